"""The allocator's in-memory fold (processors/allocator/fold.py): events -> state, idempotence, the commit, the
frees, and that a fold's placement is the reference placement over the same region. Pure: no broker, no Redis.

The event-sequence table is the one the Redis index's Lua scripts were tested with before the fold replaced them
(same events, same versions and values), minus the index sets the fold no longer needs."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from allocator_log import (
    ALLOC_J01, SEQUENCES, Log, allocated, assign, check, deallocated, ev, profile, reg, rejected, requested, state,
    status, unavailability, unavailability_ended,
)
from processors.allocator import placement
from processors.allocator.fold import (
    ALLOCATOR_PRODUCER, CONFLICT_TASK_PLACED, MissingResources, RegionFold, UnknownMachineEvent, merged, releases,
)
from processors.allocator.placement import (
    CONFLICT_CAPACITY, CONFLICT_OWNER, CONFLICT_STATUS, CONFLICT_VERSION, Entitlement, Request,
)
from streams.events import Event


def apply_all(fold: RegionFold, events) -> Log:
    log = Log()
    for e in events:
        fold.apply(*log.add(e))
    return log


@pytest.mark.parametrize("events,expected", SEQUENCES.values(), ids=SEQUENCES.keys())
def test_event_sequences_give_this_state(events, expected):
    fold = RegionFold()
    apply_all(fold, events)
    check(state(fold), expected)


def batch_status(machines, s, ent="free/dc1"):
    return ev("MachinesStatusChanged", ent, machines[0], {
        "status": s, "reason": "health_check", "machines": [{"machine_id": m, "previous_status": "UP"} for m in machines]})


def test_a_batch_of_statuses_is_the_statuses_one_by_one():
    one, batch = RegionFold(), RegionFold()
    apply_all(one, [reg("m1"), reg("m2"), reg("m3"), status("m1", "DOWN"), status("m2", "DOWN")])
    apply_all(batch, [reg("m1"), reg("m2"), reg("m3"), batch_status(["m1", "m2"], "DOWN")])
    assert {k: v for k, v in one.dump().items() if k.startswith("m:")} == \
        {k: v for k, v in batch.dump().items() if k.startswith("m:")}


ERRORS = {
    "status-of-unknown-machine": ([reg("m1")], status("m9", "DOWN"), UnknownMachineEvent),
    "maintenance-naming-an-unknown-machine": ([reg("m1")], unavailability("ue1", ["m1", "m9"]), UnknownMachineEvent),
    "batch-status-naming-an-unknown-machine": ([reg("m1")], batch_status(["m1", "m9"], "DOWN"), UnknownMachineEvent),
    "assign-unknown-machine": ([], assign("m9", "e1"), UnknownMachineEvent),
    "allocate-on-unknown-machine": ([reg("m1"), requested("r1", "e1", ["j/0"])],
                                    allocated("r1", "e1", [("j/0", "m1"), ("j/1", "m9")], ["m1"]), UnknownMachineEvent),
    "allocate-without-its-request": ([reg("m1")], allocated("r1", "e1", [("j/0", "m1")], ["m1"]), MissingResources),
    "deallocate-releasing-an-unknown-machine": (ALLOC_J01, deallocated("e1", [("j/0", "m1")], released=["m9"]),
                                                UnknownMachineEvent),
}


@pytest.mark.parametrize("before,event,error", ERRORS.values(), ids=ERRORS.keys())
def test_an_event_that_cannot_apply_changes_nothing_not_even_its_mark(before, event, error):
    fold = RegionFold()
    log = apply_all(fold, before)
    snapshot = state(fold)
    with pytest.raises(error):
        fold.apply(*log.add(event))
    assert state(fold) == snapshot


def test_an_offset_at_or_below_the_mark_changes_nothing():
    fold = RegionFold()
    log = apply_all(fold, ALLOC_J01)
    snapshot = state(fold)
    for event, position in log.records:
        assert fold.apply(event, position) is False
    assert state(fold) == snapshot


def test_every_event_redelivered_at_a_new_offset_changes_nothing_but_the_mark():
    """A redelivered copy (the same event again at a new offset, e.g. produced twice) right after the first is a
    no-op by content: the same state, only the mark moves."""
    fold, log = RegionFold(), Log()
    for event in ALLOC_J01 + [reg("m3"), status("m3", "DOWN"), assign("m2", "e2"), profile("m3", "db"),
                              deallocated("e1", [("j/0", "m1")]), rejected("r1", "e1", ["j/1"])]:
        fold.apply(*log.add(event))
        before = {k: v for k, v in state(fold).items() if not k.startswith("applied:")}
        assert fold.apply(*log.add(event)) is True
        assert {k: v for k, v in state(fold).items() if not k.startswith("applied:")} == before, event.type


def test_the_allocators_own_echoes_change_nothing():
    """MachineAssignedToEntitlement from the allocator echoes TasksAllocated.machines_added: the fact is the
    TasksAllocated's, so the echo is a no-op whenever it is read (before, after, long after a release)."""
    fold = RegionFold()
    echo = Event(type="MachineAssignedToEntitlement", entitlement="e1", entity_id="m1",
                 payload={"machine_id": "m1", "dc": "dc1", "reason": "allocation r1"}, producer=ALLOCATOR_PRODUCER,
                 event_id="echo")
    apply_all(fold, [reg("m1"), echo])
    assert fold.machines["m1"].entitlement == "" and fold.machines["m1"].version == 1


