"""`ropewalk rebuild` on the real broker and Redis.

A real allocator (the harness of test_allocator_processor) is driven through registrations, entitlements,
allocations (one partial, with a quota rejection), machine status changes, planned maintenances (one ended),
deallocations, releases and a re-take of released machines, waiting after each step until it has applied everything
in the log; its index is dumped. The rebuild, from the log alone with the allocator stopped, must give the same keys
and values, applied marks included, for every key that is index state (processors/allocator/rebuild.py:
NOT_INDEX_STATE).
"""
from __future__ import annotations

import difflib
import json
import os
import pprint
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
import redis
from confluent_kafka.admin import AdminClient

from processors.allocator import snapshot
from processors.allocator.fold import EVENT_TYPES, RegionFold, merged
from processors.allocator.processor import SOURCES
from processors.allocator import index as index_module
from processors.allocator.index import MachineIndex, _Bulk
from processors.allocator.rebuild import (
    SCRATCH, Rebuild, RebuildConflict, RebuildRefused, index_state, is_index_state, rebuild_index,
)
from streams.events import Event, new_event
from streams.replay import Replay, ReplayFilter
from streams.topics import Topics, provision
from test_allocator_processor import MACHINES, answered, requested, run_allocator, send, setup_region, wait_for

ROOT = Path(__file__).resolve().parents[2]


# --- the region ------------------------------------------------------------------------------------------

def status_changed(mid: str, status: str, previous: str, key: str) -> Event:
    return new_event("MachineStatusChanged", {"machine_id": mid, "status": status, "previous_status": previous,
                                              "reason": "test"}, entitlement=key, entity_id=mid, producer="test")


def maintenance(type_: str, ue: str, machines: list[str]) -> Event:
    payload = {"unavailability_id": ue, "machine_ids": machines}
    if type_ == "UnavailabilityStarted":
        payload.update(kind="MAINTENANCE", start_ms=int(time.time() * 1000) + 3_600_000, deadline_ms=None,
                       expected_duration_ms=600_000, reason="test")
    return new_event(type_, payload, entitlement="free/dc1", entity_id=ue, producer="test")


def settle(ctx, quiet_s: float = 1.0, timeout_s: float = 30.0) -> None:
    """Wait until the allocator's applied marks cover every machines/allocations record in the log, and no new
    record has arrived for ``quiet_s`` (a decision's echoes are produced after its request is marked)."""
    deadline = time.monotonic() + timeout_s
    last_change = time.monotonic()
    mark_key = ctx.index.key("applied:allocator")
    while True:
        new = ctx.log.consumer.poll(500, 0.2)
        ctx.log.records += new
        marks = {k.decode(): int(v) for k, v in ctx.r.hgetall(mark_key).items()}
        pending = [r for r in ctx.log.records if r.event.type in EVENT_TYPES
                   and marks.get(f"{r.topic}/{r.partition}", -1) < r.offset]
        now = time.monotonic()
        if new or pending:
            last_change = now
        elif now - last_change >= quiet_s:
            return
        if now > deadline:
            left = [(r.event.type, r.topic, r.partition, r.offset) for r in pending]
            raise AssertionError(f"the allocator did not apply {left}")


