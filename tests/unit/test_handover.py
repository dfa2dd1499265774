"""An entitlement moving between partitions (processors/scheduler/handover.py), pure: what a shard does with each
record (``route``), the move decided on the partition it leaves (``begin``), its state sent (``hand_over``) and adopted
on the partition it goes to (``adopt``), part by part, in any order, twice. Decisions on the adopted state are the
decisions the state it left would have made: a move changes nothing of a job but where it is decided."""
import dataclasses
import random

import pytest

from processors.scheduler import handover as ho
from processors.scheduler import model as sm
from processors.scheduler import store as st
from processors.scheduler.decide import decide, machines_of
from processors.scheduler.handover import DECIDE, FORWARD, HOLD, Home, Route
from processors.scheduler.reasons import REASON_UNKNOWN_ENTITLEMENT
from streams import batches
from streams.events import new_event
from streams.partitionmap import (REASON_HELD, REASON_MOVED, MapEntry, PartitionMap, assignment_event,
                                  least_loaded)
from streams.partitioner import partition_for
from streams.serde import SchemaRegistry
from test_scheduler_decide import (
    ENT, T0, agent_reactions, allocated, kinds, machine_status, running_job, spec_changed,
)

REG = SchemaRegistry.from_dir()
P0, P1, PARTS = 1, 3, 4


def entry(partition, epoch=0, moving_to=None):
    return MapEntry(ENT, partition, epoch, moving_to)


# -- route: what a shard does with a record of an entitlement -----------------------------------------------------

ROUTES = {
    # name: (home on this partition, map entry, this partition, record's epoch header) -> route
    "never heard of, no map: decided (its hash partition's)": (None, None, P0, None, Route(DECIDE)),
    "never heard of, the map says here": (None, entry(P0), P0, None, Route(DECIDE)),
    "never heard of, the map says elsewhere: a stale producer's, forwarded": (
        None, entry(P1, 2), P0, None, Route(FORWARD, P1, 2)),
    "forwarded at epoch 0 by a stale hash partition, lives here": (None, entry(P0), P0, 0, Route(DECIDE)),
    "forwarded by a move not adopted here yet: held": (None, entry(P0, 0, P1), P1, 1, Route(HOLD, epoch=1)),
    "lives here": (Home(P0), None, P0, None, Route(DECIDE)),
    "lives here, whatever a stale map says": (Home(P1, 1), entry(P0), P1, None, Route(DECIDE)),
    "leaving: forwarded to where it goes, with the move's epoch": (
        Home(P0, 1, moving_to=P1), entry(P0), P0, None, Route(FORWARD, P1, 1)),
    "left long ago: still forwarded": (Home(P0, 1, moving_to=P1, sent=True), entry(P1, 1), P0, None,
                                       Route(FORWARD, P1, 1)),
    "arriving (parts missing): held": (Home(P1, 1, parts=(0,), parts_total=2), None, P1, 1, Route(HOLD, epoch=1)),
    "adopted, a forwarded record of that move: decided": (Home(P1, 1), entry(P0, 0, P1), P1, 1, Route(DECIDE)),
    "adopted an older move, a record of a newer one: held": (Home(P1, 1), None, P1, 2, Route(HOLD, epoch=2)),
}


@pytest.mark.parametrize("home, map_entry, partition, epoch, want", ROUTES.values(), ids=ROUTES.keys())
def test_route(home, map_entry, partition, epoch, want):
    assert ho.route(home, map_entry, partition, epoch) == want


# -- begin: the move decided where the entitlement lives ----------------------------------------------------------

def move(to, *, ent=ENT, event_id="move-1"):
    return new_event(ho.MOVE_REQUESTED, {"to_partition": to, "reason": "test"}, entitlement=ent, entity_id=ent,
                     producer="api", event_id=event_id, timestamp_ms=T0)


BEGINS = {
    # name: (home, entitlement known here?, to partition) -> (new home's moving_to | None, refusal reason | None)
    "a first move": (None, True, P1, (P1, 1), None),
    "a second move": (Home(P0, 1), True, P1, (P1, 2), None),
    "to where it lives: refused": (None, True, P0, None, ho.REASON_ALREADY_THERE),
    "to a partition the topics do not have": (None, True, PARTS, None, ho.REASON_INVALID_PARTITION),
    "to a negative partition": (None, True, -1, None, ho.REASON_INVALID_PARTITION),
    "an entitlement not here": (None, False, P1, None, REASON_UNKNOWN_ENTITLEMENT),
    "one leaving already": (Home(P0, 1, moving_to=2), True, P1, None, REASON_UNKNOWN_ENTITLEMENT),
}


