"""Planned maintenance on the real broker (Twine §2.5): a real scheduler shard worker (``python -m
processors.scheduler.shard``, its timer every second), two real reference TaskController processes (``python -m
processors.taskcontrol.controllers``), the Ops Planner's own functions (``processors/opsplanner/planner.py``: what
``ropewalk maintenance plan|end`` call) against machines registered on the ``machines`` topic; the test plays the
allocator and the agents (``Hands``).

* ``e1.sm``, 4 tasks hosting shards, under a ``replica-aware`` controller (min live 2): maintenance of the machines
  of ``/0`` (shard a: 3 replicas) and ``/1`` (shard b: 2 replicas). The maintenance is long: ``/0`` is MOVEd
  (a keeps 2 live), ``/1`` is never chosen (b would keep 1), so the deadline stops it, held on its machine, and
  the end of the maintenance starts it again there.
* ``e1.web``, 2 tasks under a ``pacing`` controller that sits through maintenances up to 2 h: ``/0``, on a
  maintained machine, is KEPT running through the deadline and the window.

The whole story is then read back with ``streams.replay`` (the audit reader ``ropewalk replay`` uses).
"""
from __future__ import annotations

import json
import time

import pytest

from processors.opsplanner import planner as ops
from processors.opsplanner.decide import Plan
from processors.resourcebroker import decide as rb
from processors.resourcebroker.processor import fold_machines, produce
from processors.resourcebroker.region import MachineSpec
from processors.scheduler.decide import PRODUCER
from streams import batches
from streams.clients import EventProducer
from streams.replay import ReplayFilter, replay
from taskcontrollers import Controller, settle
from test_scheduler_shard import Hands, entitlement, ev, workers  # noqa: F401 - workers is a fixture
from test_taskcontrol_leader_last import Reader

ENT, SM, WEB = "e1", "e1.sm", "e1.web"
SHARDS = {f"{SM}/0": ["a"], f"{SM}/1": ["b"], f"{SM}/2": ["a", "b"], f"{SM}/3": ["a"]}  # a: 3 replicas, b: 2
DURATION_MS, DEADLINE_IN_MS = 30 * 60_000, 12_000


def spec(job, n, controller):
    return {"job_id": job, "name": job, "spec_version": 1, "tasks": n, "command": ["sleep", "3600"],
            "resources": {"cpu_millicores": 100, "memory_mib": 64}, "requirements": {}, "spread": "msb",
            "max_unavailable": 1, "env": {}, "controller": controller}


class JobReader(Reader):
    def state(self, job):
        states = [e.payload for e in self.events if e.type == "JobStatePublished" and e.payload["job_id"] == job]
        return states[-1] if states else None

    def tasks(self, job):
        s = self.state(job)
        return {t["task_id"]: (t["state"], t["machine_id"], t["reason"]) for t in s["tasks"]} if s else {}


@pytest.fixture
def controllers(cfg, tmp_path):
    (tmp_path / "shards.json").write_text(json.dumps(SHARDS))
    (tmp_path / "load").write_text("0.2")
    args = {"sm": ["replica-aware", "--shards", str(tmp_path / "shards.json"), "--min-live", "2"],
            "web": ["pacing", "--load-file", str(tmp_path / "load"), "--keep-below-s", "7200"]}
    started = [Controller(cfg, tmp_path / f"controller-{name}", tmp_path / f"controller-{name}.log", *a, name=name)
               for name, a in args.items()]
    yield started
    for c in started:
        c.kill()


def register_machines(cfg, registry, n):
    """m1..mn registered in one rack each and assigned to ``ENT`` (the Ops Planner resolves machines from this)."""
    machines = [MachineSpec(f"m{i}", "r1", "dc1", f"msb{i % 3}", f"rk{i}", "skylake", 8000, 16384)
                for i in range(1, n + 1)]
    _, events = rb.register_all(rb.BrokerState(), machines, int(time.time() * 1000))
    events += [ev("MachineAssignedToEntitlement", {"machine_id": m.id, "dc": m.dc, "reason": "test"}, ent=ENT,
                  entity=m.id, producer="allocator") for m in machines]
    produce(EventProducer(cfg, registry, "test-region"), events)


