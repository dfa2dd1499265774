"""Stops go through the rate limiter too (Twine §4): the stops a user asks for (shrink, job stop: "retire") and the
stops a TaskController chooses under an advance notice (MOVE / STOP) take a token of the job's and the shard's
bucket, wait (still RUNNING, still serving) while the buckets are empty, and are announced in OperationsThrottled
(kind STOP) like every other operation. The one exception, the maintenance deadline, takes none. Nothing
deadlocks: a job stopped during an update, a shrink undone before the tokens came, a waiting task that fails.
"""
from collections import Counter
from dataclasses import replace
from types import MappingProxyType

import pytest

from processors.scheduler import decide as sd
from processors.scheduler import lifecycle as lc
from processors.scheduler import model as sm
from processors.scheduler.lifecycle import JOB_STOPPED, JOB_STOPPING
from processors.scheduler.steps import RECOMMAND_MS
from processors.scheduler.reasons import (
    REASON_COMMAND_REPEATED, REASON_JOB_STOPPED, REASON_MACHINE_MAINTENANCE, REASON_MAINTENANCE_DEADLINE, REASON_MAINTENANCE_ENDED,
    REASON_RESIZED,
)
from processors.taskcontrol import limiter
from processors.taskcontrol import protocol as tc
from processors.taskcontrol.limiter import REASON_RATE_LIMITED_JOB, Limits, Rate
from test_maintenance import DEADLINE, ack_with, ended, maintenance, settle
from test_scheduler_decide import (  # the scheduler tests' harness (tests/unit is on sys.path)
    REG, T0, Allocator, Sim, allocated, entitlement, ev, of_type, report, resized, spec_changed,
    stopped, submit, untag,
)
from test_taskcontrol_scheduler import CTL, requests

ONE_A_SECOND = Limits(job=Rate(per_minute=60, burst=1), shard=Rate(per_minute=6_000, burst=1_000))
THREE_THEN_ONE_A_SECOND = Limits(job=Rate(per_minute=60, burst=3), shard=Rate(per_minute=6_000, burst=1_000))


class LimitedSim(Sim):
    """The scheduler tests' ``Sim`` deciding under ``limits``: every input is checked for determinism,
    idempotence and schema validity, and so is every timer tick."""

    def __init__(self, limits):
        super().__init__()
        self.limits = limits
        self.check_schemas = True

    def feed(self, event, now=None):
        now = self.now if now is None else now
        new, out = sd.decide(self.state, event, now, limits=self.limits)
        assert sd.decide(self.state, event, now, limits=self.limits) == (new, out)
        assert sd.decide(new, event, now, limits=self.limits)[1] == [], f"{event.type} twice must change nothing"
        self._check(out)
        self.state = new
        return out

    def tick(self, now):
        self.now = now
        new, out = sd.retry_unplaced(self.state, now, limits=self.limits)
        assert sd.retry_unplaced(self.state, now, limits=self.limits) == (new, out)
        self._check(out)
        self.state = new
        return out

    def _check(self, out):
        for e in out if self.check_schemas else ():
            REG.encode(e.type, e.to_record(schema_version=1))
        assert len({e.event_id for e in out}) == len(out)


def job_on(limits, n, job="j", **kw):
    """A LimitedSim with job ``job`` of ``n`` tasks RUNNING on m1..mn."""
    sim = LimitedSim(limits)
    sim.feed(entitlement())
    (req,) = of_type(sim.feed(submit(job, n, **kw)), "AllocationRequested")
    settle(sim, sim.feed(allocated(req, {f"{job}/{i}": f"m{i + 1}" for i in range(n)})))
    assert all(s == "RUNNING" for s, _ in sim.tasks(job).values())
    return sim


def stops(out, reason=None):
    return [e.payload["task_id"] for e in of_type(out, "TaskCommanded")
            if e.payload["command"] == "STOP" and (reason is None or e.payload["reason"] == reason)]


def throttled(out):
    (th,) = of_type(out, "OperationsThrottled")
    return [(w["task_id"], w["kind"]) for w in th.payload["waiting"]], th.payload


# -- retire stops are paced --------------------------------------------------------------------------------------

