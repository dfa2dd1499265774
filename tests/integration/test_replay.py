"""Integration tests of streams.replay on the real embedded broker: order, filters, termination under
concurrent writes, undecodable records, and the murmur2 partitioner against confluent-kafka's."""
from __future__ import annotations

import random
import threading
import time
import uuid
from collections import defaultdict

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from streams.clients import EventProducer, producer_conf
from streams.events import new_event
from streams.partitioner import murmur2, partition_for
from streams.replay import COPIES, LOG_TIME_SLACK_MS, ReplayFilter, matches, replay
from streams.serde import MALFORMED, NO_MARKER
from streams.topics import BY_NAME, TOPIC_OF_EVENT, Topics, provision

ENTITLEMENTS = ("ads", "search", "feed", "free/dc1", "billing")
RESOURCES = {"cpu_millicores": 500, "memory_mib": 256}
PLACED = {"dc": "dc1", "msb": "msb1", "rack": "r1"}


# --- event builders (valid per schemas/) ---------------------------------------------------------
def mk(type_, payload, ent, entity, ts=None, eid=None):
    return new_event(type_, payload, entitlement=ent, entity_id=entity, producer="test", timestamp_ms=ts,
                     event_id=eid)


def submitted(ent, job, ts=None, eid=None):
    return mk("JobSubmitted", {"job_id": job, "name": job, "tasks": 2, "command": ["sleep", "1"],
                               "resources": RESOURCES}, ent, job, ts, eid)


def stopped(ent, job, ts=None, eid=None):
    return mk("JobStopped", {"job_id": job, "reason": "done"}, ent, job, ts, eid)


def requested(ent, job, req, ts=None, eid=None):
    return mk("AllocationRequested", {"request_id": req, "job_id": job, "place_task_ids": [f"{job}/0", f"{job}/1"],
                                      "resources": RESOURCES, "avoid_machine_ids": ["m9"]}, ent, req, ts, eid)


def allocated(ent, job, req, machines, ts=None, eid=None):
    placements = [{"task_id": f"{job}/{i}", "machine_id": m, **PLACED} for i, m in enumerate(machines)]
    return mk("TasksAllocated", {"request_id": req, "job_id": job, "placements": placements,
                                 "filter_rejections": {"insufficient_cpu": 3}}, ent, req, ts, eid)


def rejected(ent, job, req, ts=None, eid=None):
    return mk("AllocationRejected", {"request_id": req, "job_id": job, "reason": "no_feasible_machine",
                                     "message": "no machine has enough memory", "unplaced_task_ids": [f"{job}/0"]},
              ent, req, ts, eid)


def task_state(ent, task, machine, ts=None, eid=None):
    return mk("TaskStateChanged", {"task_id": task, "job_id": task.split("/")[0], "machine_id": machine,
                                   "state": "RUNNING", "previous_state": "STARTING"}, ent, task, ts, eid)


def unavailable(ent, ue, machines, ts=None, eid=None):
    return mk("UnavailabilityStarted", {"unavailability_id": ue, "kind": "FAILURE", "machine_ids": machines,
                                        "start_ms": ts or 0}, ent, ue, ts, eid)


def heartbeat(ent, machine, ts=None, eid=None):
    return mk("AgentHeartbeat", {"machine_id": machine, "sequence": 1}, ent, machine, ts, eid)


def assigned(ent, machine, ts=None, eid=None):
    return mk("MachineAssignedToEntitlement", {"machine_id": machine, "dc": "dc1"}, ent, machine, ts, eid)


def produce(cfg, registry, events, name="test", *, log_time_is_event_time=False):
    """Produce ``events``; their log timestamps are the time of sending, or their envelope times."""
    p = EventProducer(cfg, registry, name)
    for e in events:
        p.send(e, log_timestamp_ms=e.timestamp_ms if log_time_is_event_time else None)
    p.flush()
    return p


def fresh_cfg(infra_cfg):
    """Like the `cfg` fixture, for module-scoped data sets."""
    c = infra_cfg.with_(topic_prefix=f"t{uuid.uuid4().hex[:8]}.")
    provision(AdminClient({**c.kafka_conf()}), Topics(c.topic_prefix, c.partitions))
    return c


def offsets_increase(records) -> bool:
    last: dict[tuple[str, int], int] = {}
    for r in records:
        tp = (r.topic, r.partition)
        if r.offset <= last.get(tp, -1):
            return False
        last[tp] = r.offset
    return True


def offsets_by_partition(records) -> dict[tuple[str, int], list[int]]:
    out = defaultdict(list)
    for r in records:
        out[(r.topic, r.partition)].append(r.offset)
    return dict(out)


# --- (1) order per entitlement -------------------------------------------------------------------
INTERLEAVED_TOPICS = ("intents", "allocations", "tasks")


