"""The replay/audit reader: read the log from the beginning (or given offsets) up to where it ended when the
replay started, keep the events a filter matches, and yield them in log order per partition.

    run = replay(cfg, registry, ReplayFilter(entitlement="ads", since_ms=t0))
    for rec in run:                      # streams.clients.Record, decoded
        print(format_text(rec))          # or format_json(rec): one JSON line
    print(run.stats.matched, run.stats.read, run.stats.skipped, run.stats.events_per_s)

API
* `ReplayFilter` (frozen) and `matches(flt, event)`: a pure predicate; every set field must match (AND).
  `topics` is a tuple of logical names (default: every data topic, deadletter included, _schemas never).
* `replay(...)` returns a `Replay`: iterable ONCE; the broker is contacted when iteration starts. Its
  `.stats` (`ReplayStats`: read, matched, skipped, skipped_by_reason, partitions, elapsed_s, events_per_s)
  is updated while iterating and final when the iteration ends; `.ends` holds each partition's end offset.
* `format_text(rec)` / `format_json(rec)`: one line per event, for humans / for scripts.

Guarantees and choices
* Termination: every partition has an end offset, fixed the first time the consumer learns it: the high
  watermark of its first fetch response (at or beyond where the partition ended when the replay started, as
  high watermarks only grow), or its start if ListOffsets showed it empty before assignment. A partition is
  finished when the consumer has read up to that end or reported end-of-partition (which it only does at a
  high watermark of a fetch made after the start). Records at or beyond the end are ignored undecoded, so a
  replay ends even while producers keep writing; it contains every record that existed when it started (and
  possibly a few written in the milliseconds before the first fetch).
* Order: within one (topic, partition), records come in offset order. Nothing is promised across partitions;
  `time_order_key` sorts the matched documents into one timeline (what `ropewalk replay` prints).
* Undecodable records never stop a replay: they are counted in `stats.skipped` (by reason in
  `stats.skipped_by_reason`; `run.skipped.report()` says so in one line) and, if the caller passed
  `dead_letters` (anything with `route(**kw)`, e.g. `streams.deadletter.DeadLetters`), forwarded there too.
  Only records examined are counted: a record that the entitlement narrowing (below) skips without decoding
  is not.
* Identities: on the topics agents may write (tasks, machines, heartbeats), every record's proof of who wrote it is
  checked as every reader checks it (streams/auth.py, with the reading principal's keys); a record that does not
  verify (a forgery) is skipped like an undecodable one, by its reason (`bad_proof`, `unsigned`, ...), and every
  event shown carries the identity proven (`identity` in `format_json`, `by=` in `format_text`): a forgery cannot
  pass for `health` or `scheduler`. The forgeries themselves are in `deadletter`, where the readers put them.
* Entitlement narrowing: when `entitlement` is set, each co-partitioned (entitlement-keyed) topic is read on
  the partitions the entitlement ever lived on: the one murmur2 sends its key to (see streams/partitioner.py) and
  those the partition map names (streams/partitionmap.py: where it was placed, moved from and to), and records
  on them with another key are skipped without being decoded. This is sound whatever other filters are set: on those topics the
  record key IS the envelope entitlement (the consumer dead-letters a record whose key disagrees).
  Other topics (heartbeats, deadletter, state.*) are read whole and filtered on the envelope.
* Time: `since_ms`/`until_ms` compare the event's own envelope `timestamp_ms` (since inclusive, until
  exclusive). The reader also uses them to skip what cannot match: each partition starts at the first record
  whose log timestamp (CreateTime: when its producer sent it; a restore keeps it) is at least
  `since_ms - LOG_TIME_SLACK_MS`, and ends before the first whose log timestamp is at least
  `until_ms + LOG_TIME_SLACK_MS` (Kafka's ListOffsets by time, one request for all partitions). Ropewalk's
  producers send an event milliseconds after its envelope time, so nothing that matches is skipped; an event
  whose envelope time is more than the slack away from when it was produced (hand-produced with a forged or
  imported timestamp) may be.
* `start_offsets` maps PHYSICAL (topic, partition) to the first offset to read (>= 0, at most the partition's
  end: a later one is out of range and the consumer resets to the beginning); others start at the beginning.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping

from confluent_kafka import TopicPartition


from infra.config import Config
from streams.clients import EventConsumer, Record
from streams.deadletter import Skipped
from streams.events import Event
from streams.partitioner import partition_for
from streams.partitionmap import read_map
from streams.progress import ProgressFn, silent
from streams.serde import SchemaRegistry
from streams.topics import BY_NAME, CATALOGUE, TOPIC_OF_EVENT, TopicError, Topics

DATA_TOPICS: tuple[str, ...] = tuple(t.name for t in CATALOGUE if t.name != "_schemas")  # logical names
# Read only when asked for by name: `handoff` holds the records a scheduler shard forwarded to an entitlement's new
# partition (copies of records on the other topics: the same events again) and the hand-overs' parts.
COPIES: frozenset[str] = frozenset({"handoff"})
LOG_TIME_SLACK_MS = 5 * 60 * 1000  # how far an event's envelope time may be from its log time (seeking by time)


# --- the filter (pure) --------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayFilter:
    """What to keep. Unset (None) fields match everything; set fields must all match."""

    entitlement: str | None = None  # envelope entitlement
    job: str | None = None  # payload job_id, or entity_id == job, or a task of the job (`<job>/<n>`), or an item's
    machine: str | None = None  # payload machine_id, any of machine_ids, any placement's, command's, report's or
    # machine status's or registration's machine_id (the items of TasksCommanded, TaskStatesChanged, MachinesStatusChanged,
    # MachinesRegistered)
    since_ms: int | None = None  # envelope timestamp_ms >= since_ms
    until_ms: int | None = None  # envelope timestamp_ms < until_ms
    topics: tuple[str, ...] | None = None  # logical topic names; None: every data topic
    types: frozenset[str] | None = None  # event types; None: every type (others are passed over undecoded when
    # their record says its type in a header, as every EventProducer's does)
    exclude_types: frozenset[str] | None = None  # event types to leave out (after `types`)

    def __post_init__(self) -> None:
        if self.topics is not None:
            unknown = [t for t in self.topics if t not in DATA_TOPICS]
            if unknown:
                raise TopicError(f"unknown topic(s) {', '.join(map(repr, unknown))}; known: {', '.join(DATA_TOPICS)}")
        for name, given in (("type", self.types), ("exclude-type", self.exclude_types)):
            unknown = sorted(set(given or ()) - set(TOPIC_OF_EVENT))
            if unknown:
                raise TopicError(f"{name}: unknown event type(s) {', '.join(map(repr, unknown))}; known: "
                                 f"{', '.join(sorted(TOPIC_OF_EVENT))}")

    def logical_topics(self) -> tuple[str, ...]:
        """The logical topics to read, in catalogue order."""
        wanted = set(DATA_TOPICS) - COPIES if self.topics is None else set(self.topics)
        return tuple(t for t in DATA_TOPICS if t in wanted)


def matches(f: ReplayFilter, event: Event) -> bool:
    """Whether `event` passes every field of `f` that is set. Pure."""
    if f.entitlement is not None and event.entitlement != f.entitlement:
        return False
    if f.since_ms is not None and event.timestamp_ms < f.since_ms:
        return False
    if f.until_ms is not None and event.timestamp_ms >= f.until_ms:
        return False
    if f.topics is not None and TOPIC_OF_EVENT.get(event.type) not in f.topics:
        return False
    if f.types is not None and event.type not in f.types:
        return False
    if f.exclude_types is not None and event.type in f.exclude_types:
        return False
    if f.job is not None and not _about_job(f.job, event):
        return False
    if f.machine is not None and not _about_machine(f.machine, event):
        return False
    return True


def _about_job(job: str, event: Event) -> bool:
    p = event.payload
    task_prefix = job + "/"  # task ids are <job>/<n>
    task_id = p.get("task_id")
    return (p.get("job_id") == job or event.entity_id == job or event.entity_id.startswith(task_prefix)
            or (isinstance(task_id, str) and task_id.startswith(task_prefix))
            or any(r.get("job_id") == job for r in (p.get("reports") or ())))


def _about_machine(machine: str, event: Event) -> bool:
    p = event.payload
    if p.get("machine_id") == machine:
        return True
    if machine in (p.get("machine_ids") or ()):
        return True
    return any(item.get("machine_id") == machine
               for key in ("placements", "commands", "reports", "machines", "changes") for item in (p.get(key) or ()))


# --- the reader ---------------------------------------------------------------------------------
@dataclass
class ReplayStats:
    read: int = 0  # records examined within the captured range (decoded or not)
    matched: int = 0  # records yielded
    skipped: int = 0  # undecodable records (see skipped_by_reason)
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    not_read: int = 0  # records left unread because their log time is outside since/until (see the module doc)
    partitions: int = 0  # partitions read (after narrowing)
    elapsed_s: float = 0.0

    @property
    def events_per_s(self) -> float:
        return self.read / self.elapsed_s if self.elapsed_s > 0 else 0.0


class _BoundedConsumer(EventConsumer):
    """An EventConsumer in assign mode that reads each partition up to its end as of the start of the replay.

    The end of a partition is fixed the first time it is known: the offset `until_ms` gives (see the module
    doc), else the high watermark of the first fetch response for it (librdkafka's cached watermark, always at
    or beyond the end the partition had when the replay started), or the partition's start if it was empty.
    The ListOffsets high watermark, queried before assignment, is a lower bound of the end.

    `narrow` maps a physical topic to a record key: only the partition that key hashes to is read, and records
    with another key are skipped undecoded. `next_offset[tp]` is how far each partition has been read.
    """

    def __init__(self, cfg: Config, registry: SchemaRegistry, topics: list[str], *, narrow: Mapping[str, bytes],
                 skipped: Skipped, dead_letters, start_offsets: Mapping[tuple[str, int], int],
                 since_ms: int | None = None, until_ms: int | None = None, types: frozenset[str] | None = None,
                 narrow_partitions: Iterable[int] | None = None):
        # Set before super().__init__, which calls partitions() and assign().
        self.narrow = dict(narrow)
        self.narrow_partitions = None if narrow_partitions is None else frozenset(narrow_partitions)
        self.since_ms, self.until_ms = since_ms, until_ms
        self.skipped_by_time = 0  # records never read: before the since offset or from the until offset on
        self.floor: dict[tuple[str, int], int] = {}  # ListOffsets high watermark: a lower bound of the end
        self.ends: dict[tuple[str, int], int] = {}  # fixed once known (see the class docstring)
        self.next_offset: dict[tuple[str, int], int] = {}
        self.examined = 0
        super().__init__(cfg, registry, topics, name="replay", dead_letters=dead_letters, skipped=skipped,
                         start_offsets=start_offsets, types=types)

    def partitions(self) -> list[tuple[str, int]]:
        every = super().partitions()
        count = Counter(t for t, _ in every)
        return [(t, p) for t, p in every if t not in self.narrow or p == partition_for(self.narrow[t], count[t])
                or (self.narrow_partitions is not None and p in self.narrow_partitions)]

    def assign(self, start_offsets: Mapping[tuple[str, int], int]) -> None:
        marks = self.watermarks()
        since = self._offsets_for_time(marks, self.since_ms, -LOG_TIME_SLACK_MS)
        until = self._offsets_for_time(marks, self.until_ms, LOG_TIME_SLACK_MS)
        for tp, (low, high) in marks.items():
            start = max(low, start_offsets.get(tp, low))
            if tp in since:
                self.skipped_by_time += max(0, since[tp] - start)
                start = max(start, since[tp])
            self.next_offset[tp] = start
            self.floor[tp] = high
            if tp in until:  # the end is known now: nothing from there on can match
                self.ends[tp] = max(start, until[tp])
                self.skipped_by_time += max(0, high - self.ends[tp])
            elif high <= low:  # empty when the replay started: done, and never fetched
                self.ends[tp] = low
        super().assign({tp: o for tp, o in self.next_offset.items()},
                       only=[tp for tp in self.next_offset if not self.finished(tp)])

    def _offsets_for_time(self, marks: Mapping[tuple[str, int], tuple[int, int]], ts: int | None,
                          slack_ms: int) -> dict[tuple[str, int], int]:
        """Per partition, the first offset whose log timestamp is at least ``ts + slack_ms`` (its high
        watermark when there is none); empty when ``ts`` is None."""
        if ts is None:
            return {}
        asked = [TopicPartition(t, p, max(0, ts + slack_ms)) for t, p in marks]
        found = self._consumer.offsets_for_times(asked, timeout=10)
        return {(tp.topic, tp.partition): tp.offset if tp.offset >= 0 else marks[(tp.topic, tp.partition)][1]
                for tp in found}

    def end_of(self, tp: tuple[str, int]) -> int | None:
        """The partition's end offset, or None until a fetch response for it has arrived."""
        end = self.ends.get(tp)
        if end is None:
            high = self.fetched_high_watermark(tp)
            if high is not None:
                end = self.ends[tp] = max(high, self.floor[tp])
        return end

    def finished(self, tp: tuple[str, int]) -> bool:
        end = self.end_of(tp)
        # End-of-partition is reported at the high watermark of a fetch made after the start: past the end too.
        return tp in self.eof or (end is not None and self.next_offset[tp] >= end)

    def _decode(self, msg) -> Record | None:
        tp = (msg.topic(), msg.partition())
        offset, end = msg.offset(), self.end_of(tp)
        if end is not None and offset >= end:  # written after the start; everything before it was delivered
            self.next_offset[tp] = max(self.next_offset[tp], end)
            return None
        self.next_offset[tp] = offset + 1
        self.examined += 1
        key = self.narrow.get(tp[0])
        if key is not None and msg.key() != key:
            return None  # another entitlement sharing the partition: not decoded
        return super()._decode(msg)


