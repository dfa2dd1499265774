"""The lifecycles of the scheduler: tasks, jobs, operations and maintenance choices, each a table of its legal
transitions (h11 ``_state.py`` style). Pure: no I/O. Anything not in a table is refused by its ``Table.next_state``
(raises ``IllegalTransition``): the scheduler changes a task's state, a job's status, an operation's state or a
maintenance choice only through them (``work.JobWork``).

**Tasks.** States are the TaskState symbols of ``schemas/TaskStateChanged.avsc`` (UNKNOWN is only a reader's fallback
for a newer symbol, never a state the scheduler enters). Anything not in ``TRANSITIONS`` raises
``IllegalTransition``; ``apply()`` also recognises a duplicated event (delivery is at-least-once).
The main paths (the table below is the authority):

    PENDING --allocated--> ALLOCATED --start_commanded--> STARTING --started--> RUNNING
    RUNNING --exited_ok--> STOPPED          STARTING|RUNNING --stop_commanded--> STOPPING --stopped--> STOPPED
    STARTING|RUNNING --crashed--> FAILED    ALLOCATED|STARTING|RUNNING --machine_failed--> FAILED
    FAILED|STOPPED --rescheduled--> PENDING (reallocated; the machine it failed on is avoided)
    FAILED|STOPPED --restart_commanded--> STARTING (started again on the machine it still holds)

**Jobs** (``JOB_TRANSITIONS``; a job's phase is its ``status``, or ``deleted`` once its stop was freed):

    active --stop--> stopping --all_stopped--> stopped --freed--> deleted
    active --refused--> rejected          (its submission broke a rule: the incarnation never ran)
    rejected|deleted --resubmitted--> active (a new incarnation of the job id)
    rejected|deleted --collected--> gone     (its grace, ROPEWALK_JOB_GC_S, passed: it leaves the state)

The state JobStatePublished shows (pending, running, updating) is derived from an active job's tasks
(``model.published_state``), not a phase of its own.

**Operations** on a task (``OP_TRANSITIONS``; UPDATE, MOVE, RESTART, STOP: processors/taskcontrol; ``None`` is no
operation):

    None --asked--> pending --acked--> approved --performed--> running --ended--> None
    None --wanted--> approved (no approval to ask: no controller, or a STOP)
    pending|approved --ended--> None (moot, or done once commanded: a STOP, a RESTART after it ran)

**Planned-maintenance choices** of a task (``CHOICE_TRANSITIONS``, ``Task.maint_choice`` with ``Task.maint_ue`` the
maintenance it is for; ``None`` is no choice): its TaskController's MOVE, STOP or KEEP (a later answer may change
it), or the scheduler's at the deadline (DEADLINE: held until the end, with a controller; MOVE without one);
forgotten when the maintenance ends or the task is placed elsewhere.

    None|MOVE|STOP|KEEP --chose_move|chose_stop|chose_keep--> MOVE|STOP|KEEP
    None --deadline_held--> DEADLINE        None --deadline_moved--> MOVE
    MOVE|STOP|KEEP|DEADLINE --maintenance_ended|moved_off--> None
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from processors.taskcontrol.protocol import CHOICE_KEEP, CHOICE_MOVE, CHOICE_STOP
from streams.enums import TaskState

PENDING = TaskState.PENDING
ALLOCATED = TaskState.ALLOCATED
STARTING = TaskState.STARTING
RUNNING = TaskState.RUNNING
STOPPING = TaskState.STOPPING
STOPPED = TaskState.STOPPED
FAILED = TaskState.FAILED
STATES = (PENDING, ALLOCATED, STARTING, RUNNING, STOPPING, STOPPED, FAILED)

ALLOCATED_EV = "allocated"  # the allocator placed the task (TasksAllocated)
START_COMMANDED = "start_commanded"  # the scheduler told the agent to start it (TaskCommanded start)
STARTED = "started"  # the agent reports the process up
EXITED_OK = "exited_ok"  # the process exited with code 0 on its own
CRASHED = "crashed"  # the process exited non-zero or could not start
STOP_COMMANDED = "stop_commanded"  # the scheduler decided to stop it (job stopped, update, move)
STOPPED_EV = "stopped"  # the agent reports the process gone after a stop
MACHINE_FAILED = "machine_failed"  # the task's machine became unavailable
RESCHEDULED = "rescheduled"  # the scheduler asks for a new placement
RESTART_COMMANDED = "restart_commanded"  # started again where it is placed: restart policy, in-place update
TRIGGERS = (ALLOCATED_EV, START_COMMANDED, STARTED, EXITED_OK, CRASHED, STOP_COMMANDED, STOPPED_EV,
            MACHINE_FAILED, RESCHEDULED, RESTART_COMMANDED)

TRANSITIONS = MappingProxyType({
    (PENDING, ALLOCATED_EV): ALLOCATED,
    (PENDING, STOP_COMMANDED): STOPPED,  # never placed: nothing to stop
    (ALLOCATED, START_COMMANDED): STARTING,
    (ALLOCATED, STOP_COMMANDED): STOPPED,  # never started: the placement is simply freed
    (ALLOCATED, MACHINE_FAILED): FAILED,
    (STARTING, STARTED): RUNNING,
    (STARTING, CRASHED): FAILED,
    (STARTING, EXITED_OK): STOPPED,  # exited 0 before the agent saw it up (e.g. a short command)
    (STARTING, STOP_COMMANDED): STOPPING,
    (STARTING, MACHINE_FAILED): FAILED,
    (RUNNING, EXITED_OK): STOPPED,
    (RUNNING, CRASHED): FAILED,
    (RUNNING, STOP_COMMANDED): STOPPING,
    (RUNNING, MACHINE_FAILED): FAILED,
    (STOPPING, STOPPED_EV): STOPPED,
    (STOPPING, EXITED_OK): STOPPED,  # the exit raced the stop: stopped either way
    (STOPPING, CRASHED): STOPPED,  # killed while stopping: the stop was wanted
    (STOPPING, MACHINE_FAILED): STOPPED,  # the machine took it down: nothing left to stop
    (FAILED, RESCHEDULED): PENDING,
    (FAILED, STOP_COMMANDED): STOPPED,  # the job stops while the task awaits reallocation
    (FAILED, RESTART_COMMANDED): STARTING,  # restart policy: started again on its (healthy) machine
    (STOPPED, RESCHEDULED): PENDING,  # restarted elsewhere or as a new spec version (move, rolling update)
    (STOPPED, RESTART_COMMANDED): STARTING,  # restarted in place: after an exit, or as a new spec version
})

# -- jobs ----------------------------------------------------------------------------------------------------------
# A job's status (Job.status), and the state JobStatePublished shows of an active one (``model.published_state``).
JOB_ACTIVE = "active"
JOB_STOPPING = "stopping"  # every task is being stopped
JOB_STOPPED = "stopped"  # all stopped and their placements asked to be freed; deleted once the allocator says so
JOB_REJECTED = "rejected"  # the submission was refused (unknown entitlement, invalid spec); a new one may replace it
JOB_DELETED = "deleted"  # a phase, not a status: stopped and freed (Job.deleted; JobStatePublished "stopped", deleted)
JOB_PENDING = "pending"  # published: active, some task not RUNNING
JOB_RUNNING = "running"  # published: active, every task RUNNING
JOB_UPDATING = "updating"  # published: active, a rolling update in progress
JOB_GONE = "gone"  # a phase with no job: its grace passed, it left the state (a submission of its id starts afresh)
JOB_PHASES = (JOB_ACTIVE, JOB_STOPPING, JOB_STOPPED, JOB_DELETED, JOB_REJECTED, JOB_GONE)

JOB_STOP = "stop"  # JobStopped: every task is to stop
JOB_ALL_STOPPED = "all_stopped"  # its last task stopped: the placements are asked to be freed
JOB_FREED = "freed"  # the allocator answered the final free request (TasksDeallocated)
JOB_REFUSED = "refused"  # the submission that made it broke a rule
JOB_RESUBMITTED = "resubmitted"  # a JobSubmitted of the job id: a new incarnation
JOB_COLLECTED = "collected"  # its grace passed since it ended (``decide.collect``): it leaves the state
JOB_TRIGGERS = (JOB_STOP, JOB_ALL_STOPPED, JOB_FREED, JOB_REFUSED, JOB_RESUBMITTED, JOB_COLLECTED)

JOB_TRANSITIONS = MappingProxyType({
    (JOB_ACTIVE, JOB_STOP): JOB_STOPPING,
    (JOB_ACTIVE, JOB_REFUSED): JOB_REJECTED,  # at once: the incarnation made by the refused submission never ran
    (JOB_STOPPING, JOB_ALL_STOPPED): JOB_STOPPED,
    (JOB_STOPPED, JOB_FREED): JOB_DELETED,
    (JOB_REJECTED, JOB_RESUBMITTED): JOB_ACTIVE,
    (JOB_DELETED, JOB_RESUBMITTED): JOB_ACTIVE,
    (JOB_REJECTED, JOB_COLLECTED): JOB_GONE,
    (JOB_DELETED, JOB_COLLECTED): JOB_GONE,
})
JOB_ENDED = frozenset(phase for (phase, trigger) in JOB_TRANSITIONS if trigger == JOB_COLLECTED)  # phases with a grace

# -- operations ----------------------------------------------------------------------------------------------------
# Where a task's operation (Task.op_state: UPDATE, MOVE, RESTART, STOP; see processors/taskcontrol) stands.
OP_NONE = None  # no operation
OP_PENDING = "pending"  # awaiting the TaskController's ack
OP_APPROVED = "approved"  # acked (or no controller): performed when ready, within max_unavailable and the limiter
OP_RUNNING = "running"  # performed; completed when the task runs again (reported to the controller then)
OP_STATES = (OP_NONE, OP_PENDING, OP_APPROVED, OP_RUNNING)

OP_ASKED = "asked"  # wanted, and the job's TaskController must approve it
OP_WANTED = "wanted"  # wanted, nothing to approve (no controller, or a kind no controller approves)
OP_ACKED = "acked"  # the controller approved it (or the job no longer has one)
OP_PERFORMED = "performed"  # the limiter let it through: the task is taken down for it
OP_ENDED = "ended"  # done, or moot (reported completed to the controller if it approved it)
OP_TRIGGERS = (OP_ASKED, OP_WANTED, OP_ACKED, OP_PERFORMED, OP_ENDED)

OP_TRANSITIONS = MappingProxyType({
    (OP_NONE, OP_ASKED): OP_PENDING,
    (OP_NONE, OP_WANTED): OP_APPROVED,
    (OP_PENDING, OP_ACKED): OP_APPROVED,
    (OP_PENDING, OP_ENDED): OP_NONE,  # moot before the controller answered
    (OP_APPROVED, OP_PERFORMED): OP_RUNNING,
    (OP_APPROVED, OP_ENDED): OP_NONE,  # moot, or a STOP: over once commanded
    (OP_RUNNING, OP_ENDED): OP_NONE,  # the task runs again (or the operation became moot while it was down)
})

# -- planned-maintenance choices -----------------------------------------------------------------------------------
CHOICE_NONE = None  # no choice (no maintenance of its machine, or not chosen yet)
HELD_AT_DEADLINE = "DEADLINE"  # Task.maint_choice of a task the scheduler stopped at a maintenance deadline
CHOICE_STATES = (CHOICE_NONE, CHOICE_MOVE, CHOICE_STOP, CHOICE_KEEP, HELD_AT_DEADLINE)

CHOSE_MOVE = "chose_move"  # the job's TaskController answered the advance notice: move it off (stop, placed elsewhere)
CHOSE_STOP = "chose_stop"  # ... stop it until the maintenance ends
CHOSE_KEEP = "chose_keep"  # ... leave it running through the maintenance
CHOSEN = MappingProxyType({CHOICE_MOVE: CHOSE_MOVE, CHOICE_STOP: CHOSE_STOP, CHOICE_KEEP: CHOSE_KEEP})  # -> trigger
DEADLINE_HELD = "deadline_held"  # still on the machine at the deadline, with a controller: stopped until the end
DEADLINE_MOVED = "deadline_moved"  # still there at the deadline, no controller (or the machines must be left): moved
MAINTENANCE_ENDED = "maintenance_ended"  # UnavailabilityEnded
MOVED_OFF = "moved_off"  # placed anew elsewhere (rescheduled): no maintenance of its new machine is known
CHOICE_TRIGGERS = (CHOSE_MOVE, CHOSE_STOP, CHOSE_KEEP, DEADLINE_HELD, DEADLINE_MOVED, MAINTENANCE_ENDED, MOVED_OFF)

CHOICE_TRANSITIONS = MappingProxyType({
    **{(s, CHOSEN[c]): c for s in (CHOICE_NONE, CHOICE_MOVE, CHOICE_STOP, CHOICE_KEEP) for c in CHOSEN},
    (CHOICE_NONE, DEADLINE_HELD): HELD_AT_DEADLINE,
    (CHOICE_NONE, DEADLINE_MOVED): CHOICE_MOVE,
    **{(s, t): CHOICE_NONE for s in (CHOICE_MOVE, CHOICE_STOP, CHOICE_KEEP, HELD_AT_DEADLINE)
       for t in (MAINTENANCE_ENDED, MOVED_OFF)},
})  # HELD_AT_DEADLINE takes no controller's choice: it comes too late (steps.apply_choices ignores it, choice_too_late)

# (trigger, state) pairs where the trigger is one that can produce the state: a repeat of it is a duplicate.
_PRODUCED_BY = frozenset((trigger, target) for (_, trigger), target in TRANSITIONS.items())


class IllegalTransition(ValueError):
    """A trigger arrived in a state where the lifecycle table has no transition for it."""

    def __init__(self, state: str | None, trigger: str, table: "Table | None" = None):
        table = TASKS if table is None else table
        self.state, self.trigger, self.what = state, trigger, table.what
        legal = sorted(t for s, t in table.transitions if s == state)
        super().__init__(f"illegal {table.what} transition: {trigger!r} in state {state!r}; "
                         f"legal triggers there: {', '.join(legal) or 'none'}")


class Table:
    """One lifecycle: what it is of (``what``, named in errors), its states, its triggers and its transitions."""

    def __init__(self, what: str, states: tuple, triggers: tuple, transitions: Mapping[tuple, Any]):
        self.what, self.states, self.triggers, self.transitions = what, states, triggers, transitions

    def next_state(self, state: Any, trigger: str) -> Any:
        """The state ``trigger`` leads to from ``state``; raises IllegalTransition if the table has no such entry:
        the one place a transition is refused."""
        try:
            return self.transitions[state, trigger]
        except KeyError:
            raise IllegalTransition(state, trigger, self) from None

    def allows(self, state: Any, trigger: str) -> bool:
        return (state, trigger) in self.transitions


TASKS = Table("task", STATES, TRIGGERS, TRANSITIONS)
JOBS = Table("job", JOB_PHASES, JOB_TRIGGERS, JOB_TRANSITIONS)
OPERATIONS = Table("operation", OP_STATES, OP_TRIGGERS, OP_TRANSITIONS)
CHOICES = Table("maintenance choice", CHOICE_STATES, CHOICE_TRIGGERS, CHOICE_TRANSITIONS)
TABLES = (TASKS, JOBS, OPERATIONS, CHOICES)


def next_state(state: str, trigger: str) -> str:
    """A task's next state (``TASKS.next_state``); raises IllegalTransition if the table has no such entry."""
    return TASKS.next_state(state, trigger)


def apply(state: str, trigger: str) -> tuple[str, bool]:
    """Like ``next_state`` but duplicate-tolerant: returns ``(new_state, changed)``.

    If the table has no entry but ``trigger`` is one that leads to ``state`` (the event that produced the
    current state, delivered again), returns ``(state, False)`` instead of raising.
    """
    if (state, trigger) in TRANSITIONS:
        return TRANSITIONS[state, trigger], True
    if (trigger, state) in _PRODUCED_BY:
        return state, False
    raise IllegalTransition(state, trigger)
