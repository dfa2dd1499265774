"""Agent decisions: task commands, process exits and ticks → task state reports, heartbeats and actions. Pure.

No processes, no Kafka, no clock: ``decide(state, input, now_ms) -> (new_state, events, actions)``. The
wiring (``process.py``: real OS processes; ``simulated.py``: many pretend machines) carries out the
``actions`` (spawn a task's argv/env, kill a task) and feeds back what happened (``Spawned``,
``SpawnFailed``, ``Exited``) and the passing of time (``Tick``).

Inputs:

* ``Command``: a TaskCommanded addressed to this machine. START runs the task; any command whose event id was
  already applied is a no-op (delivery is at-least-once); a START (another command) for a task already running
  at the same spec version starts nothing: the task's run takes the command's id and, if its process is up, is
  reported RUNNING again (``already_running``: a log that was replaced commands a task the agent kept running). A START/RESTART at another spec version, or a RESTART of a live task, kills
  it and runs the new spec once it has exited. STOP kills it (STOPPED once it exited); a STOP for a task
  the agent does not run is answered STOPPED at once, so the scheduler's STOPPING completes, and so is a STOP (another
  command) for a task it stopped already (``already_stopped``: the scheduler commands again a task whose report it
  lost, ``scheduler/steps.command_again``).
* ``Spawned`` / ``SpawnFailed``: the wiring started the process (→ RUNNING) or could not (→ FAILED).
* ``Exited``: the process ended. Exit 0 → STOPPED (``exited``). Non-zero (or unknown: a process that
  vanished while the agent was down) → restarted in place after a backoff, up to ``Policy.max_restarts``
  times, silently (the control plane still sees it RUNNING); after that, FAILED with the exit code.
* ``Tick``: restarts whose backoff elapsed are spawned; one AgentHeartbeat (sequence + 1, live task ids).
* ``Suspended``: the agent itself stops (``ropewalk down``) and has killed the task's process: the task is started
  again, silently, at the agent's next start (still RUNNING to the control plane: the region was down, the log
  still says it runs); a stop under way completes (STOPPED); a kill for a new spec starts the new one then.
* ``Orphaned``: the log the agent reads commands the task no more (it was replaced: its offsets belong to another
  log): the task is stopped as if a STOP came (``not_in_log``).
* ``Unplaced``: the agent's fold of ``allocations`` (``gate.py``) placed the task on another machine or freed it from
  this one, while the agent runs it: the task is stopped as if a STOP came (``not_placed``). The allocation gate
  admits a START its fold places here, and a fold behind the log (a move not read yet) still places it here: a
  START from a scheduler shard that woke up stale after the move runs until the fold reads the move, and no later
  (the new owner's STOP may have come before it; the scheduler ignores a report from a machine the task left).

Per task the agent keeps a ``TaskRun`` whose ``phase`` is the agent's own view (SPAWNING, RUNNING, BACKOFF,
KILLING, STOPPED, FAILED) and ``reported`` the last TaskState it announced (``previous_state`` of the next).

Event ids are ``derived_event_id`` over the machine, the task, the command that began the run, the restart
number and the state, so re-deciding the same inputs emits the same ids; heartbeats over the machine, the
agent's incarnation (its boot time) and the sequence.

**Batches** (``commands`` and ``batch``). The scheduler commands a job's tasks in one TasksCommanded (older logs:
a TaskCommanded per task); ``commands`` gives the ones addressed to an agent's machines as TaskCommanded events,
each with its command id (derived from the batch's id and its position) as event id, so ``decide`` sees what it
always saw. ``decide`` still makes one TaskStateChanged per transition (with its derived id); the wiring sends
what one poll step made as ``batch``: one TaskStatesChanged per entitlement (split to stay far below the
broker's record limit), whose id is derived from its reports' ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, Union

from streams import batches
from streams.enums import TaskCommand, TaskState
from streams.events import Event, derived_event_id, new_event

PRODUCER = "agent"

# Restart-on-crash policy defaults (``Policy``): a crashed task is restarted in place this many times, the
# n-th restart after BACKOFF_MS * 2**(n-1) (at most MAX_BACKOFF_MS), before it is reported FAILED.
MAX_RESTARTS = 2
BACKOFF_MS = 500
MAX_BACKOFF_MS = 10_000
# A killed task gets SIGTERM, then SIGKILL after this grace (the wiring's business; here for one place).
STOP_GRACE_MS = 5_000

# TaskState symbols the agent reports (schemas/TaskStateChanged.avsc).
STARTING = TaskState.STARTING
RUNNING = TaskState.RUNNING
STOPPED = TaskState.STOPPED
FAILED = TaskState.FAILED
UNKNOWN = TaskState.UNKNOWN  # previous_state of a task the agent never ran

# The agent's own phases of a task.
P_SPAWNING = "spawning"  # spawn asked of the wiring, not confirmed yet
P_RUNNING = "running"  # the process is up
P_BACKOFF = "backoff"  # crashed; restarted when the backoff elapses (still RUNNING to the control plane)
P_KILLING = "killing"  # kill asked; STOPPED when it exits, or the next spec is spawned (``then``)
P_STOPPED = "stopped"
P_FAILED = "failed"
PHASES = (P_SPAWNING, P_RUNNING, P_BACKOFF, P_KILLING, P_STOPPED, P_FAILED)
LIVE = frozenset({P_SPAWNING, P_RUNNING, P_BACKOFF, P_KILLING})  # a heartbeat lists these tasks
HAS_PROCESS = frozenset({P_SPAWNING, P_RUNNING, P_KILLING})  # a process exists (or is being made)
NO_RUN = None  # the phase of a task the agent has no run of (never ran it, or forgot it)

# What changes a task's phase (the name of the change, not an input: one input may make different changes).
T_START = "start"  # a START/RESTART (or the next spec) to run where no process is: spawn it
T_SPAWNED = "spawned"  # the wiring says the process is up
T_SPAWN_FAILED = "spawn_failed"  # the wiring could not start it
T_KILL = "kill"  # kill its process: a STOP, another spec, a RESTART, the log no longer commands it
T_RELEASE = "release"  # stopped where no process is to kill: a STOP/orphaning in backoff, a STOP of no live run
T_KILLED = "killed"  # the killed process exited: stopped
T_KILLED_FOR_SPEC = "killed_for_spec"  # the killed process exited: its next spec is spawned
T_EXITED_OK = "exited_ok"  # exited 0 on its own
T_CRASHED = "crashed"  # exited non-zero (or vanished) with restarts left: back off
T_GAVE_UP = "gave_up"  # crashed with no restart left (``Policy.max_restarts``)
T_BACKOFF_ELAPSED = "backoff_elapsed"  # a tick after the backoff: spawn it again
T_SUSPENDED = "suspended"  # the agent stops and killed its process: spawned again at its next start

# Every legal change of a task's phase (``processors/scheduler/lifecycle.py``'s style): ``phase_after`` refuses any
# other. Changes that keep the phase (a duplicate command, a START of the spec already running, a second kill
# while one is under way) are no changes and not listed.
PHASE_CHANGES = MappingProxyType({
    (NO_RUN, T_START): P_SPAWNING,
    (NO_RUN, T_RELEASE): P_STOPPED,  # a STOP for a task it does not run: answered STOPPED at once
    (P_STOPPED, T_START): P_SPAWNING,
    (P_FAILED, T_START): P_SPAWNING,
    (P_FAILED, T_RELEASE): P_STOPPED,
    (P_SPAWNING, T_SPAWNED): P_RUNNING,
    (P_SPAWNING, T_SPAWN_FAILED): P_FAILED,
    (P_SPAWNING, T_KILL): P_KILLING,
    (P_SPAWNING, T_EXITED_OK): P_STOPPED,
    (P_SPAWNING, T_CRASHED): P_BACKOFF,
    (P_SPAWNING, T_GAVE_UP): P_FAILED,
    (P_SPAWNING, T_SUSPENDED): P_BACKOFF,
    (P_RUNNING, T_KILL): P_KILLING,
    (P_RUNNING, T_EXITED_OK): P_STOPPED,
    (P_RUNNING, T_CRASHED): P_BACKOFF,
    (P_RUNNING, T_GAVE_UP): P_FAILED,
    (P_RUNNING, T_SUSPENDED): P_BACKOFF,
    (P_BACKOFF, T_START): P_SPAWNING,  # another spec while backing off: no process, spawned at once
    (P_BACKOFF, T_BACKOFF_ELAPSED): P_SPAWNING,
    (P_BACKOFF, T_RELEASE): P_STOPPED,
    (P_KILLING, T_KILLED): P_STOPPED,
    (P_KILLING, T_KILLED_FOR_SPEC): P_SPAWNING,
    (P_KILLING, T_SUSPENDED): P_BACKOFF,  # killed for a new spec when the agent stopped: that one at its start
})

# Reasons carried by TaskStateChanged.reason.
REASON_SPAWNING = "spawning"  # STARTING: the agent is starting the process
REASON_PROCESS_UP = "process_up"  # RUNNING: the process started
REASON_EXITED = "exited"  # STOPPED: exit code 0 on its own
REASON_STOP_COMMANDED = "stop_commanded"  # STOPPED: killed after a STOP
REASON_NOT_RUNNING = "not_running"  # STOPPED: a STOP for a task this agent does not run
REASON_RESTART_LIMIT = "restart_limit"  # FAILED: crashed again after Policy.max_restarts local restarts
REASON_SPAWN_FAILED = "spawn_failed"  # FAILED: the process could not be started (no such file, ...)
REASON_ALREADY_RUNNING = "already_running"  # RUNNING: a START (another command) for a task whose process runs
REASON_ALREADY_STOPPED = "already_stopped"  # STOPPED: a STOP (another command) for a task it stopped already
REASON_NOT_IN_LOG = "not_in_log"  # STOPPED: the task was stopped because the log commands it no more
REASON_NOT_PLACED = "not_placed"  # STOPPED: the allocations log placed the task elsewhere (or freed it) meanwhile

# Why an action is asked (Action.reason).
WHY_COMMANDED = "commanded"  # a START/RESTART/STOP command
WHY_RESTART_POLICY = "restart_policy"  # a local restart after a crash
WHY_NEW_SPEC = "new_spec"  # killed to run another spec version / a RESTART
WHY_NOT_IN_LOG = "not_in_log"  # killed: the log the agent reads does not command it (``Orphaned``)
WHY_NOT_PLACED = "not_placed"  # killed: the allocations log placed it on another machine, or freed it (``Unplaced``)

# Action kinds.
SPAWN = "spawn"
KILL = "kill"


class AgentError(ValueError):
    pass


class IllegalPhaseChange(AgentError):
    """A change ``PHASE_CHANGES`` has no entry for (a bug in ``decide``: no input is refused this way)."""


def phase_after(phase: str | None, change: str) -> str:
    """The phase ``change`` leads to from ``phase`` (``NO_RUN``: no run of the task); IllegalPhaseChange if the
    table has no such entry."""
    to = PHASE_CHANGES.get((phase, change))
    if to is None:
        legal = sorted(c for p, c in PHASE_CHANGES if p == phase)
        raise IllegalPhaseChange(f"illegal agent phase change {change!r} in phase {phase!r}; legal there: "
                                 f"{', '.join(legal) or 'none'}")
    return to


@dataclass(frozen=True)
class Policy:
    max_restarts: int = MAX_RESTARTS
    backoff_ms: int = BACKOFF_MS
    max_backoff_ms: int = MAX_BACKOFF_MS

    def backoff(self, restart_number: int) -> int:
        """Delay before the ``restart_number``-th restart (1-based)."""
        return min(self.max_backoff_ms, self.backoff_ms * 2 ** max(0, restart_number - 1))


DEFAULT_POLICY = Policy()


@dataclass(frozen=True, slots=True)
class Spec:
    """What to run: one START/RESTART command's task, spec version, argv and env."""

    job_id: str
    entitlement: str  # the key of the task's events (the command's envelope entitlement)
    spec_version: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # sorted pairs (hashable, stable)
    run_id: str  # event id of the command that began this run: causation of the run's reports


