"""What a task or an operation does next: the steps the scheduler's handlers (``decide.py``) take on one job's
working copy (``work.JobWork``), and ``close``, the steps every decision takes on each job it touched. Pure: no I/O.

* **task steps** (``advance``, ``advance_retiring``, ``stop``, ``start_again``, ``move``, ``machine_lost``): what a
  task's intent (run, retire, update, relocate) asks of it in its state; the restart policy (``MAX_RESTARTS``).
* **rolling update and resize** (``progress_update``, ``resize``).
* **operations** (UPDATE, MOVE, RESTART, STOP; processors/taskcontrol): approved by the job's TaskController
  (``ask_controller``), performed within max_unavailable and the rate limiter (``try_perform``, ``drain_ops``),
  dropped when moot (``op_moot``); a ReBalancer move is a MOVE with a target (``move_to``).
* **planned maintenance** (``open_notices``, ``apply_choices``, ``enforce_deadlines``).
"""
from __future__ import annotations

from collections.abc import Iterable

from processors.agent.hostprofile import REASON_HOST_PROFILE_FAILED
from processors.scheduler import versions as vs
from processors.scheduler.lifecycle import (
    ALLOCATED, CHOSEN, DEADLINE_HELD, DEADLINE_MOVED, FAILED, HELD_AT_DEADLINE, JOB_ACTIVE, JOB_STOPPED, JOB_STOPPING,
    MACHINE_FAILED, MOVED_OFF, OP_ACKED, OP_APPROVED, OP_PENDING, OP_PERFORMED, OP_RUNNING, PENDING, RESCHEDULED,
    RESTART_COMMANDED, RUNNING, STARTING, START_COMMANDED, STOPPED, STOPPING, STOP_COMMANDED,
)
from processors.scheduler.model import (
    HELD, LEAVING, RELOCATE, RETIRE, RUN, UPDATE, Job, Task, replace, task_id,
)
from processors.scheduler.reasons import (
    REASON_CHOICE_TOO_LATE, REASON_COMMAND_REPEATED, REASON_MACHINE_FAILED, REASON_MACHINE_MAINTENANCE,
    REASON_MAINTENANCE_DEADLINE, REASON_MAINTENANCE_STOP, REASON_MUST_VACATE, REASON_NOT_UNDER_NOTICE, REASON_PLACED, REASON_REBALANCE,
    REASON_RESIZED, REASON_RESTART_LIMIT, REASON_RESTART_POLICY, REASON_ROLLING_UPDATE,
)
from processors.scheduler.work import JobWork
from processors.taskcontrol import limiter
from processors.taskcontrol import protocol as tc
from processors.taskcontrol.protocol import (
    CHOICE_KEEP, CHOICE_MOVE, CHOICE_STOP, CONTROLLED, OP_MOVE, OP_RESTART, OP_STOP, OP_UPDATE,
)
from streams.enums import TaskCommand
from streams.events import Event

MAX_RESTARTS = 3  # restarts in place of a task that crashed or exited on a healthy machine, then it stays down
RESTART_RESET_MS = 10 * 60_000  # a task that ran this long before it went down starts with a fresh restart budget
THROTTLED_LISTED = 1_000  # OperationsThrottled lists at most this many waiting operations (waiting_count: all)
TC_PENDING_PER_REQUEST = 2_000  # a TaskControlRequested asks about at most this many pending operations
RECOMMAND_MS = 30_000  # a task left STARTING or STOPPING this long with no report is commanded again (the timer)
ANSWER_WAIT_MS = 60_000  # an allocation request this long without an answer is made again (the timer): a minute, as a
# region coming back from a power loss or a 20,000-task placement may take tens of seconds to answer; each repeat
# costs the allocator a decision

# Task commands: the TaskCommand symbols of schemas/TaskCommanded.avsc.
START = TaskCommand.START
STOP = TaskCommand.STOP
RESTART = TaskCommand.RESTART


# -- closing a decision --------------------------------------------------------------------------------------------

