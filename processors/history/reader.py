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
from collections.abc import Callable, Generator, Mapping

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from infra.config import Config
from processors.allocator.fold import order_key
from processors.history.region import SOURCES, Position
from streams.clients import EventConsumer
from streams.deadletter import Skipped
from streams.events import Event
from streams.serde import SchemaRegistry
from streams.topics import Topics

BUFFER = 2_000  # records buffered per partition before it is paused
POLL_RECORDS = 1_000
STALL_S = 30.0  # no record for this long while partitions are unfinished: the broker is away


class LogChanged(RuntimeError):
    """The record a snapshot ended at is not on the log any more: the log is not the one the snapshot was made of."""


class MomentGone(RuntimeError):
    """The log a look needs begins later than the look must read from: its older records were deleted (a topic's
    retention, processors/README's "Retention"; ``kafka-delete-records``). Nothing equal to the region then can be
    folded from the broker: an archive that holds them (``ropewalk archive``, ``restore``) can."""


class ReadStalled(RuntimeError):
    pass


class Once(Skipped):
    """A ``Skipped`` that counts each undecodable record once however many reads of one command meet it (a shadow
    reads the log up to its start and again from there): it passes each record's first meeting on to ``skipped``,
    which holds the counts (its own are not used)."""

    def __init__(self, skipped: Skipped | None):
        super().__init__()
        self.skipped = skipped if skipped is not None else Skipped()
        self.seen: set[tuple[str, int, int]] = set()

    def route(self, *, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
              reason: str, detail: str) -> None:
        if (topic, partition, offset) not in self.seen:
            self.seen.add((topic, partition, offset))
            self.skipped.route(topic=topic, partition=partition, offset=offset, key=key, value=value,
                               reason=reason, detail=detail)

    @property
    def count(self) -> int:
        return self.skipped.count

    def report(self) -> str | None:
        return self.skipped.report()


def watermarks(cfg: Config, partitions: list[tuple[str, int]], timeout_s: float = 10.0
               ) -> dict[tuple[str, int], tuple[int, int]]:
    """(low, high) of every partition, two ListOffsets requests for all (a consumer asks per partition)."""
    admin = AdminClient({**cfg.kafka_conf(), "log_level": 0})
    out: dict[tuple[str, int], list[int]] = {tp: [0, 0] for tp in partitions}
    for i, spec in enumerate((OffsetSpec.earliest(), OffsetSpec.latest())):
        futures = admin.list_offsets({TopicPartition(t, p): spec for t, p in partitions}, request_timeout=timeout_s)
        for tp, fut in futures.items():
            out[(tp.topic, tp.partition)][i] = fut.result().offset
    return {tp: (lo, hi) for tp, (lo, hi) in out.items()}