@pytest.mark.parametrize("home, known, to, want_home, want_reason", BEGINS.values(), ids=BEGINS.keys())
def test_begin(home, known, to, want_home, want_reason):
    state = running_job().state if known else sm.SchedulerState()
    new_home, out = ho.begin(state, home, move(to), P0, PARTS, T0)
    if want_reason is None:
        assert out == [] and (new_home.moving_to, new_home.epoch) == want_home
        assert new_home.handover_id == "move-1" and not new_home.sent
    else:
        assert [e.payload["reason"] for e in out] == [want_reason] and new_home == home
        REG.encode(out[0].type, out[0].to_record(schema_version=1))


def test_the_same_move_again_is_a_no_op():
    state = running_job().state
    home, _ = ho.begin(state, None, move(P1), P0, PARTS, T0)
    assert ho.begin(state, home, move(P1), P0, PARTS, T0) == (home, [])


# -- hand_over and adopt: the state travels whole -------------------------------------------------------------------

def busy_state():
    """Two jobs mid-flight: one running 3 tasks on m1..m3 with a rolling update under way, one with a task parked
    pending; a machine known down."""
    sim = running_job(3)
    out = sim.feed(spec_changed("j", 3, version=2))  # the first old task stopped for the update
    sim.feed_all(list(agent_reactions(out)))
    sim = running_job(2, machines=("m7", "m8"), job="k", sim=sim)
    sim.feed(machine_status("m8", "DOWN"))  # k/1 moves: a request outstanding
    return sim.state


def frozen(state, partition=P0, to=P1):
    home, _ = ho.begin(state, None, move(to), partition, PARTS, T0)
    return home


def adopted(state, events, order=None):
    new, home = sm.SchedulerState(), None
    for i in order or range(len(events)):
        new, home = ho.adopt(new, home, events[i], P1)
    return new, home


def test_a_handed_over_state_is_adopted_whole_and_decides_alike():
    state = busy_state()
    home = frozen(state)
    left, sent, events = ho.hand_over(state, home, ENT, drain_offset=42, now_ms=T0)
    assert ENT not in left.entitlements and not left.jobs and sent.sent and sent.drain_offset == 42
    for e in events:
        REG.encode(e.type, e.to_record(schema_version=1))
        assert (e.payload["to_partition"], e.payload["epoch"], e.payload["history"]) == (P1, 1, [P0])
    new, arrived = adopted(state, events)
    assert arrived.here and (arrived.partition, arrived.epoch, arrived.history) == (P1, 1, (P0,))
    assert new.entitlements == state.entitlements and dict(new.jobs) == dict(state.jobs)
    tied = set().union(*(machines_of(j) for j in state.jobs.values()))  # the machines the jobs know (not m8: left)
    assert dict(new.machines_down) == {m: s for m, s in state.machines_down.items() if m in tied}
    # what each would decide next is the same: the update carries on, the moved task is placed
    for nxt in (allocated(next_request(state, "k"), {"k/1": "m9"}),):
        assert kinds(decide(new, nxt, T0 + 5)[1]) == kinds(decide(state, nxt, T0 + 5)[1])


def next_request(state, job):
    """An AllocationRequested naming the request the job's pending task awaits."""
    t = next(t for t in state.jobs[job].tasks.values() if t.request_id is not None)
    return new_event("AllocationRequested", {"request_id": t.request_id, "job_id": job}, entitlement=ENT,
                     entity_id=t.request_id, producer="scheduler")


def big_state(tasks=6000):
    """A job so big that its hand-over takes several parts (chunks of 500 task records)."""
    sim = running_job(3)
    out = sim.feed(new_event("JobResized", {"job_id": "j", "tasks": tasks}, entitlement=ENT, entity_id="j",
                             producer="cli", event_id="grow", timestamp_ms=T0))
    for e in out:
        if e.type == "AllocationRequested" and e.payload["place_task_ids"]:
            placements = [{"task_id": t, "machine_id": f"n{i}", "dc": "dc1", "msb": "msb1", "rack": "r1"}
                          for i, t in enumerate(e.payload["place_task_ids"])]
            answer = new_event("TasksAllocated", {"request_id": e.payload["request_id"], "job_id": "j",
                                                  "placements": placements}, entitlement=ENT,
                               entity_id=e.payload["request_id"], producer="allocator", event_id="placed")
            sim.state, _ = decide(sim.state, answer, T0)
    return sim.state


