"""``ropewalk rebuild``: the allocator's Redis index rebuilt from the log alone, then swapped in atomically.

    stats = rebuild_index(cfg)          # {"events", "index_events", "keys", "seconds", "events_per_s", ...}

The Redis index is the projection of the allocator's fold (processors/allocator/fold.py, index.py), so a rebuild
IS a fold: read the allocator's source topics (``intents``, ``machines``, ``unavailability``, ``allocations``) to
where they end now, apply their records to a ``RegionFold`` in memory in the causal order ``fold.merged`` gives
(the order every allocator folds the log in at start), then write the whole fold to Redis in pipelined batches
(``MachineIndex.write_whole``: the keys ``project_all`` writes, without its version checks) under a scratch prefix,
and swap it in. The same Python rules as the live
allocator, so the rebuilt keys equal the live ones (tests/integration/test_rebuild.py). The fold starts as the
newest snapshot of the allocator's fold (processors/allocator/snapshot.py: checked against the log, set aside if
the log no longer holds where it ended) and reads the log after it, as an allocator's start does; ``--from-log``
(``from_snapshot=False``) folds the log from its beginning, and ``restore`` always does.

**What is index state.** Every key under the prefix except those matching ``NOT_INDEX_STATE``, which are not
compared (``index_state``) and which the swap does not delete:

    alloc:done:*       decisions committed and journaled until their events are surely on the log (index.py):
                       the log cannot give back a decision that never reached it
    alloc:fence:*      the partitions' fences: raised by each new owner, never lowered
    index:generation   names the index since an allocator last wrote it whole (``MachineIndex.claim_generation``);
                       kept by the swap: an allocator that starts on a rebuilt index without one writes its fold
                       (the same keys) and names one
    index:format       the layout the index was written in (``index.FORMAT``): the rebuild writes its own
    metrics:*          the allocator's counters: about the process, not the index
    outbox:*           the state.machines publisher's queue (and its lock). The projection queues every machine
                       it writes, so the rebuilt outbox holds every machine; it replaces the live one (RENAME
                       overwrites), and the allocator republishes every machine's state once it runs again
    ~rebuild.*         a rebuild's scratch keys (only under the empty prefix are they under the prefix)

A deny-list on purpose: a kind of key added to the index later is compared by the tests and replaced by a
rebuild without a change here. (With the empty prefix that is every other key of the Redis database: give a
shared Redis's other users another database or the region a prefix.)

**Events the fold cannot apply** (UnknownMachineEvent, MissingResources) are skipped, as the live allocator does (it
dead-letters them); undecodable records are skipped as well. Both are counted.

**Swap.** The rebuild writes under a scratch prefix ``~rebuild.<token>:<prefix>`` (same hash tag as the prefix,
so a cluster keeps every key on one slot), then in one MULTI/EXEC deletes the live index state and RENAMEs
every scratch key into place: readers see the old index or the new one, never a half-built one, and a rebuild
that fails or is interrupted leaves the live index as it was. The live keys every allocator write touches
(``applied:<consumer>``, ``placement``) are WATCHed from before the log is read, so if an allocator wrote to the
index meanwhile the swap is refused (``RebuildConflict``) and nothing changes. A running allocator makes a
rebuild pointless anyway: it holds the fold in memory and projects it into Redis whenever Redis lags it.

**Refusals** (``RebuildRefused``, nothing replaced): read from its beginning, a source partition that no longer
starts at offset 0 (retention deleted records that no snapshot holds), and a log without a
single allocator event while the index holds keys (a wrong broker or prefix would otherwise empty it).

Memory: the fold (about 1 KB per machine in Python) and the records of the log until they are merged (the merge
needs every partition's next record).
"""
from __future__ import annotations

import fnmatch
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from confluent_kafka import Consumer, TopicPartition

from infra.config import Config
from processors.allocator import lua, snapshot
from processors.allocator.fold import EVENT_TYPES, FoldError, RegionFold, merged
from processors.allocator.index import DEFAULT_CONSUMER, FORMAT_KEY, GENERATION, MachineIndex, text
from processors.allocator.processor import SOURCES
from streams.clients import consumer_conf
from streams.events import Event
from streams.gc_control import folding
from streams.progress import ProgressFn, silent
from streams.retry import watermark_offsets
from streams.serde import SchemaRegistry
from streams.topics import Topics

