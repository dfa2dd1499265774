"""The allocator processor on the real broker and Redis: the faust app runs in-process (as in
test_faust_codec), events go in with EventProducer, results are read back from the log and from Redis. The
crash windows, the fence and the answer from the journal are driven by hand on an ``Allocator`` (no faust)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import redis

from bench.killstorm import redis_differences, replay_checks
from processors.allocator.index import Committed, MachineIndex
from processors.allocator.placement import FILTER_MACHINE_TYPE, NO_FEASIBLE_MACHINE, QUOTA_EXCEEDED
from processors.allocator.decide import (
    COMMIT_RETRIES_EXHAUSTED, INVALID_REQUEST, PRODUCER, RELEASED_EMPTY, UNKNOWN_ENTITLEMENT, in_decision_order,
)
from processors.allocator import snapshot
from processors.allocator.fold import EVENT_TYPES, RegionFold
from processors.allocator.follow import Follower
from processors.allocator.processor import Allocator, allocator_metrics, build_app
from streams.clients import EventConsumer, EventProducer, Record
from streams.deadletter import PROCESSING_FAILED
from streams.events import Event, new_event
from streams.serde import NO_MARKER
from streams.topics import Topics
from processors.allocator.rebuild import index_state

FAST = {"broker_session_timeout": 2.0, "broker_heartbeat_interval": 0.5, "broker_rebalance_timeout": 2.0,
        "broker_commit_interval": 0.5}
CPU, MEM = 4000, 8192
# Two machines in each of three MSBs of dc1.
MACHINES = {f"m{msb}{i}": f"msb{msb}" for msb in (1, 2, 3) for i in "ab"}


# --- event builders ---------------------------------------------------------------------------------------

def registered(mid: str, msb: str, dc: str = "dc1", type_: str = "skylake") -> Event:
    return new_event("MachineRegistered", {
        "machine_id": mid, "topology": {"region": "reg1", "dc": dc, "msb": msb, "rack": f"{msb}-r1"},
        "machine_type": type_, "capacity": {"cpu_millicores": CPU, "memory_mib": MEM}, "host_profile": None},
        entitlement=f"free/{dc}", entity_id=mid, producer="test")


def entitlement_created(name: str, quota: int) -> Event:
    return new_event("EntitlementCreated", {"name": name, "quota_machines": quota, "machine_type": None,
                                            "dc_pin": None, "host_profile": None},
                     entitlement=name, entity_id=name, producer="test")


def requested(rid: str, ent: str, job: str, n: int = 0, *, free=(), cpu=1000, mem=1024, requirements=None) -> Event:
    return new_event("AllocationRequested", {
        "request_id": rid, "job_id": job, "spec_version": 1, "place_task_ids": [f"{job}/{i}" for i in range(n)],
        "free_task_ids": list(free), "resources": {"cpu_millicores": cpu, "memory_mib": mem},
        "requirements": requirements or {}, "spread": "msb", "avoid_machine_ids": []},
        entitlement=ent, entity_id=rid, producer="test")


# --- harness ----------------------------------------------------------------------------------------------

class _SkipBad:
    """The test reader's dead-letter router: skips bad records (the allocator routes them, not the reader)."""

    def route(self, **_):
        pass