@dataclass(frozen=True, slots=True)
class TaskRun:
    task_id: str
    spec: Spec
    phase: str
    reported: str  # last TaskState announced (UNKNOWN before the first)
    restarts: int = 0  # local restarts of this run
    restart_at_ms: int | None = None  # when in BACKOFF
    exit_code: int | None = None  # of the last exit
    then: Spec | None = None  # when KILLING: the spec to run after the exit (None: it is a stop)
    commands: tuple[str, ...] = ()  # event ids of the last commands applied (duplicates are no-ops)
    stop_reason: str = ""  # when KILLING to stop: the STOPPED report's reason ("": REASON_STOP_COMMANDED)


@dataclass(frozen=True)
class AgentState:
    machine_id: str
    incarnation: int = 0  # the agent's boot time (ms): heartbeat ids differ across agent restarts
    sequence: int = 0  # of the last heartbeat
    tasks: Mapping[str, TaskRun] = field(default_factory=lambda: MappingProxyType({}))

    def live_task_ids(self) -> list[str]:
        return sorted(t for t, run in self.tasks.items() if run.phase in LIVE)

    def _with(self, run: TaskRun | None = None, **changes) -> "AgentState":
        if run is not None:
            tasks = dict(self.tasks)
            tasks[run.task_id] = run
            changes["tasks"] = MappingProxyType(tasks)
        return replace(self, **changes)


