"""A ReBalancer plan's moves in the scheduler's pure decisions (processors/scheduler/decide.py, RebalancePlanned).

The harness is the scheduler tests' ``Sim`` (every input also checked for determinism, idempotence and schema
validity); the allocator, the agents and the TaskController are played by hand.
"""
import pytest

from processors.scheduler import reasons as rb  # the moves' reasons: rb.REASON_REBALANCE, rb.REASON_MOVE_*
from processors.scheduler.decide import decide, retry_unplaced
from processors.scheduler.lifecycle import JOB_UPDATING
from processors.scheduler.reasons import REASON_UNKNOWN_TASK
from processors.taskcontrol.protocol import OP_MOVE
from processors.taskcontrol.limiter import Limits, Rate
from test_scheduler_decide import (  # the scheduler tests' harness (tests/unit is on sys.path)
    ENT, T0, Allocator, agent_reactions, allocated, entitlement, ev, kinds, of_type, refusals, rejected,
    report, running_job, spec_changed, stopped, untag,
)
from test_taskcontrol_scheduler import CTL, ack, requests, settle


def plan(moves, ent=ENT, n=1):
    """A RebalancePlanned: moves (task, from, to)."""
    return ev("RebalancePlanned", {
        "plan_id": f"{ent}:p{n}", "status": "optimal",
        "goals": {"target_ratio": 1.1, "trigger_ratio": 1.15, "max_moves": 10, "deterministic_limit": 1.0,
                  "wall_limit_ms": 10000},
        "constraints": [], "no_bounce_ms": 3_600_000,
        "before": {"max_load": 1.0, "mean_load": 0.5, "ratio": 2.0, "machines": 3, "tasks": 3},
        "after": {"max_load": 0.5, "mean_load": 0.5, "ratio": 1.0, "machines": 3, "tasks": 3},
        "moves": [{"task_id": t, "job_id": t.rsplit("/", 1)[0], "from_machine_id": f, "to_machine_id": to,
                   "cpu_millicores": 1000, "memory_mib": 2048} for t, f, to in moves],
        "solve_ms": 5, "solver_work": 0.1, "wall_limited": False, "candidates": 3, "variables": 9, "excluded": {}},
        producer="rebalancer", ent=ent, entity=f"{ent}:p{n}")


def requests_of(out):
    return [e.payload for e in out if e.type == "AllocationRequested"]


def test_a_planned_move_stops_the_task_and_asks_for_its_target_avoiding_its_source():
    sim = running_job(3)  # j/0 m1, j/1 m2, j/2 m3; no controller: approved at once
    out = sim.feed(plan([("j/0", "m1", "m9")]))
    assert kinds(out)[:2] == [("discovery", "j/0", False), ("STOP", "j/0", "m1", 1)]
    op = sim.view()["operations"]
    assert [(o["task"], o["kind"], o["reason"], o["state"]) for o in op] == [("j/0", OP_MOVE, rb.REASON_REBALANCE,
                                                                              "running")]
    out = sim.feed(report("j/0", "STOPPED", "m1", exit_code=0))
    (req,) = requests_of(out)
    assert (req["place_task_ids"], req["free_task_ids"], req["avoid_machine_ids"], req["target_machine_ids"]) == (
        ["j/0"], ["j/0"], ["m1"], {"j/0": "m9"})
    out = sim.feed(allocated(of_type(out, "AllocationRequested")[0], {"j/0": "m9"}))
    assert ("START", "j/0", "m9", 1) in kinds(out)
    sim.feed_all(list(agent_reactions(out)))
    assert sim.tasks()["j/0"] == ("RUNNING", "m9") and sim.view()["operations"] == []


def test_a_rejected_target_is_retried_anywhere_but_the_source():
    sim = running_job(2)
    out = sim.feed(plan([("j/0", "m1", "m9")]))
    out = sim.feed(report("j/0", "STOPPED", "m1", exit_code=0))
    req = of_type(out, "AllocationRequested")[0]
    sim.feed(rejected(req, ["j/0"], reason="no_feasible_machine", message="full"))
    out = retry_unplaced(sim.state, T0 + 10_000)[1]
    (again,) = requests_of(out)
    assert again["target_machine_ids"] == {} and again["place_task_ids"] == ["j/0"]