NOT_INDEX_STATE = ("alloc:done:*", "alloc:fence:*", "metrics:*", "outbox:*", "~rebuild.*", GENERATION, FORMAT_KEY)
SCRATCH = "~rebuild."
# The swap is one MULTI/EXEC over every key of the index: at 1,000,000 machines Redis takes more than redis-py 8's
# default socket timeout (5 s) to run it, and the timeout, reported as a WatchError, failed the rebuild of two
# 1,000,000-machine benchmarks (2026-11-26; first read as a concurrent write).
SWAP_TIMEOUT_S = 600.0
_SWAP_CHUNK = 1000  # keys per UNLINK, and per rename call, inside the swap transaction
_SCAN_COUNT = 10_000  # keys per SCAN step
_LUA_RENAME = lua.script("rename")
MAX_ERRORS_SHOWN = 5

Position = tuple[str, int, int]  # (physical topic, partition, offset)


class RebuildConflict(RuntimeError):
    """The live index changed while the rebuild ran (an allocator is running): nothing was swapped in."""


class RebuildRefused(RuntimeError):
    """The log cannot give the index back (records deleted, or no events at all): nothing was swapped in."""


# ---------------------------------------------------------------------------------------------------------
# Pure: which keys are index state.

# One expression for the patterns: a swap tests every key of the index (fnmatch pattern by pattern took 0.57 s of a
# 100,000-machine rebuild's 13 s, 2026-11-29)
_NOT_INDEX_STATE = re.compile("|".join(fnmatch.translate(pattern) for pattern in NOT_INDEX_STATE))


def is_index_state(name: str) -> bool:
    """Whether a key (its name without the prefix) is index state: rebuilt, compared, replaced."""
    return _NOT_INDEX_STATE.match(name) is None


def index_state(dump: Mapping[str, Any]) -> dict[str, Any]:
    """The index-state keys of a ``MachineIndex.dump()``."""
    return {k: v for k, v in dump.items() if is_index_state(k)}


# ---------------------------------------------------------------------------------------------------------
# The rebuild.

@dataclass
class RebuildStats:
    events: int = 0  # records read from the allocator's SOURCES (decodable or not)
    snapshot: str | None = None  # the snapshot of the allocator's fold the rebuild started from (None: the log's
    snapshot_records: int = 0  # beginning), and the records of the log it stands for (not read again)
    index_events: int = 0  # of those, events the fold applies (machine, allocation and entitlement events)
    skipped: int = 0  # undecodable records (skipped; the live allocator dead-letters them)
    failed: int = 0  # apply errors seen (skipped, as live); see Rebuild.apply
    errors: list[str] = field(default_factory=list)  # the first MAX_ERRORS_SHOWN of them
    partitions: int = 0
    machines: int = 0
    keys: int = 0  # keys written (then renamed into place)
    replaced: int = 0  # live index keys deleted by the swap
    read_s: float = 0.0
    apply_s: float = 0.0
    write_s: float = 0.0
    swap_s: float = 0.0
    seconds: float = 0.0

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0

    @property
    def log_events_per_s(self) -> float:
        """The log the rebuilt index stands for (the snapshot's records and those read after it) per second."""
        return (self.snapshot_records + self.events) / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "events_per_s": round(self.events_per_s, 1),
                "log_events_per_s": round(self.log_events_per_s, 1),
                **{k: round(getattr(self, k), 3) for k in ("read_s", "apply_s", "write_s", "swap_s", "seconds")}}


