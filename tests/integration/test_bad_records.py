"""Every reader of the log goes on past a record it cannot decode (issue 11, deliverable 1).

The reproduction: one garbage record on ``state.jobs``, ``state.machines``, ``machines`` or ``taskcontrol`` made
``job status``, ``job stop/resize/update``, ``watch``, ``machine list``, ``machine fail/recover``, ``maintenance
end``, ``up``'s demo step fail with ``no_marker: state.jobs[3]@0 ...`` and a reference controller exit with a
``DecodeError`` traceback.

The table: each reader below meets, on every topic it reads and BEFORE the good records it needs (same key, so
same partition), one record of each kind in ``BAD_KINDS``: garbage bytes, an unknown fingerprint, a truncated
body, an empty value (a Kafka tombstone: a bad record on a topic that is not compacted; on a compacted one, the
``state.*`` topics, a key deleted, which a reader takes as such and does not count), and valid Avro of an event type
that does not belong on the topic. Each reader must do its job as if they were not there, count each kind under its
reason, and (a CLI command) say so in exactly one line on stderr; a processor (a TaskController) dead-letters
each.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import drop_topics
from processors.allocator.rebuild import rebuild_index
from processors.frontend import demo as frontend
from processors.resourcebroker.processor import fold_machines
from processors.taskcontrol.controller import TaskControllerProcess, producer_name
from streams import archive as ar
from streams import serde, state
from streams.clients import EventConsumer, EventProducer
from streams.deadletter import Skipped
from streams.events import new_event
from streams.topics import Topics

ROOT = Path(__file__).resolve().parents[2]
ENT, JOB = "e1", "e1.web"

# kind -> the reason it is skipped under
BAD_KINDS = {
    "garbage bytes": serde.NO_MARKER,
    "unknown fingerprint": serde.UNKNOWN_FINGERPRINT,
    "truncated body": serde.MALFORMED,
    "empty value (tombstone)": serde.NO_MARKER,
    "valid Avro, wrong event type for the topic": serde.INVALID_EVENT,
}
EXPECTED_REASONS = Counter(BAD_KINDS.values())
TOMBSTONE = "empty value (tombstone)"
TOPICS = Topics()


def kinds_of(logical: str) -> dict[str, str]:
    """The bad kinds a reader of ``logical`` skips: all, but a tombstone on a compacted topic (a key deleted)."""
    return {k: r for k, r in BAD_KINDS.items() if not (k == TOMBSTONE and TOPICS.compacted(logical))}


def bad(*logicals: str) -> int:
    """How many records the bad sets put on ``logicals`` make a reader skip."""
    return sum(len(kinds_of(t)) for t in logicals)


def reasons(*logicals: str) -> Counter:
    return sum((Counter(kinds_of(t).values()) for t in logicals), Counter())


def stopped(job: str = JOB):
    return new_event("JobStopped", {"job_id": job, "reason": "r"}, entitlement=ENT, entity_id=job, producer="test")


def bad_values(registry, logical: str) -> dict[str, bytes | None]:
    """One value of each of ``BAD_KINDS`` for topic ``logical``."""
    good = registry.encode("JobStopped", stopped().to_record(1))
    wrong_type = "TaskControlAcked" if logical != "taskcontrol" else "JobStopped"
    wrong = registry.encode(wrong_type, new_event(wrong_type, (
        {"job_id": JOB, "sequence": 1, "approved_operation_ids": []} if wrong_type == "TaskControlAcked"
        else {"job_id": JOB, "reason": "r"}), entitlement=ENT, entity_id=JOB, producer="test").to_record(1))
    return {
        "garbage bytes": b"\x00\xffnot avro at all",
        "unknown fingerprint": serde.MARKER + b"\x5a" * 8 + good[10:],
        "truncated body": good[:-5],
        "empty value (tombstone)": None,
        "valid Avro, wrong event type for the topic": wrong,
    }


def put_bad(cfg, registry, logical: str, key: str) -> list[bytes | None]:
    """Every kind of bad record on ``logical``, keyed ``key`` (the partition the good records of that key use);
    returns the values."""
    p = EventProducer(cfg, registry, "test-bad")
    name = Topics(cfg.topic_prefix, cfg.partitions).name(logical)
    values = list(bad_values(registry, logical).values())
    for value in values:
        p.send_raw(name, key.encode(), value)
    p.flush()
    return values


def cli(cfg, *args):
    env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
           "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions),
           "ROPEWALK_RUN_DIR": str(cfg.run_dir)}
    return subprocess.run([sys.executable, "-m", "processors.frontend.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def said_once(out: subprocess.CompletedProcess, n: int) -> None:
    """The command said, in exactly one stderr line, that it skipped ``n`` records, with every kind's reason."""
    lines = [line for line in out.stderr.splitlines() if "undecodable" in line]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"ropewalk: skipped {n} undecodable records (")
    for reason in EXPECTED_REASONS:
        assert reason in lines[0], lines[0]