RETIRES = {  # intent → (reason of the stops, tasks stopped at once, tasks waiting, tasks left, job state after)
    "shrink": (resized("j", 2), REASON_RESIZED, ["j/7", "j/6", "j/5"], ["j/2", "j/3", "j/4"], ["j/0", "j/1"],
               "running"),
    "job-stop": (stopped("j"), REASON_JOB_STOPPED, ["j/7", "j/6", "j/5"], [f"j/{i}" for i in range(5)], [],
                 JOB_STOPPED),
}


@pytest.mark.parametrize("intent, reason, at_once, waiting, left, final", RETIRES.values(), ids=RETIRES)
def test_retire_stops_take_tokens_and_wait_running(intent, reason, at_once, waiting, left, final):
    sim = job_on(THREE_THEN_ONE_A_SECOND, 8)
    out = sim.feed(intent)
    assert stops(out, reason) == at_once, "the bucket's burst, highest indices first"
    got, th = throttled(out)
    assert got == [(t, tc.OP_STOP) for t in waiting] and th["reason"] == REASON_RATE_LIMITED_JOB
    assert th["retry_at_ms"] == T0 + 1000
    out += settle(sim, out)
    view = sim.view()
    assert {t["id"]: t["state"] for t in view["tasks"] if t["id"] in waiting} == {t: "RUNNING" for t in waiting}
    assert {t["id"]: t["reason"] for t in view["tasks"] if t["id"] in waiting} == {t: reason for t in waiting}, \
        "job status shows why a running task waits"
    assert view["state"] == (JOB_STOPPING if final == JOB_STOPPED else final)
    assert set(map(untag, view["throttled"])) == {f"{t}:stop:{n}" for t, n in zip(waiting, _op_numbers(sim, waiting))}
    done, now, log = len(at_once), T0, list(out)
    while sim.view()["throttled"]:
        now += 250
        assert now < T0 + 60_000, "the stops never finished"
        out = sim.tick(now)
        done += len(stops(out, reason))
        assert done <= 3 + (now - T0) // 1000, "never faster than the bucket"
        log += out + settle(sim, out)
    assert done == 8 - len(left) and now == T0 + 1000 * len(waiting)
    freed = sorted(t for e in of_type(log, "AllocationRequested") for t in e.payload["free_task_ids"])
    assert freed == sorted(f"j/{i}" for i in range(len(left), 8)), "every stopped task freed, once"
    assert sim.view()["state"] == final and sim.view()["operations"] == []
    if final != JOB_STOPPED:
        assert sorted(sim.tasks()) == left


def _op_numbers(sim, tasks):
    ops = {o["task"]: o["id"] for o in sim.view()["operations"]}
    return [int(untag(ops[t]).rsplit(":", 1)[1]) for t in tasks]

def test_a_job_stop_of_ten_thousand_tasks_is_paced():
    """10,000 tasks stopped at once: the job's bucket sets the pace (here 100 a second after a burst of 500), the
    rest stay RUNNING and listed as waiting, the job "stopping"; never more stops than burst + rate · elapsed,
    each task stopped once, none left waiting at the end; a stop with no report is sent again after
    ``steps.RECOMMAND_MS`` (not a new stop: it takes no token), once per that long. (The end of a stop, all STOPPED then freed, is the
    small job's test above: feeding 10,000 agent reports through the checking harness would take minutes.)"""
    n, limits = 10_000, Limits(job=Rate(per_minute=6_000, burst=500), shard=Rate(per_minute=600_000, burst=10_000))
    sim = LimitedSim(limits)
    sim.feed(entitlement())
    (req,) = of_type(sim.feed(submit("big", n)), "AllocationRequested")
    sim.feed(ev("TasksAllocated", {"request_id": req.payload["request_id"], "job_id": "big", "placements": [
        {"task_id": f"big/{i}", "machine_id": f"m{i}", "dc": "dc1", "msb": f"msb{i % 3}", "rack": f"r{i}"}
        for i in range(n)]}, producer="allocator"))
    job = sim.state.jobs["big"]  # every task RUNNING (as 20,000 agent reports would make it), built directly
    running = {k: replace(t, state=lc.RUNNING, discovery=True, reason="", running_since_ms=T0)
               for k, t in job.tasks.items()}
    sim.state = sm.state_of([replace(job, tasks=MappingProxyType(running))], sim.state.entitlements.values())
    out = sim.feed(stopped("big"))
    sim.check_schemas = False  # checked on the first (largest) output; encoding 95 more 10,000-row ones is slow
    done = Counter(stops(out))
    assert len(done) == 500 and len(sim.view("big")["throttled"]) == n - 500
    assert sim.view("big")["state"] == JOB_STOPPING
    assert sum(t["state"] == "RUNNING" for t in sim.view("big")["tasks"]) == n - 500
    now, sent = T0, dict.fromkeys(done, T0)
    while sim.view("big")["throttled"]:
        now += 1_000
        assert now <= T0 + 100_000, f"{sum(done.values())} of {n} stopped after {now - T0} ms"
        out = sim.tick(now)
        again = stops(out, REASON_COMMAND_REPEATED)
        done.update(t for t in stops(out) if t not in again)
        for t in again:  # no agent here reports: each stop is sent again, not sooner
            assert now - sent[t] >= RECOMMAND_MS, (t, now - sent[t])
        sent.update(dict.fromkeys(stops(out), now))
        assert sum(done.values()) <= 500 + (now - T0) * 6_000 // 60_000
    assert now == T0 + 95_000 and len(done) == n and set(done.values()) == {1}
    assert {t["state"] for t in sim.view("big")["tasks"]} == {"STOPPING"} and sim.view("big")["operations"] == []


