"""The allocator's pure decisions (processors/allocator/decide.py): a request on a fold -> its events, with the
reason of every rejection. Pure: an in-memory fold built from events, no broker, no Redis; the fold is read, never
written, and the same request on the same fold gives the same events."""
from __future__ import annotations

import copy

import pytest

from allocator_log import Log, allocated, assign, ev, reg, requested, state
from processors.allocator import decide
from processors.allocator.decide import (
    ALLOCATOR_ERROR, COMMIT_RETRIES_EXHAUSTED, INVALID_REQUEST, RELEASED_EMPTY, UNKNOWN_ENTITLEMENT, drain_of,
    expected_partitions,
)
from processors.allocator.fold import RegionFold
from processors.allocator.placement import FILTER_CPU, NO_FEASIBLE_MACHINE, QUOTA_EXCEEDED
from streams.partitionmap import MapEntry

TS = 1_700_000_000_000


def created(ent="e1", quota=10, machine_type=None, dc_pin=None):
    return ev("EntitlementCreated", ent, ent, {"name": ent, "quota_machines": quota, "machine_type": machine_type,
                                              "dc_pin": dc_pin, "host_profile": None})


def fold_of(events) -> RegionFold:
    fold, log = RegionFold(), Log()
    for e in events:
        fold.apply(*log.add(e))
    return fold


def spread(rid, spread_level):
    e = requested(rid, "e1", ["j/0"])
    return type(e)(**{**e.__dict__, "payload": {**e.payload, "spread": spread_level}})


REGION = [reg("m1"), reg("m2", msb="msb2"), reg("m3", msb="msb3")]  # 4000 millicores, 8192 MiB each

# name: (the log before, the request, expected event types in order, the rejection's reason or None,
#        tasks placed)
PLACING = {
    "placed-spread-over-msbs": (
        REGION + [created()], requested("r1", "e1", ["j/0", "j/1", "j/2"]),
        ["TasksAllocated", "MachineAssignedToEntitlement", "MachineAssignedToEntitlement",
         "MachineAssignedToEntitlement"], None, 3),
    "packed-on-a-held-machine-first": (
        REGION + [created(), assign("m2", "e1")], requested("r1", "e1", ["j/0"]),
        ["TasksAllocated"], None, 1),
    "nothing-to-place": (REGION + [created()], requested("r1", "e1", []), [], None, 0),
    "unknown-entitlement": (
        REGION, requested("r1", "e1", ["j/0"]), ["AllocationRejected"], UNKNOWN_ENTITLEMENT, 0),
    "invalid-spread": (REGION + [created()], spread("r1", "planet"), ["AllocationRejected"], INVALID_REQUEST, 0),
    "too-big-for-any-machine": (
        REGION + [created()], requested("r1", "e1", ["j/0"], cpu=9000), ["AllocationRejected"],
        NO_FEASIBLE_MACHINE, 0),
    "quota-of-one-machine": (
        REGION + [created(quota=1)], requested("r1", "e1", ["j/0", "j/1"], cpu=4000),
        ["TasksAllocated", "MachineAssignedToEntitlement", "AllocationRejected"], QUOTA_EXCEEDED, 1),
    "pinned-to-a-type-no-machine-has": (
        REGION + [created(machine_type="graviton")], requested("r1", "e1", ["j/0"]), ["AllocationRejected"],
        NO_FEASIBLE_MACHINE, 0),
}


@pytest.mark.parametrize("before,request_,types,reason,placed", PLACING.values(), ids=PLACING.keys())
def test_placing_decides_these_events_and_writes_nothing(before, request_, types, reason, placed):
    fold = fold_of(before)
    snapshot = copy.deepcopy(state(fold))
    d = decide.placing(fold, request_, 1, TS)
    assert [e.type for e in d.events] == types
    assert [e.payload["reason"] for e in d.events if e.type == "AllocationRejected"] == ([reason] if reason else [])
    assert sum(len(e.payload["placements"]) for e in d.events if e.type == "TasksAllocated") == placed
    assert all(e.causation_id == request_.event_id and e.producer == decide.PRODUCER for e in d.events)
    assert state(fold) == snapshot  # the fold is read, never written
    assert decide.placing(fold, request_, 1, TS).events == d.events  # same fold, same request: same events, same ids
    if placed:  # the Redis commit's rows: every placed task once, on the version the plan read
        assert sorted(t for row in d.rows for t in row[3]) == sorted(t for t, _ in d.plan.placements)
        assert all(row[1] == fold.machines[row[0]].version for row in d.rows)
    else:
        assert d.rows == ()


