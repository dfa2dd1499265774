"""The region at a moment: the nearest snapshot before it, then a fold of the log's tail (``Region``), writing a
snapshot every ``snapshots.SNAPSHOT_EVERY`` records it folds on the way (so the next look near there is fast).

    region, stats = region_at(cfg, registry, moment_ms)
    fold_log(cfg, registry)          # ``ropewalk history snapshot``: fold to the log's end, snapshots on the way

A moment is given as ms since epoch, an ISO-8601 time, ``now`` or ``now-DURATION`` (``now-90s``, ``now-15m``), or
a record's position ``TOPIC/PARTITION@OFFSET`` (the moment that record was written: its envelope time).
"""
from __future__ import annotations

import os
import time
from typing import Any

from infra.config import Config
from processors.history import reader, snapshots
from processors.history.region import LOOKAHEAD_MS, Region
from processors.taskcontrol.limiter import Limits
from processors.times import MAX_MOMENT_CHARS, duration_ms, parse_time
from streams.clients import EventConsumer
from streams.deadletter import Skipped
from streams.events import MAX_TIME_MS
from streams.partitionmap import read_map
from streams.serde import SchemaRegistry
from streams.topics import TopicError, Topics


class MomentError(ValueError):
    pass


LOOKAHEAD_ENV = "ROPEWALK_HISTORY_LOOKAHEAD_MS"  # region.LOOKAHEAD_MS unless set (tests of short logs lower it)


FOLD_TOPICS = frozenset({"intents", "machines", "unavailability", "allocations"})  # the allocator's (fold.py)


def new_region(cfg: Config, scheduler_partitions: frozenset[int] | None = None) -> Region:
    """An empty region under the running configuration (the scheduler's limits from the environment, as the shard
    reads them); ``scheduler_partitions``: see ``Region``."""
    lookahead = int(os.environ.get(LOOKAHEAD_ENV) or LOOKAHEAD_MS)
    return Region(Topics(cfg.topic_prefix, cfg.partitions), limits=Limits.from_env(os.environ),
                  max_tasks=cfg.max_tasks_per_job, lookahead_ms=lookahead, scheduler_partitions=scheduler_partitions,
                  gc_ms=int(cfg.job_gc_s * 1000))


def partitions_of(cfg: Config, entitlements) -> frozenset[int]:
    """The partitions of these entitlements' jobs (the scheduler's for ``job status --at``): every one each lived on
    (its hash partition, and where the partition map placed and moved it)."""
    pmap = read_map(cfg)
    return frozenset(p for e in entitlements for p in pmap.partitions_ever(e))


def fold(cfg: Config, registry: SchemaRegistry, region: Region, moment_ms: int | None, *,
         verify: dict | None = None, skipped: Skipped | None = None, write_every: int | None = snapshots.SNAPSHOT_EVERY,
         stats: dict[str, Any] | None = None) -> Region:
    """Read the log from ``region``'s positions and advance it to ``moment_ms`` (None: the log's end), writing a
    snapshot each ``write_every`` records read or ``snapshots.SNAPSHOT_WORK_S`` of folding (None: none; a partial
    region writes none, and reads only the allocator's topics and its partitions of the scheduler's)."""
    stats = {} if stats is None else stats
    since_snapshot, last = 0, time.monotonic()
    lookahead = region.lookahead_ms
    parts = region.scheduler_partitions
    if parts is not None:
        write_every = None
    only = None if parts is None else (lambda topic, partition: topic in FOLD_TOPICS or partition in parts)
    stream = reader.merged(cfg, registry, region.positions, verify=verify, skipped=skipped, stats=stats, only=only)
    try:
        for ev, pos in stream:
            region.read(ev, pos)
            since_snapshot += 1
            if moment_ms is not None and ev.timestamp_ms > moment_ms + lookahead:
                break
            if write_every and region.read_to is not None and (since_snapshot >= write_every or (
                    since_snapshot % 500 == 0 and time.monotonic() - last >= snapshots.SNAPSHOT_WORK_S)):
                if _snapshot(cfg, registry, region, region.read_to - lookahead, moment_ms, stats):
                    since_snapshot, last = 0, time.monotonic()
    finally:
        stream.close()
    if moment_ms is None:  # the log's end: a last snapshot where the look-ahead still holds
        if write_every and region.read_to is not None:
            _snapshot(cfg, registry, region, region.read_to - lookahead, None, stats)
        moment_ms = region.read_to if region.read_to is not None else 0
    region.advance(moment_ms)
    return region


def _snapshot(cfg: Config, registry: SchemaRegistry, region: Region, cut: int, moment_ms: int | None,
              stats: dict[str, Any]) -> bool:
    """Advance to ``cut`` and write a snapshot there (a delta from the region's last one, but every
    ``FULL_EVERY``-th whole), if that applies something new and stays before the moment."""
    if (region.cut is not None and cut <= region.cut) or (moment_ms is not None and cut >= moment_ms):
        return False
    before = region.applied
    region.advance(cut)
    if region.applied == before:
        return False
    snapshots.write(cfg, region, registry, full=False)
    stats["snapshots_written"] = stats.get("snapshots_written", 0) + 1
    return True


