"""The allocator's Redis machine index on a real redis-server: events -> keys, idempotence, rebuild equality,
the optimistic commit, and two allocator processes racing for one free pool."""
from __future__ import annotations

import multiprocessing
import random
import time
import uuid
from collections import defaultdict
from itertools import count

import pytest
import redis

from processors.allocator import placement
from processors.allocator.cache import AllocationCache
from processors.allocator.index import (
    COMMIT_RETRIES_EXHAUSTED, CONFLICT_TASK_PLACED, MachineIndex, MissingResources, UnknownMachine, allocate,
)
from processors.allocator.placement import (
    CONFLICT_CAPACITY, CONFLICT_OWNER, CONFLICT_STATUS, CONFLICT_VERSION, Entitlement, Request, commit_check,
)
from streams.events import Event, derived_event_id
from streams.partitioner import partition_for
from streams.topics import TOPIC_OF_EVENT

pytestmark = pytest.mark.integration

PARTITIONS = 4


@pytest.fixture
def ix(cfg) -> MachineIndex:
    index = MachineIndex(redis.Redis.from_url(cfg.redis_url), cfg.topic_prefix)
    yield index
    index.clear()


# --- event builders -------------------------------------------------------------------------------------

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


def apply_all(ix, events):
    log = Log()
    for e in events:
        ix.apply(*log.add(e))
    return log


def without_marks(dump):
    return {k: v for k, v in dump.items() if not k.startswith("applied:")}


# --- (a) event sequences -> keys ------------------------------------------------------------------------

ALLOC_J01 = [reg("m1"), reg("m2"), requested("r1", "e1", ["j/0", "j/1"]),
             allocated("r1", "e1", [("j/0", "m1"), ("j/1", "m1")], added=["m1"])]
ABSENT = None