# -- inputs and actions ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    event: Event  # a TaskCommanded


@dataclass(frozen=True)
class Spawned:
    task_id: str


@dataclass(frozen=True)
class SpawnFailed:
    task_id: str
    error: str = ""


@dataclass(frozen=True)
class Exited:
    task_id: str
    exit_code: int | None  # None: unknown (the process vanished while the agent was not watching)


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class Suspended:
    task_id: str  # its process was killed because the agent stops (``ropewalk down``)


@dataclass(frozen=True)
class Orphaned:
    task_id: str  # the log the agent reads does not command it


@dataclass(frozen=True)
class Unplaced:
    task_id: str  # the allocations log placed it on another machine, or freed it from this one (``gate.Gate``)


Input = Union[Command, Spawned, SpawnFailed, Exited, Tick, Suspended, Orphaned, Unplaced]


@dataclass(frozen=True)
class Action:
    kind: str  # SPAWN or KILL
    task_id: str
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    spec_version: int = 0
    reason: str = ""


KEEP_COMMAND_IDS = 8  # per task: enough to recognise a redelivered command


# -- deciding ----------------------------------------------------------------------------------------------------

def initial_state(machine_id: str, incarnation: int = 0, sequence: int = 0) -> AgentState:
    return AgentState(machine_id=machine_id, incarnation=incarnation, sequence=sequence)


