"""Scheduler shard decisions: the lifecycle of the jobs and tasks of one shard's entitlements. Pure.

No faust, Kafka or Redis; no clock, no randomness: every decision is ``(state, event, now_ms) -> (new_state,
events)`` over immutable state, and the same input on the same state gives the same output, event ids included.
``decide`` dispatches a decoded event by type (``HANDLERS``); ``retry_unplaced`` is the timer's decision;
``job_view`` is what ``ropewalk job status --json`` prints. See ``README.md`` for the flows as a diagram.

**Who emits what.** The scheduler emits the commands (START/STOP/RESTART, AllocationRequested,
ServiceDiscoveryUpdated) and the transitions no agent can report: PENDING (rescheduled), ALLOCATED, FAILED on a
machine failure (the agent is gone), STOPPED of a task that never ran or is already dead. Per job and decision, the
commands are ONE TasksCommanded (argv/env once, a line per task) and the transitions ONE TaskStatesChanged (each
report with the id a TaskStateChanged would have had), split only if a record would exceed 900,000 bytes
(``streams/batches.py``); a job of more than ``PUBLISH_PART_TASKS`` tasks publishes its tasks in JobTasksPublished
parts, only the changed ones. A command moves the task into its transitional state at once (START → STARTING,
STOP → STOPPING, RESTART → STARTING) without a report of its own: the agent reports STARTING, RUNNING and the
exits, and its STARTING is then a duplicate the lifecycle table absorbs. A task moved off a lost machine while
starting or running also gets a STOP addressed to that machine (a fence: an UNHEALTHY machine may still run it).
The scheduler reads agents' TaskStatesChanged batches (and single TaskStateChanged of older logs) and many machines'
status in one MachinesStatusChanged. The scheduler's own events come back on the topics it reads: the shard passes
over them by their record header; ``decide`` ignores every event whose producer is the scheduler (``is_own``).

**Job size.** A job may have at most ``max_tasks`` tasks (``ROPEWALK_MAX_TASKS_PER_JOB``, default 25,000): a
submission, resize or update beyond it is refused with ``REASON_TOO_MANY_TASKS`` in ``last_reason``.

**Restart policy.** A task that crashes (FAILED) or exits 0 (STOPPED on its own: a service's task is meant to
run) on a machine not known to be down is restarted in place (TaskCommanded RESTART) up to ``MAX_RESTARTS``
times, then left down with reason ``restart_limit``; a task that ran ``RESTART_RESET_MS`` gets its budget back.

**Placements are the allocator's.** The scheduler never emits TasksDeallocated: it asks. A move (machine
failure, or a rolling update that no longer fits the task's machine) is ONE AllocationRequested listing the
task in both ``free_task_ids`` and ``place_task_ids`` (with ``avoid_machine_ids`` for a failure): one request is
one atomic decision of the allocator, Twine's "per-task map of tasks to allocate or free" (§2.3), and the
allocator's commit refuses to place a task that is still placed, so it must free first within the request.
Retired tasks (shrink, stop) are freed with a request holding only ``free_task_ids``. Each decision sends one
request per job for all its tasks (all of a tick's failed machines at once), or a few when a huge job's task ids
would not fit one record (``_request_parts``: a task in one of them, free and place together). Request ids are
``<job>:v<spec_version>:r<n>`` with ``n`` a per-job counter in the state, so a replay names them alike. A newer
request for a task supersedes the older one: the task remembers only its outstanding request, and a result for
another request is stale.

**Idempotence** (at-least-once delivery). Two lines: (1) each job keeps a bounded ring (``SEEN_LIMIT``) of the
input event ids routed to it, and an event already in the ring changes nothing and emits nothing; (2) every
handler is idempotent by content as well, so a redelivery older than the ring is still a no-op in the usual
cases: a result for a request the task no longer awaits is stale, a lifecycle duplicate changes nothing
(``lifecycle.apply``), a machine failure finds no task left on the machine, a resize to the current size, a
stop of a stopping job and a spec version not newer than the job's are no-ops. What the ring alone guards: a
crash report redelivered after the task was restarted in place would otherwise count as a second crash. A result
for a request nobody awaits is not put in the ring (``_awaited``): after a crash it may be read before its request
is asked again, and then it comes again (the allocator answers a repeated request) and must apply.

**Agent reports are checked, never trusted.** A report naming another machine or another spec version than
the task's current incarnation is stale (an agent lagging behind a move or an update) and ignored; a
transition the lifecycle table refuses is ignored too. Neither raises: a shard must not crash on a bad report.
The latest ignored report is kept in the job's ``last_ignored`` (also in ``job_view``).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from infra.config import DEFAULT_MAX_TASKS_PER_JOB
from processors.cowmap import CowMap
from processors.evolve import evolver
from processors import rules
from processors.resourcebroker.decide import DOWN, KIND_FAILURE, MAINTENANCE, UNHEALTHY, UP
from processors.agent.hostprofile import REASON_HOST_PROFILE_FAILED
from processors.scheduler import lifecycle as lc
from processors.scheduler import versions as vs
from processors.taskcontrol import limiter
from processors.taskcontrol import protocol as tc
from processors.taskcontrol.limiter import DEFAULT_LIMITS, Bucket, Limits
from processors.taskcontrol.protocol import (
    CHOICE_KEEP, CHOICE_MOVE, CHOICE_STOP, CONTROLLED, OP_MOVE, OP_RESTART, OP_STOP, OP_UPDATE,
)
from processors.scheduler.lifecycle import (
    ALLOCATED, ALLOCATED_EV, CRASHED, EXITED_OK, FAILED, MACHINE_FAILED, PENDING, RESCHEDULED, RESTART_COMMANDED,
    RUNNING, START_COMMANDED, STARTED, STARTING, STOP_COMMANDED, STOPPED, STOPPED_EV, STOPPING, IllegalTransition,
)
from streams import batches
from streams.batches import SERVICE_DISCOVERY_UPDATED, ENVELOPE_BYTES, batch_id, size_of, split
from streams.enums import TaskCommand, UnavailabilityKind
from streams.events import Event, derived_event_id, new_event

PRODUCER = "scheduler"

MAX_RESTARTS = 3  # restarts in place of a task that crashed or exited on a healthy machine, then it stays down
RESTART_RESET_MS = 10 * 60_000  # a task that ran this long before it went down starts with a fresh restart budget
SEEN_LIMIT = 1024  # input event ids remembered per job (the duplicate ring)
PUBLISH_PART_TASKS = 500  # JobTasksPublished: tasks per part of a job published in parts (index // this)
REQUEST_TASKS_AT_ONCE = 2_000  # an AllocationRequested naming fewer tasks is never split (far below the bound)
THROTTLED_LISTED = 1_000  # OperationsThrottled lists at most this many waiting operations (waiting_count: all)
TC_PENDING_PER_REQUEST = 2_000  # a TaskControlRequested asks about at most this many pending operations
REASK_MS = 30_000  # the timer asks a job's TaskController again after this long without an answer or progress
HELD_AT_DEADLINE = "DEADLINE"  # Task.maint_choice of a task the scheduler stopped at a maintenance deadline
HELD = frozenset({CHOICE_STOP, HELD_AT_DEADLINE})  # stopped for a maintenance: started again when it ends
LEAVING = frozenset({CHOICE_MOVE, CHOICE_STOP})  # choices that stop the task before the maintenance

# Where a task's operation (UPDATE, MOVE, RESTART: see processors/taskcontrol) stands.
OP_PENDING = "pending"  # awaiting the TaskController's ack
OP_APPROVED = "approved"  # acked (or no controller): performed when ready, within max_unavailable and the limiter
OP_RUNNING = "running"  # performed; completed when the task runs again (reported to the controller then)

# -- reasons: TaskStateChanged/TaskCommanded/ServiceDiscoveryUpdated change .reason, task reason, job last_reason -------
# Why a task is (re)placed, stopped or restarted.
REASON_SUBMITTED = "submitted"  # the job was submitted: a new task
REASON_RESIZED = "resized"  # JobResized: a task added or retired
REASON_JOB_STOPPED = "job_stopped"  # JobStopped: every task is stopped and freed
REASON_ROLLING_UPDATE = "rolling_update"  # JobSpecChanged: replaced by the new spec version
REASON_ALLOCATED = "allocated"  # TaskStateChanged →ALLOCATED: the allocator placed it
REASON_PLACED = "placed"  # TaskCommanded START after a placement
REASON_TASK_RUNNING = "task_running"  # discovery enabled: the agent reports it RUNNING
REASON_CRASHED = "crashed"  # the agent reports it FAILED (non-zero exit, or could not start)
REASON_EXITED = "exited"  # the agent reports it STOPPED on its own (exit 0)
REASON_RESTART_POLICY = "restart_policy"  # TaskCommanded RESTART: crashed or exited, restarted in place
REASON_RESTART_LIMIT = "restart_limit"  # left FAILED/STOPPED: MAX_RESTARTS restarts used up
REASON_MACHINE_FAILED = "machine_failed"  # its machine went DOWN, or a FAILURE/POWER unavailability
REASON_MACHINE_UNHEALTHY = "machine_unhealthy"  # its machine went UNHEALTHY (missed heartbeats)
REASON_MACHINE_MAINTENANCE = "machine_maintenance"  # its machine went into MAINTENANCE, or moved off for it
# Planned maintenance (UnavailabilityStarted MAINTENANCE with a deadline; see "Maintenance" below).
REASON_MAINTENANCE_STOP = "maintenance_stop"  # its controller chose STOP: down until the maintenance ends
REASON_MAINTENANCE_DEADLINE = "maintenance_deadline"  # still on the machine at the deadline: stopped
REASON_MAINTENANCE_ENDED = "maintenance_ended"  # UnavailabilityEnded: a task stopped for it starts again
REASON_NOT_UNDER_NOTICE = "not_under_notice"  # a choice for a task no open notice of the job names (ignored)
REASON_CHOICE_TOO_LATE = "choice_too_late"  # a choice for a task the deadline stopped already (ignored)
# Why an intent was refused: an IntentRefused event (reason, message) and, for a job, its published last_reason.
REASON_DUPLICATE_JOB_ID = "duplicate_job_id"  # JobSubmitted for a job id that exists with another spec
REASON_UNKNOWN_ENTITLEMENT = "unknown_entitlement"  # JobSubmitted to an entitlement never created
REASON_UNKNOWN_JOB = "unknown_job"  # resize/update/stop of a job this shard never had, or stopped and gone
REASON_INVALID_SPEC = rules.INVALID_SPEC  # a spec or resize breaking a rule (processors/rules.py)
REASON_TOO_MANY_TASKS = rules.TOO_MANY_TASKS  # a job (submitted, resized, updated) beyond the maximum tasks per job
REASON_INVALID_ENTITLEMENT = rules.INVALID_ENTITLEMENT  # EntitlementCreated/Updated breaking a rule (e.g. quota < 0)
REASON_JOB_NOT_ACTIVE = "job_not_active"  # resize/update of a job that is stopping or rejected; a submission of a
#                                           job id whose previous incarnation is still stopping
REASON_STALE_SPEC_VERSION = "stale_spec_version"  # JobSpecChanged not newer than the job's spec version
REASON_ENTITLEMENT_MISMATCH = "entitlement_mismatch"  # an intent keyed to another entitlement than the job's
REASON_STALE_GENERATION = "stale_generation"  # JobSpecReconciled not newer than the one the job holds
REASON_STALE_SUBMISSION = "stale_submission"  # JobSpecReconciled for another incarnation (submission) of the job
REASON_MUST_VACATE = "must_vacate"  # a KEEP/STOP choice under a notice whose machines must be left (a loan revoked)
# Why an agent report was ignored (job last_ignored).
REASON_STALE_REPORT = "stale_report"  # about another machine or spec version than the task's (a lagging agent)
REASON_ILLEGAL_REPORT = "illegal_report"  # a transition the lifecycle table refuses from the task's state
REASON_NOT_AN_AGENT_STATE = "not_an_agent_state"  # PENDING/ALLOCATED/STOPPING/UNKNOWN: not an agent's to say
REASON_UNKNOWN_TASK = "unknown_task"  # no such task in the job (e.g. retired and freed already)
REASON_REBALANCE = "rebalance"  # a MOVE of a running task planned by the ReBalancer (op_reason, task reason)
# Why a move of a ReBalancer plan is refused (IntentRefused.reason of the RebalancePlanned, per job).
REASON_MOVE_JOB_NOT_RUNNING = "job_not_running"  # the job is stopping, rejected or updating
REASON_MOVE_NOT_ON_SOURCE = "not_on_source"  # the task is no longer on the plan's source machine
REASON_MOVE_TASK_NOT_RUNNING = "task_not_running"
REASON_MOVE_TASK_BUSY = "task_busy"  # another operation (update, move, restart, stop) is wanted on it
REASON_MOVE_UNDER_MAINTENANCE = "under_maintenance"  # its machine is under a planned maintenance of the job

# Task commands: the TaskCommand symbols of schemas/TaskCommanded.avsc.
START = TaskCommand.START
STOP = TaskCommand.STOP
RESTART = TaskCommand.RESTART

# What the scheduler does with a task next (its intent), whatever state it is in.
RUN = "run"  # keep it running at the job's spec version
RETIRE = "retire"  # stop it and free its placement (shrink, job stop); it leaves the job
UPDATE = "update"  # being stopped to start again at the job's spec version (rolling update, a grow reusing it)
RELOCATE = "relocate"  # being stopped to be placed on another machine (a ReBalancer move: _on_rebalance_planned)

# The job's own status, and the state JobStatePublished/job_view show (derived by ``published_state``).
JOB_ACTIVE = "active"
JOB_STOPPING = "stopping"  # every task is being stopped
JOB_STOPPED = "stopped"  # all stopped and their placements asked to be freed; deleted once the allocator says so
JOB_REJECTED = "rejected"  # the submission was refused (unknown entitlement, invalid spec); a new one may replace it
JOB_PENDING = "pending"  # published: active, some task not RUNNING
JOB_RUNNING = "running"  # published: active, every task RUNNING
JOB_UPDATING = "updating"  # published: active, a rolling update in progress

KIND_POWER = UnavailabilityKind.POWER  # UnavailabilityKind: power loss of a fault domain, unavailable now like a failure
UNAVAILABLE_KINDS = frozenset({KIND_FAILURE, KIND_POWER})  # planned MAINTENANCE notices wait for TaskControl
MACHINE_LOST_REASON = MappingProxyType({  # machine status → why its tasks move
    DOWN: REASON_MACHINE_FAILED,
    UNHEALTHY: REASON_MACHINE_UNHEALTHY,
    MAINTENANCE: REASON_MACHINE_MAINTENANCE,
})
ON_MACHINE = frozenset({ALLOCATED, STARTING, RUNNING, STOPPING, FAILED, STOPPED})  # states that hold a machine

# Agent-reported state → lifecycle trigger (STOPPED depends on whether a stop was asked: see ``_report_trigger``).
REPORT_TRIGGERS = MappingProxyType({
    STARTING: START_COMMANDED,  # the agent acknowledges the start: a duplicate of the scheduler's own step
    RUNNING: STARTED,
    STOPPED: EXITED_OK,
    FAILED: CRASHED,
})


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


@dataclass(frozen=True, slots=True)
class Task:
    """One task, ``<job_id>/<index>``."""

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
    _row: Mapping[str, Any] | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def row(self) -> Mapping[str, Any]:
        """Its JobStatePublished TaskStatus: built once per task version, when first published (most versions a
        decision makes are never published), so publishing a 15K-task job does not rebuild 15K rows per event."""
        if self._row is None:
            object.__setattr__(self, "_row", MappingProxyType({
                "task_id": self.id, "state": self.state, "machine_id": self.machine, "dc": self.dc,
                "msb": self.msb, "rack": self.rack, "spec_version": self.spec_version, "reason": self.reason}))
        return self._row


_task_with = evolver(Task)


def replace(obj: Any, /, **changes: Any) -> Any:
    """``dataclasses.replace``; a ``Task`` (the hot one: replaced several times per task and decision) through a
    compiled ``processors.evolve.evolver``, the same result in half the time."""
    if type(obj) is Task:
        return _task_with(obj, changes)
    return dataclasses.replace(obj, **changes)


@dataclass(frozen=True, slots=True)
class Entitlement:
    """An entitlement this shard serves (from EntitlementCreated); a job may only be submitted to a known one."""

    name: str
    quota_machines: int
    machine_type: str | None = None
    dc_pin: str | None = None
    host_profile: str | None = None


def _empty() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True)
class Job:
    """A job with its tasks: one record, so one faust table value (the ring and the tasks change together)."""

    id: str
    entitlement: str
    spec: Spec
    spec_version: int
    desired: int  # task count asked for
    status: str = JOB_ACTIVE
    tasks: Mapping[str, Task] = field(default_factory=_empty)  # by id, kept in index order
    last_reason: str = ""  # latest allocation rejection or refused intent
    last_ignored: str = ""  # latest agent report ignored, and why
    updating: bool = False  # a rolling update is in progress
    requests: int = 0  # allocation requests sent (names the next one)
    free_request_id: str | None = None  # the stop's final free request, until the allocator answers it
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
    maint: tuple = ()  # planned maintenance of its machines: (UE id, machine ids, start_ms, deadline_ms, enforced)
    incarnation: int = 1  # which submission of this job id (a stopped or rejected job's id may be submitted again)
    submission: str = ""  # the event id of the JobSubmitted that made this incarnation
    mix: vs.Mix | None = None  # several versions at once (push %, canary: versions.py); None: every task the job's
    generation: int = 0  # the latest JobSpecReconciled applied (processors/jobcontrol)
    vacating: tuple[str, ...] = ()  # planned unavailabilities (ids) whose machines its tasks must leave (loans)


@dataclass(frozen=True)
class SchedulerState:
    """One shard: its entitlements, its jobs (with their tasks), and the machines known not to be UP."""

    entitlements: Mapping[str, Entitlement] = field(default_factory=_empty)
    jobs: CowMap[Job] = field(default_factory=CowMap)
    machines_down: Mapping[str, str] = field(default_factory=_empty)  # machine id → status or UE kind
    shard_bucket: Bucket | None = None  # the shard's rate-limiter bucket (None: full)


def request_id(job_id: str, spec_version: int, n: int) -> str:
    """The id of a job's ``n``-th allocation request (1-based), sent under ``spec_version``."""
    return f"{job_id}:v{spec_version}:r{n}"


