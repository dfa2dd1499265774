"""The allocator processor on the real broker and Redis: the faust app runs in-process (as in
test_faust_codec), events go in with EventProducer, results are read back from the log and from Redis."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import redis

from processors.allocator.index import MachineIndex
from processors.allocator.placement import FILTER_MACHINE_TYPE, NO_FEASIBLE_MACHINE, QUOTA_EXCEEDED
from processors.allocator.processor import PRODUCER, RELEASED_EMPTY, allocator_metrics, build_app
from streams.clients import EventConsumer, EventProducer
from streams.deadletter import PROCESSING_FAILED
from streams.events import Event, new_event
from streams.serde import NO_MARKER
from streams.topics import Topics

pytestmark = pytest.mark.integration

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


def run_allocator(cfg, registry, body, timeout_s: float = 100.0):
    """Run the allocator's faust app while ``body(ctx)`` (blocking, in a thread) drives and checks it."""
    r = redis.Redis.from_url(cfg.redis_url)
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
            return await asyncio.get_running_loop().run_in_executor(None, body, ctx)
        finally:
            crash = app.crash_reason
            await app.stop()
            assert crash is None, crash

    try:
        return asyncio.run(asyncio.wait_for(scenario(), timeout_s))
    finally:
        ctx.log.consumer.close()
        ctx.index.clear()
        r.close()


def setup_region(ctx, entitlements: dict[str, int]) -> None:
    """Register MACHINES and create entitlements; wait until the allocator has applied them."""
    for mid, msb in MACHINES.items():
        ctx.producer.send(registered(mid, msb))
    for name, quota in entitlements.items():
        ctx.producer.send(entitlement_created(name, quota))
    ctx.producer.flush()
    wait_for(lambda: len(ctx.index.machines(MACHINES)) == len(MACHINES), "the machines in the index")
    wait_for(lambda: all(ctx.allocator.entitlement(e) for e in entitlements), "the entitlements in Redis")


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
        setup_region(ctx, {"e1": 10})
        req = requested("r1", "e1", "web", 6)
        send(ctx, req)
        log = ctx.log.wait(answered("r1", "TasksAllocated"), "TasksAllocated")
        [done] = log.events("TasksAllocated", request_id="r1")
        derived_from(req, done)
        p = done.payload
        assert len(p["placements"]) == 6 and p["commit_attempts"] == 1 and p["cache_hit"] is False  # first
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
        assert ctx.index.held_count("e1") == 3

    run_allocator(cfg, registry, body)


# --- (2) nothing fits --------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_rejects_a_request_no_machine_can_meet(cfg, registry):
    def body(ctx):
        setup_region(ctx, {"e1": 10})
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

    run_allocator(cfg, registry, body)


# --- (3) quota ----------------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_quota_gives_a_partial_placement_and_a_rejection(cfg, registry):
    def body(ctx):
        setup_region(ctx, {"small": 1})
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
        assert ctx.index.held_count("small") == 1 and len(ctx.index.placements()) == 4

    run_allocator(cfg, registry, body)


# --- (4) redelivery ------------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_a_request_delivered_twice_allocates_once_and_repeats_its_result(cfg, registry):
    def body(ctx):
        setup_region(ctx, {"e1": 10})
        req = requested("r1", "e1", "web", 6)
        send(ctx, req, req)  # the same event (same id) twice, at two offsets
        log = ctx.log.wait(lambda lg: len(lg.events("TasksAllocated", request_id="r1")) == 2 and lg,
                           "two TasksAllocated")
        first, second = log.events("TasksAllocated", request_id="r1")
        assert first == second and first.event_id == second.event_id  # identical: readers dedupe by id
        log = ctx.log.wait(lambda lg: len(lg.events("MachineAssignedToEntitlement")) == 6 and lg,
                           "the assignments, twice")
        assigned = Counter(e.event_id for e in log.events("MachineAssignedToEntitlement"))
        assert len(assigned) == 3 and set(assigned.values()) == {2}
        assert not log.events("AllocationRejected")  # the second delivery did not try to allocate again
        assert len(ctx.index.placements()) == 6
        assert sum(CPU - m.cpu_free for m in ctx.index.machines(MACHINES).values()) == 6000
        # The request's pending set is cleared by the repeated result too.
        wait_for(lambda: not ctx.r.exists(ctx.index.key("req:r1")), "req:r1 answered")

    run_allocator(cfg, registry, body)


# --- (5) freeing ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_freeing_tasks_restores_capacity_and_releases_empty_machines(cfg, registry):
    def body(ctx):
        setup_region(ctx, {"e1": 10})
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
        assert ctx.index.placements() == {} and ctx.index.held_count("e1") == 0
        for m in ctx.index.machines(MACHINES).values():
            assert (m.cpu_free, m.mem_free, m.entitlement) == (CPU, MEM, None)
        # Once the allocator has read its own events back (the assignments, then the releases: one partition,
        # key e1), the index is as the allocator wrote it.
        last = max((r for r in log.records if r.event.type == "MachineReleasedToFreePool"), key=lambda r: r.offset)
        wait_for(lambda: int(ctx.r.hget(ctx.index.key("applied:allocator"), f"{last.topic}/{last.partition}") or -1)
                 >= last.offset, "the releases read back")
        assert ctx.index.held_count("e1") == 0
        assert all(m.entitlement is None for m in ctx.index.machines(MACHINES).values())

    run_allocator(cfg, registry, body)