def decide(state: AgentState, inp: Input, now_ms: int, policy: Policy = DEFAULT_POLICY
           ) -> tuple[AgentState, list[Event], list[Action]]:
    """One input → (new state, events to produce, actions for the wiring)."""
    if isinstance(inp, Command):
        return _on_command(state, inp.event, now_ms)
    if isinstance(inp, Spawned):
        return _on_spawned(state, inp.task_id, now_ms)
    if isinstance(inp, SpawnFailed):
        return _on_spawn_failed(state, inp.task_id, now_ms)
    if isinstance(inp, Exited):
        return _on_exited(state, inp.task_id, inp.exit_code, now_ms, policy)
    if isinstance(inp, Tick):
        return _on_tick(state, now_ms)
    if isinstance(inp, Suspended):
        return _on_suspended(state, inp.task_id, now_ms)
    if isinstance(inp, Orphaned):
        return _on_orphaned(state, inp.task_id, now_ms, REASON_NOT_IN_LOG, WHY_NOT_IN_LOG)
    if isinstance(inp, Unplaced):
        return _on_orphaned(state, inp.task_id, now_ms, REASON_NOT_PLACED, WHY_NOT_PLACED)
    raise AgentError(f"unknown agent input {inp!r}")


def _report(state: AgentState, run: TaskRun, new_state: str, reason: str, now_ms: int,
            exit_code: int | None = None) -> Event:
    s = run.spec
    return new_event("TaskStateChanged", {
        "task_id": run.task_id, "job_id": s.job_id, "machine_id": state.machine_id, "state": new_state,
        "previous_state": run.reported, "exit_code": exit_code, "spec_version": s.spec_version, "reason": reason},
        entitlement=s.entitlement, entity_id=run.task_id, producer=f"{PRODUCER}/{state.machine_id}",
        causation_id=s.run_id, timestamp_ms=now_ms,
        event_id=derived_event_id(PRODUCER, state.machine_id, run.task_id, s.run_id, run.restarts, new_state))


