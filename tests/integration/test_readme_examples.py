"""The README's examples run as written (issue 13): every command of the project README's fenced shell blocks, and
every ``ropewalk ...`` line of a package README's fenced blocks, is run in README order against a real region
(`ropewalk up` through ``regioncli.RegionCli``) from a directory laid out as the README assumes (``.run/`` the
region's run directory, ``examples/`` and ``.venv/`` of this checkout), each line as one ``bash -e -o pipefail``
command. Each must exit 0, unless the README says otherwise (a comment ``ropewalk: <error> (exit N)`` on the line or
under it: that exit code and that error line); where the README shows what a command prints, the output has that
shape (``SHAPES``). What cannot run here is listed in ``NOT_RUN`` with the reason, the few placeholders are filled in
by ``SUBSTITUTIONS`` (each with its reason), and commands that run until interrupted are run for a few seconds
(``FOLLOWERS``). A command the README gains is run like the others: it must pass, or be listed here; a listed
command the README no longer has fails the test too (the lists stay true).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from regioncli import ROOT, RegionCli

READMES = [ROOT / "README.md", *sorted(ROOT.glob("processors/*/README.md")), *sorted(ROOT.glob("bench/*/README.md"))]
SHELL = ("sh", "bash", "shell", "console")
MACHINES = 24  # the smallest generated region with the machines the examples name (dc1-msb2-r02-m001, ...)

# Commands not run, with the reason (the exact text of the README line).
NOT_RUN = {
    "make up": "the set-up itself: the test session ran it (infra/bootstrap.sh) and the test starts its region "
               "with `ropewalk up --machines 24` on free ports (the demo job too: `job logs demo.hello` reads it)",
    "make test": "the test suite this test is part of",
    "ropewalk down; rm -rf .run/kafka .run/redis; ropewalk restore archive/; ropewalk up":
        "stops the region and starts a 200-machine one (~1 min): tests/integration/test_durable.py runs this very "
        "sequence (archive, down, the broker's and Redis's data removed, restore, up) and checks status after it",
    "python -m processors.taskcontrol.controllers leader-last --name zk --leader e1.zk=e1.zk/0":
        "a TaskController process runs until stopped: test_taskcontrol_leader_last.py runs it",
    "python -m processors.taskcontrol.controllers replica-aware --name sm --shards shards.json --min-live 2":
        "a TaskController process, given the application's shards.json: bench/experiments (figure14 --pipeline) "
        "runs it",
    "python -m processors.taskcontrol.controllers pacing --name web --load-file load.txt":
        "a TaskController process, given the application's load file: test_maintenance_region.py runs it",
    "ROPEWALK_BOOTSTRAP_SERVERS=kafka1:9092,kafka2:9092 ROPEWALK_REDIS_URL=redis://cache:6379/0 ropewalk up":
        "needs a real cluster at kafka1, kafka2 and cache",
    "ropewalk bench": "about 2 minutes of a 10,000-machine region; test_bench_smoke.py runs the harness",
    "ropewalk bench --quick --json": "a minute; test_bench_smoke.py runs it at 300 machines",
    "ropewalk bench --machines 100000": "4-5 minutes",
    "ropewalk bench --machines 1000000 --keep": "an hour and more; BENCHMARKS.md",
    "ropewalk bench --schedulers 2 --allocators 2 --brokers 3": "about 4 minutes of a 10,000-machine region on 3 "
        "broker nodes (BENCHMARKS.md, 'On three broker nodes'); test_bench_smoke.py runs the harness scaled out on "
        "one node, test_killstorm.py a region on 3 nodes, tests/unit/test_bench_options.py the flag's refusals",
    "ropewalk job submit web.yaml": "processors/api/README.md's diagram: web.yaml stands for a user's spec (the "
                                    "README's is examples/web.yaml, submitted above)",
}

# Placeholders a line holds, and what the test puts there (the reason in the comment).
SUBSTITUTIONS = {
    "127.0.0.1:19092": lambda r: r.broker,  # the test's region runs on free ports, not the defaults
    "127.0.0.1:19080": lambda r: r.api,
    "ROPEWALK_TOKEN=rwt_...": lambda r: f"ROPEWALK_TOKEN={r.token}",  # the token `user add` printed above it
    "maintenance end ID": lambda r: f"maintenance end {r.maintenance}",  # the one `maintenance plan` printed
    # a position of the log is the region's own: the README's names e1.web's allocation in the region it was
    # written on; here the first record of e1.web's TasksAllocated
    "allocations/1@19": lambda r: r.position("e1.web", "TasksAllocated"),
}
# $TOKEN (curl's): the region administrator's token, .run/secrets/token.

# Commands the README says are refused in the region as it is then: (exit code, the error line's start).
REFUSED = {"ropewalk rebuild": (1, "ropewalk: an allocator is running")}  # "refused while an allocator runs"

# Commands that run until interrupted: run for this long, then SIGINT (exit 130), their output checked.
FOLLOWERS = {"ropewalk watch jobs": 4.0}

TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "
# What the README shows a command prints (its comment or the prose around it): the output's shape.
SHAPES = {
    "ropewalk status": lambda o: re.search(r"^TOPIC +PARTITIONS +RECORDS +END OFFSETS\n", o, re.M)
    and re.search(r"^state.jobs +\d+ +≤ \d+ ", o, re.M),  # "topics' records": records held, end offsets
    "ropewalk job submit examples/web.yaml": lambda o: o == "e1.web\n",  # "prints the job id: e1.web"
    "ropewalk job status e1.web": lambda o: re.match(r"job e1\.web .*tasks: .* of \d+ desired\n", o)
    and o.splitlines()[1].split() == ["TASK", "STATE", "MACHINE", "DC/MSB/RACK", "REASON"],
    "ropewalk machine list --entitlement e1": lambda o: o.split()[:3] == ["MACHINE", "STATUS", "OWNER"],
    "ropewalk watch jobs": lambda o: re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ  e1\.web +\w+ +tasks: ", o, re.M),
    "ropewalk replay --entitlement e1 --since 10m": lambda o: re.match(TIME, o),
    "ropewalk replay --job e1.web --exclude-type TaskStatesChanged": lambda o: re.match(TIME, o)
    and "TaskStatesChanged" not in o,
    "ropewalk job list ; ropewalk entitlement get e1 ; ropewalk maintenance list":
        lambda o: o.split()[:5] == ["JOB", "STATE", "RUNNING", "TASKS", "LAST-REASON"],
    "ropewalk machine list -o wide": lambda o: o.split()[:3] == ["MACHINE", "STATUS", "OWNER"],
    "ropewalk job status e1.web -o wide": lambda o: o.splitlines()[1].split()[:10] == [
        "TASK", "STATE", "VERSION", "MACHINE", "DC/MSB/RACK", "AGE", "RESTARTS", "MOVES", "PREVIOUS-MACHINE", "REASON"],
    "ropewalk job describe e1.web": lambda o: o.startswith("Job:          e1.web\n") and "\nLast refusals:\n" in o
    and "\nEvents (the last " in o,
    "ropewalk job logs demo.hello --tail 5": lambda o: 1 <= len(o.splitlines()) <= 5  # the agent's spawn line too
    and "hello from Ropewalk at " in o and all(line.startswith(("hello from Ropewalk at ", "--- ")) for line in o.splitlines()),
    "ropewalk job status e1.web | grep -m1 PENDING": lambda o: re.fullmatch(r"e1\.web/\d+ +PENDING +- +-/-/- +\S+.*\n", o),
    "infra/kafka/bin/kafka-consumer-groups --bootstrap-server 127.0.0.1:19092 --command-config "
    ".run/secrets/kafka-tools.properties --describe --all-groups":
        lambda o: all(re.search(rf"^{g} +\S+ +\d+ +\d+ +\d+ +\d+ ", o, re.M)
                      for g in ("scheduler", "ropewalk-position-health", "ropewalk-position-agent-simulated")),
    "python examples/state_jobs.py --bootstrap 127.0.0.1:19092 --config .run/secrets/kcat.conf":
        lambda o: re.search(r"^e1\.web +\w+ +\d+/200 running ", o, re.M),
    "python examples/submit_job.py --api http://127.0.0.1:19080 --entitlement e2 --name hello --tasks 2":
        lambda o: o.splitlines()[0] == "e2.hello: accepted" and len(re.findall(r"^e2\.hello/\d RUNNING on ", o, re.M)) == 2,
    "ropewalk --version": lambda o: re.fullmatch(r"ropewalk \S+\n", o),
    "ropewalk archive archive/": lambda o: re.match(r"archived \d+ records to archive/", o),
    "ropewalk user add bob --role e1=operator": lambda o: re.fullmatch(r"rwt_\S+\n", o),  # "prints its token"
    "ropewalk user add alice --role e1=owner --role e2=viewer": lambda o: re.fullmatch(r"rwt_\S+\n", o),
    "ropewalk machine list --at 2026-11-25T20:30:00Z --json": lambda o: isinstance(json.loads(o), list),
}

DIAGRAM = r"[─│┌┐└┘►▼]"  # a command at the head of a diagram (a package README's): the command is what precedes it
EXIT = re.compile(r"#\s+(ropewalk: .*?)\s+\(exit (\d+)\)\s*$")


@dataclass
class Example:
    readme: str
    line: int
    command: str  # the line as the README has it, its trailing comment removed
    exit: int = 0
    error: str | None = None  # the error line the README says it prints


def examples() -> list[Example]:
    """Every command of the READMEs' fenced blocks, in order: the project README's shell blocks and untagged lines
    starting with a command (``make``, ``ropewalk``); the package READMEs' lines starting with ``ropewalk``."""
    found: list[Example] = []
    for path in READMES:
        text, main = path.read_text(), path == ROOT / "README.md"
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            first = text[:block.start(2)].count("\n") + 1
            for i, raw in enumerate(block.group(2).splitlines()):
                line = raw.strip()
                said = EXIT.search(raw)
                if said and found and raw.lstrip().startswith("#"):  # the error the command above prints
                    found[-1].error, found[-1].exit = said.group(1), int(said.group(2))
                    continue
                if not line or line.startswith("#"):
                    continue
                shell = main and block.group(1) in SHELL
                if not (shell or re.match(r"(\w+=\S+\s+)*ropewalk\s" if not main else r"(make|ropewalk)\s", line)):
                    continue
                command = re.split(DIAGRAM, re.sub(r"\s+#.*$", "", line) if " #" in line else line)[0]
                ex = Example(str(path.relative_to(ROOT)), first + i, command.strip())
                if said:
                    ex.error, ex.exit = said.group(1), int(said.group(2))
                found.append(ex)
    return found