class ReplayStalled(RuntimeError):
    """The broker delivered nothing for too long while partitions were unfinished."""


class Replay:
    """One replay run: iterate it (once) for the matching `Record`s; read `.stats` during or after."""

    def __init__(self, cfg: Config, registry: SchemaRegistry, flt: ReplayFilter = ReplayFilter(),
                 start_offsets: Mapping[tuple[str, int], int] | None = None, dead_letters=None, batch: int = 5000,
                 stall_timeout_s: float = 30.0, skipped: Skipped | None = None, progress: ProgressFn | None = None):
        self.cfg = cfg
        self.progress = progress or silent  # ("reading the log", records examined, records in the range), per batch
        self.registry = registry
        self.filter = flt
        self.start_offsets = dict(start_offsets or {})
        self.dead_letters = dead_letters
        # what this run could not decode (``skipped.report()``: one line); a caller's own to count into (a command
        # whose only reader is this replay), else the run's
        self.skipped = skipped if skipped is not None else Skipped()
        self.batch = batch
        self.stall_timeout_s = stall_timeout_s
        self.stats = ReplayStats()
        self.ends: dict[tuple[str, int], int] = {}  # end offset per (physical topic, partition), set by the run
        self._started = False

    def physical_topics(self) -> tuple[list[str], dict[str, bytes]]:
        """(topics to read, {topic: key} for the co-partitioned ones narrowed to one entitlement)."""
        names = Topics(self.cfg.topic_prefix, self.cfg.partitions)
        logical = self.filter.logical_topics()
        narrow = {}
        if self.filter.entitlement is not None:
            key = self.filter.entitlement.encode("utf-8")
            narrow = {names.name(t): key for t in logical if BY_NAME[t].copartitioned}
        return [names.name(t) for t in logical], narrow

    def __iter__(self) -> Iterator[Record]:
        if self._started:
            raise RuntimeError("a Replay runs once; call replay() again for another run")
        self._started = True
        return self._run()

    def _run(self) -> Iterator[Record]:
        t0 = time.monotonic()
        topics, narrow = self.physical_topics()
        places = None
        if narrow:  # every partition the entitlement lived on (a move leaves its past on the old one)
            places = read_map(self.cfg, self.registry).partitions_ever(self.filter.entitlement or "")
        consumer = _BoundedConsumer(self.cfg, self.registry, topics, narrow=narrow, skipped=self.skipped,
                                    dead_letters=self.dead_letters, narrow_partitions=places,
                                    start_offsets=self.start_offsets, since_ms=self.filter.since_ms,
                                    until_ms=self.filter.until_ms, types=self.filter.types)
        st = self.stats
        try:
            st.partitions = len(consumer.next_offset)
            pending = {tp for tp in consumer.next_offset if not consumer.finished(tp)}
            in_range = sum(max(0, consumer.ends.get(tp, consumer.floor[tp]) - start)
                           for tp, start in consumer.next_offset.items())  # the ends' lower bounds: grows by a little
            last_progress = time.monotonic()
            while pending:
                records = consumer.poll(self.batch, 0.1)  # returns early only when `batch` are ready
                for rec in records:
                    if matches(self.filter, rec.event):
                        st.matched += 1
                        yield rec
                done = {tp for tp in pending if consumer.finished(tp)}
                consumer.pause(done)  # finished; producers may still be writing to them
                pending -= done
                if consumer.examined != st.read or done:
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > self.stall_timeout_s:
                    left = ", ".join(f"{t}[{p}]@{consumer.next_offset[(t, p)]}/{consumer.ends.get((t, p), '?')}"
                                     for t, p in sorted(pending))
                    raise ReplayStalled(f"replay: no records for {self.stall_timeout_s:.0f}s; unfinished: {left}")
                self._update(consumer, t0)
                self.progress("reading the log", st.read, max(in_range, st.read))
        finally:
            consumer.close()
            self.ends = dict(consumer.ends)
            self._update(consumer, t0)

    def _update(self, consumer: _BoundedConsumer, t0: float) -> None:
        st = self.stats
        st.read = consumer.examined
        st.not_read = consumer.skipped_by_time
        st.skipped = self.skipped.count
        st.skipped_by_reason = dict(self.skipped.by_reason)
        st.elapsed_s = time.monotonic() - t0