def test_a_decision_on_the_log_is_remembered_by_its_request():
    fold = RegionFold()
    decision = allocated("r1", "e1", [("j/0", "m1")], ["m1"])
    decision = Event(**{**decision.__dict__, "producer": ALLOCATOR_PRODUCER, "causation_id": "request-event-1"})
    apply_all(fold, [reg("m1"), requested("r1", "e1", ["j/0"]), decision])
    assert fold.is_decided("request-event-1") and not fold.is_decided("request-event-2")


# --- the commit ---------------------------------------------------------------------------------------------

def commit_region() -> RegionFold:
    fold = RegionFold()
    apply_all(fold, [reg("m1"), reg("m2"), reg("m3", cpu=1000), assign("m3", "e2")])
    return fold


COMMIT_CASES = {
    # name: (change before the commit, plan placements, machines added, expected conflicts)
    "clean": (None, [("j/0", "m1"), ("j/1", "m1")], ["m1"], {}),
    "machine went down": (lambda f: f.apply(status("m1", "DOWN"), None), [("j/0", "m1")], ["m1"],
                          {"m1": CONFLICT_STATUS}),
    "taken by another entitlement": (lambda f: f.apply(assign("m1", "e2"), None), [("j/0", "m1")], ["m1"],
                                     {"m1": CONFLICT_OWNER}),
    "not enough capacity": (None, [(f"j/{i}", "m1") for i in range(5)], ["m1"], {"m1": CONFLICT_CAPACITY}),
    "version moved": (lambda f: f.apply(profile("m1", "web", ent="free/dc1"), None), [("j/0", "m1")], ["m1"],
                      {"m1": CONFLICT_VERSION}),
    "unknown machine": (None, [("j/0", "m9")], [], {"m9": CONFLICT_STATUS}),
}


@pytest.mark.parametrize("change,pairs,added,conflicts", COMMIT_CASES.values(), ids=COMMIT_CASES.keys())
def test_the_commit_rechecks_every_machine_and_is_all_or_nothing(change, pairs, added, conflicts):
    fold = commit_region()
    expected = {mid: m.version for mid, m in fold.machines.items()}
    if change is not None:
        change(fold)
    before = state(fold)
    res = fold.commit(pairs, added, "e1", 1000, 1024, expected, cause="req-1")
    assert dict(res.conflicts) == conflicts and res.ok == (not conflicts)
    if conflicts:
        assert state(fold) == before
    else:
        assert fold.machines["m1"].entitlement == "e1" and fold.machines["m1"].version == 3
        assert fold.placement == {"j/0": "m1", "j/1": "m1"} and res.versions == {"m1": 3}


def test_the_commit_refuses_a_task_already_placed():
    fold = commit_region()
    expected = {mid: m.version for mid, m in fold.machines.items()}
    assert fold.commit([("j/0", "m1")], ["m1"], "e1", 1000, 1024, expected, "r").ok
    res = fold.commit([("j/0", "m2")], ["m2"], "e1", 1000, 1024, {"m2": 1}, "r2")
    assert dict(res.conflicts) == {"m2": CONFLICT_TASK_PLACED}


def test_a_commit_then_its_events_equals_the_events_alone():
    committed, from_log = commit_region(), commit_region()
    assert committed.commit([("j/0", "m1"), ("j/1", "m2")], ["m1", "m2"], "e1", 1000, 1024, {"m1": 1, "m2": 1},
                            "r1").ok
    events = [requested("r1", "e1", ["j/0", "j/1"]),
              allocated("r1", "e1", [("j/0", "m1"), ("j/1", "m2")], added=["m1", "m2"])]
    for e in events:  # the commit's own events read back: nothing changes
        committed.apply(e, None)
        from_log.apply(e, None)
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("applied:")}  # noqa: E731
    assert strip(committed.dump()) == strip(from_log.dump())