class Log:
    """Reads allocations, machines and deadletter from the beginning, accumulating every record."""

    def __init__(self, cfg, registry):
        catalogue = Topics(cfg.topic_prefix, cfg.partitions)
        self.consumer = EventConsumer(cfg, registry, [catalogue.name(t) for t in ("allocations", "machines",
                                                                                  "deadletter")],
                                      name="test", dead_letters=_SkipBad())
        self.records = []

    def events(self, type_: str, **payload) -> list[Event]:
        return [r.event for r in self.records if r.event.type == type_
                and all(r.event.payload.get(k) == v for k, v in payload.items())]

    def wait(self, predicate, what: str, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while True:
            self.records += self.consumer.poll(500, 0.2)
            if value := predicate(self):
                return value
            if time.monotonic() > deadline:
                seen = Counter(r.event.type for r in self.records)
                raise AssertionError(f"timed out waiting for {what}; seen {dict(seen)}")


def wait_for(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


def run_allocator(cfg, registry, body, timeout_s: float = 100.0, *, clear: bool = True,
                  region: dict[str, int] | None = None):
    """Run the allocator's faust app while ``body(ctx)`` (blocking, in a thread) drives and checks it; with
    ``region``, the machines and these entitlements are set up first (``setup_region``)."""
    r = cfg.redis_client()
    ctx = type("Ctx", (), {})()
    ctx.cfg, ctx.r = cfg, r
    ctx.index = MachineIndex(r, cfg.topic_prefix)
    ctx.producer = EventProducer(cfg, registry, "test")
    ctx.log = Log(cfg, registry)

    async def scenario():
        app, _, allocator = build_app(cfg, registry=registry, redis_client=r, **FAST)
        ctx.allocator = allocator
        await app.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, _with_region, body, ctx, region)
        finally:
            crash = app.crash_reason
            await app.stop()
            assert crash is None, crash

    try:
        return asyncio.run(asyncio.wait_for(scenario(), timeout_s))
    finally:
        ctx.log.consumer.close()
        if clear:
            ctx.index.clear()
        r.close()


def _with_region(body, ctx, region: dict[str, int] | None):
    if region is not None:
        setup_region(ctx, region)
    return body(ctx)


def setup_region(ctx, entitlements: dict[str, int]) -> None:
    """Register MACHINES and create entitlements; wait until the allocator has applied them."""
    for mid, msb in MACHINES.items():
        ctx.producer.send(registered(mid, msb))
    for name, quota in entitlements.items():
        ctx.producer.send(entitlement_created(name, quota))
    ctx.producer.flush()
    wait_for(lambda: len(ctx.index.machines(MACHINES)) == len(MACHINES), "the machines in the index")
    wait_for(lambda: all(ctx.allocator.fold.entitlement(e) for e in entitlements), "the entitlements in the fold")
    wait_for(lambda: all(ctx.r.exists(ctx.index.key(f"entitlement:{e}")) for e in entitlements),
             "the entitlements in Redis")


def send(ctx, *events: Event) -> None:
    for e in events:
        ctx.producer.send(e)
    ctx.producer.flush()


def answered(rid: str, *types: str):
    return lambda log: all(log.events(t, request_id=rid) for t in types) and log


def derived_from(request: Event, event: Event) -> None:
    assert event.causation_id == request.event_id
    assert event.entitlement == request.entitlement and event.producer == PRODUCER


# --- (1) placement with spread ----------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_allocates_a_job_spread_over_msbs(cfg, registry):
    def body(ctx):
        req = requested("r1", "e1", "web", 6)
        send(ctx, req)
        log = ctx.log.wait(answered("r1", "TasksAllocated"), "TasksAllocated")
        [done] = log.events("TasksAllocated", request_id="r1")
        derived_from(req, done)
        p = done.payload
        assert len(p["placements"]) == 6 and p["commit_attempts"] == 1 and p["cache_hit"] is False
        assert Counter(pl["msb"] for pl in p["placements"]) == {"msb1": 2, "msb2": 2, "msb3": 2}
        assert p["fault_domain_bins"] == {"dc1/msb1": 2, "dc1/msb2": 2, "dc1/msb3": 2}
        for pl in p["placements"]:
            assert (pl["dc"], pl["msb"], pl["rack"]) == ("dc1", MACHINES[pl["machine_id"]],
                                                         MACHINES[pl["machine_id"]] + "-r1")
        used = {pl["machine_id"] for pl in p["placements"]}
        assert sorted(p["machines_added"]) == sorted(used) and len(used) == 3
        log = ctx.log.wait(lambda lg: len(lg.events("MachineAssignedToEntitlement")) == 3 and lg,
                           "MachineAssignedToEntitlement")
        for e in log.events("MachineAssignedToEntitlement"):
            derived_from(req, e)
            assert e.payload["machine_id"] in used and e.payload["dc"] == "dc1"
        assert not log.events("AllocationRejected")
        # Redis: capacity used, the machines held by e1, every task placed.
        machines = ctx.index.machines(MACHINES)
        for mid in used:
            assert machines[mid].cpu_free == CPU - 2000 and machines[mid].mem_free == MEM - 2048
            assert machines[mid].entitlement == "e1"
        assert all(machines[m].cpu_free == CPU and machines[m].entitlement is None for m in set(MACHINES) - used)
        assert ctx.index.placements() == {pl["task_id"]: pl["machine_id"] for pl in p["placements"]}
        assert ctx.allocator.fold.held_count("e1") == 3
        # The fold and Redis agree key for key once the decision's echoes are read back.
        wait_for(lambda: index_state(ctx.index.dump()) == index_state(ctx.allocator.fold.dump()),
                 "Redis equal to the fold")
        assert allocator_metrics(ctx.r, cfg.topic_prefix) == {"requests": 1, "placed": 1, "rejected": 0,
                                                             "cache_hit_ratio": None}

    run_allocator(cfg, registry, body, region={"e1": 10})


# --- (2) nothing fits --------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_rejects_a_request_no_machine_can_meet(cfg, registry):
    def body(ctx):
        req = requested("r1", "e1", "gpu", 2, requirements={"machine_type": "gpu-a100"})
        send(ctx, req)
        log = ctx.log.wait(answered("r1", "AllocationRejected"), "AllocationRejected")
        [rej] = log.events("AllocationRejected", request_id="r1")
        derived_from(req, rej)
        assert rej.payload["reason"] == NO_FEASIBLE_MACHINE
        assert rej.payload["unplaced_task_ids"] == ["gpu/0", "gpu/1"]
        assert rej.payload["filter_rejections"] == {FILTER_MACHINE_TYPE: len(MACHINES)}
        assert "machine_type=gpu-a100" in rej.payload["message"] and FILTER_MACHINE_TYPE in rej.payload["message"]
        assert not log.events("TasksAllocated") and ctx.index.placements() == {}

    run_allocator(cfg, registry, body, region={"e1": 10})


# --- (3) quota ----------------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_quota_gives_a_partial_placement_and_a_rejection(cfg, registry):
    def body(ctx):
        req = requested("r1", "small", "batch", 6)  # 6 x 1000m: one machine (4000m) holds 4
        send(ctx, req)
        log = ctx.log.wait(answered("r1", "TasksAllocated", "AllocationRejected"), "both results")
        [done] = log.events("TasksAllocated", request_id="r1")
        [rej] = log.events("AllocationRejected", request_id="r1")
        assert len(done.payload["placements"]) == 4 and len({p["machine_id"] for p in done.payload["placements"]}) == 1
        assert len(done.payload["machines_added"]) == 1
        assert rej.payload["reason"] == QUOTA_EXCEEDED and rej.payload["unplaced_task_ids"] == ["batch/4", "batch/5"]
        assert "quota" in rej.payload["message"] and "small" in rej.payload["message"]
        assert done.event_id != rej.event_id
        assert ctx.allocator.fold.held_count("small") == 1 and len(ctx.index.placements()) == 4

    run_allocator(cfg, registry, body, region={"small": 1})


# --- (4) redelivery: a request whose decision is on the log is answered by it --------------------------------

@pytest.mark.timeout(150)
def test_a_request_delivered_twice_is_decided_once(cfg, registry):
    def body(ctx):
        req = requested("r1", "e1", "web", 6)
        send(ctx, req)
        ctx.log.wait(answered("r1", "TasksAllocated"), "TasksAllocated")
        send(ctx, req, requested("r2", "e1", "api", 1))  # the same event again (a producer's retry), then another
        log = ctx.log.wait(answered("r2", "TasksAllocated"), "the later request answered")
        # decided once: a request asked again after its answer is answered again with the same events (a requester
        # that crashed may have read the first answer too early), which readers drop by id
        answers = log.events("TasksAllocated", request_id="r1")
        assert len({e.event_id for e in answers}) == 1 and len({str(e.payload) for e in answers}) == 1
        assert len({e.event_id for e in log.events("MachineAssignedToEntitlement")}) == 3
        assert len(ctx.index.placements()) == 7

    run_allocator(cfg, registry, body, region={"e1": 10})


# --- (5) freeing ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_freeing_tasks_restores_capacity_and_releases_empty_machines(cfg, registry):
    def body(ctx):
        send(ctx, requested("r1", "e1", "web", 6))
        log = ctx.log.wait(answered("r1", "TasksAllocated"), "TasksAllocated")
        placed = {p["task_id"]: p["machine_id"] for p in log.events("TasksAllocated")[0].payload["placements"]}
        used = set(placed.values())

        # Free one task: its machine keeps the other task, so nothing goes back to the free pool.
        one = requested("r2", "e1", "web", free=["web/0"])
        send(ctx, one)
        log = ctx.log.wait(answered("r2", "TasksDeallocated"), "TasksDeallocated r2")
        [dealloc] = log.events("TasksDeallocated", request_id="r2")
        derived_from(one, dealloc)
        assert [(p["task_id"], p["machine_id"]) for p in dealloc.payload["placements"]] == [("web/0", placed["web/0"])]
        assert dealloc.payload["machines_released"] == []
        m = ctx.index.machine(placed["web/0"])
        assert m.cpu_free == CPU - 1000 and m.entitlement == "e1"

        # Free the rest: every machine is empty and goes back.
        rest = requested("r3", "e1", "web", free=[t for t in placed if t != "web/0"])
        send(ctx, rest)
        log = ctx.log.wait(answered("r3", "TasksDeallocated"), "TasksDeallocated r3")
        [dealloc] = log.events("TasksDeallocated", request_id="r3")
        assert len(dealloc.payload["placements"]) == 5
        assert sorted(dealloc.payload["machines_released"]) == sorted(used)
        log = ctx.log.wait(lambda lg: len(lg.events("MachineReleasedToFreePool")) == 3 and lg, "releases")
        for e in log.events("MachineReleasedToFreePool"):
            derived_from(rest, e)
            assert e.payload["reason"] == RELEASED_EMPTY and e.payload["machine_id"] in used
        assert ctx.index.placements() == {} and ctx.allocator.fold.held_count("e1") == 0
        for m in ctx.index.machines(MACHINES).values():
            assert (m.cpu_free, m.mem_free, m.entitlement) == (CPU, MEM, None)

    run_allocator(cfg, registry, body, region={"e1": 10})


# --- (6) bad records -----------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_bad_records_go_to_deadletter_and_the_allocator_goes_on(cfg, registry):
    def body(ctx):
        catalogue = Topics(cfg.topic_prefix, cfg.partitions)
        ctx.producer.send_raw(catalogue.name("allocations"), b"e1", b"not an event at all")
        # Decodes fine, but the fold cannot apply it (a machine nobody registered): processing_failed.
        send(ctx, new_event("MachineStatusChanged", {"machine_id": "ghost", "status": "DOWN",
                                                     "previous_status": "UP", "reason": "test"},
                            entitlement="e1", entity_id="ghost", producer="test"))
        send(ctx, requested("r1", "e1", "web", 2))
        log = ctx.log.wait(lambda lg: len(lg.events("DeadLetterRecorded")) == 2
                           and answered("r1", "TasksAllocated")(lg), "two dead letters and the later request answered")
        reasons = {e.payload["origin_topic"].rsplit(".", 1)[-1]: e.payload for e in log.events("DeadLetterRecorded")}
        assert reasons["allocations"]["reason"] == NO_MARKER
        assert reasons["allocations"]["payload"] == b"not an event at all"
        assert reasons["machines"]["reason"] == PROCESSING_FAILED
        assert "UNKNOWN_MACHINE" in reasons["machines"]["detail"] and "ghost" in reasons["machines"]["detail"]
        assert all(p["consumer"] == PRODUCER for p in reasons.values())
        assert len(ctx.index.placements()) == 2

    run_allocator(cfg, registry, body, region={"e1": 10})


@pytest.mark.timeout(150)
def test_a_transient_redis_error_folds_the_log_again_and_decides_once(cfg, registry):
    def body(ctx):
        real, failures = ctx.allocator.index.commit, []

        def flaky(decisions):
            if not failures:
                failures.append(len(decisions))
                raise redis.ConnectionError("redis went away for a moment")
            return real(decisions)

        ctx.allocator.index.commit = flaky
        send(ctx, requested("r1", "e1", "web", 3))
        log = ctx.log.wait(answered("r1", "TasksAllocated"), "TasksAllocated after the fold was redone")
        assert failures == [1] and not log.events("DeadLetterRecorded")
        assert len(log.events("TasksAllocated")) == 1 and len(ctx.index.placements()) == 3

    run_allocator(cfg, registry, body, region={"e1": 10})


# --- a restarted allocator: the fold of the log, and a Redis that lost the index -------------------------------

@pytest.mark.timeout(200)
def test_a_restarted_allocator_folds_the_log_and_writes_a_lost_index_back(cfg, registry):
    state = {}

    def first(ctx):
        send(ctx, requested("r1", "e1", "web", 5))
        ctx.log.wait(answered("r1", "TasksAllocated"), "TasksAllocated")
        wait_for(lambda: index_state(ctx.index.dump()) == index_state(ctx.allocator.fold.dump()), "Redis = fold")
        state["index"] = index_state(ctx.index.dump())

    run_allocator(cfg, registry, first, clear=False, region={"e1": 10})
    r = cfg.redis_client()
    MachineIndex(r, cfg.topic_prefix).clear()  # Redis lost everything (FLUSHALL, a new server)
    r.close()

    def second(ctx):
        wait_for(lambda: ctx.allocator.caught_up, "the fold caught up")
        wait_for(lambda: index_state(ctx.index.dump()) == state["index"], "the index written back whole")
        send(ctx, requested("r1", "e1", "web", 5), requested("r2", "e1", "api", 2))
        log = ctx.log.wait(answered("r2", "TasksAllocated"), "a new request decided")
        assert len(log.events("TasksAllocated", request_id="r1")) == 1  # r1 stays answered by the log
        assert len(ctx.index.placements()) == 7

    run_allocator(cfg, registry, second)


def fold_of_the_log(cfg, registry) -> dict:
    """A fold of the whole log from its beginning (no snapshot), as the index would hold it, without the marks."""
    fold = RegionFold()
    Follower(cfg, registry, fold, types=EVENT_TYPES).catch_up()
    return {k: v for k, v in fold.dump().items() if not k.startswith("applied:")}


def live_fold(ctx) -> dict:
    with ctx.allocator.lock:
        return {k: v for k, v in ctx.allocator.fold.dump().items() if not k.startswith("applied:")}


@pytest.mark.parametrize("log_replaced", [None, "event", "offset"], ids=["tail", "another event", "past the log"])
def test_a_restarted_allocator_starts_from_its_snapshot_and_reads_the_log_after_it(cfg, registry, monkeypatch,
                                                                                    log_replaced):
    """The first allocator writes a snapshot once its decision is read back; a request sent while it is stopped is
    decided by the next one, which reads only the log after the snapshot, decides nothing twice, and holds what a
    fold of the whole log holds. A snapshot whose last record is not the log's (here: its event id changed in the
    file, as if the region had been made again under the same run directory, or its offset past the log's end) is
    set aside, and the log is folded from its beginning, with the same decisions."""
    monkeypatch.setenv(snapshot.RECORDS_ENV, "1")
    monkeypatch.setenv(snapshot.EVERY_ENV, "0")

    def first(ctx):
        send(ctx, requested("r1", "e1", "web", 5))
        ctx.log.wait(answered("r1", "TasksAllocated"), "TasksAllocated")

        def taken():
            paths = snapshot.listing(cfg)
            return paths and len(snapshot.load(cfg, paths[-1]).fold.placement) == 5
        wait_for(taken, "a snapshot holding r1's placements")

    run_allocator(cfg, registry, first, clear=False, region={"e1": 10})
    newest = snapshot.listing(cfg)[-1]
    if log_replaced:  # the record the snapshot names is another event, or beyond the log's end
        lines = newest.read_bytes().split(b"\n", 1)
        meta = json.loads(lines[0])
        if log_replaced == "event":
            meta["last_applied"][0][3] = "00000000-0000-5000-8000-000000000000"
        else:
            meta["last_applied"][0][2] += 1000
        newest.write_bytes(json.dumps(meta).encode() + b"\n" + lines[1])
    producer = EventProducer(cfg, registry, "test")
    producer.send(requested("r1", "e1", "web", 5))  # delivered again: decided once
    producer.send(requested("r2", "e1", "api", 2))
    producer.flush()

    def second(ctx):
        log = ctx.log.wait(answered("r2", "TasksAllocated"), "r2 decided after the restart")
        assert len(log.events("TasksAllocated", request_id="r1")) == 1
        stats = ctx.allocator.last_catch_up
        if log_replaced:
            assert stats["snapshot"] is None and list(snapshot.directory(cfg).glob("*.bad")), stats
        else:
            assert stats["snapshot"] == newest.name and stats["records"] < 10, stats  # the tail, not the log
        wait_for(lambda: ctx.allocator.fold.as_logged and len(ctx.allocator.fold.placement) == 7, "r2's echo")
        assert live_fold(ctx) == fold_of_the_log(cfg, registry)
        wait_for(lambda: index_state(ctx.index.dump()) == index_state(ctx.allocator.fold.dump()), "Redis = fold")

    run_allocator(cfg, registry, second)


# --- by hand: the journal, the fence, the commit's re-check ---------------------------------------------------

class RecordingProducer:
    """Stands in for EventProducer: records what is sent."""

    def __init__(self):
        self.sent: list[Event] = []

    def send(self, event: Event, **_) -> None:
        self.sent.append(event)

    def send_all(self, events, **_) -> None:
        self.sent.extend(events)

    def flush(self, timeout_s: float = 30.0) -> None:
        pass

    def poll(self, timeout_s: float = 0.0) -> None:
        pass


@pytest.fixture
def hand(cfg, registry):
    """Two Allocators on the real Redis (no broker reads): fed records by hand at made-up positions."""
    r = cfg.redis_client()
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    offsets = Counter()
    made = []

    def new() -> Allocator:
        a = Allocator(cfg, registry, r, RecordingProducer())
        made.append(a)
        return a

    def feed(allocators, event: Event, topic: str = "allocations", partition: int = 0) -> None:
        physical = topics.name(topic)
        rec = Record(event, physical, partition, offsets[physical, partition], event.entitlement.encode(), 0)
        offsets[physical, partition] += 1
        for a in allocators:
            a.on_records([rec])

    def region(*allocators) -> None:
        for mid, msb in MACHINES.items():
            feed(allocators, registered(mid, msb), "machines")
        feed(allocators, entitlement_created("e1", 10), "intents")
        feed(allocators, entitlement_created("e2", 10), "intents")
        for a in allocators:
            a.project_changes(force=True)

    ctx = type("Hand", (), {"new": staticmethod(new), "feed": staticmethod(feed), "region": staticmethod(region),
                            "r": r, "index": MachineIndex(r, cfg.topic_prefix)})()
    yield ctx
    ctx.index.clear()
    r.close()


def test_a_crash_after_the_commit_is_answered_from_the_journal(hand):
    """The first allocator commits r1 in Redis and dies before its events reach the log; the next one folds a
    log without the decision, decides r1 again, and the commit hands it the journaled decision: the same events,
    produced, and no second placement."""
    first = hand.new()
    hand.region(first)
    first.assign([0])
    req = requested("r1", "e1", "web", 6)
    hand.feed([first], req)
    real_produce = first._produce
    first._produce = lambda events: (_ for _ in ()).throw(RuntimeError("the worker died"))
    with pytest.raises(RuntimeError, match="died"):
        first.decide_pending()
    first._produce = real_produce
    placed = hand.index.placements()
    assert len(placed) == 6 and first.producer.sent == []

    second = hand.new()  # a fresh fold of a log that has no decision for r1
    hand.region(second)
    second.assign([0])
    hand.feed([second], req)
    events = second.decide_pending()
    [done] = [e for e in events if e.type == "TasksAllocated"]
    assert {p["task_id"]: p["machine_id"] for p in done.payload["placements"]} == placed
    assert hand.index.placements() == placed  # committed once
    assert second.fold.placement == placed  # the fold took the journaled decision back from Redis
    assert [e.event_id for e in events] == [e.event_id for e in second.producer.sent]


def test_a_move_decided_again_after_a_conflict_still_frees_its_task_on_the_log(hand):
    """A move (free and place the same task) whose first plan meets a conflict in Redis: Redis applied the free
    then, and the second attempt's decision must still carry it. Before, the decision the log got had only the
    TasksAllocated, and the log never said the task left its old machine (the kill storm counted 33 tasks placed
    twice in the replayed log)."""
    a = hand.new()
    hand.region(a)
    a.assign([0])
    hand.feed([a], requested("r1", "e1", "web", 1))
    [first] = [e for e in a.decide_pending() if e.type == "TasksAllocated"]
    old = first.payload["placements"][0]["machine_id"]
    for mid in MACHINES:  # Redis ahead of the fold for every machine (another writer): the first plan conflicts
        hand.r.hincrby(hand.index.key(f"m:{mid}"), "version", 1)
    hand.feed([a], requested("r2", "e1", "web", 1, free=["web/0"]))
    events = a.decide_pending()
    assert [e.type for e in events if e.type.startswith("Tasks")] == ["TasksDeallocated", "TasksAllocated"]
    [freed] = [e for e in events if e.type == "TasksDeallocated"]
    [placed] = [e for e in events if e.type == "TasksAllocated"]
    assert [p["machine_id"] for p in freed.payload["placements"]] == [old]
    assert placed.payload["commit_attempts"] == 2
    new_machine = placed.payload["placements"][0]["machine_id"]
    assert hand.index.placements() == {"web/0": new_machine} == a.fold.placement


def test_a_request_asked_again_after_its_answer_is_answered_again_and_every_request_is_answered(hand):
    """A scheduler killed after asking asks again (the same record) and may have read the answer too early: the
    allocator produces the answer again, the same events, from the journal; a rejection is journaled too. A
    request with nothing to place whose tasks hold no placement (a stopped job that never ran) is answered with a
    TasksDeallocated freeing nothing: before, it was not answered, and its job waited for good."""
    a = hand.new()
    hand.region(a)
    a.assign([0])
    placing, rejecting, freeing = (requested("r1", "e1", "web", 2), requested("r2", "nobody", "x", 1),
                                   requested("r3", "e1", "never", 0, free=["never/0", "never/1"]))
    for req in (placing, rejecting, freeing):
        hand.feed([a], req)
    answers = a.decide_pending()
    by_request = {rid: [e for e in answers if e.payload.get("request_id") == rid] for rid in ("r1", "r2", "r3")}
    assert [e.type for e in by_request["r2"]] == ["AllocationRejected"]
    assert [(e.type, e.payload["placements"]) for e in by_request["r3"]] == [("TasksDeallocated", [])]
    for req in (placing, rejecting, freeing):
        a.fold.remember_decided(req.event_id)  # their answers were read back from the log
    sent = len(a.producer.sent)
    for req in (placing, rejecting, freeing):
        hand.feed([a], req)  # asked again
    assert a.decide_pending() == []  # decided once
    assert a.answer_repeated() == 3
    again = a.producer.sent[sent:]
    assert sorted(e.event_id for e in again) == sorted(e.event_id for e in answers)
    assert {e.event_id: e.payload for e in again} == {e.event_id: e.payload for e in answers}
    assert a.answer_repeated() == 0 and len(hand.index.placements()) == 2  # nothing placed twice


def test_a_stale_owner_is_fenced_and_decides_nothing(hand):
    old, new = hand.new(), hand.new()
    hand.region(old, new)
    old.assign([0])
    new.assign([0])  # the partition moved: the new owner raised its fence
    req = requested("r1", "e1", "web", 2)
    hand.feed([old, new], req)
    assert old.decide_pending() == [] and old.producer.sent == []  # refused by the fence: nothing produced
    assert hand.index.placements() == {} and old.fold.placement == {}  # and its fold took Redis's word back
    events = new.decide_pending()
    assert [e.type for e in events][:1] == ["TasksAllocated"] and len(hand.index.placements()) == 2


def test_two_allocators_racing_for_one_free_machine_commit_once_and_the_loser_decides_again(hand):
    """Both folds see the same free pool; the first commit wins, the second (another entitlement) meets the
    machines the first took (owner, version) in Redis, reloads them and places on others."""
    a, b = hand.new(), hand.new()
    hand.region(a, b)
    a.assign([0])
    b.assign([1])
    hand.feed([a, b], requested("ra", "e1", "web", 4, cpu=2000), partition=0)
    hand.feed([a, b], requested("rb", "e2", "api", 4, cpu=2000), partition=1)
    ea = a.decide_pending()
    eb = b.decide_pending()
    placed_a = [e for e in ea if e.type == "TasksAllocated"][0].payload
    placed_b = [e for e in eb if e.type == "TasksAllocated"][0].payload
    assert placed_b["commit_attempts"] == 2  # the first attempt met a's commit
    machines = hand.index.machines(MACHINES)
    assert sum(CPU - m.cpu_free for m in machines.values()) == 16000  # 8 tasks of 2000m, none lost, none twice
    assert len(hand.index.placements()) == 8
    assert {p["machine_id"] for p in placed_a["placements"]}.isdisjoint(
        {p["machine_id"] for p in placed_b["placements"]})


def test_every_attempt_in_conflict_ends_in_a_rejection(hand):
    a = hand.new()
    hand.region(a)
    a.assign([0])
    a.index.commit = lambda decisions: [Committed("conflict", conflicts={"m1a": "machine_version_changed"})
                                        for _ in decisions]
    hand.feed([a], requested("r1", "e1", "web", 2))
    events = a.decide_pending()
    assert [(e.type, e.payload["reason"]) for e in events] == [("AllocationRejected", COMMIT_RETRIES_EXHAUSTED)]
    assert "5 commit attempts" in events[0].payload["message"]


def test_entitlement_updates_unknown_entitlements_and_invalid_requests(hand):
    a = hand.new()
    hand.region(a)
    a.assign([0])
    hand.feed([a], requested("r1", "nobody", "web", 1))
    assert [(e.type, e.payload["reason"]) for e in a.decide_pending()] == [("AllocationRejected", UNKNOWN_ENTITLEMENT)]
    hand.feed([a], new_event("EntitlementUpdated", {"quota_machines": 1, "machine_type": None, "dc_pin": None,
                                                    "host_profile": None},
                             entitlement="e1", entity_id="e1", producer="test"), "intents")
    assert a.fold.entitlement("e1").quota_machines == 1
    hand.feed([a], requested("r2", "e1", "web", 6))
    assert [e.payload.get("reason") for e in a.decide_pending() if e.type == "AllocationRejected"] == [QUOTA_EXCEEDED]
    hand.feed([a], new_event("AllocationRequested", {**requested("r3", "e1", "web2", 1).payload, "spread": "planet"},
                             entitlement="e1", entity_id="r3", producer="test"))
    assert [(e.type, e.payload["reason"]) for e in a.decide_pending()] == [("AllocationRejected", INVALID_REQUEST)]


def test_a_partition_not_owned_is_not_decided(hand):
    a = hand.new()
    hand.region(a)
    a.assign([1])
    hand.feed([a], requested("r1", "e1", "web", 1), partition=0)
    assert a.decide_pending() == [] and len(a.pending) == 1  # kept until its owner decides it, or this one owns it
    a.assign([0])
    assert [e.type for e in a.decide_pending()][:1] == ["TasksAllocated"]


def test_allocator_metrics_before_any_request(cfg):
    r = cfg.redis_client()
    assert allocator_metrics(r, cfg.topic_prefix) == {"requests": 0, "placed": 0, "rejected": 0,
                                                      "cache_hit_ratio": None}
    r.close()


# --- the worker process ----------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_python_m_runs_the_allocator_worker(cfg, registry, tmp_path):
    env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
           "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions),
           "ROPEWALK_RUN_DIR": str(tmp_path)}
    out = open(tmp_path / "allocator.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "processors.allocator.processor"], env=env, stdout=out,
                            stderr=subprocess.STDOUT, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__)))))
    r = cfg.redis_client()
    index = MachineIndex(r, cfg.topic_prefix)
    log = Log(cfg, registry)
    try:
        producer = EventProducer(cfg, registry, "test")
        for mid, msb in MACHINES.items():
            producer.send(registered(mid, msb))
        producer.send(entitlement_created("e1", 10))
        producer.flush()
        wait_for(lambda: r.exists(index.key("entitlement:e1")) and len(index.machines(MACHINES)) == 6,
                 "the worker folding machines and the entitlement", 60)
        producer.send(requested("r1", "e1", "web", 3))
        producer.flush()
        log.wait(answered("r1", "TasksAllocated"), "TasksAllocated from the worker", 60)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
            out.close()
            log.consumer.close()
            index.clear()
            r.close()