def task_id(job_id: str, index: int) -> str:
    return f"{job_id}/{index}"


def _index_of(tid: str) -> int:
    return int(tid.rsplit("/", 1)[1])


def published_state(job: Job) -> str:
    """The job state JobStatePublished and ``job_view`` show."""
    if job.status != JOB_ACTIVE:
        return job.status
    if job.updating:
        return JOB_UPDATING
    live = [t for t in job.tasks.values() if t.intent != RETIRE]
    return JOB_RUNNING if len(live) == job.desired and all(t.state == RUNNING for t in live) else JOB_PENDING


def _sorted_tasks(tasks: Mapping[str, Task]) -> list[Task]:
    return sorted(tasks.values(), key=lambda t: t.index)


def _by_index(tasks: Mapping[str, Task]) -> dict[str, Task]:
    return dict(sorted(tasks.items(), key=lambda kv: kv[1].index))


def job_view(state: SchedulerState, job_id: str) -> dict:
    """What ``ropewalk job status --json`` prints. Raises UnknownJob."""
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


# -- the working copy of one decision --------------------------------------------------------------------------

class _Fold:
    """The working copy of one call; the returned state is immutable. Emits with derived ids."""

    def __init__(self, state: SchedulerState, now_ms: int, cause: Event | None, id_root: str | None = None,
                 limits: Limits = DEFAULT_LIMITS, max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB):
        self.state = state
        self.now = now_ms
        self.limits = limits
        self.max_tasks = max_tasks
        self.shard_bucket = state.shard_bucket
        self.cause_id = cause.event_id if cause is not None else None  # recorded in each touched job's ring
        self.causation_id = self.cause_id
        self.id_root = id_root or self.cause_id or PRODUCER
        self.work: dict[str, _JobWork] = {}
        self.events: list[Event] = []
        self._used: dict[tuple, int] = {}
        self._down: dict[str, str] | None = None
        self._entitlements: dict[str, Entitlement] | None = None

    # machines and entitlements
    def is_down(self, machine_id: str | None) -> bool:
        down = self._down if self._down is not None else self.state.machines_down
        return machine_id is not None and machine_id in down

    def down_status(self, machine_id: str) -> str | None:
        down = self._down if self._down is not None else self.state.machines_down
        return down.get(machine_id)

    def set_down(self, machine_id: str, status: str | None) -> None:
        down = self._down if self._down is not None else self.state.machines_down
        if down.get(machine_id) == status:
            return
        if self._down is None:
            self._down = dict(self.state.machines_down)
        if status is None:
            self._down.pop(machine_id, None)
        else:
            self._down[machine_id] = status

    def entitlements(self) -> Mapping[str, Entitlement]:
        return self._entitlements if self._entitlements is not None else self.state.entitlements

    def set_entitlement(self, ent: Entitlement) -> None:
        if self.entitlements().get(ent.name) != ent:
            self._entitlements = {**self.entitlements(), ent.name: ent}

    # jobs
    def job(self, job_id: str) -> Job | None:
        w = self.work.get(job_id)
        return w.job if w is not None else self.state.jobs.get(job_id)

    def work_for(self, job_id: str) -> "_JobWork | None":
        """The job's working copy, or None if the job is unknown or this event was applied to it already."""
        w = self.work.get(job_id)
        if w is not None:
            return w
        job = self.state.jobs.get(job_id)
        if job is None or (self.cause_id is not None and self.cause_id in job.seen):
            return None
        w = self.work[job_id] = _JobWork(self, job)
        return w

    def new_job(self, job: Job) -> "_JobWork":
        w = self.work[job.id] = _JobWork(self, job, new=True)
        w.dirty = True
        return w

    # the rate limiter
    def admit(self, w: "_JobWork") -> str | None:
        """Take a token for one operation of ``w``'s job from its bucket and the shard's; None if taken, else
        why the operation must wait (both buckets are left refilled, nothing taken)."""
        job_b, shard_b, refused = limiter.admit(w.job.bucket, self.shard_bucket, self.limits, self.now)
        w.set(quiet=True, bucket=job_b)
        self.shard_bucket = shard_b
        return refused

    # events
    def derive(self, type_: str, *disc: Any) -> str:
        """The next derived id for ``(type_, *disc)`` in this decision (a repeat gets a counter)."""
        key = (type_, *disc)
        n = self._used.get(key, 0)
        self._used[key] = n + 1
        return derived_event_id(self.id_root, *key, *((n,) if n else ()))

    def emit(self, type_: str, entitlement: str, entity_id: str, payload: Mapping[str, Any], *disc: Any,
             event_id: str | None = None) -> None:
        """Emit an event; its id derives from the decision and ``(type_, *disc)`` unless ``event_id`` is given."""
        eid = event_id or self.derive(type_, *disc)
        self.events.append(new_event(type_, payload, entitlement=entitlement, entity_id=entity_id,
                                     producer=PRODUCER, causation_id=self.causation_id, timestamp_ms=self.now,
                                     event_id=eid))

    def result(self) -> tuple[SchedulerState, list[Event]]:
        jobs = {job_id: w.finish() for job_id, w in self.work.items()}
        changed = {k: v for k, v in jobs.items() if v is not self.state.jobs.get(k)}
        if (not changed and self._down is None and self._entitlements is None
                and self.shard_bucket == self.state.shard_bucket):
            return self.state, self.events
        return SchedulerState(
            entitlements=MappingProxyType(self._entitlements) if self._entitlements is not None
            else self.state.entitlements,
            jobs=self.state.jobs.updated(changed),
            machines_down=MappingProxyType(self._down) if self._down is not None else self.state.machines_down,
            shard_bucket=self.shard_bucket,
        ), self.events


def _visible(t: Task) -> tuple:
    """What JobStatePublished shows of a task (and what ``published_state`` reads)."""
    return t.state, t.intent, t.machine, t.dc, t.msb, t.rack, t.spec_version, t.reason


_JOB_VISIBLE = frozenset({"spec", "spec_version", "desired", "status", "last_reason", "updating", "deleted",
                          "incarnation"})


