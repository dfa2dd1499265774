"""The ReBalancer's pure solver (processors/rebalancer/solver.py): tables of scopes and what a plan must do."""
from collections import Counter
from dataclasses import replace

import pytest

from bench.rebalance_solve import hot_spot_scope
from processors.rebalancer import solver as s
from processors.rebalancer.solver import Goals, JobRule, MachineLoad, Scope, TaskLoad, after_moves, balance, solve

CPU, MEM = 16_000, 65_536
GOALS = Goals(target_ratio=1.10, trigger_ratio=1.15, max_move_fraction=0.5, deterministic_limit=2.0)


def machine(mid, msb="msb1", rack="r1", dc="dc1", type_="skylake", cpu=CPU, mem=MEM, open_=True):
    return MachineLoad(mid, dc, msb, rack, type_, cpu, mem, 0, 0, open_)


def scope(machines, placed, jobs=None, **task_kw):
    """``placed``: (task, machine, cpu, mem) rows; each machine's used capacity follows from them."""
    tasks = [TaskLoad(t, t.rsplit("/", 1)[0], m, cpu, mem, **task_kw.get(t, {})) for t, m, cpu, mem in placed]
    used = Counter()
    usedm = Counter()
    for t in tasks:
        used[t.machine] += t.cpu
        usedm[t.machine] += t.mem
    ms = tuple(replace(m, cpu_used=used[m.id], mem_used=usedm[m.id]) for m in machines)
    return Scope("e1", ms, tuple(tasks), jobs or {t.job: JobRule() for t in tasks})


def row(job, i, m, cpu=1000, mem=1000):
    return (f"{job}/{i}", m, cpu, mem)


def filled(m, job, n, start=0, **kw):
    return [row(job, start + i, m, **kw) for i in range(n)]


def check(plan, sc, goals=GOALS):
    """What every plan must satisfy, whatever the case: capacity, caps, no move to a banned machine or its own."""
    after = {m.id: m for m in after_moves(sc.machines, plan.moves)}
    assert all(m.cpu_used <= m.cpu_capacity and m.mem_used <= m.mem_capacity for m in after.values())
    assert len(plan.moves) <= goals.move_cap(plan.before.tasks)
    tasks = {t.id: t for t in sc.tasks}
    for mv in plan.moves:
        t = tasks[mv.task_id]
        assert t.movable is None and mv.from_machine == t.machine != mv.to_machine
        assert mv.to_machine not in t.banned and after[mv.to_machine].open
    assert len({mv.task_id for mv in plan.moves}) == len(plan.moves)
    return after


# -- cases: (scope, goals, expectation) ---------------------------------------------------------------------------

M4 = [machine(f"m{i}") for i in range(1, 5)]


def case_hot_spot():
    sc = scope(M4, filled("m1", "a", 12) + filled("m2", "a", 4, 12) + filled("m3", "a", 4, 16) + filled("m4", "a", 4, 20))
    return sc, GOALS


CASES = {
    # name: (scope, goals, status, moves, highest load after)
    "balanced-left-alone": (scope(M4, [r for i, m in enumerate(M4) for r in filled(m.id, "a", 4, 4 * i)]), GOALS,
                            s.STATUS_BALANCED, 0, 0.25),
    "hot-spot-spread-out": (*case_hot_spot(), s.STATUS_OPTIMAL, 6, 6 / 16),
    "empty-scope": (Scope("e1", (), ()), GOALS, s.STATUS_BALANCED, 0, 0.0),
    "nothing-hot-enough": (scope(M4, filled("m1", "a", 4) + filled("m2", "a", 1, 4)), GOALS, s.STATUS_COOL, 0, 0.25),
    "nothing-movable": (scope(M4, filled("m1", "a", 12) + filled("m2", "a", 4, 12),
                              **{f"a/{i}": {"movable": s.TASK_JOB_NOT_RUNNING} for i in range(12)}),
                        GOALS, s.STATUS_NO_MOVE, 0, 12 / 16),
    "no-room-in-memory": (scope(M4, filled("m1", "a", 12) + [row("b", 0, "m2", 1000, MEM), row("b", 1, "m3", 1000, MEM),
                                                             row("b", 2, "m4", 1000, MEM)]),
                          GOALS, s.STATUS_NO_MOVE, 0, 12 / 16),
    "move-cap-limits-the-fix": (case_hot_spot()[0], replace(GOALS, max_move_fraction=0.1), s.STATUS_OPTIMAL, 2,
                                10 / 16),
    "greedy-alone": (case_hot_spot()[0], replace(GOALS, deterministic_limit=0.0), s.STATUS_GREEDY, 6, 6 / 16),
}


@pytest.mark.parametrize("sc, goals, status, n_moves, top", CASES.values(), ids=CASES)
def test_plans(sc, goals, status, n_moves, top):
    plan = solve(sc, goals)
    assert plan.status == status
    assert len(plan.moves) == n_moves
    after = check(plan, sc, goals)
    assert max((m.cpu_used / m.cpu_capacity for m in after.values() if m.open), default=0.0) == pytest.approx(top)
    assert plan.after == balance(after.values(), plan.before.tasks)


def test_hot_spot_reaches_the_target_with_few_moves():
    sc, goals = case_hot_spot()
    plan = solve(sc, goals)
    assert plan.before.ratio == pytest.approx(12 / 6) and plan.after.ratio <= goals.target_ratio
    assert {mv.from_machine for mv in plan.moves} == {"m1"}


