"""The log on the real embedded broker: every event round-trips, schemas evolve through the _schemas
topic both ways, and bad records land in `deadletter` with a reason while the records around them are
processed."""
import copy
import dataclasses
import io
import json
import time

import pytest
from confluent_kafka.admin import AdminClient
from fastavro import schemaless_writer

from streams import schemalog, serde
from streams.clients import DeliveryError, EventConsumer, EventProducer, key_of, producer_conf
from streams.deadletter import DeadLetters
from streams.events import new_event
from streams.serde import MARKER, SchemaRegistry, build_schema
from streams.topics import CATALOGUE, TOPIC_OF_EVENT, TopicError, Topics, provision


def read_all(consumer, n, timeout_s=20.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += consumer.poll(500, 0.3)
    return out


def job_stopped(ent, job, reason="r"):
    return new_event("JobStopped", {"job_id": job, "reason": reason}, entitlement=ent, entity_id=job, producer="test")


@pytest.mark.parametrize("how", ["send", "send_all"])
def test_every_event_type_round_trips_through_the_broker(cfg, registry, make_sample, how):
    producer = EventProducer(cfg, registry, "test")
    sent = {}
    for name in registry.event_names:
        record = make_sample(copy.deepcopy(dict(registry.reader(name).raw)))
        env = record["envelope"]
        payload = {k: v for k, v in record.items() if k != "envelope"}
        # Every optional filled (causation_id too), so each field's value has to survive the trip.
        ev = new_event(name, payload, entitlement=env["entitlement"], entity_id=env["entity_id"], producer="test",
                       causation_id=env["causation_id"], timestamp_ms=env["timestamp_ms"])
        if how == "send":
            producer.send(ev)
        sent[ev.event_id] = ev
    if how == "send_all":  # encoded first, then produced: the same records
        producer.send_all(list(sent.values()))
    producer.flush()
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    c = EventConsumer(cfg, registry, topics.data_topics(), name="test")
    got = {r.event.event_id: r for r in read_all(c, len(sent))}
    c.close()
    assert set(got) == set(sent) and c.dead_lettered == 0
    for eid, ev in sent.items():
        rec = got[eid]
        assert ev.causation_id is not None and ev.payload  # the sample really filled them
        # The whole event, envelope and payload; the producer stamps the schema's version.
        assert rec.event == dataclasses.replace(ev, schema_version=1)
        logical = topics.logical(rec.topic)
        assert logical == TOPIC_OF_EVENT[ev.type]
        assert rec.key == key_of(logical, ev).encode()


def _v2_registry():
    base = SchemaRegistry.from_dir()
    raw = copy.deepcopy(dict(base.reader("JobStopped").raw))
    raw["fields"].append({"name": "stopped_by", "type": "string", "default": "cli", "doc": "who stopped it"})
    raw["ropewalk.version"] = 2
    return SchemaRegistry({**{n: base.reader(n) for n in base.event_names}, "JobStopped": build_schema(raw, None)})


@pytest.mark.parametrize("writer_version,reader_version", [(2, 1), (1, 2)])
def test_schema_evolution_through_the_schemas_topic(cfg, writer_version, reader_version):
    writer = _v2_registry() if writer_version == 2 else SchemaRegistry.from_dir()
    reader = _v2_registry() if reader_version == 2 else SchemaRegistry.from_dir()
    payload = {"job_id": "j1", "reason": "done"}
    if writer_version == 2:
        payload["stopped_by"] = "ops"
    p = EventProducer(cfg, writer, "writer")
    p.send(new_event("JobStopped", payload, entitlement="e1", entity_id="j1", producer="writer"))
    p.flush()
    # The reader's registry knows only its own version; it learns the writer's from _schemas.
    assert reader.writer(writer.reader("JobStopped").fingerprint) is None
    c = EventConsumer(cfg, reader, [Topics(cfg.topic_prefix).name("intents")], name="reader")
    [rec] = read_all(c, 1)
    c.close()
    expected = {"job_id": "j1", "reason": "done"}
    if reader_version == 2:
        expected["stopped_by"] = "ops" if writer_version == 2 else "cli"  # the reader's default fills in
    assert rec.event.payload == expected
    assert rec.event.schema_version == writer_version


def _raw_body(raw_schema, record):
    buf = io.BytesIO()
    schemaless_writer(buf, build_schema(raw_schema, None).parsed, record)
    return buf.getvalue()


def bad_records(registry, cfg):
    """(case, key, value, expected reason) for the dead-letter table; also publishes writer schemas."""
    good = registry.encode("JobStopped", job_stopped("e1", "j0").to_record(1))
    js = copy.deepcopy(dict(registry.reader("JobStopped").raw))
    env = job_stopped("e1", "x").to_record(1)["envelope"]
    # A writer schema that lacks a required field (job_id, no default in the reader).
    missing = copy.deepcopy(js)
    missing["fields"] = [f for f in missing["fields"] if f["name"] != "job_id"]
    missing_schema = build_schema(missing, None)
    # A writer schema whose field has the wrong type (job_id: int).
    wrong = copy.deepcopy(js)
    next(f for f in wrong["fields"] if f["name"] == "job_id")["type"] = "int"
    wrong_schema = build_schema(wrong, None)
    p = EventProducer(cfg, registry, "test")
    for s in (missing_schema, wrong_schema):
        schemalog.publish(p._producer, Topics(cfg.topic_prefix), s)
    p.flush()
    wrong_topic = registry.encode("TaskControlAcked", {
        "envelope": env, "job_id": "j", "sequence": 1, "approved_operation_ids": []})
    return [
        ("malformed bytes", b"e1", b"\x00garbage\xff"),
        ("empty value", b"e1", b""),
        ("unknown fingerprint", b"e1", MARKER + b"\x11" * 8 + good[10:]),
        ("truncated body", b"e1", good[:-5]),
        ("trailing bytes", b"e1", good + b"\x00\x01"),
        ("missing field", b"e1", MARKER + missing_schema.fingerprint + _raw_body(missing, {"envelope": env, "reason": "r"})),
        ("wrong type", b"e1", MARKER + wrong_schema.fingerprint + _raw_body(wrong, {"envelope": env, "job_id": 5, "reason": ""})),
        ("wrong type under our fingerprint", b"e1", good[:10] + _raw_body(wrong, {"envelope": env, "job_id": 5, "reason": ""})),
        ("key differs from envelope", b"e2", good),
        ("event on the wrong topic", b"e1", wrong_topic),
    ]


EXPECTED = {
    "malformed bytes": serde.NO_MARKER, "empty value": serde.NO_MARKER,
    "unknown fingerprint": serde.UNKNOWN_FINGERPRINT, "truncated body": serde.MALFORMED,
    "trailing bytes": serde.MALFORMED, "missing field": serde.INCOMPATIBLE_SCHEMA,
    "wrong type": serde.INCOMPATIBLE_SCHEMA, "wrong type under our fingerprint": serde.MALFORMED,
    "key differs from envelope": serde.INVALID_EVENT, "event on the wrong topic": serde.INVALID_EVENT,
}


def test_bad_records_go_to_deadletter_and_the_consumer_keeps_going(cfg, registry):
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    intents = topics.name("intents")
    p = EventProducer(cfg, registry, "test")
    cases = bad_records(registry, cfg)
    # All on entitlement e1's partition, each bad record between two valid ones.
    partition = None
    for i, (case, key, value) in enumerate(cases):
        p.send(job_stopped("e1", f"before-{i}"))
        p.flush()
        if partition is None:
            c0 = EventConsumer(cfg, registry, [intents], name="probe")
            partition = read_all(c0, 1)[0].partition
            c0.close()
        p.send_raw(intents, key, value, partition=partition)
    p.send(job_stopped("e1", "last"))
    p.flush()

    c = EventConsumer(cfg, registry, [intents], name="processor-under-test", dead_letters=DeadLetters(p, "processor-under-test"))
    good = read_all(c, len(cases) + 1)
    p.flush()
    assert [r.event.payload["job_id"] for r in good] == [f"before-{i}" for i in range(len(cases))] + ["last"]
    assert c.dead_lettered == len(cases)
    c.close()

    d = EventConsumer(cfg, registry, [topics.name("deadletter")], name="reader")
    dead = read_all(d, len(cases))
    d.close()
    assert len(dead) == len(cases)
    by_value = {r.event.payload["payload"]: r.event.payload for r in dead}
    for case, key, value in cases:
        dl = by_value[value]
        assert (case, dl["reason"]) == (case, EXPECTED[case])
        assert dl["origin_topic"] == intents and dl["origin_partition"] == partition
        assert dl["origin_key"] == key and dl["detail"] and dl["consumer"] == "processor-under-test"
    offsets = sorted(r.event.payload["origin_offset"] for r in dead)
    assert len(set(offsets)) == len(cases)


def test_a_reader_given_types_passes_over_the_others_undecoded(cfg, registry):
    """Every record says its type in a header; a reader given ``types`` decodes only those (a record without the
    header is decoded as always, and a bad one of a wanted type is still dead-lettered)."""
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    intents = topics.name("intents")
    p = EventProducer(cfg, registry, "test")
    p.send(job_stopped("e1", "wanted"))
    p.send(new_event("JobResized", {"job_id": "j", "tasks": 2}, entitlement="e1", entity_id="j", producer="test"))
    p.send_raw(intents, b"e1", b"\x00not avro", headers=[("type", b"JobResized")])  # passed over: not decoded
    p.send_raw(intents, b"e1", b"\x00not avro", headers=[("type", b"JobStopped")])  # wanted: dead-lettered
    p.send_raw(intents, b"e1", registry.encode("JobStopped", job_stopped("e1", "headerless").to_record(1)))
    p.flush()

    c = EventConsumer(cfg, registry, [intents], name="typed", types={"JobStopped"},
                      dead_letters=DeadLetters(p, "typed"))
    got = read_all(c, 2)
    c.close()
    assert [r.event.payload["job_id"] for r in got] == ["wanted", "headerless"]
    assert (c.passed_over, c.dead_lettered) == (2, 1)


def test_delivery_errors_are_raised_not_swallowed(cfg, registry):
    p = EventProducer(cfg, registry, "test", **{"message.timeout.ms": 2000})
    p.send_raw(cfg.topic_prefix + "no-such-topic-and-no-autocreate", b"k", b"v", partition=99)
    with pytest.raises(DeliveryError):
        p.flush(10)


def test_producer_is_idempotent_with_acks_all(cfg, registry):
    conf = producer_conf(cfg)
    assert (conf["enable.idempotence"], conf["acks"]) == (True, "all")
    # The broker's side of idempotence: it assigned this producer an id (librdkafka's statistics say so).
    stats = []
    p = EventProducer(cfg, registry, "test", **{"statistics.interval.ms": 100,
                                                 "stats_cb": lambda s: stats.append(json.loads(s))})
    p.send(job_stopped("e1", "j1"))
    p.flush()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (stats and stats[-1].get("eos", {}).get("idemp_state") == "Assigned"):
        p.flush(1)
        time.sleep(0.1)
    eos = stats[-1]["eos"] if stats else {}
    assert eos.get("idemp_state") == "Assigned" and eos["producer_id"] >= 0, eos


def test_provision_is_idempotent_and_checks_copartitioning(cfg):
    admin = AdminClient({**cfg.kafka_conf()})
    again = provision(admin, Topics(cfg.topic_prefix, cfg.partitions))
    assert again["created"] == [] and len(again["topics"]) == len(CATALOGUE) == 17  # with `keys` (issue 27)
    with pytest.raises(TopicError, match="co-partitioned"):
        provision(admin, Topics(cfg.topic_prefix, cfg.partitions * 2))


def test_a_poll_hands_out_a_bounded_number_of_bytes_and_the_rest_in_order_next(cfg, registry, monkeypatch):
    """A poll's records are decoded at once, and one record may hold a thousand machines: a poll hands out at most
    ``POLL_BYTES`` of values (at least one record), the rest first in the next polls, in order; a reader to the
    end (``read_to_end``: end-of-partition markers among what is held) still reads every record once."""
    from streams import clients  # noqa: PLC0415
    from streams.catchup import read_to_end  # noqa: PLC0415

    topic = Topics(cfg.topic_prefix, cfg.partitions).name("intents")
    p = EventProducer(cfg, registry, "test")
    jobs = [f"j{i:03d}" for i in range(60)]
    for job in jobs:
        p.send(job_stopped("e-bounded", job, reason="x" * 1000))  # one partition: their order is the log's
    p.flush()
    size = len(registry.encode("JobStopped", job_stopped("e-bounded", "j000", reason="x" * 1000).to_record(1)))
    monkeypatch.setattr(clients, "POLL_BYTES", 5 * size)

    c = EventConsumer(cfg, registry, [topic], name="bounded")
    polls: list[int] = []

    def handle(records):
        polls.append(len(records))
        seen.extend(r.event.payload["job_id"] for r in records if r.event.entitlement == "e-bounded")

    seen: list[str] = []
    try:
        n = read_to_end(c, handle)
    finally:
        c.close()
    assert seen == jobs and n >= len(jobs)
    assert max(polls) <= 5, polls  # 5 values' bytes a poll at most (at 6 the budget is passed)
