"""streams/groups.py on the real broker: a group's committed offsets, and its lag behind the log."""
from __future__ import annotations

from confluent_kafka import Producer

from streams import groups
from streams.topics import Topics


def test_lag_counts_what_lies_beyond_the_committed_offsets(cfg):
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("machines")
    p = Producer(cfg.kafka_conf())
    for i in range(5):
        p.produce(topic, value=b"x", partition=0)
    for i in range(3):
        p.produce(topic, value=b"y", partition=1)
    assert p.flush(15) == 0
    group = f"{cfg.topic_prefix}lag-test"
    assert groups.lag(cfg, group, [topic]) == 8  # never committed: every record counts
    groups.set_committed(cfg, group, {(topic, 0): 2, (topic, 1): 3})
    assert groups.committed(cfg, group, [topic]) == {(topic, 0): 2, (topic, 1): 3}
    assert groups.lag(cfg, group, [topic]) == 3
    assert groups.lag(cfg, group, [topic, f"{cfg.topic_prefix}no-such-topic"]) == 3  # a missing topic: none