def close(w: JobWork) -> Job:
    """The steps every decision takes on each job it touched, before ``JobWork.finish``: an active job's rolling
    update goes on, its approved operations are performed as the limiter allows, its TaskController is asked what
    is new, its AllocationRequested sent; a stopping job's stops are performed as the limiter allows, and once all
    its tasks are stopped their placements are asked to be freed."""
    w.count_ops()
    if w.job.status == JOB_ACTIVE:
        progress_update(w)
        drain_ops(w)
        ask_controller(w)
        w.flush_request()
    elif w.job.status == JOB_STOPPING:
        drain_ops(w)  # its stops wait for the limiter like any other
        w.finish_stop()
    return w.finish()


# -- task steps: what each intent does next ------------------------------------------------------------------------

def advance(w: JobWork, t: Task) -> None:  # noqa: C901
    """Take the next step for ``t`` given its state and intent (after something happened to it)."""
    if t.intent == RETIRE:
        advance_retiring(w, t)
        return
    if t.op == OP_STOP and t.state not in (STARTING, RUNNING):  # went down before its stop's token came
        t = w.end_op(t)
    if t.maint_choice is not None and t.state in (FAILED, STOPPED) and t.op_state != OP_RUNNING:
        if t.maint_choice in HELD:  # stopped for a maintenance: waits for its end (UnavailabilityEnded)
            if t.intent != RUN:
                w.put(replace(t, intent=RUN))
            return
        if t.maint_choice == CHOICE_MOVE:  # stopped to move off before the maintenance: placed elsewhere
            move(w, replace(t, intent=RUN), REASON_MACHINE_MAINTENANCE, avoid=t.machine)
            return
    if t.intent == RELOCATE:  # a ReBalancer move: once down, freed and placed on its target (never back on its source)
        if t.state in (STOPPED, FAILED):
            move(w, replace(t, intent=RUN), REASON_REBALANCE, avoid=t.machine)
        return
    if t.intent == UPDATE:
        if t.state == STOPPING:
            return
        t = w.put(replace(t, intent=RUN))
        if t.state == STOPPED:  # stopped for the update: start the job's spec version
            start_again(w, t, START, t.reason or REASON_ROLLING_UPDATE)
            return
    if t.state == PENDING:
        if t.request_id is None and not t.parked:
            w.place[t.id] = None
    elif t.state == ALLOCATED:
        if w.fold.is_down(t.machine):  # placed on a machine that failed meanwhile (the allocator raced the news)
            machine_lost(w, t, REASON_MACHINE_FAILED)
        else:
            t = w.step(t, START_COMMANDED, spec_version=w.wanted(t))
            w.command(t, START, REASON_PLACED)
    elif t.state in (FAILED, STOPPED):  # went down on its own: the restart policy
        if t.op_state == OP_RUNNING:  # down again during an approved update or move: it carries on
            if w.fold.is_down(t.machine):
                move(w, t, REASON_MACHINE_FAILED, avoid=t.machine)
            elif t.restarts < MAX_RESTARTS:
                start_again(w, replace(t, restarts=t.restarts + 1), RESTART, REASON_RESTART_POLICY)
            else:
                w.end_op(w.put(replace(t, reason=REASON_RESTART_LIMIT)))
        elif w.fold.is_down(t.machine) or t.reason == REASON_HOST_PROFILE_FAILED:  # the machine cannot run it
            try_perform(w, w.new_op(t, OP_MOVE, t.reason if t.reason == REASON_HOST_PROFILE_FAILED
                                     else REASON_MACHINE_FAILED))
        elif t.restarts < MAX_RESTARTS:
            try_perform(w, w.new_op(t, OP_RESTART, REASON_RESTART_POLICY))
        else:
            w.put(replace(t, reason=REASON_RESTART_LIMIT))


def advance_retiring(w: JobWork, t: Task) -> None:
    """A retired task (shrink, job stop): one that runs is stopped through the limiter (an OP_STOP: it goes on
    running, and serving, until its token comes); one that does not is stopped at once; once stopped it is freed
    (with the job's other tasks, for a stopping job)."""
    waits = t.op == OP_STOP and t.state in (STARTING, RUNNING)
    if t.op is not None and not waits:  # whatever was wanted of it is moot now
        t = w.end_op(t)
    if t.state in (STARTING, RUNNING):
        try_perform(w, t if waits else w.new_op(t, OP_STOP, t.reason or REASON_RESIZED))
        return
    if t.state in (PENDING, ALLOCATED, FAILED):  # nothing runs: stopped at once
        held = t.machine is not None or t.request_id is not None
        w.place.pop(t.id, None)
        t = w.step(t, STOP_COMMANDED, emit_reason=t.reason, request_id=None, request_terms=None, parked=False)
        if not held and w.job.status == JOB_ACTIVE:
            w.drop(t.id)  # never placed nor asked for: nothing to free
            return
    if t.state == STOPPED and w.job.status == JOB_ACTIVE:  # a stopping job frees all at once (``finish_stop``)
        w.free[t.id] = None
        w.drop(t.id)


