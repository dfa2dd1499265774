"""The scheduler as running shards: one faust agent over the co-partitioned topics it reads, state in tables.

    python -m processors.scheduler.shard     # one worker = one shard; configuration from ROPEWALK_* (infra.config)

Start several workers and they share the partitions of ``intents``, ``allocations``, ``tasks``, ``machines`` and
``unavailability``: **consumer-group partition assignment is the sharding** (DESIGN.md). All five are keyed by
entitlement and co-partitioned, so the worker that owns partition p of one owns p of all, and sees every event of
the entitlements hashed to p, in log order. Kill a worker and the group hands its partitions to the survivors,
which recover the partitions' table data from the changelogs before they read on.

```
 intents, allocations, tasks,      decoded()            load the slice        decide()          produce + flush
 machines, unavailability  ──────► (bad bytes ──►  ──►  of the state the ──►  (pure)  ──►  ────► out events, in order
 (one faust topic, 5 names)         deadletter)         event concerns                        (EventProducer)
                                                                                                    │
                                          tables ◄── write back the changed jobs, index, etc. ◄─────┘
                                          (changelog-backed, partition = the entitlement's)
 timer (RETRY_S) ──► retry_unplaced over the jobs of the partitions this worker actively owns ──► same path
```

**Tables** (memory store, each backed by a changelog topic co-partitioned with the sources):

    jobs            job id                  -> ``job_to_record(job)``: the job, its tasks and its duplicate ring
    entitlements    entitlement name        -> the Entitlement's fields
    machines_down   machine id              -> status or unavailability kind (absent: UP)
    machine_jobs    "<entitlement>|<machine>" -> sorted job ids of that entitlement with a task placed on it
    offsets         "<topic>/<partition>"   -> the next offset of that source partition to apply (offsets.py)
    limits          "shard/<partition>"     -> the shard's token bucket for destructive operations
                                               (processors/taskcontrol/limiter.py)

Beside the tables, a memo (not state): per job, the record this worker last wrote and the ``Job`` it was made
from, used only while the table still holds that very object; it spares decoding a job on every event, and
``job_to_record`` re-uses the records of the tasks a decision left alone. The whole job record is still written per
event: for a 1,000-task job that is ~487 KB of JSON, the shard's main cost (BENCHMARKS.md, Figure 14).

Every value is written to the changelog partition of its entitlement (``partition_for(entitlement)``), which is
the partition of the event being processed for every entitlement-keyed event; so a partition's changelog holds
exactly the state of that partition's entitlements, and a worker that takes the partition over recovers it.

**Which jobs an event concerns.** Intents, allocation results and task reports name their job (``job_id``).
Machine and unavailability events are keyed by the machine's owner, and ``decide`` only moves that
entitlement's jobs off the machine, so the ``machine_jobs`` index answers in O(jobs on the machine) instead of a
scan of the shard's jobs (the index costs a few table writes when a job's placements change). A machine event
keyed to an entitlement this shard does not know (a free pool key, ``free/<dc>``) makes ``decide`` look at every
job: then the jobs of the event's partition are scanned (O(jobs held by this worker)), which is rare.

**Delivery** (at-least-once; DESIGN.md). For each event: decide, produce the output and *flush it*, then write
the tables; faust commits the offset only after the handler returns, and flushes its producer (the changelog
writes) before committing. A crash before the table writes makes the successor re-decide the event on the old
state and re-emit the same events (ids derive from the input's id); a crash after them finds the event in the
job's duplicate ring and emits nothing (its output was flushed already). A handler that raises sends the event to
``deadletter`` with reason ``processing_failed`` and the agent goes on.

Known limits: ``machines_down`` is keyed by machine alone and written to the partition of the event that
changed it, so a machine that moves to an entitlement of another partition leaves its old entry in the old
partition's changelog. Keys this worker wrote for a partition it later loses stay in its memory until it gets
the partition back (faust's memory store forgets only keys it recovered); reads by job id happen only on the
owning partition, and every scan filters by partition, so they are never acted on.

**Timer.** Every ``RETRY_S`` (``ROPEWALK_SCHEDULER_RETRY_S``, default 10 s) ``retry_unplaced`` releases throttled operations, re-asks
controllers whose ack is overdue, and re-asks placement of
tasks parked by an AllocationRejected, for the jobs of the partitions this worker actively owns (standby copies
of other workers' partitions, which faust also keeps in the same tables, are left alone). The agent and the
timer share an ``asyncio.Lock``: a decision reads and writes its jobs without the other interleaving.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import faust

from infra.config import Config
from processors.taskcontrol.limiter import Limits, bucket_of, bucket_record
from processors.scheduler.offsets import APPLY, GAP, STALL_S, OffsetGuard, partition_key
from processors.scheduler.decide import (
    PRODUCER, Entitlement, Job, SchedulerState, decide, is_own, job_from_record, job_to_record, retry_unplaced,
    state_of,
)
from streams.clients import EventProducer
from streams.deadletter import PROCESSING_FAILED, DeadLetters
from streams.events import Event
from streams.faustwire import decoded, make_app, route_dead_letter
from streams.partitioner import partition_for
from streams.serde import SchemaRegistry
from streams.topics import CHANGELOG_CONFIG, Topics

log = logging.getLogger(__name__)

APP_ID = "scheduler"
SOURCES = ("intents", "allocations", "tasks", "machines", "unavailability", "taskcontrol")
MACHINE_EVENTS = frozenset({"MachineStatusChanged", "UnavailabilityStarted", "UnavailabilityEnded"})
RETRY_S = 10.0  # default interval of the retry_unplaced timer (also releases throttled operations, re-asks controllers)
FLUSH_S = 30.0  # how long producing one decision's output may wait for the broker's acks

# Environment variables of a worker (beside infra.config's), mapped to faust settings; tests lower them.
FAUST_ENV = {
    "ROPEWALK_FAUST_SESSION_TIMEOUT": "broker_session_timeout",
    "ROPEWALK_FAUST_HEARTBEAT_INTERVAL": "broker_heartbeat_interval",
    "ROPEWALK_FAUST_REBALANCE_TIMEOUT": "broker_rebalance_timeout",
    "ROPEWALK_FAUST_COMMIT_INTERVAL": "broker_commit_interval",
}
RETRY_ENV = "ROPEWALK_SCHEDULER_RETRY_S"


def settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """faust settings overridden by ``ROPEWALK_FAUST_*`` (seconds, floats); unset ones keep faustwire's."""
    env = os.environ if env is None else env
    return {setting: float(env[name]) for name, setting in FAUST_ENV.items() if env.get(name)}


