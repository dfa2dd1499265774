"""Placement on the in-memory PlacementIndex against placement.run on the full snapshot, at 100,000 machines.

    .venv/bin/python bench/fastplace_rate.py [--machines 100000] [--requests 200] [--spread msb] [--seed 0]

Pure and in-process (no broker, no redis). Builds the region of ``region.generate_region(machines)`` (2 DCs,
racks of 30, up to 36 MSBs per DC, skylake 32000m/131072MiB on 70% of the racks, broadwell 24000m/65536MiB on
the rest) into a ``fastplace.PlacementIndex``, gives each of 4 entitlements 1,000 random machines, partly used
(0-90% of their cpu, in tasks of the request shapes), then runs ``--requests`` allocation requests of 12-60
tasks (shapes 1000m/2048MiB, 2000m/4096MiB, 500m/1024MiB; a quarter with a dc requirement; spread
``--spread``), round-robin over the entitlements, each with quota room to take free-pool machines, narrowed
as ``index.allocate`` narrows the snapshot. Each plan is committed through ``upsert`` (placed machines lose
the tasks' capacity, added ones join the entitlement). Two passes over the same requests:

  checked    per request, PlacementIndex.run and placement.run on PlacementIndex.snapshot (the snapshot
             built beforehand, not timed: in the allocator it is a Redis read, which costs more than
             placement.run itself); the plans must be equal (the script stops otherwise);
  alone      PlacementIndex.run only, on a fresh index of the same region: the same plans (asserted), timed
             without the reference runs evicting the index's data from the CPU caches in between.

Prints ms per request (p50, p99, mean): ``index`` (alone), ``index*`` (checked pass) and ``reference``, and
the upsert rate: building the index (inserts) and replacing machines (updates).
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from processors.allocator import placement  # noqa: E402
from processors.allocator.fastplace import PlacementIndex  # noqa: E402
from processors.allocator.placement import Entitlement, Machine, Plan, Request  # noqa: E402
from processors.resourcebroker import region  # noqa: E402
from streams.enums import MachineStatus  # noqa: E402

ENTITLEMENTS = ("e1", "e2", "e3", "e4")
HELD_PER_ENTITLEMENT = 1000
SHAPES = ((1000, 2048), (2000, 4096), (500, 1024))
TASKS = (12, 60)
DC_REQUIREMENT_SHARE = 0.25
QUOTA_ROOM = 500
UPDATES = 20_000


def region_machines(n: int) -> list[Machine]:
    return [Machine(id=s.id, dc=s.dc, msb=s.msb, rack=s.rack, machine_type=s.machine_type,
                    cpu_free=s.cpu_millicores, mem_free=s.memory_mib, cpu_capacity=s.cpu_millicores,
                    mem_capacity=s.memory_mib, entitlement=None, status=MachineStatus.UP, version=1)
            for s in region.iter_machines(region.generate_region(n))]


def hold(rnd: random.Random, machines: list[Machine]) -> list[Machine]:
    """Each entitlement takes HELD_PER_ENTITLEMENT random machines, each 0-90% used by tasks of one shape."""
    taken = rnd.sample(range(len(machines)), len(ENTITLEMENTS) * HELD_PER_ENTITLEMENT)
    out = list(machines)
    for k, i in enumerate(taken):
        x = out[i]
        cpu, mem = rnd.choice(SHAPES)
        n = int(rnd.uniform(0, 0.9) * min(x.cpu_capacity // cpu, x.mem_capacity // mem))
        out[i] = replace(x, entitlement=ENTITLEMENTS[k % len(ENTITLEMENTS)], cpu_free=x.cpu_free - n * cpu,
                         mem_free=x.mem_free - n * mem, version=2)
    return out


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def summary(name: str, seconds: list[float]) -> str:
    ms = [s * 1000 for s in seconds]
    return (f"{name:10s} p50 {percentile(ms, 50):8.3f} ms   p99 {percentile(ms, 99):8.3f} ms   "
            f"mean {statistics.fmean(ms):8.3f} ms")


def requests(rnd: random.Random, n: int, dcs: list[str], spread: str) -> list[tuple[str, Request]]:
    """``n`` (entitlement, request) pairs, round-robin over ENTITLEMENTS."""
    out = []
    for i in range(n):
        name = ENTITLEMENTS[i % len(ENTITLEMENTS)]
        cpu, mem = rnd.choice(SHAPES)
        job = f"{name}-job{i}"
        requirements = {"dc": rnd.choice(dcs)} if rnd.random() < DC_REQUIREMENT_SHARE else {}
        out.append((name, Request(f"{job}-r", job, name, tuple(f"{job}/{k}" for k in range(rnd.randint(*TASKS))),
                                  cpu, mem, requirements=requirements, spread=spread)))
    return out


def place_all(index: PlacementIndex, work: list[tuple[str, Request]],
              check: bool) -> tuple[list[Plan], list[float], list[float]]:
    """Each request on ``index`` as the allocator would (narrowed like index.allocate, each plan committed
    through upsert): the plans, and seconds per index.run and (``check``: each plan compared with it) per
    placement.run on the snapshot."""
    plans: list[Plan] = []
    t_index: list[float] = []
    t_ref: list[float] = []
    for i, (name, request) in enumerate(work):
        held = index.held_count(name)
        entitlement = Entitlement(name, quota_machines=held + QUOTA_ROOM)
        dc = request.requirements.get("dc") or entitlement.dc_pin
        machine_type = request.requirements.get("machine_type") or entitlement.machine_type
        t0 = time.perf_counter()
        plan = index.run(entitlement, request, held, dc, machine_type)
        t_index.append(time.perf_counter() - t0)
        if check:
            snapshot = index.snapshot(name, dc, machine_type)
            t0 = time.perf_counter()
            expected = placement.run(snapshot, entitlement, request, held).plan
            t_ref.append(time.perf_counter() - t0)
            if plan != expected:
                sys.exit(f"request {i}: the index's plan differs from placement.run's\n{plan}\n{expected}")
        for _, mid in plan.placements:
            x = index.get(mid)
            index.upsert(replace(x, cpu_free=x.cpu_free - request.cpu, mem_free=x.mem_free - request.mem,
                                 entitlement=name, version=x.version + 1))
        plans.append(plan)
    return plans, t_index, t_ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", type=int, default=100_000)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--spread", choices=placement.SPREAD_LEVELS, default="msb")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    print(f"# {platform.python_implementation()} {platform.python_version()} on {platform.machine()}, "
          f"{args.machines} machines, {args.requests} requests, spread {args.spread}")

    machines = hold(rnd, region_machines(args.machines))
    work = requests(rnd, args.requests, sorted({x.dc for x in machines}), args.spread)

    def build() -> PlacementIndex:
        index = PlacementIndex()
        for x in machines:
            index.upsert(x)
        return index

    t0 = time.perf_counter()
    index = build()
    took = time.perf_counter() - t0
    print(f"upsert (insert) {len(machines) / took:10.0f} machines/s  ({took:.2f} s for {len(machines)})")

    plans, t_checked, t_ref = place_all(index, work, check=True)
    tasks = sum(len(r.task_ids) for _, r in work)
    placed = sum(len(p.placements) for p in plans)
    print(f"{args.requests} requests, {tasks} tasks ({tasks / args.requests:.1f} per request), {placed} placed; "
          "every plan equal to placement.run's")
    again, t_alone, _ = place_all(build(), work, check=False)
    assert again == plans, "the same requests on the same region decide the same"
    print(summary("index", t_alone))
    print(summary("index*", t_checked))
    print(summary("reference", t_ref))
    print(f"speed-up (mean, index alone) {statistics.fmean(t_ref) / statistics.fmean(t_alone):.0f}x")
    print("* index.run interleaved with the reference runs (whose 100,000-machine snapshots evict its data "
          "from the CPU caches)")

    ids = [x.id for x in machines]
    updates = [rnd.choice(ids) for _ in range(UPDATES)]
    t0 = time.perf_counter()
    for mid in updates:
        x = index.get(mid)
        index.upsert(replace(x, cpu_free=x.cpu_free - 1 if x.cpu_free > 0 else x.cpu_capacity,
                             version=x.version + 1))
    took = time.perf_counter() - t0
    print(f"upsert (update) {UPDATES / took:10.0f} machines/s  (dataclasses.replace included)")


if __name__ == "__main__":
    main()
