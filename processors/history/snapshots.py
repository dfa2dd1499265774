"""Snapshots of the history's ``Region``: Avro container files under the run directory, so a moment is the
nearest snapshot before it plus a fold of the log's tail.

    <run dir>/history/<topic prefix or "_">/<cut ms:015d>-<applied:012d>.avro

**Why files, not a compacted topic.** A snapshot is derived data: the log gives it back whenever it is missing
(it is a cache, and any reader that folds a long tail writes the snapshots it passes). A region's snapshot is
megabytes (a machine ~300 bytes, a job ~1 KB per 10 tasks): on a topic it would be cut into records under the
broker's 1 MiB limit and a compacted topic keeps one value per key, so every snapshot would need keys of its own
and a reader would scan the topic to find the one before a moment; a file is found by its name, read in one
sequential pass, and kept or deleted by the operator like the archive. What ties a snapshot to its log is checked
when it is used: the event id of the last record it applied in every partition must be on the log at that offset
(``reader.LogChanged`` otherwise: the snapshot is set aside), and the configuration its decisions depend on
(topic prefix, partitions, the scheduler's limits and task maximum, the look-ahead) must be the same.

**Format.** An Avro Object Container File (fastavro) of ``HistoryItem`` records: ``kind`` (what the record is),
``key``, and its value as JSON (the fold's machines, requests, entitlements; the scheduler's jobs as its table
records, ``decide.job_to_record``) or as an Avro single-object encoded event (the jobs' latest published states,
undecided inputs, open requests). The container's metadata ``ropewalk.history`` holds the cut, the positions
(offset and event id per partition) and the configuration. Written to a temporary name and renamed.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastavro import parse_schema, reader as avro_reader, writer as avro_writer

from infra.config import Config
from processors.allocator.fold import MachineRec, PendingRequest, entitlement_of
from processors.history.region import Region
from processors.scheduler import decide as sd
from processors.taskcontrol.limiter import bucket_of, bucket_record
from streams.events import Event
from streams.serde import SchemaRegistry

FORMAT = 1
META_KEY = "ropewalk.history"
SNAPSHOT_EVERY = 50_000  # records applied between two snapshots a fold of the log writes
ITEM_SCHEMA = parse_schema({
    "type": "record", "name": "HistoryItem", "namespace": "ropewalk.history",
    "doc": "One part of a snapshot of the region (processors/history/snapshots.py).",
    "fields": [
        {"name": "kind", "type": "string"},
        {"name": "key", "type": "string"},
        {"name": "json", "type": ["null", "string"], "default": None},
        {"name": "event", "type": ["null", "bytes"], "default": None},
    ]})
_NAME = re.compile(r"(\d{15})-(\d{12})\.avro\Z")


class SnapshotError(RuntimeError):
    pass


@dataclass(frozen=True)
class SnapshotFile:
    path: Path
    cut: int
    applied: int


def directory(cfg: Config) -> Path:
    return Path(cfg.run_dir) / "history" / (re.sub(r"[^A-Za-z0-9_.-]", "_", cfg.topic_prefix) or "_")


def conditions(region: Region) -> dict[str, Any]:
    """What a snapshot's decisions depend on besides the log: a snapshot is used only under the same."""
    return {"prefix": region.topics.prefix, "partitions": region.topics.partitions,
            "limits": repr(region.limits), "max_tasks": region.max_tasks, "lookahead_ms": region.lookahead_ms}


def listing(cfg: Config) -> list[SnapshotFile]:
    d = directory(cfg)
    out = []
    if d.is_dir():
        for p in d.iterdir():
            m = _NAME.match(p.name)
            if m:
                out.append(SnapshotFile(p, int(m.group(1)), int(m.group(2))))
    return sorted(out, key=lambda s: (s.cut, s.applied))