# --- (6) bad records -----------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_bad_records_go_to_deadletter_and_the_allocator_goes_on(cfg, registry):
    def body(ctx):
        setup_region(ctx, {"e1": 10})
        catalogue = Topics(cfg.topic_prefix, cfg.partitions)
        ctx.producer.send_raw(catalogue.name("allocations"), b"e1", b"not an event at all")
        # Decodes fine, but the index cannot apply it (a machine nobody registered): processing_failed.
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
        assert "UnknownMachine" in reasons["machines"]["detail"] and "ghost" in reasons["machines"]["detail"]
        assert all(p["consumer"] == PRODUCER for p in reasons.values())
        assert len(ctx.index.placements()) == 2

    run_allocator(cfg, registry, body)


@pytest.mark.timeout(150)
def test_a_transient_redis_error_is_retried_not_dead_lettered(cfg, registry):
    def body(ctx):
        setup_region(ctx, {"e1": 10})
        real, failures = ctx.allocator.handle, []

        def flaky(event, position):
            if event.type == "AllocationRequested" and not failures:
                failures.append(position)
                raise redis.ConnectionError("redis went away for a moment")
            return real(event, position)

        ctx.allocator.handle = flaky
        send(ctx, requested("r1", "e1", "web", 3))
        log = ctx.log.wait(answered("r1", "TasksAllocated"), "TasksAllocated after a retry")
        assert len(failures) == 1 and not log.events("DeadLetterRecorded")
        assert len(log.events("TasksAllocated")) == 1

    run_allocator(cfg, registry, body)


# --- crash windows, without faust: the journal makes a re-handled request repeat its decision ------------------

class RecordingProducer:
    """Stands in for EventProducer: records what is sent; ``fail_sends`` makes the next sends raise."""

    def __init__(self):
        self.sent: list[Event] = []
        self.fail_sends = 0

    def send(self, event: Event) -> None:
        if self.fail_sends:
            self.fail_sends -= 1
            raise RuntimeError("broker gone")
        self.sent.append(event)

    def flush(self, timeout_s: float = 30.0) -> None:
        pass


class Crash(Exception):
    pass


@pytest.fixture
def direct(cfg):
    """An Allocator on the real Redis, fed by hand at made-up positions, with the region of MACHINES."""
    from processors.allocator.processor import Allocator

    r = redis.Redis.from_url(cfg.redis_url)
    allocator = Allocator(r, cfg.topic_prefix, RecordingProducer())
    offsets = Counter()

    def feed(event: Event, topic: str = "allocations", offset: int | None = None) -> list[Event]:
        if offset is None:
            offset = offsets[topic]
            offsets[topic] += 1
        return allocator.handle(event, (topic, 0, offset))

    allocator.feed = feed
    for mid, msb in MACHINES.items():
        feed(registered(mid, msb), "machines")
    feed(entitlement_created("e1", 10), "intents")
    yield allocator
    allocator.index.clear()
    r.close()


def test_a_crash_after_the_commit_re_emits_the_journaled_decision(direct):
    real_commit = direct.index.commit
    commits = []

    def commit_then_crash(*args, **kwargs):
        commits.append(args)
        real_commit(*args, **kwargs)
        raise Crash("the worker died right after the commit")

    direct.index.commit = commit_then_crash
    req = requested("r1", "e1", "web", 6)
    with pytest.raises(Crash):
        direct.feed(req, offset=0)
    direct.index.commit = lambda *a, **k: pytest.fail("a redelivered request committed again")
    placed = direct.index.placements()
    assert len(placed) == 6 and len(commits) == 1

    events = direct.feed(req, offset=0)  # redelivered at the same offset
    [done] = [e for e in events if e.type == "TasksAllocated"]
    assert {p["task_id"]: p["machine_id"] for p in done.payload["placements"]} == placed
    assert done.payload["commit_attempts"] == 1 and len(done.payload["machines_added"]) == 3
    assert sum(e.type == "MachineAssignedToEntitlement" for e in events) == 3
    assert direct.index.placements() == placed
    assert direct.feed(req, offset=5) == events  # and once more, at a new offset: the same events


def test_a_crash_before_producing_re_emits_the_same_events(direct):
    req = requested("r1", "e1", "web", 4)
    direct.producer.fail_sends = 1
    with pytest.raises(RuntimeError, match="broker gone"):
        direct.feed(req, offset=0)
    events = direct.feed(req, offset=0)
    assert [e.event_id for e in events] == [e.event_id for e in direct.producer.sent]
    assert len(direct.index.placements()) == 4


