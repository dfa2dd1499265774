"""The allocator as a running processor: an in-memory fold of the log, decisions in batches, Redis as its view.

    python -m processors.allocator.processor        # a worker; configuration from ROPEWALK_* (infra.config)

```
 intents, machines, unavailability,  catch up: the log after the      live: poll a batch ──► fold.apply each
 allocations                         newest snapshot (snapshot.py),
 (every partition)               ──► merged in causal order ──►     (bad record ──► deadletter)
                                      into the fold (fold.py)              │
                                                                           ▼
 faust group on `allocations` ──► owned partitions + fences    decide the pending requests of owned partitions
 (ownership only: the agent acks)                                 (placement on the fold, one batch) ──►
                                                                  Redis: ONE commit call for the batch ──►
                                                                  produce the decisions (not flushed:
                                                                  the journal answers for them) ──►
                                                                  Redis: project the changed machines ──►
                                                                  state.machines from the outbox
```

**One fold of the whole region.** The free pool is shared by every entitlement, so each allocator process folds
every partition of ``intents`` (entitlements), ``machines``, ``unavailability`` (planned maintenances: no placement
lands on their machines) and ``allocations`` (requests and decisions) with
a confluent-kafka consumer of its own, from the newest snapshot of its fold (snapshot.py; the beginning when there
is none): first the log as it is at start, merged in the
causal order ``merged`` gives (the rule a rebuild follows), then each record as it arrives. Placement then costs
what ``fastplace`` costs (about a millisecond for 36 tasks at 100,000 machines), never a read of the region.

**Ownership is the faust group's.** The faust app consumes ``allocations`` in a consumer group only to be told
which partitions this process owns (the agent acks and does nothing else: reading them is the fold's job).
On each assignment the process raises the partitions' fences in Redis; a decision is committed only under its
partition's current fence, so a stale owner (a zombie after a rebalance) can no longer commit or produce.

**Deciding.** The requests of owned partitions that no decision on the log answers yet (``fold.is_decided``) are
decided together: a request's frees first (TasksDeallocated + MachineReleasedToFreePool per machine the
entitlement no longer uses), then its placement on the fold (TasksAllocated + MachineAssignedToEntitlement per
machine added, and AllocationRejected for what stays unplaced, with the reason and the filters' counts). Each
plan is committed to the fold at once, so the next request of the batch sees it; then the whole batch goes to
Redis in ONE call (index.py): each decision re-checked machine by machine (several allocators may race for a
free machine), written, and its events journaled under the request's id; then every event is produced, without
waiting for the broker's acks (a decision lost with the process is in the journal; a failed delivery is raised
by the next send and folds the log again). Event ids derive from the request's event id: a decision produced twice is the same events.

**Redelivery and crashes.** Nothing depends on faust's committed offsets: every start folds the log (after its newest snapshot), and a
request is pending exactly when no decision for it is on the log. A crash after the Redis commit and before the
events reached the log leaves the decision journaled in Redis: the next attempt at that request gets it back
from the commit (``JOURNALED``) and produces those very events. A conflict (another allocator changed a machine
first) reloads the decision's machines from Redis into the fold and decides again, up to ``max_attempts``.

**Redis** is the allocator's materialized view (index.py): after each batch the fold's changed machines are
projected (version-guarded, pipelined); at start, a Redis that lost or lags the index (its applied marks behind
the fold's) is projected whole. ``state.machines`` is fed from Redis's outbox, as before.

**A Redis that loses the index while the allocator runs** (FLUSHALL, a redis-server started again without its
last writes) is noticed: the index carries a generation (``index:generation``) named when it was last written
whole, and a commit under another generation is refused whole (``IndexLost``, nothing written); every
``INDEX_CHECK_S`` the loop also compares the generation and the applied marks with what it projected
(``check_index``). Either way the allocator stops deciding, folds the log again, projects the fold whole, names a
new generation, raises its partitions' fences again (they were lost too), and decides on: no request is
answered from the emptied index meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import faust
import redis

from infra import metrics
from infra.config import Config
from processors.allocator import decide, snapshot
from processors.allocator.decide import (
    PRODUCER, decision_result, dump_events, expected_partitions, drain_of, in_decision_order, load_events,
    machine_state_event, machines_of, metric_increments, nothing_freed,
)
from processors.allocator.fold import EVENT_TYPES, FoldError, RegionFold, merged, profile_state
from processors.allocator.index import (
    DEFAULT_CONSUMER, DONE_TTL_ENV, DONE_TTL_S, FENCED, FORMAT, JOURNALED, Decision, IndexLost, MachineIndex, text,
)
from streams.clients import DeliveryError, EventConsumer, EventProducer, Record
from streams.deadletter import DeadLetters
from streams.events import Event
from streams.faustwire import make_app
from streams.gc_control import GrowthFreezer, folding
from streams.partitionmap import MapFollower
from streams.partitioner import partition_for
from streams.serde import SchemaRegistry
from streams.topics import Topics

log = logging.getLogger(__name__)

APP_ID = "allocator"
SOURCES = ("intents", "machines", "unavailability", "allocations")

# Errors that a moment cures (Redis or the broker away briefly, Redis emptied): the loop folds the log again, projects
# it, and goes on.
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, DeliveryError, IndexLost)
INDEX_CHECK_S = 1.0  # how often the loop checks that Redis still holds what it projected (check_index)
MAX_ATTEMPTS = 5  # decisions of one request per batch before COMMIT_RETRIES_EXHAUSTED
BATCH_REQUESTS = 500  # requests decided per Redis commit call at most
POLL_RECORDS = 5000  # records the fold consumer takes per poll at most
POLL_S = 0.02  # how long a poll waits for records when there are none
MACHINES_METRIC_S = 5.0  # how often ropewalk_machines is counted from the fold
PUBLISH_INTERVAL_S = 0.25  # machine states are published at most this long after their change
PUBLISH_ROUND = 500  # machine states published per loop turn at most: a backlog (a region registering) is
# drained a round per turn, between decisions, so a request never waits behind more than one round (~10 ms)
OUTBOX_LOCK = "outbox:lock"  # string: the process draining the outbox to state.machines now
LOCK_TTL_S = 30.0
METRICS_KEY = "metrics:allocator"  # hash: requests, placed, rejected (HINCRBY; allocator_metrics)


def observe_attempts(decision: Sequence[Event]) -> None:
    """``ropewalk_allocation_attempts_total``: the tasks one decision placed and those it left unplaceable."""
    for e in decision:
        if e.type == "TasksAllocated":
            metrics.ALLOCATION_ATTEMPTS.labels(result="placed").inc(len(e.payload["placements"]))
        elif e.type == "AllocationRejected":
            metrics.ALLOCATION_ATTEMPTS.labels(result="unplaceable").inc(len(e.payload["unplaced_task_ids"]))


# what the allocator's target exports from its start (infra/metrics.own)
OWNED_METRICS = (metrics.ALLOCATION_ATTEMPTS, metrics.ALLOCATION_DECISION, metrics.INDEX_STALENESS, metrics.MACHINES,
                 metrics.ALLOCATOR_TAIL)


def observe_machines(machines: Iterable[Any]) -> None:
    """``ropewalk_machines`` by status and owner from the fold (every series set, a vanished one to 0)."""
    counts = Counter((m.status, m.entitlement or "free") for m in machines)
    for sample in [s for fam in metrics.MACHINES.collect() for s in fam.samples]:
        key = (sample.labels["status"], sample.labels["entitlement"])
        counts.setdefault(key, 0)
    for (status, ent), n in counts.items():
        metrics.MACHINES.labels(status=status, entitlement=ent).set(n)


# ---------------------------------------------------------------------------------------------------------
# The processor.

@dataclass
class Pending:
    event: Event  # the AllocationRequested
    partition: int
    attempts: int = 0
    freeing: list[Event] | None = None  # its frees, decided by the first attempt: every attempt's decision has them


@dataclass
class _Planned:
    """One request's decision inside a batch, before Redis said yes."""

    pending: Pending
    events: list[Event]
    decision: Decision | None  # None: nothing to commit (a rejection without frees)
    touched: frozenset[str]  # machines the decision changed in the fold


