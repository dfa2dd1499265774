"""The pipeline Figure 14's counting (``Ledger``): table-driven over short event stories, pure (no broker).

Four tasks host two shards of three replicas: s1 on a, b, c and s2 on b, c, d; min live 2. Every story starts with
the four running version 1 on machines ma … md, and the job's spec changing to version 2.
"""
from __future__ import annotations

import pytest

from bench.experiments.figure14_pipeline import Ledger, curves, failed_msb_machines, merged, region_spec
from bench.experiments.figure14 import Conditions
from processors.resourcebroker.region import iter_machines, parse_region
from streams.events import new_event

JOB = "figure14.cache"
HOSTED = {"a": ["s1"], "b": ["s1", "s2"], "c": ["s1", "s2"], "d": ["s2"]}


def ev(type_, t, producer="scheduler", causation=None, event_id=None, **payload):
    return new_event(type_, payload, entitlement="figure14", entity_id="x", producer=producer, timestamp_ms=t,
                     causation_id=causation, event_id=event_id)


def running(task, t, version=1, machine=None):
    return ev("TaskStateChanged", t, producer=f"agent/{machine or 'm' + task}", task_id=task, job_id=JOB,
              machine_id=machine or f"m{task}", state="RUNNING", previous_state="STARTING", exit_code=None,
              spec_version=version, reason="")


def command(task, t, cmd="STOP", reason="rolling_update", machine=None, causation=None):
    return ev("TaskCommanded", t, causation=causation, task_id=task, job_id=JOB, machine_id=machine or f"m{task}",
              command=cmd, argv=[], env={}, spec_version=2, reason=reason)


def failure(t, *machines, event_id="ue1"):
    return ev("UnavailabilityStarted", t, producer="resourcebroker", event_id=event_id, unavailability_id=event_id,
              kind="FAILURE", machine_ids=list(machines), start_ms=t, deadline_ms=None, expected_duration_ms=None,
              reason="operator")


def ack(t, sequence, *tasks):
    return ev("TaskControlAcked", t, producer="taskcontroller/shard-manager", job_id=JOB, sequence=sequence,
              approved_operation_ids=[f"{x}:update:1" for x in tasks], controller="shard-manager",
              maintenance_choices=[])


def request(t, sequence, *pending, in_flight=None):
    return ev("TaskControlRequested", t, job_id=JOB, sequence=sequence, controller="shard-manager",
              pending_operations=[{"operation_id": f"{x}:update:1", "task_id": x, "kind": "UPDATE"} for x in pending],
              completed_operation_ids=[], advance_notices=[], unhealthy_task_ids=[],
              in_flight_operation_ids=None if in_flight is None else [f"{x}:update:1" for x in in_flight])


def commands(t, *rows, causation=None):
    """The scheduler's TasksCommanded: rows (task, command, reason)."""
    return ev("TasksCommanded", t, causation=causation, job_id=JOB, argv=[], env={}, part=0, parts=1,
              commands=[{"task_id": x, "machine_id": f"m{x}", "command": c, "spec_version": 2, "reason": r}
                        for x, c, r in rows])


def reports(t, *rows):
    """An agent process's TaskStatesChanged: rows (task, state, version)."""
    return ev("TaskStatesChanged", t, producer="agent/simulated", reports=[
        {"report_id": f"r{x}{t}", "task_id": x, "job_id": JOB, "machine_id": f"m{x}", "state": st,
         "previous_state": "STARTING", "exit_code": None, "spec_version": v, "reason": "", "cause_id": None}
        for x, st, v in rows])


START = [ev("JobSubmitted", 1, producer="cli", job_id=JOB, spec_version=1)] + [running(x, 2) for x in "abcd"] + [
    ev("JobSpecChanged", 10, producer="cli", job_id=JOB, spec_version=2)]

