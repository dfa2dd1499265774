"""Event builders for the allocator's tests, and ``Log``: positions as the broker would give them. Shared by the
fold's unit tests and the Redis index's integration tests (not a test module)."""
from __future__ import annotations

from collections import defaultdict
from itertools import count

from processors.allocator.placement import Entitlement, Machine, Request
from streams.events import Event, derived_event_id
from streams.partitioner import partition_for
from streams.topics import TOPIC_OF_EVENT

PARTITIONS = 4


def ev(type_, ent, entity, payload) -> Event:
    return Event(type=type_, entitlement=ent, entity_id=entity, payload=payload, producer="test",
                 event_id=derived_event_id(type_, entity, *sorted(map(str, payload.items()))))


def reg(mid, dc="dc1", msb="msb1", rack="r1", type="skylake", cpu=4000, mem=8192, profile=None):
    return ev("MachineRegistered", f"free/{dc}", mid, {
        "machine_id": mid, "topology": {"region": "reg1", "dc": dc, "msb": msb, "rack": rack},
        "machine_type": type, "capacity": {"cpu_millicores": cpu, "memory_mib": mem}, "host_profile": profile})


def status(mid, s, ent="free/dc1"):
    return ev("MachineStatusChanged", ent, mid, {"machine_id": mid, "status": s, "previous_status": "UP",
                                                 "reason": "test"})


def unavailability(ue, machines, kind="MAINTENANCE", ent="free/dc1"):
    return ev("UnavailabilityStarted", ent, ue, {
        "unavailability_id": ue, "kind": kind, "machine_ids": list(machines), "start_ms": 2_000_000_000_000,
        "deadline_ms": None, "expected_duration_ms": 600_000, "reason": "test"})


def unavailability_ended(ue, machines, ent="free/dc1"):
    return ev("UnavailabilityEnded", ent, ue, {"unavailability_id": ue, "machine_ids": list(machines)})


def profile(mid, p, ent="e1"):
    return ev("HostProfileApplied", ent, mid, {"machine_id": mid, "host_profile": p, "previous_host_profile": None})


def assign(mid, ent, dc="dc1"):
    return ev("MachineAssignedToEntitlement", ent, mid, {"machine_id": mid, "dc": dc, "reason": "test"})


def release(mid, ent, dc="dc1"):
    return ev("MachineReleasedToFreePool", ent, mid, {"machine_id": mid, "dc": dc, "reason": "entitlement_empty"})


def requested(rid, ent, tasks, cpu=1000, mem=1024, job="j", free=()):
    return ev("AllocationRequested", ent, rid, {
        "request_id": rid, "job_id": job, "spec_version": 1, "place_task_ids": list(tasks),
        "free_task_ids": list(free), "resources": {"cpu_millicores": cpu, "memory_mib": mem}, "requirements": {},
        "spread": "msb", "avoid_machine_ids": []})


def _pl(placements):
    return [{"task_id": t, "machine_id": m, "dc": "dc1", "msb": "msb1", "rack": "r1"} for t, m in placements]


def allocated(rid, ent, placements, added=(), job="j"):
    return ev("TasksAllocated", ent, rid, {
        "request_id": rid, "job_id": job, "placements": _pl(placements), "filter_rejections": {},
        "fault_domain_bins": {}, "machines_added": list(added), "cache_hit": False, "commit_attempts": 1})


def rejected(rid, ent, tasks, job="j"):
    return ev("AllocationRejected", ent, rid, {"request_id": rid, "job_id": job, "reason": "no_feasible_machine",
                                                "message": "m", "unplaced_task_ids": list(tasks),
                                                "filter_rejections": {}})


def deallocated(ent, placements, released=(), job="j", rid=""):
    return ev("TasksDeallocated", ent, rid or job, {"request_id": rid, "job_id": job, "placements": _pl(placements),
                                                    "machines_released": list(released)})


class Log:
    """Positions as the broker would give them: the event's topic, its key's partition, the next offset."""

    def __init__(self) -> None:
        self.records: list[tuple[Event, tuple[str, int, int]]] = []
        self._next: dict[tuple[str, int], count] = defaultdict(count)

    def add(self, event: Event) -> tuple[Event, tuple[str, int, int]]:
        topic = TOPIC_OF_EVENT[event.type]
        partition = partition_for(event.entitlement, PARTITIONS)
        record = (event, (topic, partition, next(self._next[topic, partition])))
        self.records.append(record)
        return record


# --- events -> state: the table the fold's unit tests and the Redis projection's integration tests share --------

def state(fold) -> dict:
    """fold.dump() plus the pending requests as ``req:<rid>`` (the shape the Lua index had)."""
    out = fold.dump()
    for rid, r in fold.requests.items():
        out[f"req:{rid}"] = {"cpu": str(r.cpu), "mem": str(r.mem), **{f"t:{t}": "1" for t in r.tasks}}
    return out


