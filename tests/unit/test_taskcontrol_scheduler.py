"""TaskControl and the rate limiter inside the scheduler's pure decisions (processors/scheduler/decide.py).

The harness is the scheduler tests' ``Sim`` (every input is also checked for determinism, idempotence and
schema validity); the TaskController and the agents are played by hand.
"""
import random
from collections import Counter

import pytest

from processors.scheduler import decide as sd
from processors.scheduler import steps
from processors.scheduler.decide import REASK_MS, retry_unplaced
from processors.scheduler.lifecycle import JOB_RUNNING, JOB_UPDATING
from processors.scheduler.model import first_sequence
from processors.taskcontrol import protocol as tc
from processors.taskcontrol.limiter import (
    REASON_RATE_LIMITED_JOB, REASON_RATE_LIMITED_SHARD, Limits, Rate,
)
from test_scheduler_decide import (  # the scheduler tests' harness (tests/unit is on sys.path)
    ENT, T0, Allocator, Sim, agent_reactions, entitlement, ev, kinds, machine_status, of_type, report, running_job,
    spec_changed, submit, unavailability,
)

CTL = "ctl"


FIRST = first_sequence(T0)  # the jobs here are submitted at T0: their requests count on from this


def ack(job, n, ops, controller=CTL):
    """The controller's ack of the job's ``n``-th request (1-based), or of the request of sequence ``n``."""
    return ev("TaskControlAcked", tc.ack_payload(job, n if n > FIRST else FIRST + n, ops, controller),
              producer=f"taskcontroller/{controller}", entity=job)


def requests(out):
    return [tc.request_of(e.payload) for e in of_type(out, "TaskControlRequested")]


def controlled_job(n=2, **kw):
    return running_job(n, machines=tuple(f"m{i + 1}" for i in range(n)), controller=CTL, **kw)


def settle(sim, out, allocator=None, now=None):
    """Feed agent (and allocator) reactions until quiet; everything emitted on the way."""
    log, todo = [], list(out)
    while todo:
        nxt = list(agent_reactions(todo)) + (list(allocator.reactions(todo)) if allocator else [])
        todo = sim.feed_all(nxt, now)
        log.extend(todo)
    return log


def op_of(req, task):
    return next(o.operation_id for o in req.pending if o.task_id == task)


# -- Figure 8(b) -------------------------------------------------------------------------------------------------

def test_figure_8b_calling_sequence_from_the_log():
    """Twine Figure 8(b): request=[t0,t1] → ack=[t1]; completed=[t1], request=[t0] → ack=[t0]; completed=[t0],
    request=[] → ack=[]. Checked on the log of everything the scheduler emitted and the controller acked."""
    sim = controlled_job(2)
    log = []

    def feed(e):
        log.append(e)
        out = sim.feed(e)
        log.extend(out)
        return out

    out = feed(spec_changed("j", 2, version=2, controller=CTL))
    assert of_type(out, "TaskCommanded") == [], "nothing is stopped before the controller acks"
    (s1,) = requests(out)
    t0, t1 = op_of(s1, "j/0"), op_of(s1, "j/1")
    out = feed(ack("j", 1, [t1]))
    assert kinds(out)[:2] == [("discovery", "j/1", False), ("STOP", "j/1", "m2", 1)]
    for e in settle(sim, out):
        log.append(e)
    out = feed(ack("j", 2, [t0]))
    assert ("STOP", "j/0", "m1", 1) in kinds(out)
    log.extend(settle(sim, out))
    feed(ack("j", 3, []))
    sequence = [(e.type, e.payload["sequence"] - FIRST,
                 [o["task_id"] for o in e.payload["pending_operations"]] if e.type == "TaskControlRequested"
                 else [op.split(":")[0] for op in e.payload["approved_operation_ids"]],
                 [c.split(":")[0] for c in e.payload.get("completed_operation_ids", [])])
                for e in log if e.type in ("TaskControlRequested", "TaskControlAcked")]
    assert sequence == [
        ("TaskControlRequested", 1, ["j/0", "j/1"], []),
        ("TaskControlAcked", 1, ["j/1"], []),
        ("TaskControlRequested", 2, ["j/0"], ["j/1"]),
        ("TaskControlAcked", 2, ["j/0"], []),
        ("TaskControlRequested", 3, [], ["j/0"]),
        ("TaskControlAcked", 3, [], []),
    ]
    assert [o.operation_id for o in requests(log)[1].pending] == [t0], "operation ids are stable across re-asks"
    view = sim.view()
    assert view["state"] == JOB_RUNNING and {t["spec_version"] for t in view["tasks"]} == {2}
    assert view["operations"] == []