def run_until(reader, hands, done, timeout_s, what, logs):
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{open(p, errors='replace').read()[-3000:]}" for p in logs)
            raise AssertionError(f"timed out waiting for {what}; {SM}: {reader.tasks(SM)}; {WEB}: "
                                 f"{reader.tasks(WEB)}\n{tails}")
        hands.react([e for e in reader.poll() if e.producer == PRODUCER])


@pytest.mark.timeout(180)
def test_maintenance_story_on_the_broker(cfg, registry, workers, controllers):  # noqa: F811
    w = workers("shard", ROPEWALK_SCHEDULER_RETRY_S="1")
    logs = [w.log_path, *(c.log_path for c in controllers)]
    reader, producer = JobReader(cfg, registry), EventProducer(cfg, registry, "test")
    hands = Hands(producer)
    t_begin = int(time.time() * 1000)
    try:
        register_machines(cfg, registry, 12)
        producer.send(entitlement(ENT))
        producer.send(ev("JobSubmitted", spec(SM, 4, "sm"), ent=ENT, entity=SM, producer="cli"))
        producer.flush()
        run_until(reader, hands, lambda: (reader.state(SM) or {}).get("state") == "running", 60, "sm running", logs)
        producer.send(ev("JobSubmitted", spec(WEB, 2, "web"), ent=ENT, entity=WEB, producer="cli"))
        producer.flush()
        run_until(reader, hands, lambda: (reader.state(WEB) or {}).get("state") == "running", 30, "web running",
                  logs)
        assert {t: m for t, (_, m, _) in reader.tasks(SM).items()} == {f"{SM}/{i}": f"m{i + 1}" for i in range(4)}
        assert {t: m for t, (_, m, _) in reader.tasks(WEB).items()} == {f"{WEB}/0": "m5", f"{WEB}/1": "m6"}

        # ropewalk maintenance plan --machines m1,m2,m5 (what it calls): long, deadline in 12 s
        now = int(time.time() * 1000)
        deadline = now + DEADLINE_IN_MS
        (started,) = ops.plan_maintenance(cfg, registry, Plan(machines=["m1", "m2", "m5"], start_ms=deadline,
                                                              duration_ms=DURATION_MS, deadline_ms=deadline))
        ue = started.payload["unavailability_id"]
        assert started.entitlement == ENT
        # the controller's choice carried out: sm/0 moved off m1, running elsewhere, before the deadline
        run_until(reader, hands, lambda: reader.tasks(SM).get(f"{SM}/0", ("", "m1"))[:2] == ("RUNNING", "m7"),
                  DEADLINE_IN_MS / 1000, "sm/0 moved", logs)
        # the deadline stops what remains (sm/1), not what is kept (web/0)
        run_until(reader, hands, lambda: reader.tasks(SM)[f"{SM}/1"][0] == "STOPPED", 30, "the deadline", logs)
        assert reader.tasks(SM)[f"{SM}/1"] == ("STOPPED", "m2", "maintenance_deadline")
        assert reader.tasks(WEB)[f"{WEB}/0"][:2] == ("RUNNING", "m5")

        # the window opens (the Resource Broker's maintenance_started), then ropewalk maintenance end UE
        _, opened = rb.maintenance_started(fold_machines(cfg, registry), ue, ["m1", "m2", "m5"],
                                           int(time.time() * 1000))
        produce(EventProducer(cfg, registry, "resourcebroker"), opened)
        # the marker: all the scheduler and the controllers make of the opened window is in the log by then
        settle(cfg, reader, lambda: hands.react([e for e in reader.poll() if e.producer == PRODUCER]), controllers)
        assert reader.tasks(SM)[f"{SM}/1"][:2] == ("STOPPED", "m2") and reader.tasks(WEB)[f"{WEB}/0"][0] == "RUNNING"
        ended = ops.end_maintenance(cfg, registry, ue)
        assert [e.type for e in ended][-1] == "UnavailabilityEnded"
        run_until(reader, hands, lambda: reader.tasks(SM)[f"{SM}/1"][0] == "RUNNING", 30, "sm/1 restarted", logs)
        # the marker: anything else the scheduler or a controller would (wrongly) still do is in the log by then
        settle(cfg, reader, lambda: hands.react([e for e in reader.poll() if e.producer == PRODUCER]), controllers)
    finally:
        reader.consumer.close()

    # -- the story, from the replayed log -------------------------------------------------------------------
    log = [rec.event for rec in replay(cfg, registry, ReplayFilter(entitlement=ENT, since_ms=t_begin))]
    by_type = lambda t: [e for e in log if e.type == t]  # noqa: E731

    (notice,) = [e for e in by_type("UnavailabilityStarted") if e.payload["kind"] == "MAINTENANCE"]
    assert notice.payload["machine_ids"] == ["m1", "m2", "m5"] and notice.payload["deadline_ms"] == deadline

    def requests(ctl):
        return [e.payload for e in by_type("TaskControlRequested") if e.payload["controller"] == ctl]

    def choices(ctl):
        return [(c["task_id"], c["choice"]) for e in by_type("TaskControlAcked") if e.payload["controller"] == ctl
                for c in e.payload.get("maintenance_choices", [])]

    noticed = [[n["task_ids"] for n in r["advance_notices"]] for r in requests("sm") if r["advance_notices"]]
    assert noticed[0] == [[f"{SM}/0", f"{SM}/1"]], "the advance notice names both tasks on maintained machines"
    assert [[f"{SM}/1"]] in noticed[1:], "asked again once sm/0 ran elsewhere: sm/1 still awaits a choice"
    assert all(n["expected_duration_ms"] == DURATION_MS for r in requests("sm") for n in r["advance_notices"])
    assert choices("sm") == [(f"{SM}/0", "MOVE")], "replica-aware never moves sm/1 (shard b would keep 1 live)"
    assert choices("web") == [(f"{WEB}/0", "KEEP")], "pacing sits through it (shorter than its 2 h threshold)"

    commands = [(c["command"], c["task_id"], c["machine_id"], c["reason"], e.timestamp_ms)
                for e in by_type("TasksCommanded") if e.timestamp_ms >= notice.timestamp_ms
                for c in batches.task_commands(e)]
    assert [c[:4] for c in commands] == [
        ("STOP", f"{SM}/0", "m1", "machine_maintenance"),
        ("START", f"{SM}/0", "m7", "placed"),
        ("STOP", f"{SM}/1", "m2", "maintenance_deadline"),
        ("START", f"{SM}/1", "m2", "maintenance_ended"),
    ], commands
    assert commands[0][4] < deadline <= commands[2][4], "moved before the deadline; the rest stopped at it"
    assert not [e for e in by_type("OperationsThrottled")], "the default limits never throttled this"

    final = {e.payload["job_id"]: e.payload for e in by_type("JobStatePublished")}
    assert {t["task_id"]: (t["state"], t["machine_id"]) for t in final[SM]["tasks"]} == {
        f"{SM}/0": ("RUNNING", "m7"), f"{SM}/1": ("RUNNING", "m2"), f"{SM}/2": ("RUNNING", "m3"),
        f"{SM}/3": ("RUNNING", "m4")}
    assert {t["task_id"]: (t["state"], t["machine_id"]) for t in final[WEB]["tasks"]} == {
        f"{WEB}/0": ("RUNNING", "m5"), f"{WEB}/1": ("RUNNING", "m6")}