def drive(ctx) -> dict:
    """The scenario (see the module doc); returns the live index's dump."""
    setup_region(ctx, {"e1": 10, "e2": 1})
    settle(ctx)

    send(ctx, requested("r1", "e1", "web", 6))  # 6 x 1000m spread over the MSBs: 3 machines join e1
    ctx.log.wait(answered("r1", "TasksAllocated"), "r1 placed")
    settle(ctx)
    first = ctx.index.placements()
    e1_machines = set(first.values())

    send(ctx, requested("r2", "e2", "batch", 6))  # quota 1 machine: 4 placed, 2 rejected
    ctx.log.wait(answered("r2", "TasksAllocated", "AllocationRejected"), "r2 placed and rejected")
    settle(ctx)

    down = first["web/0"]
    idle = sorted(m for m, mach in ctx.index.machines(MACHINES).items() if mach.entitlement is None)[0]
    machines = ctx.index.machines(MACHINES)
    planned = sorted(m for m, mach in machines.items() if mach.entitlement is None and m != idle)
    e2_machine = next(m for m, mach in machines.items() if mach.entitlement == "e2")
    send(ctx, maintenance("UnavailabilityStarted", "ue-kept", planned),  # placements avoid them from now on
         maintenance("UnavailabilityStarted", "ue-ended", [e2_machine]),
         maintenance("UnavailabilityEnded", "ue-ended", [e2_machine]))
    wait_for(lambda: ctx.index.machines(planned)[planned[0]].maintenance == ("ue-kept",), "the maintenances applied")
    send(ctx, status_changed(down, "DOWN", "UP", "e1"), status_changed(idle, "MAINTENANCE", "UP", "free/dc1"),
         new_event("EntitlementUpdated", {"quota_machines": 8, "machine_type": None, "dc_pin": None,
                                          "host_profile": None}, entitlement="e1", entity_id="e1", producer="test"),
         new_event("JobStopped", {"job_id": "other", "reason": "not an index event"}, entitlement="e1",
                   entity_id="other", producer="test"))
    wait_for(lambda: ctx.allocator.fold.entitlement("e1").quota_machines == 8, "the entitlement update applied")
    settle(ctx)

    send(ctx, requested("r3", "e1", "web", free=["web/0"]))  # its machine keeps web/? : nothing released
    ctx.log.wait(answered("r3", "TasksDeallocated"), "r3 freed")
    settle(ctx)
    send(ctx, requested("r4", "e1", "web", free=[t for t in first if t != "web/0"]))  # every e1 machine released
    ctx.log.wait(answered("r4", "TasksDeallocated"), "r4 freed")
    settle(ctx)
    assert ctx.allocator.fold.held_count("e1") == 0

    send(ctx, requested("r5", "e1", "api", 4))  # e1 takes machines again, some it released just before
    ctx.log.wait(answered("r5", "TasksAllocated"), "r5 placed")
    settle(ctx)

    assert not ctx.log.events("DeadLetterRecorded")
    retaken = set(ctx.index.placements().values()) & e1_machines
    assert retaken, "the scenario should re-take a released machine"
    return ctx.index.dump()


@pytest.fixture(scope="module")
def region(infra_cfg, registry):
    """A topic prefix of its own, driven once by a live allocator; (cfg, the live index's dump). The harness
    stops the allocator and clears its Redis keys afterwards: the log is all that is left."""
    cfg = infra_cfg.with_(topic_prefix=f"t{uuid.uuid4().hex[:8]}.")
    provision(AdminClient({**cfg.kafka_conf()}), Topics(cfg.topic_prefix, cfg.partitions))
    live = run_allocator(cfg, registry, drive, timeout_s=200)
    return cfg, live


@pytest.fixture
def index(region):
    cfg, _ = region
    r = cfg.redis_client()
    yield MachineIndex(r, cfg.topic_prefix)
    r.close()


def assert_same_index(got: dict, want: dict) -> None:
    got, want = index_state(got), index_state(want)
    if got != want:
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        lines = [f"missing keys: {missing}", f"extra keys: {extra}"]
        for k in sorted(want.keys() & got.keys()):
            if got[k] != want[k]:
                lines.append(f"--- {k}")
                lines += difflib.unified_diff(pprint.pformat(want[k]).splitlines(), pprint.pformat(got[k]).splitlines(),
                                              "live", "rebuilt", lineterm="", n=0)
        raise AssertionError("the rebuilt index differs from the live one:\n" + "\n".join(lines))


def scratch_keys(r) -> list[bytes]:
    return list(r.scan_iter(match=SCRATCH + "*", count=1000))


# --- the tests ----------------------------------------------------------------------------------------

