"""The scheduler's model: the immutable state a shard decides on. Pure: no I/O.

A shard's ``SchedulerState`` holds its entitlements (``Entitlement``, the allocator's class: one name for the
concept), its jobs (``Job``, each with its ``Task``s by id, in index order) and the machines known not to be UP.
``Spec`` is a job's spec without its task count, ``Terms`` what a placement holds. How the decisions change them is
``decide.py`` (handlers) and ``steps.py`` (what a task or an operation does next); which task state, job status,
operation state or maintenance choice may follow which is ``lifecycle.py``'s tables; how they are stored is
``records.py``.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from processors.allocator.placement import Entitlement
from processors.cowmap import CowMap
from processors.evolve import evolver
from processors.scheduler import versions as vs
from processors.scheduler.lifecycle import (
    HELD_AT_DEADLINE, JOB_ACTIVE, JOB_DELETED, JOB_PENDING, JOB_RUNNING, JOB_UPDATING, PENDING, RUNNING,
)
from processors.taskcontrol.limiter import Bucket
from processors.taskcontrol.protocol import CHOICE_MOVE, CHOICE_STOP

# What the scheduler does with a task next (its intent), whatever state it is in.
RUN = "run"  # keep it running at the job's spec version
RETIRE = "retire"  # stop it and free its placement (shrink, job stop); it leaves the job
UPDATE = "update"  # being stopped to start again at the job's spec version (rolling update, a grow reusing it)
RELOCATE = "relocate"  # being stopped to be placed on another machine (a ReBalancer move: _on_rebalance_planned)

# Kinds of planned-maintenance choice (Task.maint_choice: its table is lifecycle.CHOICE_TRANSITIONS).
HELD = frozenset({CHOICE_STOP, HELD_AT_DEADLINE})  # stopped for a maintenance: started again when it ends
LEAVING = frozenset({CHOICE_MOVE, CHOICE_STOP})  # choices that stop the task before the maintenance


class SchedulerError(ValueError):
    pass


class UnknownJob(SchedulerError, LookupError):
    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"unknown job {job_id!r}: not in this scheduler shard")


# -- the state -------------------------------------------------------------------------------------------------

Pairs = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Terms:
    """What a placement holds on its machine: per-task resources under hard requirements."""

    cpu: int
    mem: int
    requirements: Pairs = ()

    def fits(self, wanted: "Terms") -> bool:
        """Whether a task wanting ``wanted`` can run in this placement (same requirements, no more resources)."""
        return wanted.cpu <= self.cpu and wanted.mem <= self.mem and wanted.requirements == self.requirements


@dataclass(frozen=True, slots=True)
class Spec:
    """A job's spec without its task count (that is the job's ``desired``, changed by resizes too)."""

    name: str
    command: tuple[str, ...]
    cpu: int
    mem: int
    requirements: Pairs = ()
    spread: str = "msb"
    max_unavailable: int = 1
    env: Pairs = ()
    controller: str | None = None  # the job's TaskController; None: built-in policy (no approvals asked)

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> "Spec":
        """From a JobSubmitted / JobSpecChanged payload."""
        return cls(name=p["name"], command=tuple(p["command"]), cpu=p["resources"]["cpu_millicores"],
                   mem=p["resources"]["memory_mib"], requirements=tuple(sorted(p.get("requirements", {}).items())),
                   spread=p.get("spread", "msb"), max_unavailable=p.get("max_unavailable", 1),
                   env=tuple(sorted(p.get("env", {}).items())), controller=p.get("controller") or None)

    @property
    def terms(self) -> Terms:
        return Terms(self.cpu, self.mem, self.requirements)


@dataclass(frozen=True)  # no slots: replaced as a copy of its ``__dict__`` (``processors.evolve``), 2.4x faster
class Task:
    """One task, ``<job_id>/<index>``. Without ``slots`` a task takes ~56 bytes more (437 against 381 per task with
    its strings, 100,000 tasks under tracemalloc) and a replace costs 4.2 µs instead of 10 (a loaded machine;
    the ratio holds): the scheduler's decisions of a 36-task job's life 1.83 → 1.26 ms (``bench/decide_cost.py``,
    stop 42). CPU is what a job's cost is short of (issue #28); a shard decodes the jobs a decision concerns."""

    id: str
    index: int
    state: str = PENDING
    intent: str = RUN
    spec_version: int = 1  # the version it runs (or will start with, while unplaced)
    machine: str | None = None
    dc: str | None = None
    msb: str | None = None
    rack: str | None = None
    terms: Terms | None = None  # what its placement holds (None: unplaced)
    discovery: bool = False  # enabled in service discovery
    request_id: str | None = None  # the allocation request it awaits (None: none outstanding)
    request_terms: Terms | None = None  # what that request asked for
    asked_ms: int | None = None  # when that request was made (the decision's time)
    parked: bool = False  # unplaced after a rejection: waits for a retry (resize, update, ``retry_unplaced``)
    reason: str = ""  # why it is not (yet) RUNNING; cleared when it runs
    restarts: int = 0  # restarts in place used (restart policy)
    running_since_ms: int | None = None
    op: str | None = None  # wanted on it: OP_UPDATE, OP_MOVE, OP_RESTART, OP_STOP (processors/taskcontrol)
    op_id: str | None = None  # its id, stable across TaskControl re-asks
    op_state: str | None = None  # OP_PENDING, OP_APPROVED, OP_RUNNING
    op_reason: str = ""  # why it is wanted
    fence: bool = False  # a MOVE off a machine that may still run it: STOP it there when the move is performed
    maint_ue: str | None = None  # the planned maintenance (UE id) a choice or the deadline applies to it for
    maint_choice: str | None = None  # CHOICE_MOVE / CHOICE_STOP / CHOICE_KEEP, or HELD_AT_DEADLINE
    move_to: str | None = None  # a ReBalancer move's target machine, until its AllocationRequested is sent
    early_reports: tuple[str, ...] = ()  # agents' reports (JSON) read before the placement they follow (``decide``)
    asked_again: bool = False  # its request was made again by the timer (``steps.ask_again``): the free answering it
    # names where a lost answer had put it, and that machine is sent a STOP (``decide._on_tasks_deallocated``)
    commanded_ms: int | None = None  # when its last START/RESTART/STOP was decided: one left STARTING or STOPPING
    # with no report for ``steps.RECOMMAND_MS`` is commanded again by the timer (``steps.command_again``)
    _row: Mapping[str, Any] | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def row(self) -> Mapping[str, Any]:
        """Its JobStatePublished TaskStatus: built once per task version, when first published (most versions a
        decision makes are never published), so publishing a 15K-task job does not rebuild 15K rows per event."""
        row = self._row
        if row is None:
            row = MappingProxyType({
                "task_id": self.id, "state": self.state, "machine_id": self.machine, "dc": self.dc,
                "msb": self.msb, "rack": self.rack, "spec_version": self.spec_version, "reason": self.reason})
            object.__setattr__(self, "_row", row)
        return row


