"""Table-driven tests of the scheduler's lifecycle tables: task states, job phases, operation states, maintenance
choices."""
from types import MappingProxyType

import pytest

from processors.scheduler.lifecycle import (
    ALLOCATED, ALLOCATED_EV, CHOICES, CHOICE_KEEP, CHOICE_MOVE, CHOICE_NONE, CHOICE_STOP, CHOSEN, CHOSE_KEEP,
    CHOSE_MOVE, CHOSE_STOP, CRASHED, DEADLINE_HELD, DEADLINE_MOVED, EXITED_OK, FAILED, HELD_AT_DEADLINE, JOBS,
    JOB_ACTIVE, JOB_ALL_STOPPED, JOB_COLLECTED, JOB_DELETED, JOB_GONE, JOB_FREED, JOB_REFUSED, JOB_REJECTED, JOB_RESUBMITTED, JOB_STOP,
    JOB_STOPPED, JOB_STOPPING, MACHINE_FAILED, MAINTENANCE_ENDED, MOVED_OFF, OPERATIONS, OP_ACKED, OP_APPROVED,
    OP_ASKED, OP_ENDED, OP_NONE, OP_PENDING, OP_PERFORMED, OP_RUNNING, OP_WANTED, PENDING, RESCHEDULED,
    RESTART_COMMANDED, RUNNING, STARTED, STARTING, START_COMMANDED, STATES, STOPPED, STOPPED_EV, STOPPING,
    STOP_COMMANDED, TABLES, TASKS, TRANSITIONS, TRIGGERS, IllegalTransition, apply, next_state,
)
from processors.scheduler.model import Job, SchedulerState, Spec, Task, job_phase, replace
from processors.scheduler.work import Fold
from processors.taskcontrol.protocol import OP_UPDATE

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


# -- the job and operation tables: every job status and operation state change of the scheduler goes through them --

JOB_LEGAL = [
    (JOB_ACTIVE, JOB_STOP, JOB_STOPPING),
    (JOB_ACTIVE, JOB_REFUSED, JOB_REJECTED),
    (JOB_STOPPING, JOB_ALL_STOPPED, JOB_STOPPED),
    (JOB_STOPPED, JOB_FREED, JOB_DELETED),
    (JOB_REJECTED, JOB_RESUBMITTED, JOB_ACTIVE),
    (JOB_DELETED, JOB_RESUBMITTED, JOB_ACTIVE),
    (JOB_REJECTED, JOB_COLLECTED, JOB_GONE),  # its grace passed: it leaves the state (decide.collect)
    (JOB_DELETED, JOB_COLLECTED, JOB_GONE),
]

JOB_ILLEGAL = [
    (JOB_ACTIVE, JOB_RESUBMITTED),  # a live job id: the submission is refused (duplicate_job_id), not applied
    (JOB_STOPPING, JOB_RESUBMITTED),  # the previous incarnation is still stopping (job_not_active)
    (JOB_STOPPED, JOB_RESUBMITTED),  # stopped, its placements not freed yet
    (JOB_STOPPING, JOB_STOP),  # a stop of a stopping job is a no-op the handler filters, never a transition
    (JOB_REJECTED, JOB_STOP),
    (JOB_ACTIVE, JOB_ALL_STOPPED),
    (JOB_ACTIVE, JOB_FREED),
    (JOB_STOPPING, JOB_FREED),  # freed before every task stopped
    (JOB_DELETED, JOB_FREED),  # a second answer to the final free request
    (JOB_STOPPING, JOB_REFUSED),
    (JOB_DELETED, JOB_STOP),
    ("paused", JOB_STOP),
    (JOB_ACTIVE, JOB_COLLECTED),  # a live job is never collected, nor one still stopping or awaiting its free
    (JOB_STOPPING, JOB_COLLECTED),
    (JOB_STOPPED, JOB_COLLECTED),
    (JOB_GONE, JOB_RESUBMITTED),  # gone is no job: a submission of its id makes a new one, not a transition
]

OP_LEGAL = [
    (OP_NONE, OP_ASKED, OP_PENDING),
    (OP_NONE, OP_WANTED, OP_APPROVED),
    (OP_PENDING, OP_ACKED, OP_APPROVED),
    (OP_PENDING, OP_ENDED, OP_NONE),
    (OP_APPROVED, OP_PERFORMED, OP_RUNNING),
    (OP_APPROVED, OP_ENDED, OP_NONE),
    (OP_RUNNING, OP_ENDED, OP_NONE),
]

OP_ILLEGAL = [
    (OP_NONE, OP_ACKED),  # an ack for an operation the task does not have
    (OP_NONE, OP_PERFORMED),
    (OP_NONE, OP_ENDED),
    (OP_PENDING, OP_PERFORMED),  # performed before its controller approved it
    (OP_PENDING, OP_ASKED),  # a second operation on a task: the first is ended first
    (OP_APPROVED, OP_ACKED),
    (OP_APPROVED, OP_WANTED),
    (OP_RUNNING, OP_PERFORMED),
    (OP_RUNNING, OP_ACKED),
]


CHOICE_LEGAL = [
    *[(s, CHOSEN[c], c) for s in (CHOICE_NONE, CHOICE_MOVE, CHOICE_STOP, CHOICE_KEEP) for c in CHOSEN],  # a later
    (CHOICE_NONE, DEADLINE_HELD, HELD_AT_DEADLINE),  #                                  answer may change the choice
    (CHOICE_NONE, DEADLINE_MOVED, CHOICE_MOVE),
    *[(s, t, CHOICE_NONE) for s in (CHOICE_MOVE, CHOICE_STOP, CHOICE_KEEP, HELD_AT_DEADLINE)
      for t in (MAINTENANCE_ENDED, MOVED_OFF)],
]