def test_the_echoes_of_a_batch_leave_the_fold_as_a_fold_of_the_log(hand):
    """One batch: a job placed, the same job freed (its machines go back to the pool), another entitlement's job
    placed on those machines. Then the decisions come back from the log. Before, the echo of the first TasksAllocated
    put the freed tasks back on their machines until the free's echo came (a phantom placement), and each machine's
    version ended ahead of the log's, so Redis never equalled a rebuild (the kill storm's last difference)."""
    a = hand.new()
    hand.region(a)
    a.assign([0])
    requests = [requested("r1", "e1", "web", 4), requested("r2", "e1", "web", 0, free=[f"web/{i}" for i in range(4)]),
                requested("r3", "e2", "api", 4)]
    for req in requests:
        hand.feed([a], req)
    made = a.decide_pending()
    assert [e.type for e in made if e.type.startswith("Tasks")] == ["TasksAllocated", "TasksDeallocated",
                                                                     "TasksAllocated"]
    fresh = hand.new()
    hand.region(fresh)
    for req in requests:
        hand.feed([fresh], req)
    for e in made:  # the echoes, as the log gives them back to both
        topic = "machines" if e.type.startswith("Machine") else "allocations"
        before = {mid: (m.version, set(m.tasks)) for mid, m in a.fold.machines.items()}
        hand.feed([a, fresh], e, topic)
        assert {mid: (m.version, set(m.tasks)) for mid, m in a.fold.machines.items()} == before, e.type
    state = lambda f: {k: v for k, v in f.dump().items() if not k.startswith("applied:")}  # noqa: E731 - not the marks
    assert state(a.fold) == state(fresh.fold)  # (the hand-made offsets differ)
    assert a.fold.requests == {} == fresh.fold.requests