def latest_before(cfg: Config, moment_ms: int) -> list[SnapshotFile]:
    """The snapshots at or before ``moment_ms``, newest first."""
    return [s for s in reversed(listing(cfg)) if s.cut <= moment_ms]


# -- writing -----------------------------------------------------------------------------------------------------
def _items(region: Region, registry: SchemaRegistry) -> Iterator[dict]:
    def js(kind: str, key: str, value: Any) -> dict:
        return {"kind": kind, "key": key, "json": json.dumps(value, separators=(",", ":")), "event": None}

    def ev(kind: str, key: str, event: Event, extra: Any = None) -> dict:
        return {"kind": kind, "key": key, "json": None if extra is None else json.dumps(extra),
                "event": registry.encode(event.type, event.to_record(), validate=False)}

    fold = region.fold
    for mid, m in fold.machines.items():
        yield js("machine", mid, {
            "region": m.region, "dc": m.dc, "msb": m.msb, "rack": m.rack, "type": m.type, "cpu_cap": m.cpu_cap,
            "mem_cap": m.mem_cap, "cpu_free": m.cpu_free, "mem_free": m.mem_free, "entitlement": m.entitlement,
            "status": m.status, "host_profile": m.host_profile, "version": m.version,
            "maintenance": list(m.maintenance), "tasks": {t: list(fold.taskres[t]) for t in sorted(m.tasks)},
            "changed_ms": region.changed_ms.get(mid, 0)})
    for rid, req in fold.requests.items():
        yield js("request", rid, {"cpu": req.cpu, "mem": req.mem, "tasks": sorted(req.tasks)})
    for name, fields in fold.entitlement_fields.items():
        yield js("entitlement", name, fields)
    yield js("marks", "", [[t, p, o] for (t, p), o in fold.marks.items()])
    st = region.scheduler
    for job in st.jobs.values():
        yield js("job", job.id, sd.job_to_record(job))
    for ent in st.entitlements.values():
        yield js("scheduler-entitlement", ent.name, asdict(ent))
    yield js("machines-down", "", dict(st.machines_down))
    yield js("buckets", "", {str(p): bucket_record(b) for p, b in region.buckets.items()})
    for job, header in region.published.items():
        yield ev("published", job, header)
    for job, parts in region.parts.items():
        yield js("parts", job, {str(n): tasks for n, tasks in parts.items()})
    for rid, (req, partition) in region.open_requests.items():
        yield ev("open-request", rid, req, partition)
    for when, rank, _, kind, data in sorted(region._queue):
        if kind != 0:  # only inputs are kept: a timer is read again from the log after the cut
            continue
        event, partition, silent = data
        yield ev("input", str(when), event, {"rank": list(rank), "partition": partition, "silent": silent})
    for partition, waiting in region._waiting.items():
        for event, since in waiting:
            yield ev("waiting", str(since), event, partition)
    yield js("last-keys", "", [[t, p, k] for (t, p), k in region._last_key.items()])


def write(cfg: Config, region: Region, registry: SchemaRegistry) -> SnapshotFile:
    """``region`` (advanced to its ``cut``; nothing of it beyond) as a snapshot file."""
    if region.cut is None:
        raise SnapshotError("a region with nothing applied has no snapshot")
    d = directory(cfg)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "cut": region.cut, "applied": region.applied, "fold_failed": region.fold_failed,
            "decide_failed": region.decide_failed, "created_ms": int(time.time() * 1000),
            "positions": [[t, p, o, region.last_ids.get((t, p))] for (t, p), o in sorted(region.positions.items())],
            **conditions(region)}
    path = d / f"{region.cut:015d}-{region.applied:012d}.avro"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".avro")
    try:
        with os.fdopen(fd, "wb") as fh:
            avro_writer(fh, ITEM_SCHEMA, _items(region, registry), metadata={META_KEY: json.dumps(meta)},
                        codec="deflate")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return SnapshotFile(path, region.cut, region.applied)