_task_with = evolver(Task)


def replace(obj: Any, /, **changes: Any) -> Any:
    """``dataclasses.replace``; a ``Task`` (the hot one: replaced several times per task and decision) and a ``Job``
    (replaced each time a decision sets a field) through ``processors.evolve.evolver``: the same result, a copy of
    the object's ``__dict__``, in a ninth of the time for a ``Job`` and under half for a ``Task``."""
    kind = type(obj)
    if kind is Task:
        return _task_with(obj, changes)
    if kind is Job:
        return _job_with(obj, changes)
    return dataclasses.replace(obj, **changes)


def _empty() -> MappingProxyType:
    return MappingProxyType({})


class Maintenance(NamedTuple):
    """A planned maintenance of machines a job's tasks were on (``Job.maint``), from its UnavailabilityStarted."""

    unavailability_id: str
    machine_ids: tuple[str, ...]  # sorted
    start_ms: int
    deadline_ms: int  # the tasks still there are stopped at this time (``steps.enforce_deadlines``)...
    enforced: bool  # ... once: True after


@dataclass(frozen=True)
class Job:
    """A job with its tasks: one record, so one faust table value (the ring and the tasks change together)."""

    id: str
    entitlement: str
    spec: Spec
    spec_version: int
    desired: int  # task count asked for
    status: str = JOB_ACTIVE
    tasks: MappingProxyType[str, Task] = field(default_factory=_empty)  # by id, kept in index order (a dict's view)
    last_reason: str = ""  # latest allocation rejection or refused intent
    last_ignored: str = ""  # latest agent report ignored, and why
    updating: bool = False  # a rolling update is in progress
    requests: int = 0  # allocation requests sent (names the next one)
    free_request_id: str | None = None  # the stop's final free request, until the allocator answers it
    free_asked_ms: int | None = None  # when it was made: made again with no answer (``steps.ask_again``)
    deleted: bool = False  # stopped and freed: the final JobStatePublished said so
    origin: tuple = ()  # what JobSubmitted said (to tell a redelivery from a clashing job id)
    seen: tuple[str, ...] = ()  # the duplicate ring: input event ids applied to this job, newest last
    ops: int = 0  # operations created (names the next)
    ops_open: int = 0  # tasks with an operation (0: nothing to drain)
    bucket: Bucket | None = None  # the job's rate-limiter bucket (None: full)
    throttled: tuple[str, ...] = ()  # operation ids the latest OperationsThrottled announced waiting
    tc_seq: int = 0  # sequence of the latest TaskControlRequested
    tc_outstanding: bool = False  # that request awaits its ack
    tc_asked: tuple[str, ...] = ()  # the operation ids it asked about
    tc_asked_ms: int | None = None  # when it was sent
    tc_completed: tuple[str, ...] = ()  # approved operations completed since, for the next request
    tc_sent_completed: tuple[str, ...] = ()  # those the outstanding request reported (re-sent if it is lost)
    tc_sent_unhealthy: tuple[str, ...] = ()  # the tasks the outstanding request reported down
    tc_notices: tuple = ()  # advance notices: (unavailability id, task ids, start_ms, deadline_ms, duration_ms)
    tc_notice_new: bool = False  # notice news: a new notice, or a task back RUNNING under one (a next choice)
    maint: tuple[Maintenance, ...] = ()  # planned maintenances of its machines, not ended
    incarnation: int = 1  # which submission of this job id (a stopped or rejected job's id may be submitted again)
    submission: str = ""  # the event id of the JobSubmitted that made this incarnation
    mix: vs.Mix | None = None  # several versions at once (push %, canary: versions.py); None: every task the job's
    generation: int = 0  # the latest JobSpecReconciled applied (processors/jobcontrol)
    vacating: tuple[str, ...] = ()  # planned unavailabilities (ids) whose machines its tasks must leave (loans)
    parts: int = 0  # the most JobTasksPublished parts it published (``work.state_keys``: tombstoned when it leaves)
    ended_ms: int | None = None  # when this incarnation ended (stopped and freed, or rejected): it leaves the state
    #                              ``job_gc_ms`` later (``decide.collect``); None while it lives


