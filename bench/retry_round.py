"""The scheduler's retry timer: the CPU one round takes, and the longest it holds the shard's lock, on a shard's tables.

    .venv/bin/python bench/retry_round.py [--jobs 4000] [--tasks 34] [--parked 0.1] [--json]

Pure and in-process (no broker): a ``ShardTables`` on a faust app that is not started (memory stores) holds
``--jobs`` jobs of ``--tasks`` tasks over 4 entitlements, every job placed and running except one in
``1/--parked`` whose tasks an AllocationRejected parked (each built with ``decide``, stored with ``store.plan``).
Then a round of the timer, decoding and deciding only (producing and storing each slice's output, which the
real timer also does under the lock, are the broker's round trips and are not in these figures), two ways:

  baseline   as main did until 2026-11-28: per partition, every job loaded and ``retry_unplaced`` on all of
             them, one decision (the lock held across all partitions in the shard: the round's total);
  now        ``ShardTables.timer_job_keys`` (the headers' ``timer`` flag, no decoding), then slices of
             ``shard.RETRY_SLICE_JOBS`` jobs, each a decision of its own (the lock held per slice).

Each twice: ``cold`` (the decoded-job memo empty, as after a recovery) and ``warm``. Prints ms per round and the
longest single decision (what the agent waits behind at most), with the conditions.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from infra.config import Config  # noqa: E402
from processors.scheduler import store as st  # noqa: E402
from processors.scheduler.decide import decide, retry_unplaced  # noqa: E402
from processors.scheduler.model import SchedulerState  # noqa: E402
from processors.scheduler.shard import RETRY_SLICE_JOBS, ShardTables  # noqa: E402
from streams.events import new_event  # noqa: E402
from streams.faustwire import make_app  # noqa: E402

PARTITIONS = 8
ENTITLEMENTS = 4


def build(jobs: int, tasks: int, parked_every: int) -> tuple[ShardTables, int]:
    """The tables of a shard holding the jobs; returns them and how many jobs have parked tasks."""
    ids = itertools.count()

    def ev(type_, payload, ent, entity, producer):
        return new_event(type_, payload, entitlement=ent, entity_id=entity, producer=producer, timestamp_ms=1,
                         event_id=f"bench-{next(ids)}")

    ents = [f"bench-e{i}" for i in range(ENTITLEMENTS)]
    state = SchedulerState()
    for e in ents:
        state, _ = decide(state, ev("EntitlementCreated", {"name": e, "quota_machines": 10**6, "machine_type": None,
                                                            "dc_pin": None, "host_profile": None}, e, e, "cli"), 1)
    machines = itertools.count()
    parked = 0
    for i in range(jobs):
        e = ents[i % ENTITLEMENTS]
        j = f"{e}.job{i:06d}"
        state, out = decide(state, ev("JobSubmitted", {
            "job_id": j, "name": j, "spec_version": 1, "tasks": tasks, "command": ["sleep", "1"],
            "resources": {"cpu_millicores": 100, "memory_mib": 64}, "requirements": {}, "spread": "msb",
            "max_unavailable": 1, "env": {}}, e, j, "cli"), 2)
        (req,) = [x for x in out if x.type == "AllocationRequested"]
        p = req.payload
        if parked_every and i % parked_every == 0:
            parked += 1
            state, _ = decide(state, ev("AllocationRejected", {
                "request_id": p["request_id"], "job_id": j, "reason": "no_feasible_machine", "message": "",
                "unplaced_task_ids": p["place_task_ids"]}, e, j, "allocator"), 3)
        else:
            placements = [{"task_id": t, "machine_id": f"m{next(machines)}", "dc": "dc1", "msb": "msb1",
                           "rack": "r1"} for t in p["place_task_ids"]]
            state, _ = decide(state, ev("TasksAllocated", {"request_id": p["request_id"], "job_id": j,
                                                           "placements": placements}, e, j, "allocator"), 3)
            reports = [{"report_id": f"bench-{next(ids)}", "task_id": pl["task_id"], "job_id": j,
                        "machine_id": pl["machine_id"], "state": "RUNNING", "previous_state": "STARTING",
                        "exit_code": None, "spec_version": 1, "reason": "process_up", "cause_id": None}
                       for pl in placements]  # its agents say so: running, the timer has nothing to do for it
            state, _ = decide(state, ev("TaskStatesChanged", {"reports": reports}, e, j, "agent/bench"), 4)
    tables = ShardTables(make_app(Config.from_env({"ROPEWALK_RUN_DIR": tempfile.mkdtemp()}), "bench-retry"),
                         PARTITIONS)
    for name, ent in state.entitlements.items():
        tables.entitlements.data[name] = dataclasses.asdict(ent)
    for job_id, job in state.jobs.items():
        plan = st.plan(None, None, {}, job)
        tables.job_chunks.data.update(plan.chunks)
        tables.jobs.data[job_id] = plan.header
    return tables, parked


def baseline_round(tables: ShardTables, now: int) -> list[float]:
    holds = []
    for part in range(PARTITIONS):
        t = time.perf_counter()
        state, _, _ = tables.load((), tables.partition_job_keys({part}))
        retry_unplaced(tables.with_bucket(state, part), now)
        holds.append(time.perf_counter() - t)
    return [sum(holds)]  # one decision per partition, all under the lock at once


def sliced_round(tables: ShardTables, now: int) -> list[float]:
    holds = []
    t = time.perf_counter()
    todo = tables.timer_job_keys(set(range(PARTITIONS)))
    holds.append(time.perf_counter() - t)  # the selection (headers only) happens outside the lock; counted in
    for part, keys in todo.items():
        for i in range(0, len(keys), RETRY_SLICE_JOBS):
            t = time.perf_counter()
            state, _, _ = tables.load((), keys[i:i + RETRY_SLICE_JOBS])
            retry_unplaced(tables.with_bucket(state, part), now)
            holds.append(time.perf_counter() - t)
    return holds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4000)
    ap.add_argument("--tasks", type=int, default=34)
    ap.add_argument("--parked", type=float, default=0.1, help="share of the jobs with parked tasks (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tables, parked = build(args.jobs, args.tasks, round(1 / args.parked) if args.parked else 0)
    built_s = time.perf_counter() - t0
    now = 10**13  # long after every rejection: each parked job is asked for again
    doc: dict = {"jobs": args.jobs, "tasks_per_job": args.tasks, "jobs_parked": parked,
                 "slice_jobs": RETRY_SLICE_JOBS, "build_s": round(built_s, 1),
                 "conditions": {"cores": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 1),
                                "python": platform.python_version()}}
    for name, round_ in (("baseline", baseline_round), ("now", sliced_round)):
        for when in ("cold", "warm"):
            if when == "cold":
                tables._decoded.clear()
            holds = round_(tables, now)
            doc[f"{name}_{when}"] = {"round_ms": round(sum(holds) * 1e3, 1),
                                     "longest_decision_ms": round(max(holds) * 1e3, 1), "decisions": len(holds)}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{args.jobs} jobs x {args.tasks} tasks, {parked} with parked tasks; slices of {RETRY_SLICE_JOBS}; "
              f"{doc['conditions']}")
        for key in ("baseline_cold", "baseline_warm", "now_cold", "now_warm"):
            r = doc[key]
            print(f"  {key:14s} round {r['round_ms']:9.1f} ms   longest decision {r['longest_decision_ms']:8.1f} ms"
                  f"   ({r['decisions']} decisions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