CASES = {
    # name: (events after START, by_ropewalk, by_ropewalk_at_ack, by_failure, raced, updating)
    "one update stop loses nothing": ([command("a", 11)], set(), set(), set(), set(), {"a"}),
    "two stops sharing s1 lose it": ([command("a", 11), command("b", 12)], {"s1"}, set(), set(), set(), {"a", "b"}),
    "two stops sharing no shard lose nothing": ([command("a", 11), command("d", 12)], set(), set(), set(), set(),
                                                {"a", "d"}),
    "a stop after its update ran again loses nothing":
        ([command("a", 11), running("a", 20, 2), command("b", 21)], set(), set(), set(), set(), {"b"}),
    "the failure alone": ([command("a", 11), failure(12, "mb")], set(), set(), {"s1"}, set(), {"a"}),
    "a stop after the failure, before the scheduler read it, raced":
        ([failure(11, "mb"), command("a", 12)], {"s1"}, set(), set(), {"s1"}, {"a"}),
    "a stop after the scheduler read the failure did not race":
        ([failure(11, "mb"), command("b", 12, reason="machine_failed", causation="ue1"), command("a", 13)],
         {"s1"}, set(), set(), set(), {"a"}),
    "a stop after the scheduler read the machine's DOWN status did not race":
        ([ev("MachineStatusChanged", 11, producer="resourcebroker", event_id="ms1", machine_id="mb", status="DOWN",
             previous_status="UP", reason="operator"), failure(11, "mb"),
          command("b", 12, reason="machine_failed", causation="ms1"), command("a", 13)],
         {"s1"}, set(), set(), set(), {"a"}),
    "a fence stop of a task already down changes nothing":
        ([failure(11, "ma"), command("a", 12, reason="machine_failed", causation="ue1")],
         set(), set(), set(), set(), set()),
    "batched: two stops sharing s1 in one TasksCommanded lose it":
        ([commands(11, ("a", "STOP", "rolling_update"), ("b", "STOP", "rolling_update"))], {"s1"}, set(), set(),
         set(), {"a", "b"}),
    "batched: a stop after the agent's batch said it runs again loses nothing":
        ([commands(11, ("a", "STOP", "rolling_update")), reports(20, ("a", "STARTING", 2), ("a", "RUNNING", 2)),
          commands(21, ("b", "STOP", "rolling_update"))], set(), set(), set(), set(), {"b"}),
    "batched: the machines' DOWN in one MachinesStatusChanged is read as the failure":
        ([ev("MachinesStatusChanged", 11, producer="resourcebroker", event_id="ms2", status="DOWN",
             reason="operator", machines=[{"machine_id": "mb", "previous_status": "UP"}]), failure(11, "mb"),
          commands(12, ("b", "STOP", "machine_failed"), causation="ms2"), command("a", 13)],
         {"s1"}, set(), set(), set(), {"a"}),
    "an ack of two tasks sharing s1 counts at the ack": ([ack(11, 1, "a", "b")], set(), {"s1"}, set(), set(), set()),
    "an ack of two tasks sharing no shard does not": ([ack(11, 1, "a", "d")], set(), set(), set(), set(), set()),
    "an ack while another approved task is not stopped yet":
        ([ack(11, 1, "a"), ack(12, 2, "b")], set(), {"s1"}, set(), set(), set()),
    "an approval asked again was not taken, so it does not count":
        ([ack(11, 1, "a"), request(12, 2, "a", "b"), ack(13, 2, "b")], set(), set(), set(), set(), set()),
    "a request saying the scheduler took no approval clears them":
        ([ack(11, 1, "a"), request(12, 2, in_flight=()), ack(13, 2, "b")], set(), set(), set(), set(), set()),
    "a request saying the scheduler holds an approval keeps it":
        ([ack(11, 1, "a"), request(12, 2, in_flight=("a",)), ack(13, 2, "b")], set(), {"s1"}, set(), set(), set()),
    "an ack while a task sharing s1 is down counts":
        ([ack(11, 1, "a"), command("a", 12), ack(13, 2, "c")], set(), {"s1"}, set(), set(), {"a"}),
    "an ack of a task down already costs nothing":
        ([command("a", 11), ack(12, 2, "a")], set(), set(), set(), set(), {"a"}),
    "an agent's unexpected exit is neither":
        ([ev("TaskStateChanged", 11, producer="agent/ma", task_id="a", job_id=JOB, machine_id="ma", state="FAILED",
             previous_state="RUNNING", exit_code=1, spec_version=1, reason="")], set(), set(), set(), set(), set()),
}


@pytest.mark.parametrize("name", CASES)
def test_ledger(name):
    story, by_ropewalk, at_ack, by_failure, raced, updating = CASES[name]
    ledger = Ledger(HOSTED, min_live=2)
    for e in START + story:
        ledger.apply(e)
    assert (ledger.by_ropewalk, ledger.by_ropewalk_at_ack, ledger.by_failure, ledger.raced, ledger.updating) == \
        (by_ropewalk, at_ack, by_failure, raced, updating)


def test_unexpected_exits_are_reported():
    ledger = Ledger(HOSTED, min_live=2)
    for e in START + CASES["an agent's unexpected exit is neither"][0]:
        ledger.apply(e)
    assert ledger.down_otherwise == {"a"} and ledger.live["s1"] == 2


def test_offenders_name_the_operation():
    ledger = Ledger(HOSTED, min_live=2)
    for e in START + [command("a", 11), command("b", 12)]:
        ledger.apply(e)
    assert ledger.offenders == [{"at_ms": 12, "task": "b", "stop": "rolling_update", "shards": 1, "raced": False}]


def test_curves_rows_and_durations():
    # time scale 10: a row every 10 paper seconds = every 1,000 ms of log time from the update (t=10)
    story = START + [command("a", 500), running("a", 1600, 2), command("b", 1700), command("d", 1700),
                     running("b", 2500, 2), command("c", 2600), running("d", 3200, 2), running("c", 3900, 2)]
    rows, done_s = curves(Ledger(HOSTED, 2), story, start_ms=10, time_scale=10, step_s=10, tasks=4)
    assert [r["t_s"] for r in rows] == [0, 10, 20, 30, 40]
    assert [r["tasks_updating"] for r in rows] == [0, 1, 2, 2, 0]
    assert [r["tasks_updated"] for r in rows] == [0, 0, 1, 2, 4]
    assert [r["tasks_waiting"] for r in rows] == [4, 3, 1, 0, 0]
    assert [r["shards_1_down"] for r in rows] == [0, 1, 1, 1, 0]
    assert [r["shards_2plus_down"] for r in rows] == [0, 0, 1, 1, 0]
    assert done_s == 38.9


def test_merged_keeps_each_partitions_order_and_interleaves_by_time():
    p1 = [running("a", 5), running("b", 3)]  # a partition whose timestamps are not monotonic stays in order
    p2 = [running("c", 4)]
    assert [e.payload["task_id"] for e in merged([p1, p2])] == ["c", "a", "b"]


def test_region_one_machine_per_task_and_the_failed_msb():
    c = Conditions(tasks=100, shards=10, msbs=10, failed_msb=3)
    machines = [m.id for m in iter_machines(parse_region(region_spec(c)))]
    assert len(machines) == 100 and len(set(machines)) == 100
    assert failed_msb_machines(machines, c) == sorted(m for m in machines if "-msb4-" in m)
    assert len(failed_msb_machines(machines, c)) == 10
