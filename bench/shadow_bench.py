"""Shadow replay of a recorded bench workload: does replaying the log with the live policy reproduce it, decision for
decision, and what does another policy change?

    .venv/bin/python bench/shadow_bench.py [--machines 1000] [--burst 20] [--policy "scores=spread,least_loaded"] [--json]

Starts its own region (bench.env.BenchEnv: broker, Redis, Resource Broker, allocator, one scheduler shard, simulated
agents, health check; free ports, a temporary run directory) and records the workload of ``ropewalk bench --quick``
on it (bench/workloads.py): jobs one at a time, a burst, repeats (each job grows), then 1% of the machines failing
at once; it waits until every task runs. Then ``shadow`` over the whole recording (processors/history/shadow.py),
with the live policy (the determinism check: the diff must be empty) and with ``--policy``; each timed, with the
records read. Stops what it started, also on error.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench import workloads as w  # noqa: E402
from bench.env import BenchEnv, cores, sigterm_as_interrupt  # noqa: E402
from processors.allocator.placement import LIVE  # noqa: E402
from processors.history import shadow  # noqa: E402
from streams.serde import SchemaRegistry  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machines", type=int, default=1000)
    ap.add_argument("--latency-jobs", type=int, default=10)
    ap.add_argument("--burst", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--policy", default="scores=spread,least_loaded")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    registry = SchemaRegistry.from_dir()
    policy = shadow.policy_of(args.policy)
    doc: dict = {"conditions": {"machines": args.machines, "partitions": args.partitions, "cores": cores(),
                                "workload": f"bench --quick: {args.latency_jobs} jobs one at a time, a burst of "
                                            f"{args.burst}, {args.repeat} repeated, 1% of the machines failing"}}
    with sigterm_as_interrupt(), BenchEnv(args.partitions) as env:
        start = int(time.time() * 1000)
        env.start_region(args.machines, timeout_s=max(120.0, args.machines / 50))
        obs = w.LogObserver(env.cfg, registry)
        alloc = w.allocation(env, registry, obs, machines=args.machines, latency_jobs=args.latency_jobs,
                             burst_jobs=args.burst, repeat_jobs=args.repeat)
        w.wait_running(obs, 300)
        fo = w.failover(env, registry, obs, machines=args.machines)
        w.wait_running(obs, 300)
        time.sleep(2)
        until = int(time.time() * 1000)
        doc["recorded"] = {"jobs": len(alloc["jobs"]), "tasks_placed": len(obs.placement),
                           "machines_failed": fo["machines_failed"], "tasks_moved": fo["tasks_moved"],
                           "seconds": round((until - start) / 1000)}
        for name, pol in (("live", LIVE), ("policy", policy)):
            t0 = time.monotonic()
            out = shadow.shadow(env.cfg, registry, start, until, pol)
            doc[name] = {"seconds": round(time.monotonic() - t0, 1), "policy": out["policy"],
                         "decisions_compared": out["decisions_compared"], "decisions_differ": out["decisions_differ"],
                         "scheduler_events_compared": out["scheduler_events_compared"],
                         "scheduler_events_differ": out["scheduler_events_differ"], "empty": out["empty"],
                         "baseline_reproduces_the_log": out["baseline"]["reproduces_the_log"],
                         "totals": out["totals"], "synthesized_reports": out["synthesized_reports"],
                         "dropped_reports": out["dropped_reports"],
                         "first_differences": out["decisions"][:3]}
            for t in doc[name]["totals"].values():
                t.pop("spread")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        r = doc["recorded"]
        print(f"recorded: {r['jobs']} jobs, {r['tasks_placed']} tasks placed, {r['machines_failed']} machines failed "
              f"({r['tasks_moved']} tasks moved), {r['seconds']} s of region, {args.machines} machines")
        for name in ("live", "policy"):
            d = doc[name]
            print(f"shadow under {d['policy']}: {d['decisions_differ']} of {d['decisions_compared']} allocator "
                  f"decisions and {d['scheduler_events_differ']} of {d['scheduler_events_compared']} scheduler events "
                  f"differ from the log; diff empty: {d['empty']} ({d['seconds']} s)")
            t = d["totals"]
            for k in ("requests", "tasks_placed", "moves", "machines_used", "rejections"):
                print(f"  {k:14} recorded {t['recorded'][k]}  shadow {t['shadow'][k]}")
    return 0 if doc["live"]["empty"] else 1


if __name__ == "__main__":
    sys.exit(main())
