"""The allocator's Redis index on a real redis-server: the projection of the fold (key for key, version-guarded)
and the batched commit (re-checked machine by machine, all or nothing, journaled, fenced)."""
from __future__ import annotations

import json

import pytest

from allocator_log import SEQUENCES, Log, allocated, assign, deallocated, profile, reg, requested, status
from processors.allocator.fold import CONFLICT_TASK_PLACED, RegionFold
from processors.allocator.index import CONFLICT, FENCED, JOURNALED, Decision, MachineIndex
from processors.allocator.placement import (
    CONFLICT_CAPACITY, CONFLICT_OWNER, CONFLICT_QUOTA, CONFLICT_STATUS, CONFLICT_VERSION,
)
from processors.allocator.rebuild import index_state


@pytest.fixture
def ix(cfg) -> MachineIndex:
    index = MachineIndex(cfg.redis_client(), cfg.topic_prefix)
    yield index
    index.clear()


def fold_of(events) -> RegionFold:
    fold, log = RegionFold(), Log()
    for e in events:
        fold.apply(*log.add(e))
    return fold


@pytest.mark.parametrize("events,expected", SEQUENCES.values(), ids=SEQUENCES.keys())
def test_the_projection_writes_the_fold_key_for_key(ix, events, expected):
    fold = fold_of(events)
    ix.project_all(fold)
    assert index_state(ix.dump()) == index_state(fold.dump())


def test_a_projection_step_by_step_equals_the_whole_one(ix, cfg):
    """Projecting after every event (what the allocator does per batch) ends where one whole projection does:
    moved tasks leave their old machine's set and the placement hash."""
    events = SEQUENCES["task-placed-elsewhere-moves"][0] + [deallocated("e1", [("j/1", "m1")], released=["m1"])]
    fold, log = RegionFold(), Log()
    for e in events:
        fold.apply(*log.add(e))
        ix.project(fold, fold.drain_changes(), entitlements=fold.entitlement_fields)
    whole = MachineIndex(ix.r, "whole." + cfg.topic_prefix)
    whole.project_all(fold)
    try:
        assert index_state(ix.dump()) == index_state(whole.dump()) == index_state(fold.dump())
    finally:
        whole.clear()


def test_the_projection_never_writes_an_older_version_over_a_newer_one(ix):
    ahead = fold_of([reg("m1"), status("m1", "DOWN"), profile("m1", "web", ent="free/dc1")])
    behind = fold_of([reg("m1")])
    ix.project_all(ahead)
    assert ix.project_all(behind) == 0
    assert ix.dump()["m:m1"]["version"] == "3" and ix.dump()["m:m1"]["status"] == "DOWN"


def test_marks_only_grow(ix):
    fold = fold_of([reg("m1"), reg("m2")])
    ix.project_all(fold)
    marks = ix.marks()
    ix.project(RegionFold(), {}, marks=True)  # a fold that has read nothing
    assert ix.marks() == marks and marks


def test_a_drain_goes_on_from_its_cursor_and_misses_nothing(ix):
    """The outbox is read in rounds from where the last round's HSCAN stopped (a scan from 0 each round walked past
    every bucket the rounds before had emptied: O(n²) in Redis for a region's registration). A machine queued while
    the pass runs, behind the cursor or ahead of it, and one queued again at a newer version, are all read: at the
    latest in the next pass, which a round that finds the rest of its pass empty begins at once."""
    n = 3000  # past Redis's compact encoding (128 fields): a real hash table, whose SCAN cursor means something
    ix.r.hset(ix.key("outbox:machines"), mapping={f"m{i}": "1 registered" for i in range(n)})
    read: dict[str, int] = {}
    cursor, rounds = 0, 0
    while True:
        got, cursor = ix.outbox_from(cursor, 250)
        if not got:
            break
        rounds += 1
        assert rounds < 100, "the drain does not end"
        for mid, (version, _) in got.items():
            read[mid] = max(read.get(mid, 0), version)
        ix.outbox_done({mid: version for mid, (version, _) in got.items()})
        if rounds == 3:  # queued meanwhile: new machines, and a new version of one already published
            ix.r.hset(ix.key("outbox:machines"), mapping={"late-a": "1 registered", "late-b": "1 registered",
                                                         "m0": "2 status"})
    assert set(read) == {f"m{i}" for i in range(n)} | {"late-a", "late-b"} and read["m0"] == 2
    assert ix.outbox() == {}


