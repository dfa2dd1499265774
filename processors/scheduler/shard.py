"""The scheduler as running shards: one faust agent over the co-partitioned topics it reads, state in tables.

    python -m processors.scheduler.shard     # one worker = one shard; configuration from ROPEWALK_* (infra.config)

Start several workers and they share the partitions of ``intents``, ``allocations``, ``tasks``, ``machines``,
``unavailability`` and ``taskcontrol``: **consumer-group partition assignment is the sharding** (docs/architecture.md). All are
keyed by entitlement and co-partitioned, so the worker that owns partition p of one owns p of all, and sees every
event of the entitlements hashed to p, in log order. Kill a worker and the group hands its partitions to the
survivors, which recover the partitions' table data from the changelogs before they read on.

```
 intents, allocations, tasks,     FetchBatches: whole fetches, what queued until a 1 ms gap
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
 timer (RETRY_S) ──► retry_unplaced over the jobs with timer work of the partitions this worker actively owns,
                     50 at a time ──► same path (nothing while faust recovers the tables: faustwire.tables_ready)
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
whose type ``decide`` does nothing with (``CONSUMED``: no registration, no assignment echoes), is passed over
in the gate, before decoding (after the offset guard has counted it). Records without the headers (older logs,
other writers) are decoded, and ``decide`` drops the scheduler's own by ``is_own`` and ignores the other types.

**Batches.** The consumer hands the sources' records over as whole fetches (``faustwire.FetchBatches``: faust keeps
the group, the assignment, the tables and their recovery; its per-record delivery to a stream, several asyncio tasks
per record, ~90 µs against ~3 µs for aiokafka's ``getmany`` under it in ``bench/faust_overhead.py``, is skipped for
them), and a batch is what has queued: it ends when no new fetch came for ``BATCH_GAP_S`` (1 ms), or at 500
records, or 20 ms after its first record. An idle shard decides a lone record 1 ms after it came; a busy one decides
everything that queued while it was busy in one batch. The agent acks each record once its batch is handled (what
faust's commits go by). A rebalance's revocation drops the fetches not handed out yet and starts a new generation:
a batch fetched before it (being triaged, or waiting for the lock) is dropped or set aside, neither decided nor
acked, so no record of a partition now another shard's is decided here (``FetchBatches``, "Rebalances"); a
decision already under the lock ends before the revocation returns (``settle``), while the partitions are still
this shard's. The batch is decided on one state, event after event in log order (each
event with the shard bucket of its own partition), its output produced and flushed once, and the tables written
once: a job that many events of the batch touched is written once, with only its changed chunks.

**Delivery** (at-least-once; docs/architecture.md). For each batch: decide, produce the output and *flush it* while the new
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
partitions, which faust also keeps in the same tables, are left alone) that have something for it to do: each
header says so (``timer``: ``decide.has_timer_work`` of the job when written), so a round reads the headers and
decodes only those jobs. It works ``RETRY_SLICE_JOBS`` jobs at a time, each slice a decision of its own under the
lock (load, decide, produce, store), so the agent decides in between; a slice that fails is logged and the others
go on. The same slices take the jobs whose grace passed (``store.expired`` of their headers; ``decide.collect``)
out of the state: a tombstone for each of their state records (``work.state_keys``: ``state.jobs``, its
``state.tasks`` parts) is produced and flushed, then their header and chunks are deleted (a crash between the two
collects them again: the same tombstones). Then it deletes chunk records no header names (``store.orphans``: left by a write a crash interrupted). The
agent and the timer share an ``asyncio.Lock``: a decision reads and writes its jobs without the other interleaving.
(It was one decision over every active job, all partitions under the lock at once: at 100,000 machines a round
held the lock for 152 s while the broker was slow to take its output and state, 2026-11-27.)

**Recovery.** After a rebalance faust reads the changelogs of the partitions this worker keeps or takes into its
tables again, before the agent gets their records (``tables/recovery.py``): a kept partition from where its last
recovery stopped, i.e. every value this worker wrote since, in order; the job headers' topic is read beside the
chunks' topic, so until it is done a header may be an older version of itself naming a chunk the table no longer
(or not yet) holds. The timers go on meanwhile. So nothing is decided unless ``faustwire.tables_ready`` (from the
rebalance's first moment until faust has read every active changelog): the timer skips its round (or ends it), a
batch the agent holds is set aside (its offsets rewound in the guard; faust seeks to the committed offsets after
the recovery and the guard seeks back over the gap), the stall timer and the guard's seeks wait, and a revocation
waits for a decision under way to end (``settle``: its writes must be on the log before the recovery reads it).
The retry timer also deletes orphan chunks only then: on tables half recovered, a header read back at an older
version leaves its job's newest chunk unnamed, and deleting it would lose it on the log too (reasoned from the
code; a test run of the earlier timer deleted "orphans" in the middle of a recovery, the log stayed whole there).
A job the tables cannot give back whole all the same (``store.MissingChunk``, a header that is no job) is left
out of every decision and logged once; an event that names it is dead-lettered with reason ``job_unreadable``
and, if it names other jobs too, decided for those (``unreadable_named``); the shard goes on for every other job.
(The 2026-11-27 bench's shard died of ``MissingChunk`` in its retry timer during such a recovery.)

**Stalls.** A second timer (every ``offsets.STALL_S``) seeks back a partition the offset guard finds stalled (the
shard idle while records wait: no record came and no batch of the agent ended, a timer slice ending is no end of
idleness; or the partition starved while others' records come; never while a decision is under way, a batch
waiting for the lock included; once per episode, then with a doubling backoff: ``offsets.stall_step``), gives back
a source partition faust left out of its fetch for 30 s (``faustwire.FlowWatch``: a buffer-pressure pause whose
release never ran), and logs once a partition that has been below its high watermark for 30 s with what faust and aiokafka say of it.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import cProfile
import dataclasses
from collections import Counter
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import faust

from infra import metrics
from infra.config import Config
from infra.process import failpoint as process_failpoint
from processors.allocator.placement import Entitlement
from processors.scheduler import handover as ho
from processors.scheduler import store as st
from processors.scheduler.metrics import ShardMetrics
from processors.scheduler.decide import (
    CONSUMED, MACHINE_EVENTS, collect, decide, machines_of, named_jobs, retry_unplaced,
)
from processors.scheduler.model import Job, SchedulerState, state_of
from processors.scheduler.reasons import JOB_UNREADABLE
from processors.scheduler.work import PRODUCER, state_keys
from processors.scheduler.offsets import APPLY, GAP, STALL_S, TIMER, OffsetGuard, partition_key
from processors.taskcontrol.limiter import Bucket, Limits, bucket_of, bucket_record
from streams import batches
from infra.trust import verifier_for
from streams.clients import EPOCH_HEADER, FORWARDED_HEADER, PRODUCER_HEADER, TYPE_HEADER, EventProducer, passes_type
from streams.deadletter import PROCESSING_FAILED, DeadLetters
from streams.events import Event
from streams.faustwire import (FetchBatches, FlowWatch, decode_message, frozen_since, header_of, make_app,
                               route_dead_letter, tables_ready)
from streams.partitionmap import REASON_HELD, REASON_MOVED, REASON_MOVING, MapFollower, assignment_event
from streams.partitioner import partition_for
from streams.serde import SchemaRegistry
from streams.topics import BY_NAME, CHANGELOG_CONFIG, Topics, replication_config

log = logging.getLogger(__name__)

APP_ID = "scheduler"
SOURCES = ("intents", "allocations", "tasks", "machines", "unavailability", "taskcontrol", "handoff")
RETRY_S = 10.0  # default interval of the retry_unplaced timer (also releases throttled operations, re-asks controllers)
FLUSH_S = 30.0  # how long producing one batch's output may wait for the broker's acks
BATCH_MAX = 500  # records handed to one decision batch at most
BATCH_GAP_S = 0.001  # a batch is decided once no new fetch came for this long (faustwire.FetchBatches.take)...
BATCH_MAX_WAIT_S = 0.02  # ...or its first record waited this long
BARRIER_TIMEOUT_S = 15.0  # how long the tables' writes may wait for the broker's acks before the batch is retried
FAILED_BATCH_PAUSE_S = 1.0  # after an output the broker did not take, before trying again
SLOW_BATCH_S = 0.25  # a batch that takes longer is logged with where its time went
RETRY_SLICE_JOBS = 50  # jobs the retry timer decides on at a time, each slice under the lock on its own
SLOW_RETRY_S = 5.0  # a retry round that takes longer is logged with where its time went
SETTLE_S = 5.0  # a rebalance waiting this long for a decision under way says so (``settle``), and waits on
ho_types = frozenset({ho.HANDED_OVER, ho.MOVE_REQUESTED})  # a move's events: the shard's own, not decide's
SHARD_CONSUMED = CONSUMED | ho_types  # what the shard reads (any other type is passed over undecoded)
COALESCED = {"JobStatePublished": "job_id", "JobTasksPublished": None}  # only a batch's last one per key is produced

# Environment variables of a worker (beside infra.config's), mapped to faust settings; tests lower them.
FAUST_ENV = {
    "ROPEWALK_FAUST_SESSION_TIMEOUT": "broker_session_timeout",
    "ROPEWALK_FAUST_HEARTBEAT_INTERVAL": "broker_heartbeat_interval",
    "ROPEWALK_FAUST_REBALANCE_TIMEOUT": "broker_rebalance_timeout",
    "ROPEWALK_FAUST_COMMIT_INTERVAL": "broker_commit_interval",
}
RETRY_ENV = "ROPEWALK_SCHEDULER_RETRY_S"
TOMBSTONE_HEADERS = [(PRODUCER_HEADER, PRODUCER.encode())]  # a state record deleted by the shard (decide.collect)
# A test's crash between two durable steps of a move: ``after_freeze`` (a move's freeze stored, its state not sent),
# ``after_handover`` (sent, its jobs not dropped yet), ``after_adopt`` (adopted, the map not told): the process exits
# at once there (os._exit: nothing flushed, nothing stored), as a SIGKILL would.
FAILPOINT_ENV = "ROPEWALK_SCHEDULER_FAILPOINT"
PROFILE_ENV = "ROPEWALK_PROFILE_DIR"  # a directory: profile the worker (cProfile) and write its stats there at exit


class StoreTimeout(RuntimeError):
    """The broker did not acknowledge a batch's changelog records in time (transient: the batch is read again)."""


