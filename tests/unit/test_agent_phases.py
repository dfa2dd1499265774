"""The agent's task phases: the table of legal changes (``decide.PHASE_CHANGES``), the function refusing any other
(``phase_after``), and seeded random input sequences showing ``decide`` changes a phase only as the table says."""
import itertools
import random

import pytest

from processors.agent import decide as d
from streams.events import new_event

NO = d.NO_RUN
# (phase, change, phase after): written out here as well, so that a change of the table is a change of this test
ROWS = [
    (NO, d.T_START, d.P_SPAWNING),
    (NO, d.T_RELEASE, d.P_STOPPED),
    (d.P_STOPPED, d.T_START, d.P_SPAWNING),
    (d.P_FAILED, d.T_START, d.P_SPAWNING),
    (d.P_FAILED, d.T_RELEASE, d.P_STOPPED),
    (d.P_SPAWNING, d.T_SPAWNED, d.P_RUNNING),
    (d.P_SPAWNING, d.T_SPAWN_FAILED, d.P_FAILED),
    (d.P_SPAWNING, d.T_KILL, d.P_KILLING),
    (d.P_SPAWNING, d.T_EXITED_OK, d.P_STOPPED),
    (d.P_SPAWNING, d.T_CRASHED, d.P_BACKOFF),
    (d.P_SPAWNING, d.T_GAVE_UP, d.P_FAILED),
    (d.P_SPAWNING, d.T_SUSPENDED, d.P_BACKOFF),
    (d.P_RUNNING, d.T_KILL, d.P_KILLING),
    (d.P_RUNNING, d.T_EXITED_OK, d.P_STOPPED),
    (d.P_RUNNING, d.T_CRASHED, d.P_BACKOFF),
    (d.P_RUNNING, d.T_GAVE_UP, d.P_FAILED),
    (d.P_RUNNING, d.T_SUSPENDED, d.P_BACKOFF),
    (d.P_BACKOFF, d.T_START, d.P_SPAWNING),
    (d.P_BACKOFF, d.T_BACKOFF_ELAPSED, d.P_SPAWNING),
    (d.P_BACKOFF, d.T_RELEASE, d.P_STOPPED),
    (d.P_KILLING, d.T_KILLED, d.P_STOPPED),
    (d.P_KILLING, d.T_KILLED_FOR_SPEC, d.P_SPAWNING),
    (d.P_KILLING, d.T_SUSPENDED, d.P_BACKOFF),
]
CHANGES = (d.T_START, d.T_SPAWNED, d.T_SPAWN_FAILED, d.T_KILL, d.T_RELEASE, d.T_KILLED, d.T_KILLED_FOR_SPEC,
           d.T_EXITED_OK, d.T_CRASHED, d.T_GAVE_UP, d.T_BACKOFF_ELAPSED, d.T_SUSPENDED)


def test_the_table_is_the_rows():
    assert {(p, c): to for p, c, to in ROWS} == dict(d.PHASE_CHANGES)
    assert {to for *_, to in ROWS} <= set(d.PHASES)
    assert {c for _, c, _ in ROWS} == set(CHANGES)


@pytest.mark.parametrize("phase,change,after", ROWS)
def test_a_legal_change(phase, change, after):
    assert d.phase_after(phase, change) == after


ILLEGAL = [(p, c) for p, c in itertools.product((NO, *d.PHASES), CHANGES) if (p, c) not in d.PHASE_CHANGES]


@pytest.mark.parametrize("phase,change", ILLEGAL)
def test_any_other_change_is_refused_naming_it(phase, change):
    with pytest.raises(d.IllegalPhaseChange) as exc:
        d.phase_after(phase, change)
    assert repr(change) in str(exc.value) and repr(phase) in str(exc.value)
    assert isinstance(exc.value, d.AgentError)


def test_no_way_out_of_a_stopped_task_but_a_start():
    assert sorted(c for p, c in d.PHASE_CHANGES if p == d.P_STOPPED) == [d.T_START]


TASKS = ("j/0", "j/1")


def _random_input(rng: random.Random, now: int):
    task = rng.choice(TASKS)
    kind = rng.randrange(10)
    if kind <= 2:
        command = rng.choice(("START", "START", "RESTART", "STOP"))
        spec = rng.choice((1, 1, 2))
        eid = f"c{rng.randrange(12)}-{task}-{command}-{spec}"  # repeats stand for redeliveries
        return d.Command(new_event("TaskCommanded", {
            "task_id": task, "job_id": "j", "machine_id": "m1", "command": command, "argv": ["sleep", "1"],
            "env": {}, "spec_version": spec, "reason": "test"}, entitlement="e1", entity_id=task,
            producer="scheduler", timestamp_ms=now, event_id=eid))
    return (d.Spawned(task), d.Spawned(task), d.SpawnFailed(task), d.Exited(task, rng.choice((0, 1, None))),
            d.Tick(), d.Suspended(task), d.Orphaned(task))[kind - 3]


@pytest.mark.parametrize("seed", range(40))
def test_decide_changes_phases_only_as_the_table_says(seed):
    rng = random.Random(seed)
    legal = {(p, to) for (p, _), to in d.PHASE_CHANGES.items()}
    policy = d.Policy(max_restarts=2, backoff_ms=50, max_backoff_ms=100)
    state, now, seen = d.initial_state("m1", incarnation=1), 0, set()
    for _ in range(300):
        now += rng.choice((0, 10, 60))
        inp = _random_input(rng, now)
        after, _, _ = d.decide(state, inp, now, policy)
        for task in TASKS:
            before_run, after_run = state.tasks.get(task), after.tasks.get(task)
            if after_run is None:
                continue
            was = before_run.phase if before_run is not None else NO
            if was != after_run.phase:
                assert (was, after_run.phase) in legal, (inp, was, after_run.phase)
                seen.add((was, after_run.phase))
        state = after
    assert len(seen) >= 8, seen  # the sequences reach most of the table