def free_on_fold(fold: RegionFold, request: Event, ts: int) -> list[Event]:
    """``decide.frees``, applied to the fold."""
    events = decide.frees(fold, request, ts)
    for e in events:
        if e.type == "TasksDeallocated":
            fold.free(e)
    return events


def place_on_fold(fold: RegionFold, request: Event, attempt: int, ts: int
                  ) -> tuple[list[Event], tuple[decide.CommitRow, ...]]:
    """``decide.placing``, its plan committed to the fold (Redis re-checks it). Returns the events and the plan's
    rows for the Redis commit. The shadow region (``history.region``) decides with these too."""
    d = decide.placing(fold, request, attempt, ts)
    if d.plan is None or not d.plan.placements:
        return d.events, ()
    assert d.request is not None and d.machines is not None  # a plan has both
    result = fold.commit(d.plan.placements, d.plan.machines_added, request.entitlement, d.request.cpu,
                         d.request.mem, {mid: m.version for mid, m in d.machines.items()}, request.event_id)
    if not result.ok:  # the fold placed on itself: a conflict here is a bug in placement or the fold
        raise RuntimeError(f"request {request.payload['request_id']}: the fold refused its own plan: "
                           f"{result.conflicts}")
    return d.events, d.rows


class Allocator:
    """The fold, the decisions and the Redis view of one allocator process; blocking (one thread drives it)."""

    def __init__(self, cfg: Config, registry: SchemaRegistry, redis_client: redis.Redis,
                 producer: EventProducer | None, *, consumer: str = DEFAULT_CONSUMER,
                 max_attempts: int = MAX_ATTEMPTS, batch: int = BATCH_REQUESTS,
                 publish_interval_s: float = PUBLISH_INTERVAL_S, partition_map: "MapFollower | None" = None,
                 snapshots: bool = True):
        self.cfg = cfg
        self.partition_map = partition_map  # where entitlements live (drain_of); None: none ever moves
        self.registry = registry
        self.r = redis_client
        self.producer = producer
        self.topics = Topics(cfg.topic_prefix, cfg.partitions)
        self.allocations = self.topics.name("allocations")
        self.fold = RegionFold()
        self.index = MachineIndex(redis_client, cfg.topic_prefix, consumer,
                                  done_ttl_s=max(1, int(float(os.environ.get(DONE_TTL_ENV) or DONE_TTL_S))))
        self.max_attempts = max_attempts
        self.batch = batch
        self.publish_interval_s = publish_interval_s
        self.lock = threading.RLock()  # the fold and the decisions: one thread at a time
        self.pending: OrderedDict[str, Pending] = OrderedDict()  # request event id -> request, in arrival order
        self.repeated: dict[str, int] = {}  # request event id -> partition: asked again after its answer
        self.owned: dict[int, int | None] = {}  # allocations partition -> its fence (None: unfenced)
        self.ends: dict[tuple[str, int], int] = {}  # where the catch-up ended: the live consumer starts there
        self.caught_up = False
        self.last_catch_up: dict[str, Any] = {}  # what the last fold of the log read (``catch_up``'s stats)
        self.failed = 0  # records the fold could not apply (dead-lettered)
        self.decided = 0
        self._last_ts = 0  # decision time of the last batch: each batch's is later (in_decision_order)
        self._published_at = 0.0
        self._machines_observed_at = 0.0
        self._outbox_backlog = False  # the last round of publish_machine_states left machines in the outbox
        self._outbox_cursor = 0  # where the drain's HSCAN of the outbox goes on from (``MachineIndex.outbox_from``)
        self._projected_at = 0.0
        self._projected_marks: dict[tuple[str, int], int] = {}
        self._committed: dict[str, int] = {}  # machine -> the version a commit of this batch wrote to Redis
        self._checked_at = 0.0  # the last check_index
        self._publishing = threading.Lock()
        self.stale = False  # the fold went ahead of Redis and the log (a failed batch): fold the log again
        self.crash: BaseException | None = None  # what ended the loop, if it did not stop when asked
        self._freezer = GrowthFreezer()  # a region registering while this process runs: streams/gc_control.py
        self.snapshots = snapshots  # start from the newest snapshot of the fold, and write them (snapshot.py)
        self._read_since_snapshot = 0  # records read since the last snapshot was written
        self._snapshot_at = 0.0
        self._snapshot_settings = snapshot.settings()  # (records between two, least seconds between two)
        self._snapshot_child: int | None = None  # the pid of the process writing a snapshot now
        self._snapshot_records = 0  # ... the records of the log it stands for
        self._snapshot_tail = 0  # ... and those read since the one before it (counted again if it fails)

    def key(self, name: str) -> str:
        return self.cfg.topic_prefix + name

    # --- the fold -----------------------------------------------------------------------------------------
    def catch_up(self, *, stall_timeout_s: float = 60.0) -> dict[str, Any]:
        """Fold the log as it is now, in the causal order ``merged`` gives, and make Redis agree with the fold
        (projected whole when its marks are behind). Returns what it did."""
        with folding(freeze=True):  # the region this process holds from now on: out of the collector's walks
            return self._catch_up(stall_timeout_s)

    def _catch_up(self, stall_timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        loaded = snapshot.newest(self.cfg) if self.snapshots else None
        load_s = time.monotonic() - t0
        loaded, run, parts = snapshot.read_after(self.cfg, self.registry, loaded, SOURCES, EVENT_TYPES,
                                                 stall_timeout_s=stall_timeout_s)
        read_s = time.monotonic() - t0
        failed = 0
        with self.lock:
            if loaded is not None:
                self.fold = loaded.fold
                for event, partition in loaded.pending:  # open when the snapshot was taken: as if read just now
                    if not self.fold.is_decided(event.event_id):
                        self.pending.setdefault(event.event_id, Pending(event, partition))
            for event, position in merged(parts):
                try:
                    self.fold.apply(event, position)
                except FoldError:
                    failed += 1  # dead-lettered when it was first read live; skipped again, as then
                    continue
                if event.type == "AllocationRequested":
                    self._arrived(event, position)
            self.ends = dict(run.ends)
            for (topic, partition), end in self.ends.items():  # records up to the end were seen, even those not
                self.fold.read_to(topic, partition, end - 1)  # applied
            for rid in [rid for rid in self.pending if self.fold.is_decided(rid)]:
                del self.pending[rid]  # decided later in the log than it was requested
            self.fold.drain_changes()
            self.fold.index  # noqa: B018 - built now, in bulk, not by the first request after a start
            generation = self.index.read_generation()  # None: emptied (or never written whole)
            # emptied, lagging the fold, or written in an older layout (without the quota's held sets)
            behind = generation is None or self._redis_behind() or self.index.format() != FORMAT
            projected = self.index.project_all(self.fold) if behind else 0
            if not behind:
                self.index.load_functions()  # this version's readers' functions (project_all loads them too)
            self._adopt_index(refence=generation is None or generation != self.index.generation)
            self.caught_up = True
            self._read_since_snapshot = run.stats.read
            self.maybe_snapshot(at_start=True)
        return {"records": run.stats.read, "applied": self.fold.applied, "failed": failed,
                "machines": len(self.fold.machines), "pending": len(self.pending), "read_s": round(read_s, 3),
                "seconds": round(time.monotonic() - t0, 3), "redis_behind": behind, "projected": projected,
                "snapshot": None if loaded is None else loaded.path.name, "snapshot_load_s": round(load_s, 3)}

    def maybe_snapshot(self, *, at_start: bool = False) -> None:
        """Write a snapshot of the fold (in a child process) once enough was read since the last one, the fold holds
        what the log says (``RegionFold.as_logged``), and the last one is long enough ago; reap a child that
        ended. Called with the lock held."""
        if self._snapshot_child is not None:
            code = snapshot.reaped(self._snapshot_child)
            if code is None:
                return
            if code == 0:
                log.info("allocator: a snapshot of the fold written (%d records of the log, in %.1f s)",
                         self._snapshot_records, time.monotonic() - self._snapshot_at)
            else:  # what it would have held is still to be read after the last one: the next try comes as soon
                log.warning("allocator: the snapshot's writer exited with %s (tried again)", code)
                self._read_since_snapshot += self._snapshot_tail
            self._snapshot_child = None
        metrics.ALLOCATOR_TAIL.set(self._read_since_snapshot)
        records, every_s = self._snapshot_settings
        if not self.snapshots or self._read_since_snapshot < records or not self.fold.as_logged:
            return
        if not at_start and time.monotonic() - self._snapshot_at < every_s:
            return
        pending = [(pd.event, pd.partition) for pd in self.pending.values()]
        self._snapshot_records = sum(o + 1 for o in self.fold.marks.values())
        self._snapshot_at = time.monotonic()
        try:
            self._snapshot_child = snapshot.write_in_child(self.cfg, self.fold, pending,
                                                           records=self._snapshot_records)
        except OSError as exc:  # no process to spare (EAGAIN, ENOMEM): a snapshot is a cache; decide on
            log.warning("allocator: no snapshot written: %s (tried again in %.0f s)", exc, every_s)
            return
        self._snapshot_tail, self._read_since_snapshot = self._read_since_snapshot, 0

    def _adopt_index(self, *, refence: bool) -> None:
        """Redis holds the fold whole now: commit under its generation (named now if it has none), and raise the
        fences of the partitions this process owns again when the index is another than before (they went with
        it)."""
        self.index.claim_generation()
        self._projected_marks = dict(self.fold.marks)
        self._checked_at = time.monotonic()
        if refence and self.owned:
            self.owned.update(self.index.fence(self.owned))

    def _flush_decisions(self) -> None:
        """Before the log is folded again: the decisions produced so far reach it first (an index lost with Redis
        took their journal: a decision not yet on the log would be decided a second time, maybe otherwise)."""
        if self.producer is None:
            return
        try:
            self.producer.flush(30.0)
        except DeliveryError as exc:  # not on the log: decided again, as if never made
            log.warning("allocator: before folding the log again: %s", exc)

    def check_index(self) -> None:
        """Every ``INDEX_CHECK_S``: if Redis no longer holds what this allocator projected into it, raise
        ``IndexLost`` (the loop folds the log again and projects it whole before it decides)."""
        if time.monotonic() - self._checked_at < INDEX_CHECK_S:
            return
        self._checked_at = time.monotonic()
        why = self.index.lost(self._projected_marks)
        if why is not None:
            raise IndexLost(f"Redis lost the index: {why}")

    def _redis_behind(self) -> bool:
        marks = self.index.marks()
        return any(marks.get(tp, -1) < o for tp, o in self.fold.marks.items())

    def on_records(self, records: Iterable[Record], dead_letters: DeadLetters | None = None) -> None:
        """Apply live records to the fold; an event it cannot apply goes to the dead letters."""
        with self.lock:
            for rec in records:
                position = (rec.topic, rec.partition, rec.offset)
                try:
                    self.fold.apply(rec.event, position)
                except FoldError as exc:
                    self.failed += 1
                    log.warning("allocator: %s at %s[%d]@%d: %s", rec.event.type, *position, exc)
                    if dead_letters is not None:
                        dead_letters.route_failed(rec, self.registry, f"{rec.event.type}: {exc}", log)
                    continue
                if rec.event.type == "AllocationRequested":
                    self._arrived(rec.event, position)
                self._read_since_snapshot += 1
            self._freezer.grew(len(self.fold.machines))

    def read_up_to(self, last_offsets: Mapping[tuple[str, int], int]) -> None:
        """Every record up to these offsets was read (those the consumer passed over by type too): the marks say
        so, as they do for any record the fold applies as a no-op."""
        with self.lock:
            for (topic, partition), offset in last_offsets.items():
                self._read_since_snapshot += max(0, offset - self.fold.marks.get((topic, partition), -1))
                self.fold.read_to(topic, partition, offset)

    def _arrived(self, event: Event, position: tuple[str, int, int]) -> None:
        if position[0] != self.allocations:
            return
        if not self.fold.is_decided(event.event_id):
            self.pending.setdefault(event.event_id, Pending(event, position[1]))
        else:  # asked again after its answer: answered again (answer_repeated)
            self.repeated[event.event_id] = position[1]

    def answer_repeated(self) -> int:
        """Produce again the decision of each request of an owned partition that was asked again after it was
        answered (the same record: a requester that crashed after asking asks again, and may have read the answer
        before it did, too early to take it). The same events, from the journal (``DONE_TTL_S``); readers that took
        them drop them by id. Returns how many requests were answered again."""
        todo = [rid for rid, part in self.repeated.items() if part in self.owned]
        if not todo:
            return 0
        journal = self.index.journaled(todo)
        for rid in todo:
            del self.repeated[rid]
            if journal.get(rid) is None:
                log.warning("allocator: request %s was asked again after its answer, no longer journaled: not "
                            "answered again", rid)
                continue
            self._produce(load_events(journal[rid]))
        return len(todo)

    # --- ownership ----------------------------------------------------------------------------------------
    def assign(self, partitions: Iterable[int], *, fenced: bool = True) -> None:
        """This process owns these ``allocations`` partitions now: raise their fences (a former owner can no
        longer commit) and decide their pending requests."""
        parts = set(partitions)
        fences = self.index.fence(parts) if fenced else dict.fromkeys(parts)
        with self.lock:
            self.owned.update(fences)

    def revoke(self, partitions: Iterable[int]) -> None:
        with self.lock:
            for p in partitions:
                self.owned.pop(p, None)

    # --- deciding -----------------------------------------------------------------------------------------
    def decide_pending(self) -> list[Event]:
        """Decide the pending requests of owned partitions, ``batch`` per Redis commit; produce the
        decisions (flushed by the next publish of machine states, or at stop). Returns the events produced."""
        out: list[Event] = []
        while not self.stale:
            with self.lock:
                for rid in [rid for rid in self.pending if self.fold.is_decided(rid)]:
                    del self.pending[rid]  # answered on the log meanwhile (another owner, or redelivered)
                ready = [pd for rid, pd in self.pending.items() if pd.partition in self.owned
                         and not self.held_back(pd)][:self.batch]
                if not ready:
                    break
                events = self._decide_batch(ready)
            out += events
        return out

    def held_back(self, pd: Pending) -> bool:
        """Whether a request waits for requests of its entitlement asked before it moved to this partition: until
        the fold has read the partition it came from up to the move's drain offset, and none of its requests there
        is pending (``drain_of``). A request on a partition the map does not know for its entitlement makes the map
        catch up first (the move that brought it there is on the map before any request is asked there)."""
        if self.partition_map is None:
            return False
        ent = pd.event.entitlement
        entry = self.partition_map.entry(ent)
        if pd.partition not in expected_partitions(entry, partition_for(ent, self.cfg.partitions)):
            self.partition_map.catch_up(5.0)
            entry = self.partition_map.entry(ent)
        drain = drain_of(entry, pd.partition)
        if drain is None:
            return False
        source, offset = drain
        if self.fold.marks.get((self.allocations, source), -1) < offset - 1:
            return True
        return any(other.partition == source and other.event.entitlement == ent for other in self.pending.values())

    def _decide_batch(self, batch: list[Pending]) -> list[Event]:
        produced: list[Event] = []
        # What the fold applied since the last projection is in Redis before anything is committed against it: a
        # machine changed by a record of this poll would otherwise meet its older version in Redis, and the reload
        # that answers a conflict would take that older state back into the fold (the change lost).
        self.project_changes()
        todo = batch
        while todo:
            ts = self._last_ts = max(int(time.time() * 1000), self._last_ts + 1)  # one batch, one decision time
            todo = in_decision_order(todo, lambda pd: pd.partition, ts, self.topics.partitions_of("allocations"))
            planned = [self._plan_or_reject(pd, ts) for pd in todo]
            results = self.index.commit([p.decision for p in planned if p.decision is not None])
            finished, todo, reload = self._settle(planned, results, ts)
            if reload:
                self._reload(reload)
            produced += self._finish(finished)
        # Not flushed here: a decision the broker has not acknowledged is journaled in Redis (index.py), so a
        # crash now loses nothing (the next attempt gets it back JOURNALED); a failed delivery is raised by the
        # next send or flush, which folds the log again. Waiting here for each batch's acks held every batch
        # for a broker round trip (linger and acks=all).
        self.producer.poll()
        self.project_changes()
        return produced

    def _plan_or_reject(self, pd: Pending, ts: int) -> _Planned:
        """``_plan``; a request whose deciding raised (a bug) is rejected (``ALLOCATOR_ERROR``), the fold folded
        again after the batch."""
        try:
            return self._plan(pd, ts)
        except TRANSIENT:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must not stop the allocator: reject, fold again
            log.exception("allocator: deciding %s failed", pd.event.payload.get("request_id"))
            self.stale = True  # the fold may be half-changed: folded again after this batch
            return _Planned(pd, decide.failed(pd.event, exc, ts), None, frozenset())

    def _settle(self, planned: Sequence[_Planned], results: Sequence[Any], ts: int
                ) -> tuple[list[tuple[Pending, list[Event]]], list[Pending], set[str]]:
        """What Redis said of each planned decision (``results``: one per decision committed, in order): the
        requests answered (committed, journaled before, or out of attempts) with their events, those to decide
        again (a conflict), and the machines the fold takes back from Redis."""
        by_request = iter(results)
        retry: list[Pending] = []
        reload: set[str] = set()
        finished: list[tuple[Pending, list[Event]]] = []
        for p in planned:
            res = next(by_request) if p.decision is not None else None
            if res is None or res.outcome == "ok":
                finished.append((p.pending, p.events))
                if res is not None:
                    self._committed.update(res.versions)
            elif res.outcome == JOURNALED:
                journaled = load_events(res.events)
                reload |= p.touched | machines_of(journaled)
                finished.append((p.pending, journaled))
            elif res.outcome == FENCED:
                reload |= p.touched
                self.pending.pop(p.pending.event.event_id, None)  # another process owns its partition now
            else:  # CONFLICT: the fold was behind Redis for these machines (or the entitlement's quota)
                metrics.ALLOCATION_ATTEMPTS.labels(result="conflict").inc(
                    len(p.pending.event.payload["place_task_ids"]))
                reload |= p.touched | set(res.conflicts) | self._unknown_held(p.pending.event.entitlement, res.held)
                if p.pending.attempts >= self.max_attempts:
                    finished.append((p.pending, decide.exhausted(
                        p.pending.event, p.pending.attempts, res.conflicts, ts)))
                else:
                    retry.append(p.pending)
        return finished, retry, reload

    def _finish(self, finished: Sequence[tuple[Pending, list[Event]]]) -> list[Event]:
        """The answered requests: remembered by the fold as decided, counted, their events produced."""
        done: list[Event] = []
        counts: Counter[str] = Counter()
        for pd, events in finished:
            done += events
            self.fold.remember_decided(pd.event.event_id)
            self.fold.remember_made(events)
            self.pending.pop(pd.event.event_id, None)
            counts.update(metric_increments(events))
            observe_attempts(events)
            self.decided += 1
        self._produce(done)
        self.index.add_metrics(counts)
        return done

    def _plan(self, pd: Pending, ts: int) -> _Planned:
        """One request's decision on the fold (committed to the fold at once; Redis re-checks it)."""
        pd.attempts += 1
        request = pd.event
        p = request.payload
        # The frees are decided once (the fold applies them; Redis applies them even when the plan conflicts), and
        # a retry's decision carries them again: before, a retry after a conflict produced no TasksDeallocated, and
        # the log never said the request's moved tasks left their machines (found by the kill storm).
        if pd.freeing is None:
            pd.freeing = self._free(request, ts)
        freeing = pd.freeing
        frees = tuple((r["task_id"], r["machine_id"]) for e in freeing if e.type == "TasksDeallocated"
                      for r in e.payload["placements"])
        released = tuple(mid for e in freeing if e.type == "TasksDeallocated" for mid in e.payload["machines_released"])
        t0 = time.perf_counter()
        placing, plan_rows = self._place(request, pd.attempts, ts)
        metrics.ALLOCATION_DECISION.labels(result=decision_result(placing)).observe(time.perf_counter() - t0)
        events = (freeing + placing) or nothing_freed(request, ts)
        touched = machines_of(events)
        res = p["resources"]  # every decision is committed, a rejection too: journaled, so it can be given again
        ent = self.fold.entitlement(request.entitlement)  # the quota the plan kept: Redis checks it again
        decision = Decision(request.event_id, pd.partition, self.owned.get(pd.partition), request.entitlement,
                            res["cpu_millicores"], res["memory_mib"], frees, released, plan_rows,
                            dump_events(events), quota=ent.quota_machines if ent is not None else None)
        return _Planned(pd, events, decision, touched)

    def _free(self, request: Event, ts: int) -> list[Event]:
        return free_on_fold(self.fold, request, ts)

    def _place(self, request: Event, attempt: int, ts: int) -> tuple[list[Event], tuple[decide.CommitRow, ...]]:
        return place_on_fold(self.fold, request, attempt, ts)

    def _unknown_held(self, entitlement: str, held: Iterable[str]) -> set[str]:
        """Of the machines Redis says ``entitlement`` holds (a CONFLICT_QUOTA's ``held``), those the fold does not
        know it holds: another allocator added them (a decision for the same entitlement on another partition)."""
        machines = self.fold.machines
        return {mid for mid in held if (m := machines.get(mid)) is not None and m.entitlement != entitlement}

    def _reload(self, machine_ids: Iterable[str]) -> None:
        """Take these machines back from Redis into the fold (Redis was ahead: another allocator, or a journaled
        decision)."""
        for mid, fields in self.index.reload(machine_ids).items():
            self.fold.adopt(mid, fields)

    def _produce(self, events: Sequence[Event]) -> None:
        self.producer.send_all(events, validate=False)  # built from decoded events; fastavro still checks types

    def project_changes(self, *, force: bool = False) -> int:
        """Write the machines the fold changed since the last projection to Redis, with the marks and the
        entitlements (the marks alone at most every ``publish_interval_s``: they move with every record)."""
        changed = self.fold.drain_changes()
        if self._committed:  # what a commit wrote already, at the fold's version, need not be written again
            machines, committed = self.fold.machines, self._committed
            changed = {mid: cause for mid, cause in changed.items()
                       if (m := machines.get(mid)) is None or committed.get(mid) != m.version}
            self._committed = {}
        now = time.monotonic()
        if not changed and not force and now - self._projected_at < self.publish_interval_s:
            return 0
        if not changed and self.fold.marks == self._projected_marks and not force:
            return 0
        self._projected_at = now
        self._projected_marks = dict(self.fold.marks)
        return self.index.project(self.fold, changed, entitlements=self.fold.entitlement_fields)

    # --- state.machines -----------------------------------------------------------------------------------
    def publish_machine_states(self, limit: int = PUBLISH_ROUND, rounds: int | None = None) -> int:
        """Publish the current state of every machine in the outbox to ``state.machines``, flush, then take them
        out of the outbox (a machine that changed again meanwhile stays); ``rounds`` of ``limit`` machines at most
        (None: until the outbox is empty). One process drains at a time
        (``outbox:lock``), so records of one machine reach the log in version order; a state published twice
        has the same event id (machine, version)."""
        with self._publishing:
            self._published_at = time.monotonic()
            lock = self.r.lock(self.key(OUTBOX_LOCK), timeout=LOCK_TTL_S)  # redis-py: SET NX PX, token-checked release
            if not lock.acquire(blocking=False):
                return 0  # another allocator is draining; what it misses stays for the next drain
            try:
                total, turn = 0, 0
                queued: Mapping[str, tuple[int, str]] = {}
                while rounds is None or turn < rounds:
                    queued, self._outbox_cursor = self.index.outbox_from(self._outbox_cursor, limit)
                    if not queued:
                        break
                    turn += 1
                    states = self._states(queued)
                    ts = int(time.time() * 1000)
                    self.producer.send_all((machine_state_event(fields, queued[mid][1], ts)
                                            for mid, fields in states.items()), validate=False)
                    self.producer.flush()
                    gone = {mid: 2**62 for mid in queued if mid not in states}  # cleared from the index
                    self.index.outbox_done({**{mid: int(f["version"]) for mid, f in states.items()}, **gone})
                    total += len(states)
                # more of the pass to read, or a whole round read: the next turn publishes again at once
                self._outbox_backlog = bool(queued) and (len(queued) >= limit or self._outbox_cursor != 0)
                return total
            finally:
                try:
                    lock.release()
                except redis.exceptions.LockError:  # it expired meanwhile (and another may hold it): not ours
                    log.warning("allocator: the outbox lock expired while this drain ran")

    def _states(self, queued: Mapping[str, tuple[int, str]]) -> dict[str, dict[str, Any]]:
        """The current state of the queued machines: from the fold where it holds the queued version or a newer
        one (the projection and the commit write the fold's versions, so that is every machine but those another
        allocator changed since this one folded them), the rest read from Redis (``MachineIndex.states``)."""
        with self.lock:
            out = {}
            for mid, (version, _) in queued.items():
                m = self.fold.machines.get(mid)
                if m is not None and m.version >= version:
                    out[mid] = {"id": mid, **m.fields(), "task_ids": sorted(m.tasks),
                                **profile_state(self.fold, m)}
        behind = [mid for mid in queued if mid not in out]
        if behind:
            out.update(self.index.states(behind))
        return out

    def maybe_publish_machine_states(self) -> int:
        """One round, when ``publish_interval_s`` passed since the last or the last left a backlog."""
        if not self._outbox_backlog and time.monotonic() - self._published_at < self.publish_interval_s:
            return 0
        return self.publish_machine_states(rounds=1)  # one round per turn: deciding waits for no backlog

    # --- the loop -----------------------------------------------------------------------------------------
    def run(self, stop: threading.Event, dead_letters: DeadLetters) -> None:
        """Catch up, then follow the log: apply, decide, project, publish; until ``stop`` is set. A batch that
        failed half-way (Redis or the broker away) leaves the fold ahead of both: the log is folded again
        once they answer, and the batch's requests are decided again (a committed one comes back JOURNALED)."""
        consumer = None
        try:
            while not stop.is_set():
                try:
                    if consumer is None or self.stale:
                        if consumer is not None:
                            consumer.close()
                            consumer = None  # closed: not closed again if the fold below fails
                        self.refold()
                        consumer = EventConsumer(self.cfg, self.registry, [self.topics.name(t) for t in SOURCES],
                                                 name=PRODUCER, start_offsets=self.ends, dead_letters=dead_letters,
                                                 types=EVENT_TYPES, follows=True)
                    self._turn(consumer, dead_letters)
                except TRANSIENT as exc:
                    self.stale = True
                    log.warning("allocator: %s (%s); folding the log again once it answers", type(exc).__name__, exc)
                    stop.wait(1.0)
        except BaseException as exc:
            if stop.is_set():  # asked to stop meanwhile: what failed after that (its topics gone, say) is no crash
                log.info("allocator: stopping; the loop's last step failed (%s: %s)", type(exc).__name__, exc)
                return
            self.crash = exc
            log.exception("allocator: the loop failed")
            raise
        finally:
            if consumer is not None:
                consumer.close()
            if self.producer is not None:
                try:
                    self.producer.flush(5.0)  # what was decided reaches the log (else its journal answers later)
                except DeliveryError as exc:
                    log.warning("allocator: at stop: %s (journaled in Redis: produced again at the next start)", exc)

    def _turn(self, consumer: EventConsumer, dead_letters: DeadLetters) -> None:
        """One turn of the loop: a poll's records applied, then ``step``."""
        records = consumer.poll(POLL_RECORDS, POLL_S, linger_s=0.0)
        self.on_records(records, dead_letters)
        # behind the log: how old the newest record of this poll was when it was applied; 0 when idle
        metrics.INDEX_STALENESS.set(max(0.0, time.time() - max(r.log_timestamp_ms for r in records) / 1000)
                                    if records else 0.0)
        if time.monotonic() - self._machines_observed_at > MACHINES_METRIC_S:
            with self.lock:
                observe_machines(self.fold.machines.values())
            self._machines_observed_at = time.monotonic()
        self.read_up_to(consumer.last_offsets)  # records of types the fold ignores: not even decoded
        self.check_index()
        self.step()

    def step(self) -> None:
        """After records were applied: decide, project, publish (a failure marks the fold stale)."""
        try:
            with self.lock:  # before this turn decides: the echoes of the last turn's decisions may all be back
                self.maybe_snapshot()
            self.answer_repeated()
            self.decide_pending()
            self.project_changes()
        except BaseException:
            self.stale = True
            raise
        if not self.stale:
            self.maybe_publish_machine_states()

    def refold(self) -> dict[str, Any]:
        """A fresh fold of the log (at start, and after a batch failed half-way)."""
        self._flush_decisions()
        with self.lock:
            self.fold = RegionFold()
            self.pending.clear()
            self._committed = {}
            self.repeated.clear()
            self.caught_up = self.stale = False
        stats = self.catch_up()
        self.last_catch_up = stats
        log.info("allocator: folded the log: %s", stats)
        return stats


def allocator_metrics(redis_client: redis.Redis, prefix: str) -> dict[str, Any]:
    """The allocator's counters under ``prefix``: ``requests`` decided (each once), ``placed``, ``rejected``. No
    cache: every decision runs on the in-memory fold (``cache_hit_ratio`` is None, kept for readers of the old
    figure)."""
    raw = {text(k): int(v) for k, v in redis_client.hgetall(prefix + METRICS_KEY).items()}
    return {**{k: raw.get(k, 0) for k in ("requests", "placed", "rejected")}, "cache_hit_ratio": None}


# ---------------------------------------------------------------------------------------------------------
# faust wiring: the consumer group on `allocations` says which partitions this process decides.

def build_app(cfg: Config, *, registry: SchemaRegistry | None = None, redis_client: redis.Redis | None = None,
              consumer: str = DEFAULT_CONSUMER, **settings: Any):
    """The allocator's faust app, its (ownership-only) agent, and the ``Allocator`` it drives."""
    registry = registry or SchemaRegistry.from_dir()
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    partition_map = MapFollower.start(cfg, registry, name="allocator-map")
    producer = EventProducer(cfg, registry, PRODUCER, route=partition_map)
    dead_letters = DeadLetters(producer, PRODUCER)
    allocator = Allocator(cfg, registry, redis_client or cfg.redis_client(), producer,
                          consumer=consumer, partition_map=partition_map)
    # No tables, so no standby copies of them: without standbys faust's assignor also rebalances towards an even
    # split when an allocator joins (with them it leaves each member what it holds up to ceil(partitions / members),
    # and a joining allocator could get nothing: README, "A region on several machines").
    app = make_app(cfg, APP_ID, **{"table_standby_replicas": 0, **settings})
    allocations = app.topic(catalogue.name("allocations"), key_serializer="raw", value_serializer="raw",
                            partitions=cfg.partitions)
    stop = threading.Event()

    @app.agent(allocations, name=f"{APP_ID}.own")
    async def own(stream):
        """Ownership only: the fold reads these records; being in the group says which partitions are ours."""
        async for _ in stream.take_events(1000, within=0.1):
            pass

    @app.on_partitions_assigned.connect
    async def assigned(app, assigned, **kwargs) -> None:  # noqa: ARG001 - faust's signal signature
        mine = sorted({tp.partition for tp in assigned if tp.topic == allocator.allocations})
        await asyncio.get_running_loop().run_in_executor(None, allocator.assign, mine)
        log.info("allocator: owns allocations partitions %s (fences %s)", mine, allocator.owned)

    @app.on_partitions_revoked.connect
    async def revoked(app, revoked, **kwargs) -> None:  # noqa: ARG001
        allocator.revoke({tp.partition for tp in revoked if tp.topic == allocator.allocations})

    @app.task
    async def run_loop() -> None:
        """The allocator's own thread (blocking: the fold consumer, Redis, the producer), stopped with the app."""
        thread = threading.Thread(target=allocator.run, args=(stop, dead_letters), name="allocator-loop",
                                  daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                await asyncio.sleep(0.5)
            if allocator.crash is not None:
                raise allocator.crash
        finally:
            stop.set()

    return app, own, allocator


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics.serve_worker(Config.from_env().run_dir, OWNED_METRICS)  # infra/metrics.py; `up` lists the targets
    for result in ("placed", "unplaceable", "conflict"):
        metrics.ALLOCATION_ATTEMPTS.labels(result=result)  # every result's series from the start, at 0
    app, _, _ = build_app(Config.from_env().as_principal("allocator"))
    faust.Worker(app, loglevel="INFO").execute_from_commandline()


if __name__ == "__main__":
    main()