# -- acks that do not count --------------------------------------------------------------------------------------

def _asked_twice():
    """A controlled job in an update: request 1 acked with j/1, request 2 (after j/1 completed) outstanding."""
    sim = controlled_job(2)
    (s1,) = requests(sim.feed(spec_changed("j", 2, version=2, controller=CTL)))
    out = sim.feed(ack("j", 1, [op_of(s1, "j/1")]))
    (s2,) = requests(settle(sim, out))
    return sim, s1, s2


IGNORED_ACKS = {  # ack built from (request 1, request 2) → reason
    "stale": (lambda s1, s2: ack("j", 1, [op_of(s1, "j/0")]), tc.REASON_STALE_ACK),
    "from-the-future": (lambda s1, s2: ack("j", 3, [op_of(s2, "j/0")]), tc.REASON_UNKNOWN_SEQUENCE),
    "wrong-controller": (lambda s1, s2: ack("j", 2, [op_of(s2, "j/0")], controller="other"),
                         tc.REASON_WRONG_CONTROLLER),
}


@pytest.mark.parametrize("make, reason", IGNORED_ACKS.values(), ids=IGNORED_ACKS)
def test_acks_that_do_not_count_are_ignored_with_a_reason(make, reason):
    sim, s1, s2 = _asked_twice()
    before = sim.view()
    assert sim.feed(make(s1, s2)) == []
    after = sim.view()
    assert after["tasks"] == before["tasks"] and after["last_ignored"].startswith(reason + ":")


def test_a_duplicate_ack_under_another_event_id_is_ignored():
    sim, s1, s2 = _asked_twice()
    out = sim.feed(ack("j", 2, [op_of(s2, "j/0")]))
    assert ("STOP", "j/0", "m1", 1) in kinds(out)
    assert sim.feed(ack("j", 2, [op_of(s2, "j/0")])) == []
    assert sim.view()["last_ignored"].startswith(tc.REASON_DUPLICATE_ACK + ":")


def test_an_ack_for_a_job_without_controller_is_ignored():
    sim = running_job(2, ("m1", "m2"))
    assert sim.feed(ack("j", 1, ["j/0:update:1"])) == []
    assert sim.view()["last_ignored"].startswith(tc.REASON_NO_CONTROLLER + ":")


def test_approving_what_was_not_asked_does_nothing():
    sim = controlled_job(2)
    (s1,) = requests(sim.feed(spec_changed("j", 2, version=2, controller=CTL)))
    out = sim.feed(ack("j", 1, ["j/0:move:99", "nonsense"]))
    assert of_type(out, "TaskCommanded") == [] and of_type(out, "TaskControlRequested") == []


def test_without_a_controller_nothing_is_asked():
    sim = running_job(3, ("m1", "m2", "m3"))
    out = sim.feed(spec_changed("j", 3, version=2))
    out += settle(sim, out)
    assert of_type(out, "TaskControlRequested") == [] and sim.view()["state"] == JOB_RUNNING


