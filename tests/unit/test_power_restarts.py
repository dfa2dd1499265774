"""A power loss and its end through the scheduler's pure decisions: the tasks on the dark machines are gone at once
(FAILED, out of discovery) and move as the shard's limiter allows; while the power is off their placements are
refused; when it is back they restart at the shard's rate (a parked restart takes a shard token,
``work.retry_parked(paced=True)``), not all at once. The harness is the scheduler tests' (``Sim``, ``big_job``)."""
import pytest

from processors.scheduler.decide import retry_unplaced
from processors.taskcontrol.limiter import Limits, Rate
from test_scheduler_decide import ENT, batched_reactions, commands, ev, of_type, rejected, submit, unavailability
from test_taskcontrol_scheduler import big_job

N = 120
SHARD = Rate(per_minute=600, burst=40)  # 10 a second
LIMITS = Limits(job=Rate(per_minute=60_000, burst=10_000), shard=SHARD)  # the shard's bucket is the one that binds
NO_MACHINE = "no_feasible_machine"


def allocated(request, placements):
    """The allocator's TasksAllocated for ``request``: {task: machine} (big_job's topology: dc1, msb i%3, rack ri)."""
    p = request.payload
    return ev("TasksAllocated", {"request_id": p["request_id"], "job_id": p["job_id"], "placements": [
        {"task_id": t, "machine_id": m, "dc": "dc1", "msb": f"msb{(int(m[1:]) - 1) % 3}", "rack": f"r{int(m[1:]) - 1}"}
        for t, m in placements.items()]}, producer="allocator", entity=p["request_id"])


def asked(out):
    return [t for e in of_type(out, "AllocationRequested") for t in e.payload["place_task_ids"]]


def starts(out):
    return [c["task_id"] for c in commands(out) if c["command"] == "START"]


def answer(sim, out, now, home, power_on):
    """The allocator's answers to ``out``: with the power off nothing fits; back on, each task on its machine."""
    started = []
    todo = list(out)
    while todo:
        nxt = []
        for e in of_type(todo, "AllocationRequested"):
            ids = e.payload["place_task_ids"]
            if ids:
                nxt.append(allocated(e, {t: home[t] for t in ids}) if power_on else
                           rejected(e, ids, NO_MACHINE, "every machine of the job's DC is off"))
        if power_on:
            nxt += batched_reactions(todo)
        started += starts(todo)
        todo = [x for e in nxt for x in sim.feed(e, now)]
    return started


def test_tasks_of_a_dc_that_lost_its_power_restart_at_the_shards_rate_when_it_is_back():
    sim = big_job(N, LIMITS)
    home = {f"j/{i}": f"m{i + 1}" for i in range(N)}
    t0 = sim.now
    out = sim.feed(unavailability(list(home.values()), "POWER"), t0)
    assert {s for s, _ in sim.tasks().values()} <= {"FAILED", "PENDING"}, "gone at once"
    assert len(asked(out)) == SHARD.burst  # the moves, as the shard's bucket allows
    answer(sim, out, t0, home, power_on=False)
    now = t0
    for _ in range(20):  # 20 s dark: the timer asks again, at the shard's rate; nothing fits
        now += 1000
        sim.state, out = retry_unplaced(sim.state, now, limits=LIMITS)
        assert len(asked(out)) <= 10
        answer(sim, out, now, home, power_on=False)
    assert not any(s == "RUNNING" for s, _ in sim.tasks().values())
    back, total, per_tick = now, 0, []
    assert sim.feed(ev("MachinesStatusChanged", {  # the Resource Broker's power_restored: the machines UP again
        "status": "UP", "reason": "power_restored",
        "machines": [{"machine_id": m, "previous_status": "DOWN"} for m in sorted(home.values())]},
        producer="resourcebroker", ent=ENT, entity=ENT), back) == []  # nothing restarts at once: the timer paces
    while total < N:  # power back: every task restarts, never faster than burst + rate · elapsed
        now += 1000
        assert now - back <= 60_000, f"only {total} of {N} restarted after 60 s"
        sim.state, out = retry_unplaced(sim.state, now, limits=LIMITS)
        n = len(answer(sim, out, now, home, power_on=True))
        total += n
        per_tick.append(n)
        assert total <= SHARD.burst + SHARD.per_minute * (now - back) // 60_000
    assert {s for s, _ in sim.tasks().values()} == {"RUNNING"}
    assert max(per_tick) <= SHARD.burst + 10 and len([n for n in per_tick if n]) >= (N - SHARD.burst) // 10, per_tick
    assert {m for _, m in sim.tasks().values()} == set(home.values())  # each back on its own machine


def test_parked_tasks_that_never_ran_are_retried_without_tokens():
    """Only restarts are paced: tasks of a new job waiting for room are asked again all at once, as before."""
    sim = big_job(1, LIMITS)
    out = sim.feed(unavailability(["m1"], "POWER"))
    answer(sim, out, sim.now, {"j/0": "m1"}, power_on=False)

    (req,) = of_type(sim.feed(submit("k", 250)), "AllocationRequested")
    sim.feed(rejected(req, req.payload["place_task_ids"], "quota_exceeded", "e1 holds 3 of 3 machines"))
    sim.state, out = retry_unplaced(sim.state, sim.now + 10_000, limits=LIMITS)
    assert len([t for t in asked(out) if t.startswith("k/")]) == 250
    assert [t for t in asked(out) if t.startswith("j/")] == ["j/0"]  # the restart, with a token


def ended(machines, ue="ue1"):
    return ev("UnavailabilityEnded", {"unavailability_id": ue, "machine_ids": list(machines)},
              producer="resourcebroker", entity=ue)


def machines_up(machines):
    return ev("MachinesStatusChanged", {"status": "UP", "reason": "power_restored", "machines": [
        {"machine_id": m, "previous_status": "DOWN"} for m in machines]}, producer="resourcebroker", entity=ENT)


@pytest.mark.parametrize("order", [
    ("started", "up", "ended"),  # the Resource Broker's order
    ("up", "started", "ended"),  # machines and unavailability are two topics: the UP may be read first
    ("started", "ended", "up"),
])
@pytest.mark.parametrize("kind", ["POWER", "FAILURE"])
def test_a_machine_is_up_once_its_ue_ended_and_its_up_read_whatever_their_order(order, kind):
    sim = big_job(3, LIMITS)
    dark = ["m1", "m2"]
    feeds = {"started": unavailability(dark, kind), "up": machines_up(dark), "ended": ended(dark)}
    for step in order:
        sim.feed(feeds[step], sim.now)
    assert not (set(dark) & set(sim.state.machines_down)), dict(sim.state.machines_down)