@pytest.mark.timeout(280)
def test_the_rebuild_from_the_log_equals_the_live_index_key_for_key(region, index, registry):
    cfg, live = region
    # The scenario reached what the comparison is about.
    assert {live[f"m:{m}"]["status"] for m in MACHINES} == {"UP", "DOWN", "MAINTENANCE"}
    assert live["entitlement:e1"]["quota_machines"] == "8" and live["entitlement:e2"]["quota_machines"] == "1"
    assert len(live["placement"]) == 8 and not any(k.startswith("req:") for k in live)
    topics = {field.rsplit("/", 1)[0][len(cfg.topic_prefix):] for field in live["applied:allocator"]}
    assert topics == {"intents", "machines", "unavailability", "allocations"}
    assert sorted(live[f"m:{m}"]["maintenance"] for m in MACHINES) == [""] * (len(MACHINES) - 1) + ["ue-kept"]
    assert max(int(live[f"m:{m}"]["version"]) for m in MACHINES) >= 7  # taken, released, re-taken
    index.clear()  # from nothing but the log (the harness cleared the allocator's keys; other tests rebuild)

    stats = rebuild_index(cfg, registry)
    assert_same_index(index.dump(), live)
    # The only live keys left out of the comparison: the five decisions journaled by the commit (three placed,
    # two freed), the partitions' fences, the counters, the index's generation and its format.
    left_out = set(live) - set(index_state(live))
    assert len([k for k in left_out if k.startswith("alloc:done:")]) == 5
    assert all(k.startswith(("alloc:done:", "alloc:fence:", "metrics:", "index:generation", "index:format"))
               for k in left_out)
    assert stats["keys"] == len(list(index.r.scan_iter(index.key("*")))) and stats["replaced"] == 0
    # The outbox holds every machine, so the allocator republishes their states (see rebuild.py).
    assert set(index.outbox()) == set(MACHINES)
    assert stats["failed"] == 0 and stats["skipped"] == 0 and stats["errors"] == []
    assert stats["events"] > stats["index_events"] > 0  # JobStopped is read, not applied
    assert stats["seconds"] > 0 and stats["events_per_s"] == pytest.approx(stats["events"] / stats["seconds"],
                                                                          rel=0.01)
    assert scratch_keys(index.r) == []
    print(f"\nrebuild: {json.dumps(stats)}")


@pytest.mark.timeout(280)
def test_rebuilding_twice_gives_the_same_index(region, index, registry):
    cfg, live = region
    first = rebuild_index(cfg, registry)
    once = index.dump()
    second = rebuild_index(cfg, registry)
    assert index.dump() == once
    assert_same_index(once, live)
    assert second["keys"] == first["keys"] and second["replaced"] == len(index_state(live))
    assert second["events"] == first["events"] and second["index_events"] == first["index_events"]


