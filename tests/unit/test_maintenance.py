"""Planned maintenance (Twine §2.5): advance notice, the TaskController's choice per task (move now, stop and
restart after, keep running), the deadline the scheduler enforces on its timer, and the end of the window.
Driven through the scheduler's pure decisions with the scheduler tests' harness; the Ops Planner's pure plan too.
"""
import pytest

from processors.opsplanner import decide as op
from processors.resourcebroker import decide as rb
from processors.resourcebroker.region import MachineSpec
from processors.scheduler.decide import retry_unplaced
from processors.scheduler.reasons import (
    REASON_CHOICE_TOO_LATE, REASON_MACHINE_MAINTENANCE, REASON_MAINTENANCE_DEADLINE, REASON_MAINTENANCE_ENDED,
    REASON_MAINTENANCE_STOP, REASON_MUST_VACATE, REASON_NOT_UNDER_NOTICE,
)
from processors.scheduler.records import job_from_record, job_to_record
from processors.taskcontrol import protocol as tc
from test_scheduler_decide import (  # the scheduler tests' harness (tests/unit is on sys.path)
    ENT, REG, T0, Allocator, agent_reactions, ev, machine_status, of_type, running_job, spec_changed,
)
from test_taskcontrol_scheduler import CTL, requests

UE = "ue-maint"
START = T0 + 600_000
DEADLINE = T0 + 300_000


def maintenance(machines, *, deadline=DEADLINE, start=START, ue=UE):
    return ev("UnavailabilityStarted", {"unavailability_id": ue, "kind": "MAINTENANCE", "machine_ids": list(machines),
                                        "start_ms": start, "deadline_ms": deadline,
                                        "expected_duration_ms": 900_000, "reason": "maintenance"},
              producer="opsplanner", entity=ue)


def ended(machines, ue=UE):
    return ev("UnavailabilityEnded", {"unavailability_id": ue, "machine_ids": list(machines)},
              producer="resourcebroker", entity=ue)


def ack_with(seq, choices=(), approved=(), job="j"):
    return ev("TaskControlAcked", tc.ack_payload(job, seq, approved, CTL, [tc.Choice(UE, t, c) for t, c in choices]),
              producer=f"taskcontroller/{CTL}", entity=job)


def commands(out):
    return [(e.payload["command"], e.payload["task_id"], e.payload["machine_id"], e.payload["reason"])
            for e in of_type(out, "TaskCommanded")]


def tick(sim, now):
    """The scheduler's timer at ``now`` (retry_unplaced), its output checked against the schemas."""
    sim.state, out = retry_unplaced(sim.state, now)
    for e in out:
        REG.encode(e.type, e.to_record(schema_version=1))
    return out


def settle(sim, out, allocator=None):
    log, todo = [], list(out)
    while todo:
        nxt = list(agent_reactions(todo)) + (list(allocator.reactions(todo)) if allocator else [])
        todo = sim.feed_all(nxt)
        log.extend(todo)
    return log


# choice of the controller for j/0 (on m1) → what happens on the ack, at the deadline, at the end
CASES = [
    pytest.param(None, [], [("STOP", "j/0", "m1", REASON_MAINTENANCE_DEADLINE)],
                 [("START", "j/0", "m1", REASON_MAINTENANCE_ENDED)], "m1", id="unacking-stopped-at-deadline"),
    pytest.param(tc.CHOICE_KEEP, [], [], [], "m1", id="keep-running"),
    pytest.param(tc.CHOICE_STOP, [("STOP", "j/0", "m1", REASON_MAINTENANCE_STOP)], [],
                 [("START", "j/0", "m1", REASON_MAINTENANCE_ENDED)], "m1", id="stop-and-restart-after"),
    pytest.param(tc.CHOICE_MOVE, [("STOP", "j/0", "m1", REASON_MACHINE_MAINTENANCE),
                                  ("START", "j/0", "m3", "placed")], [], [], "m3", id="move-now"),
]


