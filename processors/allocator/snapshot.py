"""Snapshots of the allocator's fold, so a start reads the newest snapshot and the log after it, not the whole log.

    <run dir>/allocator/<topic prefix or "_">/<created ms:015d>-<records read:012d>.snap

A start (``Allocator.catch_up``) loads the newest snapshot whose format and conditions (topic prefix, partitions)
are this region's, then reads every partition from where the snapshot left it. The snapshot says, per partition,
the offset and event id of the last record its fold applied: that record is read again (alone: ``check_log``) and
must be the same event (``LogChanged`` otherwise: the log was replaced since, e.g. a region made again under the same
run directory or `restore`d; the snapshot is set aside and the log folded from its beginning). A snapshot that
cannot be read is set aside the same way. It is derived data, a cache: the log gives it back whenever it is missing.

**What it holds** is what the fold decides on and what makes its decisions idempotent: every machine (its record and
its tasks' resources), the resources of unanswered requests, the entitlements, the marks (the last offset read per
partition), the request ids whose decision is on the log (``RegionFold.decided``: a request delivered again after
the snapshot is not decided twice), and the open requests themselves (the AllocationRequested events no decision
answers yet, with their partition: decided after the start as if just read).

**When it is written.** Only when the fold holds what a fold of the log would (``RegionFold.as_logged``: each decision
the allocator applied as it made it has been read back since): after a start's catch-up (nothing decided yet), and
while it runs, once ``ROPEWALK_ALLOC_SNAPSHOT_RECORDS`` records were read since the last one and at most once every
``ROPEWALK_ALLOC_SNAPSHOT_S``. Written by a child process (``os.fork``: the fold as it stands, copy on write, while
the allocator goes on deciding; Redis's BGSAVE does the same), to a temporary name then renamed: a reader never sees
half a snapshot. The newest ``KEEP`` stay.

**Format.** JSON lines (orjson): the metadata, then the machines in chunks of ``CHUNK`` (``RegionFold.machine_rows``:
positional, five times faster to load than named fields), then the small parts.
"""
from __future__ import annotations

import logging
import os
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from infra.config import Config
from infra.private import make_dir
from processors.allocator.decide import event_from_json, event_to_json
from processors.allocator.fold import Position, RegionFold
from streams.clients import EventConsumer
from streams.events import Event
from streams.progress import ProgressFn
from streams.replay import Replay, ReplayFilter
from streams.serde import SchemaRegistry

log = logging.getLogger(__name__)

FORMAT = 2  # 2: machines as rows (``RegionFold.machine_rows``)
KEEP = 2  # snapshots kept (the newest)
CHUNK = 10_000  # machines per line
SUFFIX = ".snap"
RECORDS_ENV = "ROPEWALK_ALLOC_SNAPSHOT_RECORDS"
RECORDS = 200_000  # records read since the last snapshot before the next is written
EVERY_ENV = "ROPEWALK_ALLOC_SNAPSHOT_S"
EVERY_S = 300.0  # ... and at most one this often while the allocator runs


class SnapshotError(RuntimeError):
    """A snapshot this region cannot use (unreadable, another format or region)."""


class LogChanged(SnapshotError):
    """The log no longer holds the record a snapshot ended at: it was replaced since."""


@dataclass
class Loaded:
    path: Path
    fold: RegionFold
    pending: list[tuple[Event, int]]  # open requests: (AllocationRequested, partition), in the order they arrived
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def verify(self) -> dict[tuple[str, int], tuple[int, str]]:
        """Partition -> (offset, event id) of the last record the fold applied (``check_log``)."""
        return self.fold.last_applied


def directory(cfg: Config) -> Path:
    return Path(cfg.run_dir) / "allocator" / (re.sub(r"[^A-Za-z0-9_.-]", "_", cfg.topic_prefix) or "_")


def conditions(cfg: Config) -> dict[str, Any]:
    """What a snapshot's fold depends on besides the log: one made under others is not this region's."""
    return {"topic_prefix": cfg.topic_prefix, "partitions": cfg.partitions}


def listing(cfg: Config) -> list[Path]:
    """The snapshots, oldest first."""
    d = directory(cfg)
    return sorted(d.glob(f"*{SUFFIX}")) if d.is_dir() else []


def settings() -> tuple[int, float]:
    """(records between two snapshots, least seconds between two), from the environment."""
    return (int(os.environ.get(RECORDS_ENV) or RECORDS), float(os.environ.get(EVERY_ENV) or EVERY_S))


