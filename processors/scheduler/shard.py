"""The scheduler as running shards: one faust agent over the co-partitioned topics it reads, state in tables.

    python -m processors.scheduler.shard     # one worker = one shard; configuration from ROPEWALK_* (infra.config)

Start several workers and they share the partitions of ``intents``, ``allocations``, ``tasks``, ``machines``,
``unavailability`` and ``taskcontrol``: **consumer-group partition assignment is the sharding** (DESIGN.md). All are
keyed by entitlement and co-partitioned, so the worker that owns partition p of one owns p of all, and sees every
event of the entitlements hashed to p, in log order. Kill a worker and the group hands its partitions to the
survivors, which recover the partitions' table data from the changelogs before they read on.

```
 intents, allocations, tasks,     take_batches: what queued, until a 1 ms gap
 machines, unavailability,  ────► gate: offset guard; record header producer=scheduler ──► passed over, undecoded
 taskcontrol (one faust topic)    decode (bad bytes ──► deadletter)
                                     │
                                     ▼
                         load the slice of the state the batch concerns (its jobs, entitlements, machines)
                         decide() each event in order on it (pure; one that raises ──► deadletter, state kept)
                                     │
                                     ▼
                         produce + flush the batch's output (a job's state published once per batch) ─┐
                                     │   (meanwhile)                                                       │
                                     ▼                                                                     ▼
     tables ◄── 1. new task chunks ─ acks and the output's flush ─ 2. job headers, index, entitlements, machines,
                buckets ─ acks ─
                3. source offsets, tombstones of chunks no header names any more  (store.py: "Delivery")
 timer (RETRY_S) ──► retry_unplaced over the jobs of the partitions this worker actively owns ──► same path
```

**Tables** (memory store, each backed by a changelog topic co-partitioned with the sources):

    jobs            job id                  -> a job's header: the job without its tasks, and which chunk versions
                                               hold them (processors/scheduler/store.py)
    job_chunks      "<job>#<i>@<version>"   -> {"entitlement", "tasks": records of the job's tasks i*500..i*500+499}
    entitlements    entitlement name        -> the Entitlement's fields
    machines_down   machine id              -> status or unavailability kind (absent: UP)
    offsets         "<topic>/<partition>"   -> the next offset of that source partition to apply (offsets.py)
    limits          "shard/<partition>"     -> the shard's token bucket for destructive operations
                                               (processors/taskcontrol/limiter.py)

A changelog record holds at most one chunk of 500 tasks (~120 KB of JSON), whatever the job's size, and a batch
writes only the chunks whose tasks changed, once per batch (not per event). Beside the tables, two things in memory
that are not state, each derived from the tables: per job, the header this worker last wrote and the ``Job`` it
stands for (a memo used only while the table still holds that very object; it spares assembling the job from its
chunks on every batch); and the machine index, ``"<entitlement>|<machine>"`` -> the ids of that entitlement's
jobs with a task placed on the machine (``MachineJobs``), built from the stored jobs' chunks when first needed
after an assignment and kept in step by every write. It was a changelog table of its own until it made ~20 of the
~28 changelog records a job of 36 tasks cost (a record per machine a job's tasks came to or left), the largest
share of the shard's time in a burst (py-spy, 100,000 machines).

Every value is written to the changelog partition of its entitlement (``partition_for(entitlement)``), which is
the partition of the event being processed for every entitlement-keyed event; so a partition's changelog holds
exactly the state of that partition's entitlements, and a worker that takes the partition over recovers it.

**Which jobs an event concerns** is ``decide.concerned_jobs``'s rule (one place, checked against ``decide`` on every
event of the unit tests' ``Sim``). Intents and allocation results name their job (``job_id``); a TaskStatesChanged
names the jobs of its reports. Machine and unavailability events are keyed by the machines' owner, and ``decide``
only moves that entitlement's jobs off the machines, so the machine index answers in O(jobs on the
machines) instead of a scan of the shard's jobs. A machine event keyed to an entitlement this shard does not know
(a free pool key, ``free/<dc>``) makes ``decide`` look at every job: then the jobs of the event's partition are
scanned (O(jobs held by this worker)), which is rare.

**Own echoes and ignored types.** The scheduler's own events come back on the topics it reads. Every record an
``EventProducer`` sends carries the headers ``producer`` and ``type``; a record whose producer is ``scheduler``, or
whose type ``decide`` does nothing with (``CONSUMED``: no MachineRegistered, no assignment echoes), is passed over
in the gate, before decoding (after the offset guard has counted it). Records without the headers (older logs,
other writers) are decoded, and ``decide`` drops the scheduler's own by ``is_own`` and ignores the other types.

**Batches.** ``faustwire.take_batches`` hands the agent what has queued: a batch ends when no new record came for
``BATCH_GAP_S`` (1 ms), or at 500 records, or 20 ms after its first record. An idle shard decides a lone record
1 ms after it came; a busy one decides everything that queued while it was busy in one batch (faust's
``take_events`` waits a fixed window instead: 10 ms made every lone record wait, 2 ms cut a burst into batches of
~15 records, each some six produce requests of output and changelog). The batch is decided on one state, event after event in log order (each
event with the shard bucket of its own partition), its output produced and flushed once, and the tables written
once: a job that many events of the batch touched is written once, with only its changed chunks.

**Delivery** (at-least-once; DESIGN.md). For each batch: decide, produce the output and *flush it* while the new
chunks of step 1 are written (no header names them yet, so they may be durable before the output is), then write
the rest of the tables in the three steps above, step 2 only once the output is flushed; faust commits the offsets only after the batch is handed back (acked), and
flushes its producer before committing. A crash before the table writes makes the successor re-decide the
batch's events on the old state and re-emit the same events (ids derive from the input's ids); a crash between
or after them leaves every job whole, old or new (store.py), and a job already at its new header finds the events
in its duplicate ring and emits nothing (their output was flushed already). The offsets of step 3 are on the log
only after the state they stand for (the flush of step 2): the offset guard never skips an event whose effect
was lost. An event whose decision raises is sent to ``deadletter`` with reason ``processing_failed``; the rest of
the batch goes on from the state before it. If the broker does not take a batch's output, nothing of it is stored:
its records are decided again one at a time, each once more after a pause if refused, and one still refused is
dead-lettered (``processing_failed``): a record the broker refuses for ever (too big, say) does not stop the shard
for other entitlements. The tables' writes are waited for (BARRIER_TIMEOUT_S at a time, then written again: the
same keys and values), not given up. Any other failure makes the shard read the batch again from the stored
offsets (``OffsetGuard.rewind``).

Known limits: ``machines_down`` is keyed by machine alone and written to the partition of the event that
changed it, so a machine that moves to an entitlement of another partition leaves its old entry in the old
partition's changelog. Keys this worker wrote for a partition it later loses stay in its memory until it gets
the partition back (faust's memory store forgets only keys it recovered); reads by job id happen only on the
owning partition, and every scan filters by partition, so they are never acted on.

**Timer.** Every ``RETRY_S`` (``ROPEWALK_SCHEDULER_RETRY_S``, default 10 s) ``retry_unplaced`` releases throttled
operations, re-asks controllers whose ack is overdue, and re-asks placement of tasks parked by an
AllocationRejected, for the jobs of the partitions this worker actively owns (standby copies of other workers'
partitions, which faust also keeps in the same tables, are left alone); then it deletes chunk records no header
names (``store.orphans``: left by a write a crash interrupted). The agent and the timer share an
``asyncio.Lock``: a decision reads and writes its jobs without the other interleaving.

**Stalls.** A second timer (every ``offsets.STALL_S``) seeks back a partition the offset guard finds stalled, gives
back a source partition faust left out of its fetch for 30 s (``faustwire.FlowWatch``: a buffer-pressure pause
whose release never ran), and logs once a partition that has been below its high watermark for 30 s with what
faust and aiokafka say of it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import faust

from infra import metrics
from infra.config import Config
from processors.allocator.placement import Entitlement
from processors.scheduler import store as st
from processors.scheduler.metrics import ShardMetrics
from processors.scheduler.decide import CONSUMED, MACHINE_EVENTS, decide, machines_of, named_jobs, retry_unplaced
from processors.scheduler.model import Job, SchedulerState, state_of
from processors.scheduler.work import PRODUCER
from processors.scheduler.offsets import APPLY, GAP, STALL_S, OffsetGuard, partition_key
from processors.taskcontrol.limiter import Bucket, Limits, bucket_of, bucket_record
from streams import batches
from streams.clients import PRODUCER_HEADER, EventProducer, passes_type
from streams.deadletter import PROCESSING_FAILED, DeadLetters
from streams.events import Event
from streams.faustwire import FlowWatch, decode_message, header_of, make_app, route_dead_letter, take_batches
from streams.partitioner import partition_for
from streams.serde import SchemaRegistry
from streams.topics import CHANGELOG_CONFIG, Topics

log = logging.getLogger(__name__)

APP_ID = "scheduler"
SOURCES = ("intents", "allocations", "tasks", "machines", "unavailability", "taskcontrol")
RETRY_S = 10.0  # default interval of the retry_unplaced timer (also releases throttled operations, re-asks controllers)
FLUSH_S = 30.0  # how long producing one batch's output may wait for the broker's acks
BATCH_MAX = 500  # records handed to one decision batch at most
BATCH_GAP_S = 0.001  # a batch is decided once no new record came for this long (faustwire.take_batches)...
BATCH_MAX_WAIT_S = 0.02  # ...or its first record waited this long
BARRIER_TIMEOUT_S = 15.0  # how long the tables' writes may wait for the broker's acks before the batch is retried
FAILED_BATCH_PAUSE_S = 1.0  # after an output the broker did not take, before trying again
SLOW_BATCH_S = 0.25  # a batch that takes longer is logged with where its time went
COALESCED = {"JobStatePublished": "job_id", "JobTasksPublished": None}  # only a batch's last one per key is produced

# Environment variables of a worker (beside infra.config's), mapped to faust settings; tests lower them.
FAUST_ENV = {
    "ROPEWALK_FAUST_SESSION_TIMEOUT": "broker_session_timeout",
    "ROPEWALK_FAUST_HEARTBEAT_INTERVAL": "broker_heartbeat_interval",
    "ROPEWALK_FAUST_REBALANCE_TIMEOUT": "broker_rebalance_timeout",
    "ROPEWALK_FAUST_COMMIT_INTERVAL": "broker_commit_interval",
}
RETRY_ENV = "ROPEWALK_SCHEDULER_RETRY_S"
PROFILE_ENV = "ROPEWALK_PROFILE_DIR"  # a directory: profile the worker (cProfile) and write its stats there at exit


class StoreTimeout(RuntimeError):
    """The broker did not acknowledge a batch's changelog records in time (transient: the batch is read again)."""