# name: (events, {key: expected}); a hash is compared on the listed fields, ABSENT means no such key.
SEQUENCES = {
    "register": (
        [reg("m1")],
        {"m:m1": {"region": "reg1", "dc": "dc1", "msb": "msb1", "rack": "r1", "type": "skylake", "cpu_cap": "4000",
                  "mem_cap": "8192", "cpu_free": "4000", "mem_free": "8192", "entitlement": "", "status": "UP",
                  "host_profile": "", "version": "1"},
         "idx:dc:dc1": ["m1"], "idx:type:skylake": ["m1"], "idx:status:UP": ["m1"], "free:dc1": ["m1"],
         "dcs": ["dc1"], "z:cpu_free": {"m1": 4000.0}}),
    "status-down-moves-status-index": (
        [reg("m1"), reg("m2"), status("m1", "DOWN")],
        {"m:m1": {"status": "DOWN", "version": "2"}, "idx:status:DOWN": ["m1"], "idx:status:UP": ["m2"]}),
    "same-status-again-is-no-change": (
        [reg("m1"), status("m1", "UP")], {"m:m1": {"status": "UP", "version": "1"}}),
    "host-profile": ([reg("m1"), profile("m1", "web")], {"m:m1": {"host_profile": "web", "version": "2"}}),
    "assign-moves-free-to-entitlement": (
        [reg("m1"), assign("m1", "e1")],
        {"m:m1": {"entitlement": "e1", "version": "2"}, "ent:e1": ["m1"], "free:dc1": ABSENT}),
    "assign-of-a-held-machine-is-ignored": (
        [reg("m1"), assign("m1", "e1"), assign("m1", "e2")],
        {"m:m1": {"entitlement": "e1", "version": "2"}, "ent:e1": ["m1"], "ent:e2": ABSENT}),
    "release-back-to-free-pool": (
        [reg("m1"), assign("m1", "e1"), release("m1", "e1")],
        {"m:m1": {"entitlement": "", "version": "3"}, "ent:e1": ABSENT, "free:dc1": ["m1"]}),
    "release-by-a-non-owner-is-ignored": (
        [reg("m1"), assign("m1", "e2"), release("m1", "e1")],
        {"m:m1": {"entitlement": "e2", "version": "2"}, "ent:e2": ["m1"]}),
    "request-remembers-resources": (
        [requested("r1", "e1", ["j/0", "j/1"], cpu=500, mem=256)],
        {"req:r1": {"cpu": "500", "mem": "256", "t:j/0": "1", "t:j/1": "1"}}),
    "allocate-places-and-takes-capacity": (
        ALLOC_J01,
        {"m:m1": {"cpu_free": "2000", "mem_free": "6144", "entitlement": "e1", "version": "3"},
         "m:m2": {"cpu_free": "4000", "version": "1"}, "tasks:m1": ["j/0", "j/1"],
         "placement": {"j/0": "m1", "j/1": "m1"}, "taskres": {"j/0": "1000 1024", "j/1": "1000 1024"},
         "z:cpu_free": {"m1": 2000.0, "m2": 4000.0}, "ent:e1": ["m1"], "free:dc1": ["m2"], "req:r1": ABSENT}),
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
         "free:dc1": ["m1", "m2"], "ent:e1": ABSENT, "tasks:m1": ABSENT, "placement": ABSENT, "taskres": ABSENT,
         "z:cpu_free": {"m1": 4000.0, "m2": 4000.0}}),
    "deallocate-names-the-wrong-machine": (
        ALLOC_J01 + [deallocated("e1", [("j/0", "m2")])],
        {"m:m1": {"cpu_free": "2000", "version": "3"}, "m:m2": {"version": "1"}, "placement": {"j/0": "m1",
                                                                                              "j/1": "m1"}}),
    "release-after-deallocate-event-changes-nothing": (
        ALLOC_J01 + [deallocated("e1", [("j/0", "m1"), ("j/1", "m1")], released=["m1"]), release("m1", "e1")],
        {"m:m1": {"entitlement": "", "version": "5"}}),
    "release-with-tasks-on-the-machine-is-ignored": (
        ALLOC_J01 + [release("m1", "e1")], {"m:m1": {"entitlement": "e1", "version": "3"}, "ent:e1": ["m1"]}),
    # A materializer reading the machines topic late: e1 released m1 and took it again before the first
    # assign/release pair is read; the stale pair must not move it.
    "late-assign-and-release-after-the-entitlement-took-it-again": (
        ALLOC_J01 + [deallocated("e1", [("j/0", "m1"), ("j/1", "m1")], released=["m1"]),
                     requested("r2", "e1", ["j/2"]), allocated("r2", "e1", [("j/2", "m1")], added=["m1"]),
                     assign("m1", "e1"), release("m1", "e1")],
        {"m:m1": {"entitlement": "e1", "cpu_free": "3000", "version": "7"}, "ent:e1": ["m1"]}),
    "task-placed-elsewhere-moves": (
        ALLOC_J01 + [requested("r2", "e1", ["j/0"], cpu=1000, mem=1024), assign("m2", "e1"),
                     allocated("r2", "e1", [("j/0", "m2")])],
        {"m:m1": {"cpu_free": "3000", "version": "4"}, "m:m2": {"cpu_free": "3000", "version": "3"},
         "placement": {"j/0": "m2", "j/1": "m1"}, "tasks:m1": ["j/1"], "tasks:m2": ["j/0"]}),
    "re-registration-with-more-capacity-keeps-the-tasks": (
        ALLOC_J01 + [reg("m1", cpu=8000, mem=16384)],
        {"m:m1": {"cpu_cap": "8000", "cpu_free": "6000", "mem_free": "14336", "version": "4"},
         "z:cpu_free": {"m1": 6000.0, "m2": 4000.0}}),
    "re-registration-in-another-dc-moves-indexes": (
        [reg("m1"), reg("m1", dc="dc2")],
        {"m:m1": {"dc": "dc2", "version": "2"}, "free:dc1": ABSENT, "free:dc2": ["m1"], "idx:dc:dc1": ABSENT,
         "idx:dc:dc2": ["m1"], "dcs": ["dc1", "dc2"]}),
    "identical-re-registration-is-no-change": ([reg("m1"), reg("m1")], {"m:m1": {"version": "1"}}),
}


def check(dump, expected):
    for key, want in expected.items():
        if want is ABSENT:
            assert key not in dump, f"{key} should be absent, is {dump.get(key)}"
        elif isinstance(want, dict) and key.startswith(("m:", "req:")):
            assert {f: dump.get(key, {}).get(f) for f in want} == want, key
        else:
            assert dump.get(key) == want, key


@pytest.mark.parametrize("events,expected", SEQUENCES.values(), ids=SEQUENCES.keys())
def test_event_sequences_give_these_keys(ix, events, expected):
    apply_all(ix, events)
    check(ix.dump(), expected)


ERRORS = {
    "status-of-unknown-machine": ([reg("m1")], status("m9", "DOWN"), UnknownMachine),
    "assign-unknown-machine": ([], assign("m9", "e1"), UnknownMachine),
    "allocate-on-unknown-machine": ([reg("m1"), requested("r1", "e1", ["j/0"])],
                                    allocated("r1", "e1", [("j/0", "m1"), ("j/1", "m9")], ["m1"]), UnknownMachine),
    "allocate-without-its-request": ([reg("m1")], allocated("r1", "e1", [("j/0", "m1")], ["m1"]),
                                     MissingResources),
}


@pytest.mark.parametrize("before,event,error", ERRORS.values(), ids=ERRORS.keys())
def test_an_event_that_cannot_apply_writes_nothing_not_even_its_mark(ix, before, event, error):
    log = apply_all(ix, before)
    dump = ix.dump()
    with pytest.raises(error):
        ix.apply(*log.add(event))
    assert ix.dump() == dump
    with pytest.raises(error):
        ix.apply_many([log.records[-1]])
    assert ix.dump() == dump