CHOICE_ILLEGAL = [
    (HELD_AT_DEADLINE, CHOSE_KEEP),  # the deadline stopped it: a controller's answer comes too late
    (HELD_AT_DEADLINE, CHOSE_MOVE),
    (HELD_AT_DEADLINE, CHOSE_STOP),
    (CHOICE_KEEP, DEADLINE_HELD),  # the deadline takes only tasks nothing was chosen for
    (CHOICE_MOVE, DEADLINE_MOVED),
    (HELD_AT_DEADLINE, DEADLINE_HELD),
    (CHOICE_NONE, MAINTENANCE_ENDED),  # nothing chosen: nothing to forget
    (CHOICE_NONE, MOVED_OFF),
    ("LATER", CHOSE_MOVE),
]


@pytest.mark.parametrize("table, legal", [(JOBS, JOB_LEGAL), (OPERATIONS, OP_LEGAL), (CHOICES, CHOICE_LEGAL)],
                         ids=["jobs", "operations", "choices"])
def test_each_table_is_exactly_its_legal_cases(table, legal):
    assert dict(table.transitions) == {(s, t): e for s, t, e in legal}
    assert {s for s, _ in table.transitions} | set(table.transitions.values()) == set(table.states)
    assert {t for _, t in table.transitions} == set(table.triggers)


@pytest.mark.parametrize("table, state, trigger, expected",
                         [(JOBS, *c) for c in JOB_LEGAL] + [(OPERATIONS, *c) for c in OP_LEGAL]
                         + [(CHOICES, *c) for c in CHOICE_LEGAL])
def test_legal_job_and_operation_transitions(table, state, trigger, expected):
    assert table.next_state(state, trigger) == expected
    assert table.allows(state, trigger)


@pytest.mark.parametrize("table, state, trigger",
                         [(JOBS, *c) for c in JOB_ILLEGAL] + [(OPERATIONS, *c) for c in OP_ILLEGAL]
                         + [(CHOICES, *c) for c in CHOICE_ILLEGAL])
def test_illegal_job_and_operation_transitions_are_refused_naming_the_table(table, state, trigger):
    assert not table.allows(state, trigger)
    with pytest.raises(IllegalTransition) as err:
        table.next_state(state, trigger)
    assert (err.value.state, err.value.trigger, err.value.what) == (state, trigger, table.what)
    assert str(err.value).startswith(f"illegal {table.what} transition: {trigger!r} in state {state!r}")


def test_the_task_table_is_one_of_the_tables():
    assert TASKS.transitions is TRANSITIONS
    assert {t.what for t in TABLES} == {"task", "job", "operation", "maintenance choice"}
    assert [TASKS.next_state(s, t) for s, t, _ in LEGAL] == [e for _, _, e in LEGAL]


def _work(controller=None):
    """A job's working copy inside a decision, with one RUNNING task."""
    spec = Spec(name="web", command=("serve",), cpu=100, mem=64, controller=controller)
    task = Task(id="e1.web/0", index=0, state=RUNNING, machine="m1")
    fold = Fold(SchedulerState(), 0, None)
    return fold.new_job(Job(id="e1.web", entitlement="e1", spec=spec, spec_version=1, desired=1,
                            tasks=MappingProxyType({task.id: task})))


def test_a_job_moves_through_the_job_table_only():
    w = _work()
    w.job_step(JOB_STOP)
    assert (w.job.status, w.job.deleted, job_phase(w.job)) == (JOB_STOPPING, False, JOB_STOPPING)
    with pytest.raises(IllegalTransition, match="illegal job transition: 'freed' in state 'stopping'"):
        w.job_step(JOB_FREED)
    w.job_step(JOB_ALL_STOPPED, free_request_id="e1.web:v1:r1")
    w.job_step(JOB_FREED, free_request_id=None)
    # deleted is a phase, not a status: the job stays "stopped" (what JobStatePublished shows) with deleted set
    assert (w.job.status, w.job.deleted, job_phase(w.job), w.job.free_request_id) == (JOB_STOPPED, True,
                                                                                       JOB_DELETED, None)


@pytest.mark.parametrize("controller, first", [("ctl", OP_PENDING), (None, OP_APPROVED)])
def test_an_operation_moves_through_the_operation_table_only(controller, first):
    w = _work(controller)
    t = w.new_op(w.tasks["e1.web/0"], OP_UPDATE, "rolling_update")
    assert t.op_state == first
    if first == OP_PENDING:
        with pytest.raises(IllegalTransition, match="illegal operation transition: 'performed' in state 'pending'"):
            w.op_step(t, OP_PERFORMED)
        t = w.op_step(t, OP_ACKED)
    with pytest.raises(IllegalTransition, match="'acked' in state 'approved'"):
        w.op_step(t, OP_ACKED)
    t = w.op_step(t, OP_PERFORMED)
    assert t.op_state == OP_RUNNING
    t = w.end_op(t)
    assert (t.op, t.op_id, t.op_state) == (None, None, OP_NONE)
    assert w.end_op(t) is t  # no operation: nothing to end


def test_a_maintenance_choice_moves_through_the_choice_table_only():
    w = _work("ctl")
    t = w.tasks["e1.web/0"]
    assert w.choice_fields(t, CHOSE_KEEP, "ue1") == {"maint_choice": CHOICE_KEEP, "maint_ue": "ue1"}
    t = w.put(replace(t, **w.choice_fields(t, DEADLINE_HELD, "ue1")))
    with pytest.raises(IllegalTransition, match="illegal maintenance choice transition: 'chose_keep' in state"):
        w.choice_fields(t, CHOSE_KEEP, "ue1")
    assert w.choice_fields(t, MAINTENANCE_ENDED) == {"maint_choice": CHOICE_NONE, "maint_ue": None}