# --- the log a reader meets ------------------------------------------------------------------------------------

def job_state(job=JOB, state="running", machine="m1"):
    return new_event("JobStatePublished", {
        "job_id": job, "name": job.split(".", 1)[1], "state": state, "spec_version": 1, "desired_tasks": 1,
        "last_reason": "", "deleted": False,
        "tasks": [{"task_id": f"{job}/0", "state": "RUNNING", "machine_id": machine, "dc": "dc1", "msb": "msb1",
                   "rack": "r1", "spec_version": 1, "reason": ""}]},
        entitlement=job.split(".", 1)[0], entity_id=job, producer="scheduler")


def machine_state(mid="m1"):
    return new_event("MachineStatePublished", {
        "machine_id": mid, "topology": {"region": "reg", "dc": "dc1", "msb": "msb1", "rack": "r1"},
        "machine_type": "skylake", "status": "UP", "assigned_entitlement": ENT,
        "capacity": {"cpu_millicores": 4000, "memory_mib": 8192}, "free": {"cpu_millicores": 4000, "memory_mib": 8192},
        "host_profile": None, "task_ids": [], "version": 3}, entitlement=ENT, entity_id=mid, producer="allocator")


def registered(mid="m1"):
    return new_event("MachineRegistered", {
        "machine_id": mid, "topology": {"region": "reg", "dc": "dc1", "msb": "msb1", "rack": "r1"},
        "machine_type": "skylake", "capacity": {"cpu_millicores": 4000, "memory_mib": 8192}, "host_profile": None},
        entitlement="free/dc1", entity_id=mid, producer="test")


@pytest.fixture
def jobs_log(cfg, registry):
    """state.jobs and state.tasks: every bad kind, then the job's state."""
    put_bad(cfg, registry, "state.jobs", JOB)
    put_bad(cfg, registry, "state.tasks", f"{JOB}#0")
    p = EventProducer(cfg, registry, "test")
    p.send(job_state())
    p.flush()


@pytest.fixture
def machines_log(cfg, registry):
    """machines and state.machines: every bad kind, then machine m1 (registered; its published state)."""
    put_bad(cfg, registry, "machines", "free/dc1")
    put_bad(cfg, registry, "state.machines", "m1")
    p = EventProducer(cfg, registry, "test")
    p.send(registered("m1"))
    p.send(machine_state("m1"))
    p.flush()


# --- CLI readers -----------------------------------------------------------------------------------------------

JOB_COMMANDS = {  # command -> (its arguments, what it says on stdout when it worked)
    "job status": (("job", "status", JOB, "--json"), lambda out: json.loads(out)["tasks"][0]["machine"] == "m1"),
    "job resize": (("job", "resize", JOB, "3"), lambda out: "3 tasks" in out),
    "job stop": (("job", "stop", JOB), lambda out: "stopping" in out),
    "job update": (("job", "update", JOB, "{spec}"), lambda out: "v2" in out),
    "watch jobs --once": (("watch", "jobs", "--once", "--json"), lambda out: json.loads(out)["job"] == JOB),
}


@pytest.mark.parametrize("command", JOB_COMMANDS)
def test_job_commands_skip_what_they_cannot_decode(cfg, jobs_log, tmp_path, command):
    spec = tmp_path / "web.yaml"
    spec.write_text(f"name: web\nentitlement: {ENT}\ntasks: 1\ncommand: [sleep, '60']\n"
                    "resources: {cpu_millicores: 500, memory_mib: 256}\n")
    args, worked = JOB_COMMANDS[command]
    out = cli(cfg, *(a.format(spec=spec) for a in args))
    assert out.returncode == 0, out.stderr
    assert worked(out.stdout), out.stdout
    said_once(out, bad("state.jobs", "state.tasks"))


