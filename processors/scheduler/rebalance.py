"""A ReBalancer plan's moves in the scheduler shard: each one a MOVE operation of a running task. Pure.

The hooks in ``decide.py`` call these (this module imports ``decide`` only inside its functions: ``decide``
imports it at load time).

```
 RebalancePlanned (intents, keyed by the entitlement)
   each move of a job of this shard: refused (one IntentRefused per job, reason and the tasks) unless the job is
   active and not updating, the task RUNNING on the plan's source, with no other operation and under no maintenance
     │
     ▼
   MOVE operation (reason rebalance, task.move_to = the target) ──TaskControlAcked (job with a controller)──► approved
     │  performed when a unit of max_unavailable is free and the limiter gives a token (as an UPDATE is)
     ▼
   out of service discovery, STOP (intent relocate) ─► agent STOPPED ─► PENDING ─► AllocationRequested: free and
   place the task, avoid_machine_ids = its source, target_machine_ids = {task: target}
     │  the allocator places it on the target if the target passes every filter and fits, else wherever placement
     ▼  puts it (never on the source)
   START there ─► RUNNING: the operation is complete (reported to the controller in its next request)
```

An operation not performed yet is moot once the task is no longer RUNNING on its machine (it failed, its machine
was lost: the ordinary paths move it), or the job stops or starts an update.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from processors.scheduler.lifecycle import FAILED, RUNNING, STOPPED, STOPPING
from processors.taskcontrol.protocol import OP_MOVE
from streams.events import Event

if TYPE_CHECKING:  # decide imports this module; these names are only for annotations
    from processors.scheduler.decide import Task, _Fold, _JobWork

REASON_REBALANCE = "rebalance"  # a MOVE of a running task planned by the ReBalancer (op_reason, task reason)
# Why a planned move is refused (IntentRefused.reason of the RebalancePlanned, per job).
REASON_MOVE_JOB_NOT_RUNNING = "job_not_running"  # the job is stopping, rejected or updating
REASON_MOVE_NOT_ON_SOURCE = "not_on_source"  # the task is no longer on the plan's source machine
REASON_MOVE_TASK_NOT_RUNNING = "task_not_running"
REASON_MOVE_TASK_BUSY = "task_busy"  # another operation (update, move, restart, stop) is wanted on it
REASON_MOVE_UNDER_MAINTENANCE = "under_maintenance"  # its machine is under a planned maintenance of the job


def refusal(w: "_JobWork", t: "Task | None", move: dict[str, Any]) -> str | None:
    """Why ``move`` cannot become an operation now (None: it can)."""
    from processors.scheduler import decide as d

    if t is None:
        return d.REASON_UNKNOWN_TASK
    job = w.job
    if job.status != d.JOB_ACTIVE or job.updating:
        return REASON_MOVE_JOB_NOT_RUNNING
    if t.machine != move["from_machine_id"]:
        return REASON_MOVE_NOT_ON_SOURCE
    if t.state != RUNNING or t.intent != d.RUN or w.fold.is_down(t.machine):
        return REASON_MOVE_TASK_NOT_RUNNING
    if t.op is not None:
        return REASON_MOVE_TASK_BUSY
    if t.maint_choice is not None or any(t.machine in machines for _, machines, *_ in job.maint):
        return REASON_MOVE_UNDER_MAINTENANCE
    return None


def on_planned(fold: "_Fold", ev: Event) -> None:
    """RebalancePlanned: a MOVE operation per move of this shard's jobs; refused moves are answered by one
    IntentRefused per job (the reason of its first refused move, every refused task and why in the message)."""
    from processors.scheduler import decide as d

    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for mv in ev.payload["moves"]:
        by_job[mv["job_id"]].append(mv)
    for job_id in sorted(by_job):
        job = fold.job(job_id)
        if job is None:
            continue  # not this shard's job (or gone): nothing to do here
        if job.entitlement != ev.entitlement:
            _refused(fold, ev, job_id, [(mv["task_id"], d.REASON_ENTITLEMENT_MISMATCH) for mv in by_job[job_id]])
            continue
        w = fold.work_for(job_id)
        if w is None:
            continue  # applied already
        refused = []
        for mv in by_job[job_id]:
            t = w.tasks.get(mv["task_id"])
            why = refusal(w, t, mv)
            if why is not None:
                refused.append((mv["task_id"], why))
                continue
            d._try_perform(w, w.new_op(t, OP_MOVE, REASON_REBALANCE, move_to=mv["to_machine_id"]))
        if refused:
            _refused(fold, ev, job_id, refused)


def _refused(fold: "_Fold", ev: Event, job_id: str, refused: list[tuple[str, str]]) -> None:
    listed = ", ".join(f"{task} {why}" for task, why in refused[:50])
    more = f" (+{len(refused) - 50} more)" if len(refused) > 50 else ""
    fold.emit("IntentRefused", ev.entitlement, job_id, {
        "intent_type": ev.type, "intent_event_id": ev.event_id, "job_id": job_id, "reason": refused[0][1],
        "message": f"plan {ev.payload['plan_id']}: {len(refused)} moves of job {job_id} not made: {listed}{more}"},
        "refused", ev.event_id, job_id)


def moot(w: "_JobWork", t: "Task") -> bool:
    """Whether a planned move not performed yet no longer applies."""
    from processors.scheduler import decide as d

    return (t.state != RUNNING or t.intent != d.RUN or w.fold.is_down(t.machine) or w.job.updating
            or t.maint_choice is not None)


def perform(w: "_JobWork", t: "Task", budget: list[int]) -> "Task":
    """The move's turn came (a unit of max_unavailable, a token): out of discovery and STOP; placed once stopped."""
    from processors.scheduler import decide as d

    budget[0] -= 1
    t = w.put(d.replace(t, op_state=d.OP_RUNNING))
    return d._stop(w, d.replace(t, intent=d.RELOCATE, reason=REASON_REBALANCE), REASON_REBALANCE)


def advance(w: "_JobWork", t: "Task") -> None:
    """A task stopped to be relocated: once down, free its placement and place it on its target (never back on
    the machine it leaves)."""
    from processors.scheduler import decide as d

    if t.state == STOPPING:
        return
    if t.state in (STOPPED, FAILED):
        d._move(w, d.replace(t, intent=d.RUN), REASON_REBALANCE, avoid=t.machine)