def interleaved(n=200, seed=7):
    """n events over ENTITLEMENTS and three topics, in a seeded random interleaving."""
    rng = random.Random(seed)
    events = []
    for i in range(n):
        ent, topic = rng.choice(ENTITLEMENTS), rng.choice(INTERLEAVED_TOPICS)
        job = f"{ent.replace('/', '-')}-job{i % 3}"
        if topic == "intents":
            events.append(submitted(ent, job) if i % 2 else stopped(ent, job))
        elif topic == "allocations":
            events.append(requested(ent, job, f"req-{i}") if i % 2 else allocated(ent, job, f"req-{i}", ["m1"]))
        else:
            events.append(task_state(ent, f"{job}/{i}", f"m{i % 4}"))
    return events


def test_replay_order_per_entitlement(cfg, registry):
    events = interleaved()
    produce(cfg, registry, events)
    expected = defaultdict(list)  # (entitlement, logical topic) -> event ids in produced order
    for e in events:
        expected[(e.entitlement, TOPIC_OF_EVENT[e.type])].append(e.event_id)
    topics = Topics(cfg.topic_prefix, cfg.partitions)

    whole = list(replay(cfg, registry))
    assert len(whole) == len(events) and offsets_increase(whole)

    for ent in ENTITLEMENTS:
        run = replay(cfg, registry, ReplayFilter(entitlement=ent))
        got = list(run)
        assert offsets_increase(got)
        assert {r.event.entitlement for r in got} == {ent}
        for logical in INTERLEAVED_TOPICS:
            on_topic = [r for r in got if r.topic == topics.name(logical)]
            assert [r.event.event_id for r in on_topic] == expected[(ent, logical)], (ent, logical)
            # All of an entitlement's records are on the partition murmur2 gives its key.
            assert {r.partition for r in on_topic} <= {partition_for(ent, cfg.partitions)}
        # Narrowed: one partition of each co-partitioned topic, every partition of the others.
        copart = [t for t in BY_NAME.values() if t.copartitioned and t.name not in COPIES]
        others = [t for t in BY_NAME.values() if not t.copartitioned and t.name != "_schemas"]
        assert run.stats.partitions == len(copart) + sum(topics.partitions_of(t.name) for t in others)
        assert run.stats.matched == len(got) and run.stats.skipped == 0
        # The same answer, partition by partition, as filtering the whole log.
        assert offsets_by_partition(got) == offsets_by_partition(r for r in whole if r.event.entitlement == ent)


# --- (2) a table of filters ----------------------------------------------------------------------
def filter_dataset():
    return [
        submitted("ads", "job-1", 1000, "sub-1"),
        submitted("search", "job-10", 1100, "sub-10"),
        requested("ads", "job-1", "req-1", 1200, "req-1"),
        allocated("ads", "job-1", "req-1", ["m1", "m2"], 1300, "alloc-1"),
        rejected("search", "job-10", "req-10", 1400, "rej-10"),
        task_state("ads", "job-1/0", "m1", 1500, "ts-1-0"),
        task_state("ads", "job-1/1", "m2", 1600, "ts-1-1"),
        task_state("search", "job-10/0", "m10", 1700, "ts-10-0"),
        unavailable("ads", "ue-1", ["m2", "m3"], 1800, "ue-1"),
        stopped("ads", "job-1", 1900, "stop-1"),
        heartbeat("ads", "m1", 2000, "hb-m1"),
        assigned("ads", "m1", 2100, "assign-m1"),
    ]


ALL_IDS = {e.event_id for e in filter_dataset()}
FILTER_CASES = [
    ("all", ReplayFilter(), ALL_IDS),
    ("entitlement ads", ReplayFilter(entitlement="ads"),
     ALL_IDS - {"sub-10", "rej-10", "ts-10-0"}),
    ("entitlement search", ReplayFilter(entitlement="search"), {"sub-10", "rej-10", "ts-10-0"}),
    ("entitlement nobody", ReplayFilter(entitlement="nobody"), set()),
    ("job job-1", ReplayFilter(job="job-1"), {"sub-1", "req-1", "alloc-1", "ts-1-0", "ts-1-1", "stop-1"}),
    ("job job-10", ReplayFilter(job="job-10"), {"sub-10", "rej-10", "ts-10-0"}),
    ("machine m1", ReplayFilter(machine="m1"), {"alloc-1", "ts-1-0", "hb-m1", "assign-m1"}),
    ("machine m2", ReplayFilter(machine="m2"), {"alloc-1", "ts-1-1", "ue-1"}),
    ("machine m10", ReplayFilter(machine="m10"), {"ts-10-0"}),
    ("window [1300, 1600)", ReplayFilter(since_ms=1300, until_ms=1600), {"alloc-1", "rej-10", "ts-1-0"}),
    ("since 2000", ReplayFilter(since_ms=2000), {"hb-m1", "assign-m1"}),
    ("until 1100", ReplayFilter(until_ms=1100), {"sub-1"}),
    ("topic tasks", ReplayFilter(topics=("tasks",)), {"ts-1-0", "ts-1-1", "ts-10-0"}),
    ("topics intents+heartbeats", ReplayFilter(topics=("intents", "heartbeats")),
     {"sub-1", "sub-10", "stop-1", "hb-m1"}),
    ("job-1 on allocations", ReplayFilter(job="job-1", topics=("allocations",)), {"req-1", "alloc-1"}),
    ("ads, m1, since 1400", ReplayFilter(entitlement="ads", machine="m1", since_ms=1400),
     {"ts-1-0", "hb-m1", "assign-m1"}),
]