def stop(w: JobWork, t: Task, reason: str) -> Task:
    """STOP a STARTING/RUNNING task: out of service discovery first, then the command (→ STOPPING)."""
    if t.discovery:
        t = w.discovery(t, False, reason)
    t = w.step(t, STOP_COMMANDED, running_since_ms=None)
    w.command(t, STOP, reason)
    return t


def report_due_ms(t: Task) -> int | None:
    """When ``t``, commanded and waiting for its agent's report (STARTING or STOPPING on its machine), is to be
    commanded again (``RECOMMAND_MS`` after its command; ``command_again``); None if it waits for no report."""
    if t.state in (STARTING, STOPPING) and t.commanded_ms is not None and t.machine is not None:
        return t.commanded_ms + RECOMMAND_MS
    return None


def answer_due_ms(t: Task) -> int | None:
    """When ``t``'s placement, asked and not answered, is to be asked again (``ANSWER_WAIT_MS`` after the request;
    ``ask_again``); None if it awaits no placement."""
    if t.state == PENDING and t.intent == RUN and t.request_id is not None and t.asked_ms is not None:
        return t.asked_ms + ANSWER_WAIT_MS
    return None


def free_due_ms(job: Job) -> int | None:
    """When a stopped job's free request, not answered, is to be made again (``ask_again``); None if the job
    awaits no such answer."""
    if not frees_unanswered(job):
        return None
    return 0 if job.free_asked_ms is None else job.free_asked_ms + ANSWER_WAIT_MS


def due(at_ms: int | None, now_ms: int) -> bool:
    """Whether a repair due at ``at_ms`` (None: none) is due by ``now_ms``."""
    return at_ms is not None and at_ms <= now_ms


def command_due(t: Task, now_ms: int) -> bool:
    """Whether ``t`` has waited ``RECOMMAND_MS`` for its agent's report (``command_again``)."""
    return due(report_due_ms(t), now_ms)


def command_again(w: JobWork, t: Task) -> None:
    """The timer's repair of a lost report: ``t`` left STARTING or STOPPING ``RECOMMAND_MS`` with nothing from its
    agent is sent its command again under a new id (a START of its spec version, or a STOP). The agent answers a
    command it has not seen from where the task is: a START of the run it has RUNNING is reported RUNNING again
    (``already_running``), a STOP of a run it stopped is reported STOPPED again (``already_stopped``); a START it
    never got starts the task. How it is lost: a shard stopped between producing a decision and storing it decides
    the batch again from the older state, and may read the agent's report of the first decision's command before
    that command's cause (the report is then ignored, and its record passed: RELIABILITY.md, the kill storm).
    Edge-triggered reports are repaired by this level-triggered retry, as a kubelet's or a Nomad client's status
    sync would. A task whose machine is down is left to the machine's failure (``machine_lost``)."""
    if not command_due(t, w.fold.now) or w.fold.is_down(t.machine):
        return
    w.command(w.put(replace(t, commanded_ms=w.fold.now)), START if t.state == STARTING else STOP,
              REASON_COMMAND_REPEATED)


def frees_unanswered(job: Job) -> bool:
    """Whether ``job`` is stopped and waits for the answer to its free request (``ask_again``)."""
    return job.status == JOB_STOPPED and not job.deleted and job.free_request_id is not None


def answer_overdue(job: Job, now_ms: int) -> bool:
    """Whether the timer asks the allocator again for ``job`` (``ask_again``)."""
    if frees_unanswered(job):
        return due(free_due_ms(job), now_ms)
    return job.status == JOB_ACTIVE and any(due(answer_due_ms(t), now_ms) for t in job.tasks.values())


