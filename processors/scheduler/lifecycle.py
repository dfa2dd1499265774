"""Task lifecycle: every legal transition in one table (h11 ``_state.py`` style). Pure: no I/O.

States are the TaskState symbols of ``schemas/TaskStateChanged.avsc`` (UNKNOWN is only a reader's fallback
for a newer symbol, never a state the scheduler enters). Anything not in ``TRANSITIONS`` raises
``IllegalTransition``; ``apply()`` also recognises a duplicated event (delivery is at-least-once).
The main paths (the table below is the authority):

    PENDING --allocated--> ALLOCATED --start_commanded--> STARTING --started--> RUNNING
    RUNNING --exited_ok--> STOPPED          STARTING|RUNNING --stop_commanded--> STOPPING --stopped--> STOPPED
    STARTING|RUNNING --crashed--> FAILED    ALLOCATED|STARTING|RUNNING --machine_failed--> FAILED
    FAILED|STOPPED --rescheduled--> PENDING (reallocated; the machine it failed on is avoided)
    FAILED|STOPPED --restart_commanded--> STARTING (started again on the machine it still holds)
"""
from __future__ import annotations

from types import MappingProxyType

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

# (trigger, state) pairs where the trigger is one that can produce the state: a repeat of it is a duplicate.
_PRODUCED_BY = frozenset((trigger, target) for (_, trigger), target in TRANSITIONS.items())


class IllegalTransition(ValueError):
    """A trigger arrived in a state where the lifecycle table has no transition for it."""

    def __init__(self, state: str, trigger: str):
        self.state, self.trigger = state, trigger
        legal = sorted(t for s, t in TRANSITIONS if s == state)
        super().__init__(f"illegal task transition: {trigger!r} in state {state!r}; "
                         f"legal triggers there: {', '.join(legal) or 'none'}")


def next_state(state: str, trigger: str) -> str:
    """The state ``trigger`` leads to from ``state``; raises IllegalTransition if the table has no such entry."""
    try:
        return TRANSITIONS[state, trigger]
    except KeyError:
        raise IllegalTransition(state, trigger) from None


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