class Frozen(RuntimeError):
    """This process was frozen during a decision (streams/freeze.py): the rest of it is not written."""


class OutputRefused(RuntimeError):
    """The broker did not take a batch's output (``DeliveryError``): transient, or a record it refuses for ever."""


def settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """faust settings overridden by ``ROPEWALK_FAUST_*`` (seconds, floats); unset ones keep faustwire's."""
    env = os.environ if env is None else env
    return {setting: float(env[name]) for name, setting in FAUST_ENV.items() if env.get(name)}


def shard_bucket_key(partition: int) -> str:
    return f"shard/{partition}"


def is_ignored_record(msg: Any) -> bool:
    """Whether a record's ``type`` header names an event the shard does nothing with (a registration, say: a
    MachinesRegistered per thousand machines, on older logs a MachineRegistered per machine): passed over undecoded,
    like the scheduler's own echoes."""
    return not passes_type(getattr(msg, "headers", None), SHARD_CONSUMED)


def is_own_record(msg: Any) -> bool:
    """Whether a record's ``producer`` header names the scheduler (its own event, come back): read, not decoded."""
    name = header_of(msg, PRODUCER_HEADER)
    if name is None:
        return False
    return name == PRODUCER.encode() or name.startswith(PRODUCER.encode() + b"/")