class OutputRefused(RuntimeError):
    """The broker did not take a batch's output (``DeliveryError``): transient, or a record it refuses for ever."""


def settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """faust settings overridden by ``ROPEWALK_FAUST_*`` (seconds, floats); unset ones keep faustwire's."""
    env = os.environ if env is None else env
    return {setting: float(env[name]) for name, setting in FAUST_ENV.items() if env.get(name)}


def shard_bucket_key(partition: int) -> str:
    return f"shard/{partition}"


def is_ignored_record(msg: Any) -> bool:
    """Whether a record's ``type`` header names an event ``decide`` does nothing with (a MachineRegistered, say:
    100,000 of them when a region registers): passed over undecoded, like the scheduler's own echoes."""
    return not passes_type(getattr(msg, "headers", None), CONSUMED)


def is_own_record(msg: Any) -> bool:
    """Whether a record's ``producer`` header names the scheduler (its own event, come back): read, not decoded."""
    name = header_of(msg, PRODUCER_HEADER)
    if name is None:
        return False
    return name == PRODUCER.encode() or name.startswith(PRODUCER.encode() + b"/")


def coalesce(events: list[Event]) -> list[Event]:
    """A batch's output with only the last JobStatePublished per job and JobTasksPublished per part (the state
    topics keep only the latest per key anyway); everything else as it is, in order."""
    seen: set[tuple[str, str]] = set()
    out = []
    for ev in reversed(events):
        if ev.type in COALESCED:
            key = (ev.type, ev.entity_id)
            if key in seen:
                continue
            seen.add(key)
        out.append(ev)
    out.reverse()
    return out


