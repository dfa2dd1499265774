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
records, ``records.job_to_record``; a deleted one, ``decide.is_dormant``, as ``job-deleted``, which a load keeps
undecoded in ``Region.dormant`` until an input names it: a region keeps every job it ever stopped, ~1.2 KB each,
and decoding 60,000 of them was most of a look at the end of a 1,000,000-event log) or as an Avro single-object
encoded event (the jobs' latest published states, undecided inputs, open requests). The container's metadata ``ropewalk.history`` holds the cut, the positions
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
from infra.private import make_dir
from processors.allocator.placement import Entitlement
from processors.history.region import Region
from processors.scheduler import model as sm
from processors.scheduler import records
from processors.scheduler.decide import is_dormant
from processors.taskcontrol.limiter import bucket_of, bucket_record
from streams.events import Event
from streams.serde import SchemaRegistry

# 2: deleted jobs (``decide.is_dormant``) as ``job-deleted`` records, loaded undecoded (``Region.dormant``);
# 3: requests and operations named by their incarnation (``model.incarnation_tag``), jobs gone once their grace
#    passed (``job-gone`` in a delta; a ``job-deleted`` carries ``ended_ms``)
FORMAT = 3
META_KEY = "ropewalk.history"
SNAPSHOT_EVERY = 3_000  # records read between two snapshots a fold of the log writes (at most)
SNAPSHOT_WORK_S = 2.0  # ... or this much folding time, whichever comes first (bounds a later look's tail)
FULL_EVERY = 30  # snapshots: one whole, then deltas of what changed since the previous one
ITEM_SCHEMA = parse_schema({
    "type": "record", "name": "HistoryItem", "namespace": "ropewalk.history",
    "doc": "One part of a snapshot of the region (processors/history/snapshots.py).",
    "fields": [
        {"name": "kind", "type": "string"},
        {"name": "key", "type": "string"},
        {"name": "json", "type": ["null", "string"], "default": None},
        {"name": "event", "type": ["null", "bytes"], "default": None},
        {"name": "ended_ms", "type": ["null", "long"], "default": None},
    ]})
_NAME = re.compile(r"(\d{15})-(\d{12})(\.d)?\.avro\Z")


class SnapshotError(RuntimeError):
    pass


@dataclass(frozen=True)
class SnapshotFile:
    path: Path
    cut: int
    applied: int
    delta: bool = False


def directory(cfg: Config) -> Path:
    return Path(cfg.run_dir) / "history" / (re.sub(r"[^A-Za-z0-9_.-]", "_", cfg.topic_prefix) or "_")


def conditions(region: Region) -> dict[str, Any]:
    """What a snapshot's decisions depend on besides the log: a snapshot is used only under the same."""
    return {"prefix": region.topics.prefix, "partitions": region.topics.partitions,
            "limits": repr(region.limits), "max_tasks": region.max_tasks, "lookahead_ms": region.lookahead_ms,
            "gc_ms": region.gc_ms}


def listing(cfg: Config) -> list[SnapshotFile]:
    d = directory(cfg)
    out = []
    if d.is_dir():
        for p in d.iterdir():
            m = _NAME.match(p.name)
            if m:
                out.append(SnapshotFile(p, int(m.group(1)), int(m.group(2)), bool(m.group(3))))
    return sorted(out, key=lambda s: (s.cut, s.applied, s.delta))


def latest_before(cfg: Config, moment_ms: int) -> list[SnapshotFile]:
    """The snapshots at or before ``moment_ms``, newest first."""
    return [s for s in reversed(listing(cfg)) if s.cut <= moment_ms]


# -- writing -----------------------------------------------------------------------------------------------------
def _items(region: Region, registry: SchemaRegistry, delta: bool) -> Iterator[dict]:  # noqa: C901
    """A whole snapshot's records, or (``delta``) those of what changed since the region's last snapshot; the small
    parts (requests, entitlements, marks, queues) are always whole."""
    def js(kind: str, key: str, value: Any, ended_ms: int | None = None) -> dict:
        return {"kind": kind, "key": key, "json": json.dumps(value, separators=(",", ":")), "event": None,
                "ended_ms": ended_ms}

    def ev(kind: str, key: str, event: Event, extra: Any = None) -> dict:
        return {"kind": kind, "key": key, "json": None if extra is None else json.dumps(extra),
                "event": registry.encode(event.type, event.to_record(), validate=False)}

    fold = region.fold
    for mid in (sorted(region.dirty_machines) if delta else fold.machines):
        yield js("machine", mid, {**fold.machine_doc(fold.machines[mid]), "changed_ms": region.changed_ms.get(mid, 0)})
    yield js("requests", "", fold.requests_doc())
    yield js("entitlements", "", fold.entitlement_fields)
    yield js("marks", "", [[t, p, o] for (t, p), o in fold.marks.items()])
    st = region.scheduler
    before = region.snapshot_jobs if delta else {}
    for job in st.jobs.values():
        if before.get(job.id) is not job:
            yield js("job-deleted" if is_dormant(job) else "job", job.id, records.job_to_record(job), job.ended_ms)
    for job_id in before:  # collected since (``Region.collect``): gone from the chain too
        if job_id not in st.jobs:
            yield js("job-gone", job_id, None)
    if not delta:  # the dormant ones never change while dormant: in the whole snapshots only
        for job_id, (raw, ended) in region.dormant.items():
            yield {"kind": "job-deleted", "key": job_id, "json": raw, "event": None, "ended_ms": ended}
    yield js("scheduler-entitlements", "", [asdict(e) for e in st.entitlements.values()])
    yield js("machines-down", "", dict(st.machines_down))
    yield js("buckets", "", {str(p): bucket_record(b) for p, b in region.buckets.items()})
    yield js("homes", "", dict(sorted(region.homes.items())))
    for job in (sorted(region.dirty_published) if delta else region.published):
        header = region.published.get(job)
        if header is None:
            yield js("published-gone", job, None)
        else:
            yield ev("published", job, header)
            yield js("parts", job, {str(n): tasks for n, tasks in region.parts.get(job, {}).items()})
    yield js("open-requests", "", [[rid, partition] for rid, (_, partition) in region.open_requests.items()])
    for rid, (req, partition) in region.open_requests.items():
        yield ev("open-request", rid, req, partition)
    for when, rank, _, kind, data in sorted(region._queue):
        if kind != 0:  # only inputs are kept: a timer is read again from the log after the cut
            continue
        event, partition, silent = data
        yield ev("input", str(when), event, {"rank": list(rank), "partition": partition, "silent": silent})
    for partition, waiting in region._waiting.items():
        for event, since, tries in waiting:
            yield ev("waiting", str(since), event, [partition, tries])
    yield js("last-keys", "", [[t, p, k] for (t, p), k in region._last_key.items()])


def write(cfg: Config, region: Region, registry: SchemaRegistry, *, full: bool = True) -> SnapshotFile:
    """``region`` (advanced to its ``cut``; nothing of it beyond) as a snapshot file: whole, or (``full`` False and
    the region's last snapshot known) a delta from that one."""
    if region.cut is None:
        raise SnapshotError("a region with nothing applied has no snapshot")
    if region.scheduler_partitions is not None:
        raise SnapshotError("a partial region (some partitions' jobs not decided) has no snapshot")
    delta = not full and region.snapshot_file is not None and region.snapshot_depth + 1 < FULL_EVERY
    d = directory(cfg)
    make_dir(d.parent)  # <run dir>/history: 0700, the region's alone (infra/private.py)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "cut": region.cut, "applied": region.applied, "fold_failed": region.fold_failed,
            "decide_failed": region.decide_failed, "created_ms": int(time.time() * 1000),
            "previous": region.snapshot_file if delta else None,
            "positions": [[t, p, o, region.last_ids.get((t, p))] for (t, p), o in sorted(region.positions.items())],
            **conditions(region)}
    path = d / f"{region.cut:015d}-{region.applied:012d}{'.d' if delta else ''}.avro"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".avro")
    try:
        with os.fdopen(fd, "wb") as fh:
            avro_writer(fh, ITEM_SCHEMA, _items(region, registry, delta), metadata={META_KEY: json.dumps(meta)},
                        codec="deflate")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _written(region, path.name, region.snapshot_depth + 1 if delta else 0)
    return SnapshotFile(path, region.cut, region.applied, delta)


