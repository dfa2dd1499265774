"""The ReBalancer's model solved by HiGHS (MIP) instead of CP-SAT, on the same scopes: why CP-SAT was chosen.

    .venv/bin/python -m pip install highspy==1.16.0     # not a dependency of Ropewalk: only for this comparison
    .venv/bin/python bench/rebalance_highs.py [--machines 200 --machines 10000] [--hot 0.05]

The same candidates, targets and warm start as ``solver.solve`` (stages 2-4), the same constraints (capacity,
spread, the move cap) and objective (CPU above the target load x (cap + 1) + moves), given to HiGHS with one
thread, a fixed seed, the warm start as its start solution and the solver's wall-clock limit (HiGHS has no
deterministic work limit). Printed beside CP-SAT's ``solve`` on the same scope, in the same run.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rebalance_solve import hot_spot_scope  # noqa: E402
from processors.rebalancer import solver as s  # noqa: E402


def highs_solve(scope: s.Scope, goals: s.Goals) -> dict:  # noqa: C901
    try:
        import highspy  # noqa: PLC0415 - optional dependency: highspy (not a dependency of the project; the script says how to install it)
        import numpy as np  # noqa: PLC0415 - optional dependency: numpy, with highspy
    except ImportError:
        raise SystemExit("bench/rebalance_highs.py needs highspy: .venv/bin/python -m pip install highspy==1.16.0")
    t0 = time.monotonic()
    before = s.balance(scope.machines, len(scope.tasks))
    p = s._Problem(scope, goals, before)
    p.pick_candidates()
    p.pick_targets()
    cap = goals.move_cap(len(scope.tasks))
    hint = s._greedy(p, cap)
    tasks = {t.id: t for t in p.candidates if t.id in p.arcs}
    arcs = [(tid, mid) for tid in sorted(tasks) for mid in p.arcs[tid]]
    into, out_of, by_task = defaultdict(list), defaultdict(list), defaultdict(list)
    for i, (tid, mid) in enumerate(arcs):
        into[mid].append(i)
        out_of[tasks[tid].machine].append(i)
        by_task[tid].append(i)
    touched = sorted(set(into) | set(out_of))
    n_x, n = len(arcs), len(arcs) + len(touched)  # x per arc, then an excess per touched machine
    h = highspy.Highs()
    for opt, val in (("output_flag", False), ("threads", 1), ("random_seed", goals.seed),
                     ("time_limit", goals.wall_limit_ms / 1000)):
        h.setOptionValue(opt, val)
    lower, upper, cost = np.zeros(n), np.ones(n), np.ones(n)
    for j, mid in enumerate(touched):
        m = p.machines[mid]
        upper[n_x + j] = m.cpu_capacity
        cost[n_x + j] = cap + 1
    h.addVars(n, lower, upper)
    h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
    h.changeColsIntegrality(n_x, np.arange(n_x, dtype=np.int32), np.ones(n_x, dtype=np.uint8))
    lo, hi, starts, idx, val = [], [], [], [], []

    def row(low, high, items):
        starts.append(len(idx))
        lo.append(low)
        hi.append(high)
        for j, c in items:
            idx.append(j)
            val.append(c)

    for tid in sorted(by_task):
        row(-math.inf, 1, [(i, 1) for i in by_task[tid]])
    for j, mid in enumerate(touched):
        m = p.machines[mid]
        cpu = [(i, tasks[arcs[i][0]].cpu) for i in into[mid]] + [(i, -tasks[arcs[i][0]].cpu) for i in out_of[mid]]
        mem = [(i, tasks[arcs[i][0]].mem) for i in into[mid]] + [(i, -tasks[arcs[i][0]].mem) for i in out_of[mid]]
        row(-math.inf, m.cpu_capacity - m.cpu_used, cpu)
        row(-math.inf, m.mem_capacity - m.mem_used, mem)
        row(-math.inf, math.floor(p.target_load * m.cpu_capacity) - m.cpu_used, cpu + [(n_x + j, -1)])
    for job, d, ins, outs in p.spread_rows((tid, mid, i) for i, (tid, mid) in enumerate(arcs)):
        row(-math.inf, p.fullest[job] - p.domains[job][d], [(i, 1) for i in ins] + [(i, -1) for i in outs])
    row(-math.inf, cap, [(i, 1) for i in range(n_x)])
    h.addRows(len(lo), np.array(lo), np.array(hi), len(idx), np.array(starts, dtype=np.int32),
              np.array(idx, dtype=np.int32), np.array(val, dtype=float))
    start = np.zeros(n)
    used = s._used_after(p, hint)
    for i, (tid, mid) in enumerate(arcs):
        start[i] = 1.0 if hint.get(tid) == mid else 0.0
    for j, mid in enumerate(touched):
        start[n_x + j] = max(0, used[mid] - math.floor(p.target_load * p.machines[mid].cpu_capacity))
    sol = highspy.HighsSolution()
    sol.col_value = list(start)
    sol.value_valid = True
    h.setSolution(sol)
    h.run()
    x = h.getSolution().col_value
    chosen = {arcs[i][0]: arcs[i][1] for i in range(n_x) if x[i] > 0.5}
    after = s.balance(s.after_moves(scope.machines, s._moves(scope, chosen)), len(scope.tasks))
    return {"status": h.modelStatusToString(h.getModelStatus()), "solve_ms": round((time.monotonic() - t0) * 1000),
            "moves": len(chosen), "ratio_after": round(after.ratio, 3), "variables": n_x}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--machines", type=int, action="append")
    ap.add_argument("--hot", type=float, default=0.05)
    args = ap.parse_args(argv)
    goals = s.Goals()
    rows = []
    for machines in args.machines or [200, 2000, 10_000]:
        scope = hot_spot_scope(machines, args.hot)
        plan = s.solve(scope, goals)
        rows.append({"machines": machines, "tasks": len(scope.tasks),
                     "cp_sat": {"status": plan.status, "solve_ms": plan.solve_ms, "moves": len(plan.moves),
                                "ratio_after": round(plan.after.ratio, 3), "wall_limited": plan.wall_limited},
                     "highs": highs_solve(scope, goals)})
    print(json.dumps({"hot": args.hot, "wall_limit_ms": goals.wall_limit_ms, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
