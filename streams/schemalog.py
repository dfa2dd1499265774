"""The `_schemas` topic: the log as its own schema registry.

Every producer publishes each schema it writes with (full JSON, keyed by fingerprint hex) before its first
event of that schema. A reader that meets an unknown fingerprint reads this topic to learn the writer's
schema and resolves the record against its own. No registry server; archives carry the topic along.
"""
from __future__ import annotations

import time

from confluent_kafka import Consumer, KafkaError, TopicPartition

from infra.acls import reader_group
from infra.config import Config
from streams.retry import watermark_offsets
from streams.serde import EventSchema, SchemaRegistry
from streams.topics import Topics

# A fingerprint that `_schemas` did not know is not looked up again for this long (per reader): producers
# publish a schema before its first record, so a miss is almost always a foreign or corrupt record, and
# re-reading `_schemas` for each of a burst of them would stall the reader.
RELOOKUP_S = 30.0


def publish(producer, topics: Topics, schema: EventSchema) -> None:
    """Produce `schema` to _schemas (asynchronously; the caller flushes). `producer` is confluent's."""
    producer.produce(topics.name("_schemas"), key=schema.fingerprint_hex.encode(), value=schema.to_json().encode())


def load(cfg: Config, registry: SchemaRegistry, only: bytes | None = None, timeout_s: float = 10.0) -> int:  # noqa: C901
    """Read _schemas up to its end and learn every schema. Returns how many were read."""
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("_schemas")
    c = Consumer({**cfg.kafka_conf(), "group.id": reader_group(cfg, "schemalog"),
                  "enable.auto.commit": False, "enable.partition.eof": True, "log_level": cfg.kafka_log_level})
    try:
        md = c.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if md is None or md.error is not None:
            return 0
        # Read to end-of-partition (reported at the high watermark of a fetch made now).
        live = set()
        for p in md.partitions:
            lo, hi = watermark_offsets(c, TopicPartition(topic, p), timeout_s)
            if hi > lo:
                live.add(p)
        if not live:
            return 0
        c.assign([TopicPartition(topic, p, 0) for p in live])
        seen = 0
        deadline = time.monotonic() + timeout_s
        while live and time.monotonic() < deadline:
            for m in c.consume(1000, 0.5):
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        live.discard(m.partition())
                    continue
                if only is None or m.key() == only.hex().encode():
                    try:
                        registry.learn(m.value().decode())
                        seen += 1
                    except Exception:  # noqa: BLE001 - a broken schema record cannot be used: its data
                        pass  # records will dead-letter
        return seen
    finally:
        c.close()
