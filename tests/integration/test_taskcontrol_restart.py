"""A TaskController process SIGKILLed and restarted mid-release, on the real broker, with a real scheduler shard
worker (``python -m processors.scheduler.shard``) and real controller processes (``python -m
processors.taskcontrol.controllers leader-last``); the test plays the front end, the allocator and the agents.

A 5-task ensemble (leader ``/2``, max-down 1) is rolled to spec version 2 across three controller lifetimes:

* lifetime A is killed right after its second approving ack reaches the log (before the agents react to it);
  it stays dead until the scheduler has sent a request A never saw answered, which lifetime B must answer;
* lifetime B is killed right after it approves the last follower, and C is started at once, while that
  operation is still in flight (C must rebuild its books from the log, then approve the leader alone, last).

Read back from the log (every record, redeliveries and same-id repeats included): every operation approved in
exactly one TaskControlAcked record, each request sequence acked at most once and never stale, each update
performed (STOP rolling_update) exactly once and only after its ack, the followers one at a time, the leader
last, every task RUNNING at version 2; and each lifetime approved something (the kills really were mid-release).
"""
from __future__ import annotations

import time
from collections import Counter

import pytest

from processors.scheduler.decide import PRODUCER
from streams import batches
from streams.clients import EventProducer
from taskcontrollers import Controller, settle
from test_scheduler_shard import Hands, entitlement, ev, workers  # noqa: F401 - workers is a fixture
from test_taskcontrol_leader_last import ENT, JOB, Reader, run_until, update_stops

N, LEADER = 5, f"{JOB}/2"
FOLLOWERS = [f"{JOB}/{i}" for i in (0, 1, 3, 4)]  # the order the controller approves them in


def spec(version):
    return {"job_id": JOB, "name": "zk", "spec_version": version, "tasks": N, "command": ["sleep", str(version)],
            "resources": {"cpu_millicores": 100, "memory_mib": 64}, "requirements": {}, "spread": "msb",
            "max_unavailable": 1, "env": {}, "controller": "zk"}


class RawReader(Reader):
    """``Reader`` (first copy of each event id, in log order) plus every TaskControlAcked and TaskCommanded
    *record* as read, so that an ack or a command written twice under one event id is still counted twice."""

    def __init__(self, cfg, registry):
        super().__init__(cfg, registry)
        self.raw = []

    def poll(self):
        new = []
        for rec in self.consumer.poll(2000, 0.2):
            if rec.event.type in ("TaskControlAcked", "TaskCommanded", "TasksCommanded"):
                self.raw.append(rec)
            if rec.event.event_id not in self.seen:
                self.seen.add(rec.event.event_id)
                self.events.append(rec.event)
                new.append(rec.event)
        return new

    def approving_acks(self):
        return [e for e in self.events if e.type == "TaskControlAcked" and e.payload["approved_operation_ids"]]


class Controllers:
    """Leader-last controller processes named ``zk``, one at a time, each its own lifetime."""

    def __init__(self, cfg, tmp_path):
        self.cfg, self.tmp_path = cfg, tmp_path
        self.procs: list[Controller] = []
        self.windows: list[list[float]] = []  # [started, killed] wall-clock ms per lifetime

    @property
    def logs(self):
        return [c.log_path for c in self.procs]

    def start(self) -> None:
        n = len(self.procs)
        self.windows.append([time.time() * 1000, float("inf")])
        self.procs.append(Controller(self.cfg, self.tmp_path / f"controller-{n}", self.tmp_path / f"controller-{n}.log",
                                     "leader-last", "--leader", f"{JOB}={LEADER}", name="zk"))

    def kill(self) -> None:
        assert self.procs[-1].alive(), f"controller {len(self.procs) - 1} died on its own:\n{self.tail(-1)}"
        self.procs[-1].kill()
        self.windows[-1][1] = time.time() * 1000

    def lifetime(self, ts_ms: int) -> int | None:
        for i, (start, end) in enumerate(self.windows):
            if start <= ts_ms <= end:
                return i
        return None

    def tail(self, i: int) -> str:
        return self.procs[i].log_path.read_text(errors="replace")[-3000:]

    def stop_all(self) -> None:
        for c in self.procs:
            c.kill()


@pytest.fixture
def controllers(cfg, tmp_path):
    c = Controllers(cfg, tmp_path)
    yield c
    c.stop_all()