def test_every_projected_change_is_queued_once_for_state_machines(ix):
    fold = fold_of([reg("m1"), reg("m2")])
    ix.project(fold, fold.drain_changes())
    assert {m: v for m, (v, _) in ix.outbox().items()} == {"m1": 1, "m2": 1}
    ix.outbox_done({"m1": 1, "m2": 1})
    fold.apply(status("m1", "DOWN"), None)
    ix.project(fold, fold.drain_changes())
    assert {m: v for m, (v, _) in ix.outbox().items()} == {"m1": 2}


# --- the commit ----------------------------------------------------------------------------------------------

def committed_region(ix) -> RegionFold:
    fold = fold_of([reg("m1"), reg("m2"), reg("m3", cpu=1000), assign("m3", "e2"),
                    requested("r0", "e1", ["old/0"]), allocated("r0", "e1", [("old/0", "m2")], ["m2"])])
    ix.project_all(fold)
    return fold


def decision(rid="req-1", plan=(("m1", 1, True, ("j/0", "j/1")),), frees=(), released=(), fence=None, events="[]",
             ent="e1") -> Decision:
    return Decision(rid, 0, fence, ent, 1000, 1024, tuple(frees), tuple(released), tuple(plan), events)


CHANGES = {
    # name: (a change in Redis after the plan was made, expected conflicts)
    "none": (None, {}),
    "machine went down": (lambda f: f.apply(status("m1", "DOWN"), None), {"m1": CONFLICT_STATUS}),
    "taken by another entitlement": (lambda f: f.apply(assign("m1", "e3"), None), {"m1": CONFLICT_OWNER}),
    "version moved": (lambda f: f.apply(profile("m1", "web", ent="free/dc1"), None), {"m1": CONFLICT_VERSION}),
}


@pytest.mark.parametrize("change,conflicts", CHANGES.values(), ids=CHANGES.keys())
def test_the_commit_rechecks_each_machine_and_is_all_or_nothing(ix, change, conflicts):
    fold = committed_region(ix)
    if change is not None:  # another allocator's write, as its projection leaves it
        change(fold)
        ix.project(fold, fold.drain_changes())
    before = index_state(ix.dump())
    [res] = ix.commit([decision(events='["e"]')])
    if conflicts:
        assert (res.outcome, dict(res.conflicts)) == (CONFLICT, conflicts)
        assert index_state(ix.dump()) == before
    else:
        assert res.outcome == "ok" and dict(res.versions) == {"m1": 3}
        assert ix.placements() == {"old/0": "m2", "j/0": "m1", "j/1": "m1"}
        assert ix.dump()["alloc:done:req-1"] == '["e"]'


def test_the_commit_checks_capacity_and_tasks_already_placed(ix):
    committed_region(ix)
    [cap] = ix.commit([decision(plan=(("m3", 2, False, ("j/0", "j/1")),), ent="e2")])
    assert (cap.outcome, dict(cap.conflicts)) == (CONFLICT, {"m3": CONFLICT_CAPACITY})
    [placed] = ix.commit([decision(plan=(("m1", 1, True, ("old/0",)),))])
    assert (placed.outcome, dict(placed.conflicts)) == (CONFLICT, {"m1": CONFLICT_TASK_PLACED})


def test_the_commit_equals_the_folds_commit(ix):
    """The commit writes in Redis what ``RegionFold.commit`` does in memory: the same versions and keys."""
    fold = committed_region(ix)
    res = fold.commit([("j/0", "m1"), ("j/1", "m1"), ("j/2", "m2")], ["m1"], "e1", 1000, 1024,
                      {"m1": 1, "m2": 3}, "req-1")
    assert res.ok
    [got] = ix.commit([decision(plan=(("m1", 1, True, ("j/0", "j/1")), ("m2", 3, False, ("j/2",))))])
    assert got.outcome == "ok" and dict(got.versions) == dict(res.versions)
    dump = {k: v for k, v in index_state(ix.dump()).items() if not k.startswith(("alloc:", "applied:"))}
    assert dump == {k: v for k, v in index_state(fold.dump()).items() if not k.startswith("applied:")}


