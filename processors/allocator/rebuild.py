"""``ropewalk rebuild``: the allocator's Redis state rebuilt from the log alone, then swapped in atomically.

    stats = rebuild_index(cfg)          # {"events", "index_events", "keys", "seconds", "events_per_s", ...}

The only Redis state in Ropewalk is the allocator's (``processors/allocator/index.py`` and ``processor.py``):
the machine index, the entitlement table (``entitlement:<e>``) and the applied marks (``applied:<consumer>``,
``topic/partition`` -> last applied offset, for the index's events and the entitlement events alike). A rebuild
recreates exactly that, with the same Lua scripts the live allocator runs, at the same (topic, partition,
offset) positions, so the marks come out the same too.

**What is index state.** Every key under the prefix except those matching ``NOT_INDEX_STATE``, which are
not compared (``index_state``) and which the swap does not delete:

    alloc:req:*        the allocator's decision journal (free/wal/done per request event id): it guards
                       redelivery of requests whose decision was made. Not compared and not deleted by the
                       swap: its free/wal steps hold a decision's events before they are produced, which the
                       log cannot give back. The ``done`` step of every decision that reached the log is
                       written again from it (``journal``), so after a restore (or a lost Redis) a request
                       redelivered from the restored consumer offsets is answered with its decision, not
                       allocated a second time
    alloc:lock:*       a request being decided right now (expires by itself)
    metrics:*          the allocator's counters: about the process, not the index
    applied:*.direct   the allocator's mark for its own deallocations, removed right after each one (a
                       field is left behind only by a crash between the two steps)
    outbox:*           the state.machines publisher's queue (``outbox:machines``, left out of
                       ``MachineIndex.dump`` too) and its lock. The apply script queues every machine it
                       changes, so the rebuilt outbox holds every machine; it replaces the live one (RENAME
                       overwrites), and the allocator republishes every machine's state once it runs again:
                       state.machines then agrees with the rebuilt index. The lock is left alone.
    ~rebuild.*         a rebuild's scratch keys (only under the empty prefix are they under the prefix)

The definition is a deny-list on purpose: a kind of key added to the index later is compared by the tests and
replaced by a rebuild without a change here. (With the empty prefix that is every other key of the Redis
database: give a shared Redis's other users another database or the region a prefix.)

**Order.** The allocator reads ``intents``, ``machines`` and ``allocations`` concurrently, so its order across
partitions is not in the log. The final state does depend on it: the apply script is idempotent per event,
but a machine's ``version`` counts the kinds of change each step made, and release/assign guards look at the
current owner and tasks (index.py, "Versions"). Example: a ``TasksAllocated`` of e2 applied before the ``TasksDeallocated`` of e1 that freed its machine leaves the machine owned by e1 with
e2's tasks on it. So the rebuild applies the records in one fixed order that follows causality as the log
shows it: a k-way merge of the partitions (each in offset order) by ``(envelope timestamp_ms, rank)``, ties
broken by (topic, partition). ``rank`` puts, within one millisecond, MachineRegistered first (a machine exists
before anything names it), then intents, then allocations, then the other machine events (a decision's
MachineAssigned/Released echoes carry its TasksAllocated/TasksDeallocated timestamp and must follow them,
as they followed the allocator's own write live). The allocator's events all carry the timestamp taken when
it started the decision, and one allocator decides one request at a time, so decisions are in decision order.
This reproduces the live index whenever the live allocator read each decision's echoes before the next
decision touching the same machines (the normal case; see the tests). Not reproduced: several allocator
processes deciding concurrently about one machine, decisions within one millisecond about one machine,
and clocks that disagree between the producers of related events. (The allocator's own assign echoes change
nothing since index.py's "Allocator echoes" rule, so their order no longer matters.) Closing those needs an order the allocator writes into
its events (e.g. a sequence number its commit script increments).

**Events the index cannot apply** (UnknownMachine, MissingResources) are skipped without a mark, as the live
allocator does (it dead-letters them); undecodable records are skipped as well. Both are counted.

**Swap.** The rebuild writes under a scratch prefix ``~rebuild.<token>:<prefix>`` (same hash tag as the
prefix, so a cluster keeps every key on one slot), then in one MULTI/EXEC deletes the live index state and
RENAMEs every scratch key into place: readers see the old index or the new one, never a half-built one, and a
rebuild that fails or is interrupted leaves the live index as it was. The live keys every allocator write
touches (``applied:<consumer>``, ``applied:<consumer>.direct``, ``placement``) are WATCHed from before the log
is read, so if an allocator wrote to the index meanwhile the swap is refused (``RebuildConflict``) and
nothing changes. The allocator must still be **stopped** to rebuild: a commit made just before the rebuild
started whose events reach the log after the rebuild's read would be missing from the new index until its
echo is read back, and a decision in between would see its capacity as free.

**Refusals** (``RebuildRefused``, nothing replaced): a source partition that no longer starts at offset 0
(retention deleted records: the topics the index is built from must keep everything), and a log without a
single allocator event while the index holds keys (a wrong broker or prefix would otherwise empty it).

Memory: the index's records are held until they are merged (the merge needs every partition's next record).
"""
from __future__ import annotations

