"""The working copy of one decision: ``Fold`` (the shard's state as the decision changes it, the events it emits,
their derived ids) and ``JobWork`` (one job's: its task changes, the AllocationRequested being built, what to
publish). Every change of a task's state, a job's status, an operation's state or a maintenance choice goes
through ``lifecycle.py``'s tables here (``JobWork.step``, ``job_step``, ``new_op``/``op_step``/``end_op``,
``choice_fields``). What a task or an operation does next is ``steps.py``; the handlers of the events are
``decide.py``. Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from infra.config import DEFAULT_MAX_TASKS_PER_JOB
from processors.allocator.placement import Entitlement
from processors.scheduler import lifecycle as lc
from processors.scheduler import versions as vs
from processors.scheduler.lifecycle import (
    JOB_ALL_STOPPED, JOB_DELETED, JOB_FREED, JOB_STOPPED, OP_APPROVED, OP_ASKED, OP_ENDED, OP_RUNNING, OP_WANTED,
    PENDING, RESTART_COMMANDED, START_COMMANDED, STOP_COMMANDED, STOPPED,
)
from processors.scheduler.model import (
    RUN, Job, SchedulerState, Task, incarnation_tag, index_of, job_phase, operation_id, published_state, replace,
    request_id,
)
from processors.taskcontrol import limiter
from processors.taskcontrol.limiter import DEFAULT_LIMITS, Limits
from processors.taskcontrol.protocol import CONTROLLED
from streams.batches import SERVICE_DISCOVERY_UPDATED, ENVELOPE_BYTES, batch_id, content_key, size_of, split
from streams.events import Event, derived_event_id, new_event

PRODUCER = "scheduler"
SEEN_LIMIT = 1024  # input event ids remembered per job (the duplicate ring)
PUBLISH_PART_TASKS = 500  # JobTasksPublished: tasks per part of a job published in parts (index // this)
REQUEST_TASKS_AT_ONCE = 2_000  # an AllocationRequested naming fewer tasks is never split (far below the bound)
COMMANDED = frozenset({START_COMMANDED, RESTART_COMMANDED, STOP_COMMANDED})  # steps that command the task's agent


def _sorted_tasks(tasks: Mapping[str, Task]) -> list[Task]:
    return sorted(tasks.values(), key=lambda t: t.index)


def _by_index(tasks: Mapping[str, Task]) -> dict[str, Task]:
    return dict(sorted(tasks.items(), key=lambda kv: kv[1].index))


# -- the working copy of one decision ------------------------------------------------------------------------------

class Fold:
    """The working copy of one call; the returned state is immutable. Emits with derived ids."""

    def __init__(self, state: SchedulerState, now_ms: int, cause: Event | None, id_root: str | None = None,
                 limits: Limits = DEFAULT_LIMITS, max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB):
        self.state = state
        self.now = now_ms
        self.limits = limits
        self.max_tasks = max_tasks
        self.shard_bucket = state.shard_bucket
        self.cause_id = cause.event_id if cause is not None else None  # recorded in each touched job's ring
        self.cause_ms = cause.timestamp_ms if cause is not None else None  # the input's own log time
        self.causation_id = self.cause_id
        self.id_root = id_root or self.cause_id or PRODUCER
        self.work: dict[str, JobWork] = {}
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

    def jobs(self) -> Iterator[Job]:
        """The jobs of the state the decision started from, in id order, each as the decision has it so far."""
        for job_id in sorted(self.state.jobs):
            w = self.work.get(job_id)
            yield w.job if w is not None else self.state.jobs[job_id]

    def work_for(self, job_id: str) -> "JobWork | None":
        """The job's working copy, or None if the job is unknown or this event was applied to it already."""
        w = self.work.get(job_id)
        if w is not None:
            return w
        job = self.state.jobs.get(job_id)
        if job is None or (self.cause_id is not None and self.cause_id in job.seen):
            return None
        return self.work_of(job)

    def work_of(self, job: Job) -> "JobWork":
        """The working copy of ``job``, one of the state's, for a decision without a cause (the timer's: nothing to
        find in the job's duplicate ring); an event's decision asks ``work_for``."""
        w = self.work.get(job.id)
        if w is None:
            w = self.work[job.id] = JobWork(self, job)
        return w

    def new_job(self, job: Job) -> "JobWork":
        w = self.work[job.id] = JobWork(self, job, new=True)
        w.dirty = True
        return w

    # the rate limiter
    def admit(self, w: "JobWork") -> str | None:
        """Take a token for one operation of ``w``'s job from its bucket and the shard's; None if taken, else
        why the operation must wait (both buckets are left refilled, nothing taken)."""
        job_b, shard_b, refused = limiter.admit(w.job.bucket, self.shard_bucket, self.limits, self.now)
        w.set(quiet=True, bucket=job_b)
        self.shard_bucket = shard_b
        return refused

    def take_shard_token(self) -> bool:
        """One token of the shard's bucket (a restart re-asked after a power loss): True if taken."""
        b = limiter.take(self.shard_bucket, self.limits.shard, self.now)
        if b is None:
            return False
        self.shard_bucket = b
        return True

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

    def result(self, close: Callable[["JobWork"], Job]) -> tuple[SchedulerState, list[Event]]:
        """The new state and the events, once ``close`` (``steps.close``) closed each job the decision touched."""
        jobs = {job_id: close(w) for job_id, w in self.work.items()}
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