def test_releases_give_back_machines_the_free_empties():
    fold = RegionFold()
    apply_all(fold, [reg("m1"), reg("m2"), requested("r1", "e1", ["j/0", "j/1", "j/2"]),
                     allocated("r1", "e1", [("j/0", "m1"), ("j/1", "m1"), ("j/2", "m2")], added=["m1", "m2"])])
    assert releases(fold, "e1", {"j/0": "m1", "j/1": "m1"}) == ("m1",)
    assert releases(fold, "e1", {"j/0": "m1"}) == ()  # j/1 stays on m1
    assert releases(fold, "e2", {"j/2": "m2"}) == ()  # not e2's machine


# --- the order a log is folded in ---------------------------------------------------------------------------

def test_the_merge_replays_a_handover_in_the_order_it_was_decided():
    """e1 frees m1 (its partition), then e2 takes it (another partition): a fold that read e2's allocation
    first would leave m1 e1's with e2's tasks; the merge by decision time applies them as decided."""
    events = [reg("m1"), requested("r1", "e1", ["a/0"]), allocated("r1", "e1", [("a/0", "m1")], ["m1"]),
              deallocated("e1", [("a/0", "m1")], released=["m1"], job="a"),
              requested("r2", "e2", ["b/0"]), allocated("r2", "e2", [("b/0", "m1")], ["m1"])]
    stamped = [Event(**{**e.__dict__, "timestamp_ms": 1000 + i}) for i, e in enumerate(events)]
    log = Log()
    records = [log.add(e) for e in stamped]
    by_partition: dict = {}
    for e, pos in records:
        by_partition.setdefault(pos[:2], []).append((e, pos))
    # worst case: the partitions handed over in the reverse order of the decisions
    fold = RegionFold()
    for e, pos in merged(dict(reversed(list(by_partition.items())))):
        fold.apply(e, pos)
    assert fold.machines["m1"].entitlement == "e2" and fold.placement == {"b/0": "m1"}


# --- placement on the fold is the reference placement --------------------------------------------------------

def test_placement_on_the_fold_equals_placement_run_on_a_seeded_region():
    rng = random.Random(11)
    fold = RegionFold()
    events = [reg(f"m{i:03d}", dc=f"dc{i % 2}", msb=f"msb{i % 5}", rack=f"r{i % 11}",
                  type=("skylake", "broadwell")[i % 3 == 0], cpu=(8000, 4000)[i % 3 == 0],
                  mem=(16384, 8192)[i % 3 == 0]) for i in range(120)]
    events += [status(f"m{i:03d}", "DOWN", ent=f"free/dc{i % 2}") for i in range(0, 120, 13)]
    apply_all(fold, events)
    ent = Entitlement("e1", quota_machines=20)
    checked = 0
    for n in range(40):
        req = Request(request_id=f"r{n}", job_id=f"j{n}", entitlement="e1",
                      task_ids=tuple(f"j{n}/{i}" for i in range(rng.randint(1, 12))), cpu=rng.choice((500, 1000, 3000)),
                      mem=rng.choice((512, 2048)), requirements=rng.choice(({}, {"dc": "dc1"}, {"machine_type": "skylake"})),
                      spread=rng.choice(("dc", "msb", "rack")))
        dc, mtype = req.requirements.get("dc"), req.requirements.get("machine_type")
        snapshot = {mid: m.view() for mid, m in fold.machines.items()
                    if m.entitlement in ("", "e1") and dc in (None, m.dc) and mtype in (None, m.type)}
        want = placement.run(snapshot, ent, req, fold.held_count("e1")).plan
        got = fold.place(ent, req)
        assert got == want, n
        if got.placements:
            expected = {mid: fold.machines[mid].version for _, mid in got.placements}
            expected.update({mid: fold.machines[mid].version for mid in got.machines_added})
            assert fold.commit(got.placements, got.machines_added, "e1", req.cpu, req.mem, expected, f"r{n}").ok
            checked += 1
    assert checked > 10


