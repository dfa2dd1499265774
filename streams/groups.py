"""Consumer groups and their committed offsets: where each processor resumes.

    committed(cfg, group)                 -> {(topic, partition): next offset to read}
    lag(cfg, group, topics)               -> records on ``topics`` the group has not committed yet
    groups(cfg)                           -> the group ids under the configured topic prefix
    owners(cfg, group, topic)             -> {partition of topic: the member of the group it is assigned to}
    set_committed(cfg, group, offsets)    -> commit offsets for a group that has no live member

The faust processors (scheduler shards, allocator) keep their position in the log as the committed offsets of
their consumer group (group id = topic prefix + app id, streams/faustwire.py); the broker keeps them in
``__consumer_offsets`` (the embedded broker never expires them: infra/broker.py). ``archive`` saves them and
``restore`` sets them again, so restored processors resume where the archived ones were (streams/archive.py).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from confluent_kafka import Consumer, ConsumerGroupState, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from infra.config import Config
from streams.retry import watermark_offsets

TIMEOUT_S = 15.0
# Errors of a group's coordinator that a moment cures (a broker that just started loads __consumer_offsets).
COORDINATOR_MOVING = frozenset({KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
                                KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._TIMED_OUT,
                                KafkaError._TRANSPORT})


def _admin(cfg: Config) -> AdminClient:
    return AdminClient({**cfg.kafka_conf(), "log_level": 3})


def groups(cfg: Config, admin: AdminClient | None = None) -> list[str]:
    """Every consumer group whose id starts with the topic prefix (all groups when the prefix is empty)."""
    admin = admin or _admin(cfg)
    listed = admin.list_consumer_groups(request_timeout=TIMEOUT_S).result()
    return sorted(g.group_id for g in listed.valid if g.group_id.startswith(cfg.topic_prefix))


def app_group(cfg: Config, app_id: str) -> str:
    """The consumer group of the faust app ``app_id`` (its id, prefixed like the topics: streams/faustwire.py)."""
    return cfg.topic_prefix + app_id


def owners(cfg: Config, group: str, topic: str, timeout_s: float = 2.0,
           admin: AdminClient | None = None) -> dict[int, str]:
    """Which member of ``group`` each partition of ``topic`` is assigned to now: partition -> member id, as the
    group's coordinator answers DescribeGroups. Empty unless the group is STABLE (during a rebalance the members'
    assignments are being replaced; an empty group has none). Raises (KafkaException, a timeout) when the broker
    does not answer within ``timeout_s``.

    The scheduler shards' group (faust's assignor, protocol type ``consumer``) sends each member a standard
    ConsumerProtocolMemberAssignment, faust's own data in its user data, which librdkafka parses: a shard's
    entitlement partitions are its partitions of a source topic (``intents``); its changelog topics list every
    partition (faust's standbys), so they tell nothing."""
    admin = admin or _admin(cfg)
    found = admin.describe_consumer_groups([group], request_timeout=timeout_s)[group].result(timeout=timeout_s + 1)
    if found.state != ConsumerGroupState.STABLE:
        return {}
    return {tp.partition: m.member_id for m in found.members if m.assignment is not None
            for tp in m.assignment.topic_partitions if tp.topic == topic}


# The offsets are read and written through a Consumer carrying the group id, which never joins the group
# (no subscribe): librdkafka 2.16's AdminClient.list_consumer_group_offsets crashed the process (SIGSEGV in
# rd_kafka_cgrp_op, from rd_kafka_handle_OffsetFetch) when asked right after the broker's first start.
def _group_consumer(cfg: Config, group: str) -> Consumer:
    return Consumer({**cfg.kafka_conf(), "group.id": group, "enable.auto.commit": False,
                     "log_level": 3})


def committed(cfg: Config, group: str, topics: Iterable[str]) -> dict[tuple[str, int], int]:
    """The group's committed offsets (next offset to read) on ``topics``, per (topic, partition); partitions
    without a committed offset (or topics that do not exist) are left out."""
    c = _group_consumer(cfg, group)
    try:
        return _committed(c, _partitions(c, topics))
    finally:
        c.close()


def lag(cfg: Config, group: str, topics: Iterable[str]) -> int:
    """How many records of ``topics`` lie beyond the group's committed offsets (a partition the group never
    committed counts whole, from its low watermark). One consumer, one metadata request."""
    c = _group_consumer(cfg, group)
    try:
        tps = _partitions(c, topics)
        done = _committed(c, tps)
        behind = 0
        for tp in tps:
            low, high = watermark_offsets(c, tp, TIMEOUT_S)
            behind += max(0, high - max(low, done.get((tp.topic, tp.partition), low)))
        return behind
    finally:
        c.close()


def _partitions(c: Consumer, topics: Iterable[str]) -> list[TopicPartition]:
    """Every partition of ``topics`` that exists."""
    md = c.list_topics(timeout=TIMEOUT_S)
    return [TopicPartition(t, p) for t in topics if (tmd := md.topics.get(t)) is not None and tmd.error is None
            for p in sorted(tmd.partitions)]


def _committed(c: Consumer, tps: list[TopicPartition]) -> dict[tuple[str, int], int]:
    if not tps:
        return {}
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            got = c.committed(tps, timeout=TIMEOUT_S)
            break
        except KafkaException as exc:  # the group's coordinator moving or loading (a broker just started)
            err = exc.args[0] if exc.args else None
            if getattr(err, "code", lambda: None)() not in COORDINATOR_MOVING or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    return {(tp.topic, tp.partition): tp.offset for tp in got if tp.offset >= 0}


def set_committed(cfg: Config, group: str, offsets: Mapping[tuple[str, int], int]) -> None:
    """Commit ``offsets`` for ``group``. The broker refuses while the group has live members (a running
    processor): stop it first. Raises KafkaException with the broker's reason."""
    if not offsets:
        return
    c = _group_consumer(cfg, group)
    try:
        done = c.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items())],
                        asynchronous=False)
        failed = [f"{tp.topic}[{tp.partition}]: {tp.error}" for tp in done or () if tp.error is not None]
        if failed:
            raise KafkaException(f"{len(failed)} offsets not committed: {'; '.join(failed[:3])}")
    finally:
        c.close()