def ask_again(w: JobWork) -> None:
    """The timer's repair of a lost answer: a request ``ANSWER_WAIT_MS`` without its answer is made again, as a new
    request. How one is lost: a shard stopped between producing a decision and storing it decides the batch again
    from the older state; it may read the allocator's answer to the request that decision made before it makes it
    again (the answer then concerns no task, and its record is passed), and the request it makes again is the same
    event, which the allocator answered already and does not answer twice. A task left PENDING so is asked to be
    freed and placed (a move: wherever the lost answer put it, it is freed first, so it is never placed twice; the
    old answer, if it comes, is stale; the machine the free names is sent a STOP, ``decide._on_tasks_deallocated``:
    the decision that read the lost answer may have started it there); a stopped job's free request is made again
    (its tasks hold nothing any more: the allocator answers that it freed nothing), and the job is deleted on that
    answer (the kill storm's "stopped: want it gone" and tasks left PENDING)."""
    now = w.fold.now
    if frees_unanswered(w.job):
        if due(free_due_ms(w.job), now):
            w.ask_free()
        return
    if w.job.status != JOB_ACTIVE:
        return
    for t in w.ordered():
        if due(answer_due_ms(t), now):
            w.free[t.id] = None
            w.place[t.id] = None  # asked in the decision's AllocationRequested (``JobWork.flush_request``)
            w.asked_again.add(t.id)


def start_again(w: JobWork, t: Task, command: str, reason: str) -> None:
    """Start a FAILED/STOPPED task at the job's spec version on the machine it holds if it is up and its
    placement fits the spec (TaskCommanded ``command``); else move it."""
    if t.machine is None or w.fold.is_down(t.machine) or t.terms is None or not t.terms.fits(w.job.spec.terms):
        move(w, t, reason, avoid=t.machine if w.fold.is_down(t.machine) else None)
        return
    t = w.step(t, RESTART_COMMANDED, spec_version=w.wanted(t))
    w.command(t, command, reason)


def move(w: JobWork, t: Task, reason: str, avoid: str | None = None) -> None:
    """FAILED/STOPPED → PENDING, and ask the allocator to free its placement and place it again."""
    forget = w.choice_fields(t, MOVED_OFF) if t.maint_choice is not None else {"maint_ue": None}
    t = w.step(t, RESCHEDULED, emit_reason=reason, machine=None, dc=None, msb=None, rack=None, terms=None,
               spec_version=w.wanted(t), running_since_ms=None, reason=reason, **forget)
    w.free[t.id] = None
    w.place[t.id] = None
    if avoid is not None:
        w.avoid.add(avoid)


def machine_lost(w: JobWork, t: Task, reason: str) -> None:
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
        advance_retiring(w, t)
    elif t.op_state == OP_RUNNING:  # taken down by an approved update or move already: moved on at once
        if fence:
            w.command(t, STOP, reason)
        move(w, replace(t, intent=RUN, restarts=0), reason, avoid=machine)
    else:  # a move to approve (TaskControl) and to pace (the limiter); the fence goes with it
        try_perform(w, w.new_op(replace(t, intent=RUN, restarts=0, reason=reason), OP_MOVE, reason, fence=fence))