def _spawn(run: TaskRun, reason: str) -> Action:
    s = run.spec
    return Action(SPAWN, run.task_id, s.argv, dict(s.env), s.spec_version, reason)


def _kill(task_id: str, reason: str) -> Action:
    return Action(KILL, task_id, reason=reason)


def _spec_of(ev: Event) -> Spec:
    p = ev.payload
    return Spec(job_id=p["job_id"], entitlement=ev.entitlement, spec_version=p.get("spec_version", 1),
                argv=tuple(p.get("argv") or ()), env=tuple(sorted((p.get("env") or {}).items())),
                run_id=ev.event_id)


def _start(state: AgentState, task_id: str, spec: Spec, previous: str, commands: tuple[str, ...], now_ms: int,
           phase: str | None = NO_RUN, change: str = T_START):
    """A new run of ``spec`` spawned (from the task's ``phase`` by ``change``), announced STARTING."""
    run = TaskRun(task_id=task_id, spec=spec, phase=phase_after(phase, change), reported=previous, commands=commands)
    ev = _report(state, run, STARTING, REASON_SPAWNING, now_ms)
    return state._with(replace(run, reported=STARTING)), [ev], [_spawn(run, WHY_COMMANDED)]


def _on_command(state: AgentState, ev: Event, now_ms: int):
    if ev.type != "TaskCommanded":
        raise AgentError(f"expected a TaskCommanded, got {ev.type}")
    p = ev.payload
    if p["machine_id"] != state.machine_id:
        return state, [], []  # addressed to another machine
    task_id, command = p["task_id"], p["command"]
    run = state.tasks.get(task_id)
    if run is not None and ev.event_id and ev.event_id in run.commands:
        return state, [], []  # the same command again (redelivery)
    seen = ((run.commands if run else ()) + ((ev.event_id,) if ev.event_id else ()))[-KEEP_COMMAND_IDS:]
    if command in (TaskCommand.START, TaskCommand.RESTART):
        spec = _spec_of(ev)
        if run is None or run.phase in (P_STOPPED, P_FAILED):
            return _start(state, task_id, spec, run.reported if run else UNKNOWN, seen, now_ms,
                          run.phase if run else NO_RUN)
        same = run.spec.spec_version == spec.spec_version and run.then is None
        if command == TaskCommand.START and same:  # already running this spec version: the run takes the command's id
            adopted = replace(run, spec=spec, commands=seen)
            if run.spec.run_id == spec.run_id or run.reported != RUNNING:
                return state._with(adopted), [], []
            return state._with(adopted), [_report(state, adopted, RUNNING, REASON_ALREADY_RUNNING, now_ms)], []
        if run.phase == P_BACKOFF:  # no process: start the new spec at once
            return _start(state, task_id, spec, run.reported, seen, now_ms, P_BACKOFF)
        if run.phase == P_KILLING:  # already being killed: run the new spec after it
            return state._with(replace(run, then=spec, commands=seen)), [], []
        return (state._with(replace(run, phase=phase_after(run.phase, T_KILL), then=spec, commands=seen)), [],
                [_kill(task_id, WHY_NEW_SPEC)])
    if command == TaskCommand.STOP:
        if run is None or run.phase in (P_STOPPED, P_FAILED):
            if run is not None and run.phase == P_STOPPED:  # already stopped: said again (its report may be lost)
                again = _report(state, replace(run, spec=replace(run.spec, run_id=ev.event_id)), STOPPED,
                                REASON_ALREADY_STOPPED, now_ms, run.exit_code)
                return state._with(replace(run, reported=STOPPED, commands=seen)), [again], []
            gone = run or TaskRun(task_id=task_id, spec=_spec_of(ev), phase=P_STOPPED, reported=UNKNOWN)
            out = _report(state, replace(gone, spec=replace(gone.spec, run_id=ev.event_id)), STOPPED,
                          REASON_NOT_RUNNING, now_ms)
            phase = phase_after(run.phase if run else NO_RUN, T_RELEASE)
            return state._with(replace(gone, phase=phase, reported=STOPPED, commands=seen)), [out], []
        if run.phase == P_BACKOFF:  # nothing to kill
            out = _report(state, run, STOPPED, REASON_STOP_COMMANDED, now_ms, run.exit_code)
            return (state._with(replace(run, phase=phase_after(run.phase, T_RELEASE), reported=STOPPED,
                                        restart_at_ms=None, commands=seen)), [out], [])
        if run.phase == P_KILLING:
            return state._with(replace(run, then=None, commands=seen)), [], []  # the kill is under way
        return state._with(replace(run, phase=phase_after(run.phase, T_KILL), then=None, commands=seen)), [], [
            _kill(task_id, WHY_COMMANDED)]
    raise AgentError(f"unknown task command {command!r}")