def test_a_crash_while_freeing_re_emits_the_same_deallocation(direct):
    direct.feed(requested("r1", "e1", "web", 2))
    placed = direct.index.placements()
    real_apply = direct._direct.apply

    def apply_then_crash(*args, **kwargs):
        real_apply(*args, **kwargs)
        raise Crash("the worker died right after freeing")

    direct._direct.apply = apply_then_crash
    free = requested("r2", "e1", "web", free=list(placed))
    with pytest.raises(Crash):
        direct.feed(free, offset=1)
    direct._direct.apply = real_apply
    assert direct.index.placements() == {}
    events = direct.feed(free, offset=1)
    [dealloc] = [e for e in events if e.type == "TasksDeallocated"]
    assert {p["task_id"]: p["machine_id"] for p in dealloc.payload["placements"]} == placed
    assert sorted(dealloc.payload["machines_released"]) == sorted(set(placed.values()))
    assert direct.index.held_count("e1") == 0


def test_two_allocators_holding_one_request_decide_it_once(direct, cfg):
    """During a rebalance the old and the new owner of a partition may both process a request."""
    from concurrent.futures import ThreadPoolExecutor

    from processors.allocator.processor import Allocator

    other = Allocator(redis.Redis.from_url(cfg.redis_url), cfg.topic_prefix, RecordingProducer())
    commits = []
    for a in (direct, other):
        real = a.index.commit

        def counted(*args, _real=real, **kwargs):
            commits.append(args)
            time.sleep(0.2)  # hold the decision long enough for the other to arrive
            return _real(*args, **kwargs)

        a.index.commit = counted
    req = requested("r1", "e1", "web", 6)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda a: a.handle(req, ("allocations", 0, 0)), (direct, other)))
    assert len(commits) == 1 and results[0] == results[1]
    assert [e.type for e in results[0]].count("TasksAllocated") == 1 and len(direct.index.placements()) == 6
    assert not any(e.type == "AllocationRejected" for e in results[0])
    other.r.close()


def test_entitlement_updates_and_unknown_entitlements(direct):
    rej = direct.feed(requested("r1", "nobody", "web", 1))
    assert [(e.type, e.payload["reason"]) for e in rej] == [("AllocationRejected", "unknown_entitlement")]
    direct.feed(new_event("EntitlementUpdated", {"quota_machines": 1, "machine_type": None, "dc_pin": None,
                                                 "host_profile": None},
                          entitlement="e1", entity_id="e1", producer="test"), "intents")
    assert direct.entitlement("e1").quota_machines == 1
    events = direct.feed(requested("r2", "e1", "web", 6))
    assert [e.payload.get("reason") for e in events if e.type == "AllocationRejected"] == [QUOTA_EXCEEDED]
    bad = direct.feed(new_event("AllocationRequested", {**requested("r3", "e1", "web2", 1).payload,
                                                        "spread": "planet"},
                                entitlement="e1", entity_id="r3", producer="test"))
    assert [(e.type, e.payload["reason"]) for e in bad] == [("AllocationRejected", "invalid_request")]


def test_the_job_level_cache_answers_a_second_job_of_the_same_shape_and_counts_it(direct):
    def allocated(events):
        [done] = [e for e in events if e.type == "TasksAllocated"]
        return done.payload

    first = allocated(direct.feed(requested("r1", "e1", "web", 3)))
    r2 = requested("r2", "e1", "api", 3)
    second = allocated(direct.feed(r2))
    assert first["cache_hit"] is False and second["cache_hit"] is True
    assert {p["machine_id"] for p in second["placements"]} == {p["machine_id"] for p in first["placements"]}
    assert second["machines_added"] == [] and second["commit_attempts"] == 1
    other_shape = allocated(direct.feed(requested("r3", "e1", "big", 1, cpu=2000)))
    assert other_shape["cache_hit"] is False
    again = direct.feed(r2)  # redelivered: the journal answers, not counted again
    assert allocated(again) == second
    direct.feed(requested("r4", "e1", "web", free=["web/0"]))  # frees only: a request, not a cache lookup
    direct.feed(requested("r5", "nobody", "x", 1))  # rejected before placement: not a lookup either
    metrics = allocator_metrics(direct.r, direct.prefix)
    assert metrics == {"cache_hits": 1, "cache_misses": 2, "requests": 5, "cache_hit_ratio": 1 / 3}
    assert {k.decode(): int(v) for k, v in direct.r.hgetall(direct.key("metrics:allocator")).items()} == {
        "cache_hits": 1, "cache_misses": 2, "requests": 5}


def test_allocator_metrics_before_any_request(cfg):
    r = redis.Redis.from_url(cfg.redis_url)
    assert allocator_metrics(r, cfg.topic_prefix) == {"cache_hits": 0, "cache_misses": 0, "requests": 0,
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
    r = redis.Redis.from_url(cfg.redis_url)
    index = MachineIndex(r, cfg.topic_prefix)
    log = Log(cfg, registry)
    try:
        producer = EventProducer(cfg, registry, "test")
        for mid, msb in MACHINES.items():
            producer.send(registered(mid, msb))
        producer.send(entitlement_created("e1", 10))
        producer.flush()
        wait_for(lambda: r.exists(index.key("entitlement:e1")) and len(index.machines(MACHINES)) == 6,
                 "the worker applying machines and the entitlement", 60)
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