@pytest.mark.parametrize("choice, on_ack, at_deadline, at_end, final_machine", CASES)
def test_controller_choice_then_deadline_then_end(choice, on_ack, at_deadline, at_end, final_machine):
    sim = running_job(2, ("m1", "m2"), controller=CTL)
    alloc = Allocator(["m3", "m4"])
    out = sim.feed(maintenance(["m1"]))
    assert commands(out) == [], "a notice stops nothing by itself"
    (req,) = requests(out)
    assert [(n.unavailability_id, n.task_ids, n.deadline_ms) for n in req.notices] == [(UE, ("j/0",), DEADLINE)]
    if choice is not None:
        out = sim.feed(ack_with(req.sequence, [("j/0", choice)]))
        out += settle(sim, out, alloc)
        assert [c for c in commands(out)] == on_ack
    assert commands(tick(sim, DEADLINE - 1)) == [], "nothing happens before the deadline"
    out = tick(sim, DEADLINE)
    assert commands(out) == at_deadline
    if at_deadline:
        assert ("j/0", False, REASON_MAINTENANCE_DEADLINE) in [
            (e.payload["task_id"], e.payload["enabled"], e.payload["reason"])
            for e in of_type(out, "ServiceDiscoveryChanged")], "out of service discovery first, with the reason"
    settle(sim, out, alloc)
    assert commands(tick(sim, DEADLINE + 60_000)) == [], "a deadline is enforced once"
    state_during = sim.tasks()["j/0"]
    assert state_during[0] == ("RUNNING" if choice in (tc.CHOICE_KEEP, tc.CHOICE_MOVE) else "STOPPED")
    # the window opens: the machine goes into MAINTENANCE; kept and held tasks stay where they are
    out = sim.feed(machine_status("m1", "MAINTENANCE"))
    assert commands(out) == [] and sim.tasks()["j/0"] == state_during
    assert sim.tasks()["j/1"] == ("RUNNING", "m2"), "tasks on other machines are never touched"
    sim.feed(machine_status("m1", "UP"))
    out = sim.feed(ended(["m1"]))
    assert commands(out) == at_end
    settle(sim, out, alloc)
    assert sim.tasks()["j/0"] == ("RUNNING", final_machine)
    assert sim.view()["maintenance"] == []


def test_without_a_controller_the_deadline_moves_the_task():
    sim = running_job(2, ("m1", "m2"))
    assert sim.feed(maintenance(["m1"])) == []
    out = tick(sim, DEADLINE)
    assert commands(out) == [("STOP", "j/0", "m1", REASON_MAINTENANCE_DEADLINE)]
    out = settle(sim, out, Allocator(["m3"]))
    (request,) = of_type(out, "AllocationRequested")
    assert request.payload["avoid_machine_ids"] == ["m1"]
    assert sim.tasks()["j/0"] == ("RUNNING", "m3")


def test_deadline_stops_only_what_remains_on_the_machines():
    """j/0 was moved off by its controller before the deadline; j/1 stays on m2; only j/2 (on m1, no choice)
    is stopped at the deadline."""
    sim = running_job(3, ("m1", "m1", "m2"), controller=CTL, max_unavailable=3)
    (req,) = requests(sim.feed(maintenance(["m1"])))
    assert req.notices[0].task_ids == ("j/0", "j/1")
    out = sim.feed(ack_with(req.sequence, [("j/0", tc.CHOICE_MOVE)]))
    settle(sim, out, Allocator(["m3"]))
    out = tick(sim, DEADLINE + 5)
    assert commands(out) == [("STOP", "j/1", "m1", REASON_MAINTENANCE_DEADLINE)]
    settle(sim, out)
    assert sim.tasks() == {"j/0": ("RUNNING", "m3"), "j/1": ("STOPPED", "m1"), "j/2": ("RUNNING", "m2")}


@pytest.mark.parametrize("task, ue, reason", [
    ("j/1", UE, REASON_NOT_UNDER_NOTICE),  # on m2: not under the notice
    ("j/0", "another-ue", REASON_NOT_UNDER_NOTICE),
])
def test_choices_for_tasks_not_under_notice_are_ignored_with_a_reason(task, ue, reason):
    sim = running_job(2, ("m1", "m2"), controller=CTL)
    (req,) = requests(sim.feed(maintenance(["m1"])))
    bogus = ev("TaskControlAcked", tc.ack_payload("j", req.sequence, [], CTL, [tc.Choice(ue, task, tc.CHOICE_STOP)]),
               producer=f"taskcontroller/{CTL}", entity="j")
    assert commands(sim.feed(bogus)) == []
    assert sim.view()["last_ignored"].startswith(reason)


def test_a_choice_after_the_deadline_stopped_the_task_is_too_late():
    sim = running_job(2, ("m1", "m2"), controller=CTL)
    (req,) = requests(sim.feed(maintenance(["m1"])))
    settle(sim, tick(sim, DEADLINE))
    assert commands(sim.feed(ack_with(req.sequence, [("j/0", tc.CHOICE_KEEP)]))) == []
    assert sim.view()["last_ignored"].startswith(REASON_CHOICE_TOO_LATE)
    assert sim.tasks()["j/0"] == ("STOPPED", "m1")