class ShardTables:
    """The shard's faust tables, and how one batch's slice of ``SchedulerState`` is read from and written back to
    them. Writes go to the table's store and to the changelog partition of the entitlement."""

    def __init__(self, app: faust.App, partitions: int):
        self.app = app
        self.partitions = partitions
        opts = {"default": None, "key_type": str, "value_type": None, "partitions": partitions,
                "extra_topic_configs": dict(CHANGELOG_CONFIG)}
        self.jobs = app.Table("scheduler-jobs", **opts)  # job id -> header (store.py)
        self.job_chunks = app.Table("scheduler-job-chunks", **opts)  # "<job>#<i>@<v>" -> a chunk of its tasks
        self.entitlements = app.Table("scheduler-entitlements", **opts)
        self.machines_down = app.Table("scheduler-machines-down", **opts)
        self.machine_jobs = st.MachineJobs()  # in memory, derived from jobs and job_chunks (see the module docstring)
        self.offsets = app.Table("scheduler-offsets", **opts)  # "<topic>/<partition>" -> next offset to apply
        self.limits = app.Table("scheduler-limits", **opts)  # "shard/<partition>" -> the shard's token bucket
        # A memo, not state: job id -> (the header this worker last wrote or read, the Job it stands for). Used
        # only while the table still holds that very object (a recovery or another worker's write puts a new one),
        # so it can never disagree with the table.
        self._decoded: dict[str, tuple[dict, Job]] = {}
        self._unacked: list = []  # changelog sends since the last barrier (faust FutureMessages)
        self.written_chunks = 0  # chunk records written (a figure for tests and profiles)
        self.store_ms = (0, 0)  # the last store's wait for its chunks and output, then for its headers (logged)

    def partition_of(self, entitlement: str) -> int:
        return partition_for(entitlement, self.partitions)

    # -- reading ----------------------------------------------------------------------------------------------
    def job_ids_for(self, event: Event, partition: int) -> list[str]:
        """The jobs ``event`` concerns: ``decide.concerned_jobs``'s rule, machine events through the machine index
        (a key no entitlement of this shard has: every job of the event's partition, the ones this shard holds)."""
        named = named_jobs(event)
        if named or event.type not in MACHINE_EVENTS:
            return named
        machines = batches.machine_ids(event)
        if self.entitlements.data.get(event.entitlement) is not None:
            if not self.machine_jobs.built:
                self.machine_jobs.build(self.jobs.data, self.job_chunks.data)
            ids: set[str] = set()
            for m in machines:
                ids.update(self.machine_jobs.jobs(event.entitlement, m))
            return sorted(ids)
        # a key no entitlement of this shard has (free/<dc>): every job of the event's partition
        return sorted(k for k, r in list(self.jobs.data.items())
                      if r is not None and self.partition_of(r["entitlement"]) == partition)

    def load(self, events: Iterable[Event], job_ids: Iterable[str]) -> tuple[SchedulerState, dict[str, dict]]:
        """The slice of the state: the given jobs, the entitlements they and ``events`` name, and whether each
        machine they (and the machine events) touch is down. Also the job headers as read (to diff on write-back)."""
        headers = {j: r for j in job_ids if (r := self.jobs.data.get(j)) is not None}
        jobs = [self._job_of(j, r) for j, r in headers.items()]
        ent_names = {j.entitlement for j in jobs}
        machines: set[str] = set()
        for j in jobs:
            machines |= machines_of(j)
        for event in events:
            ent_names.add(event.entitlement)
            if event.type in MACHINE_EVENTS:
                machines.update(batches.machine_ids(event))
        ents = [Entitlement(**e) for n in sorted(ent_names) if (e := self.entitlements.data.get(n)) is not None]
        down = {m: s for m in machines if (s := self.machines_down.data.get(m)) is not None}
        return state_of(jobs, ents, down), headers

    def _job_of(self, job_id: str, header: dict) -> Job:
        memo = self._decoded.get(job_id)
        if memo is not None and memo[0] is header:
            return memo[1]
        job = st.job_of(header, self.job_chunks.data)
        self._decoded[job_id] = (header, job)
        return job

    def bucket(self, partition: int) -> Bucket | None:
        """The rate-limiter bucket of the shard's ``partition`` (processors/taskcontrol/limiter.py)."""
        return bucket_of(self.limits.data.get(shard_bucket_key(partition)))

    def with_bucket(self, state: SchedulerState, partition: int) -> SchedulerState:
        return dataclasses.replace(state, shard_bucket=self.bucket(partition))

    def active_job_ids(self, active_partitions: set[int]) -> list[str]:
        return sorted(k for k, r in list(self.jobs.data.items())
                      if r is not None and self.partition_of(r["entitlement"]) in active_partitions)

    # -- writing ----------------------------------------------------------------------------------------------
    def _put(self, table: faust.Table, partition: int, key: str, value: Any) -> None:
        """Set (or with None, delete: a tombstone) ``key`` in the store and in the changelog's ``partition``."""
        if value is None:
            table.data.pop(key, None)
            fut = table.send_changelog(partition, key, None, value_serializer="raw")
        else:
            table.data[key] = value
            fut = table.send_changelog(partition, key, value)
        self._unacked.append(fut)

    async def _barrier(self) -> None:
        """Wait until the broker has acknowledged every changelog record sent since the last barrier (each
        record's own future: faust's ``producer.flush()`` may return with records still in its buffer). Raises
        ``StoreTimeout`` after BARRIER_TIMEOUT_S (a broker slow to serve a changelog partition): the batch is read
        again, nothing is lost (the records are still on their way; a second write of a key is the same value)."""
        futs, self._unacked = self._unacked, []
        if not futs:
            return
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.gather(*futs)), BARRIER_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise StoreTimeout(f"{sum(not f.done() for f in futs)} of {len(futs)} changelog records not "
                               f"acknowledged after {BARRIER_TIMEOUT_S:.0f} s") from None

    async def store(self, before: SchedulerState, after: SchedulerState, headers: Mapping[str, dict], *,
                    down_partitions: Mapping[str, int] | None = None, buckets: Mapping[int, Bucket | None] = (),
                    applied: Mapping[str, tuple[int, int]] = (), output: Awaitable[Any] | None = None) -> int:
        """Write back what a batch's decisions changed, in the three steps of store.py's delivery argument;
        returns the number of jobs written. ``down_partitions``: machine -> the partition of the event that
        changed its ``machines_down`` entry; ``buckets``: partition -> its bucket after the batch; ``applied``:
        source partition key -> (its changelog partition, the next offset to apply), written last; ``output``:
        the batch's output being produced, awaited once the new chunks are sent and before any header is (the
        two round trips overlap; a header is still never written before the output it stands for is flushed)."""
        plans: list[tuple[Job, int, st.Plan]] = []
        for job_id, job in after.jobs.items():
            old = before.jobs.get(job_id)
            if old is job:
                continue
            plans.append((job, self.partition_of(job.entitlement),
                          st.plan(old, headers.get(job_id), self.job_chunks.data, job)))
        t0 = time.monotonic()
        # 1. the new chunks, durable before any header names them
        if any(p.chunks for _, _, p in plans):
            for _, part, p in plans:
                for key, value in p.chunks.items():
                    self._put(self.job_chunks, part, key, value)
                    self.written_chunks += 1
            await self._barrier()
        if output is not None:
            await output  # raises OutputRefused: nothing but orphan chunks was written (drop_orphans)
        t1 = time.monotonic()
        # 2. the headers, and the other tables' values
        wrote = False
        for job, part, p in plans:
            self._put(self.jobs, part, job.id, p.header)
            self._decoded[job.id] = (p.header, job)
            self.machine_jobs.update(job.id, job.entitlement, machines_of(before.jobs.get(job.id)),
                                     machines_of(job))
            wrote = True
        for name, ent in after.entitlements.items():
            if before.entitlements.get(name) != ent:
                self._put(self.entitlements, self.partition_of(name), name, dataclasses.asdict(ent))
                wrote = True
        if after.machines_down is not before.machines_down:
            for m in set(before.machines_down) | set(after.machines_down):
                if before.machines_down.get(m) != after.machines_down.get(m):
                    part = (down_partitions or {}).get(m, 0)
                    self._put(self.machines_down, part, m, after.machines_down.get(m))
                    wrote = True
        for part, bucket in dict(buckets).items():
            if bucket != self.bucket(part):
                self._put(self.limits, part, shard_bucket_key(part), bucket_record(bucket))
                wrote = True
        obsolete = [(part, key) for _, part, p in plans for key in p.obsolete]
        if wrote and (applied or obsolete):
            await self._barrier()
        self.store_ms = (round((t1 - t0) * 1e3), round((time.monotonic() - t1) * 1e3))
        # 3. the offsets, and the chunks no durable header names any more
        for key, (part, nxt) in dict(applied).items():
            self._put(self.offsets, part, key, nxt)
        for part, key in obsolete:
            self._put(self.job_chunks, part, key, None)
        return len(plans)

    def drop_orphans(self, active_partitions: set[int]) -> int:
        """Delete the chunk records of the active partitions that no header names (``store.orphans``: left by a
        write a crash interrupted, or a tombstone lost with it). Between decisions a chunk that a header on the log
        names is named by the header in memory too: ``store`` drops a chunk from a header only as ``obsolete``, and
        deletes it itself once the new header is flushed. Returns how many were deleted."""
        parts = {k: self.partition_of(v["entitlement"]) for k, v in list(self.job_chunks.data.items())
                 if v is not None and self.partition_of(v["entitlement"]) in active_partitions}
        garbage = st.orphans(parts, self.jobs.data)
        for key in garbage:
            self._put(self.job_chunks, parts[key], key, None)
        return len(garbage)