def progress_update(w: JobWork) -> None:  # noqa: C901
    """Rolling update: want an UPDATE operation on every task of an older spec version (approved by the job's
    TaskController if it has one); ``drain_ops`` performs them, never making more than ``max_unavailable``
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
            start_again(w, replace(t, restarts=0, reason=REASON_ROLLING_UPDATE), START, REASON_ROLLING_UPDATE)
        else:
            w.new_op(t, OP_UPDATE, REASON_ROLLING_UPDATE)


# -- operations: approved (TaskControl), then paced (max_unavailable, the rate limiter) ----------------------------

def op_moot(w: JobWork, t: Task) -> bool:
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


def try_perform(w: JobWork, t: Task, budget: list[int] | None = None) -> Task:  # noqa: C901
    """Perform ``t``'s approved operation if it is ready and the limiter allows it; an UPDATE also needs a
    unit of ``budget`` (the job's max_unavailable left; computed here if not given)."""
    if t.op_state != OP_APPROVED:
        return t
    if t.op == OP_STOP and t.state not in (STARTING, RUNNING):
        return t
    paced = None  # the budget it takes a unit of: an UPDATE or a move takes a running task down
    if t.op == OP_UPDATE or t.move_to is not None:  # max_unavailable paces them
        if t.state != RUNNING:  # not up yet (starting): taken down once it runs
            return t
        paced = budget if budget is not None else [unavailable_budget(w)]
        if paced[0] <= 0:
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
        return stop(w, replace(w.end_op(t), reason=reason), reason)
    t = w.op_step(t, OP_PERFORMED)
    if paced is not None:
        paced[0] -= 1
    if t.move_to is not None:  # a ReBalancer move: out of discovery and STOP; placed on its target once stopped
        return stop(w, replace(t, intent=RELOCATE, reason=REASON_REBALANCE), REASON_REBALANCE)
    if t.op == OP_UPDATE:
        return stop(w, replace(t, intent=UPDATE, reason=REASON_ROLLING_UPDATE), REASON_ROLLING_UPDATE)
    if t.op == OP_MOVE:
        if t.fence:
            w.command(t, STOP, t.op_reason)  # the fence: addressed to the old machine, whatever it runs now
        move(w, replace(t, fence=False), t.op_reason, avoid=t.machine)
        return w.tasks[t.id]
    t = w.end_op(t)  # RESTART: over once commanded (a machine lost meanwhile makes it a move)
    start_again(w, replace(t, restarts=t.restarts + 1), RESTART, REASON_RESTART_POLICY)
    return w.tasks[t.id]


def unavailable_budget(w: JobWork) -> int:
    return w.job.spec.max_unavailable - sum(t.state != RUNNING for t in w.tasks.values() if t.intent != RETIRE)


def drain_ops(w: JobWork) -> None:
    """Perform every approved operation that is ready, in task order, as the limiter allows; drop moot ones;
    announce what the limiter holds back (OperationsThrottled) when that changed."""
    if w.job.ops_open + w.ops_delta <= 0 and not w.job.throttled:
        return
    budget = [unavailable_budget(w)]
    for t in w.ordered():
        if t.op is None or t.op_state == OP_RUNNING:
            continue
        if op_moot(w, t):
            w.end_op(t)
        elif t.op_state == OP_PENDING and not w.job.spec.controller:  # the controller was removed
            try_perform(w, w.op_step(t, OP_ACKED), budget)
        else:
            try_perform(w, t, budget)
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


def ask_controller(w: JobWork) -> None:
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
    notices = open_notices(w)
    if job.tc_notice_new and not any(n.task_ids for n in notices):
        w.set(quiet=True, tc_notice_new=False)  # every task under notice has its choice: nothing to ask
    if not (news or w.job.tc_notice_new) and not (w.ask and (pending or job.tc_outstanding)):
        return
    completed = (*job.tc_sent_completed, *job.tc_completed) if job.tc_outstanding else job.tc_completed
    seq = job.tc_seq + 1
    req = tc.Request(
        job_id=job.id, entitlement=job.entitlement, controller=job.spec.controller, sequence=seq,
        pending=tuple(_operation(t) for t in pending),
        completed=completed,
        notices=notices,
        unhealthy=tuple(t.id for t in w.ordered() if (t.state != RUNNING or t.op == OP_STOP) and t.intent != RETIRE),
        in_flight=tuple(_operation(t).operation_id for t in w.ordered()
                        if t.op in CONTROLLED and t.op_state in (OP_APPROVED, OP_RUNNING)))
    w.emit("TaskControlRequested", job.id, tc.request_payload(req), "taskcontrol", job.id, seq)
    w.set(quiet=True, tc_seq=seq, tc_outstanding=True, tc_asked=tuple(t.op_id for t in pending),
          tc_asked_ms=w.fold.now, tc_completed=(), tc_sent_completed=completed, tc_notice_new=False,
          tc_sent_unhealthy=req.unhealthy)


def _operation(t: Task) -> tc.Operation:
    """``t``'s operation as its TaskController is told it. ``t`` has one (``op`` or ``op_state`` set):
    ``JobWork.new_op`` sets ``op``, ``op_id`` and ``op_state`` together and ``end_op`` clears them together."""
    assert t.op is not None and t.op_id is not None, f"{t.id} has op_state {t.op_state} but no operation"
    return tc.Operation(t.op_id, t.id, t.op, t.op_reason)


def open_notices(w: JobWork) -> tuple[tc.AdvanceNotice, ...]:
    """The job's open advance notices as its controller is told them: each names the tasks still on the
    maintenance's machines that await a choice (none made yet for it, not retiring), so that a task moved off,
    being stopped or kept is not asked about again."""
    machines = {m.unavailability_id: frozenset(m.machine_ids) for m in w.job.maint}
    out = []
    for ue, task_ids, start, deadline, duration in w.job.tc_notices:
        gone = machines.get(ue)
        if gone is not None:
            task_ids = tuple(t.id for t in w.ordered() if t.machine in gone and t.intent != RETIRE
                             and (t.maint_choice is None or t.maint_ue != ue))
        out.append(tc.AdvanceNotice(ue, tuple(task_ids), start, deadline, duration))
    return tuple(out)


def resize(w: JobWork, n: int, reason: str) -> None:
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
            advance(w, w.put(replace(t, intent=UPDATE, reason=reason)))
    for t in sorted(w.tasks.values(), key=lambda t: -t.index):
        if t.index >= n and t.intent != RETIRE:
            advance_retiring(w, w.put(replace(t, intent=RETIRE, reason=reason)))
    w.set(desired=n)


# -- planned maintenance: the deadline and the controllers' choices ------------------------------------------------

def enforce_deadlines(w: JobWork) -> None:
    """The timer at or after a maintenance deadline: every task still starting or running on the machines is
    taken out of service discovery and stopped (reason ``maintenance_deadline``), unless its controller chose
    to keep it running. With a controller it stays down until the maintenance ends and then starts again where
    it is; without one (the built-in policy) it moves elsewhere once stopped. Each deadline is enforced once.

    These stops take no token from the limiter (the one exception to it): the maintenance proceeds at its
    deadline whatever the buckets hold, so a throttled deadline would mean nothing. For the same reason a task
    whose stop still waits for a token (its controller chose MOVE or STOP, or it is retiring) is stopped now;
    it keeps its choice (held, or moved once stopped) or its retirement."""
    now = w.fold.now
    due = [m for m in w.job.maint if not m.enforced and m.deadline_ms <= now]
    if not due:
        return
    w.set(quiet=True, maint=tuple(m._replace(enforced=True) if m in due else m for m in w.job.maint))
    for m in due:
        ue = m.unavailability_id
        # moved off when it has no controller or must leave (a loan revoked); else held until the end
        held = DEADLINE_HELD if w.job.spec.controller and ue not in w.job.vacating else DEADLINE_MOVED
        gone = set(m.machine_ids)
        for t in w.ordered():
            if t.machine not in gone or t.maint_choice == CHOICE_KEEP or t.state not in (STARTING, RUNNING):
                continue  # elsewhere, kept running through it, down already or stopping
            if t.intent == RETIRE or t.maint_choice is not None:
                if t.op == OP_STOP:  # leaving anyway, its stop waits for a token: the deadline does not wait
                    stop(w, w.end_op(t), REASON_MAINTENANCE_DEADLINE)
                continue
            if t.op is not None and t.op_state != OP_RUNNING:
                t = w.end_op(t)  # moot: the deadline stops it
            if t.op_state == OP_RUNNING:  # under an update: it restarts on the machine only after the window
                t = w.end_op(t)
            stop(w, replace(t, intent=RUN, reason=REASON_MAINTENANCE_DEADLINE, **w.choice_fields(t, held, ue)),
                  REASON_MAINTENANCE_DEADLINE)


def apply_choices(w: JobWork, ev: Event, choices: Iterable[tc.Choice]) -> None:
    """A controller's answers to advance notices: MOVE (stop, then placed elsewhere), STOP (stopped until the
    maintenance ends), KEEP (left running through it). Choices for tasks no open notice names are ignored."""
    open_ = {m.unavailability_id: (set(m.machine_ids), m.enforced) for m in w.job.maint}
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
        t = w.put(replace(t, **w.choice_fields(t, CHOSEN[c.choice], c.unavailability_id)))
        if c.choice == CHOICE_KEEP:
            continue
        why = REASON_MAINTENANCE_STOP if c.choice == CHOICE_STOP else REASON_MACHINE_MAINTENANCE
        if t.state in (STARTING, RUNNING) and t.op_state != OP_RUNNING:  # through the limiter, like any stop
            try_perform(w, w.new_op(replace(t, reason=why), OP_STOP, why))
        elif t.state in (FAILED, STOPPED) and t.op_state != OP_RUNNING:
            advance(w, t)

