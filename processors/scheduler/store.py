"""How a job is kept in the shard's tables: a header and bounded chunks of tasks, written as few as changed. Pure.

A job of 1,000 tasks was one table value of ~487 KB of JSON, written whole after every event; one of 20,000
tasks made an 8.7 MB changelog record the broker refused (``MessageSizeTooLargeError``), and the scheduler
crash-looped. Now a job is

    header   jobs table, key <job id>       the job without its tasks (``job_to_record`` of it) and
                                            "chunks": {"<i>": v, ...}  which version of each chunk is the job's,
                                            "version": the latest version written
                                            "timer": ``decide.has_timer_work`` of the job (its timer loads only
                                            these; a header without it, written before, counts as True)
                                            "timer_at": ``decide.timer_due_ms``: from when (the timer loads a
                                            job once it is due, not every job in flight at each round)
    chunk    chunks table, key <job>#<i>@<v>  {"entitlement": e, "tasks": [task record, ...]}: the tasks of index
                                            in [i*CHUNK_TASKS, (i+1)*CHUNK_TASKS), in index order, at version v

Task records are sparse (a field at its default is left out): a running task is ~240 bytes, a chunk of 500 tasks
~120 KB, far below the broker's 1 MiB; the header holds no per-task data except the duplicate ring and
TaskControl's operation lists (bounded by the job's size limit). ``plan`` says, for a decision's before and after,
which chunks to write (only those with a task added, removed or changed: identity of the immutable ``Task``),
the new header, and which chunk keys the new header no longer names.

**Delivery: a crash never leaves a half-written job.** Chunk keys are immutable: a changed chunk is written under
a new version (the job's ``version`` + 1), never over the one the current header names. The shard writes

    1. the new chunks                                   (then waits until the broker has them: a producer flush)
    2. the new headers (and the other tables' values)   (flush)
    3. the source offsets, and tombstones for the chunk keys the new headers no longer name

so a header that reached the changelog names only chunks that reached it before, and a chunk is deleted only once
a header that does not name it is on the log. A crash anywhere leaves each job either at its old header with its
old chunks (all still there: nothing the old header names is overwritten or deleted before the new header is
durable), or at its new header with its new chunks: never a mix. The successor re-decides the events after the
committed offset: a job still at its old header re-decides them to the same outputs (derived ids), a job at its
new header finds their ids in its duplicate ring. Chunks written in 1. whose header never made it are garbage
nothing names; ``orphans`` finds them (the shard's timer deletes them) and the next write of that chunk reuses the
key anyway (same version). A changelog record is bounded by ``CHUNK_TASKS`` tasks, whatever the job's size.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from processors.scheduler.decide import ended_before, machines_of, maint_machines, timer_due_ms
from processors.scheduler.lifecycle import JOB_DELETED
from processors.scheduler.model import Job, Task
from processors.scheduler.records import job_from_record, job_to_record, terms_of, terms_record

CHUNK_TASKS = 500  # tasks per chunk record (a task of index i is in chunk i // CHUNK_TASKS)
HEADER_FORMAT = 2  # headers with chunks; a record with "tasks" is the older whole-job format (still read)

_TASK_FIELDS = tuple(f.name for f in fields(Task) if f.init)
_DEFAULTS = {f.name: f.default for f in fields(Task) if f.init and f.default is not MISSING}
_TERMS = ("terms", "request_terms")


class MissingChunk(LookupError):
    """A header names a chunk the table does not hold (a store broken outside the delivery argument)."""


def chunk_of(task: Task) -> int:
    return task.index // CHUNK_TASKS


def chunk_key(job_id: str, chunk: int, version: int) -> str:
    return f"{job_id}#{chunk}@{version}"


def job_of_key(key: str) -> str:
    """The job id of a chunk key."""
    return key.rsplit("#", 1)[0]


def task_record(t: Task) -> dict[str, Any]:
    """``t`` as a sparse JSON-able record: fields at their default are left out."""
    r: dict[str, Any] = {}
    for name in _TASK_FIELDS:
        v = getattr(t, name)
        if name in _TERMS:
            if v is not None:
                r[name] = terms_record(v)
        elif name not in _DEFAULTS or v != _DEFAULTS[name]:
            r[name] = v
    return r


def task_of(r: Mapping[str, Any]) -> Task:
    return Task(**{**r, "terms": terms_of(r.get("terms")), "request_terms": terms_of(r.get("request_terms"))})


def is_chunked(header: Mapping[str, Any]) -> bool:
    return "chunks" in header


def header_key(header: Mapping[str, Any]) -> str:
    """The key a header is stored under, which its chunks' keys start with: the job id, or the job id qualified by
    the partition it is kept for (``handover.storage_key``: a job of an entitlement that lives off its hash
    partition)."""
    return header.get("key") or header["id"]


def job_of(header: Mapping[str, Any], chunks: Mapping[str, Any]) -> Job:
    """The job a header and the chunk table (key -> value) hold. Raises MissingChunk."""
    if not is_chunked(header):
        return job_from_record(header)  # the older whole-job record
    tasks: list[Task] = []
    key = header_key(header)
    for i, v in sorted(((int(i), v) for i, v in header["chunks"].items())):
        value = chunks.get(chunk_key(key, i, v))
        if value is None:
            raise MissingChunk(f"job {header['id']}: its header names chunk {i} at version {v}, which the table "
                               "does not hold")
        tasks.extend(task_of(r) for r in value["tasks"])
    job = job_from_record({**header, "tasks": []})
    return replace(job, tasks=MappingProxyType({t.id: t for t in tasks}))


@dataclass
class Plan:
    """What to write for one job: the chunks (key -> value), then the header, then delete ``obsolete`` keys."""

    header: dict[str, Any]
    chunks: dict[str, dict[str, Any]] = field(default_factory=dict)
    obsolete: list[str] = field(default_factory=list)


def _by_chunk(tasks: Iterable[Task]) -> dict[int, list[Task]]:
    out: dict[int, list[Task]] = {}
    for t in tasks:
        out.setdefault(chunk_of(t), []).append(t)
    return out


def plan(before: Job | None, header: Mapping[str, Any] | None, chunk_values: Mapping[str, Any],  # noqa: C901
         after: Job, key: str | None = None) -> Plan:
    """The writes that take the stored job from ``header`` (as read; None: not stored) and ``before`` (the job
    it holds) to ``after``. Only chunks with a task added, removed or replaced are written (a new version);
    their records of unchanged tasks are reused from ``chunk_values`` (the chunk table) as they are. ``key``: the
    key the job is stored under (``header_key``; None: its id)."""
    key = key or after.id
    old_chunks: dict[int, int] = {}
    version = 0
    if header is not None and is_chunked(header) and before is not None:
        old_chunks = {int(i): v for i, v in header["chunks"].items()}
        version = header["version"]
        changed: set[int] = set()
        old_tasks = before.tasks
        for tid, t in after.tasks.items():
            if old_tasks.get(tid) is not t:
                changed.add(chunk_of(t))
        if len(old_tasks) != len(after.tasks) or changed:
            changed |= {chunk_of(t) for tid, t in old_tasks.items() if tid not in after.tasks}
    else:  # new, or held in the older whole-job record: every chunk is written
        changed = {chunk_of(t) for t in after.tasks.values()}
        before = None
    new_chunks = dict(old_chunks)
    out_chunks: dict[str, dict[str, Any]] = {}
    obsolete: list[str] = []
    if changed:
        version += 1
        grouped = _by_chunk(t for t in after.tasks.values() if chunk_of(t) in changed)
        for i in sorted(changed):
            reuse: dict[str, dict] = {}
            if i in old_chunks and before is not None:
                old_value = chunk_values.get(chunk_key(key, i, old_chunks[i]))
                if old_value is not None:
                    reuse = {r["id"]: r for r in old_value["tasks"]}
                obsolete.append(chunk_key(key, i, old_chunks[i]))
            tasks = grouped.get(i)
            if not tasks:
                new_chunks.pop(i, None)
                continue
            records = []
            for t in tasks:
                r = reuse.get(t.id)  # (only with ``before``)
                same = r is not None and before is not None and before.tasks.get(t.id) is t
                records.append(r if same else task_record(t))
            out_chunks[chunk_key(key, i, version)] = {"entitlement": after.entitlement, "tasks": records}
            new_chunks[i] = version
    timer_at = timer_due_ms(after)
    head = job_to_record(replace(after, tasks=MappingProxyType({})))
    del head["tasks"]
    head.update(format=HEADER_FORMAT, version=version, chunks={str(i): v for i, v in sorted(new_chunks.items())},
                timer=timer_at is not None, timer_at=timer_at)  # (``decide.has_timer_work``, derived)
    if key != after.id:
        head["key"] = key
    return Plan(head, out_chunks, obsolete)


def wants_timer(header: Mapping[str, Any], now_ms: int | None = None) -> bool:
    """Whether the job a header stands for may have work for the retry timer (its ``timer``; True if it has none:
    a header written before the flag, or the older whole-job record); with ``now_ms``, whether that work is due by
    then (its ``timer_at``, ``decide.timer_due_ms``, where the header has one)."""
    if now_ms is not None and "timer_at" in header:
        at = header["timer_at"]
        return at is not None and at <= now_ms
    return bool(header.get("timer", True))


def expired(header: Mapping[str, Any], now_ms: int, gc_ms: int) -> bool:
    """``decide.is_expired`` of the job a header (or an older whole-job record) stands for, read without decoding
    it: the timer loads those to ``collect`` them."""
    phase = JOB_DELETED if header.get("deleted") else header.get("status", "")
    return ended_before(phase, header.get("ended_ms"), now_ms, gc_ms)


def named_keys(header: Mapping[str, Any]) -> set[str]:
    """The chunk keys a header names."""
    if not is_chunked(header):
        return set()
    key = header_key(header)
    return {chunk_key(key, int(i), v) for i, v in header["chunks"].items()}


def orphans(chunk_keys: Iterable[str], headers: Mapping[str, Any]) -> list[str]:
    """Chunk keys no header names (garbage of a write a crash interrupted, or a lost tombstone), sorted."""
    named: dict[str, set[str]] = {}
    out = []
    for key in chunk_keys:
        job = job_of_key(key)
        if job not in named:
            h = headers.get(job)
            named[job] = named_keys(h) if h is not None else set()
        if key not in named[job]:
            out.append(key)
    return sorted(out)


def index_key(entitlement: str, machine: str) -> str:
    return f"{entitlement}|{machine}"


class MachineJobs:
    """``"<entitlement>|<machine>"`` -> the keys (``header_key``: ids, or ids qualified by a partition) of the jobs of
    that entitlement with a task on the machine, in memory.
    Derived from the jobs table and its chunks (``build``: each stored job's task records name their machine), kept
    in step by ``update`` for every job a batch writes, and dropped (``forget``) at every partition assignment: a
    recovery or a standby copy changes the tables without a write of this worker's, so the next use builds it
    again from what the tables hold then."""

    def __init__(self) -> None:
        self._ids: dict[str, set[str]] | None = None  # None: to be built from the tables

    def forget(self) -> None:
        self._ids = None

    def build(self, headers: Mapping[str, Any], chunks: Mapping[str, Any]) -> None:
        """Index every stored job: ``headers`` the jobs table (job id -> header), ``chunks`` the chunk table."""
        ids: dict[str, set[str]] = {}
        for job_id, header in list(headers.items()):
            if header is None:
                continue
            ent = header["entitlement"]
            if is_chunked(header):  # decide.machines_of of the stored job: its tasks' machines, its maintenances'
                machines = {r["machine"] for key in named_keys(header)
                            for r in (chunks.get(key) or {}).get("tasks", ()) if r.get("machine") is not None}
                machines |= maint_machines(header.get("maint", ()))
            else:
                machines = machines_of(job_from_record(header))  # the older whole-job record
            for m in machines:
                ids.setdefault(index_key(ent, m), set()).add(job_id)
        self._ids = ids

    @property
    def built(self) -> bool:
        return self._ids is not None

    def jobs(self, entitlement: str, machine: str) -> set[str]:
        return self._ids.get(index_key(entitlement, machine), set()) if self._ids is not None else set()

    def update(self, job_id: str, entitlement: str, before: set[str], after: set[str]) -> None:
        """The job's tasks left the machines of ``before`` not in ``after`` and came to those of ``after``."""
        if self._ids is None:
            return  # built from the tables (which already hold this write) when next needed
        for m in before - after:
            key = index_key(entitlement, m)
            held = self._ids.get(key)
            if held is not None:
                held.discard(job_id)
                if not held:
                    del self._ids[key]
        for m in after - before:
            self._ids.setdefault(index_key(entitlement, m), set()).add(job_id)