def test_an_error_says_what_was_skipped_on_its_one_line(cfg, registry):
    """A job whose only state records are unreadable is unknown, and the one line of the error says why it may be."""
    put_bad(cfg, registry, "state.jobs", JOB)
    out = cli(cfg, "job", "status", JOB)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"ropewalk: unknown job '{JOB}'")
    assert f"(skipped {bad('state.jobs')} undecodable records (" in out.stderr


MACHINE_COMMANDS = {  # command -> (its arguments, what it says when it worked, the topic it reads)
    "machine list": (("machine", "list", "--json"), lambda out: [m["id"] for m in json.loads(out)] == ["m1"],
                     "state.machines"),
    "watch machines --once": (("watch", "machines", "--once", "--json"), lambda out: json.loads(out)["id"] == "m1",
                              "state.machines"),
    "machine fail": (("machine", "fail", "m1"), lambda out: "m1 failed" in out, "machines"),
}


@pytest.mark.parametrize("command", MACHINE_COMMANDS)
def test_machine_commands_skip_what_they_cannot_decode(cfg, machines_log, command):
    args, worked, topic = MACHINE_COMMANDS[command]
    out = cli(cfg, *args)
    assert out.returncode == 0, out.stderr
    assert worked(out.stdout), out.stdout
    said_once(out, bad(topic))


def test_machine_recover_and_maintenance_skip_what_they_cannot_decode(cfg, registry, machines_log):
    assert cli(cfg, "machine", "fail", "m1").returncode == 0
    put_bad(cfg, registry, "machines", "free/dc1")  # after the failure too: the fold meets both sets
    out = cli(cfg, "machine", "recover", "m1")
    assert out.returncode == 0 and "m1 recovered" in out.stdout, out.stderr
    said_once(out, 2 * len(BAD_KINDS))

    put_bad(cfg, registry, "unavailability", "free/dc1")
    plan = cli(cfg, "maintenance", "plan", "--machines", "m1", "--start", "+1h", "--duration", "10m", "--json")
    assert plan.returncode == 0, plan.stderr
    said_once(plan, 2 * len(BAD_KINDS))  # machines
    ue = json.loads(plan.stdout)["unavailability_id"]
    end = cli(cfg, "maintenance", "end", ue, "--json")
    assert end.returncode == 0 and json.loads(end.stdout)["machines"] == ["m1"], end.stderr
    said_once(end, 3 * len(BAD_KINDS))  # unavailability, then machines


def test_replay_skips_what_it_cannot_decode(cfg, registry, jobs_log):
    put_bad(cfg, registry, "intents", ENT)
    p = EventProducer(cfg, registry, "test")
    p.send(stopped())
    p.flush()
    out = cli(cfg, "replay", "--json")
    assert out.returncode == 0, out.stderr
    types = [json.loads(line)["type"] for line in out.stdout.splitlines()]
    assert sorted(types) == ["JobStatePublished", "JobStopped"]
    said_once(out, bad("state.jobs", "state.tasks", "intents"))


def test_up_demo_step_skips_what_it_cannot_decode(cfg, registry):
    """``up``'s demo step (``_start_demo``) reads state.jobs for demo.hello: bad records before its state."""
    put_bad(cfg, registry, "state.jobs", "demo.hello")
    p = EventProducer(cfg, registry, "test")
    p.send(job_state("demo.hello", machine="local-msb1-r01-m001"))
    p.flush()
    skipped = Skipped()
    demo = frontend._start_demo(cfg, skipped)
    assert demo["running"] and demo["job"] == "demo.hello"
    assert skipped.by_reason == reasons("state.jobs", "state.jobs")  # read twice: is it there, is it running


# --- library readers -------------------------------------------------------------------------------------------

def test_state_readers_skip_what_they_cannot_decode(cfg, registry, jobs_log, machines_log):
    skipped = Skipped()
    assert list(state.current(cfg, registry, "jobs", skipped=skipped)) == [JOB]
    assert skipped.by_reason == reasons("state.jobs", "state.tasks")
    skipped = Skipped()
    assert list(state.current(cfg, registry, "machines", skipped=skipped)) == ["m1"]
    assert skipped.by_reason == reasons("state.machines")
    assert skipped.report().startswith(f"skipped {bad('state.machines')} undecodable records (")


