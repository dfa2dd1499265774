"""Readers of the latest-state streams `state.jobs` and `state.machines`.

They are meant to be compacted (the last record per key is the current state), but the embedded broker
does not enforce compaction, so readers take the last record per key themselves. `current()` reads the
topic to its end and returns the latest state per key; `follow()` then yields each change.

`state.machines` records carry the machine's index version: a record older than the one held for its
machine is skipped (two allocator processes may publish one machine's states close together). With an
entitlement filter, a machine whose latest state is outside the entitlement leaves the result.
"""
from __future__ import annotations

import time
from typing import Iterator

from infra.config import Config
from streams.clients import EventConsumer, Record
from streams.events import Event
from streams.serde import SchemaRegistry
from streams.topics import Topics

STATE_TOPICS = {"jobs": "state.jobs", "machines": "state.machines"}
KEY_FIELD = {"jobs": "job_id", "machines": "machine_id"}


class StateReader:
    """Latest state per key of one state stream, kept up to date by `poll()`."""

    def __init__(self, cfg: Config, registry: SchemaRegistry, kind: str, entitlement: str | None = None):
        if kind not in STATE_TOPICS:
            raise ValueError(f"unknown state stream {kind!r}; known: {', '.join(STATE_TOPICS)}")
        self.kind = kind
        self.entitlement = entitlement
        self.latest: dict[str, Event] = {}
        self._versions: dict[str, int] = {}  # machines: the newest version seen per machine
        self._consumer = EventConsumer(cfg, registry, [Topics(cfg.topic_prefix, cfg.partitions).name(STATE_TOPICS[kind])],
                                       name=f"state-reader/{kind}")

    def _wanted(self, ev: Event) -> bool:
        if self.entitlement is None:
            return True
        if self.kind == "jobs":
            return ev.entitlement == self.entitlement
        return ev.payload.get("assigned_entitlement") == self.entitlement

    def poll(self, timeout_s: float = 0.5) -> list[Record]:
        """Apply the next batch of changes; returns the changed records (in log order per partition)."""
        changed = []
        for rec in self._consumer.poll(5000, timeout_s):
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

    def catch_up(self, timeout_s: float = 30.0) -> dict[str, Event]:
        """Read to the end of every partition (end-of-partition, not the listed watermark) and return the
        latest state per key."""
        partitions = set(self._consumer.partitions())
        deadline = time.monotonic() + timeout_s
        while not partitions <= self._consumer.eof:
            if time.monotonic() > deadline:
                raise TimeoutError(f"state.{self.kind}: not caught up after {timeout_s:.0f}s")
            self.poll(0.2)
        return self.latest

    def follow(self, idle_s: float = 0.5) -> Iterator[Record]:
        while True:
            yield from self.poll(idle_s)

    def close(self) -> None:
        self._consumer.close()


def machine_view(ev: Event) -> dict:
    """One machine of `ropewalk machine list --json` (DESIGN.md's contract plus capacity, free resources,
    tasks), from its MachineStatePublished."""
    p = ev.payload
    return {"id": p["machine_id"], "status": p["status"], "entitlement": p["assigned_entitlement"],
            **{k: p["topology"][k] for k in ("region", "dc", "msb", "rack")}, "type": p["machine_type"],
            "capacity": dict(p["capacity"]), "free": dict(p["free"]), "host_profile": p["host_profile"],
            "tasks": list(p["task_ids"]), "version": p["version"], "updated_ms": ev.timestamp_ms}


def current(cfg: Config, registry: SchemaRegistry, kind: str, entitlement: str | None = None) -> dict[str, Event]:
    reader = StateReader(cfg, registry, kind, entitlement)
    try:
        return dict(reader.catch_up())
    finally:
        reader.close()