# -- pacing on top of the acks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, max_unavailable", [(3, 1), (4, 2), (5, 2)])
def test_max_unavailable_caps_what_the_controller_approves(n, max_unavailable):
    """The controller approves everything at once; the scheduler still never has more than max_unavailable
    tasks down, counting tasks down for any reason, and finishes without asking again for approved ones."""
    sim = controlled_job(n, max_unavailable=max_unavailable)
    (s1,) = requests(sim.feed(spec_changed("j", n, version=2, controller=CTL, max_unavailable=max_unavailable)))
    todo = sim.feed(ack("j", 1, [o.operation_id for o in s1.pending]))
    worst = 0
    while todo:
        worst = max(worst, sum(t["state"] != "RUNNING" for t in sim.view()["tasks"]))
        nxt = list(agent_reactions(todo))
        todo = []
        for e in nxt:  # one report at a time, checking after each
            todo += sim.feed(e)
            worst = max(worst, sum(t["state"] != "RUNNING" for t in sim.view()["tasks"]))
        acks = [ack("j", r.sequence, []) for r in requests(todo)]
        todo += sim.feed_all(acks)
    assert worst == max_unavailable
    assert {t["spec_version"] for t in sim.view()["tasks"]} == {2} and sim.view()["state"] == JOB_RUNNING


def test_a_crashed_task_counts_against_max_unavailable():
    sim = controlled_job(3)
    sim.feed(report("j/2", "FAILED", "m3", exit_code=1))  # restarted in place: down until it runs again
    (s1,) = requests(sim.feed(spec_changed("j", 3, version=2, controller=CTL)))
    assert "j/2" in s1.unhealthy
    out = sim.feed(ack("j", 1, [o.operation_id for o in s1.pending]))
    assert of_type(out, "TaskCommanded") == [], "one task is down already: max_unavailable=1 is used up"


def test_an_approval_resting_on_a_task_being_down_is_not_taken_once_it_runs_again():
    """The request says j/2 is down (crashed, restarting), so taking it costs nothing and the controller approves its
    update; j/2 runs again before the ack is read: performing it now would take a serving task on a stale picture.
    Found by ``figure14 --pipeline`` when the update began while the scheduler still saw tasks STARTING: every task
    was approved at once. j/0, serving when asked, is performed; j/2's approval is not, and the controller is asked
    again with the present picture."""
    sim = controlled_job(3, max_unavailable=3)
    sim.feed(report("j/2", "FAILED", "m3", exit_code=1))
    (s1,) = requests(sim.feed(spec_changed("j", 3, version=2, controller=CTL, max_unavailable=3)))
    assert "j/2" in s1.unhealthy and "j/0" not in s1.unhealthy
    assert requests(sim.feed(report("j/2", "RUNNING", "m3"))) == []
    out = sim.feed(ack("j", 1, [op_of(s1, "j/0"), op_of(s1, "j/2")]))
    stops = [k for k in kinds(out) if k[0] == "STOP"]
    assert stops == [("STOP", "j/0", "m1", 1)]
    (s2,) = requests(out)
    assert [o.task_id for o in s2.pending] == ["j/1", "j/2"] and "j/2" not in s2.unhealthy
    assert s2.in_flight == (op_of(s1, "j/0"),)
    assert sim.state.jobs["j"].last_ignored.startswith(tc.REASON_RECOVERED_SINCE_ASKED)


# -- machine failures are moves the controller approves --------------------------------------------------------------

def test_a_move_waits_for_the_ack_then_fences_and_reschedules():
    sim = controlled_job(2)
    out = sim.feed(machine_status("m1", "UNHEALTHY"))
    assert kinds(out)[:2] == [("discovery", "j/0", False), ("state", "j/0", "FAILED", "machine_unhealthy")]
    assert of_type(out, "TaskCommanded") == [] and of_type(out, "AllocationRequested") == []
    (r,) = requests(out)
    assert [(o.task_id, o.kind, o.reason) for o in r.pending] == [("j/0", tc.OP_MOVE, "machine_unhealthy")]
    assert r.unhealthy == ("j/0",)
    out = sim.feed(ack("j", 1, [r.pending[0].operation_id]))
    assert kinds(out)[:3] == [("request", ("j/0",), ("j/0",), ("m1",)),
                              ("state", "j/0", "PENDING", "machine_unhealthy"), ("STOP", "j/0", "m1", 1)]
    log = settle(sim, out, Allocator(["m9"]))
    (r2,) = requests(log)
    assert r2.completed == (r.pending[0].operation_id,) and r2.pending == () and r2.unhealthy == ()