def test_a_narrowed_no_feasible_machine_is_explained_over_every_machine():
    """A type pin no machine matches: the filter counts say why the others did not fit, not just 'none left'."""
    fold = fold_of(REGION + [created(machine_type="graviton")])
    rejected = decide.placing(fold, requested("r1", "e1", ["j/0"], cpu=9000), 1, TS).events[0]
    assert rejected.payload["filter_rejections"].get(FILTER_CPU, 0) + \
        rejected.payload["filter_rejections"].get("machine_type_mismatch", 0) == 3


ALLOC = REGION + [created(), requested("r0", "e1", ["j/0", "j/1"]),
                  allocated("r0", "e1", [("j/0", "m1"), ("j/1", "m1")], added=["m1"])]

# name: (the log before, the task ids freed, expected (task, machine) deallocated, machines released)
FREES = {
    "every-task-of-a-machine-releases-it": (ALLOC, ["j/0", "j/1"], [("j/0", "m1"), ("j/1", "m1")], ["m1"]),
    "one-of-two-keeps-the-machine": (ALLOC, ["j/1"], [("j/1", "m1")], []),
    "an-unknown-task-frees-nothing": (ALLOC, ["j/7"], [], []),
    "nothing-placed-frees-nothing": (REGION + [created()], ["j/0"], [], []),
    "another-entitlements-task-is-not-freed": (
        ALLOC + [created("e2"), requested("r2", "e2", ["k/0"], job="k"),
                 allocated("r2", "e2", [("k/0", "m2")], added=["m2"], job="k")],
        ["k/0", "j/0"], [("j/0", "m1")], []),
}


@pytest.mark.parametrize("before,free,freed,released", FREES.values(), ids=FREES.keys())
def test_frees_decides_what_the_request_frees(before, free, freed, released):
    fold = fold_of(before)
    snapshot = copy.deepcopy(state(fold))
    events = decide.frees(fold, requested("r1", "e1", [], free=free), TS)
    dealloc = [e for e in events if e.type == "TasksDeallocated"]
    assert sorted((r["task_id"], r["machine_id"]) for e in dealloc for r in e.payload["placements"]) == freed
    assert [e.payload["machine_id"] for e in events if e.type == "MachineReleasedToFreePool"] == released
    assert all(e.payload["reason"] == RELEASED_EMPTY for e in events if e.type == "MachineReleasedToFreePool")
    assert bool(events) == bool(freed)
    assert state(fold) == snapshot


# name: (the rejection, its reason)
REJECTIONS = {
    "exhausted": (lambda r: decide.exhausted(r, 5, {"m1": "machine_version_changed"}, TS), COMMIT_RETRIES_EXHAUSTED),
    "failed": (lambda r: decide.failed(r, KeyError("x"), TS), ALLOCATOR_ERROR),
}


@pytest.mark.parametrize("make,reason", REJECTIONS.values(), ids=REJECTIONS.keys())
def test_the_processors_rejections_name_their_reason_and_every_task(make, reason):
    r = requested("r1", "e1", ["j/0", "j/1"])
    [e] = make(r)
    assert (e.type, e.payload["reason"], e.payload["unplaced_task_ids"]) == ("AllocationRejected", reason,
                                                                            ["j/0", "j/1"])


# name: (the map's entry, the request's partition, what it waits for)
DRAINS = {
    "never-mapped": (None, 3, None),
    "never-moved": (MapEntry("e1", 3), 3, None),
    "moving-to-here": (MapEntry("e1", 1, epoch=1, moving_to=3, drain_offset=40), 3, (1, 40)),
    "moving-from-here": (MapEntry("e1", 1, epoch=1, moving_to=3, drain_offset=40), 1, None),
    "moved-here": (MapEntry("e1", 3, epoch=1, history=(1,), drain_offset=40), 3, (1, 40)),
    "moved-no-drain-offset": (MapEntry("e1", 3, epoch=1, history=(1,)), 3, None),
}


@pytest.mark.parametrize("entry,partition,expected", DRAINS.values(), ids=DRAINS.keys())
def test_drain_of(entry, partition, expected):
    assert drain_of(entry, partition) == expected
    assert partition in expected_partitions(entry, partition)