@pytest.fixture(scope="module")
def filter_cfg(infra_cfg, registry):
    c = fresh_cfg(infra_cfg)
    # The data set's log times are of 1970 (as if imported); heartbeats keep HEARTBEAT_RETENTION_MS, so the broker's
    # retention check (every 5 min) could delete this module's heartbeat between producing and reading it (seen
    # once, under load): this module's heartbeats topic keeps its records.
    admin = AdminClient({**c.kafka_conf()})
    hb = ConfigResource(ConfigResource.Type.TOPIC, Topics(c.topic_prefix, c.partitions).name("heartbeats"),
                        incremental_configs=[ConfigEntry("retention.ms", "-1",
                                                         incremental_operation=AlterConfigOpType.SET)])
    for fut in admin.incremental_alter_configs([hb]).values():
        fut.result(timeout=15)
    produce(c, registry, filter_dataset(), log_time_is_event_time=True)
    return c


@pytest.mark.parametrize("name,flt,expected", FILTER_CASES, ids=[c[0] for c in FILTER_CASES])
def test_replay_filters(filter_cfg, registry, name, flt, expected):
    run = replay(filter_cfg, registry, flt)
    got = [r.event.event_id for r in run]
    assert len(got) == len(set(got))
    assert set(got) == expected
    assert run.stats.matched == len(expected) and run.stats.skipped == 0


def test_replay_from_start_offsets(filter_cfg, registry):
    tasks = Topics(filter_cfg.topic_prefix, filter_cfg.partitions).name("tasks")
    part = partition_for("ads", filter_cfg.partitions)
    run = replay(filter_cfg, registry, ReplayFilter(topics=("tasks",)), start_offsets={(tasks, part): 1})
    assert [r.event.event_id for r in run if r.partition == part] == ["ts-1-1"]  # ads's first task event skipped


def test_replay_seeks_by_log_time(cfg, registry):
    """since/until skip, by Kafka's offsets-for-times, the records whose log time is more than the slack outside
    the window: they are not read at all (stats.not_read), and what is read gives the same answer as a full
    scan filtered on the envelope times."""
    hour, t0 = 3_600_000, 1_790_000_000_000
    events = [task_state("ads", f"job-{h}/{i}", "m1", t0 + h * hour + i, f"h{h}-{i}") for h in range(4) for i in range(25)]
    produce(cfg, registry, events, log_time_is_event_time=True)
    full = {r.event.event_id for r in replay(cfg, registry, ReplayFilter(topics=("tasks",)))}
    assert len(full) == 100
    for since_h, until_h, unread in ((1, None, 25), (None, 2, 25), (1, 3, 25), (3, None, 75), (None, None, 0)):
        flt = ReplayFilter(topics=("tasks",), since_ms=None if since_h is None else t0 + since_h * hour,
                           until_ms=None if until_h is None else t0 + until_h * hour)
        run = replay(cfg, registry, flt)
        got = {r.event.event_id for r in run}
        assert got == {e.event_id for e in events if matches(flt, e)}
        assert run.stats.not_read == unread and run.stats.read == 100 - unread, (since_h, until_h, run.stats)
    # within the slack nothing is skipped: an event sent a minute after its envelope time is still found
    late = task_state("ads", "late/0", "m1", t0 + 3 * hour - 60_000, "late")
    assert 60_000 < LOG_TIME_SLACK_MS
    p = EventProducer(cfg, registry, "test")
    p.send(late, log_timestamp_ms=t0 + 3 * hour)
    p.flush()
    got = [r.event.event_id for r in replay(cfg, registry, ReplayFilter(topics=("tasks",), until_ms=t0 + 3 * hour))]
    assert "late" in got


