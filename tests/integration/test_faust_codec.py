"""The faust side of the log, on the real embedded broker and Redis (no mocks):

* a faust agent reading a topic where valid events are interleaved with bad records processes every valid
  event, routes every bad one to `deadletter` with its reason and origin, and keeps running;
* the faust codec and the confluent tools write byte-identical records and read each other's;
* faust/aiokafka and the confluent producers put a key on the same partition (co-partitioning).

The faust app runs in-process (`app.start()` inside `asyncio.run`), with group timeouts lowered so a group
forms and moves in seconds.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import io
import time

import pytest
import redis.asyncio as aioredis
from confluent_kafka import Consumer, Producer, TopicPartition
from faust.serializers import codecs as faust_codecs
from fastavro import schemaless_writer

from streams import schemalog
from streams.clients import EventConsumer, EventProducer, producer_conf
from streams.codec import EventCodec, register_codec
from streams.deadletter import DeadLetters
from streams.events import new_event
from streams.faustwire import FetchBatches, decoded, make_app, source_topic
from streams.serde import (INVALID_EVENT, MALFORMED, MARKER, NO_MARKER, UNKNOWN_FINGERPRINT, DecodeError,
                           SchemaRegistry, build_schema)
from streams.topics import Topics

# Fast group timing for tests (see streams.faustwire.app_settings for the production values).
FAST = {"broker_session_timeout": 2.0, "broker_heartbeat_interval": 0.5, "broker_rebalance_timeout": 2.0,
        "broker_commit_interval": 0.5}


def job_stopped(ent: str, job: str, producer: str = "test"):
    return new_event("JobStopped", {"job_id": job, "reason": "r"}, entitlement=ent, entity_id=job,
                     producer=producer)


async def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


class RawProducer:
    """A confluent producer (Ropewalk's producer settings) that remembers where each record landed."""

    def __init__(self, cfg):
        self._producer = Producer(producer_conf(cfg))
        self.landed: dict[str, tuple[str, int, int]] = {}  # label -> (topic, partition, offset)
        self.errors: list[str] = []

    def send(self, label: str, topic: str, key: bytes | None, value: bytes | None) -> None:
        def on_delivery(err, msg):
            if err is not None:
                self.errors.append(f"{label}: {err}")
            else:
                self.landed[label] = (msg.topic(), msg.partition(), msg.offset())
        self._producer.produce(topic, key=key, value=value, on_delivery=on_delivery)

    def flush(self) -> None:
        assert self._producer.flush(15) == 0 and not self.errors, self.errors


def read_dead_letters(cfg, registry, n: int, timeout_s: float = 20.0):
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    consumer = EventConsumer(cfg, registry, [catalogue.name("deadletter")], name="test-reader")
    try:
        out, deadline = [], time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < deadline:
            out += consumer.poll(500, 0.3)
        return out
    finally:
        consumer.close()


# -- (a) a faust agent survives bad records and dead-letters them ------------------------------------------

@pytest.mark.timeout(120)
def test_agent_processes_valid_events_and_dead_letters_bad_ones(cfg, registry):  # noqa: C901
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    intents = catalogue.name("intents")
    raw = RawProducer(cfg)

    def encode(event):
        schema = registry.reader(event.type)
        return registry.encode(event.type, event.to_record(schema.version))

    def valid(i: int):
        ev = job_stopped(f"e{i % 7}", f"j{i}")
        raw.send(f"valid/{i}", intents, ev.entitlement.encode(), encode(ev))
        return ev

    good = encode(job_stopped("e1", "truncated"))
    unknown_fp = bytearray(good)
    unknown_fp[2:10] = b"\xde\xad\xbe\xef\x00\x11\x22\x33"
    wrong_topic = new_event("HostProfileApplied", {"machine_id": "m1", "host_profile": "web",
                                                   "previous_host_profile": None},
                            entitlement="e2", entity_id="m1", producer="test")
    bad = {  # label -> (key, value, expected reason)
        "garbage": (b"e3", b"this is not avro at all", NO_MARKER),
        "truncated": (b"e1", good[: len(good) - 5], MALFORMED),
        "unknown_fingerprint": (b"e4", bytes(unknown_fp), UNKNOWN_FINGERPRINT),
        "wrong_topic": (b"e2", encode(wrong_topic), INVALID_EVENT),
        "key_mismatch": (b"e6", encode(job_stopped("e5", "jx")), INVALID_EVENT),
    }
    expected_ids = []
    i = 0
    for label, (key, value, _) in bad.items():  # valid, bad, valid, valid, bad, ...
        for _ in range(3):
            expected_ids.append(valid(i).event_id)
            i += 1
        raw.send(label, intents, key, value)
    for _ in range(3):
        expected_ids.append(valid(i).event_id)
        i += 1
    raw.flush()

    processed_key = f"{cfg.topic_prefix}faust-codec:processed"
    dead_letter_producer = EventProducer(cfg, registry, "test-faust")
    dead_letters = DeadLetters(dead_letter_producer, "recorder")

    async def scenario():
        r = aioredis.from_url(cfg.redis_url, **cfg.redis_auth())
        app = make_app(cfg, "faust-codec-test", **FAST)
        starts = []

        @app.agent(source_topic(app, cfg, "intents"))
        async def recorder(stream):
            starts.append(time.monotonic())
            async for record, event in decoded(stream, registry, dead_letters, catalogue, cfg=cfg):
                assert record.event is event and record.topic == intents
                await r.rpush(processed_key, f"{record.partition}:{record.offset}:{event.event_id}")

        async def processed():
            return [v.decode().split(":") for v in await r.lrange(processed_key, 0, -1)]

        await app.start()
        try:
            rows = await wait_until(lambda: _at_least(processed, len(expected_ids)), 60, "the valid events")
            # The agent survived the bad records: one start, no crash, and a later event is processed.
            late = job_stopped("e1", "late")
            raw.send("late", intents, b"e1", encode(late))
            raw.flush()
            rows = await wait_until(lambda: _at_least(processed, len(expected_ids) + 1), 30, "the late event")
            assert len(starts) == 1, "the agent was restarted"
            assert app.crash_reason is None
            return rows, late
        finally:
            await app.stop()
            await r.delete(processed_key)
            await r.aclose()

    rows, late = asyncio.run(asyncio.wait_for(scenario(), 100))

    # Every valid event exactly once (no restart, so no redelivery), in log order per partition.
    ids = [event_id for _, _, event_id in rows]
    assert sorted(ids) == sorted(expected_ids + [late.event_id])
    for label, (topic, partition, offset) in raw.landed.items():
        if label.startswith("valid/") or label == "late":
            assert [str(partition), str(offset)] in [row[:2] for row in rows], label
    by_partition: dict[str, list[int]] = {}
    for partition, offset, _ in rows:
        by_partition.setdefault(partition, []).append(int(offset))
    assert all(offsets == sorted(offsets) for offsets in by_partition.values())

    # Every bad record is on deadletter, once, with its reason, origin and bytes.
    letters = read_dead_letters(cfg, registry, len(bad))
    assert len(letters) == len(bad), [r.event.payload for r in letters]
    got = {(r.event.payload["origin_topic"], r.event.payload["origin_partition"],
            r.event.payload["origin_offset"]): r.event.payload for r in letters}
    for label, (key, value, reason) in bad.items():
        payload = got[raw.landed[label]]
        assert payload["reason"] == reason, (label, payload["detail"])
        assert payload["payload"] == value and payload["origin_key"] == key
        assert payload["consumer"] == "recorder"
    assert "does not belong on topic" in got[raw.landed["wrong_topic"]]["detail"]
    assert "differs from the event's" in got[raw.landed["key_mismatch"]]["detail"]


async def _at_least(fetch, n):
    rows = await fetch()
    return rows if len(rows) >= n else None


# -- FetchBatches: whole fetches; a batch is what queued; a lone record comes alone -----------------------------

@pytest.mark.timeout(120)
def test_fetch_batches_hand_over_what_queued_while_busy_and_a_lone_record_alone(cfg, registry):  # noqa: C901
    """The consumer hands a batched topic's records over as whole fetches (``faustwire.FetchBatches``), not through
    faust's per-record delivery: a shard busy with its first batch finds the 300 records that arrived meanwhile in a
    few large batches, a lone record later is handed over on its own, every record is handed over once, in log order
    per partition, and committed only once acked after its batch was handled; a topic of the same app that is not
    batched (``other``) still reaches its agent's stream record by record."""
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    intents = catalogue.name("intents")
    other = catalogue.name("taskcontrol")
    raw = RawProducer(cfg)

    def send(label: str, ent: str, topic: str = intents) -> None:
        ev = job_stopped(ent, label)
        raw.send(label, topic, ent.encode(), registry.encode(ev.type, ev.to_record(1)))

    async def scenario():
        app = make_app(cfg, "fetch-batches-test", **FAST)
        fetches = app.fetch_batches = FetchBatches([intents])
        batches: list[list[tuple[int, int]]] = []
        others: list[int] = []
        busy, release = asyncio.Event(), asyncio.Event()

        @app.agent(source_topic(app, cfg, "intents"))
        async def shard(stream):  # noqa: ARG001 - its records come as whole fetches
            while True:
                batch = await fetches.take(500, 0.001, 0.02)
                batches.append([(m.partition, m.offset) for m in batch])
                if len(batches) == 1:  # busy with the first batch while the burst arrives
                    busy.set()
                    await release.wait()
                for m in batch:
                    app.consumer.ack(m)

        @app.agent(source_topic(app, cfg, "taskcontrol"))
        async def plain(stream):
            async for event in stream.events():
                others.append(event.message.offset)

        await app.start()
        try:
            send("first", "e1")
            send("other", "e1", other)
            raw.flush()
            await wait_until(lambda: _true(busy.is_set()), 60, "the first batch")
            for i in range(300):
                send(f"burst/{i}", f"e{i % 7}")
            raw.flush()
            # The shard stays busy until the whole burst is on the broker, and 1 s more for faust to fetch it.
            await asyncio.sleep(1.0)
            release.set()
            await wait_until(lambda: _true(sum(map(len, batches)) >= 301), 30, "the burst")
            burst_batches = len(batches) - 1
            await asyncio.sleep(0.5)
            send("lone", "e3")
            raw.flush()
            await wait_until(lambda: _true(sum(map(len, batches)) >= 302), 30, "the lone record")
            await wait_until(lambda: _true(bool(others)), 30, "the record of the topic not batched")
            return batches, burst_batches
        finally:
            await app.stop()

    batches, burst_batches = asyncio.run(asyncio.wait_for(scenario(), 100))
    assert burst_batches <= 5, [len(b) for b in batches]  # what queued while the shard was busy: few batches
    assert batches[-1] == [raw.landed["lone"][1:]]  # the lone record, on its own
    seen = [pos for b in batches for pos in b]
    assert sorted(seen) == sorted(pos[1:] for label, pos in raw.landed.items() if label != "other")  # each once
    for part in {p for p, _ in seen}:
        offsets = [o for p, o in seen if p == part]
        assert offsets == sorted(offsets)
    group = Consumer({**cfg.kafka_conf(), "group.id": f"{cfg.topic_prefix}fetch-batches-test"})
    deadline = time.monotonic() + 10  # faust commits every broker_commit_interval (0.5 s here)
    ends = {p: max(o for q, o in seen if q == p) + 1 for p, _ in seen}
    while True:
        committed = group.committed([TopicPartition(intents, p) for p in range(cfg.partitions)], timeout=10)
        got = {tp.partition: tp.offset for tp in committed if tp.partition in ends}
        if got == ends or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    group.close()
    assert got == ends  # acked once handled


@pytest.mark.timeout(150)
def test_fetch_batches_a_revocation_drops_what_was_fetched_before_it(cfg, registry):
    """A rebalance while whole fetches wait on ``FetchBatches`` and a batch is in the reader's hands (#28): the waiting
    fetches are dropped at the revocation, not handed out after it, and the batch in hand is no longer ``current``
    (the shard decides and acks none of it: its partitions may be another shard's now). The partitions kept read the
    records again from the committed offsets, so after the rebalance every record is handed over exactly once: none
    lost, none twice (before the fix the waiting fetches came after the rebalance and again after faust's seek)."""
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    intents = catalogue.name("intents")
    raw = RawProducer(cfg)

    def send(label: str, ent: str) -> None:
        ev = job_stopped(ent, label)
        raw.send(label, intents, ent.encode(), registry.encode(ev.type, ev.to_record(1)))

    async def scenario():
        app = make_app(cfg, "fetch-batches-revoke-test", **FAST)
        fetches = app.fetch_batches = FetchBatches([intents])
        taken: list[tuple[int, list[tuple[int, int]]]] = []  # (rebalances before it was taken, its positions)
        in_hand: dict[str, bool] = {}
        busy, release = asyncio.Event(), asyncio.Event()

        @app.agent(source_topic(app, cfg, "intents"))
        async def shard(stream):  # noqa: ARG001 - its records come as whole fetches
            while True:
                batch = await fetches.take(500, 0.001, 0.02)
                taken.append((app.rebalancing_count, [(m.partition, m.offset) for m in batch]))
                if len(taken) == 1:  # in the reader's hands while the rest queues and the rebalance comes
                    busy.set()
                    await release.wait()
                    in_hand["current"] = fetches.current(batch)
                if fetches.current(batch):
                    for m in batch:
                        app.consumer.ack(m)

        def queued() -> int:
            return sum(len(f) for f in list(fetches.queue._queue))

        await app.start()
        try:
            send("first", "e1")
            raw.flush()
            await wait_until(lambda: _true(busy.is_set()), 60, "the first batch")
            for i in range(200):
                send(f"burst/{i}", f"e{i % 7}")
            raw.flush()
            await wait_until(lambda: _true(queued() >= 200), 30, "the burst queued as whole fetches")
            rebalances = app.rebalancing_count
            thread = app.consumer._thread
            coordinator = thread._ensure_consumer()._coordinator
            thread.thread_loop.call_soon_threadsafe(coordinator.request_rejoin)  # a real rebalance of the group
            await wait_until(lambda: _true(app.rebalancing_count > rebalances and not app.rebalancing), 60,
                             "the rebalance")
            dropped_at_revocation = fetches.dropped
            release.set()
            await wait_until(lambda: _true(sum(len(b) for n, b in taken if n > rebalances) >= 201), 60,
                             "every record again after the rebalance")
            await asyncio.sleep(1.0)  # nothing more may come: a record handed over twice would come now
            return taken, rebalances, in_hand, dropped_at_revocation, queued()
        finally:
            await app.stop()

    taken, rebalances, in_hand, dropped, left = asyncio.run(asyncio.wait_for(scenario(), 130))
    assert in_hand == {"current": False}  # the batch in hand at the revocation: not to be decided nor acked
    assert dropped >= 200 and left == 0  # the burst's fetches were dropped, not handed out after the rebalance
    after = sorted(pos for n, b in taken if n > rebalances for pos in b)
    assert after == sorted(pos[1:] for pos in raw.landed.values())  # each record once after the rebalance


async def _true(value: bool):
    return value


# -- (b) the faust codec and the serde are one encoding ----------------------------------------------------

def test_codec_round_trip_is_byte_identical_with_the_serde(registry):
    register_codec(registry)
    codec = faust_codecs.get_codec("ropewalk")
    assert isinstance(codec, EventCodec)
    register_codec(registry)  # idempotent: the same codec object stays registered
    assert faust_codecs.get_codec("ropewalk") is codec
    with pytest.raises(ValueError):
        register_codec(registry, name="json")  # never replaces a codec that is not ours

    event = job_stopped("e1", "j1")
    version = registry.reader("JobStopped").version
    serde_bytes = registry.encode("JobStopped", event.to_record(version))
    faust_bytes = faust_codecs.dumps("ropewalk", event)
    assert faust_bytes == serde_bytes  # what EventProducer writes, byte for byte

    name, record = registry.decode(faust_bytes)
    assert name == "JobStopped" and record == event.to_record(version)
    assert faust_codecs.loads("ropewalk", serde_bytes) == dataclasses.replace(event, schema_version=version)

    # Chained codecs keep the registry (faust's clone passes the constructor's keyword arguments).
    chained = codec | faust_codecs.get_codec("binary")
    assert chained.loads(chained.dumps(event)) == faust_codecs.loads("ropewalk", serde_bytes)

    with pytest.raises(DecodeError) as err:
        codec.loads(faust_bytes[:-3])
    assert err.value.reason == MALFORMED
    with pytest.raises(DecodeError) as err:
        codec.loads(b"{}")
    assert err.value.reason == NO_MARKER


def test_codec_learns_an_unknown_writer_schema_from_the_log(cfg, registry):
    """A newer writer (an extra field with a default) is resolved after reading `_schemas`, once."""
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    raw = copy.deepcopy(dict(registry.reader("JobStopped").raw))
    raw["fields"] = list(raw["fields"]) + [{"name": "operator", "type": "string", "default": "nobody"}]
    raw["ropewalk.version"] = 2
    newer = build_schema(raw, None)
    producer = Producer(producer_conf(cfg))
    schemalog.publish(producer, catalogue, newer)
    assert producer.flush(10) == 0

    record = job_stopped("e1", "j9").to_record(2)
    record["operator"] = "alice"
    buf = io.BytesIO()
    buf.write(MARKER + newer.fingerprint)
    schemaless_writer(buf, newer.parsed, record)

    without_log = EventCodec(registry=SchemaRegistry.from_dir())
    with pytest.raises(DecodeError) as err:
        without_log.loads(buf.getvalue())
    assert err.value.reason == UNKNOWN_FINGERPRINT

    with_log = EventCodec(registry=SchemaRegistry.from_dir(), cfg=cfg)
    event = with_log.loads(buf.getvalue())
    assert event.entity_id == "j9" and event.schema_version == 2 and "operator" not in event.payload

    unknown = bytearray(buf.getvalue())
    unknown[2:10] = b"\x00" * 8
    with pytest.raises(DecodeError) as err:
        with_log.loads(bytes(unknown))
    assert err.value.reason == UNKNOWN_FINGERPRINT


# -- (c) faust/aiokafka and confluent agree on partitions --------------------------------------------------

@pytest.mark.timeout(120)
def test_faust_and_confluent_producers_put_a_key_on_the_same_partition(cfg, registry):
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    keys = [f"ent-{i:03d}" for i in range(100)]

    confluent = EventProducer(cfg, registry, "confluent")
    for key in keys:
        confluent.send(job_stopped(key, f"c-{key}", producer="confluent"))
    confluent.flush()

    async def send_with_faust():
        register_codec(registry, cfg=cfg)
        app = make_app(cfg, "faust-partitioner-test", **FAST)
        topic = app.topic(catalogue.name("intents"), key_serializer="raw", value_serializer="ropewalk")
        try:
            futures = [await topic.send(key=key.encode(), value=job_stopped(key, f"f-{key}", producer="faust"))
                       for key in keys]
            await app.producer.flush()
            return [(await fut).partition for fut in futures]
        finally:
            await app.producer.stop()  # the app itself never started: sending started only its producer

    faust_partitions = asyncio.run(asyncio.wait_for(send_with_faust(), 60))

    # Read everything back with the confluent consumer: faust's records decode with the serde too.
    consumer = EventConsumer(cfg, registry, [catalogue.name("intents")], name="test-reader")
    try:
        records, deadline = [], time.monotonic() + 20
        while len(records) < 2 * len(keys) and time.monotonic() < deadline:
            records += consumer.poll(1000, 0.3)
    finally:
        consumer.close()
    assert len(records) == 2 * len(keys) and consumer.dead_lettered == 0
    where: dict[str, dict[str, int]] = {}
    for rec in records:
        where.setdefault(rec.event.entitlement, {})[rec.event.producer] = rec.partition
    assert {k: p for k, p in zip(keys, faust_partitions)} == {k: where[k]["faust"] for k in keys}
    disagree = [k for k in keys if where[k]["faust"] != where[k]["confluent"]]
    assert not disagree, f"{len(disagree)} keys on different partitions, e.g. {disagree[:5]}"
    assert len({where[k]["faust"] for k in keys}) == cfg.partitions  # the keys really do spread