class Region:
    """The region the examples run against, and what they printed that later examples name."""

    def __init__(self, cli: RegionCli, cwd: Path):
        self.cli, self.cwd = cli, cwd
        self.broker = f"127.0.0.1:{cli.env['ROPEWALK_BROKER_PORT']}"
        self.api = f"127.0.0.1:{cli.env['ROPEWALK_API_PORT']}"
        self.token: str | None = None
        self.maintenance: str | None = None
        bindir = str(Path(sys.executable).parent)  # this checkout's venv: its `ropewalk` console script first
        self.env = {**cli.env, "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}

    def command(self, ex: Example) -> str:
        cmd = ex.command
        for placeholder, value in SUBSTITUTIONS.items():
            if placeholder in cmd:
                cmd = cmd.replace(placeholder, value(self))
        return cmd

    def run(self, ex: Example) -> subprocess.CompletedProcess:
        argv = ["bash", "-e", "-o", "pipefail", "-c", self.command(ex)]
        if ex.command in FOLLOWERS:
            # Ctrl-C as at a terminal: SIGINT to its process group, taken as by default even when this test runs
            # where SIGINT is ignored (a background job), which the command would inherit
            proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            time.sleep(FOLLOWERS[ex.command])
            os.killpg(proc.pid, signal.SIGINT)
            out, err = proc.communicate(timeout=30)
            return subprocess.CompletedProcess(argv, 0 if proc.returncode == 130 else proc.returncode, out, err)
        return subprocess.run(argv, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=180)

    def remember(self, ex: Example, out: str) -> None:
        if ex.command.startswith("ropewalk user add "):
            self.token = out.strip()
        if m := re.match(r"maintenance (\S+) planned", out):
            self.maintenance = m.group(1)

    def position(self, job: str, event_type: str) -> str:
        docs = [json.loads(line) for line in self.cli.ok("replay", "--job", job, "--type", event_type, "--json",
                                                         "--direct").splitlines()]
        return f"{docs[0]['topic']}/{docs[0]['partition']}@{docs[0]['offset']}"


def test_the_lists_name_only_commands_the_readmes_have():
    """Every NOT_RUN, SHAPES and FOLLOWERS entry is a command the READMEs have (no stale entry), and every
    substitution is used."""
    commands = {ex.command for ex in examples()}
    assert len(commands) > 40
    for table in (NOT_RUN, SHAPES, FOLLOWERS, REFUSED):
        assert not set(table) - commands, sorted(set(table) - commands)
    assert all(any(p in c for c in commands) for p in SUBSTITUTIONS), SUBSTITUTIONS


@pytest.mark.timeout(420)
def test_every_readme_example_runs_as_written(tmp_path):
    for name in ("examples", "infra", ".venv"):  # the checkout's, where the README's relative paths expect them
        (tmp_path / name).symlink_to(ROOT / name if name != ".venv" else Path(sys.executable).parents[1])
    cli = RegionCli(tmp_path / ".run")
    up = cli("up", "--machines", str(MACHINES), "--json")
    failed = []
    try:
        assert up.returncode == 0, up.stderr
        region = Region(cli, tmp_path)
        region.env["TOKEN"] = (tmp_path / ".run" / "secrets" / "token").read_text().strip()
        for ex in examples():
            if ex.command in NOT_RUN:
                continue
            t0 = time.monotonic()
            out = region.run(ex)
            if ex.command in REFUSED:
                ex.exit, refusal = REFUSED[ex.command]
                if not out.stderr.startswith(refusal):
                    failed.append(f"{ex.readme}:{ex.line} `{ex.command}`: the README says it is refused here "
                                  f"({refusal!r}); it printed {out.stderr.strip()!r}")
            said = f"{ex.readme}:{ex.line} `{ex.command}` ({time.monotonic() - t0:.1f}s) exit {out.returncode}"
            if out.returncode != ex.exit:
                failed.append(f"{said}, the README says {ex.exit}: {out.stderr.strip()[-500:]}")
            elif ex.error is not None and out.stderr.strip().splitlines()[-1:] != [ex.error]:
                failed.append(f"{said}: the README says it prints {ex.error!r}; it printed {out.stderr.strip()!r}")
            elif ex.command in SHAPES and not SHAPES[ex.command](out.stdout):
                failed.append(f"{said}: not the output the README shows: {out.stdout[:800]!r}")
            if out.returncode == 0:
                region.remember(ex, out.stdout)
            print(said)
    finally:
        cli("down")
    assert not failed, "\n".join(failed)