def test_frees_come_first_and_a_journaled_decision_answers_the_same_request_again(ix):
    fold = committed_region(ix)
    events = json.dumps([{"type": "TasksDeallocated"}])
    [first] = ix.commit([decision(plan=(), frees=[("old/0", "m2")], released=["m2"], events=events)])
    assert first.outcome == "ok" and ix.placements() == {}
    assert ix.dump()["m:m2"]["entitlement"] == "" and ix.dump()["m:m2"]["version"] == "5"
    fold.apply(deallocated("e1", [("old/0", "m2")], released=["m2"], job="old"), None)
    assert ix.dump()["m:m2"] == fold.dump()["m:m2"]  # the free in Redis is the fold's free
    [again] = ix.commit([decision(plan=(("m1", 1, True, ("j/0",)),), frees=[("old/0", "m2")], released=["m2"])])
    assert (again.outcome, again.events) == (JOURNALED, events)  # the same request: its decision, not a new one
    assert ix.placements() == {}


def test_a_decision_under_a_stale_fence_is_refused(ix):
    committed_region(ix)
    fences = ix.fence([0])
    [stale] = ix.commit([decision(fence=fences[0] - 1)])
    [fresh] = ix.commit([decision(rid="req-2", fence=fences[0])])
    assert stale.outcome == FENCED and fresh.outcome == "ok"
    assert ix.fence([0]) == {0: fences[0] + 1}


def test_a_batch_commits_each_decision_on_its_own(ix):
    committed_region(ix)
    results = ix.commit([decision(rid="a", plan=(("m1", 1, True, ("a/0",)),)),
                         decision(rid="b", plan=(("m1", 1, True, ("b/0",)),)),  # m1 moved on with "a"
                         decision(rid="c", plan=(("m3", 2, False, ("c/0",)),), ent="e2")])
    assert [r.outcome for r in results] == ["ok", CONFLICT, "ok"]
    assert dict(results[1].conflicts) == {"m1": CONFLICT_OWNER}


def test_reload_reads_a_machine_with_its_tasks(ix):
    committed_region(ix)
    got = ix.reload(["m2", "m9"])
    assert list(got) == ["m2"] and got["m2"]["tasks"] == {"old/0": (1000, 1024)} and got["m2"]["version"] == 3


@pytest.mark.parametrize("quota,outcome", [(None, "ok"), (2, "ok"), (1, CONFLICT)])
def test_a_plan_that_adds_machines_is_checked_against_the_quota_redis_holds(ix, quota, outcome):
    """e1 holds m2 (``held:e1``); a plan adding m1 fits a quota of 2, not of 1: then it is a conflict naming the
    machine it would add, with the machines e1 holds (what the loser reloads), and nothing is written."""
    fold = committed_region(ix)
    assert ix.dump()["held:e1"] == ["m2"] and ix.dump()["held:e2"] == ["m3"]
    before = index_state(ix.dump())
    [res] = ix.commit([Decision("req-1", 0, None, "e1", 1000, 1024, (), (), (("m1", 1, True, ("j/0",)),), '["e"]',
                                quota=quota)])
    assert res.outcome == outcome
    if outcome == CONFLICT:
        assert dict(res.conflicts) == {"m1": CONFLICT_QUOTA} and res.held == ("m2",)
        assert index_state(ix.dump()) == before
    else:
        assert ix.dump()["held:e1"] == ["m1", "m2"]
        fold.commit([("j/0", "m1")], ["m1"], "e1", 1000, 1024, {"m1": 1}, "req-1")
        assert {k: v for k, v in index_state(ix.dump()).items() if k.startswith("held:")} == \
            {k: v for k, v in fold.dump().items() if k.startswith("held:")}


def test_the_held_sets_follow_every_owner_change_of_the_projection(ix):
    """A machine released and another assigned by events (not by a commit): the projection moves them between
    the entitlements' held sets, as a rebuild (a whole projection) has them."""
    fold = committed_region(ix)
    fold.apply(deallocated("e1", [("old/0", "m2")], released=["m2"], job="old"), None)
    fold.apply(assign("m1", "e2"), None)
    ix.project(fold, fold.drain_changes())
    assert "held:e1" not in ix.dump() and ix.dump()["held:e2"] == ["m1", "m3"]
    assert index_state(ix.dump()) == index_state(fold.dump())