# -- writing -----------------------------------------------------------------------------------------------------
def _lines(fold: RegionFold, pending: Iterable[tuple[Event, int]], meta: dict[str, Any]) -> Iterator[bytes]:
    yield orjson.dumps(meta)
    chunk: list = []
    for row in fold.machine_rows():
        chunk.append(row)
        if len(chunk) >= CHUNK:
            yield orjson.dumps({"machines": chunk})
            chunk = []
    if chunk:
        yield orjson.dumps({"machines": chunk})
    yield orjson.dumps({"requests": fold.requests_doc(), "entitlements": fold.entitlement_fields,
                        "decided": list(fold.decided),
                        "pending": [[event_to_json(e), p] for e, p in pending]})


def write(cfg: Config, fold: RegionFold, pending: Iterable[tuple[Event, int]], *, records: int) -> Path:
    """``fold`` (which must hold what a fold of the log up to its marks holds) and its open requests, as the newest
    snapshot; older ones beyond ``KEEP`` deleted. ``records``: how many records the fold has read in all (its name
    says it, for the operator)."""
    if not fold.as_logged:
        raise SnapshotError("the fold is ahead of the log (decisions not read back yet, or machines taken from the "
                            "shared index): no snapshot")
    d = directory(cfg)
    make_dir(d.parent)
    d.mkdir(parents=True, exist_ok=True)
    now = int(time.time() * 1000)
    meta = {"format": FORMAT, **conditions(cfg), "created_ms": now, "records": records,
            "machines": len(fold.machines), "applied": fold.applied,
            "marks": [[t, p, o] for (t, p), o in sorted(fold.marks.items())],
            "last_applied": [[t, p, o, eid] for (t, p), (o, eid) in sorted(fold.last_applied.items())]}
    path = d / f"{now:015d}-{records:012d}{SUFFIX}"
    tmp = d / f".tmp-{os.getpid()}-{now}.part"  # never a ``*.snap``: a reader would take it, half written
    try:
        with open(tmp, "wb") as fh:
            for line in _lines(fold, pending, meta):
                fh.write(line)
                fh.write(b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for old in listing(cfg)[:-KEEP] + sorted(d.glob("*.bad"))[:-KEEP] + _abandoned(d, tmp):
        old.unlink(missing_ok=True)
    return path


def _abandoned(d: Path, mine: Path) -> list[Path]:
    """Temporary files of writers killed half-way (an hour old)."""
    out = []
    for p in d.glob(".tmp-*.part"):
        try:
            if p != mine and time.time() - p.stat().st_mtime > 3600:
                out.append(p)
        except OSError:  # renamed or deleted meanwhile
            pass
    return out


def write_in_child(cfg: Config, fold: RegionFold, pending: list[tuple[Event, int]], *, records: int) -> int:
    """``write`` in a child process (the fold as it stands now, copy on write); returns its pid (reap it with
    ``reaped``). The child touches nothing but the fold and its file: no logging, no client, no lock."""
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            write(cfg, fold, pending, records=records)
        except BaseException:  # noqa: BLE001 - its exit code says it; the next attempt writes it again
            code = 1
        os._exit(code)
    return pid


def reaped(pid: int) -> int | None:
    """The exit code of the child ``pid`` once it ended (None while it runs)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -1
    return None if done == 0 else os.waitstatus_to_exitcode(status)


# -- reading -----------------------------------------------------------------------------------------------------
def load(cfg: Config, path: Path) -> Loaded:
    """The fold ``path`` holds. Raises SnapshotError if it cannot be read or is another region's."""
    fold = RegionFold()
    try:
        with open(path, "rb") as fh:
            meta = orjson.loads(fh.readline())
            if meta.get("format") != FORMAT:
                raise SnapshotError(f"{path.name}: format {meta.get('format')}, this version reads {FORMAT}")
            differ = [k for k, v in conditions(cfg).items() if meta.get(k) != v]
            if differ:
                raise SnapshotError(f"{path.name}: made under another {', '.join(differ)}")
            small: dict[str, Any] = {}

            def rows() -> Iterator[list]:
                for line in fh:
                    doc = orjson.loads(line)
                    if "machines" in doc:
                        yield from doc["machines"]
                    else:
                        small.update(doc)
            fold.restore_rows(rows())
        fold.restore_requests(small["requests"])
        fold.restore_entitlements(small["entitlements"])
        for rid in small["decided"]:
            fold.decided[rid] = None
        pending = [(event_from_json(e), p) for e, p in small["pending"]]
        fold.marks = {(t, p): o for t, p, o in meta["marks"]}
        fold.last_applied = {(t, p): (o, eid) for t, p, o, eid in meta["last_applied"]}
        fold.applied = meta["applied"]
    except SnapshotError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"{path.name}: unreadable ({type(exc).__name__}: {exc})") from exc
    return Loaded(path, fold, pending, meta)