MOVES_REFUSED = {
    "unknown-task": ([("j/7", "m1", "m9")], REASON_UNKNOWN_TASK),
    "not-on-its-source-any-more": ([("j/0", "m2", "m9")], rb.REASON_MOVE_NOT_ON_SOURCE),
}


@pytest.mark.parametrize("moves, reason", MOVES_REFUSED.values(), ids=MOVES_REFUSED)
def test_refused_moves_are_answered_by_an_intent_refused(moves, reason):
    sim = running_job(2)
    out = sim.feed(plan(moves))
    assert refusals(out) == [("RebalancePlanned", reason)]
    assert of_type(out, "TaskCommanded") == [] and sim.view()["operations"] == []


def test_no_move_of_a_task_not_running_or_of_an_updating_job():
    sim = running_job(2)
    out = sim.feed(report("j/1", "FAILED", "m2", exit_code=1))  # restarted in place: STARTING
    out = sim.feed(plan([("j/1", "m2", "m9")], n=1))
    assert refusals(out) == [("RebalancePlanned", rb.REASON_MOVE_TASK_NOT_RUNNING)]
    sim2 = running_job(2, controller=CTL)
    sim2.feed(spec_changed("j", 2, version=2, controller=CTL))
    assert sim2.view()["state"] == JOB_UPDATING
    out = sim2.feed(plan([("j/0", "m1", "m9")]))
    assert refusals(out) == [("RebalancePlanned", rb.REASON_MOVE_JOB_NOT_RUNNING)]


def test_another_entitlements_plan_moves_nothing_here():
    sim = running_job(2)
    sim.feed(entitlement("e2"))
    out = sim.feed(plan([("j/0", "m1", "m9")], ent="e2"))
    assert refusals(out) == [("RebalancePlanned", "entitlement_mismatch")]
    assert sim.tasks()["j/0"] == ("RUNNING", "m1")


def test_moves_wait_for_the_controller_and_go_max_unavailable_at_a_time():
    sim = running_job(3, controller=CTL, max_unavailable=1)
    out = sim.feed(plan([("j/0", "m1", "m7"), ("j/1", "m2", "m8")]))
    assert of_type(out, "TaskCommanded") == [], "nothing moves before the controller acks"
    (req,) = requests(out)
    assert [(o.task_id, o.kind, o.reason) for o in req.pending] == [("j/0", OP_MOVE, rb.REASON_REBALANCE),
                                                                   ("j/1", OP_MOVE, rb.REASON_REBALANCE)]
    out = sim.feed(ack("j", 1, [o.operation_id for o in req.pending]))
    stops = [k for k in kinds(out) if k[0] == "STOP"]
    assert stops == [("STOP", "j/0", "m1", 1)], "max_unavailable 1: one at a time"
    log = settle(sim, out, Allocator(["m7", "m8"]))
    assert sim.tasks() == {"j/0": ("RUNNING", "m7"), "j/1": ("RUNNING", "m8"), "j/2": ("RUNNING", "m3")}
    (r2,) = requests(log)  # one request outstanding at a time: the first completion, then (acked) the second
    assert tuple(map(untag, r2.completed)) == ("j/0:move:1",)
    (r3,) = requests(sim.feed(ack("j", r2.sequence, [])))
    assert tuple(map(untag, r3.completed)) == ("j/1:move:2",)


def test_the_limiter_paces_planned_moves():
    sim = running_job(3, max_unavailable=3)
    tight = Limits(job=Rate(per_minute=1, burst=1), shard=Rate(per_minute=100, burst=100))
    state, out = decide(sim.state, plan([("j/0", "m1", "m7"), ("j/1", "m2", "m8")]), T0, limits=tight)
    assert [k for k in kinds(out) if k[0] == "STOP"] == [("STOP", "j/0", "m1", 1)]
    throttled = of_type(out, "OperationsThrottled")
    assert [w["task_id"] for w in throttled[0].payload["waiting"]] == ["j/1"]


def test_a_job_stopped_during_a_move_ends_it():
    sim = running_job(2)
    sim.feed(plan([("j/0", "m1", "m9")]))  # j/0 STOPPING to move
    out = sim.feed(stopped("j"))
    out += settle(sim, out)
    out += sim.feed(report("j/0", "STOPPED", "m1", exit_code=0))
    reqs = requests_of(out)
    assert reqs and all(r["place_task_ids"] == [] and r["target_machine_ids"] == {} for r in reqs)
    assert sim.view()["state"] == "stopped"