def test_a_maintenance_on_the_log_keeps_every_placement_off_its_machines_until_it_ends():
    """The reproduction of issue 11: a task moved off an MSB under maintenance went to a free machine of that very
    MSB (its bin was the emptiest). The fold filters the maintenance's machines, held or free, for any request."""
    fold = RegionFold()
    log = apply_all(fold, [reg("a1", msb="msb1"), reg("b2", msb="msb2"), reg("c2", msb="msb2"),
                           unavailability("ue1", ["b2", "c2"])])
    e1 = Entitlement("e1", quota_machines=10)
    ask = Request(request_id="r1", job_id="j", entitlement="e1", task_ids=("j/0", "j/1"), cpu=1000, mem=1024,
                  existing={"j/9": "a1"})  # msb1 has a task of the job: msb2 would be the spread's choice
    plan = fold.place(e1, ask)
    assert plan.placements == (("j/0", "a1"), ("j/1", "a1"))
    assert dict(plan.filter_rejections) == {placement.FILTER_MAINTENANCE: 2}
    fold.apply(*log.add(unavailability_ended("ue1", ["b2", "c2"])))
    assert {mid for _, mid in fold.place(e1, ask).placements} == {"b2"}


def test_the_fold_counts_its_machines_by_status_as_they_change():
    """RegionFold.statuses (what the index summary says and `ropewalk up` waits on) follows registrations and every
    status change, whichever event carries it."""
    fold = RegionFold()
    ms = [reg(f"dc1-msb1-r01-m00{i}") for i in range(4)]
    for i, e in enumerate(ms):
        fold.apply(e, ("machines", 0, i))
    assert +fold.statuses == Counter({"UP": 4})
    fold.apply(status("dc1-msb1-r01-m000", "DOWN"), ("machines", 0, 10))
    fold.apply(status("dc1-msb1-r01-m000", "DOWN"), ("machines", 0, 11))  # no change: counted once
    fold.apply(status("dc1-msb1-r01-m001", "MAINTENANCE"), ("machines", 0, 12))
    assert +fold.statuses == Counter({"UP": 2, "DOWN": 1, "MAINTENANCE": 1})
    assert +fold.statuses == Counter(m.status for m in fold.machines.values())


def held(fold: RegionFold, mid: str, tasks: dict, **changes) -> dict:
    """``MachineIndex.reload``'s fields of ``mid``: the fold's own, with ``tasks`` and ``changes``."""
    m = fold.machines[mid]
    return {**m.fields(), "maintenance": m.maintenance, "tasks": tasks, **changes}


# name: (machine adopted, its tasks as the index holds them, field changes, expected placement, expected status
#        counts, expected cpu_free per machine)
ADOPTIONS = {
    "a-task-moved-here-from-another-machine": (
        "m2", {"j/1": (1000, 1024)}, {"cpu_free": 3000, "entitlement": "e1", "version": 9},
        {"j/0": "m1", "j/1": "m2"}, {"UP": 2}, {"m1": 3000, "m2": 3000}),
    "a-task-gone-from-the-machine": (
        "m1", {"j/0": (1000, 1024)}, {"cpu_free": 3000, "version": 9}, {"j/0": "m1"}, {"UP": 2}, {"m1": 3000, "m2": 4000}),
    "another-status-keeps-the-counts": (
        "m2", {}, {"status": "DOWN", "version": 9}, {"j/0": "m1", "j/1": "m1"}, {"UP": 1, "DOWN": 1},
        {"m1": 2000, "m2": 4000}),
}


@pytest.mark.parametrize("mid,tasks,changes,placement_,statuses,cpu_free", ADOPTIONS.values(), ids=ADOPTIONS.keys())
def test_adopt_takes_a_machine_as_the_index_holds_it(mid, tasks, changes, placement_, statuses, cpu_free):
    fold = RegionFold()
    apply_all(fold, ALLOC_J01)
    fold.index  # noqa: B018 - built: adopt keeps it in step
    fold.drain_changes()
    assert fold.adopt(mid, held(fold, mid, tasks, **changes))
    assert fold.placement == placement_
    assert {s: n for s, n in fold.statuses.items() if n} == statuses
    assert {m: fold.machines[m].cpu_free for m in cpu_free} == cpu_free
    assert all(getattr(fold.machines[mid], k) == v for k, v in changes.items())
    assert set(fold.taskres) == set(placement_) and fold.job_tasks["j"] == set(placement_)
    assert fold.index.snapshot("e1")[mid] == fold.machines[mid].view()  # the placement index follows
    assert fold.drain_changes() == {}  # not a change read on the log: nothing to project


def test_adopting_an_unknown_machine_changes_nothing():
    fold = RegionFold()
    apply_all(fold, ALLOC_J01)
    before = state(fold)
    assert not fold.adopt("m9", {"tasks": {"j/0": (1, 1)}, "status": "DOWN"})
    assert state(fold) == before


def test_read_to_moves_a_mark_forward_only():
    fold = RegionFold()
    for offset, expected in [(-1, None), (4, 4), (2, 4), (7, 7)]:
        fold.read_to("allocations", 0, offset)
        assert fold.marks.get(("allocations", 0)) == expected
