"""The allocator's decision events (processors/allocator/decide.py): what a plan becomes on the log,
and that no record exceeds the broker's limit whatever the job size."""
from __future__ import annotations

import pytest

from processors.allocator.fold import RegionFold
from processors.allocator.placement import QUOTA_EXCEEDED, Machine, Plan
from processors.allocator.decide import free_events, plan_events, rejection_events
from streams.batches import MAX_RECORD_BYTES
from streams.events import new_event
from streams.serde import SchemaRegistry

REGISTRY = SchemaRegistry.from_dir()


def machine(i: int) -> Machine:
    return Machine(id=f"dc1-msb{i % 30}-r{i % 200:03d}-m{i:06d}", dc="dc1", msb=f"msb{i % 30}", rack=f"r{i % 200:03d}",
                   machine_type="skylake", cpu_free=32000, mem_free=131072, cpu_capacity=32000, mem_capacity=131072,
                   entitlement=None, status="UP", version=1)


def request(n: int, free: int = 0):
    job = "e1.very-big-job-with-a-long-name"
    return new_event("AllocationRequested", {
        "request_id": f"{job}:v1:r1", "job_id": job, "spec_version": 1,
        "place_task_ids": [f"{job}/{i}" for i in range(n)], "free_task_ids": [f"{job}/{i}" for i in range(free)],
        "resources": {"cpu_millicores": 1000, "memory_mib": 1024}, "requirements": {}, "spread": "msb",
        "avoid_machine_ids": []}, entitlement="e1", entity_id=f"{job}:v1:r1", producer="scheduler")


def encoded(e) -> int:
    return len(REGISTRY.encode(e.type, e.to_record()))


@pytest.mark.parametrize("tasks,unplaced", [(36, 0), (20_000, 0), (25_000, 5_000), (3, 25_000)])
def test_a_plan_of_any_size_fits_in_records_and_says_everything(tasks, unplaced):
    req = request(tasks + unplaced)
    ids = req.payload["place_task_ids"]
    ms = [machine(i) for i in range(max(1, tasks // 30))]
    placements = tuple((t, ms[i % len(ms)].id) for i, t in enumerate(ids[:tasks]))
    plan = Plan(placements=placements, machines_added=tuple(m.id for m in ms), filter_rejections={"insufficient_cpu": 7},
                fault_domain_bins={"dc1/msb1": 3}, unplaced=tuple(ids[tasks:]), reason=QUOTA_EXCEEDED if unplaced else None,
                message="quota" if unplaced else None)
    events = plan_events(req, plan, 1, {m.id: m for m in ms}, 1_795_000_000_000)
    assert all(encoded(e) < MAX_RECORD_BYTES for e in events)
    allocated = [e for e in events if e.type == "TasksAllocated"]
    rejected = [e for e in events if e.type == "AllocationRejected"]
    assert [(r["task_id"], r["machine_id"]) for e in allocated for r in e.payload["placements"]] == list(placements)
    assert sorted(m for e in allocated for m in e.payload["machines_added"]) == sorted(m.id for m in ms)
    assert [t for e in rejected for t in e.payload["unplaced_task_ids"]] == list(ids[tasks:])
    assert len({e.event_id for e in events}) == len(events)  # every part an event of its own
    if allocated:  # the first part is the undivided event: its id, the counts, the bins
        assert allocated[0].payload["filter_rejections"] == {"insufficient_cpu": 7}
        assert allocated[0].payload["fault_domain_bins"] == {"dc1/msb1": 3}
    if tasks <= 36 and not unplaced:
        assert len(allocated) == 1
    # each part names the machines it is the first to use, so a fold applying the parts in order ends where one
    # applying the undivided event does
    seen = set()
    for e in allocated:
        used = {r["machine_id"] for r in e.payload["placements"]}
        assert set(e.payload["machines_added"]) <= used | set(m.id for m in ms)
        assert not set(e.payload["machines_added"]) & seen
        seen |= set(e.payload["machines_added"])


def test_the_parts_of_a_decision_fold_to_the_same_region_as_one_event():
    ms = [machine(i) for i in range(700)]
    req = request(20_000)
    regs = [new_event("MachineRegistered", {"machine_id": m.id, "topology": {"region": "r", "dc": m.dc, "msb": m.msb,
                                                                               "rack": m.rack},
                                            "machine_type": m.machine_type,
                                            "capacity": {"cpu_millicores": m.cpu_capacity, "memory_mib": m.mem_capacity},
                                            "host_profile": None}, entitlement="free/dc1", entity_id=m.id, producer="rb")
            for m in ms]
    ids = req.payload["place_task_ids"]
    placements = tuple((t, ms[i % 700].id) for i, t in enumerate(ids))
    plan = Plan(placements=placements, machines_added=tuple(m.id for m in ms), filter_rejections={},
                fault_domain_bins={}, unplaced=(), reason=None, message=None)
    events = plan_events(req, plan, 1, {m.id: m for m in ms}, 1_795_000_000_000)
    assert len([e for e in events if e.type == "TasksAllocated"]) > 1
    fold = RegionFold()
    for e in regs + [req] + events:
        fold.apply(e, None)
    assert len(fold.placement) == 20_000 and fold.held_count("e1") == 700 and not fold.requests
    frees = free_events(req, dict(placements), [m.id for m in ms], {m.id: m for m in ms}, 1_795_000_000_001)
    assert all(encoded(e) < MAX_RECORD_BYTES for e in frees)
    for e in frees:
        fold.apply(e, None)
    assert fold.placement == {} and fold.held_count("e1") == 0


def test_a_rejection_of_many_tasks_is_split_too():
    req = request(25_000)
    events = rejection_events(req, req.payload["place_task_ids"], "no_feasible_machine", "none", {"x": 1}, 1)
    assert len(events) > 1 and all(encoded(e) < MAX_RECORD_BYTES for e in events)
    assert [t for e in events for t in e.payload["unplaced_task_ids"]] == req.payload["place_task_ids"]