def shard_bucket_key(partition: int) -> str:
    return f"shard/{partition}"


def index_key(entitlement: str, machine: str) -> str:
    return f"{entitlement}|{machine}"


def _machines_of(record: Mapping[str, Any] | None) -> set[str]:
    if record is None:
        return set()
    return {t["machine"] for t in record["tasks"] if t["machine"] is not None}


class ShardTables:
    """The shard's faust tables, and how one decision's slice of ``SchedulerState`` is read from and written
    back to them. Writes go to the table's store and to the changelog partition of the entitlement."""

    def __init__(self, app: faust.App, partitions: int):
        self.app = app
        self.partitions = partitions
        opts = {"default": None, "key_type": str, "value_type": None, "partitions": partitions,
                "extra_topic_configs": dict(CHANGELOG_CONFIG)}
        self.jobs = app.Table("scheduler-jobs", **opts)
        self.entitlements = app.Table("scheduler-entitlements", **opts)
        self.machines_down = app.Table("scheduler-machines-down", **opts)
        self.machine_jobs = app.Table("scheduler-machine-jobs", **opts)
        self.offsets = app.Table("scheduler-offsets", **opts)  # "<topic>/<partition>" -> next offset to apply
        self.limits = app.Table("scheduler-limits", **opts)  # "shard/<partition>" -> the shard's token bucket
        # A memo, not state: job id -> (the record this worker last wrote to the jobs table, the Job it was made
        # from). Used only while the table still holds that very object (a recovery or another worker's write
        # puts a new one), so it can never disagree with the table; it saves decoding (and re-encoding the
        # unchanged tasks of) a big job on every event: 10 + 5 ms per event at 1,000 tasks.
        self._decoded: dict[str, tuple[dict, Job]] = {}

    def partition_of(self, entitlement: str) -> int:
        return partition_for(entitlement, self.partitions)

    # -- reading ----------------------------------------------------------------------------------------------
    def job_ids_for(self, event: Event, partition: int) -> list[str]:
        """The jobs ``event`` concerns (see the module docstring)."""
        p = event.payload
        if "job_id" in p:
            return [p["job_id"]]
        if event.type not in MACHINE_EVENTS:
            return []
        machines = p["machine_ids"] if "machine_ids" in p else [p["machine_id"]]
        if self.entitlements.data.get(event.entitlement) is not None:
            ids: set[str] = set()
            for m in machines:
                ids.update(self.machine_jobs.data.get(index_key(event.entitlement, m)) or ())
            return sorted(ids)
        # a key no entitlement of this shard has (free/<dc>): every job of the event's partition
        return sorted(k for k, r in list(self.jobs.data.items())
                      if r is not None and self.partition_of(r["entitlement"]) == partition)

    def load(self, event: Event | None, job_ids: Iterable[str]) -> tuple[SchedulerState, dict[str, dict]]:
        """The slice of the state: the given jobs, the entitlements they and ``event`` name, and whether each
        machine they (and ``event``) touch is down. Also the job records as read (to diff on write-back)."""
        records = {j: r for j in job_ids if (r := self.jobs.data.get(j)) is not None}
        ent_names = {r["entitlement"] for r in records.values()}
        machines: set[str] = set()
        for r in records.values():
            machines |= _machines_of(r)
        if event is not None:
            ent_names.add(event.entitlement)
            if event.type in MACHINE_EVENTS:
                machines.update(event.payload.get("machine_ids") or [event.payload.get("machine_id")])
        ents = [Entitlement(**e) for n in sorted(ent_names) if (e := self.entitlements.data.get(n)) is not None]
        down = {m: s for m in machines if m is not None and (s := self.machines_down.data.get(m)) is not None}
        jobs = [self._job_of(j, r) for j, r in records.items()]
        return state_of(jobs, ents, down), records

    def _job_of(self, job_id: str, record: dict) -> Job:
        memo = self._decoded.get(job_id)
        if memo is not None and memo[0] is record:
            return memo[1]
        job = job_from_record(record)
        self._decoded[job_id] = (record, job)
        return job

    def with_bucket(self, state: SchedulerState, partition: int) -> SchedulerState:
        """``state`` with the rate-limiter bucket of the shard's ``partition`` (processors/taskcontrol/limiter.py)."""
        return dataclasses.replace(state, shard_bucket=bucket_of(self.limits.data.get(shard_bucket_key(partition))))

    def active_job_ids(self, active_partitions: set[int]) -> list[str]:
        return sorted(k for k, r in list(self.jobs.data.items())
                      if r is not None and self.partition_of(r["entitlement"]) in active_partitions)

    # -- writing ----------------------------------------------------------------------------------------------
    async def _put(self, table: faust.Table, partition: int, key: str, value: Any) -> None:
        """Set (or with None, delete: a tombstone) ``key`` in the store and in the changelog's ``partition``."""
        if value is None:
            table.data.pop(key, None)
            table.send_changelog(partition, key, None, value_serializer="raw")
        else:
            table.data[key] = value
            table.send_changelog(partition, key, value)

    async def store(self, before: SchedulerState, after: SchedulerState, records: Mapping[str, dict],
              event_partition: int | None, applied: tuple[str, int] | None = None,
              bucket_partition: int | None = None) -> int:
        """Write back what ``decide`` changed; returns the number of jobs written. ``applied``: the source
        partition key and offset of the event, whose next offset is written last (processors/scheduler/offsets.py)."""
        written = 0
        for job_id, job in after.jobs.items():
            if before.jobs.get(job_id) is job:
                continue
            part = self.partition_of(job.entitlement)
            old = before.jobs.get(job_id)
            rec = job_to_record(job, (old, records[job_id]) if old is not None and job_id in records else None)
            await self._put(self.jobs, part, job_id, rec)
            self._decoded[job_id] = (rec, job)
            written += 1
            old_m, new_m = _machines_of(records.get(job_id)), _machines_of(rec)
            for m in old_m ^ new_m:
                key = index_key(job.entitlement, m)
                ids = set(self.machine_jobs.data.get(key) or ())
                if m in new_m:
                    ids.add(job_id)
                else:
                    ids.discard(job_id)
                await self._put(self.machine_jobs, part, key, sorted(ids) or None)
        for name, ent in after.entitlements.items():
            if before.entitlements.get(name) != ent:
                await self._put(self.entitlements, self.partition_of(name), name, dataclasses.asdict(ent))
        if after.machines_down is not before.machines_down:
            part = event_partition if event_partition is not None else 0
            for m in set(before.machines_down) | set(after.machines_down):
                if before.machines_down.get(m) != after.machines_down.get(m):
                    await self._put(self.machines_down, part, m, after.machines_down.get(m))
        if bucket_partition is not None and after.shard_bucket != before.shard_bucket:
            await self._put(self.limits, bucket_partition, shard_bucket_key(bucket_partition),
                            bucket_record(after.shard_bucket))
        if applied is not None and event_partition is not None:
            await self._put(self.offsets, event_partition, applied[0], applied[1] + 1)
        return written


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

    async def produce(events: list[Event]) -> None:
        def send_all() -> None:
            for e in events:
                producer.send(e)
            producer.flush(FLUSH_S)
        await asyncio.get_running_loop().run_in_executor(None, send_all)

    async def apply(event: Event, partition: int, applied: tuple[str, int] | None = None) -> None:
        async with lock:
            job_ids = tables.job_ids_for(event, partition)
            state, records = tables.load(event, job_ids)
            state = tables.with_bucket(state, partition)
            new, out = decide(state, event, int(time.time() * 1000), limits=limits)
            if event.type in MACHINE_EVENTS:  # rare, and what moved where is worth a line
                log.info("scheduler: %s %s of %s on partition %d: jobs %s, %d events", event.type,
                         event.payload.get("machine_id") or event.payload.get("machine_ids"), event.entitlement,
                         partition, job_ids, len(out))
            if out:
                await produce(out)  # before the tables: see "Delivery" in the module docstring
            if new is not state:
                await tables.store(state, new, records, partition, applied, bucket_partition=partition)

    guard = OffsetGuard(tables.offsets.data)

    async def seek_back(tp: Any, key: str, why: str) -> None:
        target = guard.should_seek(key, time.monotonic())
        if target is not None:
            log.warning("scheduler: %s on %s: seeking back to offset %d", why, key, target)
            await app.consumer.seek_wait({tp: target})  # in the consumer's thread, which owns the fetcher

    async def gate(msg: Any) -> bool:
        """The offset guard in front of decoding: apply in order, once (processors/scheduler/offsets.py)."""
        key = partition_key(msg.topic, msg.partition)
        v = guard.check(key, msg.offset, time.monotonic())
        if v == GAP:
            await seek_back(msg.tp, key, f"gap before offset {msg.offset}")
        return v == APPLY

    @app.agent(source, name=f"{APP_ID}.schedule")
    async def schedule(stream):
        async for record, event in decoded(stream, registry, dead_letters, catalogue, cfg=cfg, gate=gate):
            if is_own(event):
                continue
            try:
                await apply(event, record.partition, (partition_key(record.topic, record.partition), record.offset))
            except Exception as exc:  # noqa: BLE001 - one bad event must not stop the shard
                log.exception("scheduler: %s %s at %s[%d]@%d failed", event.type, event.event_id, record.topic,
                              record.partition, record.offset)
                await route_dead_letter(dead_letters, stream.current_event.message, PROCESSING_FAILED,
                                        f"{event.type}: {type(exc).__name__}: {exc}")

    @app.timer(retry_s, name=f"{APP_ID}.retry_unplaced")
    async def retry() -> None:
        active = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic in source_names}
        if not active:
            return
        async with lock:
            for part in sorted(active):  # one partition at a time: each has its own shard bucket
                state, records = tables.load(None, tables.active_job_ids({part}))
                state = tables.with_bucket(state, part)
                new, out = retry_unplaced(state, int(time.time() * 1000), limits=limits)
                if out:
                    await produce(out)
                if new is not state:
                    await tables.store(state, new, records, None, bucket_partition=part)

    @app.timer(STALL_S, name=f"{APP_ID}.stalls")
    async def find_stalls() -> None:
        now = time.monotonic()
        for tp in app.assignor.assigned_actives():
            if tp.topic in source_names:
                key = partition_key(tp.topic, tp.partition)
                try:
                    high = app.consumer.highwater(tp)  # from the last fetch response
                except Exception:  # noqa: BLE001 - a partition moving away in a rebalance: look next time
                    continue
                if guard.stalled(key, high, now):
                    await seek_back(tp, key, "stalled below the high watermark")

    @app.on_partitions_assigned.connect
    async def announce(app, assigned, **kwargs) -> None:  # noqa: ARG001 - faust's signal signature
        guard.forget()
        mine = sorted({tp.partition for tp in assigned if tp.topic in source_names})
        log.info("scheduler shard %d: assigned partitions %s", os.getpid(), mine)

    return app, schedule, tables


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    retry_s = float(os.environ.get(RETRY_ENV) or RETRY_S)
    app, _, _ = build_app(Config.from_env(), retry_s=retry_s, **settings_from_env())
    faust.Worker(app, loglevel="INFO").execute_from_commandline()


if __name__ == "__main__":
    main()