import fnmatch
import heapq
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from confluent_kafka import Consumer, TopicPartition

from infra.config import Config
from processors.allocator.index import DEFAULT_CONSUMER, EVENT_TYPES, IndexApplyError, MachineIndex
from processors.allocator.processor import (
    ENTITLEMENT_EVENTS, JOURNAL_TTL_S, SOURCES, Allocator, decisions_on_log, dump_events,
)
from streams.clients import consumer_conf
from streams.events import Event
from streams.replay import Replay, ReplayFilter
from streams.serde import SchemaRegistry
from streams.topics import BY_NAME, Topics

NOT_INDEX_STATE = ("alloc:req:*", "alloc:lock:*", "metrics:*", "applied:*.direct", "outbox:*", "~rebuild.*")
SCRATCH = "~rebuild."
APPLY_BATCH = 500  # records per pipelined round trip
_SWAP_CHUNK = 1000  # keys per UNLINK inside the swap transaction
MAX_ERRORS_SHOWN = 5

Position = tuple[str, int, int]  # (physical topic, partition, offset)


class RebuildConflict(RuntimeError):
    """The live index changed while the rebuild ran (an allocator is running): nothing was swapped in."""


class RebuildRefused(RuntimeError):
    """The log cannot give the index back (records deleted, or no events at all): nothing was swapped in."""


# ---------------------------------------------------------------------------------------------------------
# Pure: which keys are index state, and the order records are applied in.

def is_index_state(name: str) -> bool:
    """Whether a key (its name without the prefix) is index state: rebuilt, compared, replaced."""
    return not any(fnmatch.fnmatchcase(name, pattern) for pattern in NOT_INDEX_STATE)


def index_state(dump: Mapping[str, Any]) -> dict[str, Any]:
    """The index-state keys of a ``MachineIndex.dump()``."""
    return {k: v for k, v in dump.items() if is_index_state(k)}


_RANK_REGISTERED, _RANK_INTENTS, _RANK_ALLOCATIONS, _RANK_MACHINES = range(4)
_RANK = {
    **{t: _RANK_INTENTS for t in BY_NAME["intents"].events},
    **{t: _RANK_ALLOCATIONS for t in BY_NAME["allocations"].events},
    **{t: _RANK_MACHINES for t in BY_NAME["machines"].events},
    "MachineRegistered": _RANK_REGISTERED,
}


def order_key(event: Event) -> tuple[int, int]:
    """Where ``event`` goes in the merge: its envelope time, then its rank within one millisecond."""
    return event.timestamp_ms, _RANK[event.type]


def merged(partitions: Mapping[tuple[str, int], Sequence[tuple[Event, Position]]]
           ) -> Iterator[tuple[Event, Position]]:
    """Every partition's records, each partition in its own (offset) order, merged by ``order_key``; equal keys
    in (topic, partition) order. A function of the log alone: the same records always give the same order."""
    return heapq.merge(*(partitions[tp] for tp in sorted(partitions)), key=lambda rec: order_key(rec[0]))


# ---------------------------------------------------------------------------------------------------------
# The rebuild.