def region_at(cfg: Config, registry: SchemaRegistry, moment_ms: int, *, skipped: Skipped | None = None,
              write_every: int | None = snapshots.SNAPSHOT_EVERY, scheduler_partitions: frozenset[int] | None = None
              ) -> tuple[Region, dict[str, Any]]:
    """The region at ``moment_ms``: from the newest usable snapshot at or before it (one made under other
    conditions is passed over; one whose log was replaced is deleted), else from the beginning.
    ``scheduler_partitions``: decide only these partitions' jobs (``machine list``: none; ``job status``: the
    job's) -- a partial region, much cheaper; see ``Region``."""
    t0 = time.monotonic()
    stats: dict[str, Any] = {"moment_ms": moment_ms, "snapshot": None, "set_aside": []}
    for snap in [*snapshots.latest_before(cfg, moment_ms), None]:
        region = new_region(cfg, scheduler_partitions)
        verify = None
        if snap is not None:
            why = snapshots.usable(snap, region)
            if why is not None:
                stats["set_aside"].append(why)
                continue
            try:
                verify = snapshots.load(snap, region, registry)
            except Exception as exc:  # noqa: BLE001 - a broken cache file (truncated, garbage) is passed over
                stats["set_aside"].append(f"{snap.path.name}: {type(exc).__name__}: {exc}")
                continue
        stats["snapshot"] = None if snap is None else snap.path.name
        stats["loaded_s"] = round(time.monotonic() - t0, 3)
        try:
            fold(cfg, registry, region, moment_ms, verify=verify, skipped=skipped, write_every=write_every,
                 stats=stats)
        except reader.LogChanged as exc:
            if snap is None:  # (only a snapshot's positions are verified: from the beginning nothing is)
                raise
            stats["set_aside"].append(f"{snap.path.name}: {exc}")
            snapshots.discard(snap)
            continue
        stats.update(applied=region.applied, seconds=round(time.monotonic() - t0, 3))
        stats["set_aside"] = stats["set_aside"][:3] + ([f"... {len(stats['set_aside']) - 3} more"]
                                                        if len(stats["set_aside"]) > 3 else [])
        return region, stats
    raise AssertionError("unreachable: the last attempt folds from the beginning")


def fold_log(cfg: Config, registry: SchemaRegistry, *, skipped: Skipped | None = None,
             write_every: int = snapshots.SNAPSHOT_EVERY) -> tuple[Region, dict[str, Any]]:
    """Fold the whole log from the newest snapshot to its end, writing snapshots on the way and one at the end."""
    t0 = time.monotonic()
    newest = snapshots.listing(cfg)
    stats: dict[str, Any] = {"snapshot": None}
    if newest:
        region, stats = region_at(cfg, registry, newest[-1].cut, skipped=skipped, write_every=None)
    else:
        region = new_region(cfg)
    fold(cfg, registry, region, None, skipped=skipped, write_every=write_every, stats=stats)
    stats.update(applied=region.applied, seconds=round(time.monotonic() - t0, 3))
    return region, stats


# -- moments ---------------------------------------------------------------------------------------------------
def parse_moment(value: str, now_ms: int, record_time=None) -> int:
    """ms since epoch, ISO-8601 (UTC unless it says), ``now[-DURATION]``, or ``TOPIC/PARTITION@OFFSET``
    (``record_time(topic, partition, offset)`` gives that record's envelope time); between the epoch and
    ``events.MAX_TIME_MS``."""
    if len(value) > MAX_MOMENT_CHARS:
        raise MomentError(f"bad moment: at most {MAX_MOMENT_CHARS} characters, got {len(value)}")
    ms = _moment(value, now_ms, record_time)
    if not 0 <= ms <= MAX_TIME_MS:
        raise MomentError(f"bad moment {value!r}: before 1970 or after 9999")
    return ms


def _moment(value: str, now_ms: int, record_time=None) -> int:
    v = value.strip()
    if v == "now":
        return now_ms
    if v.startswith("now-"):
        try:
            return now_ms - duration_ms(v[4:])
        except ValueError:
            raise MomentError(f"bad moment {value!r}: the duration is seconds, or 500ms, 90s, 15m, 2h") from None
    if "@" in v:
        where, _, offset = v.rpartition("@")
        topic, _, partition = where.rpartition("/")
        if not (partition.isdigit() and offset.isdigit() and topic):
            raise MomentError(f"bad position {value!r}: use TOPIC/PARTITION@OFFSET, e.g. tasks/3@120")
        if record_time is None:
            raise MomentError("a position needs the log")
        return record_time(topic, int(partition), int(offset))
    try:
        ms = parse_time(v)
    except ValueError:  # the times' own error, said again with every form a moment takes
        raise MomentError(f"bad moment {value!r}: use ms since epoch, ISO-8601 (2026-11-22T10:00:00Z), now, "
                          f"now-DURATION (now-15m) or TOPIC/PARTITION@OFFSET (tasks/3@120)") from None
    assert ms is not None  # (None only for None)
    return ms


def record_time(cfg: Config, registry: SchemaRegistry, topic: str, partition: int, offset: int) -> int:
    """The envelope time of the record at ``topic``/``partition``@``offset`` (a logical topic name)."""
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    try:
        physical = topics.name(topic)
    except TopicError as exc:
        raise MomentError(f"bad position {topic}/{partition}@{offset}: {exc}") from None
    if not 0 <= partition < (n := topics.partitions_of(topic)):
        raise MomentError(f"bad position {topic}/{partition}@{offset}: {topic} has partitions 0..{n - 1}")
    consumer = EventConsumer(cfg, registry, [physical], name="history-moment")
    try:
        consumer.assign({(physical, partition): offset}, only=[(physical, partition)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for rec in consumer.poll(1, 0.5):
                if rec.partition == partition and rec.offset == offset:
                    return rec.event.timestamp_ms
                if rec.partition == partition and rec.offset > offset:
                    break
            if (physical, partition) in consumer.eof:
                break
    finally:
        consumer.close()
    raise MomentError(f"no readable record at {topic}/{partition}@{offset}")
