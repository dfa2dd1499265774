"""Progress on long steps (issue 13): `replay`, `rebuild`, `archive` and `restore` draw their phases on stderr when it
is a terminal (a pseudo-terminal here, python's ``pty``), say at most a line per phase when it is not, and print the
same stdout either way: byte for byte where the output holds no timing, the same document but for its timings where
it does. (`bench`'s progress: test_bench_smoke.py runs it on a terminal; `up`'s lines: every region test.)"""
from __future__ import annotations

import json
import re
import sys
import time

from processes import env_of, phase_drawn as drawn, run_stopped_on_timeout
from streams.clients import EventProducer
from streams.events import new_event

from conftest import drop_topics

TIMINGS = re.compile(r"seconds|_s$|per_s$|^(started|finished|restored)_at$")
N = 1200  # records: more than a thousand (a count is drawn as 1,200/1,200), few enough for CI
PHASE_LINE = re.compile(r"^ropewalk: \[ *\d+\.\ds\] (.+) \.\.\.$")


def ropewalk(env: dict, *args: str, terminal: bool):
    out = run_stopped_on_timeout([sys.executable, "-m", "processors.frontend.cli", *args], 120, terminal=terminal,
                                 env={**env, "TERM": "xterm", "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def both(env: dict, *args: str):
    """The command with stderr a pipe, then with stderr a terminal: (piped, on the terminal)."""
    return ropewalk(env, *args, terminal=False), ropewalk(env, *args, terminal=True)


def untimed(doc):
    """A document without the figures that are timings (they differ from run to run)."""
    if isinstance(doc, dict):
        return {k: untimed(v) for k, v in doc.items() if not TIMINGS.search(k)}
    return [untimed(v) for v in doc] if isinstance(doc, list) else doc


def phases(stderr: str) -> list[str]:
    return [PHASE_LINE.match(line).group(1) for line in stderr.splitlines() if PHASE_LINE.match(line)]


def test_long_steps_show_progress_on_a_terminal_and_print_the_same_stdout(cfg, registry, tmp_path, janitor):
    p = EventProducer(cfg, registry, "test")
    now = int(time.time() * 1000)
    for i in range(N):
        p.send(new_event("EntitlementCreated", {"name": f"e{i}", "quota_machines": 1, "machine_type": None,
                                                "dc_pin": None, "host_profile": None},
                         entitlement=f"e{i % 7}", entity_id=f"e{i}", producer="test", timestamp_ms=now - N + i))
    p.flush()
    p.close()
    env = env_of(cfg, tmp_path)  # the session's broker and Redis, this test's prefix, a run directory of its own

    piped, shown = both(env, "replay", "--json")  # a read command: its stdout byte for byte
    assert piped.stdout == shown.stdout and len(piped.stdout.splitlines()) == N
    assert piped.stderr == ""  # off a terminal replay says nothing more (its summary line is the text output's)
    assert drawn(shown.stderr, "reading the log") and f"{N:,}/{N:,}" in shown.stderr, shown.stderr[-1500:]
    piped, shown = both(env, "replay")
    assert piped.stdout == shown.stdout
    assert len(piped.stderr.splitlines()) == 1 and piped.stderr.startswith(f"-- {N} events matched of ")

    piped, shown = both(env, "rebuild", "--json")
    first, second = json.loads(piped.stdout), json.loads(shown.stdout)
    # the second replaced the first's keys: every one it wrote but index:format, which a swap overwrites, not deletes
    assert second.pop("replaced") == first.pop("keys") - 1 == second.pop("keys") - 1
    first.pop("replaced")
    assert untimed(first) == untimed(second)
    steps = ["reading the log", "folding the log", "writing the index to Redis", "swapping it in"]
    assert phases(piped.stderr) == steps  # one line per phase, nothing else
    assert all(drawn(shown.stderr, s) for s in steps), shown.stderr[-1500:]

    piped = ropewalk(env, "archive", str(tmp_path / "arc1"), "--json", terminal=False)  # archives are incremental:
    shown = ropewalk(env, "archive", str(tmp_path / "arc2"), "--json", terminal=True)  # one directory each
    archived = json.loads(piped.stdout)
    assert untimed(archived) == untimed(json.loads(shown.stdout)) and archived["records"] >= N
    assert phases(piped.stderr) == ["reading the consumer groups' offsets", "archiving the log"]
    assert drawn(shown.stderr, "archiving the log") and f"{archived['records']:,}/" in shown.stderr

    # restore: into two empty prefixes of the same broker
    docs, outs = [], []
    for n, terminal in ((1, False), (2, True)):
        target = cfg.with_(topic_prefix=f"{cfg.topic_prefix}r{n}.")
        out = ropewalk({**env, "ROPEWALK_TOPIC_PREFIX": target.topic_prefix, "ROPEWALK_RUN_DIR": str(tmp_path / f"r{n}")},
                       "restore", str(tmp_path / f"arc{n}"), "--json", terminal=terminal)
        drop_topics(target, janitor)
        doc = json.loads(out.stdout)
        doc["groups"] = sorted(doc["groups"].values())  # named under each target's prefix
        docs.append(doc)
        outs.append(out)
    assert untimed(docs[0]) == untimed(docs[1]) and docs[0]["records"] == archived["records"]
    assert phases(outs[0].stderr)[:4] == ["starting the broker and Redis", "creating the topics",
                                          "republishing the archived records", "committing the consumer groups' offsets"]
    assert drawn(outs[1].stderr, "republishing the archived records"), outs[1].stderr[-1500:]
    assert f"{archived['records']:,}/{archived['records']:,}" in outs[1].stderr