def test_planned_maintenance_is_an_advance_notice():
    sim = controlled_job(2)
    notice = ev("UnavailabilityStarted", {"unavailability_id": "ue7", "kind": "MAINTENANCE", "machine_ids": ["m2"],
                                          "start_ms": T0 + 3_600_000, "deadline_ms": T0 + 7_200_000,
                                          "expected_duration_ms": 600_000, "reason": "rack switch"},
                producer="opsplanner", entity="ue7")
    out = sim.feed(notice)
    (r,) = requests(out)
    assert r.notices == (tc.AdvanceNotice("ue7", ("j/1",), T0 + 3_600_000, T0 + 7_200_000, 600_000),)
    assert r.pending == ()
    assert of_type(out, "TaskCommanded") == []


# -- the timer asks again ------------------------------------------------------------------------------------------

def test_an_unanswered_request_is_asked_again_and_its_ack_goes_stale():
    sim = controlled_job(2)
    (s1,) = requests(sim.feed(spec_changed("j", 2, version=2, controller=CTL)))
    assert retry_unplaced(sim.state, T0 + REASK_MS - 1)[1] == []
    state, out = retry_unplaced(sim.state, T0 + REASK_MS)
    (s2,) = requests(out)
    assert s2.sequence == FIRST + 2 and s2.pending == s1.pending
    sim.state = state
    assert sim.feed(ack("j", 1, [op_of(s1, "j/0")])) == []
    assert sim.view()["last_ignored"].startswith(tc.REASON_STALE_ACK)
    assert ("STOP", "j/0", "m1", 1) in kinds(sim.feed(ack("j", 2, [op_of(s2, "j/0")])))


# -- the rate limiter -----------------------------------------------------------------------------------------------

LIMITS = Limits(job=Rate(per_minute=60, burst=5), shard=Rate(per_minute=600, burst=100))


def big_job(n, limits, job="j", sim=None, machines=None):
    """``n`` tasks RUNNING on ``machines`` (default m1..mn), decided under ``limits``."""
    sim = sim or Sim()
    sim.feed = _with_limits(sim, limits)
    machines = machines or tuple(f"m{i + 1}" for i in range(n))
    if ENT not in sim.state.entitlements:
        sim.feed(entitlement())
    (req,) = of_type(sim.feed(submit(job, n)), "AllocationRequested")
    out = sim.feed(ev("TasksAllocated", {"request_id": req.payload["request_id"], "job_id": job, "placements": [
        {"task_id": f"{job}/{i}", "machine_id": m, "dc": "dc1", "msb": f"msb{i % 3}", "rack": f"r{i}"}
        for i, m in enumerate(machines)]}, producer="allocator"))
    sim.feed_all(list(agent_reactions(out)))
    return sim


def _with_limits(sim, limits):
    def feed(event, now=None):
        now = sim.now if now is None else now
        new, out = sd.decide(sim.state, event, now, limits=limits)
        assert sd.decide(sim.state, event, now, limits=limits) == (new, out)
        assert sd.decide(new, event, now, limits=limits)[1] == []
        sim.state = new
        return out
    return feed


def moved(out):
    return [e.payload["task_id"] for e in of_type(out, "TaskStateChanged") if e.payload["state"] == "PENDING"]