def _on_spawned(state: AgentState, task_id: str, now_ms: int):
    run = state.tasks.get(task_id)
    if run is None or run.phase != P_SPAWNING:
        return state, [], []
    events = []
    if run.reported != RUNNING:  # a local restart of a RUNNING task is not news
        events.append(_report(state, run, RUNNING, REASON_PROCESS_UP, now_ms))
    return state._with(replace(run, phase=phase_after(run.phase, T_SPAWNED), reported=RUNNING)), events, []


def _on_spawn_failed(state: AgentState, task_id: str, now_ms: int):
    run = state.tasks.get(task_id)
    if run is None or run.phase != P_SPAWNING:
        return state, [], []
    out = _report(state, run, FAILED, REASON_SPAWN_FAILED, now_ms)
    return state._with(replace(run, phase=phase_after(run.phase, T_SPAWN_FAILED), reported=FAILED)), [out], []


def _on_exited(state: AgentState, task_id: str, code: int | None, now_ms: int, policy: Policy):
    run = state.tasks.get(task_id)
    if run is None or run.phase not in HAS_PROCESS:
        return state, [], []  # not ours, or already accounted for
    if run.phase == P_KILLING:
        if run.then is not None:  # killed to run another spec
            return _start(state, task_id, run.then, run.reported, run.commands, now_ms, P_KILLING, T_KILLED_FOR_SPEC)
        out = _report(state, run, STOPPED, run.stop_reason or REASON_STOP_COMMANDED, now_ms, code)
        return state._with(replace(run, phase=phase_after(run.phase, T_KILLED), reported=STOPPED,
                                   exit_code=code, stop_reason="")), [out], []
    if code == 0:
        out = _report(state, run, STOPPED, REASON_EXITED, now_ms, 0)
        return state._with(replace(run, phase=phase_after(run.phase, T_EXITED_OK), reported=STOPPED,
                                   exit_code=0)), [out], []
    if run.restarts < policy.max_restarts:
        n = run.restarts + 1
        return state._with(replace(run, phase=phase_after(run.phase, T_CRASHED), restarts=n, exit_code=code,
                                   restart_at_ms=now_ms + policy.backoff(n))), [], []
    out = _report(state, run, FAILED, REASON_RESTART_LIMIT, now_ms, code)
    return state._with(replace(run, phase=phase_after(run.phase, T_GAVE_UP), reported=FAILED,
                               exit_code=code)), [out], []