def unreadable_named(event: Event, unreadable: Mapping[str, str]) -> tuple[bool, str] | None:
    """Whether ``event`` names a job the shard could not read (``unreadable``: job id -> why): None if not, else
    (whether it names only such jobs, the dead letter's detail). One that names only such jobs is not decided (a
    decision without its job would take it for unknown: a JobSubmitted would make a new one over it); one that also
    names readable jobs (an agent's batch of reports) is decided for those. Either is dead-lettered, to be replayed
    once the job is mended (its other jobs' duplicate rings make the replay a no-op for them)."""
    named = named_jobs(event)
    bad = [j for j in named if j in unreadable]
    if not bad:
        return None
    why = "; ".join(f"{j}: {unreadable[j]}" for j in bad)
    return len(bad) == len(named), f"{event.type} names jobs the shard cannot read: {why}"


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
    them. Writes go to the table's store and to the changelog partition the entitlement lives on (``where``: the
    partition of the events decided for it); an entitlement off its hash partition keeps its values under keys
    qualified by the partition (``handover.storage_key``)."""

    def __init__(self, app: faust.App, partitions: int):
        self.app = app
        self.partitions = partitions
        opts = {"default": None, "key_type": str, "value_type": None, "partitions": partitions,
                "extra_topic_configs": {**CHANGELOG_CONFIG, **replication_config(app.conf.topic_replication_factor)}}
        self.jobs = app.Table("scheduler-jobs", **opts)  # job key -> header (store.py)
        self.job_chunks = app.Table("scheduler-job-chunks", **opts)  # "<job key>#<i>@<v>" -> a chunk of its tasks
        self.entitlements = app.Table("scheduler-entitlements", **opts)  # entitlement key -> its fields
        self.machines_down = app.Table("scheduler-machines-down", **opts)
        self.homes = app.Table("scheduler-homes", **opts)  # "<entitlement>@<partition>" -> handover.Home
        self.machine_jobs = st.MachineJobs()  # in memory, derived from jobs and job_chunks (see the module docstring)
        self.offsets = app.Table("scheduler-offsets", **opts)  # "<topic>/<partition>" -> next offset to apply
        self.limits = app.Table("scheduler-limits", **opts)  # "shard/<partition>" -> the shard's token bucket
        # A memo, not state: job key -> (the header this worker last wrote or read, the Job it stands for). Used
        # only while the table still holds that very object (a recovery or another worker's write puts a new one),
        # so it can never disagree with the table.
        self._decoded: dict[str, tuple[dict, Job]] = {}
        self._unacked: list = []  # changelog sends since the last barrier (faust FutureMessages)
        self.unreadable: dict[str, str] = {}  # job id -> why: the jobs the last load could not read (load)
        self._unreadable_logged: dict[str, dict] = {}  # job key -> the header last logged as unreadable (once each)
        self.written_chunks = 0  # chunk records written (a figure for tests and profiles)
        self.store_ms = (0, 0)  # the last store's wait for its chunks and output, then for its headers (logged)
        self._here: dict[str, int] | None = None  # a memo of the homes table: entitlement -> where it lives here

    # -- keys: where an entitlement's values are kept ---------------------------------------------------------
    def hash_partition(self, entitlement: str) -> int:
        return partition_for(entitlement, self.partitions)

    def key(self, key: str, entitlement: str, partition: int) -> str:
        return ho.storage_key(key, entitlement, partition, self.hash_partition(entitlement))

    def partition_of_key(self, key: str, entitlement: str) -> int:
        """The partition a value stored under ``key`` (a job key, an entitlement key) is kept for."""
        base, sep, part = key.rpartition("~")
        if sep and part.isdigit() and base:
            return int(part)
        return self.hash_partition(entitlement)

    def home(self, entitlement: str, partition: int) -> ho.Home | None:
        return ho.home_of(self.homes.data.get(ho.home_key(entitlement, partition)))

    def here_partition(self, entitlement: str, pmap: "MapFollower") -> int:
        """Where this shard's own records of ``entitlement`` go: the partition it lives on here (a move adopted here
        is known before the map says so), else the partition map's."""
        if self._here is None:
            self._here = {}
            for key, r in list(self.homes.data.items()):
                h = ho.home_of(r)
                if h is not None and h.here:
                    self._here[key.rsplit("@", 1)[0]] = h.partition
        p = self._here.get(entitlement)
        return p if p is not None else pmap.partition_of(entitlement)

    def forget_homes(self) -> None:
        """At every assignment: the recovery that follows may change the homes (``here_partition`` builds again)."""
        self._here = None

    def frozen(self, entitlement: str, partition: int) -> bool:
        """Whether the entitlement is leaving ``partition`` or not all arrived there: nothing of it is decided."""
        h = self.home(entitlement, partition)
        return h is not None and not h.here

    # -- reading ----------------------------------------------------------------------------------------------
    def job_keys_for(self, event: Event, partition: int) -> list[str]:
        """The keys of the jobs ``event`` concerns on ``partition``: ``decide.concerned_jobs``'s rule, machine events
        through the machine index (a key no entitlement of this shard has: every job of the event's partition)."""
        named = named_jobs(event)
        if named or event.type not in MACHINE_EVENTS:
            return [self.key(j, event.entitlement, partition) for j in named]
        machines = batches.machine_ids(event)
        if self.entitlements.data.get(self.key(event.entitlement, event.entitlement, partition)) is not None:
            if not self.machine_jobs.built:
                self.machine_jobs.build(self.jobs.data, self.job_chunks.data)
            keys: set[str] = set()
            for m in machines:
                keys.update(k for k in self.machine_jobs.jobs(event.entitlement, m)
                            if self.partition_of_key(k, event.entitlement) == partition)
            return sorted(keys)
        # a key no entitlement of this shard has (free/<dc>): every job of the event's partition
        return self.partition_job_keys({partition})

    def partition_job_keys(self, partitions: set[int], entitlement: str | None = None) -> list[str]:
        """The keys of every job these partitions hold (of ``entitlement`` only, if given), but those of an
        entitlement frozen there (leaving, or not all arrived: ``frozen``)."""
        out = []
        for k, r in list(self.jobs.data.items()):
            if r is None or (entitlement is not None and r["entitlement"] != entitlement):
                continue
            part = self.partition_of_key(k, r["entitlement"])
            if part in partitions and (entitlement is not None or not self.frozen(r["entitlement"], part)):
                out.append(k)
        return sorted(out)

    def load(self, events: Iterable[tuple[Event, int]], job_keys: Iterable[str], *,
             entitlements: Mapping[str, int] | None = None) -> tuple[SchedulerState, dict[str, dict], dict[str, int]]:
        """The slice of the state: the jobs of ``job_keys``, the entitlements they, the ``events`` (each with its
        partition) and ``entitlements`` (name -> partition) name, and whether each machine they (and the machine
        events) touch is down. Also the job headers as read, by job id (to diff on write-back), and where each
        entitlement's values are kept (``store``'s ``where``).

        A job whose stored form cannot be read (its header names a chunk the table does not hold: ``MissingChunk``,
        or a header that is no job) is left out of both, and ``unreadable`` says which and why (job id -> reason)
        until the next load; it is logged once per stored header. Never raises for one job: the others are still
        decided (the callers skip what names such a job: ``unreadable_named``)."""
        headers = {}
        jobs: list[Job] = []
        self.unreadable = {}
        wanted: dict[str, int] = dict(entitlements or {})  # entitlement -> the partition its values are read from
        for k in job_keys:
            r = self.jobs.data.get(k)
            if r is None:
                continue
            try:
                job = self._job_of(st.header_key(r), r)
                part = self.partition_of_key(k, r["entitlement"])
            except Exception as exc:  # noqa: BLE001 - a job it cannot read must not stop the shard for the others
                job_id = r.get("id", k) if isinstance(r, dict) else k
                self.unreadable[job_id] = f"{type(exc).__name__}: {exc}"
                if self._unreadable_logged.get(k) is not r:
                    self._unreadable_logged[k] = r
                    log.error("scheduler: job %s cannot be read from the tables, left alone until its stored form "
                              "changes (events naming it are dead-lettered): %s", job_id, self.unreadable[job_id])
                continue
            jobs.append(job)
            headers[r["id"]] = r
            wanted.setdefault(r["entitlement"], part)
        machines: set[str] = set()
        for j in jobs:
            machines |= machines_of(j)
        for event, partition in events:
            wanted.setdefault(event.entitlement, partition)
            if event.type in MACHINE_EVENTS:
                machines.update(batches.machine_ids(event))
        ents = [Entitlement(**e) for n, p in sorted(wanted.items())
                if (e := self.entitlements.data.get(self.key(n, n, p))) is not None]
        down = {m: s for m in machines if (s := self.machines_down.data.get(m)) is not None}
        return state_of(jobs, ents, down), headers, wanted

    def _job_of(self, key: str, header: dict) -> Job:
        memo = self._decoded.get(key)
        if memo is not None and memo[0] is header:
            return memo[1]
        job = st.job_of(header, self.job_chunks.data)
        self._decoded[key] = (header, job)
        return job

    def bucket(self, partition: int) -> Bucket | None:
        """The rate-limiter bucket of the shard's ``partition`` (processors/taskcontrol/limiter.py)."""
        return bucket_of(self.limits.data.get(shard_bucket_key(partition)))

    def with_bucket(self, state: SchedulerState, partition: int) -> SchedulerState:
        return dataclasses.replace(state, shard_bucket=self.bucket(partition))

    def timer_job_keys(self, partitions: set[int], now_ms: int = 0, gc_ms: int | None = None
                       ) -> dict[int, list[str]]:
        """Partition -> the keys of the jobs of it the retry timer may have work for (``store.wants_timer`` of their
        headers: ``decide.timer_due_ms`` when written, due by ``now_ms`` if given; and with ``gc_ms``, those whose grace passed at ``now_ms``:
        ``store.expired``, for ``decide.collect``), for ``partitions``, read without decoding any job, but
        those of an entitlement frozen there (as ``partition_job_keys``). The timer used to load and decide on every
        job of the shard every round, most of them running untouched."""
        out: dict[int, list[str]] = {p: [] for p in sorted(partitions)}
        for k, r in list(self.jobs.data.items()):
            if not isinstance(r, dict) or not isinstance(ent := r.get("entitlement"), str) or not (
                    st.wants_timer(r, now_ms or None) or (gc_ms is not None and st.expired(r, now_ms, gc_ms))):
                continue  # (a header that is no job's is left to load, which says so when an event names it)
            part = self.partition_of_key(k, ent)
            if part in out and not self.frozen(ent, part):
                out[part].append(k)
        return {p: sorted(keys) for p, keys in out.items()}

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

    def check_not_frozen(self, since: float | None) -> None:
        """Raise ``Frozen`` if this process was frozen since ``since`` (``faustwire.frozen_since``)."""
        if since is not None and frozen_since(self.app, since):
            raise Frozen("this process was frozen during the decision: its partitions may be another's now; "
                         "nothing more of it is written (the batch is read again)")

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

    async def store(self, before: SchedulerState, after: SchedulerState, headers: Mapping[str, dict], *,  # noqa: C901
                    where: Mapping[str, int], down_partitions: Mapping[str, int] | None = None,
                    buckets: Mapping[int, Bucket | None] = (), homes: Mapping[str, ho.Home] = (),
                    applied: Mapping[str, tuple[int, int]] = (), output: Awaitable[Any] | None = None,
                    since: float | None = None) -> int:
        """Write back what a batch's decisions changed, in the three steps of store.py's delivery argument;
        returns the number of jobs written. ``where``: entitlement -> the partition its values are kept for (the
        partition of the events decided for it); ``down_partitions``: machine -> the partition of the event that
        changed its ``machines_down`` entry; ``buckets``: partition -> its bucket after the batch; ``homes``: home
        key -> the home after the batch; ``applied``: source partition key -> (its changelog partition, the next
        offset to apply), written last; ``output``: the batch's output being produced, awaited once the new chunks
        are sent and before any header is (the two round trips overlap; a header is still never written before the
        output it stands for is flushed). A job or an entitlement in ``before`` and not in ``after`` (handed over to
        another partition) is deleted: its header and entitlement in step 2, its chunks in step 3. ``since``: when
        the decision began (monotonic): if the process was frozen since (streams/freeze.py), steps 2 and 3 are not
        written (``Frozen``; its partitions may be another's now, and the batch is read again)."""
        plans: list[tuple[Job, int, str, st.Plan]] = []
        for job_id, job in after.jobs.items():
            old = before.jobs.get(job_id)
            if old is job:
                continue
            part = where[job.entitlement]
            key = self.key(job_id, job.entitlement, part)
            plans.append((job, part, key, st.plan(old, headers.get(job_id), self.job_chunks.data, job, key)))
        gone = [(job, where[job.entitlement]) for job_id, job in before.jobs.items() if job_id not in after.jobs]
        t0 = time.monotonic()
        # 1. the new chunks, durable before any header names them
        if any(p.chunks for _, _, _, p in plans):
            for _, part, _, p in plans:
                for key, value in p.chunks.items():
                    self._put(self.job_chunks, part, key, value)
                    self.written_chunks += 1
            await self._barrier()
        if output is not None:
            await output  # raises OutputRefused: nothing but orphan chunks was written (drop_orphans)
        t1 = time.monotonic()
        self.check_not_frozen(since)
        # 2. the headers, and the other tables' values
        wrote = False
        for job, part, key, p in plans:
            self._put(self.jobs, part, key, p.header)
            self._decoded[key] = (p.header, job)
            self.machine_jobs.update(key, job.entitlement, machines_of(before.jobs.get(job.id)), machines_of(job))
            wrote = True
        obsolete = [(part, key) for _, part, _, p in plans for key in p.obsolete]
        for job, part in gone:
            key = self.key(job.id, job.entitlement, part)
            header = headers.get(job.id) or self.jobs.data.get(key)
            self._put(self.jobs, part, key, None)
            self._decoded.pop(key, None)
            self.machine_jobs.update(key, job.entitlement, machines_of(job), set())
            if header is not None:
                obsolete += [(part, k) for k in sorted(st.named_keys(header))]
            wrote = True
        for name in set(before.entitlements) | set(after.entitlements):
            ent = after.entitlements.get(name)
            if before.entitlements.get(name) != ent:
                part = where[name]
                self._put(self.entitlements, part, self.key(name, name, part),
                          None if ent is None else dataclasses.asdict(ent))
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
        for key, home in dict(homes).items():
            record = ho.home_record(home)
            if self.homes.data.get(key) != record:
                self._put(self.homes, home.partition, key, record)
                self._here = None
                wrote = True
        if wrote and (applied or obsolete):
            await self._barrier()
        self.store_ms = (round((t1 - t0) * 1e3), round((time.monotonic() - t1) * 1e3))
        self.check_not_frozen(since)
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
        parts = {k: part for k, v in list(self.job_chunks.data.items())
                 if v is not None and (part := self.partition_of_key(st.job_of_key(k), v["entitlement"]))
                 in active_partitions}
        garbage = st.orphans(parts, self.jobs.data)
        for key in garbage:
            self._put(self.job_chunks, parts[key], key, None)
        return len(garbage)