def test_requirements_decide_where_a_task_may_go():
    ms = [machine("m1", dc="dc1"), machine("m2", dc="dc1"), machine("m3", dc="dc2"), machine("m4", dc="dc2")]
    sc = scope(ms, filled("m1", "a", 12) + filled("m2", "a", 2, 12) + filled("m3", "b", 2) + filled("m4", "b", 2, 2),
               jobs={"a": JobRule(requirements={"dc": "dc1"}), "b": JobRule()})
    plan = solve(sc, GOALS)
    assert plan.moves and all(mv.to_machine == "m2" for mv in plan.moves)


def test_spread_is_never_made_worse():
    """Job ``a`` spreads over MSBs: 6 in msb1 on m1 (hot), 6 in msb2. A move to msb3 would leave msb3 ... fine, but a
    move from msb2 into msb1 would not: the plan keeps every MSB at or under the fullest one today."""
    ms = [machine("m1", msb="msb1"), machine("m2", msb="msb1"), machine("m3", msb="msb2"), machine("m4", msb="msb2"),
          machine("m5", msb="msb3")]
    placed = filled("m1", "a", 6) + filled("m3", "a", 6, 6) + filled("m1", "h", 8) + filled("m4", "f", 2)
    sc = scope(ms, placed, jobs={"a": JobRule(spread="msb"), "h": JobRule(spread="msb"), "f": JobRule()})
    plan = solve(sc, GOALS)
    check(plan, sc)
    assert plan.moves
    for job in ("a", "h"):
        before = Counter(m.msb for t in sc.tasks if t.job == job for m in sc.machines if m.id == t.machine)
        moved = {mv.task_id: mv.to_machine for mv in plan.moves}
        msb = {m.id: m.msb for m in sc.machines}
        after = Counter(msb[moved.get(t.id, t.machine)] for t in sc.tasks if t.job == job)
        assert max(after.values()) <= max(before.values())


def test_no_bounce_keeps_a_task_off_a_machine_it_left():
    sc = scope(M4, filled("m1", "a", 12) + filled("m2", "a", 2, 12),
               **{f"a/{i}": {"banned": frozenset({"m2", "m3"})} for i in range(12)})
    plan = solve(sc, GOALS)
    check(plan, sc)
    assert plan.moves and all(mv.to_machine == "m4" for mv in plan.moves)


def excess(plan, sc, goals=GOALS):
    """CPU above the target load summed over the machines after ``plan`` (the model's objective)."""
    allowed = goals.target_ratio * plan.before.mean_load
    return sum(max(0, m.cpu_used - int(allowed * m.cpu_capacity)) for m in after_moves(sc.machines, plan.moves))


def test_the_solver_beats_the_greedy_warm_start():
    """Two hot machines: m2 (14 small tasks, hottest) and m1 (3 big ones). m1's tasks fit only m3 in memory; m2's
    fit m3 and m4. The greedy stage serves m2 first and spreads its tasks over m3 and m4, so that m3 has little
    room left for a big task (m3 ends above the target too); the model sends more of m2's tasks to m4 and leaves
    m3 the room."""
    ms = [machine("m1"), machine("m2"), machine("m3"), machine("m4", mem=8_000)]
    placed = ([row("big", i, "m1", 4000, 20_000) for i in range(3)] + filled("m2", "small", 14, mem=100)
              + filled("m4", "y", 1, mem=100))
    sc = scope(ms, placed)
    greedy = solve(sc, replace(GOALS, deterministic_limit=0.0))
    best = solve(sc, GOALS)
    check(best, sc)
    assert best.status == s.STATUS_OPTIMAL
    assert excess(best, sc) < excess(greedy, sc)
    assert best.after.max_load <= greedy.after.max_load


def test_the_same_scope_gives_the_same_plan():
    """Deterministic: one worker, a seed, a deterministic work limit (only the wall time may differ)."""
    sc = hot_spot_scope(200, hot=0.05, seed=3)
    a, b = solve(sc, Goals()), solve(sc, Goals())
    assert a.moves and replace(a, solve_ms=0) == replace(b, solve_ms=0)


def test_a_region_of_200_machines_meets_the_goal():
    """The issue's goal on the bench's scope: max/mean <= 1.15 moving at most 5 % of the tasks, well within 10 s."""
    sc = hot_spot_scope(200, hot=0.05)
    plan = solve(sc, Goals())
    check(plan, sc, Goals())
    assert plan.before.ratio > 1.6
    assert plan.after.ratio <= 1.15 and len(plan.moves) <= 0.05 * len(sc.tasks)
    assert plan.status in (s.STATUS_OPTIMAL, s.STATUS_FEASIBLE) and not plan.wall_limited


BAD_GOALS = {
    "target-below-1": dict(target_ratio=0.9),
    "target-above-trigger": dict(target_ratio=1.3, trigger_ratio=1.2),
    "negative-fraction": dict(max_move_fraction=-0.1),
    "no-targets": dict(targets_per_task=0),
}


@pytest.mark.parametrize("kw", BAD_GOALS.values(), ids=BAD_GOALS)
def test_bad_goals_are_refused(kw):
    with pytest.raises(ValueError):
        Goals(**kw)
