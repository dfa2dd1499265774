"""Catching up: read a consumer's partitions up to where they ended when the read started, while producers go on
writing (``read_to_end``). The catch-up of every log follower (the Resource Broker, the Health Check, the
followers of processors/follower.py, the Ops Planner's CLI)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from streams.clients import EventConsumer, Record

POLL_S = 0.2
POLL_MAX = 10000
CATCH_UP_TIMEOUT_S = 120.0


class CatchUpTimeout(RuntimeError):
    """Catching up stalled: some partition made no progress towards its end for the timeout (broker away)."""


class CatchUpStopped(RuntimeError):
    """The reader was told to stop (SIGTERM: ``ropewalk down``) before it caught up: what it folded is partial, so
    nothing may be decided from it (``processors.worker.LoopWorker.begin`` closes the worker instead)."""


def read_to_end(consumer: EventConsumer, on_records: Callable[[list[Record]], None], *,  # noqa: C901
                partitions: Iterable[tuple[str, int]] | None = None,
                timeout_s: float = CATCH_UP_TIMEOUT_S, stop: Callable[[], bool] | None = None) -> int:
    """Poll ``consumer`` until every one of ``partitions`` (default: all it reads) has been read up to where it
    ended when the call started; hand each batch to ``on_records`` (records beyond that end, and records of
    other partitions, included: the consumer goes on following from there). Returns the records handed over.

    ``consumer`` must be freshly assigned (not polled yet), as both callers' are. The end of a partition is
    fixed the first time it is known: the high watermark of the first fetch response for it (at or beyond the
    end the partition had when the call started, as watermarks only grow), or its start if ListOffsets shows
    it empty (the ListOffsets high watermark is kept as a lower bound). A partition is finished when a record at or beyond
    ``end - 1`` has been read, or it reported end-of-partition (only ever done at a fetch's high watermark).
    So catching up terminates while producers keep writing (a region registering, heartbeats flowing).

    ``timeout_s`` bounds a stall, not the whole read: ``CatchUpTimeout`` is raised when no unfinished
    partition has advanced (no record read or dead-lettered on it, none finished) for ``timeout_s``. A big
    topic that takes longer to fold but keeps moving does not time out.

    ``stop`` (a worker's stop flag: ``LoopWorker.stopping``) is asked before every poll: when it says so,
    ``CatchUpStopped`` is raised, one poll (``POLL_S``) and one batch's fold at most after the request, however long
    the log is."""
    want = list(partitions if partitions is not None else consumer.partitions())
    listed = consumer.watermarks()
    floor: dict[tuple[str, int], int] = {}  # ListOffsets high watermark: a lower bound of the end
    ends: dict[tuple[str, int], int] = {}  # fixed once known
    pending: set[tuple[str, int]] = set()
    for tp in want:
        low, high = listed.get(tp, (0, 0))
        floor[tp] = high
        if tp in listed and high <= low:
            ends[tp] = low  # empty when the read started: finished
        else:
            pending.add(tp)
    next_offset: dict[tuple[str, int], int] = {}

    def finished(tp: tuple[str, int]) -> bool:
        if tp in consumer.eof:
            return True
        end = ends.get(tp)
        if end is None:
            high = consumer.fetched_high_watermark(tp)
            if high is None:
                return False  # no fetch response yet
            end = ends[tp] = max(high, floor[tp])
        return next_offset.get(tp, -1) >= end

    n = 0
    dead_lettered = consumer.dead_lettered
    last_progress = time.monotonic()
    while pending:
        if stop is not None and stop():
            raise CatchUpStopped(f"{consumer.name}: stopped while catching up, after {n} records")
        records = consumer.poll(POLL_MAX, POLL_S)
        progressed = consumer.dead_lettered != dead_lettered
        dead_lettered = consumer.dead_lettered
        if records:
            n += len(records)
            on_records(records)
            for r in records:
                tp = (r.topic, r.partition)
                if tp in pending:
                    next_offset[tp] = max(next_offset.get(tp, -1), r.offset + 1)
                    progressed = True
        done = {tp for tp in pending if finished(tp)}
        pending -= done
        if progressed or done:
            last_progress = time.monotonic()
        elif pending and time.monotonic() - last_progress > timeout_s:
            left = ", ".join(f"{t}[{p}]@{next_offset.get((t, p), '-')}/{ends.get((t, p), '?')}"
                             for t, p in sorted(pending))
            raise CatchUpTimeout(f"{consumer.name}: no progress for {timeout_s:.0f}s; unfinished: {left}")
    return n