# -- nothing deadlocks ----------------------------------------------------------------------------------------------

def _update_pending_with_controller():
    sim = job_on(ONE_A_SECOND, 3, controller=CTL)
    (r,) = requests(sim.feed(spec_changed("j", 3, version=2, controller=CTL)))
    return sim, r


def _update_throttled():
    sim = job_on(ONE_A_SECOND, 3, max_unavailable=3)
    out = sim.feed(spec_changed("j", 3, version=2, max_unavailable=3))
    assert [t for t, _ in throttled(out)[0]] == ["j/1", "j/2"]
    settle(sim, out)  # j/0 updated; j/1 and j/2 wait for tokens
    assert [untag(t) for t in sim.view()["throttled"]] == ["j/1:update:2", "j/2:update:3"]
    return sim, None


@pytest.mark.parametrize("setup", [_update_pending_with_controller, _update_throttled],
                         ids=["update-awaiting-the-controller", "update-throttled"])
def test_a_job_stopped_while_its_update_waits_ends_stopped(setup):
    sim, _ = setup()
    out = sim.feed(stopped("j"))
    out += settle(sim, out)
    now = T0
    while sim.view()["state"] != JOB_STOPPED:
        now += 500
        assert now < T0 + 30_000, f"stuck: {sim.view()}"
        settle(sim, sim.tick(now))
    assert sim.view()["operations"] == [] and sim.view()["throttled"] == []
    assert of_type(sim.tick(now + sd.REASK_MS), "TaskControlRequested") == [], "a stopped job asks nothing"


def test_a_shrink_undone_before_the_tokens_came_stops_nothing_more():
    sim = job_on(ONE_A_SECOND, 4)
    out = sim.feed(resized("j", 1))
    assert stops(out) == ["j/3"] and [t for t, _ in throttled(out)[0]] == ["j/1", "j/2"]
    settle(sim, out)
    out = sim.feed(resized("j", 4))
    assert stops(out) == [] and sim.view()["throttled"] == [] and sim.view()["operations"] == []
    out += settle(sim, out, Allocator(["m9"]))
    for now in (T0 + 1_000, T0 + 2_000, T0 + 5_000):
        assert stops(settle(sim, sim.tick(now))) == []
    assert sim.tasks() == {"j/0": ("RUNNING", "m1"), "j/1": ("RUNNING", "m2"), "j/2": ("RUNNING", "m3"),
                           "j/3": ("RUNNING", "m9")}, "j/1, j/2 never stopped; j/3 had left: a new one is placed"
    assert all(t["reason"] == "" for t in sim.view()["tasks"]) and sim.view()["state"] == "running"


@pytest.mark.parametrize("intent, final", [(resized("j", 1), "running"), (stopped("j"), JOB_STOPPED)],
                         ids=["shrink", "job-stop"])