@dataclass
class RebuildStats:
    events: int = 0  # records read from intents, machines and allocations (decodable or not)
    index_events: int = 0  # of those, events the allocator applies (index events and entitlement events)
    skipped: int = 0  # undecodable records (skipped; the live allocator dead-letters them)
    failed: int = 0  # apply errors seen (skipped without a mark, as live); see Rebuild.apply
    errors: list[str] = field(default_factory=list)  # the first MAX_ERRORS_SHOWN of them
    partitions: int = 0
    keys: int = 0  # keys written (then renamed into place): the index state, the outbox and the journals
    journals: int = 0  # decisions on the log whose ``done`` journal was written (processor.py, "Redelivery")
    replaced: int = 0  # live index keys deleted by the swap
    read_s: float = 0.0
    apply_s: float = 0.0
    swap_s: float = 0.0
    seconds: float = 0.0

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "events_per_s": round(self.events_per_s, 1),
                **{k: round(getattr(self, k), 3) for k in ("read_s", "apply_s", "swap_s", "seconds")}}


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
                low, _ = consumer.get_watermark_offsets(TopicPartition(physical, p), timeout=timeout_s)
                if low > 0:
                    out.append(f"{physical}[{p}]@{low}")
        return out
    finally:
        consumer.close()


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


class Rebuild:
    """One rebuild, in steps (``rebuild_index`` runs them all): ``guard`` (WATCH the live index), ``read`` the
    log, ``apply`` it under the scratch prefix, ``swap`` it in; ``discard`` drops the scratch keys."""

    def __init__(self, cfg: Config, registry: SchemaRegistry, redis_client: redis.Redis,
                 consumer: str = DEFAULT_CONSUMER, stall_timeout_s: float = 30.0) -> None:
        self.cfg, self.registry, self.r, self.consumer = cfg, registry, redis_client, consumer
        self.stall_timeout_s = stall_timeout_s
        self.prefix = cfg.topic_prefix
        self.scratch = f"{SCRATCH}{uuid.uuid4().hex[:12]}:{self.prefix}"
        self.stats = RebuildStats()
        self._guard = None

    def guard(self) -> None:
        """WATCH the live keys every allocator write touches; the swap is refused if any of them changes."""
        self._guard = self.r.pipeline(transaction=True)
        self._guard.watch(*(self.prefix + k for k in (f"applied:{self.consumer}", f"applied:{self.consumer}.direct",
                                                     "placement")))

    def read(self) -> dict[tuple[str, int], list[tuple[Event, Position]]]:
        """The allocator's source topics up to where they end now: the records it applies, per partition.
        Refused if a partition no longer starts at offset 0 (retention deleted records the index depends on)."""
        t0 = time.monotonic()
        if gone := truncated_partitions(self.cfg):
            raise RebuildRefused(f"the log no longer starts at offset 0 in {', '.join(gone)} (retention deleted "
                                 f"records): a rebuild from it would lose what they did; the index was left as it is")
        run = Replay(self.cfg, self.registry, ReplayFilter(topics=SOURCES), stall_timeout_s=self.stall_timeout_s)
        out: dict[tuple[str, int], list[tuple[Event, Position]]] = defaultdict(list)
        for rec in run:
            if rec.event.type in EVENT_TYPES or rec.event.type in ENTITLEMENT_EVENTS:
                out[(rec.topic, rec.partition)].append((rec.event, (rec.topic, rec.partition, rec.offset)))
        st = self.stats
        st.events, st.skipped, st.partitions = run.stats.read, run.stats.skipped, run.stats.partitions
        st.index_events = sum(map(len, out.values()))
        st.read_s = time.monotonic() - t0
        return out

    def apply(self, records: Iterable[tuple[Event, Position]]) -> None:
        """Apply ``records`` in order under the scratch prefix, pipelined.

        An event the index cannot apply is skipped without a mark (the live allocator dead-letters it). When a
        batch holds one, the batch is applied again record by record (records applied already are no-ops by
        their marks) to skip it; a failed record followed in its batch by a later record of its partition is
        then skipped by that record's mark and not counted in ``failed``."""
        t0 = time.monotonic()
        index = MachineIndex(self.r, self.scratch, self.consumer)
        entitlements = Allocator(self.r, self.scratch, producer=None, consumer=self.consumer)
        batch: list[tuple[Event, Position]] = []
        for event, position in records:
            if event.type in ENTITLEMENT_EVENTS:  # other keys than the index's: order against it is moot
                entitlements.apply_entitlement(event, position)
                continue
            batch.append((event, position))
            if len(batch) == APPLY_BATCH:
                self._apply_batch(index, batch)
                batch = []
        if batch:
            self._apply_batch(index, batch)
        self.stats.apply_s = time.monotonic() - t0

    def journal(self, records: Iterable[tuple[Event, Position]], now_ms: int | None = None) -> None:
        """The ``done`` journal (processor.py, "Redelivery") of every request whose decision is on the log and
        younger than ``JOURNAL_TTL_S``, with the time it has left, under the scratch prefix."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        pipe = self.r.pipeline(transaction=False)
        for n, (request_id, events) in enumerate(decisions_on_log(e for e, _ in records).items(), 1):
            ttl_s = JOURNAL_TTL_S - (now_ms - events[0].timestamp_ms) // 1000
            if ttl_s > 0:
                key = f"{self.scratch}alloc:req:{request_id}"
                pipe.hset(key, "done", dump_events(events))
                pipe.expire(key, ttl_s)
                self.stats.journals += 1
            if n % APPLY_BATCH == 0:
                pipe.execute()
        pipe.execute()

    def _apply_batch(self, index: MachineIndex, batch: list[tuple[Event, Position]]) -> None:
        try:
            index.apply_many(batch, batch=len(batch))
            return
        except IndexApplyError:
            pass
        for event, position in batch:
            try:
                index.apply(event, position)
            except IndexApplyError as exc:
                self.stats.failed += 1
                if len(self.stats.errors) < MAX_ERRORS_SHOWN:
                    topic, partition, offset = position
                    self.stats.errors.append(f"{topic}[{partition}]@{offset} {event.type}: {exc}")

    def _scan(self, prefix: str) -> list[str]:
        return sorted(_s(k) for k in self.r.scan_iter(match=_glob_escape(prefix) + "*", count=1000))

    def swap(self) -> None:
        """Replace the live index state with the scratch keys in one transaction (refused if the live index
        changed since ``guard``)."""
        if self._guard is None:
            raise RuntimeError("swap() needs guard() first")
        t0 = time.monotonic()
        live = [k for k in self._scan(self.prefix) if is_index_state(k[len(self.prefix):])]
        new = self._scan(self.scratch)
        if live and not new:
            raise RebuildRefused(f"the log holds no allocator event under topic prefix {self.prefix!r}, but the "
                                 f"index holds {len(live)} keys: wrong broker or prefix? the index was left as it is")
        pipe, self._guard = self._guard, None
        try:
            pipe.multi()
            for i in range(0, len(live), _SWAP_CHUNK):
                pipe.unlink(*live[i:i + _SWAP_CHUNK])
            for k in new:
                pipe.rename(k, self.prefix + k[len(self.scratch):])
            pipe.execute()
        except redis.WatchError:
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
            records = list(merged(self.read()))
            self.apply(records)
            self.journal(records)
            self.swap()
        except BaseException:
            self.discard()
            raise
        self.stats.seconds = time.monotonic() - t0
        return self.stats


def rebuild_index(cfg: Config, registry: SchemaRegistry | None = None, *, redis_client: redis.Redis | None = None,
                  consumer: str = DEFAULT_CONSUMER) -> dict[str, Any]:
    """Rebuild the allocator's Redis state under ``cfg.topic_prefix`` from the log and swap it in (see the
    module doc). Returns ``RebuildStats.as_dict()``: events, index_events, keys, seconds, events_per_s, ...
    Raises RebuildConflict if an allocator wrote to the index meanwhile, RebuildRefused if the log cannot give
    the index back; in both cases nothing was replaced."""
    registry = registry or SchemaRegistry.from_dir()
    r = redis_client or redis.Redis.from_url(cfg.redis_url)
    try:
        return Rebuild(cfg, registry, r, consumer).run().as_dict()
    finally:
        if redis_client is None:
            r.close()
