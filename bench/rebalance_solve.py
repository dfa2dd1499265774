"""How long the ReBalancer's solver takes on one entitlement of N machines with a CPU hot spot (no broker).

    .venv/bin/python bench/rebalance_solve.py                       # 200 and 10,000 machines, a table
    .venv/bin/python bench/rebalance_solve.py --machines 10000 --hot 0.05 --json

The scope is what a packing allocator leaves: every machine holds memory-heavy tasks (1 core, 7,000 MiB; 9 of them
on a 16-core, 64 GiB machine: 56 % CPU, 96 % memory), and a CPU-heavy, memory-light job (1 core, 100 MiB) was
packed 7 tasks to a machine onto ``--hot`` of the machines (100 % CPU): max/mean about 1.7. The plan must bring
max/mean to at most 1.15 moving at most 5 % of the tasks, with the jobs spread over MSBs kept as well spread as they
are. Printed per size: machines, tasks, the solve's wall time (stages 1-5 of ``solver.solve``) and this process's
CPU time over it (on a shared machine, the figure a busy neighbour does not inflate), the model's deterministic
time, candidates and variables, moves, max/mean before and after, and the status. The baseline in
the same run is the greedy stage alone (``solver.solve`` with a deterministic time of 0: the warm start).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from processors.rebalancer.solver import Goals, JobRule, MachineLoad, Scope, TaskLoad, solve  # noqa: E402

CPU, MEM = 16_000, 65_536
BASE_TASK = (1_000, 7_000)  # memory-heavy: 9 fill a machine's memory
HOT_TASK = (1_000, 100)  # CPU-heavy, memory-light: the allocator packs 7 more onto a machine
BASE_PER_MACHINE, HOT_PER_MACHINE = 9, 7
RACK, MSB = 10, 5  # machines per rack, racks per MSB (as resourcebroker.region lays a region out)


def hot_spot_scope(machines: int, hot: float = 0.05, seed: int = 7, base_job_tasks: int = 450) -> Scope:
    """A scope of ``machines`` with ``hot`` of them packed full by a CPU-heavy job (see the module doc)."""
    rnd = random.Random(seed)
    ms, tasks = [], []
    for i in range(machines):
        rack, msb = i // RACK, i // (RACK * MSB)
        ms.append(MachineLoad(f"dc1-msb{msb + 1}-r{rack % MSB + 1:02d}-m{i % RACK + 1:03d}", "dc1", f"msb{msb + 1}",
                              f"r{rack % MSB + 1:02d}", "skylake", CPU, MEM, 0, 0))
    n = 0
    for m in ms:
        for _ in range(BASE_PER_MACHINE):
            job = f"e1.base{n // base_job_tasks}"
            tasks.append(TaskLoad(f"{job}/{n % base_job_tasks}", job, m.id, *BASE_TASK))
            n += 1
    hot_ids = sorted(rnd.sample([m.id for m in ms], max(1, round(machines * hot))))
    k = 0
    for mid in hot_ids:
        for _ in range(HOT_PER_MACHINE):
            tasks.append(TaskLoad(f"e1.hot/{k}", "e1.hot", mid, *HOT_TASK))
            k += 1
    used: dict[str, list[int]] = {m.id: [0, 0] for m in ms}
    for t in tasks:
        used[t.machine][0] += t.cpu
        used[t.machine][1] += t.mem
    ms = [replace(m, cpu_used=used[m.id][0], mem_used=used[m.id][1]) for m in ms]
    jobs = {t.job: JobRule(spread="msb") for t in tasks}
    return Scope("e1", tuple(ms), tuple(tasks), jobs)


def measure(machines: int, hot: float, goals: Goals) -> dict:
    from ortools.sat.python import cp_model  # noqa: F401, PLC0415 - imported before timing (a processor imports it once); start-up cost: ortools (~300 ms), and the unit tests import this module for hot_spot_scope

    t0 = time.monotonic()
    scope = hot_spot_scope(machines, hot)
    built_s = time.monotonic() - t0
    greedy = solve(scope, replace(goals, deterministic_limit=0.0))
    c0 = time.process_time()
    plan = solve(scope, goals)
    cpu_ms = round((time.process_time() - c0) * 1000)  # this process's CPU: what a loaded machine does not inflate
    return {"machines": machines, "tasks": len(scope.tasks), "hot_machines": round(machines * hot),
            "scope_build_s": round(built_s, 2), "solve_ms": plan.solve_ms, "solve_cpu_ms": cpu_ms,
            "work": plan.work,
            "wall_limited": plan.wall_limited, "status": plan.status, "candidates": plan.candidates,
            "variables": plan.variables, "moves": len(plan.moves), "moved_fraction": round(len(plan.moves) / len(scope.tasks), 4),
            "ratio_before": round(plan.before.ratio, 3), "ratio_after": round(plan.after.ratio, 3),
            "baseline_greedy": {"solve_ms": greedy.solve_ms, "moves": len(greedy.moves),
                                "ratio_after": round(greedy.after.ratio, 3), "status": greedy.status}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--machines", type=int, action="append", help="scope size (repeatable; default 200 and 10000)")
    ap.add_argument("--hot", type=float, default=0.05, help="fraction of machines in the hot spot (default 0.05)")
    ap.add_argument("--deterministic-limit", type=float, default=Goals().deterministic_limit)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    goals = Goals(deterministic_limit=args.deterministic_limit)
    from ortools import __version__ as ortools_version  # noqa: PLC0415 - start-up cost: ortools (~300 ms); the unit tests import this module for hot_spot_scope

    rows = [measure(n, args.hot, goals) for n in (args.machines or [200, 10_000])]
    doc = {"conditions": {"cores": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                          "python": platform.python_version(), "ortools": ortools_version,
                          "goals": {"target_ratio": goals.target_ratio, "trigger_ratio": goals.trigger_ratio,
                                    "max_move_fraction": goals.max_move_fraction,
                                    "deterministic_limit": goals.deterministic_limit,
                                    "wall_limit_ms": goals.wall_limit_ms}, "hot": args.hot}, "results": rows}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"conditions: {json.dumps(doc['conditions'])}")
    print(f"{'machines':>9} {'tasks':>8} {'solve ms':>9} {'cpu ms':>7} {'det':>6} {'vars':>7} {'moves':>6} {'moved':>7} "
          f"{'before':>7} {'after':>6} {'status':9} {'greedy ms':>9} {'greedy after':>12}")
    for r in rows:
        g = r["baseline_greedy"]
        print(f"{r['machines']:>9} {r['tasks']:>8} {r['solve_ms']:>9} {r['solve_cpu_ms']:>7} {r['work']:>6} {r['variables']:>7} "
              f"{r['moves']:>6} {r['moved_fraction']:>7.2%} {r['ratio_before']:>7} {r['ratio_after']:>6} "
              f"{r['status']:9} {g['solve_ms']:>9} {g['ratio_after']:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
