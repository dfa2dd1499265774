"""Allocation commit rate of the Redis machine index, and Redis bytes per machine.

    .venv/bin/python bench/commit_rate.py [--machines 10000] [--requests 60] [--tasks 36]

Starts its own redis-server (port 46679, run dir /tmp/rw-bench-commit), registers the machines through the
index's event path (MachineRegistered, pipelined), and measures:

* bytes per machine: INFO memory ``used_memory`` after registering minus before, over the machine count;
  and bytes per placed task after the allocations;
* single-process ``allocate()`` (snapshot -> placement.place -> Lua commit) with ``--tasks`` tasks per request,
  requests round-robin over 50 entitlements, end to end: commits/s and tasks/s;
* the same loop split into its phases (snapshot read, pure placement, commit script), per request;
* both without requirements (the snapshot is the entitlement plus the whole free pool) and with a ``dc``
  requirement (the index sets narrow the snapshot to one of 4 DCs).

Stops what it started.
"""
from __future__ import annotations

import argparse
import platform
import time

import redis

from infra import services
from infra.config import Config
from processors.allocator import placement
from processors.allocator.index import MachineIndex, allocate
from processors.allocator.placement import Entitlement, Request
from streams.events import Event

DCS, MSBS, RACKS = 4, 5, 10
CPU, MEM = 32_000, 131_072  # per machine
TASK_CPU, TASK_MEM = 1000, 2048


def registrations(n: int):
    for i in range(n):
        dc = f"dc{i % DCS}"
        mid = f"host{i:06d}"
        yield (Event("MachineRegistered", f"free/{dc}", mid, {
            "machine_id": mid, "machine_type": ("skylake", "broadwell")[i % 5 == 0], "host_profile": None,
            "topology": {"region": "r1", "dc": dc, "msb": f"{dc}-msb{i // DCS % MSBS}",
                         "rack": f"{dc}-rack{i // (DCS * MSBS) % RACKS}"},
            "capacity": {"cpu_millicores": CPU, "memory_mib": MEM}}), ("machines", i % 8, i // 8))


def used_memory(r) -> int:
    return int(r.info("memory")["used_memory"])


def requests(n: int, tasks: int, tag: str, dc_requirement: bool):
    for i in range(n):
        ent = f"e{i % 50}"
        job = f"{ent}-{tag}{i}"
        yield Entitlement(ent, quota_machines=10_000), Request(
            f"{job}-r", job, ent, tuple(f"{job}/{k}" for k in range(tasks)), TASK_CPU, TASK_MEM,
            requirements={"dc": f"dc{i % DCS}"} if dc_requirement else {})


def run_allocate(ix: MachineIndex, n: int, tasks: int, tag: str, dc_requirement: bool) -> dict:
    placed = attempts = 0
    t0 = time.perf_counter()
    for ent, req in requests(n, tasks, tag, dc_requirement):
        plan, a, _ = allocate(ix, ent, req)
        placed += len(plan.placements)
        attempts += a
    dt = time.perf_counter() - t0
    return {"commits_per_s": n / dt, "tasks_per_s": placed / dt, "tasks_placed": placed, "attempts": attempts}


def run_phases(ix: MachineIndex, n: int, tasks: int, tag: str, dc_requirement: bool) -> dict:
    """allocate()'s body with a timer per phase (one attempt each: a single process meets no conflict)."""
    t_snap = t_place = t_commit = 0.0
    snap_size = 0
    for ent, req in requests(n, tasks, tag, dc_requirement):
        t0 = time.perf_counter()
        snap = ix.snapshot(dc=req.requirements.get("dc"), entitlement=ent.name)
        t1 = time.perf_counter()
        plan = placement.place(snap, ent, req, ix.held_count(ent.name))
        t2 = time.perf_counter()
        touched = {m for _, m in plan.placements} | set(plan.machines_added)
        result = ix.commit(plan.placements, {m: snap[m].version for m in touched}, ent.name, req.cpu, req.mem,
                           plan.machines_added)
        t3 = time.perf_counter()
        assert result.ok, result.conflicts
        t_snap, t_place, t_commit = t_snap + t1 - t0, t_place + t2 - t1, t_commit + t3 - t2
        snap_size += len(snap)
    return {"snapshot_ms": 1000 * t_snap / n, "place_ms": 1000 * t_place / n, "commit_ms": 1000 * t_commit / n,
            "snapshot_machines": snap_size / n, "commit_script_per_s": n / t_commit}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machines", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--tasks", type=int, default=36)
    args = ap.parse_args()
    cfg = Config.from_env({"ROPEWALK_REDIS_PORT": "46679", "ROPEWALK_RUN_DIR": "/tmp/rw-bench-commit"})
    server = services.redis_server(cfg)
    server.start()
    try:
        r = redis.Redis.from_url(cfg.redis_url)
        r.flushdb()
        ix = MachineIndex(r, "bench.")
        before = used_memory(r)
        t0 = time.perf_counter()
        ix.apply_many(registrations(args.machines))
        reg_s = time.perf_counter() - t0
        per_machine = (used_memory(r) - before) / args.machines
        rows = []
        for dc_req in (False, True):
            label = "dc requirement (1 of 4 DCs)" if dc_req else "no requirement (entitlement + whole free pool)"
            end_to_end = run_allocate(ix, args.requests, args.tasks, f"a{int(dc_req)}-", dc_req)
            phases = run_phases(ix, args.requests, args.tasks, f"p{int(dc_req)}-", dc_req)
            rows.append((label, end_to_end, phases))
        tasks_now = r.hlen(ix.key("placement"))
        mem_now = used_memory(r)
        per_task = (mem_now - before - per_machine * args.machines) / tasks_now
        print(f"redis-server {r.info('server')['redis_version']}, redis-py {redis.__version__}, "
              f"Python {platform.python_version()}, {platform.machine()}, 1 allocator process")
        print(f"{args.machines} machines ({DCS} DCs x {MSBS} MSBs x {RACKS} racks, {CPU}m/{MEM} MiB each); "
              f"requests of {args.tasks} tasks x {TASK_CPU}m/{TASK_MEM} MiB, spread msb, 50 entitlements")
        print(f"register {args.machines} machines via apply_many: {args.machines / reg_s:,.0f} events/s")
        print(f"redis bytes per machine (used_memory delta after registering): {per_machine:,.0f}")
        print(f"redis bytes per placed task (after {tasks_now} tasks): {per_task:,.0f}")
        for label, e2e, ph in rows:
            print(f"\n{label}:")
            print(f"  allocate() end to end: {e2e['commits_per_s']:.2f} commits/s, {e2e['tasks_per_s']:.0f} tasks/s "
                  f"({args.requests} requests, {e2e['tasks_placed']} tasks, {e2e['attempts']} attempts)")
            print(f"  per request: snapshot {ph['snapshot_ms']:.1f} ms ({ph['snapshot_machines']:.0f} machines), "
                  f"place {ph['place_ms']:.1f} ms, commit {ph['commit_ms']:.2f} ms "
                  f"(commit script alone: {ph['commit_script_per_s']:.0f} commits/s, "
                  f"{ph['commit_script_per_s'] * args.tasks:.0f} tasks/s)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