def merged(cfg: Config, registry: SchemaRegistry, start: Mapping[tuple[str, int], int] | None = None, *,  # noqa: C901
           verify: Mapping[tuple[str, int], str] | None = None, skipped: Skipped | None = None,
           stats: dict | None = None, only: Callable[[str, int], bool] | None = None
           ) -> Generator[tuple[Event, Position], None, None]:
    """See the module doc. ``only(logical topic, partition)``: read just the partitions it accepts."""
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    names = [topics.name(t) for t in SOURCES]
    rank = {n: i for i, n in enumerate(names)}
    start = dict(start or {})
    verify = dict(verify or {})
    consumer = EventConsumer(cfg, registry, names, name="history", skipped=skipped)
    try:
        wanted = [tp for tp in consumer.partitions() if only is None or only(topics.logical(tp[0]) or tp[0], tp[1])]
        marks = watermarks(cfg, wanted)
        first: dict[tuple[str, int], int] = {}
        ends: dict[tuple[str, int], int] = {}
        read = 0
        gone = sorted((tp, low) for tp, (low, high) in marks.items() if tp not in start and low > 0)
        if gone:  # from the beginning, where there is no beginning any more
            (topic, partition), low = gone[0]
            raise MomentGone(f"the log of {topic}[{partition}] begins at offset {low}: its older records were deleted "
                             f"({len(gone)} partitions so; retention, README \"Retention\"), so the region cannot be "
                             "folded from its beginning and no snapshot from before holds it; `ropewalk restore` an "
                             "archive (`ropewalk archive`) that holds them to look")
        for tp, (low, high) in marks.items():
            at = max(low, start.get(tp, low))
            if tp in verify:
                if at - 1 < low or at > high:
                    raise LogChanged(f"{tp[0]}[{tp[1]}]: offset {at - 1} is not on the log (it holds {low}..{high - 1})")
                at -= 1
            first[tp], ends[tp] = at, high
        consumer.assign(first, only=list(marks))
        verify = {tp: eid for tp, eid in verify.items() if tp in marks}
        buffers: dict[tuple[str, int], deque] = {tp: deque() for tp in marks}  # fetched, not decoded yet
        done = {tp for tp in marks if first[tp] >= ends[tp]}  # every record up to its end fetched
        next_off = dict(first)  # per partition, the offset of the next record this read takes
        consumer.pause(done)
        paused: set[tuple[str, int]] = set(done)
        heads: list = []  # the next record of each partition that has one decoded: (key, topic rank, partition,
        in_heap: set[tuple[str, int]] = set()  # offset, event, tp)
        read = 0
        last_progress = time.monotonic()

        def head(tp: tuple[str, int]) -> None:
            """Decode the partition's next record and put it in the merge: a record is decoded only when it is
            the next of its partition, so a read that stops at a moment decodes little past it."""
            buf = buffers[tp]
            while buf:
                rec = consumer.decode(buf.popleft())
                if rec is None:  # a type the history does not read, or undecodable (counted in ``skipped``)
                    continue
                expected = verify.pop(tp, None)
                if expected is not None:
                    if rec.offset != first[tp] or rec.event.event_id != expected:
                        raise LogChanged(f"{tp[0]}[{tp[1]}]@{rec.offset}: event {rec.event.event_id}, the snapshot "
                                         f"ended at {expected}")
                    continue
                heapq.heappush(heads, (order_key(rec.event), rank[tp[0]], tp[1], rec.offset, rec.event, tp))
                in_heap.add(tp)
                return

        def read_more() -> bool:
            nonlocal read, last_progress
            msgs = consumer.poll_raw(POLL_RECORDS, 0.1)
            for msg in msgs:
                tp = (msg.topic(), msg.partition())
                off = msg.offset()
                if tp not in next_off or off < next_off[tp] or off >= ends[tp]:
                    continue  # not this read's (the consumer's first assignment, from the beginning) or past the end
                next_off[tp] = off + 1
                buffers[tp].append(msg)
                read += 1
                if off + 1 >= ends[tp]:
                    done.add(tp)
            for tp, buf in buffers.items():
                if buf and tp not in in_heap:
                    head(tp)
                if tp in done:
                    continue
                if len(buf) >= BUFFER and tp not in paused:
                    consumer.pause([tp])
                    paused.add(tp)
                elif len(buf) < BUFFER // 2 and tp in paused:
                    consumer.resume([tp])
                    paused.discard(tp)
            if msgs:
                last_progress = time.monotonic()
            return bool(msgs)

        while True:
            waiting = [tp for tp in marks if tp not in done and tp not in in_heap]
            if waiting:
                if not read_more() and time.monotonic() - last_progress > STALL_S:
                    raise ReadStalled(f"history: no records for {STALL_S:.0f}s; waiting for "
                                      + ", ".join(f"{t}[{p}]" for t, p in waiting[:5]))
                continue
            if not heads:
                break
            _, _, partition, offset, event, tp = heapq.heappop(heads)
            in_heap.discard(tp)
            head(tp)
            yield event, (tp[0], partition, offset)
        for tp in verify:  # a partition whose checked record was never read
            raise LogChanged(f"{tp[0]}[{tp[1]}]: the record the snapshot ended at was not read")
    finally:
        if stats is not None:
            stats["read"] = stats.get("read", 0) + read
        consumer.close()
