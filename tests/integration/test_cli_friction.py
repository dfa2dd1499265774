"""Issue 13's CLI friction points, each kept as a test on the real broker through the real CLI (direct to the log,
as the test session's environment says; the API path prints the same documents): header rows, task counts by
state, list/get verbs, `--version`, replay merged in time order with `--type`/`--exclude-type` and a relative
`--since`, `watch` with timestamps, a reference controller's one-line error."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from infra.config import ENDPOINT_VARS, ENDPOINTS_FILE
from infra.process import free_ports
from streams.clients import EventProducer
from streams.events import new_event
from test_cli_jobs import ROOT, cli, job_state


def entitlement(name: str, ts: int):
    return new_event("EntitlementCreated", {"name": name, "quota_machines": 2, "machine_type": None, "dc_pin": None,
                                            "host_profile": None},
                     entitlement="fx", entity_id=name, producer="test", timestamp_ms=ts)


def test_replay_is_one_timeline_with_type_filters_and_relative_since(cfg, registry):
    now = int(time.time() * 1000)
    p = EventProducer(cfg, registry, "test")
    # log order on intents: late, early; state.jobs between them in time; one an hour old
    p.send(entitlement("late", now - 1000))
    p.send(entitlement("early", now - 3000))
    p.send(new_event("JobStatePublished", job_state("fx.web", "fx", "pending", [("PENDING", None)]).payload,
                     entitlement="fx", entity_id="fx.web", producer="test", timestamp_ms=now - 2000))
    p.send(entitlement("old", now - 3_600_000))
    p.flush()

    out = cli(cfg, "replay", "--entitlement", "fx", "--json")
    assert out.returncode == 0, out.stderr
    docs = [json.loads(line) for line in out.stdout.splitlines()]
    assert [d["entity_id"] for d in docs] == ["old", "early", "fx.web", "late"]  # time order, not topic order
    assert [d["timestamp_ms"] for d in docs] == sorted(d["timestamp_ms"] for d in docs)

    recent = cli(cfg, "replay", "--entitlement", "fx", "--since", "10m", "--json")
    assert [json.loads(line)["entity_id"] for line in recent.stdout.splitlines()] == ["early", "fx.web", "late"]
    typed = cli(cfg, "replay", "--entitlement", "fx", "--since", "2h", "--type", "JobStatePublished", "--json")
    assert [json.loads(line)["type"] for line in typed.stdout.splitlines()] == ["JobStatePublished"]
    excluded = cli(cfg, "replay", "--entitlement", "fx", "--exclude-type", "JobStatePublished", "--json")
    assert [json.loads(line)["entity_id"] for line in excluded.stdout.splitlines()] == ["old", "early", "late"]
    text = cli(cfg, "replay", "--entitlement", "fx")
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ", text.stdout)  # human times, not epoch ms
    bad = cli(cfg, "replay", "--type", "NoSuchEvent")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "NoSuchEvent" in bad.stderr
    bad = cli(cfg, "replay", "--since", "ten minutes")
    assert bad.returncode == 1 and "10m" in bad.stderr


def test_tables_have_header_rows_and_count_tasks_by_state(cfg, registry):
    assert cli(cfg, "entitlement", "create", "e1", "--quota", "4").returncode == 0
    p = EventProducer(cfg, registry, "test")
    p.send(job_state("e1.web", "e1", "running", [("RUNNING", "m1")] * 4 + [("PENDING", None)] * 2))
    p.flush()

    status = cli(cfg, "job", "status", "e1.web")
    assert status.returncode == 0, status.stderr
    assert "tasks: 4 running, 2 pending of 6 desired" in status.stdout.splitlines()[0]
    assert status.stdout.splitlines()[1].split() == ["TASK", "STATE", "MACHINE", "DC/MSB/RACK", "REASON"]
    jobs = cli(cfg, "job", "list").stdout.splitlines()
    assert jobs[0].split()[:3] == ["JOB", "STATE", "RUNNING"] and jobs[1].split()[:3] == ["e1.web", "running", "4/6"]
    ents = cli(cfg, "entitlement", "list").stdout.splitlines()
    assert ents[0].split()[:2] == ["ENTITLEMENT", "QUOTA"] and ents[1].split()[:2] == ["e1", "4"]
    got = cli(cfg, "entitlement", "get", "e1", "--json")
    assert json.loads(got.stdout)["quota_machines"] == 4
    missing = cli(cfg, "entitlement", "get", "e9")
    assert missing.returncode == 1 and missing.stderr.startswith("ropewalk: no entitlement 'e9'")
    assert cli(cfg, "job", "status", "e1.web", "--json").stdout.startswith("{")  # --json unchanged
    watched = cli(cfg, "watch", "jobs", "--once").stdout.splitlines()
    # the time with its date and zone (UTC, as the tables); the tasks counted once (not "4/6 running 4 running ...")
    assert len(watched) == 1 and re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ  e1\.web +running +tasks: 4 running, "
                                          r"2 pending of 6 desired$", watched[0]), watched
    version = cli(cfg, "--version")
    assert version.returncode == 0 and re.fullmatch(r"ropewalk \S+\n", version.stdout)


@pytest.mark.parametrize("args, says", [
    (["replica-aware", "--name", "x", "--shards", "/nonexistent/shards.json"], "--shards /nonexistent/shards.json"),
    (["pacing", "--name", "x", "--load-file", "/nonexistent/load"], "--load-file /nonexistent/load"),
])
def test_a_reference_controller_given_a_missing_file_says_so_in_one_line(args, says):
    out = subprocess.run([sys.executable, "-m", "processors.taskcontrol.controllers", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_up_with_endpoints_remembered_from_a_region_that_is_gone_says_so_and_how_to_forget(tmp_path):
    """A new shell (no endpoint variables) whose last `up` remembered an external broker that is gone: `up` says
    the endpoints were remembered, from which file, and how to forget them; `down --forget` does."""
    broker_port, redis_port = free_ports(2)  # nothing listens on them
    remembered = {"ROPEWALK_BOOTSTRAP_SERVERS": f"127.0.0.1:{broker_port}",
                  "ROPEWALK_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
                  "ROPEWALK_SECRETS_DIR": str(tmp_path / "secrets")}
    (tmp_path / ENDPOINTS_FILE).write_text(json.dumps(remembered))
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ENDPOINT_VARS and k not in ("ROPEWALK_DIRECT", "ROPEWALK_TOKEN")}
    env["ROPEWALK_RUN_DIR"] = str(tmp_path)

    def ropewalk(*args):
        return subprocess.run([sys.executable, "-m", "processors.frontend.cli", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    up = ropewalk("up", "--machines", "0")
    assert up.returncode == 1, up.stderr
    said = up.stderr.splitlines()[-1]  # after the progress line: one line of error
    assert said.startswith("ropewalk: broker: ")
    assert f"127.0.0.1:{broker_port} does not answer" in said
    assert f"remembered from an earlier `ropewalk up` in {tmp_path / ENDPOINTS_FILE}" in said
    assert "`ropewalk down --forget`" in said and f"ROPEWALK_BOOTSTRAP_SERVERS=127.0.0.1:{broker_port}" in said

    down = ropewalk("down", "--forget")
    assert down.returncode == 0, down.stderr
    assert f"forgot the endpoints remembered in {tmp_path / ENDPOINTS_FILE}" in down.stdout
    assert not (tmp_path / ENDPOINTS_FILE).exists()
    again = ropewalk("down", "--forget", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["forgot"] is None
