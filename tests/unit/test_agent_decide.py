"""Table-driven tests of the agent's pure decisions: commands, duplicates, exits, the restart policy, ticks."""
import pytest

from processors.agent.decide import (
    FAILED, KILL, REASON_ALREADY_RUNNING, REASON_ALREADY_STOPPED, REASON_EXITED, REASON_NOT_IN_LOG, REASON_NOT_PLACED,
    REASON_NOT_RUNNING, REASON_PROCESS_UP, REASON_RESTART_LIMIT, REASON_SPAWN_FAILED, REASON_SPAWNING,
    REASON_STOP_COMMANDED, RUNNING, SPAWN, STARTING, STOPPED, UNKNOWN, WHY_NEW_SPEC, WHY_NOT_IN_LOG, WHY_NOT_PLACED, WHY_RESTART_POLICY, AgentError,
    Command, Exited, Orphaned, Policy, SpawnFailed, Spawned, Suspended, Tick, Unplaced, decide, forget_finished,
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
    # A log that was replaced (its START has another id) commands a task whose process the agent kept: nothing
    # starts, the task is reported RUNNING again under that command (the new log's scheduler waits for it).
    "start of a running task at the same spec (another command) is reported RUNNING again": (
        UP_ + [(cmd("START", eid="other"), 2), (cmd("START", eid="other"), 3)],
        UP_OUT + [([(RUNNING, RUNNING, REASON_ALREADY_RUNNING, None)], []), ([], [])]),
    "start of a task still starting at the same spec: its RUNNING comes with the spawn": (
        [(cmd("START"), 0), (cmd("START", eid="other"), 1), (Spawned("j/0"), 2)],
        [UP_OUT[0], ([], []), ([(RUNNING, STARTING, REASON_PROCESS_UP, None)], [])]),
    # `ropewalk down`: the agent kills its tasks; its next start runs them again, silently (no restart counted).
    "suspended by the agent's stop, started again at its next start": (
        UP_ + [(Suspended("j/0"), 2), (Tick(), 3), (Spawned("j/0"), 4)],
        UP_OUT + [([], []), ([], [(SPAWN, "j/0", WHY_RESTART_POLICY)]), ([], [])]),
    "suspended before its first spawn was confirmed: RUNNING once it is": (
        [(cmd("START"), 0), (Suspended("j/0"), 1), (Tick(), 2), (Spawned("j/0"), 3)],
        [UP_OUT[0], ([], []), ([], [(SPAWN, "j/0", WHY_RESTART_POLICY)]),
         ([(RUNNING, STARTING, REASON_PROCESS_UP, None)], [])]),
    "suspended while a stop was under way: STOPPED": (
        UP_ + [(cmd("STOP"), 2), (Suspended("j/0"), 3), (Tick(), 4)],
        UP_OUT + [([], [(KILL, "j/0", "commanded")]), ([(STOPPED, RUNNING, REASON_STOP_COMMANDED, None)], []),
                  ([], [])]),
    "suspended while killed for a new spec: the new one starts with the agent": (
        UP_ + [(cmd("START", spec=2), 2), (Suspended("j/0"), 3), (Tick(), 4), (Spawned("j/0"), 5)],
        UP_OUT + [([], [(KILL, "j/0", WHY_NEW_SPEC)]), ([(STARTING, RUNNING, REASON_SPAWNING, None)], []),
                  ([], [(SPAWN, "j/0", WHY_RESTART_POLICY)]), ([(RUNNING, STARTING, REASON_PROCESS_UP, None)], [])]),
    "suspension of a task without a process changes nothing": (
        UP_ + [(Exited("j/0", 3), 2), (Suspended("j/0"), 3), (Suspended("zz"), 4)],
        UP_OUT + [([], []), ([], []), ([], [])]),
    # A log that does not command the task (the agent's offsets belonged to another one): stopped.
    "orphaned: killed, STOPPED (not_in_log) on exit": (
        UP_ + [(Orphaned("j/0"), 2), (Exited("j/0", -15), 3)],
        UP_OUT + [([], [(KILL, "j/0", WHY_NOT_IN_LOG)]), ([(STOPPED, RUNNING, REASON_NOT_IN_LOG, -15)], [])]),
    # Issue 26: the allocations log placed the task elsewhere (or freed it) after a START the agent ran (a stale
    # shard's, read before the move): stopped, the report naming why; a STOP that comes meanwhile changes nothing.
    "unplaced: killed, STOPPED (not_placed) on exit": (
        UP_ + [(Unplaced("j/0"), 2), (cmd("STOP"), 3), (Exited("j/0", -15), 4)],
        UP_OUT + [([], [(KILL, "j/0", WHY_NOT_PLACED)]), ([], []), ([(STOPPED, RUNNING, REASON_NOT_PLACED, -15)], [])]),
    "unplaced in backoff: STOPPED at once; unknown, stopped or unplaced again: nothing": (
        UP_ + [(Exited("j/0", 3), 2), (Unplaced("j/0"), 3), (Unplaced("j/0"), 4), (Unplaced("zz"), 5)],
        UP_OUT + [([], []), ([(STOPPED, RUNNING, REASON_NOT_PLACED, 3)], []), ([], []), ([], [])]),
    "unplaced while killed for a new spec: the new spec is not run": (
        UP_ + [(cmd("START", spec=2), 2), (Unplaced("j/0"), 3), (Exited("j/0", -15), 4)],
        UP_OUT + [([], [(KILL, "j/0", WHY_NEW_SPEC)]), ([], []), ([(STOPPED, RUNNING, REASON_NOT_PLACED, -15)], [])]),
    "unplaced, then placed here again and started: runs, a later STOP reports stop_commanded": (
        UP_ + [(Unplaced("j/0"), 2), (Exited("j/0", -15), 3), (cmd("START", eid="back"), 4), (Spawned("j/0"), 5),
               (cmd("STOP"), 6), (Exited("j/0", -15), 7)],
        UP_OUT + [([], [(KILL, "j/0", WHY_NOT_PLACED)]), ([(STOPPED, RUNNING, REASON_NOT_PLACED, -15)], []),
                  ([(STARTING, STOPPED, REASON_SPAWNING, None)], [(SPAWN, "j/0", "commanded")]),
                  ([(RUNNING, STARTING, REASON_PROCESS_UP, None)], []), ([], [(KILL, "j/0", "commanded")]),
                  ([(STOPPED, RUNNING, REASON_STOP_COMMANDED, -15)], [])]),
    "orphaned in backoff: STOPPED at once; unknown or stopped: nothing": (
        UP_ + [(Exited("j/0", 3), 2), (Orphaned("j/0"), 3), (Orphaned("j/0"), 4), (Orphaned("zz"), 5)],
        UP_OUT + [([], []), ([(STOPPED, RUNNING, REASON_NOT_IN_LOG, 3)], []), ([], []), ([], [])]),
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
    "another stop while killing waits; one after is answered STOPPED again, its redelivery not": (
        UP_ + [(cmd("STOP"), 2), (cmd("STOP", eid="s2"), 3), (Exited("j/0", -15), 4), (cmd("STOP", eid="s3"), 5),
               (cmd("STOP", eid="s3"), 6)],
        UP_OUT + [([], [(KILL, "j/0", "commanded")]), ([], []),
                  ([(STOPPED, RUNNING, REASON_STOP_COMMANDED, -15)], []),
                  ([(STOPPED, STOPPED, REASON_ALREADY_STOPPED, -15)], []), ([], [])]),
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


# -- batches: a job's TasksCommanded in, one TaskStatesChanged per entitlement out --------------------------------

from processors.agent.decide import batch, commands  # noqa: E402
from streams import batches  # noqa: E402


def tasks_commanded(rows, eid="batch-1", ent="e1"):
    """A TasksCommanded of job j: rows (task, machine, command, spec)."""
    return new_event("TasksCommanded", {
        "job_id": "j", "argv": ["sleep", "30"], "env": {"A": "1"},
        "commands": [{"task_id": t, "machine_id": m, "command": c, "spec_version": v, "reason": "placed"}
                     for t, m, c, v in rows], "part": 0, "parts": 1},
        entitlement=ent, entity_id="j", producer="scheduler", timestamp_ms=1, event_id=eid)


BATCH = tasks_commanded([("j/0", "m1", "START", 1), ("j/1", "m2", "START", 1), ("j/2", "m1", "STOP", 1)])

COMMANDS_FOR = {  # machine -> (task, command, argv) it keeps
    "m1": [("j/0", "START", ["sleep", "30"]), ("j/2", "STOP", [])],
    "m2": [("j/1", "START", ["sleep", "30"])],
    "m9": [],
}


@pytest.mark.parametrize("machine, expected", COMMANDS_FOR.items(), ids=COMMANDS_FOR)
def test_each_agent_keeps_the_commands_addressed_to_its_machine(machine, expected):
    got = commands(BATCH, machine.__eq__)
    assert [(c.payload["task_id"], c.payload["command"], c.payload["argv"]) for c in got] == expected
    for c in got:
        assert c.type == "TaskCommanded" and c.entitlement == "e1" and c.payload["env"] == (
            {"A": "1"} if c.payload["command"] != "STOP" else {})
        position = [r["task_id"] for r in BATCH.payload["commands"]].index(c.payload["task_id"])
        assert c.event_id == batches.command_id(BATCH.event_id, position)  # derived: the same on redelivery
        REG.encode("TaskCommanded", c.to_record(1))


def test_a_redelivered_batch_command_is_a_no_op():
    state = initial_state(M, incarnation=7)
    (start,) = [c for c in commands(BATCH, M.__eq__) if c.payload["command"] == "START"]
    state, events, actions = decide(state, Command(start), 0, POLICY)
    assert [e.payload["state"] for e in events] == [STARTING] and len(actions) == 1
    (again,) = [c for c in commands(BATCH, M.__eq__) if c.payload["command"] == "START"]
    assert decide(state, Command(again), 1, POLICY) == (state, [], [])


def test_an_old_single_task_command_is_read_as_before():
    old = cmd("START").event
    assert commands(old, M.__eq__) == [old] and commands(old, "m2".__eq__) == []


def report_events(rows):
    """TaskStateChanged reports of one step: rows (entitlement, task, state)."""
    state = initial_state(M, incarnation=7)
    out = []
    for ent, task, st in rows:
        out.append(new_event("TaskStateChanged", {
            "task_id": task, "job_id": task.split("/")[0], "machine_id": M, "state": st, "previous_state": UNKNOWN,
            "exit_code": None, "spec_version": 1, "reason": REASON_SPAWNING}, entitlement=ent, entity_id=task,
            producer=f"agent/{M}", causation_id=f"run-{task}", timestamp_ms=5, event_id=f"r-{ent}-{task}-{st}"))
    assert state is not None
    return out


BATCHES = {  # reports (entitlement, task, state) -> per batch: (entitlement, [(task, state)])
    "one entitlement: one batch": ([("e1", "a/0", STARTING), ("e1", "a/1", STARTING), ("e1", "a/0", RUNNING)],
                                   [("e1", [("a/0", STARTING), ("a/1", STARTING), ("a/0", RUNNING)])]),
    "two entitlements: one batch each, reports in order": (
        [("e1", "a/0", STARTING), ("e2", "b/0", STARTING), ("e1", "a/0", RUNNING)],
        [("e1", [("a/0", STARTING), ("a/0", RUNNING)]), ("e2", [("b/0", STARTING)])]),
    "nothing: nothing": ([], []),
}


@pytest.mark.parametrize("rows, expected", BATCHES.values(), ids=BATCHES)
def test_reports_of_a_step_go_out_as_one_batch_per_entitlement(rows, expected):
    reports = report_events(rows)
    out = batch(reports, "agent/m1", 9)
    assert [(e.entitlement, [(r["task_id"], r["state"]) for r in e.payload["reports"]]) for e in out] == expected
    for e in out:
        REG.encode(e.type, e.to_record(1))
        assert e.type == "TaskStatesChanged" and e.producer == "agent/m1" and e.timestamp_ms == 9
        ids = [r["report_id"] for r in e.payload["reports"]]
        assert e.event_id == batches.batch_id("TaskStatesChanged", ids)  # derived from its content
        assert all(r["cause_id"].startswith("run-") for r in e.payload["reports"])  # the run's command
    assert batch(reports, "agent/m1", 99)[0].event_id == out[0].event_id if out else True  # time is not content


def test_a_huge_step_is_split_below_the_record_limit():
    reports = report_events([("e1", f"big/{i}", STARTING) for i in range(12_000)])
    out = batch(reports, "agent/simulated", 1)
    sizes = [len(e.payload["reports"]) for e in out]
    assert len(out) >= 3 and sum(sizes) == 12_000 and max(sizes) <= batches.MAX_ITEMS
    assert [r["task_id"] for e in out for r in e.payload["reports"]] == [f"big/{i}" for i in range(12_000)]
    assert max(len(REG.encode(e.type, e.to_record(1))) for e in out) < batches.MAX_RECORD_BYTES
    assert len({e.event_id for e in out}) == len(out)


def test_only_reports_are_batched():
    with pytest.raises(AgentError):
        batch([new_event("AgentHeartbeat", {"machine_id": M, "running_task_ids": [], "sequence": 1},
                         entitlement="", entity_id=M, producer="agent/m1")], "agent/m1", 1)
