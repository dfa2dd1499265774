"""Scheduler shard decisions: the lifecycle of the jobs and tasks of one shard's entitlements. Pure.

No faust, Kafka or Redis; no clock, no randomness: every decision is ``(state, event, now_ms) -> (new_state,
events)`` over immutable state, and the same input on the same state gives the same output, event ids included.
``decide`` dispatches a decoded event by type (``HANDLERS``); ``retry_unplaced`` is the timer's decision;
``concerned_jobs`` is what an event concerns (the slice of the state a shard loads). See ``README.md`` for the flows
as a diagram. The pieces, by name:

    decide.py     the entry points, one handler per consumed event type, what an event concerns
    model.py      the state: SchedulerState, Job, Task, Spec, Terms (Entitlement: the allocator's class)
    lifecycle.py  the tables of legal transitions: task states, job phases, operation states
    work.py       the working copy of one decision (Fold, JobWork): every transition goes through the tables there
    steps.py      what a task or an operation does next (restart policy, rolling update, operations, maintenance)
    reasons.py    the reason constants the events carry
    records.py    the state as faust table values (job_to_record / job_from_record)

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
would not fit one record (``JobWork._request_parts``: a task in one of them, free and place together). Request ids are
``<job>:<tag>:v<spec_version>:r<n>`` with ``tag`` the incarnation's (``model.incarnation_tag``) and ``n`` a
per-incarnation counter in the state, so a replay names them alike. A newer
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
is asked again, and then it may come again (the allocator's journal answers a request whose decision is not on the
log yet) and must apply. A lost answer or report is repaired by the timer: a request a minute unanswered is made again,
a task 30 s STARTING or STOPPING is commanded again (``steps.ask_again``, ``steps.command_again``).

**Agent reports are checked, never trusted.** A report naming another machine or another spec version than
the task's current incarnation is stale (an agent lagging behind a move or an update) and ignored; a
transition the lifecycle table refuses is ignored too. Neither raises: a shard must not crash on a bad report.
The latest ignored report is kept in the job's ``last_ignored`` (also in ``model.job_detail``).
"""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from infra.config import DEFAULT_JOB_GC_MS, DEFAULT_MAX_TASKS_PER_JOB
from processors import rules
from processors.agent.hostprofile import REASON_HOST_PROFILE_FAILED
from processors.allocator.placement import ENTITLEMENT_FIELDS, Entitlement
from processors.scheduler import lifecycle as lc
from processors.scheduler import steps
from processors.scheduler import versions as vs
from processors.scheduler.lifecycle import (
    ALLOCATED, ALLOCATED_EV, CRASHED, EXITED_OK, FAILED, JOB_ACTIVE, JOB_FREED, JOB_REFUSED, JOB_RESUBMITTED, JOB_STOP,
    JOB_STOPPING, MAINTENANCE_ENDED, OP_ACKED, OP_PENDING, OP_RUNNING, PENDING, RUNNING, STARTED, STARTING,
    START_COMMANDED, STOPPED, STOPPED_EV, STOPPING, IllegalTransition,
)
from processors.scheduler.model import (
    HELD, RETIRE, RUN, Job, Maintenance, SchedulerState, Spec, Task, first_sequence, job_phase, replace,
)
from processors.scheduler.reasons import (
    REASON_ALLOCATED, REASON_CRASHED, REASON_DUPLICATE_JOB_ID, REASON_ENTITLEMENT_MISMATCH, REASON_EXITED,
    REASON_ILLEGAL_REPORT, REASON_JOB_NOT_ACTIVE, REASON_JOB_STOPPED, REASON_LOST_PLACEMENT, REASON_MACHINE_FAILED,
    REASON_MACHINE_MAINTENANCE, REASON_MACHINE_UNHEALTHY, REASON_MAINTENANCE_ENDED, REASON_MOVE_JOB_NOT_RUNNING, REASON_MOVE_NOT_ON_SOURCE,
    REASON_MOVE_TASK_BUSY, REASON_MOVE_TASK_NOT_RUNNING, REASON_MOVE_UNDER_MAINTENANCE, REASON_NOT_AN_AGENT_STATE,
    REASON_REBALANCE, REASON_RESIZED, REASON_STALE_GENERATION, REASON_STALE_REPORT, REASON_STALE_SPEC_VERSION,
    REASON_STALE_SUBMISSION, REASON_SUBMITTED, REASON_TASK_RUNNING, REASON_UNKNOWN_ENTITLEMENT, REASON_UNKNOWN_JOB,
    REASON_UNKNOWN_TASK,
)
from processors.scheduler.steps import RESTART_RESET_MS, START, STOP
from processors.scheduler.work import PRODUCER, Fold, JobWork
from processors.taskcontrol import protocol as tc
from processors.taskcontrol.limiter import DEFAULT_LIMITS, Limits
from processors.taskcontrol.protocol import CHOICE_KEEP, OP_MOVE
from streams import batches
from streams.enums import MachineStatus, UnavailabilityKind
from streams.events import Event

UP, UNHEALTHY, DOWN = MachineStatus.UP, MachineStatus.UNHEALTHY, MachineStatus.DOWN
MAINTENANCE = MachineStatus.MAINTENANCE
KIND_FAILURE = UnavailabilityKind.FAILURE
REASK_MS = 30_000  # the timer asks a job's TaskController again after this long without an answer or progress