def test_a_big_entitlement_goes_in_parts_adopted_in_any_order_and_twice():
    state = big_state()
    home = frozen(state)
    _, _, events = ho.hand_over(state, home, ENT, drain_offset=7, now_ms=T0)
    sizes = [batches.size_of(e.payload["items"]) for e in events]
    assert len(events) >= 2 and max(sizes) <= batches.MAX_RECORD_BYTES, sizes
    order = list(range(len(events)))
    random.Random(3).shuffle(order)
    # a part missing: not adopted, the entitlement not decided
    partial, home_partial = adopted(state, events, order[:-1])
    assert home_partial.arriving and ho.route(home_partial, None, P1, None).action == HOLD
    # every part, shuffled, each twice (a crash after sending repeats them: the same ids)
    new, home = adopted(state, events, order + order)
    assert home.here and dict(new.jobs) == dict(state.jobs)
    assert len(new.jobs["j"].tasks) == 6000


def test_a_repeated_hand_over_is_the_same_events():
    state = busy_state()
    home = frozen(state)
    assert ho.hand_over(state, home, ENT, drain_offset=3, now_ms=T0) == \
        ho.hand_over(state, home, ENT, drain_offset=3, now_ms=T0)


def test_an_older_or_adopted_hand_over_changes_nothing():
    state = busy_state()
    _, _, events = ho.hand_over(state, frozen(state), ENT, drain_offset=3, now_ms=T0)
    new, home = adopted(state, events)
    for e in events:  # again, after the adoption
        assert ho.adopt(new, home, e, P1) == (new, home)
    newer = Home(P1, 2)
    assert ho.adopt(new, newer, events[0], P1) == (new, newer)
    assert ho.adopt(new, None, events[0], 2) == (new, None)  # a part for another partition


def test_moving_back_and_again():
    """P0 → P1 → P0: each move's epoch is one more; the first home on P0 (leaving) does not stop the second
    adoption there."""
    state = busy_state()
    h1 = frozen(state)
    _, sent1, ev1 = ho.hand_over(state, h1, ENT, drain_offset=1, now_ms=T0)
    on_p1, home_p1 = adopted(state, ev1)
    h2, _ = ho.begin(on_p1, home_p1, move(P0, event_id="move-2"), P1, PARTS, T0)
    assert (h2.epoch, h2.moving_to, h2.history) == (2, P0, (P0,))
    _, _, ev2 = ho.hand_over(on_p1, h2, ENT, drain_offset=5, now_ms=T0)
    back, home_back = sm.SchedulerState(), sent1
    for e in ev2:
        back, home_back = ho.adopt(back, home_back, e, P0)
    assert home_back.here and (home_back.partition, home_back.epoch, home_back.history) == (P0, 2, (P0, P1))
    assert dict(back.jobs) == dict(state.jobs)


def test_storage_keys_differ_per_partition_off_the_hash_partition():
    home = partition_for(ENT, PARTS)
    other = (home + 1) % PARTS
    assert ho.storage_key("e1.j", ENT, home, home) == "e1.j"
    assert ho.storage_key("e1.j", ENT, other, home) == f"e1.j~{other}"
    header = st.plan(None, None, {}, busy_state().jobs["j"], key=f"e1.j~{other}").header
    assert st.header_key(header) == f"e1.j~{other}"
    assert all(k.startswith(f"e1.j~{other}#") for k in st.named_keys(header))


# -- the map -----------------------------------------------------------------------------------------------------------

A, B = "shard-a", "shard-b"
BLOCKS = {0: A, 1: A, 2: B, 3: B}  # the scheduler group's assignment: partition -> shard (member)
LEAST = {
    # name: (entries, weight, owners) -> partition
    "empty: the first": ([], 0, None, 0),
    "the lightest by quota": ([MapEntry("a", 0, weight=10), MapEntry("b", 1, weight=3), MapEntry("c", 2, weight=5),
                               MapEntry("d", 3, weight=3)], 4, None, 1),
    "ties: the fewest entitlements": ([MapEntry("a", 0, weight=0), MapEntry("b", 0, weight=0),
                                       MapEntry("c", 1, weight=0)], 0, None, 2),
    "a move counts where it goes": ([MapEntry("a", 0, weight=9, moving_to=1), MapEntry("b", 2, weight=1),
                                     MapEntry("c", 3, weight=1)], 1, None, 0),
    # with the shards' assignment: the least-loaded shard, then its least-loaded partition
    "shards: an empty partition of a loaded shard loses to the other shard": (
        [MapEntry("a", 0, weight=5)], 5, BLOCKS, 2),
    "shards interleaved: the other shard's lowest": ([MapEntry("a", 0, weight=5)], 5, {0: A, 1: B, 2: A, 3: B}, 1),
    "shards: the lightest shard, though a lighter partition is another shard's": (
        [MapEntry("a", 0, weight=10), MapEntry("c", 2, weight=3), MapEntry("d", 3, weight=3)], 1, BLOCKS, 2),
    "shards: on the lightest shard, its lightest partition": (
        [MapEntry("a", 0, weight=1), MapEntry("b", 1, weight=2), MapEntry("c", 2, weight=4)], 1, BLOCKS, 0),
    "shards tie on quota: the fewest entitlements": ([MapEntry("a", 0), MapEntry("b", 0), MapEntry("c", 2)], 0,
                                                     BLOCKS, 3),
    "shards tie on both: the one with the lowest partition": ([], 0, {0: B, 1: A, 2: A, 3: B}, 0),
    "shards of unequal sizes: by their sum, not their mean": ([MapEntry("a", 3, weight=1)], 1,
                                                              {0: A, 1: A, 2: A, 3: B}, 0),
    "shards: a move counts where it goes": ([MapEntry("a", 2, weight=9, moving_to=0)], 1, BLOCKS, 2),
    "a partition without an owner: by partition, as without owners": (
        [MapEntry("a", 0, weight=5)], 5, {0: A, 1: A, 2: B}, 1),
    "no owners (no shard, a rebalance under way): by partition": ([MapEntry("a", 0, weight=5)], 5, {}, 1),
}