def newest(cfg: Config) -> Loaded | None:
    """The newest snapshot this region can use (those it cannot are set aside, with the reason logged)."""
    for path in reversed(listing(cfg)):
        try:
            return load(cfg, path)
        except SnapshotError as exc:
            set_aside(path, str(exc))
    return None


def read_after(cfg: Config, registry: SchemaRegistry, loaded: Loaded | None, topics: Sequence[str],
               types: frozenset[str], *, stall_timeout_s: float = 30.0, progress: ProgressFn | None = None
               ) -> tuple[Loaded | None, Replay, dict[tuple[str, int], list[tuple[Event, Position]]]]:
    """The records of ``types`` on ``topics`` after ``loaded`` (kept), or from the beginning when there is none or
    the log no longer holds the record it ended at (it is set aside): per partition, for ``fold.merged``."""
    if loaded is not None:
        try:
            return (loaded, *_read(cfg, registry, loaded, topics, types, stall_timeout_s, progress))
        except LogChanged as exc:
            set_aside(loaded.path, str(exc))
    return (None, *_read(cfg, registry, None, topics, types, stall_timeout_s, progress))


def _read(cfg: Config, registry: SchemaRegistry, loaded: Loaded | None, topics: Sequence[str], types: frozenset[str],
          stall_timeout_s: float, progress: ProgressFn | None
          ) -> tuple[Replay, dict[tuple[str, int], list[tuple[Event, Position]]]]:
    """The log from the beginning, or (``loaded``) after the snapshot's marks, once the record each partition's fold
    applied last is checked (``check_log``)."""
    start: dict[tuple[str, int], int] = {}
    if loaded is not None:
        check_log(cfg, registry, loaded.verify, stall_timeout_s)
        start = {tp: o + 1 for tp, o in loaded.fold.marks.items()}
    run = Replay(cfg, registry, ReplayFilter(topics=tuple(topics), types=types), start_offsets=start,
                 stall_timeout_s=stall_timeout_s, progress=progress)
    parts: dict[tuple[str, int], list[tuple[Event, Position]]] = defaultdict(list)
    for rec in run:
        if rec.event.type in types:
            parts[(rec.topic, rec.partition)].append((rec.event, (rec.topic, rec.partition, rec.offset)))
    return run, parts


def check_log(cfg: Config, registry: SchemaRegistry, verify: dict[tuple[str, int], tuple[int, str]],
              timeout_s: float = 30.0) -> None:
    """Each partition's record at the offset ``verify`` names is the event it names, else ``LogChanged``: one
    record read per partition. (Reading the log from there instead re-read, undecoded, every record of other types
    since: on ``intents``, every job's since the last entitlement's, at each start; the bench's start read 638
    records where it needed 6.)"""
    if not verify:
        return
    left = dict(verify)
    consumer = EventConsumer(cfg, registry, sorted({t for t, _ in verify}), name="allocator-snapshot",
                             start_offsets={tp: o for tp, (o, _) in verify.items()})
    try:
        consumer.assign({tp: o for tp, (o, _) in verify.items()}, only=list(verify))
        deadline = time.monotonic() + timeout_s
        while left and time.monotonic() < deadline:
            for rec in consumer.poll(100, 0.2):
                tp = (rec.topic, rec.partition)
                want = left.pop(tp, None)
                if want is None:
                    continue
                consumer.pause([tp])
                if (rec.offset, rec.event.event_id) != want:
                    raise LogChanged(f"{tp[0]}[{tp[1]}]@{rec.offset}: event {rec.event.event_id}, the snapshot ended "
                                     f"at {want[1]}@{want[0]}")
            gone = [tp for tp in left if tp in consumer.eof]
            if gone:
                raise LogChanged(f"{gone[0][0]}[{gone[0][1]}]: the record the snapshot ended at (offset "
                                 f"{left[gone[0]][0]}) is not on the log")
        if left:
            (topic, partition), (offset, _) = next(iter(left.items()))
            raise LogChanged(f"{topic}[{partition}]: the record the snapshot ended at (offset {offset}) was not read "
                             f"in {timeout_s:.0f} s")
    finally:
        consumer.close()


def set_aside(path: Path, why: str) -> None:
    """A snapshot that cannot serve: renamed ``*.bad`` (kept for a look, never read again)."""
    log.warning("allocator: snapshot %s set aside: %s", path.name, why)
    try:
        os.replace(path, path.with_suffix(".bad"))
    except OSError:
        pass


__all__ = ["CHUNK", "EVERY_ENV", "EVERY_S", "FORMAT", "KEEP", "LogChanged", "Loaded", "RECORDS", "RECORDS_ENV",
           "SnapshotError", "conditions", "directory", "listing", "load", "check_log", "newest", "read_after", "reaped", "set_aside", "settings",
           "write", "write_in_child"]