def build_app(cfg: Config, *, registry: SchemaRegistry | None = None, retry_s: float = RETRY_S,  # noqa: C901
              partition_map: MapFollower | None = None, **settings: Any):
    """The scheduler's faust app, its agent, its timer and its tables; ``settings`` override faust's;
    ``partition_map``: the follower of the entitlement -> partition map (default: one of its own)."""
    registry = registry or SchemaRegistry.from_dir()
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    app = make_app(cfg, APP_ID, **settings)
    tables = ShardTables(app, cfg.partitions)
    pmap = partition_map if partition_map is not None else MapFollower.start(cfg, registry, name="scheduler-map")
    producer = EventProducer(cfg, registry, PRODUCER, route=lambda e: tables.here_partition(e, pmap))
    dead_letters = DeadLetters(producer, PRODUCER)
    verifier = verifier_for(cfg, registry)  # agents' reports and the machine events must prove who wrote them
    source_names = [catalogue.name(t) for t in SOURCES]
    handoff_topic = catalogue.name("handoff")
    allocations_topic = catalogue.name("allocations")
    source = app.topic(*source_names, key_serializer="raw", value_serializer="raw", partitions=cfg.partitions)
    fetches = app.fetch_batches = FetchBatches(source_names)  # whole fetches, not faust's per-record delivery
    lock = asyncio.Lock()
    batches_waiting = 0  # the agent's batches waiting for the lock: a decision under way for find_stalls

    @contextlib.asynccontextmanager
    async def batch_lock() -> AsyncIterator[None]:
        """The lock, for a batch of the agent's records: while it waits (behind a timer slice), records wait behind
        it (the agent takes no more), so ``find_stalls`` counts it as a decision under way (offsets.py)."""
        nonlocal batches_waiting
        batches_waiting += 1
        try:
            await lock.acquire()
        finally:
            batches_waiting -= 1
        try:
            yield
        finally:
            lock.release()

    limits = Limits.from_env(os.environ)
    max_tasks = cfg.max_tasks_per_job
    gc_ms = int(cfg.job_gc_s * 1000)  # a stopped job's grace (decide.collect)
    # Records of an entitlement whose hand-over is not all here yet (handover.HOLD), in the order they came, per
    # entitlement: (message, the epoch they await). Memory only: their partitions' offsets are stored no further
    # than the first of them (``floors``), so a crash or a rebalance reads them again.
    held: dict[str, dict[tuple[str, int], tuple[Any, int]]] = {}

    def floors() -> dict[str, int]:
        out: dict[str, int] = {}
        for waiting in held.values():
            for key, offset in waiting:
                out[key] = min(out.get(key, offset), offset)
        return out

    async def produce(events: list[Event], forwards: list[tuple[Any, ho.Route]] = (),
                      tombstones: list[tuple[str, str]] = ()) -> None:
        def send_all() -> None:
            producer.send_all(events, validate=False)  # built by decide from decoded events; fastavro still checks
            for msg, r in forwards:
                producer.send_raw(handoff_topic, msg.key, msg.value, partition=r.to,
                                  headers=forwarded_headers(msg, catalogue, r.epoch))
            for topic, key in tombstones:  # (logical topic, key): a job gone from the state (decide.collect)
                producer.send_raw(catalogue.name(topic), key.encode(), None, headers=TOMBSTONE_HEADERS)
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
                if app.should_stop:  # the worker stops: its successor decides again from the stored offsets
                    raise
                log.warning("scheduler: storing a decision's state: %s; writing it again", exc)

    shard_metrics = ShardMetrics()  # this process's metrics (processors/scheduler/metrics.py)

    async def apply(items: list[tuple[Any, Any, Event]], passed: Mapping[str, tuple[int, int]] = MappingProxyType({}),  # noqa: C901
                    forwards: list[tuple[Any, ho.Route]] | None = None, *, generation: int) -> None:
        """Decide a batch of (message, record, event), in order, on one state; produce (with the records to
        ``forwards`` to an entitlement's new partition); store (with the offsets of the records the batch ``passed``
        over: key -> (partition, next offset)). Then the steps of a move that follow a durable decision: the state of
        an entitlement frozen here sent to its new partition, the map told of one adopted here. ``generation``: the
        assignment its records were fetched under (``FetchBatches``); none of it is decided once a revocation came
        since (its partitions may be another worker's now)."""
        forwards = list(forwards or ())
        async with batch_lock():
            t0 = time.monotonic()
            if not tables_ready(app):  # a rebalance, a recovery or a freeze: decide nothing on the tables now
                set_aside(items, passed, forwards, "the tables are being recovered, or this process was frozen")
                return
            if generation != fetches.generation:  # a rebalance came and went since its records were fetched
                set_aside(items, passed, forwards, "its partitions were revoked since it was fetched")
                return
            now = int(time.time() * 1000)
            job_keys: set[str] = set()
            for _, rec, ev in items:
                if ev.type == ho.HANDED_OVER:  # what earlier parts of the hand-over brought
                    job_keys.update(tables.key(j, ev.entitlement, rec.partition) for j in ho.job_ids_of(ev))
                elif ev.type != ho.MOVE_REQUESTED:
                    job_keys.update(tables.job_keys_for(ev, rec.partition))
            start, headers, where = tables.load([(ev, rec.partition) for _, rec, ev in items], sorted(job_keys))
            unreadable = tables.unreadable
            state = start
            buckets: dict[int, Bucket | None] = {}
            down_partitions: dict[str, int] = {}
            homes: dict[str, ho.Home] = {}  # home key -> the home this batch leaves
            moving: list[tuple[str, int]] = []  # (entitlement, partition): frozen by this batch
            arrived: list[tuple[str, int]] = []  # adopted by this batch
            out: list[Event] = []
            failed = []
            for msg, rec, ev in items:
                part = rec.partition
                ent = ev.entitlement
                hk = ho.home_key(ent, part)
                home = homes[hk] if hk in homes else tables.home(ent, part)
                if ev.type == ho.HANDED_OVER:
                    state, new_home = ho.adopt(state, home, ev, part)
                    if new_home is not None and new_home != home:
                        homes[hk], where[ent] = new_home, part
                        if new_home.here:
                            arrived.append((ent, part))
                    continue
                if home is not None and home.moving_to is not None:  # frozen by a move earlier in this batch
                    forwards.append((msg, ho.Route(ho.FORWARD, home.moving_to, home.epoch)))
                    continue
                if ev.type == ho.MOVE_REQUESTED:
                    new_home, refused = ho.begin(state, home, ev, part, cfg.partitions, now)
                    out.extend(refused)
                    if new_home is not None and new_home.moving_to is not None and new_home != home:
                        homes[hk] = new_home
                        moving.append((ent, part))
                    continue
                if unreadable and (bad := unreadable_named(ev, unreadable)):
                    failed.append((msg, JOB_UNREADABLE, bad[1]))
                    if bad[0]:
                        continue  # it names no job that can be read: nothing to decide
                if part not in buckets:
                    buckets[part] = tables.bucket(part)
                state = dataclasses.replace(state, shard_bucket=buckets[part])
                t_ev = time.monotonic()
                try:
                    new, emitted = decide(state, ev, now, limits=limits, max_tasks=max_tasks, gc_ms=gc_ms)
                except Exception as exc:  # noqa: BLE001 - one bad event must not stop the shard
                    log.exception("scheduler: %s %s at %s[%d]@%d failed", ev.type, ev.event_id, rec.topic, part,
                                  rec.offset)
                    failed.append((msg, PROCESSING_FAILED, f"{ev.type}: {type(exc).__name__}: {exc}"))
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
            for msg, reason, detail in failed:
                await route_dead_letter(dead_letters, msg, reason, detail)
            t1 = time.monotonic()
            # The output is flushed before any table value that stands for it (see "Delivery" in the module
            # docstring); it is produced while the new chunks are sent, which need not wait for it.
            if frozen_since(app, t0):  # its partitions may be another's: neither its output nor its state
                set_aside(items, passed, forwards, "this process was frozen while deciding it")
                return
            output = asyncio.ensure_future(produce(coalesce(out), forwards)) if out or forwards else None
            applied = dict(passed)  # the offset after the last record of this batch, per partition
            for msg, _ in forwards:
                key = partition_key(msg.topic, msg.partition)
                if key not in applied or msg.offset + 1 > applied[key][1]:
                    applied[key] = (msg.partition, msg.offset + 1)
            for _, rec, _ in items:
                key = partition_key(rec.topic, rec.partition)
                if key not in applied or rec.offset + 1 > applied[key][1]:
                    applied[key] = (rec.partition, rec.offset + 1)
            for key, floor in floors().items():  # never past a record held for a hand-over
                if key in applied and applied[key][1] > floor:
                    applied[key] = (applied[key][0], floor)
            try:
                if (state is not start or homes or any(b != tables.bucket(p) for p, b in buckets.items())
                        or guard.persist_due(applied) or forwards):
                    await store(start, state, headers, where=where, down_partitions=down_partitions,
                                buckets=buckets, homes=homes, applied=applied, output=output, since=t0)
            finally:
                if output is not None:
                    await output  # also when storing failed: its outcome is what apply_or_retry acts on
            if forwards:
                where_to = Counter(f"{m.key.decode('utf-8', 'replace')}->{r.to}" for m, r in forwards)
                log.info("scheduler: forwarded %d records to their entitlements' new partitions (%s)", len(forwards),
                         ", ".join(f"{k}: {n}" for k, n in sorted(where_to.items())))
            for ent, part in moving:
                log.info("scheduler: entitlement %s frozen on partition %d, moving to %d", ent, part,
                         homes[ho.home_key(ent, part)].moving_to)
                failpoint("after_freeze")
                await send_handover(ent, part)
            for ent, part in arrived:
                log.info("scheduler: entitlement %s adopted on partition %d", ent, part)
                failpoint("after_adopt")
            await publish_map(state, start, where, arrived)
            t2 = time.monotonic()
            guard.worked(time.monotonic())
            if t2 - t0 > SLOW_BATCH_S:
                log.info("scheduler: slow batch: %d records, %d events out, %.0f ms (decide %.0f, produce and store "
                         "%.0f: chunks and output %d, headers %d)", len(items), len(out), (t2 - t0) * 1e3,
                         (t1 - t0) * 1e3, (t2 - t1) * 1e3, *tables.store_ms)

    async def send_handover(ent: str, part: int) -> None:
        """The second step of a move (``handover.hand_over``), once the freeze is durable: the map says the
        entitlement is moving (with the drain offset), its state goes to the new partition, its jobs leave this
        one. Called with the lock held; repeated by the timer if a crash cut it short (the frozen state does not
        change: the same parts)."""
        home = tables.home(ent, part)
        if home is None or home.moving_to is None or home.sent:
            return
        keys = tables.partition_job_keys({part}, entitlement=ent)
        state, headers, where = tables.load((), keys, entitlements={ent: part})
        loop = asyncio.get_running_loop()
        drain = await loop.run_in_executor(None, lambda: pmap.high_watermark(allocations_topic, part))
        now = int(time.time() * 1000)
        new_state, new_home, parts = ho.hand_over(state, home, ent, drain_offset=drain, now_ms=now)
        weight = ent_weight(state, ent)
        moving_entry = ho.map_entry(ent, new_home, weight, REASON_MOVING)

        def send_all() -> None:
            producer.send(assignment_event(moving_entry, producer=PRODUCER, cause=home.handover_id,
                                           timestamp_ms=now))
            producer.flush(FLUSH_S)  # the map says "moving" (and the drain) before any part is on the log
            for ev in parts:
                producer.send(ev, partition=home.moving_to)
            producer.flush(FLUSH_S)
        await loop.run_in_executor(None, send_all)
        failpoint("after_handover")
        where[ent] = part
        await store(state, new_state, headers, where=where, homes={ho.home_key(ent, part): new_home})
        log.info("scheduler: entitlement %s handed over from partition %d to %d: %d jobs in %d parts (drain offset "
                 "%d)", ent, part, home.moving_to, len(keys), len(parts), drain)

    async def publish_map(state: SchedulerState, start: SchedulerState, where: Mapping[str, int],
                          arrived: Iterable[tuple[str, int]]) -> None:
        """Tell the partition map where the entitlements this batch adopted, created or changed the quota of live
        (after their state is durable: producers send there only then). An entry the map has already is not
        written again."""
        entries = []
        for ent, part in arrived:
            home = tables.home(ent, part)
            if home is not None and home.here:
                entries.append(ho.map_entry(ent, home, ent_weight(state, ent), REASON_MOVED))
        for ent, e in state.entitlements.items():
            if start.entitlements.get(ent) == e or ent not in where:
                continue
            part = where[ent]
            home = tables.home(ent, part) or ho.Home(part)
            if home.here:
                entries.append(ho.map_entry(ent, home, ent_weight(state, ent), REASON_HELD))
        entries = [e for e in entries if not e.same_place(pmap.entry(e.entitlement))]
        if not entries:
            return
        now = int(time.time() * 1000)

        def send_all() -> None:
            for e in entries:
                producer.send(assignment_event(e, producer=PRODUCER, timestamp_ms=now))
            producer.flush(FLUSH_S)
        await asyncio.get_running_loop().run_in_executor(None, send_all)

    async def reconcile(active: set[int]) -> None:
        """The steps of a move a crash may have cut short, for the partitions this worker actively owns: a state
        frozen here but not sent yet is sent; an entitlement adopted here that the map does not place here yet is
        published. Called with the lock held (the timer's)."""
        for key, r in list(tables.homes.data.items()):
            home = ho.home_of(r)
            if home is None or home.partition not in active:
                continue
            ent = key.rsplit("@", 1)[0]
            if home.moving_to is not None and not home.sent:
                await send_handover(ent, home.partition)
            elif home.here and home.epoch > 0:
                entry = pmap.entry(ent)
                if entry is None or entry.partition != home.partition or entry.epoch < home.epoch:
                    state, _, _ = tables.load((), (), entitlements={ent: home.partition})
                    await publish_map(state, SchedulerState(), {ent: home.partition}, [(ent, home.partition)])

    guard = OffsetGuard(tables.offsets.data)

    async def seek_back(tp: Any, key: str, why: str) -> None:
        if not tables_ready(app):  # faust seeks every partition to its committed offset itself once the recovery
            return  # is done, and would undo this seek; the records come again then, and the guard sees the gap
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

    missed: dict[bytes, float] = {}

    async def triage(msg: Any, items: list, passed: dict, forwards: list) -> None:
        """Where one record goes: passed over (an own echo, a type the scheduler ignores, one that does not
        decode), forwarded to its entitlement's new partition, held for a hand-over, or decided (``items``)."""
        on_handoff = msg.topic == handoff_topic
        where = partition_key(msg.topic, msg.partition)
        if not on_handoff and (is_own_record(msg) or is_ignored_record(msg)):  # own echoes, types decide ignores
            passed[where] = (msg.partition, msg.offset + 1)
            return
        ent = msg.key.decode("utf-8", "replace") if msg.key is not None else None
        if ent is not None and header_of(msg, TYPE_HEADER) != ho.HANDED_OVER.encode():
            epoch = header_of(msg, EPOCH_HEADER)
            r = ho.route(tables.home(ent, msg.partition), pmap.entry(ent), msg.partition,
                         int(epoch) if epoch is not None and epoch.isdigit() else None)
            if r.action == ho.FORWARD:
                forwards.append((msg, r))
                return
            if r.action == ho.HOLD:
                held.setdefault(ent, {})[(where, msg.offset)] = (msg, r.epoch)
                return
        got = await decode_message(msg, registry, dead_letters, catalogue, cfg=cfg, missed=missed,
                                   placement_topic=original_topic(msg, catalogue), verifier=verifier)
        if got is not None:
            items.append((msg, *got))
        else:  # dead-lettered: its offset still moves on
            passed[where] = (msg.partition, msg.offset + 1)

    async def release_held() -> None:
        """Decide (or forward) the held records of the entitlements whose hand-over is now adopted here. They are of
        the current assignment (``held`` is cleared at an assignment, and of a batch dropped as stale)."""
        generation = fetches.generation
        for ent in list(held):
            waiting = held[ent]
            ready = []
            for key, (msg, epoch) in list(waiting.items()):
                r = ho.route(tables.home(ent, msg.partition), pmap.entry(ent), msg.partition, epoch)
                if r.action != ho.HOLD:
                    ready.append(msg)
                    del waiting[key]
            if not waiting:
                del held[ent]
            if ready:
                items: list = []
                passed: dict = {}
                forwards: list = []
                for msg in ready:
                    await triage(msg, items, passed, forwards)
                log.info("scheduler: %d records of entitlement %s held for its hand-over: released", len(ready), ent)
                await apply_or_retry(items, passed, forwards, generation=generation)

    def drop_stale(batch: Any) -> None:
        """A batch a revocation came after (``FetchBatches.current``): not decided, held or acked. faust seeks every
        partition it assigns to its committed offset, and the guard (forgotten at the assignment) to the stored one,
        so the partitions kept read its records again."""
        mine = {id(msg) for msg in batch}
        for ent in list(held):  # what it held meanwhile (held was cleared at the assignment)
            waiting = held[ent]
            for key in [k for k, (msg, _) in waiting.items() if id(msg) in mine]:
                del waiting[key]
            if not waiting:
                del held[ent]
        log.info("scheduler: a batch of %d records dropped: its partitions were revoked since it was fetched",
                 len(batch))

    @app.agent(source, name=f"{APP_ID}.schedule")
    async def schedule(stream):  # noqa: ARG001 - the consumer hands the sources' records over as whole fetches
        ack = app.consumer.ack
        while True:
            batch = await fetches.take(BATCH_MAX, BATCH_GAP_S, BATCH_MAX_WAIT_S)
            if not fetches.current(batch):  # fetched before a revocation: its partitions may be another's now
                drop_stale(batch)
                continue
            items: list = []
            passed: dict[str, tuple[int, int]] = {}  # records passed over (no decision): key -> (partition, next)
            forwards: list = []
            for msg in batch:
                if await gate(msg):
                    await triage(msg, items, passed, forwards)
            if not fetches.current(batch):  # a revocation came while it was triaged (decoding awaits)
                drop_stale(batch)
                continue
            # A batch of only passed-over records (a region's registration: a million MachineRegistered) stores
            # its offsets once they run PERSIST_AFTER ahead of the table's, or a rebalance reads them all again.
            if items or forwards or guard.persist_due(passed):
                await apply_or_retry(items, passed, forwards, generation=batch.generation)
            if held:
                await release_held()
            if fetches.current(batch):  # handled: faust may commit them (the shard's own offsets are its tables')
                for msg in batch:
                    ack(msg)

    async def apply_or_retry(items: list, passed: Mapping[str, tuple[int, int]], forwards: list = (), *,
                             generation: int) -> None:
        """Apply a batch. If the broker does not take its output (nothing is stored then), apply its records one
        at a time, each once more after a pause if refused, and send one still refused to ``deadletter``
        (processing_failed): a record the broker refuses for ever does not stop the shard for everyone else. (A
        batch is not read again: answers to what part of its output did reach the log may already follow it.)
        Anything else that fails (a bug) makes the shard read the batch again from the stored offsets."""
        try:
            await apply(items, passed, list(forwards), generation=generation)
            return
        except OutputRefused:
            log.exception("scheduler: the output of a batch of %d records was not taken by the broker; deciding "
                          "them one at a time", len(items))
        except Exception:  # noqa: BLE001 - not an infrastructure failure we know: read the batch again
            log.exception("scheduler: a batch of %d records failed; reading it again", len(items))
            await read_again(items + [(msg, None, None) for msg, _ in forwards])
            return
        if forwards:
            try:
                await apply([], {}, list(forwards), generation=generation)
            except Exception:  # noqa: BLE001 - the broker away: read them again
                log.exception("scheduler: %d records to forward were not taken; reading them again", len(forwards))
                await read_again([(msg, None, None) for msg, _ in forwards])
                return
        for n, item in enumerate(items):
            msg, rec, ev = item
            try:
                for attempt in (1, 2):
                    try:
                        await apply([item], generation=generation)
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

    def set_aside(items: list, passed: Mapping[str, tuple[int, int]], forwards: list, why: str) -> None:
        """A batch that may not be decided now (the tables not ready, or its partitions revoked since it was
        fetched): not decided (nor forwarded), and the guard's next
        offsets of its partitions go back to the stored ones, so its records apply when they come again (faust seeks
        to the committed offsets after the recovery; a gap before them makes the guard seek back to the stored
        ones)."""
        msgs = [msg for msg, _, _ in items] + [msg for msg, _ in forwards]
        for key in {partition_key(msg.topic, msg.partition) for msg in msgs} | set(passed):
            guard.rewind(key)
            set_aside_keys.add(key)  # find_stalls seeks back there once the tables are ready
        log.info("scheduler: a batch of %d records set aside: %s (read again after)", len(msgs) + len(passed), why)

    async def read_again(items: list) -> None:
        """Seek back to the stored offsets of these records' partitions (the offset guard falls back to them)."""
        starts: dict[str, Any] = {}
        for msg, _, _ in items:
            starts.setdefault(partition_key(msg.topic, msg.partition), msg.tp)
        for key, tp in starts.items():
            guard.rewind(key)
            await seek_back(tp, key, "a batch not applied")
        await asyncio.sleep(FAILED_BATCH_PAUSE_S)

    def active_partitions() -> set[int]:
        return {tp.partition for tp in app.assignor.assigned_actives() if tp.topic in source_names}

    async def retry_slice(part: int, job_keys: list[str]) -> int:
        """``retry_unplaced`` on these jobs of partition ``part``, its output produced and its state stored; the
        caller holds the lock. Returns the events emitted."""
        t0 = time.monotonic()
        state, headers, where = tables.load((), job_keys)  # a job it cannot read is left out (and logged)
        state = tables.with_bucket(state, part)
        now = int(time.time() * 1000)
        new, out = retry_unplaced(state, now, limits=limits)
        new, gone = collect(new, now, gc_ms)
        if out or gone:
            log.info("scheduler: retry: %d events for %d jobs of partition %d; %d jobs gone (their grace of %.0f s "
                     "passed)", len(out), len(state.jobs), part, len(gone), gc_ms / 1000)
            tables.check_not_frozen(t0)
            await produce(coalesce(out), tombstones=[k for j in gone for k in state_keys(state.jobs[j])])
        if new is not state:
            await store(state, new, headers, where=where, buckets={part: new.shard_bucket}, since=t0)
        return len(out)

    @app.timer(retry_s, name=f"{APP_ID}.retry_unplaced")
    async def retry() -> None:  # noqa: C901
        """A round of the timer: the jobs with something to retry (``timer_job_keys``), partition by partition,
        ``RETRY_SLICE_JOBS`` at a time, each slice a decision of its own under the lock (the agent decides in
        between), none while the tables are not ready (a rebalance or a recovery: the round ends there)."""
        if not tables_ready(app):
            log.info("scheduler: retry round skipped: the tables are being recovered (a rebalance), or a freeze")
            return
        t0 = time.monotonic()
        active = active_partitions()
        async with lock:  # the steps of a move a crash cut short (handover.py), before the round
            if not tables_ready(app):
                return
            await reconcile(active)
        todo = tables.timer_job_keys(active, int(time.time() * 1000), gc_ms)
        n_jobs = n_out = n_slices = failed = 0
        waited = 0.0
        for part, keys in todo.items():
            for i in range(0, len(keys), RETRY_SLICE_JOBS):
                t_wait = time.monotonic()
                async with lock:
                    waited += time.monotonic() - t_wait
                    if not tables_ready(app) or part not in active_partitions():
                        log.info("scheduler: retry round cut short after %d slices: a rebalance began", n_slices)
                        return
                    try:
                        n_out += await retry_slice(part, keys[i:i + RETRY_SLICE_JOBS])
                    except Exception:  # noqa: BLE001 - the broker refused the output, or a bug: the others go on
                        failed += 1
                        log.exception("scheduler: a retry slice of %d jobs of partition %d failed (nothing of it "
                                      "stored; the next round tries again)", len(keys[i:i + RETRY_SLICE_JOBS]), part)
                    finally:
                        guard.worked(time.monotonic(), TIMER)  # not an end of idleness: offsets.py
                n_jobs += len(keys[i:i + RETRY_SLICE_JOBS])
                n_slices += 1
        async with lock:  # never while recovering: a header read back at an older version leaves its job's newest
            if tables_ready(app):  # chunk unnamed for a while, and deleting it would delete it on the log too
                try:  # the partitions owned now: a rebalance may have come and gone during the round
                    dropped = tables.drop_orphans(active_partitions())
                except Exception:  # noqa: BLE001 - a chunk record that is no chunk: the timer goes on
                    log.exception("scheduler: looking for chunk records no job names failed")
                    dropped = 0
                if dropped:
                    log.warning("scheduler: deleted %d chunk records no job names (left by an interrupted write)",
                                dropped)
        took = time.monotonic() - t0
        if took > SLOW_RETRY_S:
            log.info("scheduler: slow retry round: %.1f s for %d jobs in %d slices (%d failed), %d events out; "
                     "%.1f s of it waiting for the lock", took, n_jobs, n_slices, failed, n_out, waited)
        metrics.TIMER_TICKS.labels(worker=APP_ID).inc()  # a round of the retry timer done, its output produced

    flow = FlowWatch()
    behind: dict[str, float] = {}  # partition key -> since when it is below its high watermark (logged once)
    # Partitions whose batch was set aside: faust's seek to the committed offsets may already have run when the
    # batch was set aside (it comes before faust marks the recovery done), and then nothing brings its records
    # again (a quiet partition shows no gap to the guard); so once the tables are ready they are sought back.
    set_aside_keys: set[str] = set()

    async def resume_set_aside(sources: list) -> None:
        """Seek the partitions whose batch was set aside back to their next offset (the guard skips what was
        applied already), those still this shard's and behind; the others (revoked) are forgotten."""
        if not set_aside_keys:
            return
        keys, targets = set(set_aside_keys), {}
        set_aside_keys.clear()
        for tp in sources:
            key = partition_key(tp.topic, tp.partition)
            if key not in keys:
                continue
            try:
                high = app.consumer.highwater(tp)
            except Exception:  # noqa: BLE001 - moving away in a rebalance: the next owner reads it from its offsets
                continue
            if high is None or high > guard.next_offset(key):
                targets[tp] = guard.next_offset(key)
        if targets:
            log.info("scheduler: reading again from their next offsets the set-aside records of %s",
                     ", ".join(f"{tp.topic}[{tp.partition}]@{off}" for tp, off in targets.items()))
            await app.consumer.seek_wait(targets)

    @app.timer(STALL_S, name=f"{APP_ID}.stalls")
    async def find_stalls() -> None:
        if not tables_ready(app):  # a rebalance: faust pauses, seeks and resumes the partitions itself
            return
        now = time.monotonic()
        sources = [tp for tp in app.assignor.assigned_actives() if tp.topic in source_names]
        await resume_set_aside(sources)
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
            target = guard.stall_seek(key, high, now, busy=lock.locked() or batches_waiting > 0)
            if target is not None:
                episode = guard.stalls[key]
                log.warning("scheduler: %s stalled below its high watermark %d: seeking back to offset %d (seek %d of "
                            "this stall; next no sooner than in %.0f s)", key, high, target, episode.seeks,
                            episode.next_seek_at - now)
                await app.consumer.seek_wait({tp: target})  # in the consumer's thread, which owns the fetcher

    @app.on_partitions_revoked.connect
    async def settle(app, revoked, **kwargs) -> None:  # noqa: ARG001 - faust's signal signature
        """A rebalance begins (``tables_ready`` is False from now on, and ``FetchBatches`` is at a new generation: no
        batch fetched before decides anything after): wait for a decision under way (the agent's batch, past its
        checks under the lock, or a slice of the timer) to end before the recovery that follows reads the
        changelogs. Its writes must be on the log by then: one written after the recovery took the changelogs' ends
        would be overwritten in memory by an older value the recovery reads, and the worker would go on from a
        state its log no longer holds (then deleting the newer chunks as orphans). As faust waits for the agent, not
        bounded: a slice is 50 jobs; one stuck on the broker is logged every SETTLE_S."""
        t0 = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(lock.acquire(), SETTLE_S)
                break
            except asyncio.TimeoutError:
                log.warning("scheduler: the rebalance waits for a decision under way (%.0f s so far)",
                            time.monotonic() - t0)
        lock.release()

    @app.on_partitions_assigned.connect
    async def announce(app, assigned, **kwargs) -> None:  # noqa: ARG001 - faust's signal signature
        guard.forget()
        behind.clear()  # a partition back after a move is watched afresh (its episode may have been logged)
        held.clear()  # read again from the stored offsets, which stop before them
        tables.machine_jobs.forget()  # the recovery that follows may change the tables: built again when needed
        tables.forget_homes()
        mine = sorted({tp.partition for tp in assigned if tp.topic in source_names})
        log.info("scheduler shard %d: assigned partitions %s", os.getpid(), mine)

    return app, schedule, tables


