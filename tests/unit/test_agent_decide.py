"""Table-driven tests of the agent's pure decisions: commands, duplicates, exits, the restart policy, ticks."""
import pytest

from processors.agent.decide import (
    FAILED, KILL, REASON_EXITED, REASON_NOT_RUNNING, REASON_PROCESS_UP, REASON_RESTART_LIMIT, REASON_SPAWN_FAILED,
    REASON_SPAWNING, REASON_STOP_COMMANDED, RUNNING, SPAWN, STARTING, STOPPED, UNKNOWN, WHY_NEW_SPEC,
    WHY_RESTART_POLICY, AgentError, Command, Exited, Policy, SpawnFailed, Spawned, Tick, decide, forget_finished,
    initial_state, run_from_json, run_to_json,
)
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
M = "m1"
POLICY = Policy(max_restarts=2, backoff_ms=100, max_backoff_ms=150)


def cmd(command, task="j/0", spec=1, eid=None, machine=M, argv=("sleep", "30")):
    return Command(new_event("TaskCommanded", {
        "task_id": task, "job_id": "j", "machine_id": machine, "command": command, "argv": list(argv),
        "env": {"A": "1"}, "spec_version": spec, "reason": "placed"},
        entitlement="e1", entity_id=task, producer="scheduler", timestamp_ms=1,
        event_id=eid or f"c-{command}-{task}-{spec}"))


def run(steps, state=None):
    """Feed (input, now_ms) pairs; return the state and, per step, (reports, actions) in compact form."""
    state = state or initial_state(M, incarnation=7)
    out = []
    for inp, now in steps:
        state, events, actions = decide(state, inp, now, POLICY)
        for ev in events:  # every event must be encodable with its schema
            REG.encode(ev.type, ev.to_record(1))
        out.append(([(e.payload["state"], e.payload["previous_state"], e.payload["reason"], e.payload["exit_code"])
                     for e in events if e.type == "TaskStateChanged"],
                    [(a.kind, a.task_id, a.reason) for a in actions]))
    return state, out


UP_ = [(cmd("START"), 0), (Spawned("j/0"), 1)]
UP_OUT = [([(STARTING, UNKNOWN, REASON_SPAWNING, None)], [(SPAWN, "j/0", "commanded")]),
          ([(RUNNING, STARTING, REASON_PROCESS_UP, None)], [])]