def _written(region: Region, name: str, depth: int) -> None:
    """The region now stands as snapshot ``name`` holds it: later deltas are relative to that."""
    region.snapshot_file = name
    region.snapshot_depth = depth
    region.snapshot_jobs = {j.id: j for j in region.scheduler.jobs.values()}
    region.dirty_machines = set()
    region.dirty_published = set()


def chain_length(cfg: Config, snap: SnapshotFile) -> int:
    """How many files loading ``snap`` reads (its whole snapshot and the deltas to it)."""
    return len(_chain(snap))


# -- reading -----------------------------------------------------------------------------------------------------
def _meta(path: Path) -> dict:
    with open(path, "rb") as fh:
        return json.loads(avro_reader(fh).metadata[META_KEY])


def usable(snap: SnapshotFile, region: Region) -> str | None:
    """Why ``snap`` cannot serve ``region`` (another format or conditions), from its own metadata; None if it can."""
    try:
        meta = _meta(snap.path)
    except Exception as exc:  # noqa: BLE001 - garbage where a snapshot should be: not one
        return f"{snap.path.name}: unreadable ({type(exc).__name__}: {exc})"
    if meta.get("format") != FORMAT:
        return f"{snap.path.name}: format {meta.get('format')}, this version reads {FORMAT}"
    differ = [k for k, v in conditions(region).items() if meta.get(k) != v]
    return f"{snap.path.name}: made under another {', '.join(differ)}" if differ else None


def _chain(snap: SnapshotFile) -> list[Path]:
    """``snap``'s file and the ones before it back to a whole snapshot, oldest first."""
    out = [snap.path]
    meta = _meta(snap.path)
    while meta.get("previous"):
        prev = snap.path.parent / meta["previous"]
        if not prev.exists():
            raise SnapshotError(f"{snap.path.name}: the snapshot before it, {prev.name}, is gone")
        out.append(prev)
        meta = _meta(prev)
        if len(out) > 10 * FULL_EVERY:
            raise SnapshotError(f"{snap.path.name}: a chain of more than {10 * FULL_EVERY} deltas")
    return out[::-1]