def build_app(cfg: Config, *, registry: SchemaRegistry | None = None, retry_s: float = RETRY_S, **settings: Any):
    """The scheduler's faust app, its agent, its timer and its tables; ``settings`` override faust's."""
    registry = registry or SchemaRegistry.from_dir()
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    producer = EventProducer(cfg, registry, PRODUCER)
    dead_letters = DeadLetters(producer, PRODUCER)
    app = make_app(cfg, APP_ID, **settings)
    tables = ShardTables(app, cfg.partitions)
    source_names = [catalogue.name(t) for t in SOURCES]
    source = app.topic(*source_names, key_serializer="raw", value_serializer="raw", partitions=cfg.partitions)
    lock = asyncio.Lock()
    limits = Limits.from_env(os.environ)
    max_tasks = cfg.max_tasks_per_job

    async def produce(events: list[Event]) -> None:
        def send_all() -> None:
            producer.send_all(events, validate=False)  # built by decide from decoded events; fastavro still checks
            producer.flush(FLUSH_S)
        try:
            await asyncio.get_running_loop().run_in_executor(None, send_all)
        except Exception as exc:  # noqa: BLE001 - DeliveryError, BufferError, a schema refused: see apply_or_retry
            raise OutputRefused(f"{type(exc).__name__}: {exc}") from exc

    async def store(*args: Any, **kwargs: Any) -> None:
        """``tables.store``, written again while the broker is slow to acknowledge it (the same keys and values:
        idempotent); a decision's output is on the log already, so its state must follow, not be given up."""
        while True:
            try:
                await tables.store(*args, **kwargs)
                return
            except StoreTimeout as exc:
                log.warning("scheduler: storing a decision's state: %s; writing it again", exc)

    shard_metrics = ShardMetrics()  # this process's metrics (processors/scheduler/metrics.py)

    async def apply(items: list[tuple[Any, Any, Event]], passed: Mapping[str, tuple[int, int]] = MappingProxyType({})
                    ) -> None:
        """Decide a batch of (message, record, event), in order, on one state; produce; store (with the offsets
        of the records the batch ``passed`` over: key -> (partition, next offset))."""
        async with lock:
            t0 = time.monotonic()
            now = int(time.time() * 1000)
            job_ids: set[str] = set()
            for _, rec, ev in items:
                job_ids.update(tables.job_ids_for(ev, rec.partition))
            start, headers = tables.load([ev for _, _, ev in items], sorted(job_ids))
            state = start
            buckets: dict[int, Bucket | None] = {}
            down_partitions: dict[str, int] = {}
            out: list[Event] = []
            failed = []
            for msg, rec, ev in items:
                part = rec.partition
                if part not in buckets:
                    buckets[part] = tables.bucket(part)
                state = dataclasses.replace(state, shard_bucket=buckets[part])
                t_ev = time.monotonic()
                try:
                    new, emitted = decide(state, ev, now, limits=limits, max_tasks=max_tasks)
                except Exception as exc:  # noqa: BLE001 - one bad event must not stop the shard
                    log.exception("scheduler: %s %s at %s[%d]@%d failed", ev.type, ev.event_id, rec.topic, part,
                                  rec.offset)
                    failed.append((msg, f"{ev.type}: {type(exc).__name__}: {exc}"))
                    continue
                try:
                    shard_metrics.decided(ev, emitted, time.monotonic() - t_ev, now)
                except Exception:  # noqa: BLE001 - a metric is never a reason to stop deciding
                    log.exception("scheduler: metrics of %s %s", ev.type, ev.event_id)
                if new.machines_down is not state.machines_down:
                    for m in set(new.machines_down) | set(state.machines_down):
                        if new.machines_down.get(m) != state.machines_down.get(m):
                            down_partitions[m] = part
                if ev.type in MACHINE_EVENTS:  # rare, and what moved where is worth a line
                    log.info("scheduler: %s of %s (%d machines) on partition %d: %d events", ev.type,
                             ev.entitlement, len(batches.machine_ids(ev)), part, len(emitted))
                buckets[part] = new.shard_bucket
                state = new
                out.extend(emitted)
            for msg, detail in failed:
                await route_dead_letter(dead_letters, msg, PROCESSING_FAILED, detail)
            t1 = time.monotonic()
            # The output is flushed before any table value that stands for it (see "Delivery" in the module
            # docstring); it is produced while the new chunks are sent, which need not wait for it.
            output = asyncio.ensure_future(produce(coalesce(out))) if out else None
            applied = dict(passed)  # the offset after the last record of this batch, per partition
            for _, rec, _ in items:
                key = partition_key(rec.topic, rec.partition)
                if key not in applied or rec.offset + 1 > applied[key][1]:
                    applied[key] = (rec.partition, rec.offset + 1)
            try:
                if (state is not start or any(b != tables.bucket(p) for p, b in buckets.items())
                        or guard.persist_due(applied)):
                    await store(start, state, headers, down_partitions=down_partitions, buckets=buckets,
                                applied=applied, output=output)
            finally:
                if output is not None:
                    await output  # also when storing failed: its outcome is what apply_or_retry acts on
            t2 = time.monotonic()
            if t2 - t0 > SLOW_BATCH_S:
                log.info("scheduler: slow batch: %d records, %d events out, %.0f ms (decide %.0f, produce and store "
                         "%.0f: chunks and output %d, headers %d)", len(items), len(out), (t2 - t0) * 1e3,
                         (t1 - t0) * 1e3, (t2 - t1) * 1e3, *tables.store_ms)

    guard = OffsetGuard(tables.offsets.data)

    async def seek_back(tp: Any, key: str, why: str) -> None:
        target = guard.should_seek(key, time.monotonic())
        if target is not None:
            log.warning("scheduler: %s on %s: seeking back to offset %d", why, key, target)
            await app.consumer.seek_wait({tp: target})  # in the consumer's thread, which owns the fetcher

    async def gate(msg: Any) -> bool:
        """The offset guard in front of decoding: whether the record is the next of its partition (applied in
        order, once: processors/scheduler/offsets.py)."""
        key = partition_key(msg.topic, msg.partition)
        v = guard.check(key, msg.offset, time.monotonic())
        if v == GAP:
            await seek_back(msg.tp, key, f"gap before offset {msg.offset}")
        return v == APPLY

    @app.agent(source, name=f"{APP_ID}.schedule")
    async def schedule(stream):
        missed: dict[bytes, float] = {}
        async for batch in take_batches(stream, BATCH_MAX, BATCH_GAP_S, BATCH_MAX_WAIT_S):
            items = []
            passed: dict[str, tuple[int, int]] = {}  # records passed over (no decision): key -> (partition, next)
            for fev in batch:
                msg = fev.message
                if not await gate(msg):
                    continue
                got = None
                if not is_own_record(msg) and not is_ignored_record(msg):  # own echoes, types decide ignores
                    got = await decode_message(msg, registry, dead_letters, catalogue, cfg=cfg, missed=missed)
                if got is not None:
                    items.append((msg, *got))
                else:  # passed over undecoded, or dead-lettered: its offset still moves on
                    passed[partition_key(msg.topic, msg.partition)] = (msg.partition, msg.offset + 1)
            # A batch of only passed-over records (a region's registration: a million MachineRegistered) stores
            # its offsets once they run PERSIST_AFTER ahead of the table's, or a rebalance reads them all again.
            if items or guard.persist_due(passed):
                await apply_or_retry(items, passed)

    async def apply_or_retry(items: list, passed: Mapping[str, tuple[int, int]]) -> None:
        """Apply a batch. If the broker does not take its output (nothing is stored then), apply its records one
        at a time, each once more after a pause if refused, and send one still refused to ``deadletter``
        (processing_failed): a record the broker refuses for ever does not stop the shard for everyone else. (A
        batch is not read again: answers to what part of its output did reach the log may already follow it.)
        Anything else that fails (a bug) makes the shard read the batch again from the stored offsets."""
        try:
            await apply(items, passed)
            return
        except OutputRefused:
            log.exception("scheduler: the output of a batch of %d records was not taken by the broker; deciding "
                          "them one at a time", len(items))
        except Exception:  # noqa: BLE001 - not an infrastructure failure we know: read the batch again
            log.exception("scheduler: a batch of %d records failed; reading it again", len(items))
            await read_again(items)
            return
        for n, item in enumerate(items):
            msg, rec, ev = item
            try:
                for attempt in (1, 2):
                    try:
                        await apply([item])
                        break
                    except OutputRefused as exc:
                        if attempt == 2:
                            log.error("scheduler: %s %s at %s[%d]@%d: output refused twice, dead-lettered: %s",
                                      ev.type, ev.event_id, rec.topic, rec.partition, rec.offset, exc)
                            await route_dead_letter(dead_letters, msg, PROCESSING_FAILED,
                                                    f"{ev.type}: output not taken by the broker: {exc}")
                        else:
                            await asyncio.sleep(FAILED_BATCH_PAUSE_S)
            except Exception:  # noqa: BLE001 - the broker away (even for dead letters), or a bug: read it again
                log.exception("scheduler: %s at %s[%d]@%d failed; reading the rest of its batch again", ev.type,
                              rec.topic, rec.partition, rec.offset)
                await read_again(items[n:])
                return

    async def read_again(items: list) -> None:
        """Seek back to the stored offsets of these records' partitions (the offset guard falls back to them)."""
        starts: dict[str, Any] = {}
        for msg, rec, _ in items:
            starts.setdefault(partition_key(rec.topic, rec.partition), msg.tp)
        for key, tp in starts.items():
            guard.rewind(key)
            await seek_back(tp, key, "a batch not applied")
        await asyncio.sleep(FAILED_BATCH_PAUSE_S)

    @app.timer(retry_s, name=f"{APP_ID}.retry_unplaced")
    async def retry() -> None:
        active = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic in source_names}
        if not active:
            return
        async with lock:
            for part in sorted(active):  # one partition at a time: each has its own shard bucket
                state, headers = tables.load((), tables.active_job_ids({part}))
                state = tables.with_bucket(state, part)
                new, out = retry_unplaced(state, int(time.time() * 1000), limits=limits)
                if out:
                    await produce(coalesce(out))
                if new is not state:
                    await store(state, new, headers, buckets={part: new.shard_bucket})
            dropped = tables.drop_orphans(active)
            if dropped:
                log.warning("scheduler: deleted %d chunk records no job names (left by an interrupted write)", dropped)
        metrics.TIMER_TICKS.labels(worker=APP_ID).inc()  # a round of the retry timer done, its output produced

    flow = FlowWatch()
    behind: dict[str, float] = {}  # partition key -> since when it is below its high watermark (logged once)

    @app.timer(STALL_S, name=f"{APP_ID}.stalls")
    async def find_stalls() -> None:
        now = time.monotonic()
        sources = [tp for tp in app.assignor.assigned_actives() if tp.topic in source_names]
        for tp, why in flow.check(app.consumer, sources, now):
            log.warning("scheduler: %s[%d] was out of the consumer's fetch for %.0f s (%s): fetching it again",
                        tp.topic, tp.partition, flow.after_s, why)
        for tp in sources:
            key = partition_key(tp.topic, tp.partition)
            try:
                high = app.consumer.highwater(tp)  # from the last fetch response
            except Exception:  # noqa: BLE001 - a partition moving away in a rebalance: look next time
                continue
            if high is None or high <= guard.next_offset(key):
                behind.pop(key, None)
            elif now - behind.setdefault(key, now) >= flow.after_s:
                behind[key] = float("inf")  # one line an episode (a backlog, or a stall)
                log.warning("scheduler: %s has been below its high watermark for %.0f s (next offset %d, high %d; "
                            "%s)", key, flow.after_s, guard.next_offset(key), high, flow.describe(app.consumer, tp))
            if guard.stalled(key, high, now):
                await seek_back(tp, key, "stalled below the high watermark")

    @app.on_partitions_assigned.connect
    async def announce(app, assigned, **kwargs) -> None:  # noqa: ARG001 - faust's signal signature
        guard.forget()
        behind.clear()  # a partition back after a move is watched afresh (its episode may have been logged)
        tables.machine_jobs.forget()  # the recovery that follows may change the tables: built again when needed
        mine = sorted({tp.partition for tp in assigned if tp.topic in source_names})
        log.info("scheduler shard %d: assigned partitions %s", os.getpid(), mine)

    return app, schedule, tables