KIND_POWER = UnavailabilityKind.POWER  # UnavailabilityKind: power loss of a fault domain, unavailable now like a failure
UNAVAILABLE_KINDS = frozenset({KIND_FAILURE, KIND_POWER})  # planned MAINTENANCE notices wait for TaskControl
UE_DOWN_STATUSES = frozenset({MAINTENANCE, *UNAVAILABLE_KINDS})  # down statuses a UE sets, so its end clears them
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


# -- handlers: one per consumed event type -------------------------------------------------------------------------

def refuse(fold: Fold, ev: Event, reason: str, message: str, w: "JobWork | None" = None) -> None:
    """Refuse intent ``ev``, applying none of it: an IntentRefused (``reason``, ``message``) keyed to its entitlement;
    the job it is about (``w``, if it has one) shows it in its published last_reason."""
    job_id = ev.payload.get("job_id")
    fold.emit("IntentRefused", ev.entitlement, job_id or ev.entity_id, {
        "intent_type": ev.type, "intent_event_id": ev.event_id, "job_id": job_id, "reason": reason,
        "message": message}, "refused", ev.event_id)
    if w is not None:
        w.set(last_reason=f"{reason}: {message}")


def _problems(fold: Fold, ev: Event) -> tuple[str, str] | None:
    """(reason, message) if ``ev`` breaks a rule of ``processors/rules.py`` (the front end's too), else None."""
    found = rules.intent_problems(ev.type, ev.payload, ev.entitlement, fold.max_tasks)
    return rules.refusal(found) if found else None


def _on_entitlement_created(fold: Fold, ev: Event) -> None:
    p = ev.payload
    if (refused := _problems(fold, ev)) is not None:
        refuse(fold, ev, *refused)
        return
    fold.set_entitlement(Entitlement(name=p["name"], quota_machines=p["quota_machines"],
                                     machine_type=p.get("machine_type"), dc_pin=p.get("dc_pin"),
                                     host_profile=p.get("host_profile")))


def _on_entitlement_updated(fold: Fold, ev: Event) -> None:
    """The fields an EntitlementUpdated sets change (an entitlement exists once a quota is set, as the allocator
    has it); one breaking a rule is refused."""
    if (refused := _problems(fold, ev)) is not None:
        refuse(fold, ev, *refused)
        return
    p = ev.payload
    known = fold.entitlements().get(ev.entitlement)
    given: dict[str, Any] = {k: p.get(k) for k in ENTITLEMENT_FIELDS if p.get(k) is not None}
    if known is not None:
        fold.set_entitlement(replace(known, **given))
    elif "quota_machines" in given:
        fold.set_entitlement(Entitlement(name=ev.entitlement, **given))


def _successor(existing: Job | None) -> dict[str, Any]:
    """What a new incarnation of a job id takes over from the previous one, while that one is still in the state
    (a stopped and freed job, or a rejected submission, within its grace: ``collect``): its number + 1 and the
    duplicate ring. Nothing names the new incarnation's requests, operations or TaskControl requests after the
    previous one's: they carry its own tag (``model.incarnation_tag`` of its submission) and its sequence counts
    from its submission's time (``model.first_sequence``), so a late result or ack for the previous incarnation
    stays stale whether or not that one is still held. Task ids stay ``<job>/<index>``: the previous incarnation's
    were freed before it was gone."""
    if existing is None:
        return {}
    return {"status": lc.JOBS.next_state(job_phase(existing), JOB_RESUBMITTED),
            "incarnation": existing.incarnation + 1, "seen": existing.seen}


def _on_job_submitted(fold: Fold, ev: Event) -> None:
    """A new job, or a new incarnation of a job id whose previous one was rejected, or stopped and freed (deleted).
    The same submission again is a no-op; another spec under a live job id is refused (duplicate_job_id), as is a
    submission while the previous incarnation is still stopping (job_not_active: submit again once it is gone)."""
    p = ev.payload
    job_id, spec = p["job_id"], Spec.from_payload(p)
    origin = (ev.entitlement, p["spec_version"], p["tasks"], spec)
    existing = fold.state.jobs.get(job_id)
    if existing is not None and ev.event_id in existing.seen:
        return
    if existing is not None and not lc.JOBS.allows(job_phase(existing), JOB_RESUBMITTED):
        w = fold.work_for(job_id)
        if w is None or (existing.status == JOB_ACTIVE and existing.origin == origin):
            return  # applied already, or the same submission again (under another event id): a no-op
        if existing.status == JOB_ACTIVE:
            refuse(fold, ev, REASON_DUPLICATE_JOB_ID, f"job {job_id} exists with another spec (submitted to "
                                                       f"{existing.entitlement} at spec version "
                                                       f"{existing.origin[1]})", w)
        else:
            refuse(fold, ev, REASON_JOB_NOT_ACTIVE, f"job {job_id} is {existing.status}: submit it again once it "
                                                     "is stopped", w)
        return
    refused = _problems(fold, ev)
    if ev.entitlement not in fold.entitlements():
        refused = (REASON_UNKNOWN_ENTITLEMENT, f"entitlement {ev.entitlement!r} was never created")
    w = fold.new_job(Job(id=job_id, entitlement=ev.entitlement, spec=spec, spec_version=p["spec_version"],
                         desired=0, origin=origin, submission=ev.event_id, tc_seq=first_sequence(fold.now),
                         **_successor(existing)))
    if refused is not None:
        w.job_step(JOB_REFUSED)
        refuse(fold, ev, *refused, w)
        return
    steps.resize(w, p["tasks"], REASON_SUBMITTED)


