"""Readers of the latest-state streams `state.jobs` (with `state.tasks`) and `state.machines`.

They are compacted (``cleanup.policy=compact``, streams/topics.py: the broker keeps the last record per key), but
the log cleaner compacts closed segments only, in its own time, so the active segment and a segment not yet
cleaned still hold older records of a key: readers take the last record per key themselves. `current()` reads
the topic to its end and returns the latest state per key; `follow()` then yields each change.

A job of more than 500 tasks is published as a JobStatePublished without its tasks (`task_parts` n > 0) and n
JobTasksPublished records on `state.tasks` (each a part of 500 tasks, keyed `<job>#<part>`, only the changed parts
published again); the jobs reader reads both topics and hands out each job whole: a JobStatePublished whose
`tasks` are the parts' tasks in order (the parts it holds so far: the two topics are not ordered, so a part may
lag its header for a moment).

`state.machines` records carry the machine's index version: a record older than the one held for its
machine is skipped (two allocator processes may publish one machine's states close together). With an
entitlement filter, a machine whose latest state is outside the entitlement leaves the result.

A tombstone (a record without a value: a job gone from the scheduler's state once its grace passed) removes its key.

A record a reader cannot decode is skipped and counted in ``skipped`` (a ``streams.deadletter.Skipped``, which a
command may share among its readers and report once); the reader goes on.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from infra.config import Config
from streams.catchup import CatchUpTimeout, read_to_end
from streams.clients import EventConsumer, Record
from streams.deadletter import Skipped
from streams.events import Event
from streams.serde import SchemaRegistry
from streams.topics import Topics

STATE_TOPICS = {"jobs": "state.jobs", "machines": "state.machines"}
PART_TOPICS = {"jobs": "state.tasks"}  # where a kind's records in parts are
KEY_FIELD = {"jobs": "job_id", "machines": "machine_id"}


class StateReader:
    """Latest state per key of one state stream, kept up to date by `poll()`."""

    def __init__(self, cfg: Config, registry: SchemaRegistry, kind: str, entitlement: str | None = None, *,
                 skipped: Skipped | None = None):
        if kind not in STATE_TOPICS:
            raise ValueError(f"unknown state stream {kind!r}; known: {', '.join(STATE_TOPICS)}")
        self.kind = kind
        self.entitlement = entitlement
        self.latest: dict[str, Event] = {}
        self.gone: dict[str, Event] = {}  # jobs: the last state of a job that is gone (its deleted header)
        self._versions: dict[str, int] = {}  # machines: the newest version seen per machine
        self._headers: dict[str, Event] = {}  # jobs: the latest JobStatePublished per job (tasks maybe in parts)
        self._parts: dict[str, dict[int, list]] = {}  # jobs: job -> part -> its tasks (JobTasksPublished)
        topics = Topics(cfg.topic_prefix, cfg.partitions)
        names = [topics.name(STATE_TOPICS[kind])] + ([topics.name(PART_TOPICS[kind])] if kind in PART_TOPICS else [])
        self._part_topic = topics.name(PART_TOPICS[kind]) if kind in PART_TOPICS else None
        self._consumer = EventConsumer(cfg, registry, names, name=f"state-reader/{kind}", skipped=skipped,
                                       on_tombstone=self._deleted)
        self.skipped = self._consumer.skipped

    def _deleted(self, topic: str, key: bytes | None) -> None:
        """A tombstone: the key left the topic (a job gone from the scheduler's state once its grace passed,
        processors/scheduler/README.md "Stopped jobs leave"; a part of its tasks)."""
        if key is None:
            return
        name = key.decode("utf-8", "replace")
        if topic == self._part_topic:
            job, _, part = name.rpartition("#")
            parts = self._parts.get(job)
            if parts is not None and part.isdigit():
                parts.pop(int(part), None)
            return
        self.latest.pop(name, None)
        self.gone.pop(name, None)  # its last state is no more: the grace passed
        self._headers.pop(name, None)
        self._parts.pop(name, None)
        self._versions.pop(name, None)

    def _wanted(self, ev: Event) -> bool:
        if self.entitlement is None:
            return True
        if self.kind == "jobs":
            return ev.entitlement == self.entitlement
        return ev.payload.get("assigned_entitlement") == self.entitlement

    def poll(self, timeout_s: float = 0.5) -> list[Record]:
        """Apply the next batch of changes; returns the changed records (in log order per partition; for jobs,
        one record per job that changed, carrying the whole job)."""
        return self._apply(self._consumer.poll(5000, timeout_s))

    def _apply(self, records: list[Record]) -> list[Record]:
        if self.kind == "jobs":
            return self._apply_jobs(records)
        changed = []
        for rec in records:
            # One key's records share a partition, so log order is the order of its states: last wins.
            key = rec.event.payload[KEY_FIELD[self.kind]]
            if self.kind == "machines":
                held = self._versions.get(key, -1)
                if rec.event.payload["version"] < held:
                    continue  # an older state published late
                self._versions[key] = rec.event.payload["version"]
            if not self._wanted(rec.event):
                self.latest.pop(key, None)  # its current state is not (or no longer) in the filter
                continue
            if rec.event.payload.get("deleted"):
                self.latest.pop(key, None)  # a tombstone: the job is gone
            else:
                self.latest[key] = rec.event
            changed.append(rec)
        return changed

    def _apply_jobs(self, records: list[Record]) -> list[Record]:
        touched: dict[str, Record] = {}
        for rec in records:
            ev, p = rec.event, rec.event.payload
            job = p["job_id"]
            if ev.type == "JobTasksPublished":
                parts = self._parts.setdefault(job, {})
                if p["deleted"]:
                    parts.pop(p["part"], None)
                else:
                    parts[p["part"]] = p["tasks"]
            else:
                self._headers[job] = ev
            touched[job] = rec
        changed = []
        for job, rec in touched.items():
            header = self._headers.get(job)
            if header is None:  # parts ahead of their header
                continue
            if not self._wanted(header) or header.payload.get("deleted"):
                self.latest.pop(job, None)  # not (or no longer) in the filter; or a tombstone: the job is gone
                if header.payload.get("deleted"):
                    self._parts.pop(job, None)
                    if self._wanted(header):
                        self.gone[job] = header
                changed.append(dataclasses.replace(rec, event=header))
                continue
            self.gone.pop(job, None)
            whole = job_whole(header, self._parts.get(job, {}))
            self.latest[job] = whole
            changed.append(dataclasses.replace(rec, event=whole))
        return changed

    def catch_up(self, timeout_s: float = 30.0) -> dict[str, Event]:
        """Read every partition up to where it ended when the call started (``streams.catchup.read_to_end``: it
        ends although the allocator keeps publishing) and return the latest state per key. Call it first, on
        the fresh reader. ``TimeoutError`` when no partition made progress for ``timeout_s`` (broker away)."""
        try:
            read_to_end(self._consumer, self._apply, timeout_s=timeout_s)
        except CatchUpTimeout as exc:
            raise TimeoutError(f"state.{self.kind}: not caught up: {exc}") from None
        return self.latest

    def follow(self, idle_s: float = 0.5) -> Iterator[Record]:
        while True:
            yield from self.poll(idle_s)

    def close(self) -> None:
        self._consumer.close()


def job_whole(header: Event, parts: dict[int, list]) -> Event:
    """A JobStatePublished with its tasks: its own, or (``task_parts`` n > 0) those of parts 0..n-1 in order."""
    n = header.payload.get("task_parts") or 0
    if not n:
        return header
    tasks = [t for i in range(n) for t in parts.get(i, ())]
    return dataclasses.replace(header, payload={**header.payload, "tasks": tasks})


def machine_view(ev: Event) -> dict:
    """One machine of `ropewalk machine list --json` (docs/architecture.md's contract plus capacity, free resources,
    tasks, the planned maintenances announced on it, its host profile: applied, wanted by its entitlement, and
    the state of the switch), from its MachineStatePublished."""
    p = ev.payload
    return {"id": p["machine_id"], "status": p["status"], "entitlement": p["assigned_entitlement"],
            **{k: p["topology"][k] for k in ("region", "dc", "msb", "rack")}, "type": p["machine_type"],
            "capacity": dict(p["capacity"]), "free": dict(p["free"]), "host_profile": p["host_profile"],
            "host_profile_wanted": p.get("host_profile_wanted"), "host_profile_state": p.get("host_profile_state") or "",
            "tasks": list(p["task_ids"]), "maintenance": list(p.get("maintenance_ids") or ()),
            "version": p["version"], "updated_ms": ev.timestamp_ms}


def current(cfg: Config, registry: SchemaRegistry, kind: str, entitlement: str | None = None, *,
            skipped: Skipped | None = None) -> dict[str, Event]:
    reader = StateReader(cfg, registry, kind, entitlement, skipped=skipped)
    try:
        return dict(reader.catch_up())
    finally:
        reader.close()


def current_and_gone(cfg: Config, registry: SchemaRegistry, entitlement: str | None = None, *,
                     skipped: Skipped | None = None) -> tuple[dict[str, Event], dict[str, Event]]:
    """The jobs: the latest state of every live job, and the last state (``deleted``) of every job that was stopped
    and is gone. A gone job's record is the scheduler's final JobStatePublished, kept by compaction as its key's
    latest until the job id is submitted again or its grace passes (``ROPEWALK_JOB_GC_S``: the scheduler's tombstone,
    processors/scheduler/README.md "Stopped jobs leave"; Nomad keeps a dead job until its garbage collection)."""
    reader = StateReader(cfg, registry, "jobs", entitlement, skipped=skipped)
    try:
        return dict(reader.catch_up()), dict(reader.gone)
    finally:
        reader.close()