def _profile_to(directory: str) -> None:
    """``ROPEWALK_PROFILE_DIR``: profile this worker (cProfile, every thread's calls on the event loop's thread)
    and write ``scheduler-<pid>.prof`` there at exit (``python -m pstats FILE`` reads it). For measurements only."""
    import atexit
    import cProfile

    prof = cProfile.Profile()
    path = Path(directory) / f"scheduler-{os.getpid()}.prof"

    def dump() -> None:
        prof.disable()
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(path))

    atexit.register(dump)
    prof.enable()


# what a shard's target exports from its start (infra/metrics.own)
OWNED_METRICS = (metrics.SCHEDULING_ATTEMPT, metrics.SUBMIT_TO_RUNNING, metrics.PENDING_TASKS, metrics.TASK_MOVES,
                 metrics.TASKCONTROL_ACK, metrics.TASKCONTROL_PENDING, metrics.TIMER_TICKS)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics.serve_worker(Config.from_env().run_dir, OWNED_METRICS)  # infra/metrics.py; `up` lists the targets
    if os.environ.get(PROFILE_ENV):
        _profile_to(os.environ[PROFILE_ENV])
    retry_s = float(os.environ.get(RETRY_ENV) or RETRY_S)
    app, _, _ = build_app(Config.from_env().as_principal("scheduler"), retry_s=retry_s, **settings_from_env())
    faust.Worker(app, loglevel="INFO").execute_from_commandline()


if __name__ == "__main__":
    main()