def test_a_batch_is_decided_in_the_order_its_decision_time_names_whatever_the_arrival(hand):
    """Two requests of one batch want more of the free pool than there is: they are decided in the order
    ``in_decision_order`` gives for the batch's decision time (by partition from the one that time names), not in
    the order they arrived, so a replay of the log (processors/history) decides them alike; the batch's decisions
    share one decision time, later than the batch before's."""
    a = hand.new()
    hand.region(a)
    a.assign([0, 1])
    hand.feed([a], requested("warmup", "e1", "one", 1, cpu=1000), partition=0)
    [before] = [e for e in a.decide_pending() if e.type == "TasksAllocated"]
    hand.feed([a], requested("late", "e2", "api", 4, cpu=CPU), partition=1)  # arrives first
    hand.feed([a], requested("early", "e1", "web", 4, cpu=CPU), partition=0)
    events = a.decide_pending()
    assert len({e.timestamp_ms for e in events}) == 1 and events[0].timestamp_ms > before.timestamp_ms
    first, second = in_decision_order([("late", 1), ("early", 0)], lambda r: r[1], events[0].timestamp_ms,
                                      a.topics.partitions_of("allocations"))
    placed = {e.payload["request_id"]: len(e.payload["placements"]) for e in events if e.type == "TasksAllocated"}
    # 6 machines of one task each less the warm-up's (e1 holds it, 1000m used): 5 whole ones for 8 tasks
    assert placed == {first[0]: 4, second[0]: 1}, placed
    assert [e.payload["request_id"] for e in events if e.type == "TasksAllocated"] == [first[0], second[0]]


