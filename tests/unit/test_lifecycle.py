"""Table-driven tests of the task lifecycle table."""
import pytest

from processors.scheduler.lifecycle import (
    ALLOCATED, ALLOCATED_EV, CRASHED, EXITED_OK, FAILED, MACHINE_FAILED, PENDING, RESCHEDULED, RESTART_COMMANDED,
    RUNNING, START_COMMANDED, STARTED, STARTING, STATES, STOP_COMMANDED, STOPPED, STOPPED_EV, STOPPING, TRANSITIONS,
    TRIGGERS, IllegalTransition, apply, next_state,
)

LEGAL = [
    (PENDING, ALLOCATED_EV, ALLOCATED),
    (ALLOCATED, START_COMMANDED, STARTING),
    (STARTING, STARTED, RUNNING),
    (RUNNING, EXITED_OK, STOPPED),
    (RUNNING, STOP_COMMANDED, STOPPING),
    (STARTING, STOP_COMMANDED, STOPPING),
    (STOPPING, STOPPED_EV, STOPPED),
    (STOPPING, EXITED_OK, STOPPED),
    (STOPPING, CRASHED, STOPPED),
    (PENDING, STOP_COMMANDED, STOPPED),
    (ALLOCATED, STOP_COMMANDED, STOPPED),
    (FAILED, STOP_COMMANDED, STOPPED),
    (STARTING, CRASHED, FAILED),
    (STARTING, EXITED_OK, STOPPED),
    (RUNNING, CRASHED, FAILED),
    # machine failure: the task fails, then is rescheduled back to PENDING for reallocation
    (ALLOCATED, MACHINE_FAILED, FAILED),
    (STARTING, MACHINE_FAILED, FAILED),
    (RUNNING, MACHINE_FAILED, FAILED),
    (STOPPING, MACHINE_FAILED, STOPPED),
    (FAILED, RESCHEDULED, PENDING),
    (STOPPED, RESCHEDULED, PENDING),
    # restarted where it is placed: restart policy after a crash or an exit, in-place rolling update
    (FAILED, RESTART_COMMANDED, STARTING),
    (STOPPED, RESTART_COMMANDED, STARTING),
]

ILLEGAL = [
    (PENDING, STARTED),
    (PENDING, START_COMMANDED),
    (PENDING, MACHINE_FAILED),
    (ALLOCATED, STARTED),
    (RUNNING, ALLOCATED_EV),
    (RUNNING, RESCHEDULED),
    (RUNNING, RESTART_COMMANDED),
    (PENDING, RESTART_COMMANDED),
    (STOPPING, RESTART_COMMANDED),
    (STOPPING, START_COMMANDED),
    (STOPPED, STARTED),
    (FAILED, STARTED),
    ("UNKNOWN", ALLOCATED_EV),
    (RUNNING, "teleported"),
]

# A repeat of the trigger that produced the current state (an event delivered twice) changes nothing.
DUPLICATES = [
    (ALLOCATED, ALLOCATED_EV),
    (STARTING, START_COMMANDED),
    (RUNNING, STARTED),
    (STOPPING, STOP_COMMANDED),
    (STOPPED, STOPPED_EV),
    (STOPPED, STOP_COMMANDED),
    (FAILED, CRASHED),
    (FAILED, MACHINE_FAILED),
    (PENDING, RESCHEDULED),
    (STARTING, RESTART_COMMANDED),
]


@pytest.mark.parametrize("state, trigger, expected", LEGAL)
def test_legal_transition(state, trigger, expected):
    assert next_state(state, trigger) == expected
    assert apply(state, trigger) == (expected, True)


def test_table_is_exactly_the_legal_cases():
    assert dict(TRANSITIONS) == {(s, t): e for s, t, e in LEGAL}
    assert {s for s, _ in TRANSITIONS} | set(TRANSITIONS.values()) == set(STATES)
    assert {t for _, t in TRANSITIONS} == set(TRIGGERS)


@pytest.mark.parametrize("state, trigger", ILLEGAL)
def test_illegal_transition_raises(state, trigger):
    with pytest.raises(IllegalTransition) as err:
        next_state(state, trigger)
    assert isinstance(err.value, ValueError)
    assert (err.value.state, err.value.trigger) == (state, trigger)
    assert repr(trigger) in str(err.value) and repr(state) in str(err.value)
    with pytest.raises(IllegalTransition):
        apply(state, trigger)


@pytest.mark.parametrize("state, trigger", DUPLICATES)
def test_duplicate_event_is_a_no_op(state, trigger):
    with pytest.raises(IllegalTransition):
        next_state(state, trigger)
    assert apply(state, trigger) == (state, False)


def test_crash_restart_in_place():
    state = RUNNING
    for trigger in (CRASHED, RESTART_COMMANDED, STARTED, EXITED_OK, RESTART_COMMANDED, EXITED_OK):
        state, _ = apply(state, trigger)
    assert state == STOPPED


def test_machine_failure_then_reschedule():
    state = RUNNING
    for trigger in (MACHINE_FAILED, MACHINE_FAILED, RESCHEDULED, ALLOCATED_EV):
        state, _ = apply(state, trigger)
    assert state == ALLOCATED