@pytest.mark.timeout(280)
def test_a_rebuild_from_a_snapshot_of_the_fold_reads_only_the_log_after_it_and_equals_the_live_index(region, index,
                                                                                                   registry,
                                                                                                   monkeypatch):
    """A snapshot of the fold of the log's first half (each partition up to the first record at or after the middle
    moment): the rebuild starts from it, reads the rest, and gives the live index; from the log, the same. The bulk
    write in rounds of two machines here (``index.BULK_CHUNK``): the shared hashes written in several rounds."""
    monkeypatch.setattr(index_module, "BULK_CHUNK", 2)
    cfg, live = region
    records = list(Replay(cfg, registry, ReplayFilter(topics=SOURCES, types=EVENT_TYPES)))
    cut = sorted(r.event.timestamp_ms for r in records)[len(records) // 2]
    parts: dict = defaultdict(list)
    ended: set = set()
    for r in records:  # in offset order per partition
        tp = (r.topic, r.partition)
        if tp in ended or r.event.timestamp_ms >= cut:
            ended.add(tp)
            continue
        parts[tp].append((r.event, (r.topic, r.partition, r.offset)))
    fold = RegionFold()
    for event, position in merged(parts):
        fold.apply(event, position)
    first_half = sum(map(len, parts.values()))
    path = snapshot.write(cfg, fold, [], records=first_half)
    try:
        stats = rebuild_index(cfg, registry)
        assert stats["snapshot"] == path.name and stats["snapshot_records"] == first_half, stats
        assert stats["index_events"] == len(records) - first_half, stats
        assert_same_index(index.dump(), live)
        from_log = rebuild_index(cfg, registry, from_snapshot=False)
        assert from_log["snapshot"] is None and from_log["index_events"] == len(records)
        assert_same_index(index.dump(), live)
    finally:
        for p in snapshot.listing(cfg):
            p.unlink()


@pytest.mark.timeout(280)
def test_a_rebuild_repairs_a_damaged_index_and_leaves_the_journal_and_fences_alone(region, index, registry):
    cfg, live = region
    rebuild_index(cfg, registry)
    r, k = index.r, index.key
    r.delete(k("outbox:machines"))  # as if the allocator had published every machine
    some = sorted(m for m in MACHINES if live[f"m:{m}"]["entitlement"])
    r.delete(k(f"m:{some[0]}"))  # a machine lost
    r.hset(k(f"m:{some[1]}"), "cpu_free", 1)  # a value changed
    r.hdel(k("placement"), next(iter(live["placement"])))  # a placement lost
    r.srem(k(f"tasks:{some[-1]}"), *r.smembers(k(f"tasks:{some[-1]}")))  # a machine's task set lost
    r.hset(k("applied:allocator"), next(iter(live["applied:allocator"])), 10**9)  # a mark moved
    r.hset(k("m:ghost"), "status", "UP")  # a key the log never made
    not_index = {"alloc:done:ev1": "[]", "alloc:fence:3": "7", "metrics:rebuilds": "3"}
    for name, value in not_index.items():
        if isinstance(value, dict):
            r.hset(k(name), mapping=value)
        else:
            r.set(k(name), value)
    assert all(not is_index_state(name) for name in not_index)
    with pytest.raises(AssertionError):
        assert_same_index(index.dump(), live)

    stats = rebuild_index(cfg, registry)
    after = index.dump()
    assert_same_index(after, live)
    assert {name: after[name] for name in not_index} == not_index
    # what the swap deleted: the live index state less the two keys lost (m:<some[0]>, tasks:<some[-1]>), plus
    # m:ghost
    assert stats["replaced"] == len(index_state(live)) - 2 + 1
    assert set(index.outbox()) == set(MACHINES)  # every machine to be published again


@pytest.mark.timeout(280)
def test_a_rebuild_that_meets_a_writing_allocator_replaces_nothing(region, index, registry):
    cfg, live = region
    rebuild_index(cfg, registry)
    index.r.delete(index.key("placement"))  # damage, to see that the refused swap does not repair it
    before = index.dump()

    rb = Rebuild(cfg, registry, index.r)
    rb.guard()
    index.r.hset(index.key("applied:allocator"), "elsewhere/0", 1)  # the allocator applied an event meanwhile
    rb.apply(rb.read())
    rb.write()
    assert scratch_keys(index.r)
    with pytest.raises(RebuildConflict, match="Stop the allocator"):
        rb.swap()
    assert rb.discard() > 0 and scratch_keys(index.r) == []
    assert index.dump() == {**before, "applied:allocator": {**before["applied:allocator"], "elsewhere/0": "1"}}

    index.r.hdel(index.key("applied:allocator"), "elsewhere/0")
    rebuild_index(cfg, registry)  # and once the allocator is quiet, the rebuild goes through
    assert_same_index(index.dump(), live)


def test_a_log_without_allocator_events_does_not_empty_the_index(cfg, registry):
    """A wrong broker or topic prefix (a log without the allocator's events) is refused."""
    r = cfg.redis_client()
    index = MachineIndex(r, cfg.topic_prefix)
    try:
        r.hset(index.key("m:m1"), "status", "UP")
        with pytest.raises(RebuildRefused, match="no allocator event"):
            rebuild_index(cfg, registry)
        assert index.dump() == {"m:m1": {"status": "UP"}} and scratch_keys(r) == []
        index.clear()
        assert rebuild_index(cfg, registry)["keys"] == 0  # nothing to rebuild, nothing to lose: fine
    finally:
        index.clear()
        r.close()


def cli(cfg, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
           "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions),
           "ROPEWALK_RUN_DIR": str(run_dir)}
    return subprocess.run([sys.executable, "-m", "processors.frontend.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(280)
def test_the_cli_rebuilds_and_refuses_while_the_allocator_runs(region, index, tmp_path):
    cfg, live = region
    index.r.delete(index.key("placement"))
    (tmp_path / "allocator-0.pid").write_text(str(os.getpid()))  # a live process: "the allocator runs"
    refused = cli(cfg, tmp_path, "rebuild")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith("ropewalk: an allocator is running (allocator-0 pid") and "--force" in refused.stderr
    assert "placement" not in index.dump()

    (tmp_path / "allocator-0.pid").unlink()
    out = cli(cfg, tmp_path, "rebuild", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {"events", "keys", "seconds", "events_per_s"} <= doc.keys() and doc["keys"] > len(index_state(live))
    assert_same_index(index.dump(), live)

    text = cli(cfg, tmp_path, "rebuild")
    assert text.returncode == 0 and "events/s" in text.stdout and "allocator" in text.stdout


# --- the merge order (pure) -----------------------------------------------------------------------------

def _ev(type_: str, ts: int, tag: str) -> Event:
    return Event(type=type_, entitlement="e", entity_id=tag, payload={}, timestamp_ms=ts)


@pytest.mark.parametrize("partitions, expected", [
    # a decision's echo (machines) follows its TasksAllocated (allocations) in the same millisecond
    ({("machines", 0): [_ev("MachineAssignedToEntitlement", 5, "assign")],
      ("allocations", 0): [_ev("TasksAllocated", 5, "placed")]}, ["placed", "assign"]),
    # a registration precedes an allocation of the same millisecond
    ({("allocations", 1): [_ev("TasksAllocated", 5, "placed")],
      ("machines", 2): [_ev("MachineRegistered", 5, "reg")]}, ["reg", "placed"]),
    # time first: an echo of an earlier decision precedes a later release
    ({("allocations", 0): [_ev("TasksDeallocated", 9, "freed")],
      ("machines", 0): [_ev("MachineAssignedToEntitlement", 4, "assign")]}, ["assign", "freed"]),
    # within a partition the offset order stands even when the clock went back
    ({("allocations", 0): [_ev("AllocationRequested", 7, "req"), _ev("TasksAllocated", 3, "placed")],
      ("machines", 0): [_ev("MachineStatusChanged", 5, "status")]}, ["status", "req", "placed"]),
    # equal keys: (topic, partition) order
    ({("machines", 1): [_ev("MachineStatusChanged", 1, "b")], ("machines", 0): [_ev("MachineStatusChanged", 1, "a")]},
     ["a", "b"]),
])
def test_the_merge_order(partitions, expected):
    recs = {tp: [(e, (*tp, i)) for i, e in enumerate(evs)] for tp, evs in partitions.items()}
    assert [e.entity_id for e, _ in merged(recs)] == expected


def test_a_bulk_write_redis_refuses_in_part_raises_and_the_rest_of_its_round_is_written(index):
    """``MachineIndex.write_whole``'s rounds (``index._Bulk``): every reply is read, an error reply raised after the
    round (a rebuild's write then fails and its scratch keys are discarded), the connection usable after it."""
    r, tag = index.r, uuid.uuid4().hex[:8]
    wrong, ok = f"bulk-{tag}-string", f"bulk-{tag}-ok"
    r.set(wrong, "x")
    try:
        bulk = _Bulk(r, keys := [])
        bulk.add(("SADD", wrong, "a"))  # WRONGTYPE
        bulk.add(("SET", ok, "1"))
        bulk.add(("SET", ok, "1"))  # a key written twice is named once
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            bulk.flush()
        assert r.get(ok) == b"1" and keys == [wrong, ok] and r.ping()
    finally:
        r.delete(wrong, ok)