_job_with = evolver(Job)


@dataclass(frozen=True)
class SchedulerState:
    """One shard: its entitlements, its jobs (with their tasks), and the machines known not to be UP."""

    entitlements: Mapping[str, Entitlement] = field(default_factory=_empty)
    jobs: CowMap[Job] = field(default_factory=CowMap)
    machines_down: Mapping[str, str] = field(default_factory=_empty)  # machine id → status or UE kind
    shard_bucket: Bucket | None = None  # the shard's rate-limiter bucket (None: full)


def state_of(jobs: Iterable[Job] = (), entitlements: Iterable[Entitlement] = (),
             machines_down: Mapping[str, str] | None = None, shard_bucket: Bucket | None = None) -> SchedulerState:
    """A shard's state from its parts (e.g. read back from faust tables; ``shard_bucket`` from
    ``limiter.bucket_of`` of the partition's stored record)."""
    return SchedulerState(entitlements=MappingProxyType({e.name: e for e in entitlements}),
                          jobs=CowMap((j.id, j) for j in jobs),
                          machines_down=MappingProxyType(dict(machines_down or {})), shard_bucket=shard_bucket)


def incarnation_tag(submission: str) -> str:
    """A short name of an incarnation, from its submission (the JobSubmitted event id, ``Job.submission``): its
    requests and operations carry it, so that a late answer to another incarnation of the job id never names one of
    this incarnation's, though the counters start again at 1 once the job id left the state (``decide.collect``).
    8 hex digits of a hash: two incarnations of one job id share a tag with odds of 1 in 4.3 billion. "" for a job
    held from before tags (its counters went on from its predecessor's)."""
    return hashlib.blake2b(submission.encode(), digest_size=4).hexdigest() if submission else ""