def replay(cfg: Config, registry: SchemaRegistry, flt: ReplayFilter = ReplayFilter(),
           start_offsets: Mapping[tuple[str, int], int] | None = None, dead_letters=None,
           batch: int = 5000, skipped: Skipped | None = None, progress: ProgressFn | None = None) -> Replay:
    """A replay of the log as it is when iteration starts, filtered by `flt` (see the module docstring)."""
    return Replay(cfg, registry, flt, start_offsets=start_offsets, dead_letters=dead_letters, batch=batch,
                  skipped=skipped, progress=progress)


# --- output -------------------------------------------------------------------------------------
def logical_topic(rec: Record) -> str:
    """The record's logical topic: the one its event type belongs to (the consumer checks it is on it)."""
    topic = TOPIC_OF_EVENT.get(rec.event.type)
    if topic is not None:
        return topic
    # Not reachable for decoded records; fall back on the longest catalogue name the physical name ends with.
    ends = [t.name for t in CATALOGUE if rec.topic.endswith(t.name)]
    return max(ends, key=len) if ends else rec.topic


def time_order_key(doc: Mapping[str, Any]) -> tuple:
    """Sort key of an event document (``format_json``'s) for a timeline merged across topics and partitions: its
    envelope time, then its place in the log (so events of one partition keep their log order on equal times)."""
    return doc["timestamp_ms"], doc["topic"], doc["partition"], doc["offset"]