def _intent_work(fold: Fold, ev: Event) -> JobWork | None:
    """The job an intent is about, if it can take one; else the intent is refused (an IntentRefused, and the
    job's last_reason if it has one). A stop of a job stopping, stopped or rejected is a no-op: it is what was
    asked."""
    job_id = ev.payload["job_id"]
    job = fold.job(job_id)
    if job is None or job.deleted:
        if job is None or ev.event_id not in job.seen:
            gone = "" if job is None else " (stopped and gone)"
            refuse(fold, ev, REASON_UNKNOWN_JOB, f"no job {job_id} in entitlement {ev.entitlement}{gone}")
        return None
    w = fold.work_for(job_id)
    if w is None:
        return None  # applied already
    if ev.entitlement != w.job.entitlement:
        refuse(fold, ev, REASON_ENTITLEMENT_MISMATCH, f"{ev.type} {ev.event_id} is keyed to {ev.entitlement}, the "
                                                       f"job belongs to {w.job.entitlement}", w)
        return None
    if w.job.status != JOB_ACTIVE:
        if ev.type != "JobStopped":
            refuse(fold, ev, REASON_JOB_NOT_ACTIVE, f"{ev.type} {ev.event_id} refused, the job is {w.job.status}", w)
        return None
    return w


def _on_job_resized(fold: Fold, ev: Event) -> None:
    w = _intent_work(fold, ev)
    if w is None:
        return
    if (refused := _problems(fold, ev)) is not None:
        refuse(fold, ev, *refused, w)
        return
    steps.resize(w, ev.payload["tasks"], REASON_RESIZED)
    w.retry_parked()


def _on_job_spec_changed(fold: Fold, ev: Event) -> None:
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
    steps.resize(w, p["tasks"], REASON_RESIZED)
    w.retry_parked()


def _refused_stale_version(fold: Fold, ev: Event, w: JobWork, *, same_is_stale: bool) -> bool:
    """Refuse a spec whose version is older than the job's (or the same, ``same_is_stale``), or that breaks a rule
    of the intent rules; True if refused."""
    new, have = ev.payload["spec_version"], w.job.spec_version
    if new < have or (same_is_stale and new == have):
        refuse(fold, ev, REASON_STALE_SPEC_VERSION, f"spec version {new} is "
                f"{'not newer than' if same_is_stale else 'older than'} {have}", w)
        return True
    if (refused := _problems(fold, ev)) is not None:
        refuse(fold, ev, *refused, w)
        return True
    return False


def _take_spec(w: JobWork, spec: Spec, version: int) -> None:
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


def _on_job_spec_reconciled(fold: Fold, ev: Event) -> None:
    """The Job Control Plane's reconciled spec (processors/jobcontrol): the job's shared spec, its size and its
    version mix (push %, canary) at once; tasks move to their target versions as in a rolling update
    (``versions.py``). One older than the job's (generation, spec version) or for another incarnation is refused."""
    w = _intent_work(fold, ev)
    if w is None:
        return
    p = ev.payload
    job = w.job
    if p["generation"] <= job.generation:
        refuse(fold, ev, REASON_STALE_GENERATION, f"generation {p['generation']} is not newer than "
                                                   f"{job.generation}", w)
        return
    if p.get("submission_id") and job.submission and p["submission_id"] != job.submission:
        refuse(fold, ev, REASON_STALE_SUBMISSION, f"reconciled for submission {p['submission_id']}; this "
                                                   f"incarnation ({job.incarnation}) is {job.submission}", w)
        return
    if _refused_stale_version(fold, ev, w, same_is_stale=False):  # a size or mix change keeps the versions
        return
    mix = vs.mix_of(p, job.mix)
    code = mix.code(mix.push if mix.push is not None else mix.stable)  # the job's spec shows the newest code
    assert code is not None  # refused above otherwise: the rules refuse a version the payload does not list
    spec = Spec.from_payload({**p, "command": code.command, "env": dict(code.env)})
    w.set(mix=mix, generation=p["generation"])
    w.remix = True
    _take_spec(w, spec, p["spec_version"])
    steps.resize(w, p["tasks"], REASON_RESIZED)
    w.retry_parked()


def _on_job_stopped(fold: Fold, ev: Event) -> None:
    w = _intent_work(fold, ev)
    if w is None:
        return
    why = ev.payload.get("reason", "")
    w.job_step(JOB_STOP, updating=False, last_reason=f"{REASON_JOB_STOPPED}: {why}" if why else "")
    for t in sorted(w.tasks.values(), key=lambda t: -t.index):
        steps.advance_retiring(w, w.put(replace(t, intent=RETIRE, reason=REASON_JOB_STOPPED)))


