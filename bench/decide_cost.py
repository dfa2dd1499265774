"""What deciding a job costs in-process: the scheduler's decisions of a job's life and the allocator's placement
events with their journal, per job (issue #28 item 1). Pure: no broker, no Redis, no other process.

    .venv/bin/python bench/decide_cost.py [--jobs 300] [--tasks 36] [--rounds 3] [--json]

The scheduler: ``--jobs`` jobs of ``--tasks`` tasks, each submitted, placed (a TasksAllocated on 20 machines) and
reported STARTING and RUNNING by its agents in one TaskStatesChanged, every one through ``decide`` on one state;
the time is ``decide``'s alone. The allocator: a placement of ``--tasks`` tasks on as many machines turned into its
events (``decide.plan_events``) and journaled as the allocator journals them in Redis (``decide.dump_events``),
``--jobs`` times. The whole pipeline's figures (``ropewalk bench``) move ±30 % between runs on a shared machine;
these move a few per cent, so a change to a decision's code is measured here (compare two checkouts by running
this script of each, alternating). Prints ms per job, the best of ``--rounds``, with the conditions.
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from processors.allocator.decide import dump_events, plan_events  # noqa: E402
from processors.allocator.placement import Machine, Plan  # noqa: E402
from processors.scheduler.decide import decide  # noqa: E402
from processors.scheduler.model import SchedulerState  # noqa: E402
from streams import batches  # noqa: E402
from streams.events import new_event  # noqa: E402

ENT = "bench-e1"
T0 = 1_795_000_000_000
MACHINES = 20  # the scheduler's jobs are placed on these (the scheduler does not check capacity)


def scheduler_ms_per_job(jobs: int, tasks: int) -> float:
    ids = itertools.count()

    def ev(type_, payload, entity, producer):
        return new_event(type_, payload, entitlement=ENT, entity_id=entity, producer=producer, timestamp_ms=T0,
                         event_id=f"bench-{next(ids)}")

    state, _ = decide(SchedulerState(), ev("EntitlementCreated", {
        "name": ENT, "quota_machines": 10**6, "machine_type": None, "dc_pin": None, "host_profile": None},
        ENT, "cli"), T0)
    spent = 0.0
    for i in range(jobs):
        job = f"{ENT}.job{i:06d}"
        submitted = ev("JobSubmitted", {
            "job_id": job, "name": job, "spec_version": 1, "tasks": tasks, "command": ["sleep", "1"],
            "resources": {"cpu_millicores": 100, "memory_mib": 64}, "requirements": {}, "spread": "msb",
            "max_unavailable": 1, "env": {}}, job, "cli")
        t0 = time.perf_counter()
        state, out = decide(state, submitted, T0)
        spent += time.perf_counter() - t0
        (req,) = [e for e in out if e.type == "AllocationRequested"]
        placements = [{"task_id": t, "machine_id": f"m{n % MACHINES}", "dc": "dc1", "msb": f"msb{n % 3}",
                       "rack": f"r{n % MACHINES}"} for n, t in enumerate(req.payload["place_task_ids"])]
        allocated = ev("TasksAllocated", {"request_id": req.payload["request_id"], "job_id": job,
                                          "placements": placements}, job, "allocator")
        t0 = time.perf_counter()
        state, out = decide(state, allocated, T0)
        spent += time.perf_counter() - t0
        reports = [{"report_id": f"r-{c['task_id']}-{s}", "task_id": c["task_id"], "job_id": job,
                    "machine_id": c["machine_id"], "state": s, "previous_state": prev, "exit_code": None,
                    "spec_version": 1, "reason": "", "cause_id": None}
                   for e in out if e.type == "TasksCommanded" for c in batches.task_commands(e)
                   for s, prev in (("STARTING", "UNKNOWN"), ("RUNNING", "STARTING"))]
        reported = ev("TaskStatesChanged", {"reports": reports}, job, "agent/simulated")
        t0 = time.perf_counter()
        state, _ = decide(state, reported, T0)
        spent += time.perf_counter() - t0
    return spent / jobs * 1000


def allocator_ms_per_job(jobs: int, tasks: int) -> float:
    job = f"{ENT}.job"
    request = new_event("AllocationRequested", {
        "request_id": f"{job}:v1:r1", "job_id": job, "spec_version": 1,
        "place_task_ids": [f"{job}/{i}" for i in range(tasks)], "free_task_ids": [],
        "resources": {"cpu_millicores": 1000, "memory_mib": 1024}, "requirements": {}, "spread": "msb",
        "avoid_machine_ids": []}, entitlement=ENT, entity_id=f"{job}:v1:r1", producer="scheduler")
    machines = {m.id: m for m in (Machine(
        id=f"dc1-msb{i % 30}-r{i % 200:03d}-m{i:06d}", dc="dc1", msb=f"msb{i % 30}", rack=f"r{i % 200:03d}",
        machine_type="skylake", cpu_free=32000, mem_free=131072, cpu_capacity=32000, mem_capacity=131072,
        entitlement=None, status="UP", version=1) for i in range(tasks))}
    plan = Plan(placements=tuple(zip(request.payload["place_task_ids"], machines)), machines_added=tuple(machines),
                filter_rejections={"insufficient_cpu": 7}, fault_domain_bins={"dc1/msb1": 3}, unplaced=(),
                reason=None, message=None)
    t0 = time.perf_counter()
    for _ in range(jobs):
        dump_events(plan_events(request, plan, 1, machines, T0))
    return (time.perf_counter() - t0) / jobs * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/decide_cost.py", description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--tasks", type=int, default=36)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sched = min(scheduler_ms_per_job(args.jobs, args.tasks) for _ in range(args.rounds))
    alloc = min(allocator_ms_per_job(args.jobs, args.tasks) for _ in range(args.rounds))
    doc = {"scheduler_decide_ms_per_job": round(sched, 3), "allocator_events_and_journal_ms_per_job": round(alloc, 3),
           "conditions": {"jobs": args.jobs, "tasks_per_job": args.tasks, "rounds": args.rounds, "best_of": "rounds",
                          "python": platform.python_version(), "checkout": str(Path(__file__).resolve().parents[1])}}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"decide cost ({args.jobs} jobs of {args.tasks} tasks, best of {args.rounds}, Python "
              f"{platform.python_version()})")
        print(f"  scheduler: a job's decisions (submit, placement, reports)   {sched:8.3f} ms")
        print(f"  allocator: a placement's events and their journal           {alloc:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