def test_a_task_held_for_maintenance_is_not_restarted_by_a_rolling_update():
    sim2 = running_job(2, ("m1", "m2"), controller=CTL, max_unavailable=2)
    (req,) = requests(sim2.feed(maintenance(["m1"])))
    settle(sim2, sim2.feed(ack_with(req.sequence, [("j/0", tc.CHOICE_STOP)])))
    out = sim2.feed(spec_changed("j", 2, version=2, controller=CTL, max_unavailable=2))
    assert all(c[1] != "j/0" for c in commands(out)), "held: the update does not start it"
    settle(sim2, sim2.feed(ended(["m1"])))
    assert sim2.tasks()["j/0"] == ("RUNNING", "m1")
    assert next(t for t in sim2.view()["tasks"] if t["id"] == "j/0")["spec_version"] == 2


def test_maintenance_survives_the_table_record():
    sim = running_job(2, ("m1", "m2"), controller=CTL)
    (req,) = requests(sim.feed(maintenance(["m1"])))
    sim.feed(ack_with(req.sequence, [("j/0", tc.CHOICE_KEEP)]))
    job = sim.state.jobs["j"]
    assert job.maint and job_from_record(job_to_record(job)) == job


def test_protocol_valid_choices():
    req = tc.Request("j", ENT, CTL, 1, notices=(tc.AdvanceNotice(UE, ("j/0", "j/1"), START, DEADLINE),))
    given = [tc.Choice(UE, "j/0", "KEEP"), tc.Choice(UE, "j/0", "STOP"), tc.Choice(UE, "j/9", "STOP"),
             tc.Choice(UE, "j/1", "BOGUS"), tc.Choice("x", "j/1", "MOVE"), tc.Choice(UE, "j/1", "MOVE")]
    assert tc.valid_choices(req, given) == [tc.Choice(UE, "j/0", "KEEP"), tc.Choice(UE, "j/1", "MOVE")]
    payload = tc.ack_payload("j", 1, [], CTL, tc.valid_choices(req, given))
    REG.encode("TaskControlAcked", {**payload, "envelope": {
        "event_id": "a", "entitlement": ENT, "entity_id": "j", "timestamp_ms": 1, "producer": "p",
        "causation_id": None, "schema_version": 1}})
    assert tc.choices_of(payload) == (tc.Choice(UE, "j/0", "KEEP"), tc.Choice(UE, "j/1", "MOVE"))
    assert tc.choices_of(tc.ack_payload("j", 1, [], CTL)) == ()


# -- the Ops Planner --------------------------------------------------------------------------------------------

def _region():
    machines = [MachineSpec(f"m{i}", "r1", "dc1", f"msb{i % 2}", f"rk{i % 4}", "skylake", 8000, 16384)
                for i in range(8)]
    state, _ = rb.register_all(rb.BrokerState(), machines, T0)
    return state


@pytest.mark.parametrize("scope, machines", [
    ({"machines": ["m1", "m3"]}, ["m1", "m3"]),
    ({"rack": "dc1/msb1/rk1"}, ["m1", "m5"]),
    ({"msb": "dc1/msb0"}, ["m0", "m2", "m4", "m6"]),
])
def test_ops_planner_plans_maintenance_of_the_machines_concerned(scope, machines):
    plan = op.Plan(**scope, start_ms=START, duration_ms=900_000, deadline_ms=DEADLINE)
    events = op.plan(_region(), plan, now_ms=T0)
    assert [e.type for e in events] == ["UnavailabilityStarted"]
    p = events[0].payload
    assert (p["kind"], p["machine_ids"], p["start_ms"], p["deadline_ms"], p["expected_duration_ms"]) == (
        "MAINTENANCE", machines, START, DEADLINE, 900_000)
    assert events[0].producer == op.PRODUCER
    REG.encode(events[0].type, events[0].to_record(schema_version=1))
    assert op.plan(_region(), plan, now_ms=T0) == events, "a plan names its events alike when repeated"


@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one of"),
    ({"machines": ["m1"], "msb": "dc1/msb0"}, "exactly one of"),
    ({"machines": ["nope"]}, "matches no registered machine"),
    ({"machines": ["m1"], "deadline_ms": START + 1}, "deadline"),
    ({"machines": ["m1"], "duration_ms": 0}, "duration"),
])
def test_ops_planner_refuses_a_bad_plan_with_a_reason(kw, message):
    args = {"start_ms": START, "duration_ms": 900_000, "deadline_ms": DEADLINE, **kw}
    with pytest.raises(op.PlanError, match=message):
        op.plan(_region(), op.Plan(**args), now_ms=T0)


