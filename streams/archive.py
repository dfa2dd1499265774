"""Archive the log to disk and restore it into a broker: an audit export and a disaster-recovery path.

Format (a directory, one per region and topic prefix)::

    <dir>/manifest.json
    <dir>/<logical topic>/p<partition>/<first offset:020d>-<last offset:020d>.avro

Each segment is an Avro Object Container File (fastavro) whose records follow `LOG_RECORD_SCHEMA`
(`ropewalk.archive.LogRecord`): logical topic, partition, the record's real offset (offsets on a broker need
not be contiguous), timestamp and its type, and the key, value and headers exactly as the broker holds them.
Values are stored RAW, not decoded: Avro single-object encoded events, the `_schemas` JSON and undecodable
garbage alike are kept byte for byte. The container header carries `ropewalk.*` metadata (prefix, topic,
partition, first offset). `manifest.json` holds, per topic: the partition count and per partition the next
offset to archive, the segments (first, last, count) and any gaps (offsets that left the broker before they
were archived); plus the topic prefix archived, times and totals.

Guarantees:

* Incremental: a run archives, per partition, from the manifest's next offset up to the high watermark
  captured when the run started (so it terminates), into one new segment per partition.
* Atomic and resumable: a segment is written to a temp name, fsynced and renamed; the manifest is rewritten
  (temp + rename) after each partition's segment is complete, and only then. A run stopped early
  (`max_records`) or killed leaves complete segments plus a manifest that lists exactly them; stray temp files
  and segments the manifest does not list (a crash between the two renames) are removed by the next run,
  which re-archives those records. So re-running gives no gaps and no duplicates. One run at a time per
  directory (a lock file enforces it).
* What is archived: every catalogue topic, and the changelog topics of the faust processors' tables (topics
  under the prefix named ``*-changelog``: the scheduler shards' state). And the **committed offsets of every
  consumer group** under the prefix (the faust processors' positions), captured at the start of each run,
  *before* the ends of the partitions are: the archive then always holds every record a group has consumed,
  and a restored processor resumes where the archived one was (re-reading what it read after its last
  commit, which processing tolerates: at-least-once, idempotent).
* Restore republishes into empty topics (provisioned with the archive's partition counts; changelogs created
  compacted as faust would) under the target configuration's prefix: `_schemas` first, then every partition's
  records in offset order to the SAME partition number, with key, value, timestamp and headers, through an
  idempotent producer; delivery errors raise. Then it commits every archived group's offsets. A partition
  archived from offset 0 without holes (every data topic: kept forever, no transaction markers) gets the
  same offsets back, so positions kept outside the broker (an agent's state file, the scheduler's offset
  table, the allocator's marks) stay true. Where the archived offsets had holes (compacted topics, records
  lost to retention) the restored offsets are denser: group offsets are translated (the first record at or
  after the archived committed offset), and the partitions whose offsets moved are reported
  (``RestoreStats.offsets_moved``). Archive a restored region into a NEW directory.
* A restore leaves a note in the run directory (``restored.json``: the archive, when, the partitions whose offsets
  moved, the restored ``_schemas`` topic's id); ``restore_note`` gives it back while the log is that one, and
  `ropewalk status` says so beside each topic's records and end offsets.
* ``progress`` (streams/progress.py): both report how many records of how many, once per batch.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from fastavro import parse_schema, reader
from fastavro.write import Writer

from infra.config import Config
from streams import groups as consumer_groups
from streams.clients import DeliveryError, consumer_conf, producer_conf
from streams.progress import ProgressFn, silent
from streams.retry import watermark_offsets
from streams.topics import (BY_NAME, CATALOGUE, CHANGELOG_CONFIG, Topics, provision, replication_config,
                            replication_factor, topic_id, wait_until_served)

FORMAT = "ropewalk-archive/1"
MANIFEST = "manifest.json"
TIMESTAMP_TYPES = ("NOT_AVAILABLE", "CREATE_TIME", "LOG_APPEND_TIME")  # index = confluent TIMESTAMP_* value
LOG_RECORD_SCHEMA = {
    "type": "record", "name": "LogRecord", "namespace": "ropewalk.archive",
    "doc": "One Kafka record exactly as the broker held it.",
    "fields": [
        {"name": "topic", "type": "string", "doc": "Logical topic name (without prefix)."},
        {"name": "partition", "type": "int"},
        {"name": "offset", "type": "long", "doc": "The record's offset in the archived log."},
        {"name": "timestamp_ms", "type": "long"},
        {"name": "timestamp_type", "type": {"type": "enum", "name": "TimestampType", "symbols": list(TIMESTAMP_TYPES)}},
        {"name": "key", "type": ["null", "bytes"]},
        {"name": "value", "type": ["null", "bytes"]},
        {"name": "headers", "type": {"type": "array", "items": {
            "type": "record", "name": "Header",
            "fields": [{"name": "key", "type": "string"}, {"name": "value", "type": ["null", "bytes"]}]}}},
    ],
}


CHANGELOG_SUFFIX = "-changelog"  # faust names a table's changelog topic "<app id>-<table>-changelog"


class ArchiveError(RuntimeError):
    """The archive cannot be written or restored; the message says why and what to do."""


def is_changelog(logical: str) -> bool:
    return logical not in BY_NAME and logical.endswith(CHANGELOG_SUFFIX) and not logical.startswith("_")


def physical_name(cat: Topics, logical: str) -> str:
    """The physical name of a catalogue topic or of a changelog topic (both under the prefix)."""
    return cat.prefix + logical if is_changelog(logical) else cat.name(logical)


def changelogs_on(metadata, prefix: str) -> list[str]:
    """The changelog topics (logical names) the broker holds under ``prefix``."""
    return sorted(t[len(prefix):] for t in metadata.topics if t.startswith(prefix) and is_changelog(t[len(prefix):]))


@dataclass
class ArchiveStats:
    records: int = 0
    bytes: int = 0  # key + value + header bytes archived
    file_bytes: int = 0  # size of the segments written
    segments: int = 0
    seconds: float = 0.0
    complete: bool = True  # False when the run stopped at max_records: run again to continue
    per_topic: dict[str, int] = field(default_factory=dict)
    gaps: list[tuple[str, int, int, int]] = field(default_factory=list)  # (topic, partition, from, to) lost
    missing_topics: list[str] = field(default_factory=list)  # not on the broker

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds else 0.0


@dataclass
class RestoreStats:
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0
    per_topic: dict[str, int] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)  # group -> partitions whose offset was committed
    offsets_moved: list[str] = field(default_factory=list)  # "topic[p]": restored offsets differ from archived

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


# -- archive -------------------------------------------------------------------------------------------
def archive(cfg: Config, out_dir: Path | str, *, topics: list[str] | None = None, max_records: int | None = None,  # noqa: C901
            codec: str = "null", timeout_s: float = 30.0, progress: ProgressFn | None = None) -> ArchiveStats:
    """Archive every record of `topics` (logical names; default: the whole catalogue and the changelogs under the
    prefix) not yet in `out_dir`, and the committed offsets of the consumer groups under the prefix. ``progress``:
    records archived of those to archive, after each batch."""
    say = progress or silent
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cat = Topics(cfg.topic_prefix, cfg.partitions)
    stats, started = ArchiveStats(), time.monotonic()
    schema = parse_schema(LOG_RECORD_SCHEMA)
    with _locked(out_dir):
        manifest = _read_manifest(out_dir) or _new_manifest(cfg)
        if manifest["topic_prefix"] != cfg.topic_prefix:
            raise ArchiveError(f"{out_dir} archives topic prefix {manifest['topic_prefix']!r}, not "
                               f"{cfg.topic_prefix!r}; use another directory")
        run = {"started_at": _now(), "records": 0, "complete": False}
        manifest["last_run"] = run
        # auto.offset.reset=error: a start offset outside the log must fail loudly, never silently rewind.
        consumer = Consumer(consumer_conf(cfg, None, **{"enable.partition.eof": True, "auto.offset.reset": "error"}))
        open_segments: dict[tuple[str, int], _Segment] = {}
        try:
            if topics is None:
                names = [t.name for t in CATALOGUE] + changelogs_on(consumer.list_topics(timeout=timeout_s), cat.prefix)
            else:
                names = [t if is_changelog(t) else cat.logical(cat.name(t)) for t in topics]
            # Before the partitions' ends (_plan): every record a group consumed is then in the archive.
            say("reading the consumer groups' offsets")
            manifest["groups"] = _group_offsets(cfg, cat, names)
            pending = _plan(consumer, cat, names, manifest, out_dir, stats, timeout_s)
            to_archive = sum(max(0, end - start) for start, end, _ in pending.values())
            say("archiving the log", 0, to_archive)
            _write_manifest(out_dir, manifest)
            consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _, _) in pending.items()])
            fetched: set[tuple[str, int]] = set()
            idle_since = time.monotonic()

            def finish(tp: tuple[str, int], eof_offset: int | None = None) -> None:
                _, _, logical = pending.pop(tp)
                consumer.pause([TopicPartition(*tp)])
                pstate = manifest["topics"][logical]["partitions"][str(tp[1])]
                before = pstate["next_offset"]
                seg = open_segments.pop(tp, None)
                if seg is not None:
                    seg.commit()
                    pstate["segments"].append([seg.first, seg.last, seg.count])
                    pstate["next_offset"] = seg.last + 1
                    pstate["records"] += seg.count
                    pstate["bytes"] += seg.bytes
                    stats.segments += 1
                    stats.file_bytes += seg.path.stat().st_size
                    stats.per_topic[logical] = stats.per_topic.get(logical, 0) + seg.count
                if eof_offset is not None:  # every record below it was delivered (skips control records)
                    pstate["next_offset"] = max(pstate["next_offset"], eof_offset)
                if seg is not None or pstate["next_offset"] != before:
                    _write_manifest(out_dir, manifest)

            while pending and (max_records is None or stats.records < max_records):
                msgs = consumer.consume(10000, 1.0)
                if not msgs:
                    _check_not_behind(consumer, pending, out_dir)
                    if time.monotonic() - idle_since > timeout_s:
                        raise ArchiveError(f"no records for {timeout_s:.0f}s from {sorted(pending)[:3]}...")
                    continue
                idle_since = time.monotonic()
                for m in msgs:
                    tp = (m.topic(), m.partition())
                    plan = pending.get(tp)
                    if plan is None:
                        continue  # finished already: records past the end captured at the start
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            finish(tp, m.offset())
                            continue
                        hint = (f" (offset {plan[0]} is outside the log: truncated, or a different/restarted log; "
                                "archive it into a new directory)" if err.code() == KafkaError.OFFSET_OUT_OF_RANGE else "")
                        raise ArchiveError(f"reading {tp[0]}[{tp[1]}]: {err.str()}{hint}")
                    if tp not in fetched:  # the end of the log as the first fetch response saw it
                        fetched.add(tp)
                        plan[1] = max(plan[1], consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)[1])
                    offset, end = m.offset(), plan[1]
                    if offset >= end:
                        finish(tp)
                        continue
                    seg = open_segments.get(tp)
                    if seg is None:
                        seg = open_segments[tp] = _Segment.open(out_dir, cfg, plan[2], tp[1], offset, schema, codec)
                    ts_type, ts = m.timestamp()
                    key, value, headers = m.key(), m.value(), m.headers()
                    seg.writer.write({
                        "topic": plan[2], "partition": tp[1], "offset": offset, "timestamp_ms": ts,
                        "timestamp_type": TIMESTAMP_TYPES[ts_type], "key": key, "value": value,
                        "headers": [{"key": k, "value": v} for k, v in headers] if headers else [],
                    })
                    size = (len(key) if key else 0) + (len(value) if value else 0) + (
                        sum(len(k) + len(v or b"") for k, v in headers) if headers else 0)
                    seg.last, seg.count, seg.bytes = offset, seg.count + 1, seg.bytes + size
                    stats.records += 1
                    stats.bytes += size
                    if offset + 1 >= end:
                        finish(tp)
                    if max_records is not None and stats.records >= max_records:
                        break
                say("archiving the log", stats.records, max(to_archive, stats.records))
            stats.complete = not pending
            for tp in list(open_segments):  # stopped at max_records: keep what is complete
                finish(tp)
            run.update(finished_at=_now(), records=stats.records, complete=stats.complete)
            _write_manifest(out_dir, manifest)
        finally:
            for seg in open_segments.values():  # an exception: nothing half-written stays visible
                seg.abort()
            consumer.close()
    stats.seconds = time.monotonic() - started
    return stats


def _plan(consumer, cat: Topics, names: list[str], manifest: dict, out_dir: Path, stats: ArchiveStats,
          timeout_s: float) -> dict[tuple[str, int], list]:
    """(physical topic, partition) -> [start offset, end offset (so far), logical topic] for every partition.

    The end starts as the listed high watermark and is raised to the one the first fetch response reports
    (records written meanwhile come along; either way every record a group had consumed is in). Also records
    partition counts in the manifest and cleans partition directories of what an interrupted run left.
    """
    md = consumer.list_topics(timeout=timeout_s)
    pending = {}
    for name in names:
        physical = physical_name(cat, name)
        tmd = md.topics.get(physical)
        if tmd is None or tmd.error is not None:
            stats.missing_topics.append(name)
            continue
        tstate = manifest["topics"].setdefault(name, {"partition_count": 0, "partitions": {}})
        tstate["partition_count"] = len(tmd.partitions)
        for p in sorted(tmd.partitions):
            pstate = tstate["partitions"].setdefault(
                str(p), {"next_offset": 0, "records": 0, "bytes": 0, "segments": [], "gaps": []})
            _clean_partition_dir(out_dir / name / f"p{p}", pstate["segments"])
            lo, hi = watermark_offsets(consumer, TopicPartition(physical, p), timeout_s)
            start = pstate["next_offset"]
            if start < lo:  # retention removed records before they could be archived
                pstate["gaps"].append([start, lo - 1])
                stats.gaps.append((name, p, start, lo - 1))
                start = pstate["next_offset"] = lo
            pending[(physical, p)] = [start, hi, name]
    return pending


def _group_offsets(cfg: Config, cat: Topics, names: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    """group -> logical topic -> partition (str) -> committed offset, for the groups under the prefix and the
    archived topics."""
    by_physical = {physical_name(cat, n): n for n in names}
    out: dict[str, dict[str, dict[str, int]]] = {}
    for group in consumer_groups.groups(cfg):
        for (topic, p), offset in consumer_groups.committed(cfg, group, by_physical).items():
            out.setdefault(group[len(cat.prefix):], {}).setdefault(by_physical[topic], {})[str(p)] = offset
    return out


def _check_not_behind(consumer, pending: dict, out_dir: Path) -> None:
    """Raise if a partition's log ends before the archive's next offset: a different or restarted log."""
    for (topic, p), (start, _, _) in pending.items():
        hi = consumer.get_watermark_offsets(TopicPartition(topic, p), cached=True)[1]
        if 0 <= hi < start:
            raise ArchiveError(
                f"{topic}[{p}] ends at offset {hi} but {out_dir} already holds offsets up to {start - 1}: "
                "this is a different (or restarted) log; archive it into a new directory")


@dataclass
class _Segment:
    """One segment being written: a temp file until `commit` renames it."""

    tmp: Path
    fo: object
    writer: Writer
    first: int
    last: int = -1
    count: int = 0
    bytes: int = 0
    path: Path | None = None

    @classmethod
    def open(cls, out_dir: Path, cfg: Config, logical: str, partition: int, first: int, schema, codec: str):
        pdir = out_dir / logical / f"p{partition}"
        pdir.mkdir(parents=True, exist_ok=True)
        tmp = pdir / f".{first:020d}.avro.tmp"
        fo = open(tmp, "wb")
        meta = {"ropewalk.format": FORMAT, "ropewalk.topic_prefix": cfg.topic_prefix, "ropewalk.topic": logical,
                "ropewalk.partition": str(partition), "ropewalk.first_offset": str(first)}
        return cls(tmp, fo, Writer(fo, schema, codec=codec, metadata=meta), first)

    def commit(self) -> None:
        self.writer.flush()
        self.fo.flush()
        os.fsync(self.fo.fileno())
        self.fo.close()
        self.path = self.tmp.parent / _segment_name(self.first, self.last)
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.fo.close()
        self.tmp.unlink(missing_ok=True)


def _segment_name(first: int, last: int) -> str:
    return f"{first:020d}-{last:020d}.avro"


def _clean_partition_dir(pdir: Path, segments: list) -> None:
    """Remove temp files and segments the manifest does not list (left by an interrupted run)."""
    if not pdir.is_dir():
        return
    listed = {_segment_name(first, last) for first, last, _ in segments}
    for f in pdir.iterdir():
        if f.name.endswith(".tmp") or (f.suffix == ".avro" and f.name not in listed):
            f.unlink()


# -- restore -------------------------------------------------------------------------------------------
def restore(cfg: Config, in_dir: Path | str, *, force: bool = False, timeout_s: float = 30.0,  # noqa: C901
            progress: ProgressFn | None = None) -> RestoreStats:
    """Republish the archive in `in_dir` into `cfg`'s broker under `cfg.topic_prefix`, then commit the archived
    consumer groups' offsets (translated where offsets moved; see the module doc). ``progress``: records
    republished of those archived, every 1,000.

    Refuses (ArchiveError) when a target topic already holds records, unless `force`; the group offsets are
    refused by the broker while a group has live members (stop the control plane first).
    """
    in_dir = Path(in_dir)
    manifest = _read_manifest(in_dir)
    if manifest is None:
        raise ArchiveError(f"{in_dir} has no {MANIFEST}: not a Ropewalk archive")
    tstates = manifest["topics"]
    counts = {name: st["partition_count"] for name, st in tstates.items()}
    shared = {n for name, n in counts.items() if is_changelog(name) or BY_NAME[name].partitions is None}
    if len(shared) > 1:
        raise ArchiveError(f"archive has topics with different partition counts {sorted(shared)}; "
                           "Ropewalk topics are co-partitioned")
    cat = Topics(cfg.topic_prefix, shared.pop() if shared else cfg.partitions)
    for name, n in counts.items():
        want = cat.partitions if is_changelog(name) else cat.partitions_of(name)
        if n != want:
            raise ArchiveError(f"archive's {name} has {n} partitions, the catalogue says {want}")
    stats, started = RestoreStats(partitions=dict(counts)), time.monotonic()
    say = progress or silent
    archived = sum(pst["records"] for st in tstates.values() for pst in st["partitions"].values())
    say("creating the topics")
    admin = AdminClient({**cfg.kafka_conf(), "log_level": 3})
    rf = replication_factor(cfg, admin)  # the region's, as `up` and faust create them (streams/topics.py)
    provision(admin, cat, timeout_s, replication=rf, conf=cfg.kafka_conf())
    _create_changelogs(admin, cat, {n: c for n, c in counts.items() if is_changelog(n)}, timeout_s, rf)
    bases = _ends(cfg, cat, counts, timeout_s)  # where each partition's restored records will start
    if not force and (busy := [f"{physical_name(cat, n)}[{p}] (high watermark {hi})"
                               for (n, p), hi in sorted(bases.items()) if hi > 0]):
        raise ArchiveError(f"restore refused: target topics already hold records: {', '.join(busy[:5])}"
                           f"{' ...' if len(busy) > 5 else ''}; restore into an empty broker or another "
                           "ROPEWALK_TOPIC_PREFIX (or pass force=True to append)")

    errors: list[str] = []

    def on_delivery(err, msg) -> None:
        if err is not None:
            errors.append(f"{msg.topic()}[{msg.partition()}]: {err.str()}")

    producer = Producer(producer_conf(cfg, **{"linger.ms": 20}))

    def flush() -> None:
        remaining = producer.flush(timeout_s)
        if remaining:
            errors.append(f"{remaining} records still undelivered after {timeout_s:.0f}s")
        if errors:
            more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
            raise DeliveryError(f"restore: {len(errors)} records not delivered: {'; '.join(errors[:3])}{more}")

    groups = manifest.get("groups") or {}
    wanted: dict[tuple[str, int], list[int]] = {}  # (logical, p) -> archived committed offsets to translate
    for per_topic in groups.values():
        for name, per_partition in per_topic.items():
            for p, offset in per_partition.items():
                wanted.setdefault((name, int(p)), []).append(offset)
    translated: dict[tuple[str, int, int], int] = {}  # (logical, p, archived offset) -> restored offset

    say("republishing the archived records", 0, archived)
    catalogue_order = [t.name for t in CATALOGUE]
    order = sorted(tstates, key=lambda n: (n != "_schemas", is_changelog(n),
                                           catalogue_order.index(n) if n in catalogue_order else 0, n))
    for name in order:
        physical = physical_name(cat, name)
        for p, pstate in sorted(tstates[name]["partitions"].items(), key=lambda kv: int(kv[0])):
            base, i = bases[(name, int(p))], 0
            targets = sorted(set(wanted.get((name, int(p)), ())), reverse=True)
            moved = False
            for rec in _read_partition(in_dir, name, int(p), pstate["segments"]):
                while targets and targets[-1] <= rec["offset"]:
                    translated[(name, int(p), targets.pop())] = base + i
                moved = moved or base + i != rec["offset"]
                kwargs = {"partition": int(p), "key": rec["key"], "value": rec["value"],
                          "on_delivery": on_delivery}
                if rec["timestamp_type"] != "NOT_AVAILABLE":
                    kwargs["timestamp"] = rec["timestamp_ms"]
                if rec["headers"]:
                    kwargs["headers"] = [(h["key"], h["value"]) for h in rec["headers"]]
                while True:
                    try:
                        producer.produce(physical, **kwargs)
                        break
                    except BufferError:  # local queue full: let deliveries drain
                        producer.poll(0.1)
                i += 1
                stats.records += 1
                stats.bytes += len(rec["key"] or b"") + len(rec["value"] or b"")
                stats.per_topic[name] = stats.per_topic.get(name, 0) + 1
                if stats.records % 1000 == 0:
                    producer.poll(0)
                    say("republishing the archived records", stats.records, max(archived, stats.records))
            for offset in targets:  # at or past the partition's end: the restored end
                translated[(name, int(p), offset)] = base + i
            if moved:
                stats.offsets_moved.append(f"{physical}[{p}]")
    flush()
    say("republishing the archived records", stats.records, max(archived, stats.records))
    say("committing the consumer groups' offsets")
    for group, per_topic in sorted(groups.items()):
        offsets = {(physical_name(cat, name), int(p)): translated[(name, int(p), offset)]
                   for name, per_partition in per_topic.items() for p, offset in per_partition.items()}
        try:
            consumer_groups.set_committed(cfg, cat.prefix + group, offsets)
        except Exception as exc:  # noqa: BLE001 - e.g. the group has live members
            raise ArchiveError(f"restore: cannot commit the offsets of group {cat.prefix + group}: {exc}; stop the "
                               "control plane (`ropewalk down`) before restoring") from None
        stats.groups[cat.prefix + group] = len(offsets)
    stats.seconds = time.monotonic() - started
    _write_restore_note(cfg, cat, in_dir, stats)
    return stats


# -- what a restore renumbered, for `ropewalk status` ---------------------------------------------------
RESTORE_NOTE = "restored.json"  # in the run directory


def _write_restore_note(cfg: Config, cat: Topics, in_dir: Path, stats: RestoreStats) -> None:
    """Remember in the run directory that this log was restored from ``in_dir``, and which partitions' offsets the
    restore renumbered (where the archived offsets had holes): their end offsets differ from the archived region's.
    Keyed by the restored ``_schemas`` topic's id, so a later log (the data removed, a new broker) is not said to
    be the restored one."""
    note = {"archive": str(in_dir.resolve()), "restored_at": _now(), "topic_prefix": cfg.topic_prefix,
            "records": stats.records, "offsets_moved": sorted(stats.offsets_moved),
            "schemas_topic_id": topic_id(cfg, cat.name("_schemas"))}
    path = Path(cfg.run_dir) / RESTORE_NOTE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RESTORE_NOTE}.tmp")
    tmp.write_text(json.dumps(note, indent=1, sort_keys=True))
    os.replace(tmp, path)


def restore_note(cfg: Config) -> dict | None:
    """What the restore that made this log wrote (``_write_restore_note``); None when the log was not restored
    (no note, or a note of another log or topic prefix)."""
    path = Path(cfg.run_dir) / RESTORE_NOTE
    try:
        note = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if note.get("topic_prefix") != cfg.topic_prefix:
        return None
    try:
        current = topic_id(cfg, Topics(cfg.topic_prefix, cfg.partitions).name("_schemas"))
    except Exception:  # noqa: BLE001 - no such topic (another log): not the restored one
        return None
    return note if current == note.get("schemas_topic_id") else None


def _create_changelogs(admin, cat: Topics, counts: dict[str, int], timeout_s: float, replication: int = 1) -> None:
    """Create the changelog topics as faust would (compacted, ``replication`` replicas), with Ropewalk's compaction
    settings."""
    if not counts:
        return
    config = {"cleanup.policy": "compact", **CHANGELOG_CONFIG, **replication_config(replication)}
    futures = admin.create_topics([NewTopic(physical_name(cat, n), c, replication, config=config)
                                   for n, c in counts.items()],
                                  operation_timeout=timeout_s)
    for name, fut in futures.items():
        try:
            fut.result()
        except Exception as exc:  # noqa: BLE001
            err = exc.args[0] if exc.args else None
            if not (hasattr(err, "code") and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                raise ArchiveError(f"cannot create topic {name}: {exc}") from None
    wait_until_served(admin, {physical_name(cat, n): c for n, c in counts.items()})


def _ends(cfg: Config, cat: Topics, counts: dict[str, int], timeout_s: float) -> dict[tuple[str, int], int]:
    """(logical topic, partition) -> its high watermark on the target broker."""
    c = Consumer(consumer_conf(cfg, None))
    try:
        return {(name, p): watermark_offsets(c, TopicPartition(physical_name(cat, name), p), timeout_s)[1]
                for name, n in counts.items() for p in range(n)}
    finally:
        c.close()


def read_archive(in_dir: Path | str) -> Iterator[dict]:
    """Every archived record of the catalogue's topics (LogRecord dicts; not the changelogs), topic by topic in
    catalogue order, partitions in offset order."""
    in_dir = Path(in_dir)
    manifest = _read_manifest(in_dir) or {"topics": {}}
    for spec in CATALOGUE:
        tstate = manifest["topics"].get(spec.name)
        for p, pstate in sorted((tstate or {"partitions": {}})["partitions"].items(), key=lambda kv: int(kv[0])):
            yield from _read_partition(in_dir, spec.name, int(p), pstate["segments"])


def _read_partition(in_dir: Path, name: str, partition: int, segments: list) -> Iterator[dict]:
    for first, last, count in segments:
        path = in_dir / name / f"p{partition}" / _segment_name(first, last)
        if not path.exists():
            raise ArchiveError(f"{path} is listed in the manifest but missing")
        n = 0
        with open(path, "rb") as fo:
            for rec in reader(fo):
                if rec["topic"] != name or rec["partition"] != partition or not first <= rec["offset"] <= last:
                    raise ArchiveError(f"{path}: record {rec['topic']}[{rec['partition']}]@{rec['offset']} "
                                       "does not belong in this segment")
                n += 1
                yield rec
        if n != count:
            raise ArchiveError(f"{path}: {n} records, the manifest says {count}")


# -- manifest ------------------------------------------------------------------------------------------
def _new_manifest(cfg: Config) -> dict:
    return {"format": FORMAT, "record_schema": "ropewalk.archive.LogRecord", "topic_prefix": cfg.topic_prefix,
            "source": cfg.bootstrap_servers, "created_at": _now(), "topics": {}}


def _read_manifest(d: Path) -> dict | None:
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    if manifest.get("format") != FORMAT:
        raise ArchiveError(f"{d / MANIFEST}: format {manifest.get('format')!r}, this code reads {FORMAT!r}")
    return manifest


def _write_manifest(d: Path, manifest: dict) -> None:
    parts = [ps for ts in manifest["topics"].values() for ps in ts["partitions"].values()]
    for ts in manifest["topics"].values():
        ts["records"] = sum(ps["records"] for ps in ts["partitions"].values())
        ts["bytes"] = sum(ps["bytes"] for ps in ts["partitions"].values())
    manifest["totals"] = {"records": sum(p["records"] for p in parts), "bytes": sum(p["bytes"] for p in parts),
                          "segments": sum(len(p["segments"]) for p in parts)}
    manifest["updated_at"] = _now()
    tmp = d / f".{MANIFEST}.tmp"
    with open(tmp, "w") as fo:
        json.dump(manifest, fo, indent=1, sort_keys=True)
        fo.flush()
        os.fsync(fo.fileno())
    os.replace(tmp, d / MANIFEST)


@contextmanager
def _locked(d: Path):
    with open(d / ".lock", "w") as fo:
        try:
            fcntl.flock(fo, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArchiveError(f"another archive run is writing {d}") from None
        yield


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


__all__ = ["archive", "restore", "restore_note", "read_archive", "ArchiveStats", "RestoreStats", "ArchiveError",
           "LOG_RECORD_SCHEMA", "FORMAT"]