def _on_suspended(state: AgentState, task_id: str, now_ms: int):
    run = state.tasks.get(task_id)
    if run is None or run.phase not in HAS_PROCESS:
        return state, [], []
    if run.phase == P_KILLING and run.then is None:  # a stop under way: done
        return _on_exited(state, task_id, None, now_ms, DEFAULT_POLICY)
    if run.phase == P_KILLING and run.then is not None:  # killed for a new spec: it starts with the agent (announced now)
        new = TaskRun(task_id=task_id, spec=run.then, phase=phase_after(run.phase, T_SUSPENDED),
                      reported=run.reported, restart_at_ms=now_ms, commands=run.commands)
        ev = _report(state, new, STARTING, REASON_SPAWNING, now_ms)
        return state._with(replace(new, reported=STARTING)), [ev], []
    # SPAWNING or RUNNING: started again when the agent is, no restart counted, nothing reported
    return state._with(replace(run, phase=phase_after(run.phase, T_SUSPENDED), restart_at_ms=now_ms)), [], []


def _on_orphaned(state: AgentState, task_id: str, now_ms: int, reason: str, why: str):
    """A task the agent must not run any more though no STOP came (``Orphaned``, ``Unplaced``): stopped."""
    run = state.tasks.get(task_id)
    if run is None or run.phase in (P_STOPPED, P_FAILED):
        return state, [], []
    if run.phase == P_BACKOFF:  # nothing to kill
        out = _report(state, run, STOPPED, reason, now_ms, run.exit_code)
        return state._with(replace(run, phase=phase_after(run.phase, T_RELEASE), reported=STOPPED,
                                   restart_at_ms=None)), [out], []
    if run.phase == P_KILLING:
        return state._with(replace(run, then=None, stop_reason=run.stop_reason or reason)), [], []
    return state._with(replace(run, phase=phase_after(run.phase, T_KILL), then=None, stop_reason=reason)), [], [
        _kill(task_id, why)]


def _on_tick(state: AgentState, now_ms: int):
    actions, tasks = [], None
    for task_id in sorted(state.tasks):
        run = state.tasks[task_id]
        if run.phase == P_BACKOFF and run.restart_at_ms is not None and run.restart_at_ms <= now_ms:
            tasks = dict(state.tasks) if tasks is None else tasks
            tasks[task_id] = replace(run, phase=phase_after(run.phase, T_BACKOFF_ELAPSED), restart_at_ms=None)
            actions.append(_spawn(run, WHY_RESTART_POLICY))
    if tasks is not None:
        state = replace(state, tasks=MappingProxyType(tasks))
    seq = state.sequence + 1
    hb = heartbeat(state.machine_id, state.incarnation, seq, state.live_task_ids(), now_ms)
    return replace(state, sequence=seq), [hb], actions


def refused_start(machine_id: str, cmd: Event, reason: str, now_ms: int) -> Event:
    """The FAILED report of a START/RESTART (a TaskCommanded) this agent will not run, e.g. because its machine
    cannot get the host profile the command requires (``hostprofile.py``)."""
    run = TaskRun(task_id=cmd.payload["task_id"], spec=_spec_of(cmd), phase=P_FAILED, reported=UNKNOWN)
    return _report(AgentState(machine_id), run, FAILED, reason, now_ms)