def test_only_machine_and_allocation_events_apply(ix):
    with pytest.raises(ValueError, match="does not apply JobSubmitted"):
        ix.apply(Event("JobSubmitted", "e1", "j", {}), ("intents", 0, 0))


# --- (c) a region driven by the allocator: the live index vs the log -----------------------------------

ENTS = {f"e{i}": Entitlement(f"e{i}", quota_machines=12) for i in range(1, 5)}
STATUSES = ("UP", "UP", "UP", "DOWN", "MAINTENANCE", "UNHEALTHY")


def drive_region(ix: MachineIndex, n_events: int, seed: int) -> Log:
    """Run the allocator against ``ix`` the way the system does, and return the log it produced.

    Machine events and allocator results are applied as a materializer would after reading them back; the
    allocator's commits write the index first (sometimes before its AllocationRequested is applied, as when
    the materializer lags), so the TasksAllocated that records a commit finds its facts already there.
    """
    rnd, log = random.Random(seed), Log()
    machines = [f"m{i:02d}" for i in range(40)]

    def emit(event):
        ix.apply(*log.add(event))

    for i, mid in enumerate(machines):
        emit(reg(mid, dc=f"dc{i % 2 + 1}", msb=f"msb{i % 3}", rack=f"r{i % 5}", type=("skylake", "broadwell")[i % 4 == 0],
                 cpu=rnd.choice((4000, 8000)), mem=16384))
    jobs: dict[str, tuple[str, list[str]]] = {}  # job -> (entitlement, task ids placed)
    for step in count():
        if len(log.records) >= n_events:
            return log
        roll = rnd.random()
        if roll < 0.55 or not jobs:
            ent = rnd.choice(sorted(ENTS))
            job, rid = f"{ent}-j{step}", f"{ent}-r{step}"
            tasks = tuple(f"{job}/{k}" for k in range(rnd.randint(1, 5)))
            req = Request(rid, job, ent, tasks, cpu=rnd.choice((500, 1000, 2000)), mem=rnd.choice((512, 2048)),
                          requirements={"dc": "dc1"} if rnd.random() < 0.3 else {})
            request_event = requested(rid, ent, tasks, req.cpu, req.mem, job=job)
            lag = rnd.random() < 0.5
            if not lag:
                emit(request_event)
            plan, attempts, conflicts = allocate(ix, ENTS[ent], req)
            assert not conflicts  # one allocator: nothing moves under it
            if lag:
                emit(request_event)
            for mid in plan.machines_added:
                emit(assign(mid, ent, ix.machine(mid).dc))
            if plan.placements:
                emit(allocated(rid, ent, plan.placements, plan.machines_added, job=job))
                jobs[job] = (ent, [t for t, _ in plan.placements])
            if plan.unplaced:
                emit(rejected(rid, ent, plan.unplaced, job=job))
        elif roll < 0.8:
            job = rnd.choice(sorted(jobs))
            ent, tasks = jobs[job]
            placed = ix.placements()
            freeing = tasks if rnd.random() < 0.6 else tasks[: max(1, len(tasks) // 2)]
            left = [t for t in tasks if t not in freeing]
            if left:
                jobs[job] = (ent, left)
            else:
                del jobs[job]
            freed = {placed[t] for t in freeing}
            released = sorted(m for m in freed if ix.machine(m).entitlement == ent and
                              not (set(ix.r.smembers(ix.key(f"tasks:{m}"))) - {t.encode() for t in freeing}))
            emit(deallocated(ent, [(t, placed[t]) for t in freeing], released, job=job))
            for mid in released:
                emit(release(mid, ent, ix.machine(mid).dc))
        elif roll < 0.93:
            mid = rnd.choice(machines)
            m = ix.machine(mid)
            emit(status(mid, rnd.choice(STATUSES), ent=m.entitlement or f"free/{m.dc}"))
        else:
            mid = rnd.choice(machines)
            emit(profile(mid, rnd.choice(("web", "batch", "db")), ent=ix.machine(mid).entitlement or "free"))


@pytest.fixture(scope="module")
def region_log(infra_cfg):
    """A ~500-event log and the dump of the live index that produced it (commits + materialized events)."""
    index = MachineIndex(redis.Redis.from_url(infra_cfg.redis_url), f"region-{uuid.uuid4().hex[:8]}.")
    index.clear()
    log = drive_region(index, 500, seed=7)
    live = index.dump()
    index.clear()
    return log, live


def test_the_driven_region_did_what_the_tests_need(region_log):
    log, live = region_log
    types = {e.type for e, _ in log.records}
    assert types == {"MachineRegistered", "MachineStatusChanged", "HostProfileApplied", "AllocationRequested",
                     "TasksAllocated", "AllocationRejected", "TasksDeallocated", "MachineAssignedToEntitlement",
                     "MachineReleasedToFreePool"}
    assert len(log.records) >= 500 and len(live["placement"]) > 20


def test_rebuild_from_the_log_equals_the_live_index_key_for_key(ix, region_log):
    """The live index (allocator commits + materialized events) == a rebuild from the log alone, applied marks
    included: the rebuild reads the same records at the same positions."""
    log, live = region_log
    assert ix.rebuild(log.records) == len(log.records)
    assert ix.dump() == live
    # and again: clear, apply the same sequence (what `ropewalk rebuild` does) -> the same keys
    ix.clear()
    for record in log.records:
        assert ix.apply(*record)
    assert ix.dump() == live


# --- (b) at-least-once delivery ---------------------------------------------------------------------------

def test_every_event_applied_twice_at_its_position_changes_nothing(ix, region_log):
    log, live = region_log
    for record in log.records:
        assert ix.apply(*record) is True
        assert ix.apply(*record) is False
    assert ix.dump() == live
    assert ix.apply_many(log.records) == 0  # a whole batch redelivered
    assert ix.dump() == live


def test_every_event_redelivered_at_a_new_offset_changes_nothing_but_the_mark(ix, region_log):
    """A producer retry writes the record twice: the copy has its own offset. Content idempotence absorbs it;
    only the applied marks differ (offsets shift), so they are left out of the comparison."""
    log, live = region_log
    dup = Log()
    for event, _ in log.records:
        ix.apply(*dup.add(event))
        ix.apply(*dup.add(event))
    assert without_marks(ix.dump()) == without_marks(live)


def test_tasks_allocated_redelivered_at_a_new_position_does_not_subtract_twice(ix):
    log = apply_all(ix, ALLOC_J01)
    before = ix.dump()
    event, (topic, partition, offset) = log.records[-1]
    assert ix.apply(event, (topic, partition, offset + 10))
    after = ix.dump()
    assert after["applied:allocator"] == {f"{topic}/{partition}": str(offset + 10), **{
        k: v for k, v in before["applied:allocator"].items() if k != f"{topic}/{partition}"}}
    assert without_marks(after) == without_marks(before)
    assert after["m:m1"]["cpu_free"] == "2000"


# --- (d) the optimistic commit ---------------------------------------------------------------------------

E1 = Entitlement("e1", quota_machines=10)


def commit_setup(ix):
    """m1 held by e1 with one task, m2 and m3 free; a plan on a snapshot: 2 tasks on m1, 1 on m2 (added)."""
    apply_all(ix, [reg("m1", msb="a"), reg("m2", msb="b"), reg("m3", msb="c"), requested("r0", "e1", ["old/0"]),
                   allocated("r0", "e1", [("old/0", "m1")], ["m1"])])
    snap = ix.snapshot(entitlement="e1")
    plan = [("j/0", "m1"), ("j/1", "m1"), ("j/2", "m2")]
    return snap, plan, {mid: snap[mid].version for mid in ("m1", "m2")}


def fill_m1(ix):  # e1 places another job on m1 after the snapshot: 1000 left
    assert ix.commit([("k/0", "m1"), ("k/1", "m1")], {"m1": ix.machine("m1").version}, "e1", 1000, 1024).ok


# name: (change after the snapshot, expected conflicts, whether placement.commit_check says the same)
COMMITS = {
    "no-change-commits": (lambda ix: None, {}, True),
    "host-profile-changed-version": (lambda ix: ix.apply(profile("m1", "web"), ("machines", 0, 100)),
                                     {"m1": CONFLICT_VERSION}, True),
    "capacity-taken-by-another-job": (fill_m1, {"m1": CONFLICT_CAPACITY}, True),
    "free-machine-taken-by-other-entitlement": (lambda ix: ix.apply(assign("m2", "e2"), ("machines", 0, 100)),
                                                {"m2": CONFLICT_OWNER}, True),
    "machine-went-down": (lambda ix: ix.apply(status("m2", "DOWN"), ("machines", 0, 100)),
                          {"m2": CONFLICT_STATUS}, True),
    "held-machine-released-meanwhile": (
        lambda ix: (ix.apply(deallocated("e1", [("old/0", "m1")], ["m1"]), ("allocations", 0, 100))),
        {"m1": CONFLICT_OWNER}, False),  # commit_check accepts a free machine; the plan assumed e1 holds it
    "every-conflicting-machine-is-reported": (
        lambda ix: (ix.apply(status("m1", "DOWN"), ("machines", 0, 100)),
                    ix.apply(assign("m2", "e2"), ("machines", 0, 101))),
        {"m1": CONFLICT_STATUS, "m2": CONFLICT_OWNER}, True),
}


@pytest.mark.parametrize("change,conflicts,same_as_commit_check", COMMITS.values(), ids=COMMITS.keys())
def test_commit_is_all_or_nothing(ix, change, conflicts, same_as_commit_check):
    snap, plan, versions = commit_setup(ix)
    change(ix)
    before = ix.dump()
    result = ix.commit(plan, versions, "e1", 1000, 1024, machines_added=["m2"])
    assert dict(result.conflicts) == conflicts
    assert result.ok is (not conflicts)
    if conflicts:
        assert ix.dump() == before and not result.versions
        if same_as_commit_check:
            for mid, reason in conflicts.items():
                n = sum(1 for _, m in plan if m == mid)
                assert commit_check(ix.machine(mid), versions[mid], 1000, 1024, n, entitlement="e1") == reason
        return
    after = ix.dump()
    assert dict(result.versions) == {"m1": versions["m1"] + 1, "m2": versions["m2"] + 2}  # m2: owner + tasks
    assert after["m:m1"]["cpu_free"] == "1000" and after["m:m2"]["cpu_free"] == "3000"
    assert after["m:m2"]["entitlement"] == "e1" and after["ent:e1"] == ["m1", "m2"] and after["free:dc1"] == ["m3"]
    assert after["placement"] == {"old/0": "m1", "j/0": "m1", "j/1": "m1", "j/2": "m2"}
    assert after["z:cpu_free"] == {"m1": 1000.0, "m2": 3000.0, "m3": 4000.0}


def test_commit_refuses_a_task_that_is_already_placed(ix):
    snap, plan, versions = commit_setup(ix)
    assert ix.commit(plan, versions, "e1", 1000, 1024, machines_added=["m2"]).ok
    before = ix.dump()
    result = ix.commit([("j/0", "m3")], {"m3": ix.machine("m3").version}, "e1", 1000, 1024, machines_added=["m3"])
    assert dict(result.conflicts) == {"m3": CONFLICT_TASK_PLACED} and ix.dump() == before


def test_commit_then_its_events_equals_the_events_alone(ix):
    """The allocator's commit writes first; TasksAllocated/MachineAssignedToEntitlement then change nothing."""
    snap, plan, versions = commit_setup(ix)
    assert ix.commit(plan, versions, "e1", 1000, 1024, machines_added=["m2"]).ok
    events = [requested("r1", "e1", ["j/0", "j/1", "j/2"]), assign("m2", "e1"),
              allocated("r1", "e1", plan, ["m2"])]
    log = Log()
    for e in [reg("m1", msb="a"), reg("m2", msb="b"), reg("m3", msb="c"), requested("r0", "e1", ["old/0"]),
              allocated("r0", "e1", [("old/0", "m1")], ["m1"])] + events:
        log.add(e)
    for record in log.records[5:]:
        ix.apply(*record)
    live = ix.dump()
    ix.rebuild(log.records)
    assert ix.dump() == live



# --- (d') the allocator's assign echo ----------------------------------------------------------------------

def decide_assign_then_release(ix):
    """What the live allocator does (processor.py's own event builders): request r1 of e1 commits j/0 on a free
    machine (TasksAllocated + MachineAssignedToEntitlement echo); request r2 frees j/0 and releases the machine
    (TasksDeallocated, applied at once, + MachineReleasedToFreePool echo). Returns the machine, the log so far
    (r1's request and TasksAllocated, r2's request and TasksDeallocated, in the order the index read them)
    and the two echoes on ``machines``, not read yet."""
    from processors.allocator.processor import free_events, plan_events

    log = Log()
    for e in (reg("m1"), reg("m2", msb="msb2")):
        ix.apply(*log.add(e))
    req1 = requested("r1", "e1", ["j/0"])
    ix.apply(*log.add(req1))
    plan, attempts, _ = allocate(ix, E1, Request("r1", "j", "e1", ("j/0",), 1000, 1024), cause=req1.event_id)
    (mid,) = plan.machines_added  # the commit wrote the assignment
    decision1 = plan_events(req1, plan, attempts, ix.machines([mid]), 1_795_000_000_000)
    tasks_allocated, assign_echo = decision1
    assert (tasks_allocated.type, assign_echo.type) == ("TasksAllocated", "MachineAssignedToEntitlement")
    ix.apply(*log.add(tasks_allocated))  # its facts are written already: changes nothing
    req2 = requested("r2", "e1", [], free=["j/0"])
    ix.apply(*log.add(req2))
    tasks_deallocated, release_echo = free_events(req2, {"j/0": mid}, [mid], ix.machines([mid]), 1_795_000_000_005)
    assert release_echo.type == "MachineReleasedToFreePool"
    ix.apply(*log.add(tasks_deallocated))
    m = ix.machine(mid)
    assert m.entitlement is None and (m.cpu_free, m.mem_free) == (4000, 8192)
    return mid, log, assign_echo, release_echo


def test_a_stale_assign_echo_read_after_a_later_release_leaves_the_machine_free(ix):
    """The assign echo of r1 is read (on ``machines``) after r2's release: the machine stays in the free pool
    with its full capacity, e1 holds nothing, and nothing else changes; r2's release echo then changes nothing."""
    mid, log, assign_echo, release_echo = decide_assign_then_release(ix)
    before = without_marks(ix.dump())
    assert ix.apply(*log.add(assign_echo))
    dump = ix.dump()
    assert dump["m:" + mid]["entitlement"] == "" and mid in dump["free:dc1"] and "ent:e1" not in dump
    assert (dump["m:" + mid]["cpu_free"], dump["m:" + mid]["mem_free"]) == ("4000", "8192")
    assert ix.held_count("e1") == 0
    assert without_marks(dump) == before  # not even a version bump
    assert ix.apply(*log.add(release_echo))
    assert without_marks(ix.dump()) == before
    # A rebuild from these records in the same order gives the same index (the commit left nothing else).
    live = ix.dump()
    ix.rebuild(log.records)
    assert ix.dump() == live


def test_an_assign_echo_read_before_its_tasks_allocated_changes_nothing_either(ix):
    """The echo never carries a fact of its own: read before its TasksAllocated (another interleaving of the
    topics), the TasksAllocated still makes the same assignment, versions included."""
    mid, log, assign_echo, release_echo = decide_assign_then_release(ix)
    live = without_marks(ix.dump())
    events = [e for e, _ in log.records]
    at = next(i for i, e in enumerate(events) if e.type == "TasksAllocated")
    reordered = Log()
    ix.rebuild(reordered.add(e) for e in events[:at] + [assign_echo] + events[at:])
    assert without_marks(ix.dump()) == live


def test_an_assign_from_anyone_but_the_allocator_still_takes_a_free_machine(ix):
    """Only the allocator's echoes are inert: an assignment nobody else wrote is applied as before."""
    apply_all(ix, [reg("m1"), assign("m1", "e1")])
    assert ix.machine("m1").entitlement == "e1" and ix.held_count("e1") == 1

ALLOCATES = {
    # (machines to register, request, expected placements, expected reason)
    "places-and-commits": ([reg("a", msb="a"), reg("b", msb="b")], dict(n=2),
                           (("j/0", "a"), ("j/1", "b")), None),
    "nothing-fits-explains-over-all-machines": (
        [reg("a", type="broadwell"), reg("b", dc="dc2")], dict(n=1, requirements={"machine_type": "skylake",
                                                                                  "dc": "dc1"}),
        (), "no_feasible_machine"),
}


@pytest.mark.parametrize("machines,req,placements,reason", ALLOCATES.values(), ids=ALLOCATES.keys())
def test_allocate(ix, machines, req, placements, reason):
    apply_all(ix, machines)
    n = req.pop("n")
    request = Request("r1", "j", "e1", tuple(f"j/{i}" for i in range(n)), 1000, 1024, **req)
    plan, attempts, conflicts = allocate(ix, E1, request)
    assert (plan.placements, plan.reason, attempts, conflicts) == (placements, reason, 1, ())
    assert ix.placements() == dict(placements)
    if reason:
        assert dict(plan.filter_rejections) == {"machine_type_mismatch": 1, "dc_mismatch": 1}
        assert "1 machine_type_mismatch, 1 dc_mismatch" in plan.message


def test_allocate_gives_up_after_max_attempts(ix):
    """A rival changes every machine of the plan between snapshot and commit: each attempt conflicts."""
    apply_all(ix, [reg(f"m{i}") for i in range(3)])
    offsets, commit = count(100), ix.commit

    def commit_after_a_rival(placements, versions, *args, **kw):
        for mid in versions:
            ix.apply(profile(mid, f"p{next(offsets)}"), ("machines", 0, next(offsets)))
        return commit(placements, versions, *args, **kw)

    ix.commit = commit_after_a_rival
    plan, attempts, conflicts = allocate(ix, E1, Request("r1", "j", "e1", ("j/0",), 1000, 1024), max_attempts=3)
    assert attempts == 3 and conflicts == ({"m0": CONFLICT_VERSION},) * 3
    assert plan.reason == COMMIT_RETRIES_EXHAUSTED and plan.placements == () and plan.unplaced == ("j/0",)
    assert "3 commit attempts met conflicts (machine_version_changed)" in plan.message
    assert ix.placements() == {}


# --- (f) the job-level allocation cache on Redis --------------------------------------------------------------

def cache_region(ix):
    apply_all(ix, [reg(f"{msb}{i}", msb=msb, cpu=8000, mem=16384) for msb in "abc" for i in range(4)])


def job(name, n=3, **kw):
    return Request(f"{name}-r", name, "e1", tuple(f"{name}/{i}" for i in range(n)), 1000, 1024, **kw)


def test_a_second_job_of_the_same_shape_hits_and_decides_as_a_full_placement(ix):
    cache_region(ix)
    cache = AllocationCache()
    first, attempts, _ = allocate(ix, E1, job("a"), cache=cache)
    assert not first.cache_hit and attempts == 1 and len(cache) == 1
    expected = placement.place(ix.snapshot(entitlement="e1"), E1, job("b"), ix.held_count("e1"))
    second, attempts, _ = allocate(ix, E1, job("b"), cache=cache)
    assert second.cache_hit and attempts == 1
    assert (second.placements, second.machines_added) == (expected.placements, expected.machines_added)
    assert ix.placements() == {**dict(first.placements), **dict(second.placements)}
    # the job grows: its placed tasks count in the spread (task ids 3.. of job b)
    grown = Request("b-r2", "b", "e1", ("b/3", "b/4"), 1000, 1024, existing=dict(second.placements))
    expected = placement.place(ix.snapshot(entitlement="e1"), E1, grown, ix.held_count("e1"))
    third, _, _ = allocate(ix, E1, grown, cache=cache)
    assert third.cache_hit and third.placements == expected.placements


def test_a_change_the_cache_did_not_make_is_a_miss(ix):
    cache_region(ix)
    cache = AllocationCache()
    first, _, _ = allocate(ix, E1, job("a"), cache=cache)
    used = first.placements[0][1]
    ix.apply(profile(used, "web"), ("machines", 0, 1000))  # a machine e1 holds changed: version and epoch
    second, _, _ = allocate(ix, E1, job("b"), cache=cache)
    assert not second.cache_hit
    assert allocate(ix, E1, job("c"), cache=cache)[0].cache_hit


def test_a_stale_hit_costs_a_retry_never_an_over_commit(ix):
    """A rival fills every machine of the cached plan between the lookup and the commit: the hit's commit
    conflicts, the entry is dropped, and the retry places on a full snapshot; no machine goes below zero."""
    cache_region(ix)
    cache = AllocationCache()
    allocate(ix, E1, job("a"), cache=cache)
    commit, calls = ix.commit, []

    def rival_first(placements, versions, *args, **kw):
        calls.append(dict(placements))
        if len(calls) == 1:  # the cached plan: a rival takes what is left on each of its machines first
            for mid in versions:
                m = ix.machine(mid)
                assert commit([(f"rival-{mid}/0", mid)], {mid: m.version}, "e1", m.cpu_free, m.mem_free).ok
        return commit(placements, versions, *args, **kw)

    ix.commit = rival_first
    plan, attempts, conflicts = allocate(ix, E1, job("b"), cache=cache)
    assert attempts == 2 and set(conflicts[0].values()) == {CONFLICT_CAPACITY}
    assert plan.placements and not plan.cache_hit  # the retry was a miss, on other machines
    assert not set(calls[0].values()) & set(calls[1].values())
    for mid, m in ix.snapshot(entitlement="e1").items():
        assert m.cpu_free >= 0 and m.mem_free >= 0, mid


# --- (g) the outbox: what state.machines must publish ------------------------------------------------------------

def test_every_change_queues_the_machine_once_with_its_version_and_cause(ix):
    log = apply_all(ix, [reg("m1"), reg("m2")])
    assert ix.outbox() == {"m1": (1, log.records[0][0].event_id), "m2": (1, log.records[1][0].event_id)}
    assert "outbox:machines" not in ix.dump()  # the publisher's queue, not index state
    assert ix.outbox_done({"m1": 1, "m2": 1}) == 2 and ix.outbox() == {}
    # a redelivered registration (same offset, or a new one) changes nothing: nothing to publish
    ix.apply(*log.records[0])
    ix.apply(log.records[0][0], ("machines", 0, 99))
    assert ix.outbox() == {}
    # the allocator's commit queues what it changed, under the request's event id
    assert ix.epoch("e1") == 0
    result = ix.commit([("j/0", "m1")], {"m1": 1}, "e1", 1000, 1024, machines_added=["m1"], cause="req-1")
    assert ix.outbox() == {"m1": (result.versions["m1"], "req-1")} and result.versions["m1"] == 3
    assert result.epochs == (0, 2) and ix.epoch("e1") == 2  # owner + tasks, while e1 holds it
    # a change queued after a state was read stays until its own state is published
    ix.apply(status("m1", "DOWN", ent="e1"), ("machines", 0, 100))
    assert ix.outbox_done({"m1": 3}) == 0 and ix.outbox()["m1"][0] == 4
    assert ix.outbox_done({"m1": 4}) == 1 and ix.outbox() == {}
    state = ix.states(["m1", "nope"])
    assert list(state) == ["m1"] and state["m1"]["task_ids"] == ["j/0"] and state["m1"]["status"] == "DOWN"
    assert (state["m1"]["id"], state["m1"]["entitlement"], state["m1"]["cpu_free"], state["m1"]["version"]) == (
        "m1", "e1", "3000", "4")


# --- (e) two allocator processes racing for one free pool ---------------------------------------------------

RACE_MACHINES, RACE_CPU, RACE_MEM, RACE_SECONDS = 24, 8000, 16384, 4.0


def _race_worker(url: str, prefix: str, ent: str, partition: int, seed: int, barrier, out) -> None:
    """One allocator: for RACE_SECONDS, allocate small and whole-machine requests for ``ent``, and now and
    then free one of its jobs (giving emptied machines back to the free pool), so the pool keeps churning."""
    index = MachineIndex(redis.Redis.from_url(url), prefix)
    entitlement, rnd, offsets = Entitlement(ent, quota_machines=RACE_MACHINES), random.Random(seed), count()
    results, freed, live_jobs = [], [], {}
    barrier.wait()
    deadline = time.monotonic() + RACE_SECONDS
    for i in count():
        if time.monotonic() > deadline:
            break
        if live_jobs and rnd.random() < 0.4:
            job = rnd.choice(sorted(live_jobs))
            placements = live_jobs.pop(job)
            machines = {m for _, m in placements}
            tasks = {t for t, _ in placements}
            released = sorted(m for m in machines if not {t.decode() for t in index.r.smembers(
                index.key(f"tasks:{m}"))} - tasks)
            index.apply(deallocated(ent, placements, released, job=job), ("allocations", partition, next(offsets)))
            freed.extend(t for t, _ in placements)
            continue
        cpu = rnd.choice((1000, 2000, RACE_CPU))
        tasks = tuple(f"{ent}-j{i}/{k}" for k in range(1 if cpu == RACE_CPU else rnd.randint(1, 3)))
        req = Request(f"{ent}-r{i}", f"{ent}-j{i}", ent, tasks, cpu=cpu, mem=cpu * 2)
        plan, attempts, conflicts = allocate(index, entitlement, req)
        if plan.placements:
            live_jobs[req.job_id] = list(plan.placements)
        results.append((list(plan.placements), cpu, cpu * 2, attempts, [dict(c) for c in conflicts], plan.reason))
    out.put((results, freed))


def test_two_allocator_processes_racing_for_one_free_pool(ix, cfg):
    apply_all(ix, [reg(f"m{i:02d}", msb=f"msb{i % 3}", cpu=RACE_CPU, mem=RACE_MEM) for i in range(RACE_MACHINES)])
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(cfg.redis_url, cfg.topic_prefix, ent, part, seed, barrier, out))
             for ent, part, seed in (("eA", 0, 1), ("eB", 1, 2))]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    outputs = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    elapsed = time.monotonic() - t0
    results = [r for rs, _ in outputs for r in rs]
    freed = {t for _, fs in outputs for t in fs}

    committed = [(t, m, cpu, mem) for placements, cpu, mem, *_ in results for t, m in placements]
    conflicts = [c for *_, cs, _ in results for c in cs]
    reasons = defaultdict(int)
    for c in conflicts:
        for r in c.values():
            reasons[r] += 1
    print(f"\nrace: {len(results)} allocations, {len(committed)} tasks placed, {len(freed)} freed, "
          f"{len(conflicts)} conflicting commits {dict(reasons)}, max attempts {max(r[3] for r in results)}, "
          f"{sum(r[5] == COMMIT_RETRIES_EXHAUSTED for r in results)} gave up, {elapsed:.1f}s")

    # every committed placement is recorded exactly once; freed ones are gone; nothing else is there
    assert len({t for t, *_ in committed}) == len(committed)
    placed = [(t, m, cpu, mem) for t, m, cpu, mem in committed if t not in freed]
    assert ix.placements() == {t: m for t, m, *_ in placed}
    used = defaultdict(lambda: [0, 0])
    for t, m, cpu, mem in placed:
        used[m][0] += cpu
        used[m][1] += mem
    machines = ix.snapshot(include_free=True) | ix.snapshot(entitlement="eA", include_free=False) | \
        ix.snapshot(entitlement="eB", include_free=False)
    assert len(machines) == RACE_MACHINES
    for mid, m in machines.items():
        assert m.cpu_free >= 0 and m.mem_free >= 0, mid
        assert (m.cpu_capacity - m.cpu_free, m.mem_capacity - m.mem_free) == tuple(used[mid]), mid
        owners = {t.split("-")[0] for t, mm, *_ in placed if mm == mid}
        assert owners <= {m.entitlement}, (mid, owners)  # no machine runs two entitlements' tasks
    assert conflicts, "the two allocators never met a conflict"
    assert elapsed < 30