@pytest.mark.parametrize("entries, weight, owners, want", LEAST.values(), ids=LEAST.keys())
def test_least_loaded(entries, weight, owners, want):
    assert least_loaded(entries, PARTS, weight, owners) == want


@pytest.mark.parametrize("owners", [
    {p: f"s{p // 2}" for p in range(8)},  # 4 shards of 2 partitions, in blocks
    {p: f"s{p % 4}" for p in range(8)},  # ... interleaved
    {p: f"s{min(p // 3, 2)}" for p in range(8)},  # 3 shards: 3, 3 and 2 partitions
])
def test_new_entitlements_of_one_quota_spread_over_the_shards(owners):
    """The scaled-out bench's case (BENCHMARKS.md): entitlements of one quota created one after the other land one
    per shard before any shard gets a second, each on a partition of its own while its shard has an empty one."""
    entries: list[MapEntry] = []
    shards = sorted(set(owners.values()))
    for i in range(2 * len(shards)):
        p = least_loaded(entries, 8, 10, owners)
        entries.append(MapEntry(f"e{i}", p, weight=10))
        held = [sum(owners[e.partition] == s for e in entries) for s in shards]
        assert max(held) - min(held) <= 1, (i, held)
    assert len({e.partition for e in entries}) == len(entries)


def test_the_map_routes_by_its_entry_else_by_hash():
    m = PartitionMap(PARTS)
    assert m.partition_of("zz") == partition_for("zz", PARTS)
    event = new_event("EntitlementPartitionAssigned", MapEntry("zz", 3, 1, history=(0,)).payload(), entitlement="zz",
                      entity_id="zz", producer="scheduler")
    REG.encode(event.type, event.to_record(schema_version=1))
    m.apply(event)
    assert m.partition_of("zz") == 3 and set(m.partitions_ever("zz")) == {0, 3, partition_for("zz", PARTS)}
    m.apply(None, "zz")
    assert m.entry("zz") is None


def test_the_entry_a_home_publishes():
    assert ho.map_entry(ENT, Home(P0, 1, moving_to=P1, history=(2,), drain_offset=9), 5, "moving") == \
        MapEntry(ENT, P0, 1, P1, (2,), 9, 5, "moving")
    assert ho.map_entry(ENT, Home(P1, 1, history=(P0,), drain_offset=9), 5, "moved") == \
        MapEntry(ENT, P1, 1, None, (P0,), 9, 5, "moved")


def test_home_records_round_trip():
    h = Home(P1, 2, parts=(0, 2), parts_total=3, handover_id="x", history=(0, 1), drain_offset=4)
    assert ho.home_of(ho.home_record(h)) == h and ho.home_of(None) is None
    assert dataclasses.asdict(h)  # plain data


def test_the_adoption_of_a_move_is_one_event_however_often_it_is_published():
    """The shard publishes an adoption after its batch and again from its timer while its map follower lags: one id
    per move (the entitlement's epoch), so a reader counts it once; another move, or a quota republished, is another."""
    def ev(reason, epoch=1, weight=4):
        return assignment_event(MapEntry("e1", 2, epoch, None, (0,), 17, weight, reason), producer="scheduler")
    assert ev(REASON_MOVED).event_id == ev(REASON_MOVED, weight=5).event_id
    assert ev(REASON_MOVED).event_id != ev(REASON_MOVED, epoch=2).event_id
    assert ev(REASON_MOVED).event_id != assignment_event(MapEntry("e2", 2, 1, None, (0,), 17, 4, REASON_MOVED),
                                                         producer="scheduler").event_id
    assert ev(REASON_HELD).event_id != ev(REASON_HELD).event_id  # a republished weight is news each time