def test_a_change_read_with_a_request_is_in_redis_before_the_request_is_committed(hand):
    """A record that changes a machine (its host profile) arrives in the same poll as a request placed on it: the
    fold is ahead of Redis for that machine when the request is decided. Before, the commit met the older version
    in Redis, reloaded the machine from it and so undid the change in the fold (the host profile lost until the
    next change, Redis no longer a projection of the log)."""
    a = hand.new()
    hand.region(a)
    a.assign([0])
    for mid in MACHINES:
        hand.feed([a], new_event("HostProfileApplied", {"machine_id": mid, "host_profile": "web",
                                                                 "previous_host_profile": None},
                                 entitlement="free/dc1", entity_id=mid, producer="test"), "machines")
    hand.feed([a], requested("r1", "e1", "web", 2))
    [placed] = [e for e in a.decide_pending() if e.type == "TasksAllocated"]
    assert placed.payload["commit_attempts"] == 1
    assert {m.host_profile for m in a.fold.machines.values()} == {"web"}
    a.project_changes(force=True)
    assert index_state(hand.index.dump()) == index_state(a.fold.dump())


# --- two allocators deciding for one entitlement at once --------------------------------------------------------

def _to_partition(producer: EventProducer, event: Event, partition: int) -> None:
    """``event`` on a partition its entitlement's hash does not name: where a request of an entitlement moving to
    another partition is, while the old partition's owner may still decide for it (issue 25, item 2)."""
    producer.send(event, partition=partition)