CASES = {
    "start runs": (UP_, UP_OUT),
    "duplicate start (same event id) is a no-op": (UP_ + [(cmd("START"), 2)], UP_OUT + [([], [])]),
    "start of a running task at the same spec is a no-op": (
        UP_ + [(cmd("START", eid="other"), 2)], UP_OUT + [([], [])]),
    "start at a new spec kills, then runs the new one": (
        UP_ + [(cmd("START", spec=2), 2), (Exited("j/0", -15), 3), (Spawned("j/0"), 4)],
        UP_OUT + [([], [(KILL, "j/0", WHY_NEW_SPEC)]),
                  ([(STARTING, RUNNING, REASON_SPAWNING, None)], [(SPAWN, "j/0", "commanded")]),
                  ([(RUNNING, STARTING, REASON_PROCESS_UP, None)], [])]),
    "restart of a running task kills and respawns": (
        UP_ + [(cmd("RESTART"), 2), (Exited("j/0", -15), 3)],
        UP_OUT + [([], [(KILL, "j/0", WHY_NEW_SPEC)]),
                  ([(STARTING, RUNNING, REASON_SPAWNING, None)], [(SPAWN, "j/0", "commanded")])]),
    "stop kills, STOPPED on exit": (
        UP_ + [(cmd("STOP"), 2), (Exited("j/0", -15), 3)],
        UP_OUT + [([], [(KILL, "j/0", "commanded")]), ([(STOPPED, RUNNING, REASON_STOP_COMMANDED, -15)], [])]),
    "duplicate stop while killing and after": (
        UP_ + [(cmd("STOP"), 2), (cmd("STOP", eid="s2"), 3), (Exited("j/0", -15), 4), (cmd("STOP", eid="s3"), 5)],
        UP_OUT + [([], [(KILL, "j/0", "commanded")]), ([], []),
                  ([(STOPPED, RUNNING, REASON_STOP_COMMANDED, -15)], []), ([], [])]),
    "stop of an unknown task is answered STOPPED": (
        [(cmd("STOP"), 0)], [([(STOPPED, UNKNOWN, REASON_NOT_RUNNING, None)], [])]),
    "command for another machine is ignored": ([(cmd("START", machine="m2"), 0)], [([], [])]),
    "exit 0 is STOPPED, no restart": (
        UP_ + [(Exited("j/0", 0), 2), (Tick(), 1000)],
        UP_OUT + [([(STOPPED, RUNNING, REASON_EXITED, 0)], []), ([], [])]),
    "crash restarts after backoff, silently, then FAILED after the limit": (
        UP_ + [(Exited("j/0", 3), 10), (Tick(), 50), (Tick(), 110), (Spawned("j/0"), 111),
               (Exited("j/0", 3), 120), (Tick(), 269), (Tick(), 270), (Spawned("j/0"), 271), (Exited("j/0", 3), 280)],
        UP_OUT + [([], []), ([], []), ([], [(SPAWN, "j/0", WHY_RESTART_POLICY)]), ([], []),
                  ([], []), ([], []), ([], [(SPAWN, "j/0", WHY_RESTART_POLICY)]), ([], []),
                  ([(FAILED, RUNNING, REASON_RESTART_LIMIT, 3)], [])]),
    "crash while starting (exit before Spawned) also restarts": (
        [(cmd("START"), 0), (Exited("j/0", 1), 1), (Tick(), 101)],
        [UP_OUT[0], ([], []), ([], [(SPAWN, "j/0", WHY_RESTART_POLICY)])]),
    "stop during backoff is STOPPED at once": (
        UP_ + [(Exited("j/0", 3), 10), (cmd("STOP"), 20), (Tick(), 500)],
        UP_OUT + [([], []), ([(STOPPED, RUNNING, REASON_STOP_COMMANDED, 3)], []), ([], [])]),
    "spawn failure is FAILED": (
        [(cmd("START"), 0), (SpawnFailed("j/0", "no such file"), 1)],
        [UP_OUT[0], ([(FAILED, STARTING, REASON_SPAWN_FAILED, None)], [])]),
    "start after FAILED runs again": (
        [(cmd("START"), 0), (SpawnFailed("j/0"), 1), (cmd("RESTART"), 2)],
        [UP_OUT[0], ([(FAILED, STARTING, REASON_SPAWN_FAILED, None)], []),
         ([(STARTING, FAILED, REASON_SPAWNING, None)], [(SPAWN, "j/0", "commanded")])]),
    "exit of an unknown task is ignored": ([(Exited("zz", 1), 0)], [([], [])]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sequences(name):
    steps, expected = CASES[name]
    _, out = run(steps)
    assert out == expected


def test_event_ids_are_deterministic_and_distinct():
    steps = UP_ + [(Exited("j/0", 3), 10), (Tick(), 200), (Spawned("j/0"), 201), (cmd("STOP"), 300),
                   (Exited("j/0", -15), 301)]
    ids = []
    for _ in range(2):
        state, got = initial_state(M, incarnation=7), []
        for inp, now in steps:
            state, events, _ = decide(state, inp, now, POLICY)
            got += [e.event_id for e in events]
        ids.append(got)
    assert ids[0] == ids[1]
    assert len(set(ids[0])) == len(ids[0])


def test_reports_carry_task_fields_and_causation():
    state, events, actions = decide(initial_state(M), cmd("START", spec=4), 5, POLICY)
    (ev,), (act,) = events, actions
    assert ev.entitlement == "e1" and ev.entity_id == "j/0" and ev.causation_id == "c-START-j/0-4"
    assert ev.payload["spec_version"] == 4 and ev.payload["machine_id"] == M and ev.payload["job_id"] == "j"
    assert act.argv == ("sleep", "30") and act.env == {"A": "1"} and act.spec_version == 4


def test_heartbeats_increase_and_list_live_tasks():
    state, _ = run(UP_ + [(cmd("START", task="j/1"), 2), (cmd("STOP", task="j/1"), 3), (Exited("j/1", 0), 4)])
    state, (hb1,), _ = decide(state, Tick(), 10, POLICY)
    state, (hb2,), _ = decide(state, Tick(), 20, POLICY)
    assert hb1.type == "AgentHeartbeat" and hb1.payload["running_task_ids"] == ["j/0"]
    assert (hb1.payload["sequence"], hb2.payload["sequence"]) == (1, 2)
    assert hb1.event_id != hb2.event_id and hb1.entity_id == M
    REG.encode("AgentHeartbeat", hb1.to_record(1))
    # another incarnation of the agent does not reuse heartbeat ids
    _, (other,), _ = decide(initial_state(M, incarnation=8), Tick(), 10, POLICY)
    assert other.payload["sequence"] == 1 and other.event_id != hb1.event_id


def test_policy_backoff_doubles_and_caps():
    p = Policy(max_restarts=5, backoff_ms=100, max_backoff_ms=350)
    assert [p.backoff(n) for n in (1, 2, 3, 4)] == [100, 200, 350, 350]


def test_unknown_inputs_raise():
    with pytest.raises(AgentError):
        decide(initial_state(M), object(), 0)
    bad = new_event("TaskStateChanged", {}, entitlement="e", entity_id="t", producer="x")
    with pytest.raises(AgentError, match="expected a TaskCommanded"):
        decide(initial_state(M), Command(bad), 0)


def test_json_round_trip_and_forget_finished():
    state, _ = run(UP_ + [(cmd("START", spec=2), 2), (cmd("START", task="j/1"), 3), (SpawnFailed("j/1"), 4)])
    for r in state.tasks.values():
        assert run_from_json(run_to_json(r)) == r
    assert set(forget_finished(state).tasks) == {"j/0"}