def iso_time(ms: int) -> str:
    """ms since epoch as ISO-8601 UTC with milliseconds, e.g. 2026-11-22T10:00:00.123Z."""
    dt = datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(milliseconds=ms)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def format_text(rec: Record) -> str:
    """One human line: time, topic, partition@offset, type, entity id, who wrote it (``by=``: the identity the reader
    proved, streams/auth.py; none where nothing is proven), payload summary."""
    ev = rec.event
    return _text_line(ev.timestamp_ms, logical_topic(rec), rec.partition, rec.offset, ev.type, ev.entity_id, ev.payload,
                      ev.identity)


def format_text_doc(doc: Mapping[str, Any]) -> str:
    """``format_text`` of an event as ``format_json`` wrote it (the API's replay lines)."""
    return _text_line(doc["timestamp_ms"], doc["topic"], doc["partition"], doc["offset"], doc["type"],
                      doc["entity_id"], doc["payload"], doc.get("identity"))


def summary(type_: str, payload: Mapping[str, Any]) -> str:
    """The payload of an event of ``type_`` in one short line, as ``replay`` prints it after the entity."""
    return _SUMMARIES.get(type_, _summary_generic)(payload)


def _text_line(ts: int, topic: str, partition: int, offset: int, type_: str, entity: str, payload,
               identity: str | None = None) -> str:
    summary = _SUMMARIES.get(type_, _summary_generic)(payload)
    by = f" by={identity}" if identity else ""
    return f"{iso_time(ts)} {topic:<14} {partition}@{offset:<7} {type_:<28} {entity}{by}  {summary}".rstrip()


