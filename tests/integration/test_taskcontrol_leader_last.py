"""TaskControl on the real broker: a real scheduler shard worker (``python -m processors.scheduler.shard``) and a
real leader-last TaskController process (``python -m processors.taskcontrol.controllers leader-last``); the test
plays the front end, the allocator and the agents. A rolling update of a 3-member ensemble must, read back from
the log: stop only tasks whose operation the controller acked, update the followers one at a time, the leader
last (one leader change per release), echo every request's sequence in its ack, and finish at the new version.
"""
from __future__ import annotations

import time

import pytest

from processors.scheduler.decide import PRODUCER
from streams import batches
from streams.clients import EventConsumer, EventProducer
from streams.topics import Topics
from taskcontrollers import Controller
from test_scheduler_shard import Hands, entitlement, ev, workers  # noqa: F401 - workers is a fixture

ENT, JOB, LEADER = "e1", "e1.zk", "e1.zk/0"


def spec(version):
    return {"job_id": JOB, "name": "zk", "spec_version": version, "tasks": 3, "command": ["sleep", str(version)],
            "resources": {"cpu_millicores": 100, "memory_mib": 64}, "requirements": {}, "spread": "msb",
            "max_unavailable": 1, "env": {}, "controller": "zk"}


class Reader:
    """Every event of the topics, in log order per partition (first copy of each event id)."""

    def __init__(self, cfg, registry):
        t = Topics(cfg.topic_prefix, cfg.partitions)
        self.consumer = EventConsumer(cfg, registry, [t.name(n) for n in ("allocations", "tasks", "taskcontrol",
                                                                           "state.jobs")], name="test-reader")
        self.events, self.seen = [], set()

    def poll(self):
        new = []
        for rec in self.consumer.poll(2000, 0.2):
            if rec.event.event_id not in self.seen:
                self.seen.add(rec.event.event_id)
                self.events.append(rec.event)
                new.append(rec.event)
        return new

    def job(self):
        states = [e.payload for e in self.events if e.type == "JobStatePublished" and e.payload["job_id"] == JOB]
        return states[-1] if states else None


def run_until(reader, hands, done, timeout_s, what, procs):
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{open(p, errors='replace').read()[-3000:]}" for p in procs)
            raise AssertionError(f"timed out waiting for {what}; job: {reader.job()}\n{tails}")
        hands.react([e for e in reader.poll() if e.producer == PRODUCER])


@pytest.fixture
def controller(cfg, tmp_path):
    c = Controller(cfg, tmp_path / "controller", tmp_path / "controller.log", "leader-last",
                   "--leader", f"{JOB}={LEADER}", name="zk")
    yield c.log_path
    c.kill()


@pytest.mark.timeout(180)
def test_leader_last_rolling_update_from_the_log(cfg, registry, workers, controller):  # noqa: F811
    w = workers("shard")
    reader, producer = Reader(cfg, registry), EventProducer(cfg, registry, "test")
    hands = Hands(producer)
    procs = [w.log_path, controller]
    try:
        producer.send(entitlement(ENT))
        producer.send(ev("JobSubmitted", spec(1), ent=ENT, entity=JOB, producer="cli"))
        producer.flush()
        run_until(reader, hands, lambda: (reader.job() or {}).get("state") == "running", 60, "the job running",
                  procs)
        producer.send(ev("JobSpecChanged", spec(2), ent=ENT, entity=JOB, producer="cli"))
        producer.flush()
        run_until(reader, hands, lambda: (j := reader.job()) is not None and j["state"] == "running"
                  and {t["spec_version"] for t in j["tasks"]} == {2}, 90, "the update done", procs)
    finally:
        reader.consumer.close()

    log = reader.events
    requests = [e.payload for e in log if e.type == "TaskControlRequested"]
    acks = [e.payload for e in log if e.type == "TaskControlAcked"]
    first = requests[0]["sequence"]  # an incarnation counts from its submission's time (model.first_sequence)
    assert [r["sequence"] - first for r in requests] == list(range(len(requests)))
    assert {a["sequence"] for a in acks} <= {r["sequence"] for r in requests}
    approved = {op for a in acks for op in a["approved_operation_ids"]}
    op_task = {o["operation_id"]: o["task_id"] for r in requests for o in r["pending_operations"]}

    # every update stop was acked before it happened, one at a time, the leader last
    stops = update_stops(log, op_task)
    assert sorted(stops) == [f"{JOB}/0", f"{JOB}/1", f"{JOB}/2"] and stops[-1] == LEADER
    assert {op_task[o] for o in approved} == set(stops)
    # the last request reports the leader's update completed and asks nothing more
    assert requests[-1]["pending_operations"] == [] and op_task[requests[-1]["completed_operation_ids"][-1]] == LEADER


def update_stops(log, op_task) -> list[str]:
    """The tasks the rolling update stopped, in log order; asserts each was acked first and that each stop
    waited until the task stopped before was RUNNING at version 2 again (one at a time).

    In causal order, not read order: acks (``taskcontrol``), commands and reports (``tasks``) are two topics, and a
    reader may read a STOP before the ack it answers (it did once, at load ~60). Every writer stamps its events with
    the clock of this one machine, and a STOP is written after its ack and the report before it were read: so by
    time, and at an equal millisecond what is not a command first."""
    stops, acked_tasks, running_v2 = [], set(), set()
    for e in sorted(log, key=lambda e: (e.timestamp_ms, bool(batches.task_commands(e)))):
        if e.type == "TaskControlAcked":
            acked_tasks |= {op_task[o] for o in e.payload["approved_operation_ids"]}
        for c in batches.task_commands(e):  # the scheduler's TasksCommanded
            if c["command"] == "STOP" and c["reason"] == "rolling_update":
                t = c["task_id"]
                assert t in acked_tasks, f"{t} stopped before its operation was acked"
                assert len(stops) == len(running_v2), f"{t} stopped while {stops[-1]} was not back yet"
                stops.append(t)
        if e.producer != PRODUCER:  # an agent's TaskStatesChanged
            running_v2 |= {r["task_id"] for r in batches.task_reports(e)
                           if r["state"] == "RUNNING" and r["spec_version"] == 2}
    return stops