def test_a_runaway_failure_never_moves_faster_than_the_limit():
    """2000 machines fail at once: 5 tasks move now, the rest wait (OperationsThrottled says which and why) and
    leave at one a second as the timer ticks; never more than burst + rate · elapsed."""
    n = 2000
    sim = big_job(n, LIMITS)
    out = sim.feed(unavailability([f"m{i + 1}" for i in range(n)]))
    assert len(moved(out)) == 5
    (th,) = of_type(out, "OperationsThrottled")
    assert th.payload["reason"] == REASON_RATE_LIMITED_JOB and th.payload["waiting_count"] == n - 5
    assert len(th.payload["waiting"]) == steps.THROTTLED_LISTED  # the first ones listed: a record of bounded size
    assert [w["task_id"] for w in th.payload["waiting"]][:2] == ["j/5", "j/6"]
    assert th.payload["retry_at_ms"] == T0 + 1000 and th.payload["limit"] == "job: 60/min, burst 5"
    assert {w["kind"] for w in th.payload["waiting"]} == {tc.OP_MOVE}
    total = 5
    for step in range(1, 121):  # the timer every 500 ms for a minute
        now = T0 + step * 500
        sim.state, out = retry_unplaced(sim.state, now, limits=LIMITS)
        total += len(moved(out))
        assert total <= 5 + (now - T0) * 60 // 60_000
    assert total == 5 + 60
    assert sim.view()["throttled"] and len(sim.view()["throttled"]) == n - total

FLOOD = Limits(job=Rate(per_minute=1_200, burst=20), shard=Rate(per_minute=60_000, burst=500))


class RefBucket:
    """An independent token bucket (the semantics processors/taskcontrol/limiter.py documents, not its code):
    ``burst`` operations, refilled at ``per_minute``; a move the scheduler performs must find a whole token here."""

    def __init__(self, rate, now):
        self.rate, self.tokens_x60k, self.at = rate, rate.burst * 60_000, now  # in 1/60000 of an operation

    def refill(self, now):
        self.tokens_x60k = min(self.rate.burst * 60_000, self.tokens_x60k + (now - self.at) * self.rate.per_minute)
        self.at = now

    def take(self, k, what):
        assert self.tokens_x60k >= k * 60_000, f"{what}: {k} moves with {self.tokens_x60k / 60_000:.3f} tokens"
        self.tokens_x60k -= k * 60_000

    @property
    def empty(self):
        return self.tokens_x60k < 60_000


def test_a_flood_of_ten_thousand_moves_is_paced_and_all_performed():
    """10,000 tasks (100 jobs of 100) lose their machines in one event. On a timeline of irregular timer ticks,
    after every decision: the moves so far never exceed burst + rate · elapsed, for the shard and for each job,
    and each decision's moves are covered by tokens of independently kept buckets; no task moves twice; the
    limiter wastes nothing (while moves wait, the reference shard bucket or every waiting job's is empty); and
    every move is eventually performed, nothing left throttled."""
    jobs, per_job = 100, 100
    n = jobs * per_job
    sim = None
    for j in range(jobs):
        sim = big_job(per_job, FLOOD, job=f"j{j:03d}", sim=sim,
                      machines=tuple(f"m{j * per_job + i + 1}" for i in range(per_job)))
    done: Counter = Counter()
    ref_shard = RefBucket(FLOOD.shard, T0)
    ref_job = {f"j{j:03d}": RefBucket(FLOOD.job, T0) for j in range(jobs)}

    def check(out, now):
        now_moved = moved(out)
        done.update(now_moved)
        for b in (ref_shard, *ref_job.values()):
            b.refill(now)
        ref_shard.take(len(now_moved), f"shard at +{now - T0} ms")
        for job, k in Counter(t.split("/")[0] for t in now_moved).items():
            ref_job[job].take(k, f"{job} at +{now - T0} ms")
        elapsed = now - T0
        assert max(done.values()) == 1, "a task moved twice"
        assert sum(done.values()) <= FLOOD.shard.burst + elapsed * FLOOD.shard.per_minute // 60_000
        per = Counter(t.split("/")[0] for t in done)
        assert max(per.values()) <= FLOOD.job.burst + elapsed * FLOOD.job.per_minute // 60_000
        waiting = [j for j in sim.state.jobs.values() if j.throttled]
        assert sum(len(j.throttled) for j in waiting) == n - sum(done.values())
        if waiting:  # work-conserving: something really stops the next move
            assert ref_shard.empty or all(ref_job[j.id].empty for j in waiting), f"tokens unused at +{elapsed} ms"

    out = sim.feed(unavailability([f"m{i + 1}" for i in range(n)]))
    check(out, T0)
    assert sum(done.values()) == FLOOD.shard.burst
    first = FLOOD.shard.burst // FLOOD.job.burst  # jobs served, in order, before the shard's burst is spent
    assert {e.payload["job_id"]: e.payload["reason"] for e in of_type(out, "OperationsThrottled")} == {
        f"j{j:03d}": REASON_RATE_LIMITED_JOB if j < first else REASON_RATE_LIMITED_SHARD for j in range(jobs)}
    ticks, now, rng = 0, T0, random.Random(7)
    while sum(done.values()) < n:
        now += rng.randint(50, 700)
        ticks += 1
        assert ticks < 200, f"only {sum(done.values())} of {n} moved by {now - T0} ms"
        sim.state, out = retry_unplaced(sim.state, now, limits=FLOOD)
        check(out, now)
    assert set(done) == {f"j{j:03d}/{i}" for j in range(jobs) for i in range(per_job)}
    assert not any(j.throttled for j in sim.state.jobs.values())
    # not before the shard's rate allows (how late is bounded tick by tick by the work-conserving check: the
    # tail is the last jobs' own 20-a-second buckets, served after the shard's tokens went to earlier jobs)
    assert now - T0 >= (n - FLOOD.shard.burst) * 60_000 // FLOOD.shard.per_minute