def test_ops_planner_end_restarts_through_unavailability_ended():
    state = _region()
    (started,) = op.plan(state, op.Plan(machines=["m1"], start_ms=START, duration_ms=1, deadline_ms=DEADLINE),
                         now_ms=T0)
    events = op.end(state, started.payload["unavailability_id"], started.payload["machine_ids"], now_ms=START + 5)
    assert [e.type for e in events] == ["UnavailabilityEnded"]
    assert events[0].payload == {"unavailability_id": started.payload["unavailability_id"], "machine_ids": ["m1"]}


def test_a_task_moved_for_a_maintenance_avoids_every_machine_of_it():
    """The regression seen with `ropewalk maintenance plan --msb`: a task stopped at the deadline was placed on
    another machine of the same MSB. Placements of the job during the maintenance avoid all of its machines."""
    sim = running_job(2, ("m1", "m2"))
    sim.feed(maintenance(["m1", "m3"]))  # m3: a free machine of the same maintenance
    out = settle(sim, tick(sim, DEADLINE), Allocator(["m3", "m4"]))
    (request,) = of_type(out, "AllocationRequested")
    assert request.payload["avoid_machine_ids"] == ["m1", "m3"]
    assert sim.tasks()["j/0"] == ("RUNNING", "m4")


@pytest.mark.parametrize("status, final", [("MAINTENANCE", "m1"), ("DOWN", "m3")],
                         ids=["window-still-open-here", "machine-failed-meanwhile"])
def test_the_end_arriving_before_the_machine_is_up_restarts_in_place(status, final):
    """UnavailabilityEnded and the machine's MachineStatusChanged(UP) travel on different topics: a shard may read
    the end first. The maintenance being over, its machine is UP for the scheduler, and the held task starts
    where it is; a machine that failed meanwhile stays down and the task moves."""
    sim = running_job(2, ("m1", "m2"), controller=CTL)
    (req,) = requests(sim.feed(maintenance(["m1"])))
    settle(sim, sim.feed(ack_with(req.sequence, [("j/0", tc.CHOICE_STOP)])))
    sim.feed(machine_status("m1", status))
    out = sim.feed(ended(["m1"]))
    settle(sim, out, Allocator(["m3"]))
    assert sim.tasks()["j/0"] == ("RUNNING", final)
    assert ("m1" in sim.state.machines_down) == (status == "DOWN")


# -- a revoked loan (processors/resourcebroker/loans.py): a notice whose machines must be left --------------------

def revocation(machines, ue=UE):
    return ev("UnavailabilityStarted", {"unavailability_id": ue, "kind": "MAINTENANCE", "machine_ids": list(machines),
                                        "start_ms": DEADLINE, "deadline_ms": DEADLINE,
                                        "expected_duration_ms": 60_000, "reason": "loan_revoked", "vacate": True},
              producer="resourcebroker/loans", entity=ue)


@pytest.mark.parametrize("choice", [None, tc.CHOICE_KEEP, tc.CHOICE_STOP])
def test_a_revoked_loan_is_vacated_keep_and_stop_are_refused_and_the_deadline_moves_the_task(choice):
    """The borrower's controller gets the notice like any maintenance's, but may only move: KEEP and STOP are
    ignored (must_vacate), and at the deadline the task is stopped and moved elsewhere at once, not held on the
    machine until the end as a controller's job is under a maintenance."""
    sim = running_job(2, ("m1", "m2"), controller=CTL)
    alloc = Allocator(["m3", "m4"])
    out = sim.feed(revocation(["m1"]))
    assert commands(out) == [], "the notice stops nothing by itself"
    (req,) = requests(out)
    assert [(n.unavailability_id, n.task_ids) for n in req.notices] == [(UE, ("j/0",))]
    if choice is not None:
        out = sim.feed(ack_with(req.sequence, [("j/0", choice)]))
        assert commands(settle(sim, out, alloc) + out) == [], f"{choice} under a revocation changes nothing"
        assert sim.state.jobs["j"].last_ignored.startswith(f"{REASON_MUST_VACATE}:")
    out = tick(sim, DEADLINE)
    assert commands(out) == [("STOP", "j/0", "m1", REASON_MAINTENANCE_DEADLINE)]
    settle(sim, out, alloc)
    assert sim.tasks()["j/0"] == ("RUNNING", "m3") and sim.tasks()["j/1"] == ("RUNNING", "m2")