def _awaited(fold: Fold, ev: Event, task_ids: Iterable[str]) -> "JobWork | None":
    """The job's working copy if the result's request is awaited (by one of ``task_ids``, or as the stopped job's
    final free request), else None. A result nobody awaits changes nothing and is not remembered as applied (not in
    the duplicate ring): a scheduler that crashed after asking may read the answer before it asks again — the same
    request, the same ids — and while that decision is not yet on the log the allocator answers the request asked
    again with the same events (its journal), which must then apply. Once the decision is on the log the allocator
    does not answer the same request event twice: the timer then makes the request again (``steps.ask_again``).
    (The kill storm found a stopped job waiting for good for an answer it had read too early.)"""
    job_id, rid = ev.payload["job_id"], ev.payload["request_id"]
    if job_id not in fold.work:
        job = fold.job(job_id)
        if job is None or (job.free_request_id != rid and not any(
                (t := job.tasks.get(tid)) is not None and t.request_id == rid for tid in task_ids)):
            return None
    return fold.work_for(job_id)


EARLY_REPORTS = 4  # agents' reports a task awaiting its placement holds at most (``_hold_early``)


def _hold_early(w: JobWork, t: Task, p: Mapping[str, Any], rid: str) -> bool:
    """Hold an agent's report that comes before the placement it follows: STARTING or RUNNING of ``t``'s spec
    version, from a machine, while ``t`` awaits its placement. Only a batch decided again reads them so: a shard
    stopped after producing a decision and before storing it reads the batch again from its older state, and its
    topics may come in another order, an agent's reports of the START it commanded (on ``tasks``) before the
    TasksAllocated it started from (on ``allocations``). Ignored, they were lost (the record is passed) and the task
    stayed STARTING for good though its agent ran it (the kill storm, stop 41). Held, they apply once the
    TasksAllocated places ``t`` on that machine (``_on_tasks_allocated``); held reports of another machine are
    dropped then. Only a report dated at or after the request ``t`` awaits is held (what answers the request comes
    after it): a report of an earlier run (an old incarnation's, read again) is ignored as before; so is one of
    another spec version (an update's old run)."""
    if (t.state != PENDING or t.request_id is None or p["state"] not in (STARTING, RUNNING)
            or p.get("spec_version", 1) != t.spec_version or p.get("machine_id") is None
            or t.asked_ms is None or w.fold.cause_ms is None or w.fold.cause_ms < t.asked_ms):
        return False
    held = json.dumps({**p, "report_id": rid}, sort_keys=True, separators=(",", ":"))
    if held not in t.early_reports:
        w.put(replace(t, early_reports=(*t.early_reports, held)[-EARLY_REPORTS:]))
    return True


def _on_tasks_allocated(fold: Fold, ev: Event) -> None:
    w = _awaited(fold, ev, (pl["task_id"] for pl in ev.payload["placements"]))
    if w is None:
        return
    rid = ev.payload["request_id"]
    placed = False
    for pl in ev.payload["placements"]:
        t = w.tasks.get(pl["task_id"])
        if t is None or t.request_id != rid or t.state != PENDING:
            continue  # stale (superseded, retired) or applied already
        early = t.early_reports
        t = w.step(t, ALLOCATED_EV, emit_reason=REASON_ALLOCATED, machine=pl["machine_id"], dc=pl["dc"],
                   msb=pl["msb"], rack=pl["rack"], terms=t.request_terms, request_id=None, request_terms=None,
                   parked=False, early_reports=(), asked_again=False)
        steps.advance(w, t)
        for held in early:  # what its agent reported of this placement before it was read (``_hold_early``)
            r = json.loads(held)
            if r["machine_id"] == pl["machine_id"]:
                _apply_report(w, r, r["report_id"])
        placed = True
    if placed and not any(t.parked for t in w.tasks.values()):
        w.set(last_reason="")


def _on_allocation_rejected(fold: Fold, ev: Event) -> None:
    w = _awaited(fold, ev, ev.payload["unplaced_task_ids"])
    if w is None:
        return
    p = ev.payload
    rejected = False
    for tid in p["unplaced_task_ids"]:
        t = w.tasks.get(tid)
        if t is None or t.request_id != p["request_id"] or t.state != PENDING:
            continue
        w.put(replace(t, request_id=None, request_terms=None, parked=True, reason=p["reason"], asked_again=False))
        rejected = True
    if rejected:
        w.set(last_reason=f"{p['reason']}: {p['message']}" if p.get("message") else p["reason"])


def _on_tasks_deallocated(fold: Fold, ev: Event) -> None:
    """The answer to a stopped job's final free request: the job's tasks are gone. And the free that answers a request
    the timer made again (``steps.ask_again``) names where the lost answer had placed a task: the decision that read
    that answer may have started it there (before the shard was stopped and decided the batch again), so that machine
    is sent a STOP before the task starts where it is placed now (its agent would also stop it once it reads the
    free: the STOP makes it sure, and tells the log)."""
    p = ev.payload
    job = fold.job(p["job_id"])
    lost = [] if job is None else [
        (t, r["machine_id"]) for r in p["placements"] if (t := job.tasks.get(r["task_id"])) is not None
        and t.asked_again and t.request_id == p.get("request_id") and t.state == PENDING]
    if lost:
        fence = fold.work_for(p["job_id"])
        if fence is not None:  # else this free was applied already (the duplicate ring)
            for t, machine in lost:
                fence.command(replace(t, machine=machine), STOP, REASON_LOST_PLACEMENT)
        return
    w = _awaited(fold, ev, ())
    if (w is None or not lc.JOBS.allows(job_phase(w.job), JOB_FREED)
            or w.job.free_request_id != ev.payload.get("request_id")):
        return
    for tid in list(w.tasks):
        w.drop(tid)
    # and it forgets its maintenances: a deleted job is tied to no machine (only an event naming it concerns it)
    w.job_step(JOB_FREED, free_request_id=None, free_asked_ms=None, maint=(), tc_notices=(), vacating=())