ALLOC_J01 = [reg("m1"), reg("m2"), requested("r1", "e1", ["j/0", "j/1"]),
             allocated("r1", "e1", [("j/0", "m1"), ("j/1", "m1")], added=["m1"])]
ABSENT = None

# name: (events, {key: expected}); a hash is compared on the listed fields, ABSENT means no such key.
SEQUENCES = {
    "register": (
        [reg("m1")],
        {"m:m1": {"region": "reg1", "dc": "dc1", "msb": "msb1", "rack": "r1", "type": "skylake", "cpu_cap": "4000",
                  "mem_cap": "8192", "cpu_free": "4000", "mem_free": "8192", "entitlement": "", "status": "UP",
                  "host_profile": "", "version": "1", "maintenance": ""}, "tasks:m1": ABSENT}),
    "maintenance-announced": (
        [reg("m1"), reg("m2"), unavailability("ue1", ["m1"]), unavailability("ue0", ["m1", "m2"])],
        {"m:m1": {"maintenance": "ue0,ue1", "status": "UP", "version": "3"},
         "m:m2": {"maintenance": "ue0", "version": "2"}}),
    "maintenance-ended": (
        [reg("m1"), unavailability("ue1", ["m1"]), unavailability("ue2", ["m1"]), unavailability_ended("ue1", ["m1"])],
        {"m:m1": {"maintenance": "ue2", "version": "4"}}),
    "failures-and-unknown-ends-change-nothing": (
        [reg("m1"), unavailability("f1", ["m1"], kind="FAILURE"), unavailability_ended("f1", ["m1"])],
        {"m:m1": {"maintenance": "", "version": "1"}}),
    "status-down": ([reg("m1"), reg("m2"), status("m1", "DOWN")], {"m:m1": {"status": "DOWN", "version": "2"}}),
    "same-status-again-is-no-change": ([reg("m1"), status("m1", "UP")], {"m:m1": {"status": "UP", "version": "1"}}),
    "host-profile": ([reg("m1"), profile("m1", "web")], {"m:m1": {"host_profile": "web", "version": "2"}}),
    "assign-moves-free-to-entitlement": ([reg("m1"), assign("m1", "e1")], {"m:m1": {"entitlement": "e1", "version": "2"},
                                                                            "held:e1": ["m1"]}),
    "assign-of-a-held-machine-is-ignored": (
        [reg("m1"), assign("m1", "e1"), assign("m1", "e2")], {"m:m1": {"entitlement": "e1", "version": "2"}}),
    "release-back-to-free-pool": (
        [reg("m1"), assign("m1", "e1"), release("m1", "e1")], {"m:m1": {"entitlement": "", "version": "3"},
                                                               "held:e1": ABSENT}),
    "release-by-a-non-owner-is-ignored": (
        [reg("m1"), assign("m1", "e2"), release("m1", "e1")], {"m:m1": {"entitlement": "e2", "version": "2"}}),
    "request-remembers-resources": (
        [requested("r1", "e1", ["j/0", "j/1"], cpu=500, mem=256)],
        {"req:r1": {"cpu": "500", "mem": "256", "t:j/0": "1", "t:j/1": "1"}}),
    "allocate-places-and-takes-capacity": (
        ALLOC_J01,
        {"m:m1": {"cpu_free": "2000", "mem_free": "6144", "entitlement": "e1", "version": "3"},
         "m:m2": {"cpu_free": "4000", "version": "1"}, "tasks:m1": ["j/0", "j/1"],
         "placement": {"j/0": "m1", "j/1": "m1"}, "taskres": {"j/0": "1000 1024", "j/1": "1000 1024"},
         "req:r1": ABSENT}),
    "assign-event-after-allocation-changes-nothing": (
        ALLOC_J01 + [assign("m1", "e1")], {"m:m1": {"entitlement": "e1", "version": "3"}}),
    "assign-event-before-allocation-gives-the-same-version": (
        [reg("m1"), reg("m2"), requested("r1", "e1", ["j/0", "j/1"]), assign("m1", "e1"),
         allocated("r1", "e1", [("j/0", "m1"), ("j/1", "m1")], added=["m1"])],
        {"m:m1": {"cpu_free": "2000", "entitlement": "e1", "version": "3"}}),
    "partial-answer-keeps-the-request-until-rejected": (
        [reg("m1"), requested("r1", "e1", ["j/0", "j/1", "j/2"]), allocated("r1", "e1", [("j/0", "m1")], ["m1"])],
        {"req:r1": {"cpu": "1000", "t:j/1": "1", "t:j/2": "1"}}),
    "rejection-answers-the-rest": (
        [reg("m1"), requested("r1", "e1", ["j/0", "j/1", "j/2"]), allocated("r1", "e1", [("j/0", "m1")], ["m1"]),
         rejected("r1", "e1", ["j/1", "j/2"])],
        {"req:r1": ABSENT, "placement": {"j/0": "m1"}}),
    "deallocate-and-release": (
        ALLOC_J01 + [deallocated("e1", [("j/0", "m1"), ("j/1", "m1")], released=["m1"])],
        {"m:m1": {"cpu_free": "4000", "mem_free": "8192", "entitlement": "", "version": "5"},
         "tasks:m1": ABSENT, "placement": ABSENT, "taskres": ABSENT}),
    "deallocate-names-the-wrong-machine": (
        ALLOC_J01 + [deallocated("e1", [("j/0", "m2")])],
        {"m:m1": {"cpu_free": "2000", "version": "3"}, "m:m2": {"version": "1"},
         "placement": {"j/0": "m1", "j/1": "m1"}}),
    "release-after-deallocate-event-changes-nothing": (
        ALLOC_J01 + [deallocated("e1", [("j/0", "m1"), ("j/1", "m1")], released=["m1"]), release("m1", "e1")],
        {"m:m1": {"entitlement": "", "version": "5"}}),
    "release-with-tasks-on-the-machine-is-ignored": (
        ALLOC_J01 + [release("m1", "e1")], {"m:m1": {"entitlement": "e1", "version": "3"}}),
    # A fold reading the machines topic late: e1 released m1 and took it again before the first assign/release
    # pair is read; the stale pair must not move it.
    "late-assign-and-release-after-the-entitlement-took-it-again": (
        ALLOC_J01 + [deallocated("e1", [("j/0", "m1"), ("j/1", "m1")], released=["m1"]),
                     requested("r2", "e1", ["j/2"]), allocated("r2", "e1", [("j/2", "m1")], added=["m1"]),
                     assign("m1", "e1"), release("m1", "e1")],
        {"m:m1": {"entitlement": "e1", "cpu_free": "3000", "version": "7"}}),
    "task-placed-elsewhere-moves": (
        ALLOC_J01 + [requested("r2", "e1", ["j/0"], cpu=1000, mem=1024), assign("m2", "e1"),
                     allocated("r2", "e1", [("j/0", "m2")])],
        {"m:m1": {"cpu_free": "3000", "version": "4"}, "m:m2": {"cpu_free": "3000", "version": "3"},
         "held:e1": ["m1", "m2"],
         "placement": {"j/0": "m2", "j/1": "m1"}, "tasks:m1": ["j/1"], "tasks:m2": ["j/0"]}),
    "re-registration-with-more-capacity-keeps-the-tasks": (
        ALLOC_J01 + [reg("m1", cpu=8000, mem=16384)],
        {"m:m1": {"cpu_cap": "8000", "cpu_free": "6000", "mem_free": "14336", "version": "4"}}),
    "re-registration-in-another-dc": ([reg("m1"), reg("m1", dc="dc2")], {"m:m1": {"dc": "dc2", "version": "2"}}),
    "identical-re-registration-is-no-change": ([reg("m1"), reg("m1")], {"m:m1": {"version": "1"}}),
    "entitlement-created-then-updated": (
        [ev("EntitlementCreated", "e1", "e1", {"name": "e1", "quota_machines": 4, "machine_type": None,
                                               "dc_pin": "dc1", "host_profile": None}),
         ev("EntitlementUpdated", "e1", "e1", {"name": "e1", "quota_machines": 6, "machine_type": None,
                                               "dc_pin": None, "host_profile": None})],
        {"entitlement:e1": {"quota_machines": "6", "machine_type": "", "dc_pin": "dc1", "host_profile": ""}}),
}