def test_the_shard_bucket_is_shared_by_all_jobs():
    limits = Limits(job=Rate(60, 50), shard=Rate(60, 6))
    sim = big_job(4, limits, job="a", machines=("m1", "m2", "m3", "m4"))
    big_job(4, limits, job="b", sim=sim, machines=("m5", "m6", "m7", "m8"))
    out = sim.feed(unavailability(["m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8"]))
    assert len(moved(out)) == 6 - 0  # the shard's burst, whatever the job
    throttled = of_type(out, "OperationsThrottled")
    assert [e.payload["reason"] for e in throttled] == [REASON_RATE_LIMITED_SHARD]


ONE_A_SECOND = Limits(job=Rate(60, 1), shard=Rate(600, 100))


def test_a_throttled_restart_waits_for_a_token():
    sim = big_job(1, ONE_A_SECOND, machines=("m1",))
    out = sim.feed(report("j/0", "FAILED", "m1", exit_code=1))
    assert ("RESTART", "j/0", "m1", 1) in kinds(out)
    out = sim.feed(report("j/0", "FAILED", "m1", exit_code=1), T0 + 10)  # crash-looping: no token left
    assert [k for k in kinds(out) if k[0] == "RESTART"] == []
    (th,) = of_type(out, "OperationsThrottled")
    assert [(w["task_id"], w["kind"]) for w in th.payload["waiting"]] == [("j/0", tc.OP_RESTART)]
    _, out = retry_unplaced(sim.state, th.payload["retry_at_ms"] - 1, limits=ONE_A_SECOND)
    assert out == []
    _, out = retry_unplaced(sim.state, th.payload["retry_at_ms"], limits=ONE_A_SECOND)
    assert ("RESTART", "j/0", "m1", 1) in kinds(out)


def test_the_ops_list_shows_in_job_status():
    sim = controlled_job(2)
    sim.feed(spec_changed("j", 2, version=2, controller=CTL))
    view = sim.view()
    assert view["state"] == JOB_UPDATING and view["controller"] == CTL
    assert [(o["task"], o["kind"], o["state"]) for o in view["operations"]] == [
        ("j/0", tc.OP_UPDATE, "pending"), ("j/1", tc.OP_UPDATE, "pending")]