def _report_trigger(t: Task, reported: str) -> str | None:
    if reported == STOPPED and t.state == STOPPING:
        return STOPPED_EV
    return REPORT_TRIGGERS.get(reported)


def _on_task_state_changed(fold: Fold, ev: Event) -> None:
    """An agent's report (one transition): as one of a TaskStatesChanged."""
    _on_task_states_changed(fold, ev)


def _on_task_states_changed(fold: Fold, ev: Event) -> None:
    """Agents' reports (STARTING, RUNNING, STOPPED, FAILED with exit_code), in order; each job of the batch
    takes it once (the batch's id joins each job's duplicate ring)."""
    for r in batches.task_reports(ev):
        w = fold.work_for(r["job_id"])
        if w is not None:
            _apply_report(w, r, r["report_id"])


def _apply_report(w: JobWork, p: Mapping[str, Any], rid: str) -> None:  # noqa: C901
    """One agent report ``p`` (a TaskStateChanged's fields; ``rid`` its id, named in what is ignored)."""
    fold = w.fold
    reported = p["state"]
    t = w.tasks.get(p["task_id"])
    if t is None:
        w.ignore(REASON_UNKNOWN_TASK, f"{rid} reports {reported} for {p['task_id']}")
        return
    machine = p.get("machine_id")
    if machine is not None and machine != t.machine and _hold_early(w, t, p, rid):
        return
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
        if state == STARTING and p.get("reason") and p["reason"] != t.reason:  # why it is not running yet (held
            w.put(replace(t, reason=p["reason"]))  # by its agent until the machine has the job's host profile)
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
    steps.advance(w, t)


def _evacuate(fold: Fold, ev: Event, machine_ids: Iterable[str], reason: str) -> None:
    """Move every task of this shard off ``machine_ids``. Machine and unavailability events are keyed to the
    machine's owner, so only that entitlement's jobs are looked at (all jobs for a free-pool key). When the
    machines enter MAINTENANCE, tasks their controller keeps running through it, or that were stopped for it
    (they start again where they are when it ends), stay."""
    spare = reason == REASON_MACHINE_MAINTENANCE
    gone = set(machine_ids)
    for job in fold.jobs():
        if job.status not in (JOB_ACTIVE, JOB_STOPPING) or not in_owner_scope(fold.entitlements(), ev, job):
            continue
        hit = [t.id for t in job.tasks.values() if t.machine in gone and t.state in ON_MACHINE
               and not (spare and (t.maint_choice == CHOICE_KEEP or t.maint_choice in HELD))]
        if not hit:
            continue
        w = fold.work_for(job.id)
        if w is None:  # applied already
            continue
        for tid in hit:
            steps.machine_lost(w, w.tasks[tid], reason)


def _on_machine_status_changed(fold: Fold, ev: Event) -> None:
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


def _on_unavailability_started(fold: Fold, ev: Event) -> None:
    if ev.payload["kind"] not in UNAVAILABLE_KINDS:
        _record_maintenance(fold, ev)  # its deadline is enforced by the timer (``retry_unplaced``)
        _advance_notice(fold, ev)  # controllers hear of it now and choose (TaskControlAcked maintenance_choices)
        return
    for mid in ev.payload["machine_ids"]:
        fold.set_down(mid, ev.payload["kind"])
    _evacuate(fold, ev, ev.payload["machine_ids"], REASON_MACHINE_FAILED)


def _jobs_in_scope(fold: Fold, ev: Event) -> list[Job]:
    """Active jobs an event keyed to a machine owner concerns: that entitlement's (every job for a free-pool key)."""
    return [job for job in fold.jobs() if job.status == JOB_ACTIVE and in_owner_scope(fold.entitlements(), ev, job)]


def _record_maintenance(fold: Fold, ev: Event) -> None:
    """Every active job with tasks on the machines remembers the maintenance: its machines and deadline; and, when
    the machines must be left (``vacate``: a loan revoked, processors/resourcebroker/loans.py), that its tasks leave
    them whatever their controller would choose."""
    p = ev.payload
    gone = frozenset(p["machine_ids"])
    deadline = p.get("deadline_ms")
    deadline = p["start_ms"] if deadline is None else deadline
    for job in _jobs_in_scope(fold, ev):
        if any(m.unavailability_id == p["unavailability_id"] for m in job.maint) or not any(
                t.machine in gone for t in job.tasks.values()):
            continue
        w = fold.work_for(job.id)
        if w is not None:
            w.set(quiet=True, maint=(*w.job.maint, Maintenance(p["unavailability_id"], tuple(sorted(gone)),
                                                                p["start_ms"], deadline, enforced=False)))
            if p.get("vacate"):
                w.set(quiet=True, vacating=(*w.job.vacating, p["unavailability_id"]))