def format_json(rec: Record) -> str:
    """One JSON line: envelope fields, type, payload (bytes as hex), logical topic, partition, offset."""
    doc = rec.event.to_json()
    doc.update(topic=logical_topic(rec), partition=rec.partition, offset=rec.offset)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def _compact(value: Any) -> str:
    """A short rendering of a payload value: strings bare unless they need quotes, collections shortened."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value and not any(c.isspace() or c in '="{}[],' for c in value) else json.dumps(value)
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, Mapping):
        items = [f"{k}:{_compact(v)}" for k, v in list(value.items())[:4]]
        more = f",+{len(value) - 4}" if len(value) > 4 else ""
        return "{" + ",".join(items) + more + "}"
    if isinstance(value, (list, tuple)):
        if len(value) <= 3 and all(not isinstance(v, (Mapping, list, tuple)) for v in value):
            return "[" + ",".join(_compact(v) for v in value) + "]"
        return f"[{len(value)} items]"
    return str(value)


def _kv(**fields: Any) -> str:
    return " ".join(f"{k}={_compact(v)}" for k, v in fields.items())


def _summary_generic(p: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={_compact(v)}" for k, v in p.items() if v is not None and v != "" and v != {} and v != [])


def _summary_rejected(p: Mapping[str, Any]) -> str:
    return _kv(job=p["job_id"], reason=p["reason"], message=p["message"], unplaced=len(p["unplaced_task_ids"]),
               filter_rejections=p.get("filter_rejections") or {})


def _summary_allocated(p: Mapping[str, Any]) -> str:
    out = _kv(job=p["job_id"], placements=len(p["placements"]), filter_rejections=p.get("filter_rejections") or {})
    if p.get("machines_added"):
        out += f" machines_added={len(p['machines_added'])}"
    if p.get("commit_attempts", 1) != 1:
        out += f" commit_attempts={p['commit_attempts']}"
    return out


def _summary_deallocated(p: Mapping[str, Any]) -> str:
    return _kv(job=p["job_id"], placements=len(p["placements"]),
               machines_released=len(p.get("machines_released") or ()))


def _summary_refused(p: Mapping[str, Any]) -> str:
    return _kv(refused=p["intent_type"], job=p.get("job_id"), reason=p["reason"], message=p["message"],
               intent=p["intent_event_id"])


def _summary_dead_letter(p: Mapping[str, Any]) -> str:
    return (f"origin={p['origin_topic']}[{p['origin_partition']}]@{p['origin_offset']} "
            + _kv(reason=p["reason"], detail=p["detail"], consumer=p["consumer"]))


_SUMMARIES: Mapping[str, Callable[[Mapping[str, Any]], str]] = MappingProxyType({
    "AllocationRejected": _summary_rejected,
    "TasksAllocated": _summary_allocated,
    "TasksDeallocated": _summary_deallocated,
    "DeadLetterRecorded": _summary_dead_letter,
    "IntentRefused": _summary_refused,
})

__all__ = ["ReplayFilter", "matches", "Replay", "ReplayStats", "ReplayStalled", "replay", "format_text",
           "format_json", "logical_topic", "iso_time", "DATA_TOPICS"]