def test_a_task_waiting_for_its_stop_token_that_fails_is_stopped_at_once(intent, final):
    sim = job_on(ONE_A_SECOND, 3)
    out = sim.feed(intent)
    assert stops(out) == ["j/2"] and ("j/1", tc.OP_STOP) in throttled(out)[0]
    settle(sim, out)
    out = sim.feed(report("j/1", "FAILED", "m2", exit_code=1))
    assert stops(out) == [], "nothing runs: no STOP, no token"
    assert ("j/1", "STOPPED") in [(e.payload["task_id"], e.payload["state"]) for e in of_type(out, "TaskStateChanged")]
    assert "j/1" not in {o["task"] for o in sim.view()["operations"]}
    now = T0
    while sim.view()["state"] != final:
        now += 500
        assert now < T0 + 10_000, f"stuck: {sim.view()}"
        settle(sim, sim.tick(now))
    assert sim.view()["throttled"] == []


# -- a controller's maintenance choices are paced; the deadline is not ---------------------------------------------

def test_maintenance_stop_and_move_choices_take_tokens_the_deadline_does_not():
    sim = job_on(ONE_A_SECOND, 4, controller=CTL, max_unavailable=4)
    alloc = Allocator(["m7", "m8"])
    (r,) = requests(sim.feed(maintenance(["m1", "m2", "m3"])))
    out = sim.feed(ack_with(r.sequence, [("j/0", tc.CHOICE_STOP), ("j/1", tc.CHOICE_MOVE), ("j/2", tc.CHOICE_STOP)]))
    assert stops(out) == ["j/0"]
    assert throttled(out)[0] == [("j/1", tc.OP_STOP), ("j/2", tc.OP_STOP)]
    assert sim.view()["operations"][0]["reason"] == REASON_MACHINE_MAINTENANCE
    settle(sim, out, alloc)
    out = sim.tick(T0 + 1_000)
    assert stops(out, REASON_MACHINE_MAINTENANCE) == ["j/1"], "the MOVE choice waited for its token"
    out += settle(sim, out, alloc)
    assert sim.tasks()["j/1"] == ("RUNNING", "m7")
    assert sim.tasks()["j/2"] == ("RUNNING", "m3") and sim.view()["throttled"], "j/2 waits for the next token"
    out = sim.tick(DEADLINE)  # the deadline comes before j/2's token would (the timer ticks late here)
    assert stops(out) == ["j/2"] and stops(out, REASON_MAINTENANCE_DEADLINE) == ["j/2"]
    settle(sim, out, alloc)
    assert sim.view()["throttled"] == [] and sim.view()["operations"] == []
    assert sim.tasks() == {"j/0": ("STOPPED", "m1"), "j/1": ("RUNNING", "m7"), "j/2": ("STOPPED", "m3"),
                           "j/3": ("RUNNING", "m4")}
    out = sim.feed(ended(["m1", "m2", "m3"]))
    assert sorted((e.payload["task_id"], e.payload["reason"]) for e in of_type(out, "TaskCommanded")) == [
        ("j/0", REASON_MAINTENANCE_ENDED), ("j/2", REASON_MAINTENANCE_ENDED)]
    settle(sim, out, alloc)
    assert all(s == "RUNNING" for s, _ in sim.tasks().values())


def test_the_deadline_stops_a_retiring_task_still_waiting_for_its_token():
    sim = job_on(ONE_A_SECOND, 3)
    sim.feed(maintenance(["m2"]))
    out = sim.feed(resized("j", 1))
    assert stops(out) == ["j/2"]
    settle(sim, out)
    out = sim.tick(DEADLINE)
    assert stops(out, REASON_MAINTENANCE_DEADLINE) == ["j/1"]
    settle(sim, out)
    assert sim.tasks() == {"j/0": ("RUNNING", "m1")} and sim.view()["throttled"] == []


