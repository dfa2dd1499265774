"""Provisioning on the real broker: topics are created with the catalogue's config (retention), and provisioning
again changes nothing."""
from __future__ import annotations

import uuid

from confluent_kafka.admin import AdminClient, ConfigResource

from streams.topics import CATALOGUE, Topics, provision


def test_provision_creates_topics_with_the_catalogue_config_and_is_idempotent(infra_cfg):
    admin = AdminClient({**infra_cfg.kafka_conf()})
    topics = Topics(f"cfg{uuid.uuid4().hex[:8]}.", infra_cfg.partitions)
    first = provision(admin, topics)
    assert first["created"] == sorted(topics.all())
    again = provision(admin, topics)
    assert again["created"] == [] and again["topics"] == first["topics"]

    resources = [ConfigResource(ConfigResource.Type.TOPIC, topics.name(t.name)) for t in CATALOGUE]
    described = {r.name: fut.result(timeout=15) for r, fut in admin.describe_configs(resources).items()}
    for spec in CATALOGUE:
        entries = described[topics.name(spec.name)]
        for key, value in spec.config.items():
            assert key in entries and entries[key].value == value, (spec.name, key, entries.get(key))