def _on_unavailability_ended(fold: Fold, ev: Event) -> None:
    """A maintenance is over: its machines still in MAINTENANCE are UP (the Resource Broker says so on
    ``machines`` too, but the two topics are not ordered), tasks stopped for it start again where they are (a task
    whose machine is down meanwhile, e.g. failed, moves), kept ones are ordinary again, the job forgets the
    notice."""
    ue = ev.payload["unavailability_id"]
    for mid in ev.payload["machine_ids"]:  # over: a machine still down here for what a UE says (MAINTENANCE, or
        # FAILURE/POWER: ``_on_unavailability_started``) is UP. Its status change is on another topic, not ordered
        # with this one: an UP read before the UnavailabilityStarted it ends left the machine down for good, and
        # each placement the allocator (which had it UP) made there was moved off again at once (a shadow replay
        # of a power loss then power back spun forever, 2026-11-28)
        if fold.is_down(mid) and fold.down_status(mid) in UE_DOWN_STATUSES:
            fold.set_down(mid, None)
    for job in _jobs_in_scope(fold, ev):
        if not any(m.unavailability_id == ue for m in job.maint) and not any(t.maint_ue == ue for t in job.tasks.values()):
            continue
        w = fold.work_for(job.id)
        if w is None:
            continue
        w.set(quiet=True, maint=tuple(m for m in w.job.maint if m.unavailability_id != ue),
              tc_notices=tuple(n for n in w.job.tc_notices if n[0] != ue),
              vacating=tuple(u for u in w.job.vacating if u != ue))
        for t in w.ordered():
            if t.maint_ue != ue:
                continue
            held = t.maint_choice in HELD and t.state in (FAILED, STOPPED)
            t = w.put(replace(t, **w.choice_fields(t, MAINTENANCE_ENDED)))
            if held:
                steps.start_again(w, replace(t, restarts=0), START, REASON_MAINTENANCE_ENDED)


def _advance_notice(fold: Fold, ev: Event) -> None:
    """Planned maintenance: every job of the machines' entitlement with a TaskController and tasks on them is
    told in its next request (sent at once): which tasks, from when, until which deadline."""
    p = ev.payload
    gone = set(p["machine_ids"])
    for job in fold.jobs():
        if job.status != JOB_ACTIVE or not job.spec.controller or not in_owner_scope(fold.entitlements(), ev, job):
            continue
        hit = tuple(t.id for t in job.tasks.values() if t.machine in gone)
        if not hit or any(n[0] == p["unavailability_id"] for n in job.tc_notices):
            continue
        w = fold.work_for(job.id)
        if w is None:
            continue
        notice = (p["unavailability_id"], hit, p["start_ms"], p.get("deadline_ms"), p.get("expected_duration_ms"))
        w.set(quiet=True, tc_notices=(*w.job.tc_notices, notice), tc_notice_new=True)


def _on_task_control_acked(fold: Fold, ev: Event) -> None:
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
    steps.apply_choices(w, ev, tc.choices_of(p))
    approved: set[str] = set(p["approved_operation_ids"])
    if not approved:
        return
    stale = []
    for t in w.ordered():
        if t.op_state == OP_PENDING and t.op_id in approved:
            if t.id in down_when_asked and t.state == RUNNING:
                stale.append(t.op_id)  # "it is down, taking it costs nothing" no longer holds: ask again
                continue
            w.op_step(t, OP_ACKED)  # performed by ``steps.drain_ops`` as the decision closes
    if stale:
        w.ignore(tc.REASON_RECOVERED_SINCE_ASKED, f"{ev.event_id} approved {', '.join(stale)} while the request "
                                                   "said the task was down; it runs again")
        w.ask = True


def _on_rebalance_planned(fold: Fold, ev: Event) -> None:
    """RebalancePlanned (the ReBalancer's plan, processors/rebalancer): each move of a job of this shard becomes a
    MOVE operation of its running task (reason ``REASON_REBALANCE``, ``move_to`` its target), approved by the job's
    TaskController like any operation, performed within max_unavailable and the limiter (``steps.try_perform``: out of
    discovery and STOP), then placed on the target avoiding the source (``steps.advance``, intent RELOCATE; the
    allocator places it elsewhere if the target no longer passes every filter), complete once it runs there. Refused
    moves are answered by one IntentRefused per job (the reason of its first refused move, every refused task and why
    in the message). A move not performed yet is moot once the task no longer runs on its machine (the ordinary paths
    move it), or the job stops or starts an update (``steps.op_moot``)."""
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
            if t is None:
                refused.append((mv["task_id"], REASON_UNKNOWN_TASK))
            elif (why := _move_refusal(w, t, mv)) is not None:
                refused.append((mv["task_id"], why))
            else:
                steps.try_perform(w, w.new_op(t, OP_MOVE, REASON_REBALANCE, move_to=mv["to_machine_id"]))
        if refused:
            _refused_moves(fold, ev, job_id, refused)