RACES = {
    # name: (machines {id: (dc, cpu)}, quota of e1, warm-up request of e1 decided first (or None),
    #        the two racing requests of e1 (partition 0, partition 1), what must hold once both decided)
    "one machine's last capacity": (
        {"m1": ("dc1", CPU)}, 1, requested("warm", "e1", "w", 1, cpu=1000),
        (requested("ra", "e1", "a", 1, cpu=3000), requested("rb", "e1", "b", 1, cpu=3000)),
        {"placed": 1, "loser_reason": NO_FEASIBLE_MACHINE, "conflict": "machine_capacity_changed", "held": 1}),
    "the quota's last machine": (
        {"m1": ("dc1", CPU), "m2": ("dc1", CPU), "m3": ("dc2", CPU)}, 2, requested("warm", "e1", "w", 1, cpu=CPU),
        (requested("ra", "e1", "a", 1, requirements={"dc": "dc1"}), requested("rb", "e1", "b", 1,
                                                                              requirements={"dc": "dc2"})),
        {"placed": 1, "loser_reason": QUOTA_EXCEEDED, "conflict": "quota_exceeded_at_commit", "held": 2}),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("machines,quota,warm,race,want", RACES.values(), ids=RACES.keys())
def test_two_allocators_deciding_at_once_for_one_entitlement_keep_capacity_and_quota(cfg, registry, machines, quota,
                                                                                     warm, race, want):
    """Two allocator processes' worth (two ``Allocator``s, each folding the real log, each with its own producer
    to it) own partitions 0 and 1; a request of e1 waits on each (one entitlement on two partitions: a move between
    shards). Both plan on the same fold and commit at once, against one Redis (a barrier holds each commit until
    both planned). The commit re-checks every machine, and the quota when a plan adds machines: one decision
    commits, the other meets a conflict (capacity, or ``quota_exceeded_at_commit``), reloads what the other took
    and decides again. The log, replayed, has no machine over its capacity and no entitlement over its quota;
    Redis equals a rebuild from the log."""
    r = cfg.redis_client()
    producer = EventProducer(cfg, registry, "test")
    for mid, (dc, cpu) in machines.items():
        producer.send(new_event("MachineRegistered", {
            "machine_id": mid, "topology": {"region": "reg1", "dc": dc, "msb": "msb1", "rack": "r1"},
            "machine_type": "skylake", "capacity": {"cpu_millicores": cpu, "memory_mib": MEM}, "host_profile": None},
            entitlement=f"free/{dc}", entity_id=mid, producer="test"))
    producer.send(entitlement_created("e1", quota))
    producer.send(warm)
    producer.flush()
    made: list[Allocator] = []

    def allocator() -> Allocator:
        a = Allocator(cfg, registry, r, EventProducer(cfg, registry, PRODUCER))
        made.append(a)
        a.catch_up()
        return a

    try:
        first = allocator()  # the warm-up: e1 takes a machine
        first.assign(range(cfg.partitions))
        assert any(e.type == "TasksAllocated" for e in first.decide_pending())
        first.producer.flush()
        for partition, req in enumerate(race):
            _to_partition(producer, req, partition)
        producer.flush()
        a, b = allocator(), allocator()  # both fold the warm-up's decision and the two requests
        a.assign([0])
        b.assign([1])
        assert len(a.pending) == len(b.pending) == 2
        barrier = threading.Barrier(2)
        outcomes: list = []  # every commit's results, both allocators'
        for al in (a, b):
            real = al.index.commit
            waited: list[bool] = []

            def commit(decisions, real=real, waited=waited):
                if not waited:  # the first commit of each waits for the other's plan: they race
                    waited.append(True)
                    barrier.wait(30)
                out = real(decisions)
                outcomes.extend(out)
                return out

            al.index.commit = commit
        decided: dict[str, list[Event]] = {}
        threads = [threading.Thread(target=lambda al=al, n=n: decided.__setitem__(n, al.decide_pending()))
                   for n, al in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for al in (a, b):
            al.producer.flush()
            al.project_changes(force=True)
        events = decided["a"] + decided["b"]
        placed = [e for e in events if e.type == "TasksAllocated"]
        rejected = [e for e in events if e.type == "AllocationRejected"]
        assert len(placed) == want["placed"] and len(rejected) == 1, [(e.type, e.payload) for e in events]
        [loser] = rejected
        assert loser.payload["reason"] == want["loser_reason"], loser.payload
        assert sum(len(e.payload["placements"]) for e in placed) == 1
        # the loser met the winner's commit (a conflict of the expected reason), then decided again on what it
        # reloaded from Redis: three commits in all
        assert [c.outcome for c in outcomes].count("ok") == 2 and len(outcomes) == 3, outcomes
        [conflict] = [c for c in outcomes if c.outcome == "conflict"]
        assert set(conflict.conflicts.values()) == {want["conflict"]}, conflict
        checks = replay_checks(cfg, registry)
        assert {k: checks[k] for k in ("machines_overcommitted", "quota_breaches", "tasks_placed_twice",
                                       "conflicting_duplicates")} == dict.fromkeys(
            ("machines_overcommitted", "quota_breaches", "tasks_placed_twice", "conflicting_duplicates"), 0), checks
        index = MachineIndex(r, cfg.topic_prefix)
        held = [m for m in index.machines(machines).values() if m.entitlement == "e1"]
        assert len(held) == want["held"] <= quota
        assert sorted(index.dump().get("held:e1", [])) == sorted(m.id for m in held)
        # (the applied marks aside: these two did not read their own decisions back from the log, a rebuild did)
        assert [d for d in redis_differences(cfg, registry, r) if not d.startswith("applied:")] == []
    finally:
        MachineIndex(r, cfg.topic_prefix).clear()
        r.close()


def test_a_snapshot_that_cannot_be_forked_is_not_the_allocators_failure(hand, monkeypatch):
    """No process to spare for the snapshot's writer (EAGAIN): the allocator decides on, and tries again later."""
    monkeypatch.setenv(snapshot.RECORDS_ENV, "1")
    a = hand.new()
    hand.region(a)
    a.assign([0])

    def no_fork(*_, **__):
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(snapshot, "write_in_child", no_fork)
    a.maybe_snapshot(at_start=True)
    assert a._snapshot_child is None and a._read_since_snapshot > 0  # nothing written: still to be
    hand.feed([a], requested("r1", "e1", "web", 2))
    assert [e.type for e in a.decide_pending() if e.type.startswith("Tasks")] == ["TasksAllocated"]


@pytest.mark.parametrize("stopping", [True, False], ids=["asked to stop: no crash", "running: a crash"])
def test_a_loop_step_that_fails_after_the_allocator_was_asked_to_stop_is_no_crash(cfg, registry, stopping):
    """A stopped test's allocator thread kept folding, its topics dropped, and its catch-up's stall (60 s later)
    was raised as an unhandled thread exception in another test. What fails once ``stop`` is set is logged, not the
    loop's crash; what fails while it runs still is."""
    r = cfg.redis_client()
    allocator = Allocator(cfg, registry, r, None)
    stop = threading.Event()

    def refold():
        if stopping:
            stop.set()
        raise RuntimeError("the topics are gone")

    allocator.refold = refold
    try:
        if stopping:
            allocator.run(stop, None)
            assert allocator.crash is None
        else:
            with pytest.raises(RuntimeError, match="the topics are gone"):
                allocator.run(stop, None)
            assert isinstance(allocator.crash, RuntimeError)
    finally:
        r.close()