# -- reading -----------------------------------------------------------------------------------------------------
def load(snap: SnapshotFile, region: Region, registry: SchemaRegistry) -> dict[tuple[str, int], str]:
    """Fill the empty ``region`` from ``snap``; returns the event id the log must hold just before each position
    (``reader.merged``'s ``verify``). Raises SnapshotError if the snapshot was made under other conditions."""
    with open(snap.path, "rb") as fh:
        rd = avro_reader(fh)
        meta = json.loads(rd.metadata[META_KEY])
        if meta.get("format") != FORMAT:
            raise SnapshotError(f"{snap.path.name}: format {meta.get('format')}, this version reads {FORMAT}")
        want = conditions(region)
        differ = [k for k, v in want.items() if meta.get(k) != v]
        if differ:
            raise SnapshotError(f"{snap.path.name}: made under another {', '.join(differ)}")
        fold = region.fold
        jobs, ents, inputs, down = [], [], [], {}
        for item in rd:
            kind, key = item["kind"], item["key"]
            value = json.loads(item["json"]) if item["json"] is not None else None
            if kind == "machine":
                tasks = value.pop("tasks")
                region.changed_ms[key] = value.pop("changed_ms")
                m = MachineRec(id=key, maintenance=tuple(value.pop("maintenance")), tasks=set(tasks), **value)
                fold.machines[key] = m
                for t, (cpu, mem) in tasks.items():
                    fold.placement[t] = key
                    fold.taskres[t] = (cpu, mem)
                    fold.job_tasks[t.rpartition("/")[0]].add(t)
            elif kind == "request":
                fold.requests[key] = PendingRequest(value["cpu"], value["mem"], set(value["tasks"]))
            elif kind == "entitlement":
                fold.entitlement_fields[key] = value
                ent = entitlement_of(key, value)
                if ent is not None:
                    fold.entitlements[key] = ent
            elif kind == "marks":
                fold.marks = {(t, p): o for t, p, o in value}
            elif kind == "job":
                jobs.append(sd.job_from_record(value))
            elif kind == "scheduler-entitlement":
                ents.append(sd.Entitlement(**value))
            elif kind == "machines-down":
                down = value
            elif kind == "buckets":
                region.buckets = {int(p): bucket_of(b) for p, b in value.items()}
            elif kind == "published":
                region.published[key] = _event(registry, item["event"])
            elif kind == "parts":
                region.parts[key] = {int(n): tasks for n, tasks in value.items()}
            elif kind == "open-request":
                region.open_requests[key] = (_event(registry, item["event"]), value)
            elif kind == "input":
                inputs.append((int(key), tuple(value["rank"]), _event(registry, item["event"]), value["partition"],
                               value["silent"]))
            elif kind == "waiting":
                region._waiting.setdefault(value, []).append((_event(registry, item["event"]), int(key)))
            elif kind == "last-keys":
                region._last_key = {(t, p): k for t, p, k in value}
    region.scheduler = sd.state_of(jobs, ents, down)
    for when, rank, event, partition, silent in inputs:
        region._push(when, rank, 0, (event, partition, silent))
    region.cut = meta["cut"]
    region.applied = meta["applied"]
    region.fold_failed = meta["fold_failed"]
    region.decide_failed = meta["decide_failed"]
    verify = {}
    for t, p, o, eid in meta["positions"]:
        region.positions[(t, p)] = o
        if eid is not None:
            region.last_ids[(t, p)] = eid
            verify[(t, p)] = eid
    return verify


def _event(registry: SchemaRegistry, data: bytes) -> Event:
    type_, record = registry.decode(data)
    return Event.from_record(type_, record)


def discard(snap: SnapshotFile) -> None:
    snap.path.unlink(missing_ok=True)


__all__ = ["SnapshotFile", "SnapshotError", "SNAPSHOT_EVERY", "directory", "listing", "latest_before", "write",
           "load", "discard"]
