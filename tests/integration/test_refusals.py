"""Refusals are events, a stopped job's name can be used again, and absurd quantities are refused at the door
(issue 11, deliverable 5), on the real broker with a real scheduler shard worker and the real CLI; the test plays
the allocator and the agents (``Hands``, answering free requests too).

The reproductions: a resubmission with a different spec was refused with nothing shown (the scheduler's refusals
were written quietly); a stopped job's name could never be used again (``job submit`` exited 0, ``job status`` said
unknown job); ``produce intents EntitlementCreated`` accepted ``quota_machines: -5``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from processors.scheduler.decide import PRODUCER
from streams.clients import EventConsumer, EventProducer
from streams.topics import Topics
from test_scheduler_shard import ROOT, Hands, ev, workers  # noqa: F401 - workers is a fixture

ENT, JOB = "e1", "e1.web"


def cli(cfg, *args, stdin=None):
    env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
           "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions)}
    return subprocess.run([sys.executable, "-m", "processors.frontend.cli", *args], env=env, cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=120)


def ok(cfg, *args, stdin=None) -> str:
    out = cli(cfg, *args, stdin=stdin)
    assert out.returncode == 0, f"ropewalk {' '.join(args)}: {out.stderr}"
    return out.stdout


class Freeing(Hands):
    """``Hands`` that also answer a free-only request (a stopped job's last) with TasksDeallocated, and can hold
    back the agents' answers to STOP commands."""

    hold_stops = False

    def __init__(self, producer):
        super().__init__(producer)
        self.held = []  # commands not answered while stops are held back

    def release(self) -> None:
        self.hold_stops, held, self.held = False, self.held, []
        self.react(held)

    def react(self, events) -> None:
        for e in events:
            p = e.payload
            if e.type == "AllocationRequested" and not p["place_task_ids"] and p["free_task_ids"]:
                self.producer.send(ev("TasksDeallocated", {
                    "request_id": p["request_id"], "job_id": p["job_id"], "placements": [
                        {"task_id": t, "machine_id": self.placements[t][-1], "dc": "dc1", "msb": "msb1", "rack": "r1"}
                        for t in p["free_task_ids"]], "machines_released": []},
                    ent=e.entitlement, entity=p["request_id"], producer="allocator"))
        if self.hold_stops:
            self.held += [e for e in events if e.type in ("TaskCommanded", "TasksCommanded")]
            events = [e for e in events if e.type not in ("TaskCommanded", "TasksCommanded")]
        super().react(events)


class Scheduled:
    """The scheduler's output on intents, allocations, tasks and state.jobs, read back; ``hands`` react to it."""

    def __init__(self, cfg, registry, hands: Freeing):
        t = Topics(cfg.topic_prefix, cfg.partitions)
        self.consumer = EventConsumer(cfg, registry, [t.name(n) for n in ("intents", "allocations", "tasks",
                                                                          "state.jobs")], name="test-reader")
        self.hands = hands
        self.events = []

    def until(self, done, what: str, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {[e.type for e in self.events][-20:]}"
            new = [r.event for r in self.consumer.poll(1000, 0.2) if r.event.producer == PRODUCER]
            self.events += new
            self.hands.react(new)

    def refused(self, reason: str) -> list:
        return [e for e in self.events if e.type == "IntentRefused" and e.payload["reason"] == reason]

    def state(self, job=JOB):
        states = [e.payload for e in self.events if e.type == "JobStatePublished" and e.payload["job_id"] == job]
        return states[-1] if states else None


def spec_file(tmp_path, name, command, cpu=500):
    f = tmp_path / name
    f.write_text(f"name: web\nentitlement: {ENT}\ntasks: 2\ncommand: [{command}, '60']\n"
                 f"resources: {{cpu_millicores: {cpu}, memory_mib: 256}}\n")
    return str(f)


@pytest.fixture
def log(cfg, registry, workers):  # noqa: F811 - workers is a fixture
    """A scheduler shard worker and its output read back (``Scheduled``); the shard must still run at the end."""
    w = workers("shard")
    scheduled = Scheduled(cfg, registry, Freeing(EventProducer(cfg, registry, "test-hands")))
    yield scheduled
    scheduled.consumer.close()
    if w.proc.poll() is not None:
        pytest.fail(f"the shard exited:\n{w.tail()}")


@pytest.mark.timeout(300)
def test_refusals_are_shown_and_a_stopped_job_name_is_used_again(cfg, log, tmp_path):
    hands = log.hands
    ok(cfg, "entitlement", "create", ENT, "--quota", "4")
    first, other = spec_file(tmp_path, "web.yaml", "sleep"), spec_file(tmp_path, "other.yaml", "cat")
    assert ok(cfg, "job", "submit", first).strip() == JOB
    log.until(lambda: (log.state() or {}).get("state") == "running", "e1.web running")

    # another spec under the same name: refused, and shown by job status, watch and replay
    ok(cfg, "job", "submit", other)
    log.until(lambda: log.refused("duplicate_job_id"), "the duplicate refused")
    status = json.loads(ok(cfg, "job", "status", JOB, "--json"))
    assert status["state"] == "running" and status["last_reason"].startswith("duplicate_job_id: job e1.web exists")
    assert "duplicate_job_id" in ok(cfg, "watch", "jobs", "--once")
    replayed = [json.loads(line) for line in ok(cfg, "replay", "--job", JOB, "--json").splitlines()]
    refusals = [r for r in replayed if r["type"] == "IntentRefused"]
    assert [(r["topic"], r["payload"]["intent_type"], r["payload"]["reason"]) for r in refusals] == [
        ("intents", "JobSubmitted", "duplicate_job_id")]
    assert "refused=JobSubmitted" in ok(cfg, "replay", "--job", JOB)  # the text line says so too

    # a resize of a stopping job: refused, shown
    hands.hold_stops = True
    ok(cfg, "job", "stop", JOB)
    log.until(lambda: (log.state() or {}).get("state") == "stopping", "e1.web stopping")
    ok(cfg, "job", "resize", JOB, "5")
    log.until(lambda: log.refused("job_not_active"), "the resize refused")
    assert json.loads(ok(cfg, "job", "status", JOB, "--json"))["last_reason"].startswith("job_not_active: ")
    hands.release()
    log.until(lambda: (log.state() or {}).get("deleted"), "e1.web stopped and freed")
    gone = cli(cfg, "job", "status", JOB)  # its last state, not "unknown job" (issue 30)
    assert gone.returncode == 0 and gone.stdout.startswith(f"job {JOB} was stopped and is gone since "), gone.stdout
    again = cli(cfg, "job", "resize", JOB, "2")
    assert again.returncode == 1 and "was stopped and is gone since" in again.stderr

    # the name again: a new incarnation, visible in job status and replay
    assert ok(cfg, "job", "submit", other).strip() == JOB
    log.until(lambda: (log.state() or {}).get("state") == "running" and log.state()["incarnation"] == 2,
              "incarnation 2 running")
    status = json.loads(ok(cfg, "job", "status", JOB, "--json"))
    assert (status["incarnation"], status["state"], len(status["tasks"])) == (2, "running", 2)
    assert "(incarnation 2)" in ok(cfg, "job", "status", JOB)
    replayed = [json.loads(line) for line in ok(cfg, "replay", "--job", JOB, "--json").splitlines()]
    assert [r["payload"]["command"][0] for r in replayed if r["type"] == "JobSubmitted"] == ["sleep", "cat", "cat"]
    assert {r["payload"].get("incarnation") for r in replayed if r["type"] == "JobStatePublished"} == {1, 2}

    # an intent for a job that does not exist, reaching the log anyway: refused with a reason
    ok(cfg, "produce", "intents", "JobResized", "-", "--entitlement", ENT,
       stdin=json.dumps({"job_id": "e1.nope", "tasks": 3}))
    log.until(lambda: log.refused("unknown_job"), "the unknown job's resize refused")
    assert log.refused("unknown_job")[0].payload["job_id"] == "e1.nope"


@pytest.mark.timeout(180)
def test_absurd_quantities_are_refused_at_the_door_and_by_the_scheduler(cfg, registry, log, tmp_path):
    # at the door: one line naming the field, nothing produced
    out = cli(cfg, "produce", "intents", "EntitlementCreated", "-", "--entitlement", "e7",
              stdin=json.dumps({"name": "e7", "quota_machines": -5}))
    assert out.returncode == 1 and out.stderr.strip() == (
        "ropewalk: EntitlementCreated.quota_machines: expected an integer from 0 to 1,000,000, got number -5")
    out = cli(cfg, "entitlement", "create", "e7", "--quota", "-5")
    assert out.returncode == 1 and out.stderr.startswith("ropewalk: --quota: expected an integer from 0")
    out = cli(cfg, "job", "submit", spec_file(tmp_path, "neg.yaml", "sleep", cpu=-5))
    assert out.returncode == 1 and "resources.cpu_millicores: expected a positive integer" in out.stderr
    out = cli(cfg, "job", "resize", JOB, "-3")
    assert out.returncode == 1 and out.stderr.startswith("ropewalk: N: expected an integer from 0")

    # the same records reaching the log anyway (another writer): refused by the scheduler, not applied
    p = EventProducer(cfg, registry, "another-writer")
    p.send(ev("EntitlementCreated", {"name": "e7", "quota_machines": -5, "machine_type": None, "dc_pin": None,
                                     "host_profile": None}, ent="e7", entity="e7", producer="another-writer"))
    p.flush()
    log.until(lambda: log.refused("invalid_entitlement"), "the negative quota refused")
    refused = log.refused("invalid_entitlement")[0]
    assert refused.entitlement == "e7" and refused.payload["message"].startswith("quota_machines: ")
    p.send(ev("JobSubmitted", {"job_id": "e7.web", "name": "web", "spec_version": 1, "tasks": 1,
                               "command": ["sleep", "1"], "resources": {"cpu_millicores": 100, "memory_mib": 64},
                               "requirements": {}, "spread": "msb", "max_unavailable": 1, "env": {}},
              ent="e7", entity="e7.web", producer="another-writer"))
    p.send(ev("EntitlementCreated", {"name": ENT, "quota_machines": 4, "machine_type": None, "dc_pin": None,
                                     "host_profile": None}, ent=ENT, entity=ENT, producer="another-writer"))
    p.send(ev("JobSubmitted", {"job_id": JOB, "name": "web", "spec_version": 1, "tasks": 2,
                               "command": ["sleep", "1"], "resources": {"cpu_millicores": -100, "memory_mib": 64},
                               "requirements": {}, "spread": "msb", "max_unavailable": 1, "env": {}},
              ent=ENT, entity=JOB, producer="another-writer"))
    p.flush()
    log.until(lambda: log.refused("unknown_entitlement") and log.refused("invalid_spec"), "both refused")
    assert log.state("e7.web")["state"] == "rejected"  # e7 was never created: the refused record changed nothing
    bad = log.refused("invalid_spec")[0]
    assert bad.payload["message"] == ("resources.cpu_millicores: expected a positive integer up to 1,000,000, "
                                      "got number -100")
    status = json.loads(ok(cfg, "job", "status", JOB, "--json"))
    assert status["state"] == "rejected" and status["last_reason"] == f"invalid_spec: {bad.payload['message']}"
    assert not [e for e in log.events if e.type == "AllocationRequested"]  # nothing of either was applied