def drive_until_ack(reader, hands, n_approving, timeout_s, procs):
    """Let the world run until the ``n_approving``-th approving ack is read; return before the agents react to
    the events of the batch that brought it (the approved operation is then still to be performed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{open(p, errors='replace').read()[-3000:]}" for p in procs)
            raise AssertionError(f"timed out waiting for approving ack {n_approving}; job: {reader.job()}\n{tails}")
        new = [e for e in reader.poll() if e.producer == PRODUCER or e.type == "TaskControlAcked"]
        if len(reader.approving_acks()) >= n_approving:
            return new
        hands.react([e for e in new if e.producer == PRODUCER])


@pytest.mark.timeout(240)
def test_a_controller_killed_and_restarted_mid_release(cfg, registry, workers, controllers):  # noqa: F811
    w = workers("shard")
    reader, producer = RawReader(cfg, registry), EventProducer(cfg, registry, "test")
    hands = Hands(producer)
    procs = lambda: [w.log_path, *controllers.logs]  # noqa: E731
    try:
        controllers.start()
        producer.send(entitlement(ENT))
        producer.send(ev("JobSubmitted", spec(1), ent=ENT, entity=JOB, producer="cli"))
        producer.flush()
        run_until(reader, hands, lambda: (reader.job() or {}).get("state") == "running", 60, "the job running",
                  procs())
        producer.send(ev("JobSpecChanged", spec(2), ent=ENT, entity=JOB, producer="cli"))
        producer.flush()

        # lifetime A: killed as soon as its 2nd approval is in the log, before that operation is performed
        held = drive_until_ack(reader, hands, 2, 60, procs())
        controllers.kill()
        hands.react([e for e in held if e.producer == PRODUCER])
        acked_seq = max(e.payload["sequence"] for e in reader.events if e.type == "TaskControlAcked")
        # the operation completes meanwhile and the scheduler asks again: nobody answers
        run_until(reader, hands, lambda: any(e.type == "TaskControlRequested" and e.payload["sequence"] > acked_seq
                                             for e in reader.events), 30, "a request after the kill", procs())
        settle(cfg, reader, lambda: hands.react([e for e in reader.poll() if e.producer == PRODUCER]),
               controllers.procs)  # the marker: a live controller would have answered by then
        assert max(e.payload["sequence"] for e in reader.events if e.type == "TaskControlAcked") == acked_seq

        # lifetime B answers it (and what follows) until it approved the last follower; killed, C started at once
        controllers.start()
        held = drive_until_ack(reader, hands, len(FOLLOWERS), 60, procs())
        controllers.kill()
        controllers.start()
        hands.react([e for e in held if e.producer == PRODUCER])

        run_until(reader, hands, lambda: (j := reader.job()) is not None and j["state"] == "running"
                  and {t["spec_version"] for t in j["tasks"]} == {2}, 90, "the update done", procs())
        # the marker: everything a controller or the scheduler would (wrongly) still add is in the log by then
        settle(cfg, reader, lambda: hands.react([e for e in reader.poll() if e.producer == PRODUCER]),
               controllers.procs)
    finally:
        reader.consumer.close()

    log = reader.events
    requests = [e for e in log if e.type == "TaskControlRequested"]
    op_task = {o["operation_id"]: o["task_id"] for r in requests for o in r.payload["pending_operations"]}
    assert sorted(op_task.values()) == sorted(FOLLOWERS + [LEADER]), "one UPDATE per task, ids stable across asks"
    first = requests[0].payload["sequence"]  # an incarnation counts from its submission's time (first_sequence)
    assert [r.payload["sequence"] - first for r in requests] == list(range(len(requests)))

    # every ack record, across the three lifetimes: each sequence answered at most once, each operation approved
    # in exactly one ack, and each ack answering the job's latest request at the time (none stale)
    ack_records = [r.event for r in reader.raw if r.event.type == "TaskControlAcked"]
    assert all(a.producer == "taskcontroller/zk" for a in ack_records)
    twice = {s: n for s, n in Counter(a.payload["sequence"] for a in ack_records).items() if n > 1}
    assert not twice, f"sequences acked more than once: {twice}"
    approvals = Counter(op for a in ack_records for op in a.payload["approved_operation_ids"])
    assert set(approvals) == set(op_task), "every operation approved, nothing else"
    assert set(approvals.values()) == {1}, f"operations approved more than once: {approvals}"
    latest = 0
    for e in log:  # one entitlement: one partition of taskcontrol, so this is log order
        if e.type == "TaskControlRequested":
            latest = e.payload["sequence"]
        elif e.type == "TaskControlAcked":
            assert e.payload["sequence"] == latest, f"ack {e.payload['sequence']} does not answer request {latest}"

    # the kills were mid-release: every lifetime approved something, A exactly two followers, C the leader
    by_life: dict[int, list[str]] = {}
    for a in ack_records:
        life = controllers.lifetime(a.timestamp_ms)
        assert life is not None, f"an ack stamped {a.timestamp_ms} outside every controller lifetime"
        by_life.setdefault(life, []).extend(op_task[o] for o in a.payload["approved_operation_ids"])
    assert by_life.get(0) == FOLLOWERS[:2], by_life
    assert by_life.get(1) == FOLLOWERS[2:], by_life
    assert by_life.get(2) == [LEADER], by_life

    # the scheduler performed each operation exactly once (STOP records, same-id repeats counted), after its ack,
    # followers one at a time, the leader last
    stop_records = Counter(c["task_id"] for r in reader.raw for c in batches.task_commands(r.event)
                           if c["command"] == "STOP" and c["reason"] == "rolling_update")
    assert stop_records == Counter({t: 1 for t in FOLLOWERS + [LEADER]}), stop_records
    stops = update_stops(log, op_task)
    assert stops == FOLLOWERS + [LEADER]
    assert not [s["last_ignored"] for s in (e.payload for e in log if e.type == "JobStatePublished")
                if s.get("last_ignored", "").startswith(("duplicate_ack", "stale_ack", "unknown_sequence"))]

    job = reader.job()
    assert job["state"] == "running" and len(job["tasks"]) == N
    assert all(t["state"] == "RUNNING" and t["spec_version"] == 2 for t in job["tasks"]), job["tasks"]
    assert requests[-1].payload["pending_operations"] == []
    assert op_task[requests[-1].payload["completed_operation_ids"][-1]] == LEADER