def test_fold_machines_skips_what_it_cannot_decode(cfg, registry, machines_log):
    skipped = Skipped()
    assert fold_machines(cfg, registry, skipped=skipped).get("m1") is not None
    assert skipped.by_reason == EXPECTED_REASONS


def test_rebuild_skips_what_it_cannot_decode(cfg, registry, machines_log):
    for logical in ("intents", "allocations"):
        put_bad(cfg, registry, logical, ENT)
    st = rebuild_index(cfg, registry)
    assert st["skipped"] == 3 * len(BAD_KINDS) and st["machines"] == 1


def test_archive_and_restore_keep_what_nobody_can_decode(cfg, registry, tmp_path):
    """The archive stores values raw: bad records survive a round trip byte for byte (a later reader skips them)."""
    bad = put_bad(cfg, registry, "taskcontrol", ENT)
    st = ar.archive(cfg, tmp_path / "archive")
    assert st.records >= len(BAD_KINDS)
    target = cfg.with_(topic_prefix=cfg.topic_prefix + "restored.")
    try:
        ar.restore(target, tmp_path / "archive")
        c = EventConsumer(target, registry, [Topics(target.topic_prefix).name("taskcontrol")], name="test")
        raw = []
        deadline = time.monotonic() + 20
        while len(raw) < len(BAD_KINDS) and time.monotonic() < deadline:
            raw += c._consumer.consume(100, 0.3)
        c.close()
        values = [m.value() for m in raw if m.error() is None]
        assert sorted(values, key=lambda v: v or b"") == sorted(bad, key=lambda v: v or b"")
    finally:
        drop_topics(target)


def test_a_task_controller_dead_letters_what_it_cannot_decode_and_answers(cfg, registry):
    """The reference controllers' library: bad records on taskcontrol before a request; it answers the request
    and dead-letters each bad record with its reason."""
    put_bad(cfg, registry, "taskcontrol", ENT)
    p = EventProducer(cfg, registry, "scheduler")
    p.send(new_event("TaskControlRequested", {
        "job_id": JOB, "controller": "web", "sequence": 1,
        "pending_operations": [{"operation_id": "op1", "task_id": f"{JOB}/0", "kind": "UPDATE", "reason": "r"}],
        "completed_operation_ids": [], "advance_notices": [], "unhealthy_task_ids": []},
        entitlement=ENT, entity_id=JOB, producer="scheduler"))
    p.flush()
    ctl = TaskControllerProcess(cfg, "web", lambda request, view: [o.operation_id for o in request.pending],
                                registry=registry)
    try:
        deadline = time.monotonic() + 30
        while ctl.answered == 0 and time.monotonic() < deadline:
            ctl.step()
        assert ctl.answered == 1
        assert ctl.consumer.skipped.by_reason == EXPECTED_REASONS
    finally:
        ctl.producer.flush()
        ctl.consumer.close()
    d = EventConsumer(cfg, registry, [Topics(cfg.topic_prefix, cfg.partitions).name("deadletter")], name="test")
    dead = []
    deadline = time.monotonic() + 20
    while len(dead) < len(BAD_KINDS) and time.monotonic() < deadline:
        dead += d.poll(100, 0.3)
    d.close()
    assert Counter(r.event.payload["reason"] for r in dead) == EXPECTED_REASONS
    assert {r.event.payload["consumer"] for r in dead} == {producer_name("web")}


def test_history_readers_skip_what_they_cannot_decode(cfg, registry, machines_log):
    """The history's merged reader (machine list --at, at, shadow, history snapshot): bad records on the topics it
    folds, before the records it needs; each said once, also by a shadow that reads the log twice."""
    put_bad(cfg, registry, "allocations", ENT)
    now = str(int(time.time() * 1000) + 1000)
    listed = cli(cfg, "machine", "list", "--at", now, "--json")
    assert listed.returncode == 0 and [m["id"] for m in json.loads(listed.stdout)] == ["m1"], listed.stderr
    said_once(listed, 2 * len(BAD_KINDS))  # machines, allocations
    for args in (("at", now, "--json"), ("shadow", "--since", "0", "--json"), ("history", "snapshot", "--json")):
        out = cli(cfg, *args)
        assert out.returncode == 0, (args, out.stderr)
        json.loads(out.stdout)
        said_once(out, 2 * len(BAD_KINDS))