# --- (3) termination while producers keep writing -----------------------------------------------
def test_replay_ends_while_producers_write(cfg, registry):
    before = [task_state(ENTITLEMENTS[i % 5], f"job-{i}/0", f"m{i % 9}") for i in range(300)]
    before += [submitted(ENTITLEMENTS[i % 5], f"job-{i}") for i in range(100)]
    produce(cfg, registry, before)

    stop, writing = threading.Event(), threading.Event()
    written = []

    def writer():  # keeps writing to the same topics until told to stop (at most 15 s)
        p = EventProducer(cfg, registry, "writer")
        deadline = time.monotonic() + 15
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            for _ in range(50):
                p.send(task_state(ENTITLEMENTS[i % 5], f"live-{i}/0", "m1"))
                i += 1
            p.flush()
            written.append(i)
            writing.set()
            time.sleep(0.01)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        assert writing.wait(10)
        t0 = time.monotonic()
        run = replay(cfg, registry)
        got = list(run)
        elapsed = time.monotonic() - t0
        writer_alive = t.is_alive()
    finally:
        stop.set()
        t.join(20)
    assert writer_alive, f"the replay took {elapsed:.1f}s: it only ended because the writer stopped"
    ids = {r.event.event_id for r in got}
    assert {e.event_id for e in before} <= ids
    assert offsets_increase(got)
    assert all(r.offset < run.ends[(r.topic, r.partition)] for r in got)
    # The log grew past the ends while the replay ran (every topic read starts at offset 0 here).
    assert len(before) + written[-1] > sum(run.ends.values()) >= len(before)


# --- (4) undecodable records are skipped and counted --------------------------------------------
class Collect:
    """A dead-letter sink that keeps what it is given."""

    def __init__(self):
        self.routed = []

    def route(self, **kw):
        self.routed.append(kw)


@pytest.mark.parametrize("flt,sink", [
    (ReplayFilter(), None),
    (ReplayFilter(entitlement="ads"), None),  # narrowed: the garbage shares the key, so it is examined
    (ReplayFilter(topics=("intents",)), Collect()),
], ids=["all", "entitlement", "forwarded"])
def test_undecodable_records_are_skipped(cfg, registry, flt, sink):
    first = [submitted("ads", f"job-{i}") for i in range(3)]
    after = [stopped("ads", f"job-{i}") for i in range(3)]
    p = produce(cfg, registry, first)
    intents = Topics(cfg.topic_prefix, cfg.partitions).name("intents")
    good = registry.encode("JobStopped", stopped("ads", "x").to_record(1))
    p.send_raw(intents, b"ads", b"garbage, not avro")  # no C3 01 marker
    p.send_raw(intents, b"ads", good[:-3])  # right header, truncated body
    for e in after:
        p.send(e)
    p.flush()

    run = replay(cfg, registry, flt, dead_letters=sink)
    got = [r.event.event_id for r in run]
    assert got == [e.event_id for e in first + after]
    assert run.stats.skipped == 2
    assert run.stats.skipped_by_reason == {NO_MARKER: 1, MALFORMED: 1}
    if sink is not None:
        assert [kw["reason"] for kw in sink.routed] == [NO_MARKER, MALFORMED]
        assert {kw["topic"] for kw in sink.routed} == {intents}


# --- (5) murmur2 agrees with confluent-kafka's murmur2_random ------------------------------------
def test_murmur2_java_vectors():
    # From Kafka's UtilsTest (the Java client's own test of Utils.murmur2).
    cases = {"21": -973932308, "foobar": -790332482, "a-little-bit-long-string": -985981536,
             "a-little-bit-longer-string": -1486304829,
             "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971, "abc": 479470107}
    assert {k: murmur2(k.encode()) for k in cases} == cases


def keys_200(seed=11):
    rng = random.Random(seed)
    keys = [e.encode() for e in ENTITLEMENTS] + [b"", b"a", b"ab", b"abc", "entitl\u00e9ment".encode()]
    while len(keys) < 200:
        keys.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 41))))
    return keys


@pytest.mark.parametrize("partitions", [4, 7])
def test_partitioner_agrees_with_confluent_kafka(cfg, partitions):
    topic = f"{cfg.topic_prefix}murmur{partitions}"
    admin = AdminClient({**cfg.kafka_conf()})  # kept alive until the result is in
    admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=15)[topic].result()
    landed: dict[bytes, int] = {}

    def on_delivery(err, msg):
        assert err is None, err
        landed[msg.key()] = msg.partition()

    producer = Producer(producer_conf(cfg))  # the producers' own configuration: murmur2_random
    keys = keys_200()
    for key in keys:
        producer.produce(topic, key=key, value=b"v", on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert len(landed) == len(set(keys)) == 200
    assert len(set(landed.values())) == partitions  # the keys spread over every partition
    wrong = {k: (p, partition_for(k, partitions)) for k, p in landed.items() if partition_for(k, partitions) != p}
    assert not wrong