def truncated_partitions(cfg: Config, timeout_s: float = 10.0) -> list[str]:
    """The partitions of the allocator's source topics whose first records are gone: ``topic[p]@first``."""
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    consumer = Consumer(consumer_conf(cfg, None))
    try:
        md = consumer.list_topics(timeout=timeout_s)
        out = []
        for physical in map(topics.name, SOURCES):
            tmd = md.topics.get(physical)
            for p in sorted(tmd.partitions) if tmd is not None and tmd.error is None else ():
                low, _ = watermark_offsets(consumer, TopicPartition(physical, p), timeout_s)
                if low > 0:
                    out.append(f"{physical}[{p}]@{low}")
        return out
    finally:
        consumer.close()


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class Rebuild:
    """One rebuild, in steps (``rebuild_index`` runs them all): ``guard`` (WATCH the live index), ``read`` the
    log, ``apply`` it to a fold, ``write`` the fold under the scratch prefix, ``swap`` it in; ``discard`` drops
    the scratch keys."""

    def __init__(self, cfg: Config, registry: SchemaRegistry, redis_client: redis.Redis,
                 consumer: str = DEFAULT_CONSUMER, stall_timeout_s: float = 30.0,
                 progress: ProgressFn | None = None, *, from_snapshot: bool = True) -> None:
        self.cfg, self.registry, self.r, self.consumer = cfg, registry, redis_client, consumer
        self.from_snapshot = from_snapshot  # start from the newest snapshot of the allocator's fold (else the log's
        # beginning)
        self.progress = progress or silent  # a phase per step; the read counts records (streams/progress.py)
        self.stall_timeout_s = stall_timeout_s
        self.prefix = cfg.topic_prefix
        self.scratch = f"{SCRATCH}{uuid.uuid4().hex[:12]}:{self.prefix}"
        self.stats = RebuildStats()
        self.fold = RegionFold()
        self._guard: redis.client.Pipeline | None = None
        self._written: list[str] | None = None  # the scratch keys ``write`` wrote (None: scan for them)
        self._rename = redis_client.register_script(_LUA_RENAME)

    def guard(self) -> None:
        """WATCH the live keys every allocator write touches; the swap is refused if any of them changes."""
        self._guard = guard = self.r.pipeline(transaction=True)
        guard.watch(*(self.prefix + k for k in (f"applied:{self.consumer}", "placement")))

    def read(self) -> dict[tuple[str, int], list[tuple[Event, Position]]]:
        """The allocator's source topics up to where they end now, after the newest snapshot of the allocator's fold
        (processors/allocator/snapshot.py; the fold starts as it) or from the beginning: the records the fold
        applies, per partition. From the beginning, refused if a partition no longer starts at offset 0 (retention
        deleted records the index depends on)."""
        t0 = time.monotonic()
        loaded = snapshot.newest(self.cfg) if self.from_snapshot else None
        if loaded is None:
            self._refuse_truncated()
        loaded, run, out = snapshot.read_after(self.cfg, self.registry, loaded, SOURCES, EVENT_TYPES,
                                               stall_timeout_s=self.stall_timeout_s, progress=self.progress)
        st = self.stats
        if loaded is not None:
            self.fold = loaded.fold
            st.snapshot, st.snapshot_records = loaded.path.name, int(loaded.meta.get("records") or 0)
        elif self.from_snapshot:  # set aside: the log was read from its beginning
            self._refuse_truncated()
        st.events, st.skipped, st.partitions = run.stats.read, run.stats.skipped, run.stats.partitions
        st.index_events = sum(map(len, out.values()))
        st.read_s = time.monotonic() - t0
        self._ends = dict(run.ends)
        return out

    def _refuse_truncated(self) -> None:
        if gone := truncated_partitions(self.cfg):
            raise RebuildRefused(f"the log no longer starts at offset 0 in {', '.join(gone)} (retention deleted "
                                 f"records) and no snapshot of the allocator's fold holds them: a rebuild from it "
                                 f"would lose what they did; the index was left as it is")

    def apply(self, partitions: Mapping[tuple[str, int], list[tuple[Event, Position]]]) -> None:
        """Apply the records to the fold in the merged order; one the fold cannot apply is skipped (counted)."""
        t0 = time.monotonic()
        self.progress("folding the log")
        for event, position in merged(partitions):
            try:
                self.fold.apply(event, position)
            except FoldError as exc:
                self.stats.failed += 1
                if len(self.stats.errors) < MAX_ERRORS_SHOWN:
                    topic, partition, offset = position
                    self.stats.errors.append(f"{topic}[{partition}]@{offset} {event.type}: {exc}")
        for (topic, partition), end in getattr(self, "_ends", {}).items():  # every record up to the end was seen
            self.fold.read_to(topic, partition, end - 1)
        self.stats.machines = len(self.fold.machines)
        self.stats.apply_s = time.monotonic() - t0

    def write(self) -> None:
        """The whole fold under the scratch prefix, pipelined."""
        t0 = time.monotonic()
        self.progress("writing the index to Redis")
        self._written = []
        MachineIndex(self.r, self.scratch, self.consumer).write_whole(self.fold, self._written)
        self.stats.write_s = time.monotonic() - t0

    def _scan(self, prefix: str) -> list[str]:
        return sorted(text(k) for k in self.r.scan_iter(match=_glob_escape(prefix) + "*", count=_SCAN_COUNT))

    def swap(self) -> None:
        """Replace the live index state with the scratch keys in one transaction (refused if the live index
        changed since ``guard``)."""
        if self._guard is None:
            raise RuntimeError("swap() needs guard() first")
        t0 = time.monotonic()
        self.progress("swapping it in")
        live = [k for k in self._scan(self.prefix) if is_index_state(k[len(self.prefix):])]
        new = self._written if self._written is not None else self._scan(self.scratch)
        if live and not self.fold.machines and not self.fold.entitlements:
            raise RebuildRefused(f"the log holds no allocator event under topic prefix {self.prefix!r}, but the "
                                 f"index holds {len(live)} keys: wrong broker or prefix? the index was left as it is")
        pipe, self._guard = self._guard, None
        try:
            pipe.multi()
            for i in range(0, len(live), _SWAP_CHUNK):
                pipe.unlink(*live[i:i + _SWAP_CHUNK])
            for i in range(0, len(new), _SWAP_CHUNK):
                self._rename(keys=new[i:i + _SWAP_CHUNK], args=[len(self.scratch), self.prefix], client=pipe)
            pipe.execute()
        except redis.WatchError as exc:
            if "occurred while watching" in str(exc):  # redis-py: the watching connection failed (error, timeout)
                raise RebuildConflict(f"the Redis connection watching the live index failed during the rebuild "
                                      f"({exc}); nothing was replaced. Run the rebuild again") from None
            raise RebuildConflict("the allocator wrote to the index while it was rebuilt; nothing was replaced. "
                                  "Stop the allocator and run the rebuild again") from None
        finally:
            pipe.reset()
        self.stats.keys, self.stats.replaced = len(new), len(live)
        self.stats.swap_s = time.monotonic() - t0

    def discard(self) -> int:
        """Delete the scratch keys (after a failure); how many there were."""
        keys = self._scan(self.scratch)
        for i in range(0, len(keys), _SWAP_CHUNK):
            self.r.unlink(*keys[i:i + _SWAP_CHUNK])
        if self._guard is not None:
            self._guard.reset()
            self._guard = None
        return len(keys)

    def run(self) -> RebuildStats:
        t0 = time.monotonic()
        try:
            self.guard()
            with folding():  # nothing the fold builds is cyclic garbage: the collector would only walk it
                self.apply(self.read())
                self.write()
            self.swap()
        except BaseException:
            self.discard()
            raise
        self.stats.seconds = time.monotonic() - t0
        return self.stats


def rebuild_index(cfg: Config, registry: SchemaRegistry | None = None, *, redis_client: redis.Redis | None = None,
                  consumer: str = DEFAULT_CONSUMER, progress: ProgressFn | None = None,
                  from_snapshot: bool = True) -> dict[str, Any]:
    """Rebuild the allocator's Redis state under ``cfg.topic_prefix`` from the log and swap it in (see the
    module doc). Returns ``RebuildStats.as_dict()``: events, index_events, keys, seconds, events_per_s, ...
    Raises RebuildConflict if an allocator wrote to the index meanwhile, RebuildRefused if the log cannot give
    the index back; in both cases nothing was replaced."""
    registry = registry or SchemaRegistry.from_dir()
    r = redis_client or cfg.redis_client(socket_timeout=SWAP_TIMEOUT_S)
    try:
        return Rebuild(cfg, registry, r, consumer, progress=progress, from_snapshot=from_snapshot).run().as_dict()
    finally:
        if redis_client is None:
            r.close()