def failpoint(name: str) -> None:
    """Exit at once if ``FAILPOINT_ENV`` names this point (tests of a crash between the steps of a move)."""
    process_failpoint(FAILPOINT_ENV, name, log)


def ent_weight(state: SchedulerState, entitlement: str) -> int:
    """An entitlement's weight in the partition map: its quota in machines (streams/partitionmap.least_loaded)."""
    e = state.entitlements.get(entitlement)
    return e.quota_machines if e is not None else 0


def original_topic(msg: Any, catalogue: Topics) -> str | None:
    """The physical topic a forwarded record was first on (its ``forwarded_from`` header), or None."""
    origin = header_of(msg, FORWARDED_HEADER)
    if origin is None:
        return None
    logical = origin.decode("utf-8", "replace").split("/", 1)[0]
    return catalogue.name(logical) if logical in BY_NAME else None


def forwarded_headers(msg: Any, catalogue: Topics, epoch: int) -> list[tuple[str, bytes]]:
    """A forwarded record's headers: the original's (producer, type), where it first was, the epoch."""
    headers = msg.headers or []
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    keep = [(k, v) for k, v in pairs if k not in (FORWARDED_HEADER, EPOCH_HEADER)]
    first = header_of(msg, FORWARDED_HEADER)
    if first is None:
        first = f"{catalogue.logical(msg.topic)}/{msg.partition}@{msg.offset}".encode()
    return [*keep, (FORWARDED_HEADER, first), (EPOCH_HEADER, str(epoch).encode())]


def _profile_to(directory: str) -> None:
    """``ROPEWALK_PROFILE_DIR``: profile this worker (cProfile, every thread's calls on the event loop's thread)
    and write ``scheduler-<pid>.prof`` there at exit (``python -m pstats FILE`` reads it). For measurements only."""
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
