"""Requests a reader makes of one partition's leader, asked again while that leader moves.

On a cluster of several brokers (``ropewalk up --brokers 3``, or an external cluster) a broker that dies takes its
partitions' leadership with it until the controller fences it and elects new leaders from the in-sync replicas
(``broker.session.timeout.ms``, 9 s by default) or until it is back. Meanwhile a ListOffsets to it fails at once:
librdkafka drops the handle of a broker the metadata no longer lists (``_DESTROY_BROKER``: "Broker handle destroyed
without termination"), or the connection is refused (``_TRANSPORT``), or the broker that answers is no longer the
leader (``NOT_LEADER_FOR_PARTITION``). These are asked again (``transient``) until the leader answers, for
``FAILOVER_S`` at most: a user's `job submit` (whose front end reads the jobs' state first), `ropewalk status`, a
worker's catch-up ride through a broker's death instead of failing with it. With one broker there is no leader to
move to: the error is raised at once, as it always was.
"""
from __future__ import annotations

import time

from confluent_kafka import KafkaError, KafkaException, TopicPartition

FAILOVER_S = 30.0  # a broker's death to its partitions' new leaders: ~9 s fencing, more on a loaded machine
BACKOFF_S = 0.2
TRANSIENT = frozenset({
    KafkaError._DESTROY_BROKER, KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.REQUEST_TIMED_OUT, KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.OFFSET_NOT_AVAILABLE,
    # the client's own metadata lost the partition while its leader's node was stopped (a storm's SIGSTOPped broker:
    # "Failed to get watermark offsets: Local: Unknown partition"); a partition that does not exist answers
    # UNKNOWN_TOPIC_OR_PART from the broker, which is a refusal
    KafkaError._UNKNOWN_PARTITION,
})


def transient(err: KafkaError | None) -> bool:
    """Whether a client error is one a leader's move explains (asked again), not a refusal. Pure."""
    return err is not None and (err.code() in TRANSIENT or bool(err.retriable()))


def watermark_offsets(consumer, tp: TopicPartition, timeout_s: float = 10.0,
                      failover_s: float = FAILOVER_S) -> tuple[int, int]:
    """``consumer.get_watermark_offsets(tp)`` (low, high), asked again for ``failover_s`` while the error is
    ``transient`` and the cluster has another broker; each ask waits ``timeout_s`` at most. A refusal
    (authorization), an error on a cluster of one broker, or a transient error that outlasts ``failover_s`` is raised
    as the client raised it."""
    deadline = time.monotonic() + failover_s
    while True:
        try:
            return consumer.get_watermark_offsets(tp, timeout=timeout_s)
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if not transient(err) or time.monotonic() + BACKOFF_S > deadline or not several_brokers(consumer):
                raise
        time.sleep(BACKOFF_S)


def several_brokers(client, timeout_s: float = 5.0) -> bool:
    """Whether the cluster lists more than one broker (one whose leaders could move to another); False when it does
    not answer."""
    try:
        return len(client.list_topics(timeout=timeout_s).brokers) > 1
    except KafkaException:
        return False