class JobWork:
    """One job's working copy inside a decision: its task changes, the request being built, what to publish."""

    def __init__(self, fold: Fold, job: Job, new: bool = False):
        self.fold = fold
        self.job = job
        self.before = None if new else job  # the job as the decision found it
        self._tasks: dict[str, Task] | None = None  # copied on the first write
        self.commands: list[dict[str, Any]] = []  # this decision's task commands (one TasksCommanded)
        self.command_basis: dict[str, int | None] = {}  # task id -> when the decision found it last commanded
        self.reports: list[dict[str, Any]] = []  # this decision's own task transitions (one TaskStatesChanged)
        self.discoveries: list[dict[str, Any]] = []  # its service-discovery changes (one ServiceDiscoveryUpdated)
        self.dirty_parts: set[int] = set()  # parts (PUBLISH_PART_TASKS) with a task whose visible state changed
        self._added = False  # a task was added: the order by index must be restored
        self.place: dict[str, None] = {}  # ordered sets of task ids for this decision's AllocationRequested
        self.free: dict[str, None] = {}
        self.avoid: set[str] = set()
        self.asked_again: set[str] = set()  # tasks whose request the timer makes again (``steps.ask_again``)
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
        self.dirty_parts.add(index_of(tid) // PUBLISH_PART_TASKS)

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

    def job_step(self, trigger: str, **fields: Any) -> None:
        """Move the job by ``trigger`` through ``lifecycle.JOB_TRANSITIONS`` (raises IllegalTransition: a scheduler
        bug), changing ``fields`` with it."""
        phase = lc.JOBS.next_state(job_phase(self.job), trigger)
        deleted = phase == JOB_DELETED
        if phase in lc.JOB_ENDED:  # its grace runs from now (``decide.collect``)
            fields = {"ended_ms": self.fold.now, **fields}
        self.set(status=JOB_STOPPED if deleted else phase, deleted=deleted, **fields)

    def choice_fields(self, t: Task, trigger: str, ue: str | None = None) -> dict[str, Any]:
        """``t``'s planned-maintenance choice after ``trigger`` through ``lifecycle.CHOICE_TRANSITIONS`` (raises
        IllegalTransition), as the fields to replace: ``maint_choice``, and ``maint_ue`` (``ue``, None once none)."""
        choice = lc.CHOICES.next_state(t.maint_choice, trigger)
        return {"maint_choice": choice, "maint_ue": None if choice is None else ue}

    def step(self, t: Task, trigger: str, *, emit_reason: str | None = None, **changes: Any) -> Task:
        """Move ``t`` by ``trigger`` through the lifecycle table (raises IllegalTransition: a scheduler bug);
        with ``emit_reason``, announce it in the decision's TaskStatesChanged (its report id derived as a
        TaskStateChanged's would be)."""
        if trigger in COMMANDED:  # the timer commands it again if no report moves it on (``steps.command_again``)
            changes.setdefault("commanded_ms", self.fold.now)
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
        found = None if self.before is None else self.before.tasks.get(t.id)
        self.command_basis[t.id] = None if found is None else found.commanded_ms

    def emit_batches(self) -> None:
        """The decision's service-discovery changes as ServiceDiscoveryUpdated, its task transitions as
        TaskStatesChanged and its commands as TasksCommanded, each split so that no record exceeds
        ``batches.MAX_RECORD_BYTES`` (normally one of each). Discovery first: a task leaves it before it stops.
        The ids of the discovery and command batches hold a digest of their content (``batches.content_key``): a shard
        that decides a batch of inputs again from an older state (stopped between producing and storing) may read them
        in another order and decide other commands (the kill storm saw two STOPs under one id, then one); those are
        then another event, carried out as well, not a second content under one id that readers would drop (the
        agents answer a command again from where the task is: ``processors/agent/decide.py``). A command batch's digest
        holds, beside its commands, when the decision found each task last commanded: the same STOP decided again after
        the timer commanded the task again in between (the kill storm, stop 43: the START repeated, then the failure's
        STOP again under the first STOP's id, dropped as a duplicate, and the repeated START never stopped on the log)
        is another event.
        Nothing here is signed: the producer seals the commands with the scheduler's key (streams/auth.py), so the
        history's replay and shadow (processors/history) decide the same events without it."""
        job = self.job
        if self.discoveries:
            for i, part in enumerate(split(self.discoveries, fixed=ENVELOPE_BYTES + size_of(job.id))):
                self.emit(SERVICE_DISCOVERY_UPDATED, job.id, {"job_id": job.id, "changes": part}, "discovery", job.id, i,
                          content_key(part))
            self.discoveries = []
        if self.reports:
            for part in split(self.reports):
                self.emit("TaskStatesChanged", part[0]["task_id"], {"reports": part},
                          event_id=batch_id("TaskStatesChanged", (r["report_id"] for r in part)))
            self.reports = []
        if self.commands:
            ent = self.fold.entitlements().get(job.entitlement)
            profile = None if ent is None else ent.host_profile or ""  # agents start tasks only where it is applied
            # what the tasks may use: signed with the rest (the producer's signer, streams/auth.py), like argv and env
            resources = {"cpu_millicores": job.spec.cpu, "memory_mib": job.spec.mem}
            for version, code, commands in _by_version(self.commands, job.mix):
                argv, env = (list(code.command), dict(code.env)) if code else (list(job.spec.command), dict(job.spec.env))
                parts = split(commands, fixed=ENVELOPE_BYTES + size_of(job.id) + size_of(argv) + size_of(env)
                              + size_of(resources) + 30)
                disc = () if version is None else (version,)  # a job with a version mix: a batch per version run
                for i, part in enumerate(parts):
                    self.emit("TasksCommanded", job.id, {"job_id": job.id, "argv": argv, "env": env, "commands": part,
                                                         "part": i, "parts": len(parts), "host_profile": profile,
                                                         "resources": resources}, "commands", job.id, *disc, i,
                              content_key(part, [self.command_basis.get(c["task_id"]) for c in part]))
            self.commands = []
            self.command_basis = {}

    def request(self, place: Iterable[str], free: Iterable[str], avoid: Iterable[str] = (),
                targets: Mapping[str, str] | None = None) -> str:
        """An AllocationRequested; it avoids ``avoid`` and every machine of the job's planned maintenances that the
        job's entitlement holds (a task moved off a machine of an MSB under maintenance must not land on its
        neighbour). The allocator filters every maintenance's machines itself, the free pool's too; this list
        holds for the moment the allocator has not read the notice yet."""
        job, spec = self.job, self.job.spec
        if place:
            avoid = set(avoid).union(*(m.machine_ids for m in job.maint))
        n = job.requests + 1
        rid = request_id(job.id, job.spec_version, n, incarnation_tag(job.submission))
        self.set(quiet=True, requests=n)
        self.emit("AllocationRequested", rid, {
            "request_id": rid, "job_id": job.id, "spec_version": job.spec_version,
            "place_task_ids": sorted(place, key=index_of), "free_task_ids": sorted(free, key=index_of),
            "resources": {"cpu_millicores": spec.cpu, "memory_mib": spec.mem},
            "requirements": dict(spec.requirements), "spread": spec.spread, "avoid_machine_ids": sorted(avoid),
            "target_machine_ids": dict(targets or {})}, "request", rid)
        return rid

    def retry_parked(self, *, paced: bool = False) -> None:
        """Ask again to place the tasks a rejection parked. ``paced`` (the timer's retry): a parked task that an
        operation is restarting (``op_state`` running: a move off a lost machine, an update or a move whose new
        placement failed) takes a token of the shard's bucket first, as its move did, or waits for a later tick:
        when a DC's power comes back, its tasks restart at the shard's rate, not all at once."""
        for t in self.ordered():
            if t.parked and t.state == PENDING and t.intent == RUN:
                if paced and t.op_state == OP_RUNNING and not self.fold.take_shard_token():
                    continue
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
        asked = OP_ASKED if kind in CONTROLLED and self.job.spec.controller else OP_WANTED
        return self.put(replace(t, op=kind, op_id=operation_id(t.id, kind, n, incarnation_tag(self.job.submission)),
                                op_state=lc.OPERATIONS.next_state(t.op_state, asked), op_reason=reason, **changes))

    def op_step(self, t: Task, trigger: str) -> Task:
        """Move ``t``'s operation by ``trigger`` through ``lifecycle.OP_TRANSITIONS`` (raises IllegalTransition)."""
        return self.put(replace(t, op_state=lc.OPERATIONS.next_state(t.op_state, trigger)))

    def end_op(self, t: Task) -> Task:
        """``t``'s operation is over (done or moot): one the controller approved is reported completed."""
        if t.op is None:
            return t
        if self.job.spec.controller and t.op in CONTROLLED and t.op_state in (OP_APPROVED, OP_RUNNING):
            self.set(quiet=True, tc_completed=(*self.job.tc_completed, t.op_id))
        return self.put(replace(t, op=None, op_id=None, op_state=lc.OPERATIONS.next_state(t.op_state, OP_ENDED),
                                op_reason="", fence=False, move_to=None))

    # closing the decision
    def count_ops(self) -> None:
        """Add the decision's change of tasks with an operation to the job's ``ops_open``."""
        if self.ops_delta:
            self.set(quiet=True, ops_open=self.job.ops_open + self.ops_delta)
            self.ops_delta = 0

    def finish(self) -> Job:
        """The job as the decision leaves it (once ``steps.close`` took the closing steps): its tasks in index order,
        the event in its duplicate ring; emits the decision's batches and, if what it shows changed, its state."""
        self.count_ops()
        job = self.job
        if self._tasks is not None:  # the working dict becomes the state's: nothing writes to it after this
            job = replace(job, tasks=MappingProxyType(_by_index(self._tasks) if self._added else self._tasks))
        if self.fold.cause_id is not None:
            job = replace(job, seen=(*job.seen, self.fold.cause_id)[-SEEN_LIMIT:])
        if self.dirty and task_parts(job) > job.parts:
            job = replace(job, parts=task_parts(job))
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

    def flush_request(self) -> None:
        place = [tid for tid in self.place if (t := self.tasks.get(tid)) is not None and t.state == PENDING
                 and t.intent == RUN]
        if not place and not self.free:
            return
        terms = self.job.spec.terms
        for part_place, part_free in self._request_parts(place, self.free):
            targets = {tid: t.move_to for tid in part_place if (t := self.tasks[tid]).move_to is not None}
            rid = self.request(part_place, part_free, self.avoid, targets)
            for tid in part_place:  # a target is asked for once: a retry after a rejection places it anywhere
                self.put(replace(self.tasks[tid], request_id=rid, request_terms=terms, parked=False, move_to=None,
                                 asked_ms=self.fold.now, asked_again=tid in self.asked_again))

    def _request_parts(self, place: Iterable[str], free: Iterable[str]) -> list[tuple[list[str], list[str]]]:
        """``place`` and ``free`` cut into the parts of as many AllocationRequested as keep each record under
        ``batches.MAX_RECORD_BYTES`` (one, unless the task ids of a very big job would not fit); a task in both
        (a move) stays in one part, so the allocator frees it before it places it."""
        place_set, free_set = set(place), set(free)
        if len(place_set) + len(free_set) <= REQUEST_TASKS_AT_ONCE:
            return [(list(place), list(free))]
        tasks = sorted(place_set | free_set, key=index_of)
        avoid = size_of(sorted(self.avoid.union(*(m.machine_ids for m in self.job.maint))))
        parts = split(tasks, fixed=ENVELOPE_BYTES + avoid + size_of(self.job.id) * 3 + 200,
                      size=lambda t: size_of(t) * ((t in place_set) + (t in free_set)), max_items=len(tasks))
        return [([t for t in part if t in place_set], [t for t in part if t in free_set]) for part in parts]

    def finish_stop(self) -> None:
        """A stopping job whose tasks are all STOPPED: ask to free them all; stopped (deleted when answered: the
        allocator answers an entitlement's requests in order, so the answer to the last part is the last)."""
        if any(t.state != STOPPED for t in self.tasks.values()):
            return
        if not self.tasks:  # nothing to free
            self.job_step(JOB_ALL_STOPPED)
            self.job_step(JOB_FREED)
            return
        self.job_step(JOB_ALL_STOPPED)
        self.ask_free()

    def ask_free(self) -> None:
        """Ask to free every task of the stopped job (the answer to the last part is the last: ``finish_stop``)."""
        rid = None
        for _, part_free in self._request_parts((), self.tasks):
            rid = self.request((), part_free)
        self.set(quiet=True, free_request_id=rid, free_asked_ms=self.fold.now)


def _by_version(commands: list[dict[str, Any]], mix: vs.Mix | None
                ) -> list[tuple[int | None, vs.Code | None, list[dict]]]:
    """A decision's commands for one job, in TasksCommanded batches: one (None, None) without a version mix, else one
    per version the lines run with the mix's code of it (argv/env; None: a version the mix does not list runs the
    job's spec), in the order the versions first appear."""
    if mix is None:
        return [(None, None, commands)]
    by: dict[int, list[dict]] = {}
    for c in commands:
        by.setdefault(c["spec_version"], []).append(c)
    return [(version, mix.code(version), part) for version, part in by.items()]


def state_keys(job: Job) -> list[tuple[str, str]]:
    """(topic, key) of every record of the latest-state topics ``job`` may hold: its JobStatePublished on
    ``state.jobs``, and on ``state.tasks`` each JobTasksPublished part it ever published (``Job.parts``). The shard
    writes a tombstone to each when the job leaves the state (``decide.collect``), so compaction forgets them."""
    return [("state.jobs", job.id), *(("state.tasks", f"{job.id}#{p}") for p in range(job.parts))]


def task_parts(job: Job) -> int:
    """0: ``job``'s tasks are published inside its JobStatePublished; n: in n JobTasksPublished parts (a task of
    index i in part i // PUBLISH_PART_TASKS), because the job has a task of index PUBLISH_PART_TASKS or more."""
    if not job.tasks:
        return 0
    last = job.tasks[next(reversed(job.tasks))].index  # tasks are kept in index order
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