def _move_refusal(w: JobWork, t: Task, move: Mapping[str, Any]) -> str | None:
    """Why a planned ``move`` of the job's task ``t`` cannot become an operation now (None: it can)."""
    job = w.job
    if job.status != JOB_ACTIVE or job.updating:
        return REASON_MOVE_JOB_NOT_RUNNING
    if t.machine != move["from_machine_id"]:
        return REASON_MOVE_NOT_ON_SOURCE
    if t.state != RUNNING or t.intent != RUN or w.fold.is_down(t.machine):
        return REASON_MOVE_TASK_NOT_RUNNING
    if t.op is not None:
        return REASON_MOVE_TASK_BUSY
    if t.maint_choice is not None or any(t.machine in m.machine_ids for m in job.maint):
        return REASON_MOVE_UNDER_MAINTENANCE
    return None


def _refused_moves(fold: Fold, ev: Event, job_id: str, refused: list[tuple[str, str]]) -> None:
    listed = ", ".join(f"{task} {why}" for task, why in refused[:50])
    more = f" (+{len(refused) - 50} more)" if len(refused) > 50 else ""
    fold.emit("IntentRefused", ev.entitlement, job_id, {
        "intent_type": ev.type, "intent_event_id": ev.event_id, "job_id": job_id, "reason": refused[0][1],
        "message": f"plan {ev.payload['plan_id']}: {len(refused)} moves of job {job_id} not made: {listed}{more}"},
        "refused", ev.event_id, job_id)


Handler = Callable[[Fold, Event], None]

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


# -- what an event concerns: the slice of the state a shard loads to decide it -------------------------------------

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
    """The machines of a job's remembered maintenances (``Job.maint`` or its record's ``maint``: lists)."""
    return {m for entry in maint for m in Maintenance(*entry).machine_ids}


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


def is_dormant(job: Job) -> bool:
    """A deleted job with no task and no maintenance remembered: ``concerned_jobs`` names it only for an event that
    names it (it is on no machine), and the timer never acts on it (but ``collect``, once its grace passed). A region
    that holds many (a stopped job stays for its grace, for ``job status`` and its duplicate ring) may keep them
    undecoded until an event names one (``processors/history``: a snapshot's deleted jobs)."""
    return job.deleted and not job.tasks and not job.maint


# -- stopped jobs leave: the grace ------------------------------------------------------------------------------

def is_expired(job: Job, now_ms: int, gc_ms: int) -> bool:
    """Whether ``job`` ended (stopped and freed, or rejected: ``lifecycle.JOB_ENDED``) ``gc_ms`` or more before
    ``now_ms``: it is gone, whether ``collect`` took it out of the state yet or not."""
    return ended_before(job_phase(job), job.ended_ms, now_ms, gc_ms)


def ended_before(phase: str, ended_ms: int | None, now_ms: int, gc_ms: int) -> bool:
    """``is_expired`` of a job in ``phase`` that ended at ``ended_ms`` (a stored header is asked without decoding
    it: ``store.expired``). A job ended before ``ended_ms`` was kept (a record without it) counts as ended at 0:
    gone at the first look (a region upgraded in place drops the deleted jobs it kept for ever)."""
    return phase in lc.JOB_ENDED and now_ms - (ended_ms or 0) >= gc_ms


def collect(state: SchedulerState, now_ms: int, gc_ms: int = DEFAULT_JOB_GC_MS,
            job_ids: Iterable[str] | None = None) -> tuple[SchedulerState, list[str]]:
    """The timer's garbage collection: the jobs (of ``job_ids``; default every job) whose grace passed
    (``is_expired``) leave the state (``lifecycle``: ended --collected--> gone); returns the new state and their ids,
    sorted (the shard deletes their stored form and writes tombstones for them to ``state.jobs``/``state.tasks``).
    Nothing of a decision depends on whether it ran: ``decide`` takes an expired job for gone anyway."""
    gone = sorted(j for j in (state.jobs if job_ids is None else job_ids)
                  if (job := state.jobs.get(j)) is not None and is_expired(job, now_ms, gc_ms)
                  and lc.JOBS.next_state(job_phase(job), lc.JOB_COLLECTED) == lc.JOB_GONE)
    if not gone:
        return state, []
    return dataclasses.replace(state, jobs=state.jobs.without(gone)), gone


def is_own(event: Event) -> bool:
    """Whether the scheduler produced ``event`` (its events come back on the topics it reads)."""
    return event.producer == PRODUCER or event.producer.startswith(PRODUCER + "/")


# -- decisions -----------------------------------------------------------------------------------------------------