class _JobWork:
    """One job's working copy inside a decision: its task changes, the request being built, what to publish."""

    def __init__(self, fold: _Fold, job: Job, new: bool = False):
        self.fold = fold
        self.job = job
        self.before = None if new else job  # the job as the decision found it
        self._tasks: dict[str, Task] | None = None  # copied on the first write
        self.commands: list[dict[str, Any]] = []  # this decision's task commands (one TasksCommanded)
        self.reports: list[dict[str, Any]] = []  # this decision's own task transitions (one TaskStatesChanged)
        self.discoveries: list[dict[str, Any]] = []  # its service-discovery changes (one ServiceDiscoveryUpdated)
        self.dirty_parts: set[int] = set()  # parts (PUBLISH_PART_TASKS) with a task whose visible state changed
        self._added = False  # a task was added: the order by index must be restored
        self.place: dict[str, None] = {}  # ordered sets of task ids for this decision's AllocationRequested
        self.free: dict[str, None] = {}
        self.avoid: set[str] = set()
        self.dirty = False  # something JobStatePublished shows changed
        self.ops_delta = 0  # tasks that gained (+) or lost (-) an operation
        self.waiting: dict[str, Task] = {}  # task id → its operation the limiter held back in this decision
        self.refusal: str | None = None  # and why
        self.ask = False  # the timer: ask the TaskController again even if a request is outstanding
        self.remix = False  # the version mix or the job's size changed: tasks may have new target versions
        self._targets: tuple[tuple, dict[int, int]] | None = None  # ((desired, mix), versions.targets) memo

    @property
    def tasks(self) -> Mapping[str, Task]:
        return self._tasks if self._tasks is not None else self.job.tasks

    def version_for(self, index: int, desired: int | None = None, default: int | None = None) -> int:
        """The version task ``index`` is to run in a job of ``desired`` live tasks (default: the job's): the job's
        spec version, or its target in the job's version mix (``versions.py``); ``default`` (else the job's
        version) for a task beyond the live ones (retiring)."""
        mix = self.job.mix
        if mix is None:
            return self.job.spec_version
        desired = self.job.desired if desired is None else desired
        key = (desired, mix)
        if self._targets is None or self._targets[0] != key:
            self._targets = (key, vs.targets(mix, desired))
        return self._targets[1].get(index, self.job.spec_version if default is None else default)

    def wanted(self, t: Task) -> int:
        """The version ``t`` is to run (``version_for``; a retiring task keeps its own)."""
        return self.version_for(t.index, default=t.spec_version)

    def put(self, t: Task) -> Task:
        old = self.tasks.get(t.id)
        if self._tasks is None:
            self._tasks = dict(self.job.tasks)
        self._tasks[t.id] = t
        if old is None:
            self._added = True
        if (old is not None and old.op is not None) != (t.op is not None):
            self.ops_delta += 1 if t.op is not None else -1
        if old is None or _visible(old) != _visible(t):
            self.dirty = True
            self.dirty_parts.add(t.index // PUBLISH_PART_TASKS)
        return t

    def ordered(self) -> list[Task]:
        """The tasks in index order."""
        return _sorted_tasks(self.tasks) if self._added else list(self.tasks.values())

    def drop(self, tid: str) -> None:
        if self._tasks is None:
            self._tasks = dict(self.job.tasks)
        old = self._tasks.pop(tid, None)
        if old is not None and old.op is not None:
            self.ops_delta -= 1
        self.dirty = True
        self.dirty_parts.add(_index_of(tid) // PUBLISH_PART_TASKS)

    def set(self, *, quiet: bool = False, **fields: Any) -> None:
        """Change job fields; ``quiet``: a change JobStatePublished does not announce (a refused intent)."""
        changed = [k for k, v in fields.items() if getattr(self.job, k) != v]
        if changed:
            self.job = replace(self.job, **fields)
            self.dirty = self.dirty or (not quiet and any(k in _JOB_VISIBLE for k in changed))

    def ignore(self, reason: str, detail: str) -> None:
        self.set(quiet=True, last_ignored=f"{reason}: {detail}")

    # emitting
    def emit(self, type_: str, entity_id: str, payload: Mapping[str, Any], *disc: Any,
             event_id: str | None = None) -> None:
        self.fold.emit(type_, self.job.entitlement, entity_id, payload, *disc, event_id=event_id)

    def step(self, t: Task, trigger: str, *, emit_reason: str | None = None, **changes: Any) -> Task:
        """Move ``t`` by ``trigger`` through the lifecycle table (raises IllegalTransition: a scheduler bug);
        with ``emit_reason``, announce it in the decision's TaskStatesChanged (its report id derived as a
        TaskStateChanged's would be)."""
        new = self.put(replace(t, state=lc.next_state(t.state, trigger), **changes))
        if emit_reason is not None:
            self.reports.append({
                "report_id": self.fold.derive("TaskStateChanged", "state", t.id, new.state),
                "task_id": t.id, "job_id": self.job.id, "machine_id": new.machine, "state": new.state,
                "previous_state": t.state, "exit_code": None, "spec_version": new.spec_version,
                "reason": emit_reason, "cause_id": None})
        return new

    def discovery(self, t: Task, enabled: bool, reason: str) -> Task:
        """Enable or disable ``t`` in service discovery (in the decision's ServiceDiscoveryUpdated)."""
        self.discoveries.append({"task_id": t.id, "machine_id": t.machine, "enabled": enabled, "reason": reason})
        return self.put(replace(t, discovery=enabled))

    def command(self, t: Task, command: str, reason: str) -> None:
        """Command ``t``'s agent (in the decision's TasksCommanded; START/RESTART run the job's spec)."""
        self.commands.append({"task_id": t.id, "machine_id": t.machine, "command": command,
                              "spec_version": t.spec_version, "reason": reason})

    def emit_batches(self) -> None:
        """The decision's service-discovery changes as ServiceDiscoveryUpdated, its task transitions as
        TaskStatesChanged and its commands as TasksCommanded, each split so that no record exceeds
        ``batches.MAX_RECORD_BYTES`` (normally one of each). Discovery first: a task leaves it before it stops."""
        job = self.job
        if self.discoveries:
            for i, part in enumerate(split(self.discoveries, fixed=ENVELOPE_BYTES + size_of(job.id))):
                self.emit(SERVICE_DISCOVERY_UPDATED, job.id, {"job_id": job.id, "changes": part}, "discovery", job.id, i)
            self.discoveries = []
        if self.reports:
            for part in split(self.reports):
                self.emit("TaskStatesChanged", part[0]["task_id"], {"reports": part},
                          event_id=batch_id("TaskStatesChanged", (r["report_id"] for r in part)))
            self.reports = []
        if self.commands:
            ent = self.fold.entitlements().get(job.entitlement)
            profile = None if ent is None else ent.host_profile or ""  # agents start tasks only where it is applied
            for version, commands in _by_version(self.commands, job.mix):
                code = job.mix.code(version) if version is not None else None
                argv, env = (list(code.command), dict(code.env)) if code else (list(job.spec.command), dict(job.spec.env))
                parts = split(commands, fixed=ENVELOPE_BYTES + size_of(job.id) + size_of(argv) + size_of(env) + 30)
                disc = () if version is None else (version,)  # a job with a version mix: a batch per version run
                for i, part in enumerate(parts):
                    self.emit("TasksCommanded", job.id, {"job_id": job.id, "argv": argv, "env": env, "commands": part,
                                                         "part": i, "parts": len(parts), "host_profile": profile},
                              "commands", job.id, *disc, i)
            self.commands = []

    def request(self, place: Iterable[str], free: Iterable[str], avoid: Iterable[str] = (),
                targets: Mapping[str, str] | None = None) -> str:
        """An AllocationRequested; it avoids ``avoid`` and every machine of the job's planned maintenances that the
        job's entitlement holds (a task moved off a machine of an MSB under maintenance must not land on its
        neighbour). The allocator filters every maintenance's machines itself, the free pool's too; this list
        holds for the moment the allocator has not read the notice yet."""
        job, spec = self.job, self.job.spec
        if place:
            avoid = set(avoid).union(*(machines for _, machines, *_ in job.maint))
        n = job.requests + 1
        rid = request_id(job.id, job.spec_version, n)
        self.set(quiet=True, requests=n)
        self.emit("AllocationRequested", rid, {
            "request_id": rid, "job_id": job.id, "spec_version": job.spec_version,
            "place_task_ids": sorted(place, key=_index_of), "free_task_ids": sorted(free, key=_index_of),
            "resources": {"cpu_millicores": spec.cpu, "memory_mib": spec.mem},
            "requirements": dict(spec.requirements), "spread": spec.spread, "avoid_machine_ids": sorted(avoid),
            "target_machine_ids": dict(targets or {})}, "request", rid)
        return rid

    def retry_parked(self) -> None:
        for t in self.ordered():
            if t.parked and t.state == PENDING and t.intent == RUN:
                self.put(replace(t, parked=False))
                self.place[t.id] = None

    # operations (processors/taskcontrol)
    def new_op(self, t: Task, kind: str, reason: str, **changes: Any) -> Task:
        """Want operation ``kind`` on ``t`` (ending any other it has): pending if the job's controller must
        approve it, else approved at once."""
        if t.op is not None:
            t = self.end_op(t)
        n = self.job.ops + 1
        self.set(quiet=True, ops=n)
        state = OP_PENDING if kind in CONTROLLED and self.job.spec.controller else OP_APPROVED
        return self.put(replace(t, op=kind, op_id=f"{t.id}:{kind.lower()}:{n}", op_state=state, op_reason=reason,
                                **changes))

    def end_op(self, t: Task) -> Task:
        """``t``'s operation is over (done or moot): one the controller approved is reported completed."""
        if t.op is None:
            return t
        if self.job.spec.controller and t.op in CONTROLLED and t.op_state in (OP_APPROVED, OP_RUNNING):
            self.set(quiet=True, tc_completed=(*self.job.tc_completed, t.op_id))
        return self.put(replace(t, op=None, op_id=None, op_state=None, op_reason="", fence=False, move_to=None))

    # closing the decision
    def finish(self) -> Job:
        if self.ops_delta:
            self.set(quiet=True, ops_open=self.job.ops_open + self.ops_delta)
            self.ops_delta = 0
        if self.job.status == JOB_ACTIVE:
            _progress_update(self)
            _drain_ops(self)
            _ask_controller(self)
            self._flush_request()
        elif self.job.status == JOB_STOPPING:
            _drain_ops(self)  # its stops wait for the limiter like any other
            self._finish_stop()
        if self.ops_delta:
            self.set(quiet=True, ops_open=self.job.ops_open + self.ops_delta)
        job = self.job
        if self._tasks is not None:  # the working dict becomes the state's: nothing writes to it after this
            job = replace(job, tasks=MappingProxyType(_by_index(self._tasks) if self._added else self._tasks))
        if self.fold.cause_id is not None:
            job = replace(job, seen=(*job.seen, self.fold.cause_id)[-SEEN_LIMIT:])
        self.job = job
        self.emit_batches()
        if self.dirty:
            self._publish(job)
        return job

    def _publish(self, job: Job) -> None:
        """JobStatePublished; for a job published in parts (``task_parts``), also a JobTasksPublished per part
        whose tasks changed (every part when it was published whole before; parts gone as deleted ones)."""
        after = task_parts(job)
        before = task_parts(self.before) if self.before is not None else 0
        self.emit("JobStatePublished", job.id, _snapshot(job, after), "job", job.id)
        if not after and not before:
            return
        wanted = set(range(after)) if not before else {p for p in self.dirty_parts if p < after}
        by_part: dict[int, list] = {p: [] for p in wanted}
        if wanted:
            for t in job.tasks.values():
                rows = by_part.get(t.index // PUBLISH_PART_TASKS)
                if rows is not None:
                    rows.append(t.row)
        for p in sorted(wanted):
            self.emit("JobTasksPublished", f"{job.id}#{p}", {"job_id": job.id, "part": p, "parts": after,
                                                             "tasks": by_part[p], "deleted": False},
                      "tasks", job.id, p)
        for p in range(after, before):
            self.emit("JobTasksPublished", f"{job.id}#{p}", {"job_id": job.id, "part": p, "parts": after,
                                                             "tasks": [], "deleted": True}, "tasks", job.id, p)

    def _flush_request(self) -> None:
        place = [tid for tid in self.place if (t := self.tasks.get(tid)) is not None and t.state == PENDING
                 and t.intent == RUN]
        if not place and not self.free:
            return
        terms = self.job.spec.terms
        for part_place, part_free in self._request_parts(place, self.free):
            targets = {tid: t.move_to for tid in part_place if (t := self.tasks[tid]).move_to is not None}
            rid = self.request(part_place, part_free, self.avoid, targets)
            for tid in part_place:  # a target is asked for once: a retry after a rejection places it anywhere
                self.put(replace(self.tasks[tid], request_id=rid, request_terms=terms, parked=False, move_to=None))

    def _request_parts(self, place: Iterable[str], free: Iterable[str]) -> list[tuple[list[str], list[str]]]:
        """``place`` and ``free`` cut into the parts of as many AllocationRequested as keep each record under
        ``batches.MAX_RECORD_BYTES`` (one, unless the task ids of a very big job would not fit); a task in both
        (a move) stays in one part, so the allocator frees it before it places it."""
        place_set, free_set = set(place), set(free)
        if len(place_set) + len(free_set) <= REQUEST_TASKS_AT_ONCE:
            return [(list(place), list(free))]
        tasks = sorted(place_set | free_set, key=_index_of)
        avoid = size_of(sorted(self.avoid.union(*(m for _, m, *_ in self.job.maint))))
        parts = split(tasks, fixed=ENVELOPE_BYTES + avoid + size_of(self.job.id) * 3 + 200,
                      size=lambda t: size_of(t) * ((t in place_set) + (t in free_set)), max_items=len(tasks))
        return [([t for t in part if t in place_set], [t for t in part if t in free_set]) for part in parts]

    def _finish_stop(self) -> None:
        """A stopping job whose tasks are all STOPPED: ask to free them all; stopped (deleted when answered: the
        allocator answers an entitlement's requests in order, so the answer to the last part is the last)."""
        if any(t.state != STOPPED for t in self.tasks.values()):
            return
        if not self.tasks:
            self.set(status=JOB_STOPPED, deleted=True)
            return
        rid = None
        for _, part_free in self._request_parts((), self.tasks):
            rid = self.request((), part_free)
        self.set(status=JOB_STOPPED, free_request_id=rid)


def _by_version(commands: list[dict[str, Any]], mix: vs.Mix | None) -> list[tuple[int | None, list[dict]]]:
    """A decision's commands for one job, in TasksCommanded batches: one (None) without a version mix, else one per
    version the lines run (argv/env are the version's), in the order the versions first appear."""
    if mix is None:
        return [(None, commands)]
    by: dict[int, list[dict]] = {}
    for c in commands:
        by.setdefault(c["spec_version"], []).append(c)
    return list(by.items())


def task_parts(job: Job) -> int:
    """0: ``job``'s tasks are published inside its JobStatePublished; n: in n JobTasksPublished parts (a task of
    index i in part i // PUBLISH_PART_TASKS), because the job has a task of index PUBLISH_PART_TASKS or more."""
    if not job.tasks:
        return 0
    last = next(reversed(job.tasks.values())).index  # tasks are kept in index order
    return 0 if last < PUBLISH_PART_TASKS else last // PUBLISH_PART_TASKS + 1


def _snapshot(job: Job, parts: int = 0) -> dict:
    """The JobStatePublished payload (without the tasks when they are published in ``parts``)."""
    return {
        "job_id": job.id, "name": job.spec.name, "state": published_state(job), "spec_version": job.spec_version,
        "desired_tasks": job.desired,
        "tasks": [] if parts else [t.row for t in job.tasks.values()],
        "last_reason": job.last_reason, "deleted": job.deleted, "task_parts": parts, "task_count": len(job.tasks),
        "incarnation": job.incarnation,
    }


# -- task steps: what each intent does next ----------------------------------------------------------------------

def _advance(w: _JobWork, t: Task) -> None:
    """Take the next step for ``t`` given its state and intent (after something happened to it)."""
    if t.intent == RETIRE:
        _advance_retiring(w, t)
        return
    if t.op == OP_STOP and t.state not in (STARTING, RUNNING):  # went down before its stop's token came
        t = w.end_op(t)
    if t.maint_choice is not None and t.state in (FAILED, STOPPED) and t.op_state != OP_RUNNING:
        if t.maint_choice in HELD:  # stopped for a maintenance: waits for its end (UnavailabilityEnded)
            if t.intent != RUN:
                w.put(replace(t, intent=RUN))
            return
        if t.maint_choice == CHOICE_MOVE:  # stopped to move off before the maintenance: placed elsewhere
            _move(w, replace(t, intent=RUN), REASON_MACHINE_MAINTENANCE, avoid=t.machine)
            return
    if t.intent == RELOCATE:  # a ReBalancer move: once down, freed and placed on its target (never back on its source)
        if t.state in (STOPPED, FAILED):
            _move(w, replace(t, intent=RUN), REASON_REBALANCE, avoid=t.machine)
        return
    if t.intent == UPDATE:
        if t.state == STOPPING:
            return
        t = w.put(replace(t, intent=RUN))
        if t.state == STOPPED:  # stopped for the update: start the job's spec version
            _start_again(w, t, START, t.reason or REASON_ROLLING_UPDATE)
            return
    if t.state == PENDING:
        if t.request_id is None and not t.parked:
            w.place[t.id] = None
    elif t.state == ALLOCATED:
        if w.fold.is_down(t.machine):  # placed on a machine that failed meanwhile (the allocator raced the news)
            _machine_lost(w, t, REASON_MACHINE_FAILED)
        else:
            t = w.step(t, START_COMMANDED, spec_version=w.wanted(t))
            w.command(t, START, REASON_PLACED)
    elif t.state in (FAILED, STOPPED):  # went down on its own: the restart policy
        if t.op_state == OP_RUNNING:  # down again during an approved update or move: it carries on
            if w.fold.is_down(t.machine):
                _move(w, t, REASON_MACHINE_FAILED, avoid=t.machine)
            elif t.restarts < MAX_RESTARTS:
                _start_again(w, replace(t, restarts=t.restarts + 1), RESTART, REASON_RESTART_POLICY)
            else:
                w.end_op(w.put(replace(t, reason=REASON_RESTART_LIMIT)))
        elif w.fold.is_down(t.machine) or t.reason == REASON_HOST_PROFILE_FAILED:  # the machine cannot run it
            _try_perform(w, w.new_op(t, OP_MOVE, t.reason if t.reason == REASON_HOST_PROFILE_FAILED
                                     else REASON_MACHINE_FAILED))
        elif t.restarts < MAX_RESTARTS:
            _try_perform(w, w.new_op(t, OP_RESTART, REASON_RESTART_POLICY))
        else:
            w.put(replace(t, reason=REASON_RESTART_LIMIT))


def _advance_retiring(w: _JobWork, t: Task) -> None:
    """A retired task (shrink, job stop): one that runs is stopped through the limiter (an OP_STOP: it goes on
    running, and serving, until its token comes); one that does not is stopped at once; once stopped it is freed
    (with the job's other tasks, for a stopping job)."""
    waits = t.op == OP_STOP and t.state in (STARTING, RUNNING)
    if t.op is not None and not waits:  # whatever was wanted of it is moot now
        t = w.end_op(t)
    if t.state in (STARTING, RUNNING):
        _try_perform(w, t if waits else w.new_op(t, OP_STOP, t.reason or REASON_RESIZED))
        return
    if t.state in (PENDING, ALLOCATED, FAILED):  # nothing runs: stopped at once
        held = t.machine is not None or t.request_id is not None
        w.place.pop(t.id, None)
        t = w.step(t, STOP_COMMANDED, emit_reason=t.reason, request_id=None, request_terms=None, parked=False)
        if not held and w.job.status == JOB_ACTIVE:
            w.drop(t.id)  # never placed nor asked for: nothing to free
            return
    if t.state == STOPPED and w.job.status == JOB_ACTIVE:  # a stopping job frees all at once (``_finish_stop``)
        w.free[t.id] = None
        w.drop(t.id)


def _stop(w: _JobWork, t: Task, reason: str) -> Task:
    """STOP a STARTING/RUNNING task: out of service discovery first, then the command (→ STOPPING)."""
    if t.discovery:
        t = w.discovery(t, False, reason)
    t = w.step(t, STOP_COMMANDED, running_since_ms=None)
    w.command(t, STOP, reason)
    return t


def _start_again(w: _JobWork, t: Task, command: str, reason: str) -> None:
    """Start a FAILED/STOPPED task at the job's spec version on the machine it holds if it is up and its
    placement fits the spec (TaskCommanded ``command``); else move it."""
    if t.machine is None or w.fold.is_down(t.machine) or t.terms is None or not t.terms.fits(w.job.spec.terms):
        _move(w, t, reason, avoid=t.machine if w.fold.is_down(t.machine) else None)
        return
    t = w.step(t, RESTART_COMMANDED, spec_version=w.wanted(t))
    w.command(t, command, reason)


def _move(w: _JobWork, t: Task, reason: str, avoid: str | None = None) -> None:
    """FAILED/STOPPED → PENDING, and ask the allocator to free its placement and place it again."""
    t = w.step(t, RESCHEDULED, emit_reason=reason, machine=None, dc=None, msb=None, rack=None, terms=None,
               spec_version=w.wanted(t), running_since_ms=None, reason=reason, maint_ue=None,
               maint_choice=None)
    w.free[t.id] = None
    w.place[t.id] = None
    if avoid is not None:
        w.avoid.add(avoid)


def _machine_lost(w: _JobWork, t: Task, reason: str) -> None:
    """Twine's redeploy: out of service discovery, FAILED (or STOPPED if it was stopping), then moved away from
    the machine, or freed if it was retiring. A task that was starting or running is also sent a STOP on the
    machine it leaves: an UNHEALTHY machine (or one in maintenance) may still run it, and must not go on
    running it once the task starts elsewhere."""
    machine = t.machine
    if w.job.spec.controller:  # the controller's picture is outdated: supersede an outstanding request
        w.ask = True
    if t.discovery:
        t = w.discovery(t, False, reason)
    fence = False
    if t.state in (ALLOCATED, STARTING, RUNNING, STOPPING):
        was = t.state
        t = w.step(t, MACHINE_FAILED, emit_reason=reason, running_since_ms=None)
        fence = was in (STARTING, RUNNING)
    if t.intent == RETIRE:
        if fence:
            w.command(t, STOP, reason)  # the fence: addressed to the old machine, whatever it runs now
        _advance_retiring(w, t)
    elif t.op_state == OP_RUNNING:  # taken down by an approved update or move already: moved on at once
        if fence:
            w.command(t, STOP, reason)
        _move(w, replace(t, intent=RUN, restarts=0), reason, avoid=machine)
    else:  # a move to approve (TaskControl) and to pace (the limiter); the fence goes with it
        _try_perform(w, w.new_op(replace(t, intent=RUN, restarts=0, reason=reason), OP_MOVE, reason, fence=fence))


def _progress_update(w: _JobWork) -> None:
    """Rolling update: want an UPDATE operation on every task of an older spec version (approved by the job's
    TaskController if it has one); ``_drain_ops`` performs them, never making more than ``max_unavailable``
    tasks not RUNNING (counting any task not RUNNING for any reason). With a version mix (``versions.py``), every
    live task whose version is not its target is outdated (an unplaced one just takes its target)."""
    if not (w.job.updating or w.remix):
        return
    if w.job.mix is None:
        version = w.job.spec_version
        outdated = [t for t in w.ordered() if t.intent != RETIRE and t.spec_version < version]
    else:
        outdated = []
        for t in w.ordered():
            if t.intent == RETIRE or t.spec_version == (v := w.wanted(t)):
                continue
            if t.state in (PENDING, ALLOCATED) and t.op is None:  # nothing runs yet: it starts its target
                w.put(replace(t, spec_version=v))
            else:
                outdated.append(t)
    if not outdated and not any(t.op == OP_UPDATE for t in w.tasks.values()):
        w.set(updating=False)
        return
    w.set(updating=True)
    for t in outdated:
        if t.op is not None or t.intent != RUN:
            continue
        if t.maint_choice in HELD:  # stopped for a maintenance: starts the new version when it ends
            continue
        if t.state in (FAILED, STOPPED):  # already down (restart limit): replacing it costs no availability
            _start_again(w, replace(t, restarts=0, reason=REASON_ROLLING_UPDATE), START, REASON_ROLLING_UPDATE)
        else:
            w.new_op(t, OP_UPDATE, REASON_ROLLING_UPDATE)


# -- operations: approved (TaskControl), then paced (max_unavailable, the rate limiter) ---------------------------

def _op_moot(w: _JobWork, t: Task) -> bool:
    """Whether ``t``'s not yet performed operation no longer applies."""
    if t.move_to is not None:  # a ReBalancer move of a running task
        return (t.state != RUNNING or t.intent != RUN or w.fold.is_down(t.machine) or w.job.updating
                or t.maint_choice is not None)
    if t.op == OP_STOP:  # of a running task still retiring or leaving for a maintenance
        return t.state not in (STARTING, RUNNING) or (t.intent != RETIRE and t.maint_choice not in LEAVING)
    if t.intent == RETIRE:
        return True
    if t.op == OP_UPDATE:
        current = t.spec_version >= w.job.spec_version if w.job.mix is None else t.spec_version == w.wanted(t)
        return current or t.intent != RUN or t.state in (FAILED, STOPPED, PENDING)
    return t.state not in (FAILED, STOPPED)  # MOVE, RESTART: of a task that went down


def _try_perform(w: _JobWork, t: Task, budget: list[int] | None = None) -> Task:
    """Perform ``t``'s approved operation if it is ready and the limiter allows it; an UPDATE also needs a
    unit of ``budget`` (the job's max_unavailable left; computed here if not given)."""
    if t.op_state != OP_APPROVED:
        return t
    if t.op == OP_STOP and t.state not in (STARTING, RUNNING):
        return t
    if t.op == OP_UPDATE or t.move_to is not None:  # both take a running task down: max_unavailable paces them
        if t.state != RUNNING:  # not up yet (starting): taken down once it runs
            return t
        if budget is None:
            budget = [_unavailable_budget(w)]
        if budget[0] <= 0:
            return t
    # within one decision time stands still and buckets only drain: once refused, the job's next operations are
    # refused for the same reason (10,000 waiting stops cost one bucket check per decision, not 10,000)
    refused = w.refusal or w.fold.admit(w)
    if refused is not None:
        w.waiting[t.id] = t
        w.refusal = w.refusal or refused
        return t
    if t.op == OP_STOP:  # over once commanded: a retiring task is freed, a leaving one held or moved, once stopped
        reason = t.op_reason
        return _stop(w, replace(w.end_op(t), reason=reason), reason)
    t = w.put(replace(t, op_state=OP_RUNNING))
    if t.move_to is not None:  # a ReBalancer move: out of discovery and STOP; placed on its target once stopped
        budget[0] -= 1
        return _stop(w, replace(t, intent=RELOCATE, reason=REASON_REBALANCE), REASON_REBALANCE)
    if t.op == OP_UPDATE:
        budget[0] -= 1
        return _stop(w, replace(t, intent=UPDATE, reason=REASON_ROLLING_UPDATE), REASON_ROLLING_UPDATE)
    if t.op == OP_MOVE:
        if t.fence:
            w.command(t, STOP, t.op_reason)  # the fence: addressed to the old machine, whatever it runs now
        _move(w, replace(t, fence=False), t.op_reason, avoid=t.machine)
        return w.tasks[t.id]
    t = w.end_op(t)  # RESTART: over once commanded (a machine lost meanwhile makes it a move)
    _start_again(w, replace(t, restarts=t.restarts + 1), RESTART, REASON_RESTART_POLICY)
    return w.tasks[t.id]


def _unavailable_budget(w: _JobWork) -> int:
    return w.job.spec.max_unavailable - sum(t.state != RUNNING for t in w.tasks.values() if t.intent != RETIRE)


def _drain_ops(w: _JobWork) -> None:
    """Perform every approved operation that is ready, in task order, as the limiter allows; drop moot ones;
    announce what the limiter holds back (OperationsThrottled) when that changed."""
    if w.job.ops_open + w.ops_delta <= 0 and not w.job.throttled:
        return
    budget = [_unavailable_budget(w)]
    for t in w.ordered():
        if t.op is None or t.op_state == OP_RUNNING:
            continue
        if _op_moot(w, t):
            w.end_op(t)
        elif t.op_state == OP_PENDING and not w.job.spec.controller:  # the controller was removed
            _try_perform(w, w.put(replace(t, op_state=OP_APPROVED)), budget)
        else:
            _try_perform(w, t, budget)
    held = sorted(w.waiting.values(), key=lambda t: t.index)
    waiting = tuple(t.op_id for t in held)
    if waiting == w.job.throttled:
        return
    w.set(quiet=True, throttled=waiting)
    if waiting:
        lim = w.fold.limits
        rate, b = ((lim.job, w.job.bucket) if w.refusal == limiter.REASON_RATE_LIMITED_JOB
                   else (lim.shard, w.fold.shard_bucket))
        scope = "job" if rate is lim.job else "shard"
        w.emit("OperationsThrottled", w.job.id, {
            "job_id": w.job.id, "reason": w.refusal,
            "waiting": [{"operation_id": t.op_id, "task_id": t.id, "kind": t.op, "reason": t.op_reason}
                        for t in held[:THROTTLED_LISTED]], "waiting_count": len(held),
            "retry_at_ms": limiter.next_ms(b, rate, w.fold.now), "limit": f"{scope}: {rate.describe()}"},
            "throttled", w.job.id)


def _ask_controller(w: _JobWork) -> None:
    """Send the job's TaskController a request (Figure 8) when it has something new to say: approved
    operations completed, operations it was not asked about, an advance notice, a task running again while a
    notice still has tasks awaiting a choice (the controller may make its next one: e.g. move the next task
    once the one it moved runs elsewhere); or when the timer says so. One request at a time: the next waits for
    the ack of the latest (or for the timer)."""
    job = w.job
    if not job.spec.controller:
        return
    if job.tc_outstanding and not w.ask:
        return
    pending = [t for t in w.ordered() if t.op_state == OP_PENDING] if job.ops_open + w.ops_delta > 0 else []
    pending = pending[:TC_PENDING_PER_REQUEST]  # bounded: the rest are asked about as these are answered
    asked = set(job.tc_asked)
    news = bool(job.tc_completed) or any(t.op_id not in asked for t in pending)
    if not news and not job.tc_notice_new and not (w.ask and (pending or job.tc_outstanding)):
        return
    notices = _notices(w)
    if job.tc_notice_new and not any(n.task_ids for n in notices):
        w.set(quiet=True, tc_notice_new=False)  # every task under notice has its choice: nothing to ask
    if not (news or w.job.tc_notice_new) and not (w.ask and (pending or job.tc_outstanding)):
        return
    completed = (*job.tc_sent_completed, *job.tc_completed) if job.tc_outstanding else job.tc_completed
    seq = job.tc_seq + 1
    req = tc.Request(
        job_id=job.id, entitlement=job.entitlement, controller=job.spec.controller, sequence=seq,
        pending=tuple(tc.Operation(t.op_id, t.id, t.op, t.op_reason) for t in pending),
        completed=completed,
        notices=notices,
        unhealthy=tuple(t.id for t in w.ordered() if (t.state != RUNNING or t.op == OP_STOP) and t.intent != RETIRE),
        in_flight=tuple(t.op_id for t in w.ordered() if t.op in CONTROLLED and t.op_state in (OP_APPROVED, OP_RUNNING)))
    w.emit("TaskControlRequested", job.id, tc.request_payload(req), "taskcontrol", job.id, seq)
    w.set(quiet=True, tc_seq=seq, tc_outstanding=True, tc_asked=tuple(t.op_id for t in pending),
          tc_asked_ms=w.fold.now, tc_completed=(), tc_sent_completed=completed, tc_notice_new=False,
          tc_sent_unhealthy=req.unhealthy)


def _notices(w: _JobWork) -> tuple[tc.AdvanceNotice, ...]:
    """The job's open advance notices as its controller is told them: each names the tasks still on the
    maintenance's machines that await a choice (none made yet for it, not retiring), so that a task moved off,
    being stopped or kept is not asked about again."""
    machines = {m[0]: frozenset(m[1]) for m in w.job.maint}
    out = []
    for ue, task_ids, start, deadline, duration in w.job.tc_notices:
        gone = machines.get(ue)
        if gone is not None:
            task_ids = tuple(t.id for t in w.ordered() if t.machine in gone and t.intent != RETIRE
                             and (t.maint_choice is None or t.maint_ue != ue))
        out.append(tc.AdvanceNotice(ue, tuple(task_ids), start, deadline, duration))
    return tuple(out)


def _resize(w: _JobWork, n: int, reason: str) -> None:
    """Grow: new PENDING tasks (a retiring task of that index is kept and started again); shrink: retire the
    highest indices. With a version mix, the canaries are picked for the new size and the new tasks start their
    target versions (``versions.py``: the push percentage holds through sizing)."""
    job = w.job
    if job.mix is not None:
        w.set(quiet=True, mix=vs.pick_canaries(job.mix, n))
        w.remix = True
    for i in range(job.desired, n):
        tid = task_id(job.id, i)
        t = w.tasks.get(tid)
        if t is None:
            w.put(Task(id=tid, index=i, spec_version=w.version_for(i, n), reason=reason))
            w.place[tid] = None
        elif t.intent == RETIRE and t.op == OP_STOP:  # its stop still waits for a token: it simply stays
            w.put(replace(w.end_op(t), intent=RUN, reason="" if t.state == RUNNING else reason))
        elif t.intent == RETIRE:
            _advance(w, w.put(replace(t, intent=UPDATE, reason=reason)))
    for t in sorted(w.tasks.values(), key=lambda t: -t.index):
        if t.index >= n and t.intent != RETIRE:
            _advance_retiring(w, w.put(replace(t, intent=RETIRE, reason=reason)))
    w.set(desired=n)


# -- handlers: one per consumed event type -----------------------------------------------------------------------

def _refuse(fold: _Fold, ev: Event, reason: str, message: str, w: "_JobWork | None" = None) -> None:
    """Refuse intent ``ev``, applying none of it: an IntentRefused (``reason``, ``message``) keyed to its entitlement;
    the job it is about (``w``, if it has one) shows it in its published last_reason."""
    job_id = ev.payload.get("job_id")
    fold.emit("IntentRefused", ev.entitlement, job_id or ev.entity_id, {
        "intent_type": ev.type, "intent_event_id": ev.event_id, "job_id": job_id, "reason": reason,
        "message": message}, "refused", ev.event_id)
    if w is not None:
        w.set(last_reason=f"{reason}: {message}")


def _problems(fold: _Fold, ev: Event) -> tuple[str, str] | None:
    """(reason, message) if ``ev`` breaks a rule of ``processors/rules.py`` (the front end's too), else None."""
    found = rules.intent_problems(ev.type, ev.payload, ev.entitlement, fold.max_tasks)
    return rules.refusal(found) if found else None


def _on_entitlement_created(fold: _Fold, ev: Event) -> None:
    p = ev.payload
    if (refused := _problems(fold, ev)) is not None:
        _refuse(fold, ev, *refused)
        return
    fold.set_entitlement(Entitlement(name=p["name"], quota_machines=p["quota_machines"],
                                     machine_type=p.get("machine_type"), dc_pin=p.get("dc_pin"),
                                     host_profile=p.get("host_profile")))


def _on_entitlement_updated(fold: _Fold, ev: Event) -> None:
    """The fields an EntitlementUpdated sets change (an entitlement exists once a quota is set, as the allocator
    has it); one breaking a rule is refused."""
    if (refused := _problems(fold, ev)) is not None:
        _refuse(fold, ev, *refused)
        return
    p = ev.payload
    known = fold.entitlements().get(ev.entitlement)
    given = {k: p.get(k) for k in ("quota_machines", "machine_type", "dc_pin", "host_profile") if p.get(k) is not None}
    if known is not None:
        fold.set_entitlement(replace(known, **given))
    elif "quota_machines" in given:
        fold.set_entitlement(Entitlement(name=ev.entitlement, **given))


def _successor(existing: Job | None) -> dict[str, Any]:
    """What a new incarnation of a job id takes over from the previous one (a stopped and freed job, or a rejected
    submission): its number + 1, and the counters that name its requests, operations and TaskControl requests, so
    that none repeats the previous incarnation's (a late result or ack for one of those stays stale), and the
    duplicate ring. Task ids stay ``<job>/<index>``: the previous incarnation's were freed before it was gone."""
    if existing is None:
        return {}
    return {"incarnation": existing.incarnation + 1, "requests": existing.requests, "ops": existing.ops,
            "tc_seq": existing.tc_seq, "seen": existing.seen, "generation": existing.generation}


def _on_job_submitted(fold: _Fold, ev: Event) -> None:
    """A new job, or a new incarnation of a job id whose previous one was rejected, or stopped and freed (deleted).
    The same submission again is a no-op; another spec under a live job id is refused (duplicate_job_id), as is a
    submission while the previous incarnation is still stopping (job_not_active: submit again once it is gone)."""
    p = ev.payload
    job_id, spec = p["job_id"], Spec.from_payload(p)
    origin = (ev.entitlement, p["spec_version"], p["tasks"], spec)
    existing = fold.state.jobs.get(job_id)
    if existing is not None and ev.event_id in existing.seen:
        return
    if existing is not None and existing.status != JOB_REJECTED and not existing.deleted:
        w = fold.work_for(job_id)
        if w is None or (existing.status == JOB_ACTIVE and existing.origin == origin):
            return  # applied already, or the same submission again (under another event id): a no-op
        if existing.status == JOB_ACTIVE:
            _refuse(fold, ev, REASON_DUPLICATE_JOB_ID, f"job {job_id} exists with another spec (submitted to "
                                                       f"{existing.entitlement} at spec version "
                                                       f"{existing.origin[1]})", w)
        else:
            _refuse(fold, ev, REASON_JOB_NOT_ACTIVE, f"job {job_id} is {existing.status}: submit it again once it "
                                                     "is stopped", w)
        return
    refused = _problems(fold, ev)
    if ev.entitlement not in fold.entitlements():
        refused = (REASON_UNKNOWN_ENTITLEMENT, f"entitlement {ev.entitlement!r} was never created")
    w = fold.new_job(Job(id=job_id, entitlement=ev.entitlement, spec=spec, spec_version=p["spec_version"],
                         desired=0, origin=origin, submission=ev.event_id, **_successor(existing)))
    if refused is not None:
        w.set(status=JOB_REJECTED)
        _refuse(fold, ev, *refused, w)
        return
    _resize(w, p["tasks"], REASON_SUBMITTED)


def _intent_work(fold: _Fold, ev: Event) -> _JobWork | None:
    """The job an intent is about, if it can take one; else the intent is refused (an IntentRefused, and the
    job's last_reason if it has one). A stop of a job stopping, stopped or rejected is a no-op: it is what was
    asked."""
    job_id = ev.payload["job_id"]
    job = fold.job(job_id)
    if job is None or job.deleted:
        if job is None or ev.event_id not in job.seen:
            gone = "" if job is None else " (stopped and gone)"
            _refuse(fold, ev, REASON_UNKNOWN_JOB, f"no job {job_id} in entitlement {ev.entitlement}{gone}")
        return None
    w = fold.work_for(job_id)
    if w is None:
        return None  # applied already
    if ev.entitlement != w.job.entitlement:
        _refuse(fold, ev, REASON_ENTITLEMENT_MISMATCH, f"{ev.type} {ev.event_id} is keyed to {ev.entitlement}, the "
                                                       f"job belongs to {w.job.entitlement}", w)
        return None
    if w.job.status != JOB_ACTIVE:
        if ev.type != "JobStopped":
            _refuse(fold, ev, REASON_JOB_NOT_ACTIVE, f"{ev.type} {ev.event_id} refused, the job is {w.job.status}", w)
        return None
    return w


def _on_job_resized(fold: _Fold, ev: Event) -> None:
    w = _intent_work(fold, ev)
    if w is None:
        return
    if (refused := _problems(fold, ev)) is not None:
        _refuse(fold, ev, *refused, w)
        return
    _resize(w, ev.payload["tasks"], REASON_RESIZED)
    w.retry_parked()


def _on_job_spec_changed(fold: _Fold, ev: Event) -> None:
    w = _intent_work(fold, ev)
    if w is None:
        return
    p = ev.payload
    if p["spec_version"] == w.job.spec_version and Spec.from_payload(p) == w.job.spec:
        return  # the change applied already (redelivered under another event id)
    if _refused_stale_version(fold, ev, w, same_is_stale=True):
        return
    w.set(mix=None)  # a spec by hand: every task to it, whatever mix the Job Control Plane reconciled before
    _take_spec(w, Spec.from_payload(p), p["spec_version"])
    _resize(w, p["tasks"], REASON_RESIZED)
    w.retry_parked()


def _refused_stale_version(fold: _Fold, ev: Event, w: _JobWork, *, same_is_stale: bool) -> bool:
    """Refuse a spec whose version is older than the job's (or the same, ``same_is_stale``), or that breaks a rule
    of the intent rules; True if refused."""
    new, have = ev.payload["spec_version"], w.job.spec_version
    if new < have or (same_is_stale and new == have):
        _refuse(fold, ev, REASON_STALE_SPEC_VERSION, f"spec version {new} is "
                f"{'not newer than' if same_is_stale else 'older than'} {have}", w)
        return True
    if (refused := _problems(fold, ev)) is not None:
        _refuse(fold, ev, *refused, w)
        return True
    return False


def _take_spec(w: _JobWork, spec: Spec, version: int) -> None:
    """The job's spec becomes ``spec`` at ``version`` (a rolling update): unplaced tasks will start their version;
    re-asked if the terms changed."""
    w.set(spec=spec, spec_version=version, updating=True)
    for t in w.ordered():
        if t.state == PENDING and t.intent != RETIRE:
            if t.request_id is not None and t.request_terms != spec.terms:
                t = replace(t, request_id=None, request_terms=None)
                w.free[t.id] = None  # the old request may place it before this one is read: free first
                w.place[t.id] = None
            w.put(replace(t, spec_version=w.wanted(t)))


def _on_job_spec_reconciled(fold: _Fold, ev: Event) -> None:
    """The Job Control Plane's reconciled spec (processors/jobcontrol): the job's shared spec, its size and its
    version mix (push %, canary) at once; tasks move to their target versions as in a rolling update
    (``versions.py``). One older than the job's (generation, spec version) or for another incarnation is refused."""
    w = _intent_work(fold, ev)
    if w is None:
        return
    p = ev.payload
    job = w.job
    if p["generation"] <= job.generation:
        _refuse(fold, ev, REASON_STALE_GENERATION, f"generation {p['generation']} is not newer than "
                                                   f"{job.generation}", w)
        return
    if p.get("submission_id") and job.submission and p["submission_id"] != job.submission:
        _refuse(fold, ev, REASON_STALE_SUBMISSION, f"reconciled for submission {p['submission_id']}; this "
                                                   f"incarnation ({job.incarnation}) is {job.submission}", w)
        return
    if _refused_stale_version(fold, ev, w, same_is_stale=False):  # a size or mix change keeps the versions
        return
    mix = vs.mix_of(p, job.mix)
    code = mix.code(mix.push if mix.push is not None else mix.stable)  # the job's spec shows the newest code
    spec = Spec.from_payload({**p, "command": code.command, "env": dict(code.env)})
    w.set(mix=mix, generation=p["generation"])
    w.remix = True
    _take_spec(w, spec, p["spec_version"])
    _resize(w, p["tasks"], REASON_RESIZED)
    w.retry_parked()


def _on_job_stopped(fold: _Fold, ev: Event) -> None:
    w = _intent_work(fold, ev)
    if w is None:
        return
    why = ev.payload.get("reason", "")
    w.set(status=JOB_STOPPING, updating=False, last_reason=f"{REASON_JOB_STOPPED}: {why}" if why else "")
    for t in sorted(w.tasks.values(), key=lambda t: -t.index):
        _advance_retiring(w, w.put(replace(t, intent=RETIRE, reason=REASON_JOB_STOPPED)))


def _awaited(fold: _Fold, ev: Event, task_ids: Iterable[str]) -> "_JobWork | None":
    """The job's working copy if the result's request is awaited (by one of ``task_ids``, or as the stopped job's
    final free request), else None. A result nobody awaits changes nothing and is not remembered as applied (not in
    the duplicate ring): a scheduler that crashed after asking may read the answer before it asks again — the same
    request, the same ids — and the allocator answers a request asked again after its answer with the same events,
    which must then apply. (The kill storm found a stopped job waiting for good for an answer it had read too
    early.)"""
    job_id, rid = ev.payload["job_id"], ev.payload["request_id"]
    if job_id not in fold.work:
        job = fold.job(job_id)
        if job is None or (job.free_request_id != rid and not any(
                (t := job.tasks.get(tid)) is not None and t.request_id == rid for tid in task_ids)):
            return None
    return fold.work_for(job_id)


def _on_tasks_allocated(fold: _Fold, ev: Event) -> None:
    w = _awaited(fold, ev, (pl["task_id"] for pl in ev.payload["placements"]))
    if w is None:
        return
    rid = ev.payload["request_id"]
    placed = False
    for pl in ev.payload["placements"]:
        t = w.tasks.get(pl["task_id"])
        if t is None or t.request_id != rid or t.state != PENDING:
            continue  # stale (superseded, retired) or applied already
        t = w.step(t, ALLOCATED_EV, emit_reason=REASON_ALLOCATED, machine=pl["machine_id"], dc=pl["dc"],
                   msb=pl["msb"], rack=pl["rack"], terms=t.request_terms, request_id=None, request_terms=None,
                   parked=False)
        _advance(w, t)
        placed = True
    if placed and not any(t.parked for t in w.tasks.values()):
        w.set(last_reason="")


def _on_allocation_rejected(fold: _Fold, ev: Event) -> None:
    w = _awaited(fold, ev, ev.payload["unplaced_task_ids"])
    if w is None:
        return
    p = ev.payload
    rejected = False
    for tid in p["unplaced_task_ids"]:
        t = w.tasks.get(tid)
        if t is None or t.request_id != p["request_id"] or t.state != PENDING:
            continue
        w.put(replace(t, request_id=None, request_terms=None, parked=True, reason=p["reason"]))
        rejected = True
    if rejected:
        w.set(last_reason=f"{p['reason']}: {p['message']}" if p.get("message") else p["reason"])


def _on_tasks_deallocated(fold: _Fold, ev: Event) -> None:
    """Only the answer to a stopped job's final free request matters: the job's tasks are gone."""
    w = _awaited(fold, ev, ())
    if w is None or w.job.status != JOB_STOPPED or w.job.free_request_id != ev.payload.get("request_id"):
        return
    for tid in list(w.tasks):
        w.drop(tid)
    w.set(deleted=True, free_request_id=None)


def _report_trigger(t: Task, reported: str) -> str | None:
    if reported == STOPPED and t.state == STOPPING:
        return STOPPED_EV
    return REPORT_TRIGGERS.get(reported)


def _on_task_state_changed(fold: _Fold, ev: Event) -> None:
    """An agent's report (one transition): as one of a TaskStatesChanged."""
    _on_task_states_changed(fold, ev)


def _on_task_states_changed(fold: _Fold, ev: Event) -> None:
    """Agents' reports (STARTING, RUNNING, STOPPED, FAILED with exit_code), in order; each job of the batch
    takes it once (the batch's id joins each job's duplicate ring)."""
    for r in batches.task_reports(ev):
        w = fold.work_for(r["job_id"])
        if w is not None:
            _apply_report(w, r, r["report_id"])


def _apply_report(w: _JobWork, p: Mapping[str, Any], rid: str) -> None:
    """One agent report ``p`` (a TaskStateChanged's fields; ``rid`` its id, named in what is ignored)."""
    fold = w.fold
    reported = p["state"]
    t = w.tasks.get(p["task_id"])
    if t is None:
        w.ignore(REASON_UNKNOWN_TASK, f"{rid} reports {reported} for {p['task_id']}")
        return
    machine = p.get("machine_id")
    if (machine is not None and machine != t.machine) or p.get("spec_version", 1) != t.spec_version:
        w.ignore(REASON_STALE_REPORT, f"{rid} reports {t.id} {reported} on {machine} at spec version "
                                      f"{p.get('spec_version', 1)}; the task is {t.state} on {t.machine} at "
                                      f"{t.spec_version}")
        return
    trigger = _report_trigger(t, reported)
    if trigger is None:
        w.ignore(REASON_NOT_AN_AGENT_STATE, f"{rid} reports {t.id} {reported}")
        return
    try:
        state, changed = lc.apply(t.state, trigger)
    except IllegalTransition:
        w.ignore(REASON_ILLEGAL_REPORT, f"{rid} reports {t.id} {reported} while it is {t.state}")
        return
    if not changed:
        return
    now = fold.now
    if state == RUNNING:
        t = w.put(replace(t, state=state, running_since_ms=now, reason=""))
        if t.op_state == OP_RUNNING:  # the update or move it was under is complete
            t = w.end_op(t)
        if w.job.tc_notices:  # e.g. a task moved off for a maintenance runs again: its controller's next choice
            w.set(quiet=True, tc_notice_new=True)
        w.discovery(t, True, REASON_TASK_RUNNING)
        return
    if state == STARTING:  # an agent ahead of the scheduler's own step (not seen: the START comes with it)
        w.put(replace(t, state=state))
        return
    if t.state == STOPPING:  # a stop was asked: however it ended, the task keeps the stop's reason
        reason = t.reason
    elif p.get("reason") == REASON_HOST_PROFILE_FAILED:  # the agent would not start it there: it moves
        reason = REASON_HOST_PROFILE_FAILED
    else:
        reason = REASON_CRASHED if trigger == CRASHED else REASON_EXITED
    ran_long = t.running_since_ms is not None and now - t.running_since_ms >= RESTART_RESET_MS
    if t.discovery:
        t = w.discovery(t, False, reason)
    t = w.put(replace(t, state=state, running_since_ms=None, restarts=0 if ran_long else t.restarts,
                      reason=reason))
    _advance(w, t)


def _evacuate(fold: _Fold, ev: Event, machine_ids: Iterable[str], reason: str) -> None:
    """Move every task of this shard off ``machine_ids``. Machine and unavailability events are keyed to the
    machine's owner, so only that entitlement's jobs are looked at (all jobs for a free-pool key). When the
    machines enter MAINTENANCE, tasks their controller keeps running through it, or that were stopped for it
    (they start again where they are when it ends), stay."""
    spare = reason == REASON_MACHINE_MAINTENANCE
    gone = set(machine_ids)
    for job_id in sorted(fold.state.jobs):
        job = fold.job(job_id)
        if job.status not in (JOB_ACTIVE, JOB_STOPPING) or not in_owner_scope(fold.entitlements(), ev, job):
            continue
        hit = [t.id for t in job.tasks.values() if t.machine in gone and t.state in ON_MACHINE
               and not (spare and (t.maint_choice == CHOICE_KEEP or t.maint_choice in HELD))]
        if not hit:
            continue
        w = fold.work_for(job_id)
        if w is None:  # applied already
            continue
        for tid in hit:
            _machine_lost(w, w.tasks[tid], reason)


def _on_machine_status_changed(fold: _Fold, ev: Event) -> None:
    """One machine's status (MachineStatusChanged), or many machines' (MachinesStatusChanged, one status): UP
    clears them; DOWN, UNHEALTHY, MAINTENANCE move their tasks, all in this one decision (one
    AllocationRequested per job for all of its tasks on them)."""
    lost: dict[str, list[str]] = {}
    for m in batches.machine_statuses(ev):
        mid, status = m["machine_id"], m["status"]
        if status == UP:
            fold.set_down(mid, None)
        elif status in MACHINE_LOST_REASON:
            fold.set_down(mid, status)
            lost.setdefault(status, []).append(mid)
    for status, mids in lost.items():
        _evacuate(fold, ev, mids, MACHINE_LOST_REASON[status])


def _on_unavailability_started(fold: _Fold, ev: Event) -> None:
    if ev.payload["kind"] not in UNAVAILABLE_KINDS:
        _record_maintenance(fold, ev)  # its deadline is enforced by the timer (``retry_unplaced``)
        _advance_notice(fold, ev)  # controllers hear of it now and choose (TaskControlAcked maintenance_choices)
        return
    for mid in ev.payload["machine_ids"]:
        fold.set_down(mid, ev.payload["kind"])
    _evacuate(fold, ev, ev.payload["machine_ids"], REASON_MACHINE_FAILED)


def _jobs_in_scope(fold: _Fold, ev: Event) -> list[str]:
    """Active jobs an event keyed to a machine owner concerns: that entitlement's (every job for a free-pool key)."""
    return [j for j in sorted(fold.state.jobs) if (job := fold.job(j)).status == JOB_ACTIVE
            and in_owner_scope(fold.entitlements(), ev, job)]


def _record_maintenance(fold: _Fold, ev: Event) -> None:
    """Every active job with tasks on the machines remembers the maintenance: its machines and deadline; and, when
    the machines must be left (``vacate``: a loan revoked, processors/resourcebroker/loans.py), that its tasks leave
    them whatever their controller would choose."""
    p = ev.payload
    gone = frozenset(p["machine_ids"])
    deadline = p.get("deadline_ms")
    deadline = p["start_ms"] if deadline is None else deadline
    for job_id in _jobs_in_scope(fold, ev):
        job = fold.job(job_id)
        if any(m[0] == p["unavailability_id"] for m in job.maint) or not any(
                t.machine in gone for t in job.tasks.values()):
            continue
        w = fold.work_for(job_id)
        if w is not None:
            w.set(quiet=True, maint=(*w.job.maint, (p["unavailability_id"], tuple(sorted(gone)), p["start_ms"],
                                                     deadline, False)))
            if p.get("vacate"):
                w.set(quiet=True, vacating=(*w.job.vacating, p["unavailability_id"]))


def _on_unavailability_ended(fold: _Fold, ev: Event) -> None:
    """A maintenance is over: its machines still in MAINTENANCE are UP (the Resource Broker says so on
    ``machines`` too, but the two topics are not ordered), tasks stopped for it start again where they are (a task
    whose machine is down meanwhile, e.g. failed, moves), kept ones are ordinary again, the job forgets the
    notice."""
    ue = ev.payload["unavailability_id"]
    for mid in ev.payload["machine_ids"]:  # over: a machine still in MAINTENANCE here is UP (its status change,
        if fold.is_down(mid) and fold.down_status(mid) == MAINTENANCE:  # on another topic, may come after this)
            fold.set_down(mid, None)
    for job_id in _jobs_in_scope(fold, ev):
        job = fold.job(job_id)
        if not any(m[0] == ue for m in job.maint) and not any(t.maint_ue == ue for t in job.tasks.values()):
            continue
        w = fold.work_for(job_id)
        if w is None:
            continue
        w.set(quiet=True, maint=tuple(m for m in w.job.maint if m[0] != ue),
              tc_notices=tuple(n for n in w.job.tc_notices if n[0] != ue),
              vacating=tuple(u for u in w.job.vacating if u != ue))
        for t in w.ordered():
            if t.maint_ue != ue:
                continue
            held = t.maint_choice in HELD and t.state in (FAILED, STOPPED)
            t = w.put(replace(t, maint_ue=None, maint_choice=None))
            if held:
                _start_again(w, replace(t, restarts=0), START, REASON_MAINTENANCE_ENDED)


def _enforce_deadlines(w: _JobWork) -> None:
    """The timer at or after a maintenance deadline: every task still starting or running on the machines is
    taken out of service discovery and stopped (reason ``maintenance_deadline``), unless its controller chose
    to keep it running. With a controller it stays down until the maintenance ends and then starts again where
    it is; without one (the built-in policy) it moves elsewhere once stopped. Each deadline is enforced once.

    These stops take no token from the limiter (the one exception to it): the maintenance proceeds at its
    deadline whatever the buckets hold, so a throttled deadline would mean nothing. For the same reason a task
    whose stop still waits for a token (its controller chose MOVE or STOP, or it is retiring) is stopped now;
    it keeps its choice (held, or moved once stopped) or its retirement."""
    now = w.fold.now
    due = [m for m in w.job.maint if not m[4] and m[3] <= now]
    if not due:
        return
    w.set(quiet=True, maint=tuple((*m[:4], True) if m in due else m for m in w.job.maint))
    for ue, machines, _start, _deadline, _ in due:
        # moved off when it has no controller or must leave (a loan revoked); else held until the end
        held = HELD_AT_DEADLINE if w.job.spec.controller and ue not in w.job.vacating else CHOICE_MOVE
        gone = set(machines)
        for t in w.ordered():
            if t.machine not in gone or t.maint_choice == CHOICE_KEEP or t.state not in (STARTING, RUNNING):
                continue  # elsewhere, kept running through it, down already or stopping
            if t.intent == RETIRE or t.maint_choice is not None:
                if t.op == OP_STOP:  # leaving anyway, its stop waits for a token: the deadline does not wait
                    _stop(w, w.end_op(t), REASON_MAINTENANCE_DEADLINE)
                continue
            if t.op is not None and t.op_state != OP_RUNNING:
                t = w.end_op(t)  # moot: the deadline stops it
            if t.op_state == OP_RUNNING:  # under an update: it restarts on the machine only after the window
                t = w.end_op(t)
            _stop(w, replace(t, intent=RUN, maint_ue=ue, maint_choice=held, reason=REASON_MAINTENANCE_DEADLINE),
                  REASON_MAINTENANCE_DEADLINE)


def _apply_choices(w: _JobWork, ev: Event, choices: Iterable[tc.Choice]) -> None:
    """A controller's answers to advance notices: MOVE (stop, then placed elsewhere), STOP (stopped until the
    maintenance ends), KEEP (left running through it). Choices for tasks no open notice names are ignored."""
    open_ = {m[0]: (set(m[1]), m[4]) for m in w.job.maint}
    for c in choices:
        t = w.tasks.get(c.task_id)
        machines, enforced = open_.get(c.unavailability_id, (set(), False))
        if t is None or t.machine not in machines or t.intent == RETIRE:
            w.ignore(REASON_NOT_UNDER_NOTICE, f"{ev.event_id} chooses {c.choice} for {c.task_id} under "
                                              f"{c.unavailability_id}")
            continue
        if c.choice != CHOICE_MOVE and c.unavailability_id in w.job.vacating:
            w.ignore(REASON_MUST_VACATE, f"{ev.event_id} chooses {c.choice} for {c.task_id}: the machines of "
                                         f"{c.unavailability_id} must be left (MOVE, or moved at the deadline)")
            continue
        if t.maint_choice == HELD_AT_DEADLINE or (enforced and c.choice == CHOICE_KEEP and t.state != RUNNING):
            w.ignore(REASON_CHOICE_TOO_LATE, f"{ev.event_id} chooses {c.choice} for {c.task_id}: the deadline "
                                             f"of {c.unavailability_id} stopped it already")
            continue
        if t.maint_choice == c.choice and t.maint_ue == c.unavailability_id:
            continue  # chosen already
        if t.op is not None and t.op_state != OP_RUNNING:
            t = w.end_op(t)  # an update or move not performed yet is moot: the choice decides
        t = w.put(replace(t, maint_ue=c.unavailability_id, maint_choice=c.choice))
        if c.choice == CHOICE_KEEP:
            continue
        why = REASON_MAINTENANCE_STOP if c.choice == CHOICE_STOP else REASON_MACHINE_MAINTENANCE
        if t.state in (STARTING, RUNNING) and t.op_state != OP_RUNNING:  # through the limiter, like any stop
            _try_perform(w, w.new_op(replace(t, reason=why), OP_STOP, why))
        elif t.state in (FAILED, STOPPED) and t.op_state != OP_RUNNING:
            _advance(w, t)


def _advance_notice(fold: _Fold, ev: Event) -> None:
    """Planned maintenance: every job of the machines' entitlement with a TaskController and tasks on them is
    told in its next request (sent at once): which tasks, from when, until which deadline."""
    p = ev.payload
    gone = set(p["machine_ids"])
    for job_id in sorted(fold.state.jobs):
        job = fold.job(job_id)
        if job.status != JOB_ACTIVE or not job.spec.controller or not in_owner_scope(fold.entitlements(), ev, job):
            continue
        hit = tuple(t.id for t in job.tasks.values() if t.machine in gone)
        if not hit or any(n[0] == p["unavailability_id"] for n in job.tc_notices):
            continue
        w = fold.work_for(job_id)
        if w is None:
            continue
        notice = (p["unavailability_id"], hit, p["start_ms"], p.get("deadline_ms"), p.get("expected_duration_ms"))
        w.set(quiet=True, tc_notices=(*w.job.tc_notices, notice), tc_notice_new=True)


def _on_task_control_acked(fold: _Fold, ev: Event) -> None:
    """The job's TaskController approved some of the pending operations of its latest request."""
    p = ev.payload
    w = fold.work_for(p["job_id"])
    if w is None:
        return
    job = w.job
    if not job.spec.controller:
        w.ignore(tc.REASON_NO_CONTROLLER, f"{ev.event_id} acks request {p['sequence']}")
        return
    if p.get("controller") and p["controller"] != job.spec.controller:
        w.ignore(tc.REASON_WRONG_CONTROLLER, f"{ev.event_id} is from {p['controller']}, the job's controller "
                                              f"is {job.spec.controller}")
        return
    refusal = tc.ack_refusal(job.tc_seq, job.tc_outstanding, p["sequence"])
    if refusal is not None:
        w.ignore(refusal, f"{ev.event_id} acks request {p['sequence']}; the latest is {job.tc_seq}"
                          f"{'' if job.tc_outstanding else ', answered already'}")
        return
    down_when_asked = set(job.tc_sent_unhealthy)
    w.set(quiet=True, tc_outstanding=False, tc_sent_completed=(), tc_sent_unhealthy=())
    _apply_choices(w, ev, tc.choices_of(p))
    approved = set(p["approved_operation_ids"])
    if not approved:
        return
    stale = []
    for t in w.ordered():
        if t.op_state == OP_PENDING and t.op_id in approved:
            if t.id in down_when_asked and t.state == RUNNING:
                stale.append(t.op_id)  # "it is down, taking it costs nothing" no longer holds: ask again
                continue
            w.put(replace(t, op_state=OP_APPROVED))  # performed by ``_drain_ops`` as the decision closes
    if stale:
        w.ignore(tc.REASON_RECOVERED_SINCE_ASKED, f"{ev.event_id} approved {', '.join(stale)} while the request "
                                                   "said the task was down; it runs again")
        w.ask = True


def _on_rebalance_planned(fold: _Fold, ev: Event) -> None:
    """RebalancePlanned (the ReBalancer's plan, processors/rebalancer): each move of a job of this shard becomes a
    MOVE operation of its running task (reason ``REASON_REBALANCE``, ``move_to`` its target), approved by the job's
    TaskController like any operation, performed within max_unavailable and the limiter (``_try_perform``: out of
    discovery and STOP), then placed on the target avoiding the source (``_advance``, intent RELOCATE; the allocator
    places it elsewhere if the target no longer passes every filter), complete once it runs there. Refused moves
    are answered by one IntentRefused per job (the reason of its first refused move, every refused task and why in
    the message). A move not performed yet is moot once the task no longer runs on its machine (the ordinary paths
    move it), or the job stops or starts an update (``_op_moot``)."""
    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for mv in ev.payload["moves"]:
        by_job[mv["job_id"]].append(mv)
    for job_id in sorted(by_job):
        job = fold.job(job_id)
        if job is None:
            continue  # not this shard's job (or gone): nothing to do here
        if job.entitlement != ev.entitlement:
            _refused_moves(fold, ev, job_id, [(mv["task_id"], REASON_ENTITLEMENT_MISMATCH) for mv in by_job[job_id]])
            continue
        w = fold.work_for(job_id)
        if w is None:
            continue  # applied already
        refused = []
        for mv in by_job[job_id]:
            t = w.tasks.get(mv["task_id"])
            why = _move_refusal(w, t, mv)
            if why is not None:
                refused.append((mv["task_id"], why))
                continue
            _try_perform(w, w.new_op(t, OP_MOVE, REASON_REBALANCE, move_to=mv["to_machine_id"]))
        if refused:
            _refused_moves(fold, ev, job_id, refused)


def _move_refusal(w: _JobWork, t: Task | None, move: Mapping[str, Any]) -> str | None:
    """Why a planned ``move`` cannot become an operation now (None: it can)."""
    if t is None:
        return REASON_UNKNOWN_TASK
    job = w.job
    if job.status != JOB_ACTIVE or job.updating:
        return REASON_MOVE_JOB_NOT_RUNNING
    if t.machine != move["from_machine_id"]:
        return REASON_MOVE_NOT_ON_SOURCE
    if t.state != RUNNING or t.intent != RUN or w.fold.is_down(t.machine):
        return REASON_MOVE_TASK_NOT_RUNNING
    if t.op is not None:
        return REASON_MOVE_TASK_BUSY
    if t.maint_choice is not None or any(t.machine in machines for _, machines, *_ in job.maint):
        return REASON_MOVE_UNDER_MAINTENANCE
    return None


def _refused_moves(fold: _Fold, ev: Event, job_id: str, refused: list[tuple[str, str]]) -> None:
    listed = ", ".join(f"{task} {why}" for task, why in refused[:50])
    more = f" (+{len(refused) - 50} more)" if len(refused) > 50 else ""
    fold.emit("IntentRefused", ev.entitlement, job_id, {
        "intent_type": ev.type, "intent_event_id": ev.event_id, "job_id": job_id, "reason": refused[0][1],
        "message": f"plan {ev.payload['plan_id']}: {len(refused)} moves of job {job_id} not made: {listed}{more}"},
        "refused", ev.event_id, job_id)


Handler = Callable[[_Fold, Event], None]

HANDLERS: Mapping[str, Handler] = MappingProxyType({
    "EntitlementCreated": _on_entitlement_created,
    "EntitlementUpdated": _on_entitlement_updated,
    "JobSubmitted": _on_job_submitted,
    "JobSpecChanged": _on_job_spec_changed,
    "JobSpecReconciled": _on_job_spec_reconciled,
    "JobResized": _on_job_resized,
    "JobStopped": _on_job_stopped,
    "TasksAllocated": _on_tasks_allocated,
    "AllocationRejected": _on_allocation_rejected,
    "TasksDeallocated": _on_tasks_deallocated,
    "TaskStateChanged": _on_task_state_changed,
    "TaskStatesChanged": _on_task_states_changed,
    "MachineStatusChanged": _on_machine_status_changed,
    "MachinesStatusChanged": _on_machine_status_changed,
    "UnavailabilityStarted": _on_unavailability_started,
    "UnavailabilityEnded": _on_unavailability_ended,
    "TaskControlAcked": _on_task_control_acked,
    "RebalancePlanned": _on_rebalance_planned,
})
CONSUMED = frozenset(HANDLERS)  # event types the shard reads; every other type is ignored


# -- what an event concerns: the slice of the state a shard loads to decide it ----------------------------------

# Keyed by the machines' owner (an entitlement, or a free pool's ``free/<dc>``), they name machines, not jobs.
MACHINE_EVENTS = frozenset({"MachineStatusChanged", "MachinesStatusChanged", "UnavailabilityStarted",
                            "UnavailabilityEnded"})


def named_jobs(event: Event) -> list[str]:
    """The jobs an event names itself (its ``job_id``, its reports' jobs, a plan's moves' jobs)."""
    p = event.payload
    if "job_id" in p:
        return [p["job_id"]]
    if event.type == "TaskStatesChanged":
        return sorted({r["job_id"] for r in p["reports"]})
    if event.type == "RebalancePlanned":
        return sorted({m["job_id"] for m in p["moves"]})
    return []


def in_owner_scope(entitlements: Mapping[str, Entitlement], event: Event, job: Job) -> bool:
    """Whether a machine event keyed by the machines' owner concerns ``job``: a job of that entitlement, or any
    job when the key is no entitlement of the shard (a free pool's)."""
    return event.entitlement not in entitlements or job.entitlement == event.entitlement


def machines_of(job: Job | None) -> set[str]:
    """The machines a job is tied to: those its tasks are placed on, and those of the maintenances it remembers
    (``maint``: their UnavailabilityEnded concerns the job even after its tasks left the machines)."""
    if job is None:
        return set()
    return {t.machine for t in job.tasks.values() if t.machine is not None} | maint_machines(job.maint)


def maint_machines(maint: Iterable[Sequence]) -> set[str]:
    """The machines of a job's remembered maintenances (``Job.maint`` or its record's ``maint``)."""
    return {m for entry in maint for m in entry[1]}


def concerned_jobs(state: SchedulerState, event: Event) -> list[str]:
    """The jobs ``decide(state, event)`` may read or change; deciding on a state of only these jobs gives the same
    events and the same jobs (``tests/unit/test_scheduler_decide.py``'s ``Sim`` checks it on every event it feeds).
    The jobs the event names; for a machine event, the jobs in its owner's scope with a task on its machines.
    The shard loads its slice by this rule (``ShardTables.job_ids_for``, with an index of machine -> jobs)."""
    named = named_jobs(event)
    if named or event.type not in MACHINE_EVENTS:
        return named
    machines = set(batches.machine_ids(event))
    return sorted(j for j, job in state.jobs.items()
                  if in_owner_scope(state.entitlements, event, job) and machines_of(job) & machines)


def is_own(event: Event) -> bool:
    """Whether the scheduler produced ``event`` (its events come back on the topics it reads)."""
    return event.producer == PRODUCER or event.producer.startswith(PRODUCER + "/")


# -- records: the state as faust table values (MappingProxyType does not pickle) -------------------------------

_TASK_FIELDS = tuple(f.name for f in fields(Task) if f.init)


def _pairs(pairs: Pairs) -> list[list[str]]:
    return [list(p) for p in pairs]


def _terms_record(t: Terms | None) -> dict | None:
    return None if t is None else {"cpu": t.cpu, "mem": t.mem, "requirements": _pairs(t.requirements)}


def _terms_of(r: Mapping[str, Any] | None) -> Terms | None:
    return None if r is None else Terms(r["cpu"], r["mem"], tuple(map(tuple, r["requirements"])))


def _spec_record(s: Spec) -> dict:
    return {"name": s.name, "command": list(s.command), "cpu": s.cpu, "mem": s.mem,
            "requirements": _pairs(s.requirements), "spread": s.spread, "max_unavailable": s.max_unavailable,
            "env": _pairs(s.env), "controller": s.controller}


def _spec_of(r: Mapping[str, Any]) -> Spec:
    return Spec(name=r["name"], command=tuple(r["command"]), cpu=r["cpu"], mem=r["mem"],
                requirements=tuple(map(tuple, r["requirements"])), spread=r["spread"],
                max_unavailable=r["max_unavailable"], env=tuple(map(tuple, r["env"])), controller=r.get("controller"))


def job_to_record(job: Job, previous: tuple[Job, Mapping[str, Any]] | None = None) -> dict:
    """``job`` as plain JSON-able data (a faust table value); ``job_from_record`` reads it back equal.

    ``previous``: an earlier version of the job and its record (one made from the other); the record of every task
    that is still the same ``Task`` object is reused as it is instead of built again (a decision changes a few
    tasks of a job: at 1,000 tasks this is most of the cost of writing the job back)."""
    known: dict[int, tuple[Task, dict]] = {}
    if previous is not None:
        known = {id(t): (t, r) for t, r in zip(previous[0].tasks.values(), previous[1]["tasks"])}
    tasks = []
    for t in job.tasks.values():
        hit = known.get(id(t))
        if hit is not None and hit[0] is t:
            tasks.append(hit[1])
            continue
        r = {name: getattr(t, name) for name in _TASK_FIELDS}
        r["terms"], r["request_terms"] = _terms_record(t.terms), _terms_record(t.request_terms)
        tasks.append(r)
    origin = [*job.origin[:3], _spec_record(job.origin[3])] if job.origin else []
    return {"id": job.id, "entitlement": job.entitlement, "spec": _spec_record(job.spec),
            "spec_version": job.spec_version, "desired": job.desired, "status": job.status, "tasks": tasks,
            "last_reason": job.last_reason, "last_ignored": job.last_ignored, "updating": job.updating,
            "requests": job.requests, "free_request_id": job.free_request_id, "deleted": job.deleted,
            "origin": origin, "seen": list(job.seen), "ops": job.ops, "ops_open": job.ops_open,
            "bucket": limiter.bucket_record(job.bucket), "throttled": list(job.throttled), "tc_seq": job.tc_seq,
            "tc_outstanding": job.tc_outstanding, "tc_asked": list(job.tc_asked), "tc_asked_ms": job.tc_asked_ms,
            "tc_completed": list(job.tc_completed), "tc_sent_completed": list(job.tc_sent_completed),
            "tc_sent_unhealthy": list(job.tc_sent_unhealthy),
            "tc_notices": [[u, list(ts), s, d, dur] for u, ts, s, d, dur in job.tc_notices],
            "tc_notice_new": job.tc_notice_new,
            "maint": [[u, list(ms), s, d, e] for u, ms, s, d, e in job.maint], "incarnation": job.incarnation,
            "submission": job.submission, "mix": vs.mix_record(job.mix), "generation": job.generation,
            "vacating": list(job.vacating)}


def job_from_record(r: Mapping[str, Any]) -> Job:
    tasks = {}
    for tr in r["tasks"]:
        t = Task(**{**tr, "terms": _terms_of(tr["terms"]), "request_terms": _terms_of(tr["request_terms"])})
        tasks[t.id] = t
    o = r["origin"]
    return Job(id=r["id"], entitlement=r["entitlement"], spec=_spec_of(r["spec"]), spec_version=r["spec_version"],
               desired=r["desired"], status=r["status"], tasks=MappingProxyType(tasks), last_reason=r["last_reason"],
               last_ignored=r["last_ignored"], updating=r["updating"], requests=r["requests"],
               free_request_id=r["free_request_id"], deleted=r["deleted"],
               origin=(*o[:3], _spec_of(o[3])) if o else (), seen=tuple(r["seen"]), ops=r.get("ops", 0),
               ops_open=r.get("ops_open", 0), bucket=limiter.bucket_of(r.get("bucket")),
               throttled=tuple(r.get("throttled", ())), tc_seq=r.get("tc_seq", 0),
               tc_outstanding=r.get("tc_outstanding", False), tc_asked=tuple(r.get("tc_asked", ())),
               tc_asked_ms=r.get("tc_asked_ms"), tc_completed=tuple(r.get("tc_completed", ())),
               tc_sent_completed=tuple(r.get("tc_sent_completed", ())),
               tc_sent_unhealthy=tuple(r.get("tc_sent_unhealthy", ())),
               tc_notices=tuple((n[0], tuple(n[1]), n[2], n[3], n[4] if len(n) > 4 else None)
                                for n in r.get("tc_notices", ())),
               tc_notice_new=r.get("tc_notice_new", False),
               maint=tuple((u, tuple(ms), s, d, e) for u, ms, s, d, e in r.get("maint", ())),
               incarnation=r.get("incarnation", 1), submission=r.get("submission", ""),
               mix=vs.mix_from_record(r.get("mix")), generation=r.get("generation", 0),
               vacating=tuple(r.get("vacating", ())))


def state_of(jobs: Iterable[Job] = (), entitlements: Iterable[Entitlement] = (),
             machines_down: Mapping[str, str] | None = None, shard_bucket: Bucket | None = None) -> SchedulerState:
    """A shard's state from its parts (e.g. read back from faust tables; ``shard_bucket`` from
    ``limiter.bucket_of`` of the partition's stored record)."""
    return SchedulerState(entitlements=MappingProxyType({e.name: e for e in entitlements}),
                          jobs=CowMap((j.id, j) for j in jobs),
                          machines_down=MappingProxyType(dict(machines_down or {})), shard_bucket=shard_bucket)


# -- decisions ---------------------------------------------------------------------------------------------------

def decide(state: SchedulerState, event: Event, now_ms: int, *, limits: Limits = DEFAULT_LIMITS,
           max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB) -> tuple[SchedulerState, list[Event]]:
    """Apply one decoded input event: the new state and the events to produce (in order).

    Event types outside ``CONSUMED`` and the scheduler's own events change nothing. An event id already in the
    job's duplicate ring changes nothing and emits nothing. Emitted ids are ``derived_event_id`` of the input's
    id and a discriminator; ``causation_id`` is the input's id; ``timestamp_ms`` is ``now_ms``.
    """
    handler = HANDLERS.get(event.type)
    if handler is None or is_own(event):
        return state, []
    fold = _Fold(state, now_ms, event, limits=limits, max_tasks=max_tasks)
    handler(fold, event)
    return fold.result()


def decide_all(state: SchedulerState, events: Iterable[Event], now_ms: int, *, limits: Limits = DEFAULT_LIMITS,
               max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB) -> tuple[SchedulerState, list[Event]]:
    """``decide`` over many events in order (replaying a log): the final state and everything emitted."""
    out: list[Event] = []
    for ev in events:
        state, emitted = decide(state, ev, now_ms, limits=limits, max_tasks=max_tasks)
        out.extend(emitted)
    return state, out


def retry_unplaced(state: SchedulerState, now_ms: int, *, limits: Limits = DEFAULT_LIMITS
                   ) -> tuple[SchedulerState, list[Event]]:
    """The timer's decision: stop what remains on machines whose planned maintenance reached its deadline
    (``_enforce_deadlines``); ask again to place every task left unplaced by an AllocationRejected (one request
    per job); perform operations the rate limiter held back, as far as it now allows; ask a TaskController
    again after ``REASK_MS`` without an answer (a lost request or ack) or with operations still pending.
    Ids derive from the request ids, the operation ids and ``now_ms``, so a repeat from the same state emits
    the same events."""
    fold = _Fold(state, now_ms, None, id_root=f"{PRODUCER}/retry/{now_ms}", limits=limits)
    for job_id in sorted(state.jobs):
        job = state.jobs[job_id]
        if job.status not in (JOB_ACTIVE, JOB_STOPPING):  # a stopping job's stops wait for tokens too
            continue
        if any(not m[4] and m[3] <= now_ms for m in job.maint):
            _enforce_deadlines(fold.work_for(job_id))
        if job.status == JOB_ACTIVE and any(t.parked for t in job.tasks.values()):
            fold.work_for(job_id).retry_parked()
        if job.ops_open or job.throttled:
            w = fold.work_for(job_id)  # its finish drains what is approved
            if (job.status == JOB_ACTIVE and job.spec.controller and job.tc_asked_ms is not None
                    and now_ms - job.tc_asked_ms >= REASK_MS
                    and (job.tc_outstanding or any(t.op_state == OP_PENDING for t in job.tasks.values()))):
                w.ask = True
    return fold.result()