def check(dump, expected):
    for key, want in expected.items():
        if want is ABSENT:
            assert key not in dump, f"{key} should be absent, is {dump.get(key)}"
        elif isinstance(want, dict) and key.startswith(("m:", "req:")):
            assert {f: dump.get(key, {}).get(f) for f in want} == want, key
        else:
            assert dump.get(key) == want, key


# --- machines, requests and entitlements for the placement tests (placement.py and fastplace.py) ----------------

CPU, MEM = 1000, 2048  # one default task


def m(id, *, dc="dc1", msb="msb1", rack="r1", type="skylake", cpu=4000, mem=8192, used_cpu=0, used_mem=0,
      ent=None, status="UP", version=1, maintenance=()):
    return Machine(id=id, dc=dc, msb=msb, rack=rack, machine_type=type, cpu_free=cpu - used_cpu,
                   mem_free=mem - used_mem, cpu_capacity=cpu, mem_capacity=mem, entitlement=ent, status=status,
                   version=version, maintenance=tuple(maintenance))


def req(n, *, job="j", cpu=CPU, mem=MEM, **kw):
    return Request(request_id="r1", job_id=job, entitlement="e1", task_ids=tuple(f"{job}/{i}" for i in range(n)),
                   cpu=cpu, mem=mem, **kw)


def e1(quota=10, **kw):
    return Entitlement(name="e1", quota_machines=quota, **kw)