def decide(state: SchedulerState, event: Event, now_ms: int, *, limits: Limits = DEFAULT_LIMITS,
           max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB, gc_ms: int = DEFAULT_JOB_GC_MS
           ) -> tuple[SchedulerState, list[Event]]:
    """Apply one decoded input event: the new state and the events to produce (in order).

    Event types outside ``CONSUMED`` and the scheduler's own events change nothing. An event id already in the
    job's duplicate ring changes nothing and emits nothing. Emitted ids are ``derived_event_id`` of the input's
    id and a discriminator; ``causation_id`` is the input's id; ``timestamp_ms`` is ``now_ms``.

    A job the event names whose grace passed (``is_expired``) is decided as gone, held or not: the decision is the
    same whenever ``collect`` takes it out (the shard's timer, the history never). It is left in the state as it was
    unless the decision made a new job of its id (a new incarnation).
    """
    handler = HANDLERS.get(event.type)
    if handler is None or is_own(event):
        return state, []
    hidden = {j: job for j in named_jobs(event) if (job := state.jobs.get(j)) is not None
              and is_expired(job, now_ms, gc_ms)}
    seen = dataclasses.replace(state, jobs=state.jobs.without(hidden)) if hidden else state
    fold = Fold(seen, now_ms, event, limits=limits, max_tasks=max_tasks)
    handler(fold, event)
    new, out = fold.result(steps.close)
    if new is seen:
        return state, out  # nothing changed (the state as it came, hidden jobs and all)
    if hidden:
        new = dataclasses.replace(new, jobs=new.jobs.updated({j: job for j, job in hidden.items()
                                                              if j not in new.jobs}))
    return new, out


def decide_all(state: SchedulerState, events: Iterable[Event], now_ms: int, *, limits: Limits = DEFAULT_LIMITS,
               max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB, gc_ms: int = DEFAULT_JOB_GC_MS
               ) -> tuple[SchedulerState, list[Event]]:
    """``decide`` over many events in order (replaying a log): the final state and everything emitted."""
    out: list[Event] = []
    for ev in events:
        state, emitted = decide(state, ev, now_ms, limits=limits, max_tasks=max_tasks, gc_ms=gc_ms)
        out.extend(emitted)
    return state, out


def has_timer_work(job: Job) -> bool:
    """Whether ``retry_unplaced`` may have something to do for ``job``, at some time: a job retry_unplaced passes
    over at every ``now_ms`` is one this says False of (``timer_due_ms`` None)."""
    return timer_due_ms(job) is not None


def timer_due_ms(job: Job) -> int | None:
    """From when ``retry_unplaced`` may have something to do for ``job``: 0 (at once) for an active or stopping job
    (a stopping job's stops wait for tokens too) with a planned maintenance not ended (its deadline), a task parked
    by an AllocationRejected, or operations open or throttled (tokens, a TaskController to ask again); else the
    first time a task awaiting its agent's report is due to be commanded again (``steps.RECOMMAND_MS`` after its
    command), a task awaiting its placement or a stopped job awaiting its free's answer due to be asked again
    (``steps.ANSWER_WAIT_MS`` after the request); None: nothing, ever, until a decision changes the job. The shard
    keeps it in each job's header (``store.plan``), so its timer loads only the jobs due: not every job in flight at
    each round."""
    if steps.frees_unanswered(job):
        return steps.free_due_ms(job)
    if job.status not in (JOB_ACTIVE, JOB_STOPPING):
        return None
    if (job.ops_open or job.throttled or any(not m.enforced for m in job.maint)
            or (job.status == JOB_ACTIVE and any(t.parked for t in job.tasks.values()))):
        return 0
    due = [at for t in job.tasks.values() if (at := steps.report_due_ms(t)) is not None]
    if job.status == JOB_ACTIVE:
        due += [at for t in job.tasks.values() if (at := steps.answer_due_ms(t)) is not None]
    return min(due) if due else None


def retry_unplaced(state: SchedulerState, now_ms: int, *, limits: Limits = DEFAULT_LIMITS
                   ) -> tuple[SchedulerState, list[Event]]:
    """The timer's decision: stop what remains on machines whose planned maintenance reached its deadline
    (``steps.enforce_deadlines``); ask again to place every task left unplaced by an AllocationRejected (one request
    per job); perform operations the rate limiter held back, as far as it now allows; ask a TaskController
    again after ``REASK_MS`` without an answer (a lost request or ack) or with operations still pending; command
    again a task left STARTING or STOPPING ``steps.RECOMMAND_MS`` with no report (``steps.command_again``); ask again
    for an answer ``steps.ANSWER_WAIT_MS`` overdue (``steps.ask_again``). Ids derive from the request ids, the
    operation ids and ``now_ms``, so a repeat from the same state emits the same events."""
    fold = Fold(state, now_ms, None, id_root=f"{PRODUCER}/retry/{now_ms}", limits=limits)
    for job_id in sorted(state.jobs):
        job = state.jobs[job_id]
        if not has_timer_work(job):
            continue
        if any(not m.enforced and m.deadline_ms <= now_ms for m in job.maint):
            steps.enforce_deadlines(fold.work_of(job))
        if job.status == JOB_ACTIVE and any(t.parked for t in job.tasks.values()):
            fold.work_of(job).retry_parked(paced=True)  # restarts take a shard token (work.retry_parked)
        if steps.answer_overdue(job, now_ms):
            steps.ask_again(fold.work_of(job))
        if any(steps.command_due(t, now_ms) for t in job.tasks.values()):
            w = fold.work_of(job)
            for t in list(w.tasks.values()):
                steps.command_again(w, t)
        if job.ops_open or job.throttled:
            w = fold.work_of(job)  # its finish drains what is approved
            if (job.status == JOB_ACTIVE and job.spec.controller and job.tc_asked_ms is not None
                    and now_ms - job.tc_asked_ms >= REASK_MS
                    and (job.tc_outstanding or any(t.op_state == OP_PENDING for t in job.tasks.values()))):
                w.ask = True
    return fold.result(steps.close)