def load(snap: SnapshotFile, region: Region, registry: SchemaRegistry) -> dict[tuple[str, int], str]:  # noqa: C901
    """Fill the empty ``region`` from ``snap`` (and, for a delta, the snapshots before it); returns the event id the
    log must hold just before each position (``reader.merged``'s ``verify``). Raises SnapshotError if a file of
    the chain is missing or was made under other conditions."""
    machines: dict[str, str] = {}
    jobs: dict[str, str] = {}
    deleted: dict[str, tuple[str, int | None]] = {}  # dormant jobs (``decide.is_dormant``): left undecoded
    published: dict[str, bytes | None] = {}
    parts: dict[str, str] = {}
    small: dict[str, str] = {}
    opened: dict[str, tuple[bytes, int]] = {}
    inputs, waiting = [], []
    meta: dict = {}
    chain = _chain(snap)
    for path in chain:
        inputs, waiting, opened = [], [], {}
        with open(path, "rb") as fh:
            rd = avro_reader(fh)
            meta = json.loads(rd.metadata[META_KEY])
            if meta.get("format") != FORMAT:
                raise SnapshotError(f"{path.name}: format {meta.get('format')}, this version reads {FORMAT}")
            want = conditions(region)
            differ = [k for k, v in want.items() if meta.get(k) != v]
            if differ:
                raise SnapshotError(f"{path.name}: made under another {', '.join(differ)}")
            for item in rd:
                kind, key = item["kind"], item["key"]
                if kind == "machine":
                    machines[key] = item["json"]
                elif kind == "job":
                    jobs[key] = item["json"]
                    deleted.pop(key, None)
                elif kind == "job-deleted":
                    deleted[key] = (item["json"], item.get("ended_ms"))
                    jobs.pop(key, None)
                elif kind == "job-gone":
                    deleted.pop(key, None)
                    jobs.pop(key, None)
                elif kind == "published":
                    published[key] = item["event"]
                elif kind == "published-gone":
                    published[key] = None
                    parts.pop(key, None)
                elif kind == "parts":
                    parts[key] = item["json"]
                elif kind == "open-request":
                    opened[key] = (item["event"], json.loads(item["json"]))
                elif kind == "input":
                    inputs.append((int(key), item))
                elif kind == "waiting":
                    waiting.append((int(key), item))
                else:
                    small[kind] = item["json"]
    fold = region.fold

    def docs() -> Iterator[tuple[str, dict]]:
        for mid, raw in machines.items():
            value = json.loads(raw)
            region.changed_ms[mid] = value.pop("changed_ms")
            yield mid, value
    fold.restore_machines(docs())
    fold.restore_requests(json.loads(small["requests"]))
    fold.restore_entitlements(json.loads(small["entitlements"]))
    fold.marks = {(t, p): o for t, p, o in json.loads(small["marks"])}
    region._live_jobs = None  # rebuilt from the jobs by the first timer
    region.scheduler = sm.state_of([records.job_from_record(json.loads(raw)) for raw in jobs.values()],
                                   [Entitlement(**e) for e in json.loads(small["scheduler-entitlements"])],
                                   json.loads(small["machines-down"]))
    region.dormant = deleted
    region.buckets = {int(p): bucket_of(b) for p, b in json.loads(small["buckets"]).items()}
    region.homes = {e: int(p) for e, p in json.loads(small.get("homes") or "{}").items()}  # none before the map
    for job, data in published.items():
        if data is not None:
            region.published[job] = _event(registry, data)
            region.parts[job] = {int(n): tasks for n, tasks in json.loads(parts.get(job) or "{}").items()}
    for rid, (data, partition) in opened.items():
        region.open_requests[rid] = (_event(registry, data), partition)
    for when, item in inputs:
        value = json.loads(item["json"])
        region._push(when, tuple(value["rank"]), 0, (_event(registry, item["event"]), value["partition"],
                                                     value["silent"]))
    for since, item in waiting:
        partition, tries = json.loads(item["json"])
        event = _event(registry, item["event"])
        region._waiting.setdefault(partition, []).append((event, since, tries))
        region._push(since + region.lookahead_ms, (4, since, partition), 4, (partition, event.event_id))
    region._last_key = {(t, p): k for t, p, k in json.loads(small["last-keys"])}
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
    _written(region, snap.path.name, len(chain) - 1)
    return verify


def _event(registry: SchemaRegistry, data: bytes) -> Event:
    type_, record = registry.decode(data)
    return Event.from_record(type_, record)


def discard(snap: SnapshotFile) -> None:
    snap.path.unlink(missing_ok=True)


__all__ = ["SnapshotFile", "SnapshotError", "SNAPSHOT_EVERY", "SNAPSHOT_WORK_S", "FULL_EVERY", "directory",
           "listing", "latest_before", "write", "load", "discard", "chain_length"]