def request_id(job_id: str, spec_version: int, n: int, tag: str = "") -> str:
    """The id of a job's ``n``-th allocation request (1-based) of the incarnation ``tag``, sent under
    ``spec_version``: ``<job>:<tag>:v<version>:r<n>`` (``<job>:v<version>:r<n>`` without a tag)."""
    return f"{job_id}:{tag}:v{spec_version}:r{n}" if tag else f"{job_id}:v{spec_version}:r{n}"


def operation_id(tid: str, kind: str, n: int, tag: str = "") -> str:
    """The id of the job's ``n``-th operation, of kind ``kind`` on task ``tid``, in the incarnation ``tag``:
    ``<task>:<kind>:<tag>.<n>`` (``<task>:<kind>:<n>`` without a tag; ``taskcontrol.protocol`` reads the task and the
    kind from its first two parts)."""
    return f"{tid}:{kind.lower()}:{tag}.{n}" if tag else f"{tid}:{kind.lower()}:{n}"


def first_sequence(now_ms: int) -> int:
    """The TaskControl sequence a new incarnation's requests count on from (``Job.tc_seq`` at its submission): a
    job's controllers keep its latest answered sequence by job id (``taskcontrol.protocol.JobBook``) and answer only
    a newer one, so a new incarnation must count above every earlier one's, though it no longer knows them. From
    the submission's decision time: 1,000 per millisecond, more than a job can send in its lifetime's
    milliseconds (one request per decision at most; a decision takes more than a microsecond)."""
    return now_ms * 1000


def task_id(job_id: str, index: int) -> str:
    return f"{job_id}/{index}"


def index_of(tid: str) -> int:
    """The index of task ``<job>/<index>``."""
    return int(tid.rsplit("/", 1)[1])


def published_state(job: Job) -> str:
    """The job state JobStatePublished (and so ``ropewalk job status``) and ``job_detail`` show."""
    if job.status != JOB_ACTIVE:
        return job.status
    if job.updating:
        return JOB_UPDATING
    live = [t for t in job.tasks.values() if t.intent != RETIRE]
    return JOB_RUNNING if len(live) == job.desired and all(t.state == RUNNING for t in live) else JOB_PENDING


def job_phase(job: Job) -> str:
    """Where ``job`` is in ``lifecycle.JOB_TRANSITIONS``: its status, or ``JOB_DELETED`` once stopped and freed."""
    return JOB_DELETED if job.deleted else job.status


def job_detail(state: SchedulerState, job_id: str) -> dict:
    """The shard's whole picture of one job: what JobStatePublished shows (``ropewalk job status --json`` prints
    that event, through ``processors/frontend/service.job_view``), and what only the shard's state holds: the
    operations, what the limiter holds back, the version mix, the maintenances, the latest ignored report. For
    tests and debugging: no command prints it. Raises UnknownJob."""
    job = state.jobs.get(job_id)
    if job is None:
        raise UnknownJob(job_id)
    return {
        "job": job.id, "name": job.spec.name, "entitlement": job.entitlement, "state": published_state(job),
        "incarnation": job.incarnation, "spec_version": job.spec_version, "desired_tasks": job.desired,
        "last_reason": job.last_reason,
        "last_ignored": job.last_ignored, "controller": job.spec.controller,
        "operations": [{"id": t.op_id, "task": t.id, "kind": t.op, "state": t.op_state, "reason": t.op_reason}
                       for t in job.tasks.values() if t.op is not None] if job.ops_open else [],
        "throttled": list(job.throttled),
        "mix": vs.mix_view(job.mix),
        "maintenance": [{"unavailability_id": u, "machines": list(ms), "start_ms": s, "deadline_ms": d,
                         "deadline_enforced": e} for u, ms, s, d, e in job.maint],
        "tasks": [{"id": t.id, "state": t.state, "machine": t.machine, "dc": t.dc, "msb": t.msb, "rack": t.rack,
                   "spec_version": t.spec_version, "reason": t.reason} for t in job.tasks.values()],
    }

