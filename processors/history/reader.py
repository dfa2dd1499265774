"""The log as the history reads it: every partition of the region's topics, merged in ``fold.merged`` order,
streamed.

``merged(cfg, registry, start)`` reads every partition of ``region.SOURCES`` from ``start`` (per partition; the
beginning otherwise) up to its end as of the call (the high watermark then: a read ends while producers write)
and yields ``(event, (topic, partition, offset))`` in the order ``fold.merged`` gives: by envelope time, then by
rank within one millisecond, equal keys in (topic, partition) order. It is a streaming k-way merge: a record is
yielded once every unfinished partition has a record buffered (the next one of an empty partition could come
first); a partition that runs more than ``BUFFER`` records ahead is paused until the others catch up, so memory
stays bounded whatever the log's size.

``verify`` maps a partition to the event id the record just before its start must have (a snapshot's last
applied record): that record is read first and checked, not yielded; a different one (the log was replaced since
the snapshot) raises ``LogChanged``. A record the reader cannot decode is skipped and counted in ``skipped``.
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterator, Mapping

from infra.config import Config
from processors.allocator.fold import order_key
from processors.history.region import SOURCES, Position
from streams.clients import EventConsumer
from streams.deadletter import Skipped
from streams.events import Event
from streams.serde import SchemaRegistry
from streams.topics import Topics

BUFFER = 20_000  # records buffered per partition before it is paused
POLL_RECORDS = 5_000
STALL_S = 30.0  # no record for this long while partitions are unfinished: the broker is away


class LogChanged(RuntimeError):
    """The record a snapshot ended at is not on the log any more: the log is not the one the snapshot was made of."""


class ReadStalled(RuntimeError):
    pass


def watermarks(cfg: Config, partitions: list[tuple[str, int]], timeout_s: float = 10.0
               ) -> dict[tuple[str, int], tuple[int, int]]:
    """(low, high) of every partition, two ListOffsets requests for all (a consumer asks per partition)."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient({"bootstrap.servers": cfg.bootstrap_servers, "log_level": 0})
    out: dict[tuple[str, int], list[int]] = {tp: [0, 0] for tp in partitions}
    for i, spec in enumerate((OffsetSpec.earliest(), OffsetSpec.latest())):
        futures = admin.list_offsets({TopicPartition(t, p): spec for t, p in partitions}, request_timeout=timeout_s)
        for tp, fut in futures.items():
            out[(tp.topic, tp.partition)][i] = fut.result().offset
    return {tp: (lo, hi) for tp, (lo, hi) in out.items()}


def merged(cfg: Config, registry: SchemaRegistry, start: Mapping[tuple[str, int], int] | None = None, *,
           verify: Mapping[tuple[str, int], str] | None = None, skipped: Skipped | None = None,
           stats: dict | None = None) -> Iterator[tuple[Event, Position]]:
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    names = [topics.name(t) for t in SOURCES]
    rank = {n: i for i, n in enumerate(names)}
    start = dict(start or {})
    verify = dict(verify or {})
    consumer = EventConsumer(cfg, registry, names, name="history", skipped=skipped)
    try:
        marks = watermarks(cfg, consumer.partitions())
        first: dict[tuple[str, int], int] = {}
        ends: dict[tuple[str, int], int] = {}
        for tp, (low, high) in marks.items():
            at = max(low, start.get(tp, low))
            if tp in verify:
                if at - 1 < low or at > high:
                    raise LogChanged(f"{tp[0]}[{tp[1]}]: offset {at - 1} is not on the log (it holds {low}..{high - 1})")
                at -= 1
            first[tp], ends[tp] = at, high
        consumer.assign(first)
        buffers: dict[tuple[str, int], deque] = {tp: deque() for tp in marks}
        done = {tp for tp in marks if first[tp] >= ends[tp]}
        consumer.pause(done)
        paused: set[tuple[str, int]] = set(done)
        heads: list = []  # (order key, topic rank, partition, offset, event)
        read = 0
        last_progress = time.monotonic()

        def read_more() -> None:
            nonlocal read, last_progress
            records = consumer.poll(POLL_RECORDS, 0.1)
            for rec in records:
                tp = (rec.topic, rec.partition)
                if rec.offset >= ends[tp] or tp in done:
                    continue
                expected = verify.pop(tp, None)
                if expected is not None:
                    if rec.offset != first[tp] or rec.event.event_id != expected:
                        raise LogChanged(f"{tp[0]}[{tp[1]}]@{rec.offset}: event {rec.event.event_id}, the snapshot "
                                         f"ended at {expected}")
                    continue
                was_empty = not buffers[tp]
                buffers[tp].append((order_key(rec.event), rec.event, rec.offset))
                if was_empty:
                    k, ev, off = buffers[tp][0]
                    heapq.heappush(heads, (k, rank[tp[0]], tp[1], off, ev, tp))
                read += 1
            for tp, last in consumer.last_offsets.items():
                if tp not in done and last + 1 >= ends[tp]:
                    done.add(tp)
                    if tp in verify:  # the checked record itself was the last one: it must have been seen
                        raise LogChanged(f"{tp[0]}[{tp[1]}]: the record the snapshot ended at was not read")
            if records or any(consumer.last_offsets.get(tp, -1) >= first[tp] for tp in marks):
                last_progress = time.monotonic()
            for tp, buf in buffers.items():
                if tp in done:
                    continue
                if len(buf) >= BUFFER and tp not in paused:
                    consumer.pause([tp])
                    paused.add(tp)
                elif len(buf) < BUFFER // 2 and tp in paused:
                    consumer.resume([tp])
                    paused.discard(tp)

        while True:
            waiting = [tp for tp in marks if tp not in done and not buffers[tp]]
            if waiting:
                before = read
                read_more()
                if read == before and not any(tp in done for tp in waiting):
                    if time.monotonic() - last_progress > STALL_S:
                        raise ReadStalled(f"history: no records for {STALL_S:.0f}s; waiting for "
                                          + ", ".join(f"{t}[{p}]" for t, p in waiting[:5]))
                continue
            if not heads:
                break
            _, _, partition, offset, event, tp = heapq.heappop(heads)
            buf = buffers[tp]
            buf.popleft()
            if buf:
                k, ev, off = buf[0]
                heapq.heappush(heads, (k, rank[tp[0]], tp[1], off, ev, tp))
            yield event, (tp[0], partition, offset)
    finally:
        if stats is not None:
            stats["read"] = stats.get("read", 0) + read
        consumer.close()