def test_a_task_waiting_to_stop_for_a_maintenance_that_crashes_is_held():
    sim = job_on(ONE_A_SECOND, 3, controller=CTL, max_unavailable=3)
    (r,) = requests(sim.feed(maintenance(["m1", "m2"])))
    settle(sim, sim.feed(ack_with(r.sequence, [("j/0", tc.CHOICE_STOP), ("j/1", tc.CHOICE_STOP)])))
    out = sim.feed(report("j/1", "FAILED", "m2", exit_code=1))
    assert of_type(out, "TaskCommanded") == [], "held: no restart, no stop"
    assert sim.view()["throttled"] == [] and sim.view()["operations"] == []
    out = sim.feed(ended(["m1", "m2"]))
    assert sorted(e.payload["task_id"] for e in of_type(out, "TaskCommanded")) == ["j/0", "j/1"]


def test_a_waiting_maintenance_stop_is_unhealthy_to_the_controller():
    """A task whose chosen stop waits for a token still runs, but the controller must count it as down: the
    next request lists it unhealthy (a leader-last controller would otherwise move a second task)."""
    sim = job_on(ONE_A_SECOND, 3, controller=CTL, max_unavailable=3)
    (r,) = requests(sim.feed(maintenance(["m1", "m2", "m3"])))
    out = sim.feed(ack_with(r.sequence, [("j/0", tc.CHOICE_MOVE), ("j/1", tc.CHOICE_MOVE)]))
    assert stops(out) == ["j/0"]
    out = sim.feed(spec_changed("j", 3, version=2, controller=CTL, max_unavailable=3))
    (r2,) = requests(out)
    assert "j/1" in r2.unhealthy and "j/0" in r2.unhealthy


# -- notices name what still awaits a choice; a task running again is news ---------------------------------------

def test_notices_name_the_tasks_awaiting_a_choice_and_a_move_done_asks_for_the_next():
    sim = job_on(ONE_A_SECOND, 3, controller=CTL)
    alloc = Allocator(["m7", "m8"])
    (r1,) = requests(sim.feed(maintenance(["m1", "m2"])))
    assert r1.notices[0].task_ids == ("j/0", "j/1") and r1.notices[0].expected_duration_ms == 900_000
    out = sim.feed(ack_with(r1.sequence, [("j/0", tc.CHOICE_MOVE)]))
    assert requests(out) == [], "a choice made is not news"
    log = settle(sim, out, alloc)
    assert sim.tasks()["j/0"] == ("RUNNING", "m7")
    (r2,) = requests(log)  # j/0 runs elsewhere: the controller may choose its next move
    assert r2.notices[0].task_ids == ("j/1",) and r2.unhealthy == ()
    out = sim.tick(T0 + 2_000)
    out += sim.feed(ack_with(r2.sequence, [("j/1", tc.CHOICE_MOVE)]), T0 + 2_000)
    log = settle(sim, out, alloc)
    assert requests(log) == [], "nothing left to choose: a task running again is no news"
    assert sim.tasks() == {"j/0": ("RUNNING", "m7"), "j/1": ("RUNNING", "m8"), "j/2": ("RUNNING", "m3")}


# -- a decision made again that commands otherwise -----------------------------------------------------------------

def test_a_shrink_decided_again_with_fewer_tokens_commands_under_an_id_of_its_own():
    """The kill storm's conflicting duplicate (stop 42): a shard decided a shrink, was stopped before it stored its
    state, and decided the shrink again from a state where the job's bucket held fewer tokens (its batch read in
    another order): a TasksCommanded with two STOPs, then one with one STOP, under one id, and readers kept the
    first. The id of a command batch holds a digest of its commands: the second decision is another event (carried
    out as well: the agent stops what it is told to); the same decision made again has the same id."""
    sim = job_on(THREE_THEN_ONE_A_SECOND, 3)
    job = sim.state.jobs["j"]
    spent = limiter.take(job.bucket, THREE_THEN_ONE_A_SECOND.job, sim.now, 2)  # one token left of three
    fewer = sm.state_of([replace(job, bucket=spent)], sim.state.entitlements.values())
    shrink = resized("j", 1)
    first, same, other = (of_type(sd.decide(s, shrink, sim.now, limits=THREE_THEN_ONE_A_SECOND)[1], "TasksCommanded")
                          for s in (sim.state, sim.state, fewer))
    assert [len(e.payload["commands"]) for e in (*first, *other)] == [2, 1]
    assert [e.event_id for e in same] == [e.event_id for e in first]
    assert other[0].event_id != first[0].event_id
