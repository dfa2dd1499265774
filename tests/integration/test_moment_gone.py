"""A look that needs a part of the log the broker deleted says the moment is gone (README "Retention"): the history
folds the kept topics from offset 0 (or a snapshot); a kept partition that no longer starts at 0 (records deleted by
hand: ``kafka-delete-records``, or a retention an operator set) cannot give back the region before it, and the
look fails with a line naming the partition and the way back (an archive), not with a silently different region."""
from __future__ import annotations

import time

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from processors.history import moments, reader
from streams.clients import EventProducer
from streams.events import new_event
from streams.partitioner import partition_for
from streams.topics import Topics


@pytest.mark.timeout(120)
def test_a_look_at_a_deleted_beginning_says_the_moment_is_gone(cfg, registry):
    p = EventProducer(cfg, registry, "test")
    for name in ("e1", "e1"):
        p.send(new_event("EntitlementCreated", {"name": name, "quota_machines": 2, "machine_type": None,
                                                "dc_pin": None, "host_profile": None},
                         entitlement=name, entity_id=name, producer="test"))
    p.flush()
    now = int(time.time() * 1000)
    region, _ = moments.region_at(cfg, registry, now)  # the whole log is there: the look works
    assert region.applied >= 2
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("intents")
    part = partition_for("e1", cfg.partitions)
    admin = AdminClient({**cfg.kafka_conf()})
    for fut in admin.delete_records([TopicPartition(topic, part, 1)]).values():
        fut.result(timeout=30)
    with pytest.raises(reader.MomentGone) as gone:
        moments.region_at(cfg, registry, now + 1)
    assert f"{topic}[{part}] begins at offset 1" in str(gone.value) and "restore" in str(gone.value)