def held_start(machine_id: str, cmd: Event, reason: str, now_ms: int) -> Event:
    """The STARTING report of a START/RESTART this agent holds (``reason``: until its machine has the host profile
    the command requires, ``hostprofile.py``); the task's spawn reports STARTING again, under its own id."""
    run = TaskRun(task_id=cmd.payload["task_id"], spec=_spec_of(cmd), phase=P_SPAWNING, reported=UNKNOWN)
    ev = _report(AgentState(machine_id), run, STARTING, reason, now_ms)
    s = run.spec
    return replace(ev, event_id=derived_event_id(PRODUCER, machine_id, run.task_id, s.run_id, "held", reason))


COMMAND_TYPES = frozenset({"TaskCommanded", batches.TASKS_COMMANDED})  # what an agent reads of ``tasks``


def commands(ev: Event, machine_ok) -> list[Event]:
    """The commands of a TaskCommanded or TasksCommanded (else none) addressed to a machine ``machine_ok``
    accepts, as TaskCommanded events in the batch's order (each one a ``Command`` for that machine's ``decide``)."""
    return batches.command_events(ev, machine_ok)


def batch(reports: list[Event], producer: str, now_ms: int) -> list[Event]:
    """The TaskStateChanged reports of one step → TaskStatesChanged events, one per entitlement (split if big);
    each one's id is derived from its reports' ids. Other events are not reports: ``AgentError``."""
    if any(ev.type != "TaskStateChanged" for ev in reports):
        raise AgentError("only TaskStateChanged reports are batched")
    return batches.batch_reports(reports, producer=producer, timestamp_ms=now_ms)


def heartbeat(machine_id: str, incarnation: int, sequence: int, running_task_ids: list[str], now_ms: int) -> Event:
    """The AgentHeartbeat of one machine (shared with the simulated agents' idle machines)."""
    return new_event("AgentHeartbeat", {"machine_id": machine_id, "running_task_ids": running_task_ids,
                                        "sequence": sequence},
                     entitlement="", entity_id=machine_id, producer=f"{PRODUCER}/{machine_id}",
                     timestamp_ms=now_ms,
                     event_id=derived_event_id(PRODUCER, "heartbeat", machine_id, incarnation, sequence))


def forget_finished(state: AgentState) -> AgentState:
    """Drop STOPPED/FAILED tasks (bounded memory); a redelivered old command may then act again."""
    keep = {t: r for t, r in state.tasks.items() if r.phase not in (P_STOPPED, P_FAILED)}
    return state if len(keep) == len(state.tasks) else replace(state, tasks=MappingProxyType(keep))


# -- persistence (the process agent's state file) ---------------------------------------------------------------

def run_to_json(run: TaskRun) -> dict:
    def spec(s: Spec | None):
        return None if s is None else {"job_id": s.job_id, "entitlement": s.entitlement,
                                       "spec_version": s.spec_version, "argv": list(s.argv),
                                       "env": dict(s.env), "run_id": s.run_id}
    return {"task_id": run.task_id, "spec": spec(run.spec), "phase": run.phase, "reported": run.reported,
            "restarts": run.restarts, "restart_at_ms": run.restart_at_ms, "exit_code": run.exit_code,
            "then": spec(run.then), "commands": list(run.commands), "stop_reason": run.stop_reason}


def run_from_json(d: Mapping) -> TaskRun:
    def spec(s):
        return None if s is None else Spec(job_id=s["job_id"], entitlement=s["entitlement"],
                                           spec_version=s["spec_version"], argv=tuple(s["argv"]),
                                           env=tuple(sorted(s["env"].items())), run_id=s["run_id"])
    return TaskRun(task_id=d["task_id"], spec=spec(d["spec"]), phase=d["phase"], reported=d["reported"],
                   restarts=d["restarts"], restart_at_ms=d["restart_at_ms"], exit_code=d["exit_code"],
                   then=spec(d["then"]), commands=tuple(d["commands"]), stop_reason=d.get("stop_reason", ""))
