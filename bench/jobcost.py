"""What one job costs: CPU per process, records per topic and producer, and (optionally) py-spy profiles, over a burst
of jobs through the whole pipeline (issue #28). A development tool: the same region as ``ropewalk bench`` (its
``BenchEnv``), fewer phases, so a change to the job's path is measured in a couple of minutes.

    .venv/bin/python bench/jobcost.py [--machines 10000] [--jobs 400] [--failover 0.01] [--pyspy DIR] [--profile DIR]
                                      [--json]

Phases: the region registered (as the bench), 5 jobs one at a time (warm-up), then the burst: ``--jobs`` jobs
submitted at once; its figures are taken twice, once every job is allocated (what ``ropewalk bench``'s
``cpu_ms_per_job`` covers) and once every task runs and the scheduler has read so (the job's whole life: submit,
request, decision, commands, agents' reports, running). Before it, 10 s with nothing in flight: what the region
costs per second by itself (heartbeats, idle fetches). ``--failover F``: then F of the machines fail at once, as the
bench's failover phase. ``--pyspy DIR``: py-spy (``pip install py-spy``) records every worker over the burst;
``--profile DIR``: the scheduler shard runs under cProfile (``ROPEWALK_PROFILE_DIR``, its whole life).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import brokerstats  # noqa: E402
from bench import workloads as w  # noqa: E402
from bench.env import BenchEnv  # noqa: E402
from bench.logcount import records_between, topic_ends  # noqa: E402
from bench.observe import LogObserver  # noqa: E402
from streams.partitionmap import routed_producer  # noqa: E402
from streams.serde import SchemaRegistry  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--pyspy", type=Path, help="record py-spy profiles of the workers over the burst, in this directory")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--profile", type=Path, help="cProfile the scheduler shard (ROPEWALK_PROFILE_DIR) into this directory")
    ap.add_argument("--failover", type=float, default=0.0, help="then fail this fraction of the machines (0.01: 1%%)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)

    registry = SchemaRegistry.from_dir()
    out: dict = {"machines": args.machines, "jobs": args.jobs}
    with BenchEnv(partitions=8, keep=args.keep) as env:
        t0 = time.monotonic()
        extra = {"ROPEWALK_PROFILE_DIR": str(args.profile)} if args.profile else None
        region = env.start_region(args.machines, timeout_s=max(120.0, args.machines / 50), env=extra)
        out["ready_s"] = round(time.monotonic() - t0, 1)
        out["caught_up"] = region["caught_up"]
        obs = LogObserver(env.cfg, registry)
        cfg = env.cfg
        rng = random.Random(7)
        ents = w.entitlement_names(4)
        w.create_entitlements(cfg, registry, ents, quota=args.machines)
        dcs = sorted({m.split("-")[0] for m in w._region_machines(env)})
        producer = routed_producer(cfg, registry, w.PRODUCER, **{"linger.ms": 0})  # by the partition map
        producer.prepare("JobSubmitted")
        lat = []
        for spec in w.job_specs(5, ents, dcs, rng, "lat"):
            job, ts = w.submit(producer, spec)
            producer.flush(30)
            obs.expect(job, spec["tasks"])
            obs.wait(lambda: job in obs.done_ms, 60)
            lat.append(obs.done_ms.get(job, 0) - ts)
        out["warmup_ms"] = lat
        w.wait_running(obs, 120)
        bg = w.background_cost(env, 10.0)
        out["idle_broker_per_s"] = bg["broker_per_s"]
        out["idle_cpu_ms_per_s"] = bg["cpu_ms_per_s"]
        ends0 = topic_ends(cfg)
        req0 = brokerstats.read(cfg)
        spies = []
        if args.pyspy:
            args.pyspy.mkdir(parents=True, exist_ok=True)
            for name, pid in env.pids.items():
                if name.startswith(("broker", "redis")):
                    continue
                spies.append(subprocess.Popen(
                    [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--rate", str(args.rate),
                     "--nonblocking", "--format", "raw", "--output", str(args.pyspy / f"{name}.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)
        cpu0 = env.cpu_seconds()
        submitted = {}
        specs = w.job_specs(args.jobs, ents, dcs, rng, "job")
        t_first = int(time.time() * 1000)
        for spec in specs:
            job, ts = w.submit(producer, spec)
            submitted[job] = spec["tasks"]
            obs.expect(job, spec["tasks"])
        producer.flush(60)
        ok = obs.wait(lambda: all(j in obs.done_ms for j in submitted), 600)
        cpu1 = env.cpu_seconds()
        req1 = brokerstats.read(cfg)
        t_alloc = max(obs.done_ms.get(j, t_first) for j in submitted)
        running = w.wait_running(obs, 600)
        cpu2 = env.cpu_seconds()
        req2 = brokerstats.read(cfg)
        t_run = max((obs.discovered[t][1] for j in submitted for t in obs.allocated[j] if t in obs.discovered),
                    default=t_first)
        for p in spies:
            p.send_signal(2)
        for p in spies:
            p.wait(30)
        ends1 = topic_ends(cfg)
        n = len(submitted)
        out["burst"] = {"allocated": ok, "running": running, "alloc_s": round((t_alloc - t_first) / 1000, 2),
                        "jobs_per_s": round(n / max(0.001, (t_alloc - t_first) / 1000), 1),
                        "running_s": round((t_run - t_first) / 1000, 2),
                        "tasks": sum(submitted.values())}
        out["cpu_ms_per_job_allocated"] = per_job(cpu0, cpu1, n)
        out["cpu_ms_per_job_running"] = per_job(cpu0, cpu2, n)
        out["records_per_job"] = records_between(cfg, ends0, ends1, n)
        out["broker_per_job_allocated"] = brokerstats.per_job(req0, req1, n)
        out["broker_per_job_running"] = brokerstats.per_job(req0, req2, n)
        if args.failover:
            fo = w.failover(env, registry, obs, machines=args.machines, fraction=args.failover, seed=11)
            out["failover"] = {k: fo[k] for k in ("machines_failed", "tasks_affected", "tasks_moved", "p50_ms", "p99_ms",
                                                  "cpu_s")}
            out["failover"]["requests"] = (fo["cost"]["broker"] or {}).get("requests")
            out["failover"]["records"] = fo["cost"]["records"]["by_type"]
            out["failover"]["timeline_ms"] = fo["cost"]["records"].get("timeline")
        obs.close()
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print_table(out)
    return 0


def per_job(before: dict, after: dict, jobs: int) -> dict:
    used = {k: round(1000 * (after[k] - before[k]) / jobs, 3) for k in after if k in before}
    used["total"] = round(sum(v for k, v in used.items() if k != "harness"), 3)
    return used


def print_table(out: dict) -> None:
    print(json.dumps({k: v for k, v in out.items() if k not in ("records_per_job", "broker_per_job_allocated",
                                                                 "broker_per_job_running", "idle_broker_per_s")}, indent=1))
    for key in ("idle_broker_per_s", "broker_per_job_allocated", "broker_per_job_running"):
        b = out.get(key)
        if b:
            print(f"{key}: {b['requests_total']} requests: " + ", ".join(f"{k} {v}" for k, v in b["requests"].items()))
            print("   produce appends: " + ", ".join(f"{k} {v}" for k, v in b["produce_appends"].items()))
            print("   fetch reads: " + ", ".join(f"{k} {v}" for k, v in b["fetch_reads"].items()))
    rec = out["records_per_job"]
    print(f"records per job: {rec['total']} (heartbeats {rec['background']})")
    for k, v in rec["by_type"].items():
        print(f"  {v:8.2f}  {k}")


if __name__ == "__main__":
    sys.exit(main())
