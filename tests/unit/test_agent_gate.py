"""An agent runs only what the scheduler signed and the allocator placed (processors/agent/gate.py): the verdict
table, the fold of allocations, the wait for the fold to catch up, the freshness of commands, the answers to forged
ones, and the refusal event."""
import dataclasses
import json

import pytest

from processors.agent import gate as g
from streams.events import new_event


def cmd(command="START", task="e1.web/0", machine="m1", job="e1.web", entitlement="e1", producer="scheduler",
        event_id="c1"):
    return new_event("TaskCommanded", {"task_id": task, "job_id": job, "machine_id": machine, "command": command,
                                       "argv": ["sh", "-c", "id > pwned.txt"], "env": {}, "spec_version": 1,
                                       "reason": ""}, entitlement=entitlement, entity_id=task, producer=producer,
                     event_id=event_id)


def allocated(placements, job="e1.web", entitlement="e1"):
    return new_event("TasksAllocated", {"request_id": "r", "job_id": job, "placements": [
        {"task_id": t, "machine_id": m, "dc": "d", "msb": "s", "rack": "r"} for t, m in placements.items()],
        "filter_rejections": {}, "fault_domain_bins": {}, "machines_added": [], "cache_hit": False,
        "commit_attempts": 1}, entitlement=entitlement, entity_id=job, producer="allocator")


def deallocated(placements, job="e1.web", entitlement="e1"):
    return new_event("TasksDeallocated", {"request_id": "r2", "job_id": job, "machines_released": [], "placements": [
        {"task_id": t, "machine_id": m, "dc": "d", "msb": "s", "rack": "r"} for t, m in placements.items()]},
        entitlement=entitlement, entity_id=job, producer="allocator")


def proven(ev, identity):
    """``ev`` as a reader hands it over once its proof verified as ``identity``'s (streams/auth.py)."""
    return dataclasses.replace(ev, identity=identity)


HERE = g.Placement("m1", "e1", "e1.web")
VERDICTS = [
    # command, placement held for its task, verdict
    (cmd(), HERE, None),
    (cmd("RESTART"), HERE, None),
    (cmd(producer="scheduler/3"), HERE, None),
    (cmd(), None, g.REFUSED_NOT_ALLOCATED),  # no allocation at all (the issue's forged START)
    (cmd(), g.Placement("m2", "e1", "e1.web"), g.REFUSED_NOT_ALLOCATED),  # placed on another machine
    (cmd(entitlement="e2"), HERE, g.REFUSED_OTHER_ENTITLEMENT),
    (cmd(job="e1.other"), HERE, g.REFUSED_OTHER_JOB),
    (cmd(producer="cli"), HERE, g.REFUSED_NOT_SCHEDULER),
    (cmd(producer="schedulerx"), HERE, g.REFUSED_NOT_SCHEDULER),
    (cmd("STOP"), None, None),  # STOP is not judged by the placement
    # issue 27: who wrote it is what its proof says, not what its envelope claims
    (proven(cmd(), "scheduler"), HERE, None),
    (proven(cmd(producer="cli"), "operator"), HERE, None),  # the operator's direct path (a super user)
    (proven(cmd(), "machine/m7"), HERE, g.REFUSED_NOT_SCHEDULER),  # says scheduler, proven to be a machine's
    (proven(cmd("STOP"), "machine/m7"), None, g.REFUSED_NOT_SCHEDULER),  # a forged STOP
    (proven(cmd("STOP"), "health"), HERE, g.REFUSED_NOT_SCHEDULER),
    (cmd("STOP", producer="agent/m7"), None, g.REFUSED_NOT_SCHEDULER),  # a region without keys: the producer
]


@pytest.mark.parametrize("command,held,expected", VERDICTS)
def test_verdict(command, held, expected):
    assert g.verdict(command, held) == expected


def test_fold_places_moves_and_frees():
    gate = g.Gate({"m1", "m2"}.__contains__)
    gate.fold(allocated({"e1.web/0": "m1", "e1.web/1": "m9", "e1.web/2": "m2"}))
    assert gate.held == {"e1.web/0": HERE, "e1.web/2": g.Placement("m2", "e1", "e1.web")}
    gate.fold(allocated({"e1.web/0": "m9"}))  # moved to a machine of another agent: not ours any more
    assert "e1.web/0" not in gate.held
    gate.fold(deallocated({"e1.web/2": "m1"}))  # freed from another machine than ours: ours stays
    assert "e1.web/2" in gate.held
    gate.fold(deallocated({"e1.web/2": "m2"}))
    assert gate.held == {}


def test_a_start_read_before_its_placement_waits_then_runs():
    gate = g.Gate("m1".__eq__)
    assert gate.admit(cmd(), mark=1) == g.WAIT
    assert gate.fold(allocated({"e1.web/1": "m1"})) == []  # another task: still waiting
    assert [c.event_id for c in gate.fold(allocated({"e1.web/0": "m1"}))] == ["c1"]
    assert gate.waiting == [] and gate.expire(99) == []


def test_a_start_never_placed_is_refused_once_the_fold_caught_up():
    gate = g.Gate("m1".__eq__)
    assert gate.admit(cmd(event_id="old"), mark=1) == g.WAIT
    assert gate.admit(cmd(task="e1.web/5", event_id="new"), mark=3) == g.WAIT
    done = gate.expire(2)  # the fold read what was written before mark 2's commands only
    assert [(c.event_id, why) for c, why, _ in done] == [("old", g.REFUSED_NOT_ALLOCATED)]
    assert [c.event_id for _, c in gate.waiting] == ["new"]


def test_not_from_the_scheduler_is_refused_at_once():
    gate = g.Gate("m1".__eq__)
    gate.fold(allocated({"e1.web/0": "m1"}))
    assert gate.admit(cmd(producer="agent/m7"), mark=1) == g.REFUSED_NOT_SCHEDULER
    assert gate.waiting == []


def test_refusal_event_names_the_reason_and_is_idempotent():
    a = g.refusal(cmd(), g.REFUSED_NOT_ALLOCATED, None, 1000)
    b = g.refusal(cmd(), g.REFUSED_NOT_ALLOCATED, None, 2000)
    assert a.type == "TaskCommandRefused" and a.event_id == b.event_id and a.causation_id == "c1"
    assert a.payload["reason"] == g.REFUSED_NOT_ALLOCATED and "e1.web/0" in a.payload["message"]
    other = g.refusal(cmd(entitlement="e2"), g.REFUSED_OTHER_ENTITLEMENT, HERE, 1000)
    assert "for entitlement e1, not e2" in other.payload["message"]


def test_gate_state_survives_a_restart():
    gate = g.Gate("m1".__eq__)
    gate.fold(allocated({"e1.web/0": "m1"}))
    gate.admit(cmd(task="e1.web/9", event_id="w"), mark=5)
    again = g.Gate("m1".__eq__)
    again.load_json(gate.to_json())
    assert again.held == gate.held
    assert [(c.event_id, c.payload) for _, c in again.waiting] == [(c.event_id, c.payload) for _, c in gate.waiting]
    assert [c.event_id for c, _, _ in again.expire(0)] == ["w"]  # judged by the first expiry after the restart


class FakeConsumer:
    """What Judge asks of its consumer: the allocations' high watermarks and how far it read (no broker)."""

    def __init__(self):
        self.high = {("a", 0): 5}
        self.read = {}

    def high_watermarks(self, partitions):
        return {tp: self.high[tp] for tp in partitions}

    def read_up_to(self, targets, start):
        return all(self.read.get(tp, 0) >= off for tp, off in targets.items())


def test_judge_refuses_only_after_reading_up_to_the_watermark_measured_after_the_command():
    judge = g.Judge(g.Gate("m1".__eq__), [("a", 0)])
    batch = new_event("TasksCommanded", {"job_id": "e1.web", "argv": ["x"], "env": {}, "part": 0, "parts": 1,
                                         "commands": [{"task_id": "e1.web/0", "machine_id": "m1", "command": "START",
                                                       "spec_version": 1, "reason": ""}]},
                      entitlement="e1", entity_id="e1.web", producer="scheduler")
    assert judge.take([batch], "m1".__eq__, 0) == []
    consumer = FakeConsumer()
    assert judge.refusals(consumer, 0) == []  # measures the watermark: 5
    consumer.read[("a", 0)] = 4
    assert judge.refusals(consumer, 0) == []  # not there yet
    consumer.read[("a", 0)] = 5
    [refused] = judge.refusals(consumer, 0)
    assert refused.payload["reason"] == g.REFUSED_NOT_ALLOCATED and judge.gate.waiting == []


def at(ev, ms):
    return dataclasses.replace(ev, timestamp_ms=ms)


def test_a_command_older_than_the_last_applied_is_refused_as_stale():
    """A copy of an old, genuinely signed command (its proof verifies) written again: refused, for STOP too."""
    gate = g.Gate("m1".__eq__)
    gate.fold(allocated({"e1.web/0": "m1"}))
    assert gate.admit(proven(at(cmd(event_id="start"), 2000), "scheduler"), mark=1) == g.ADMIT
    assert gate.admit(proven(at(cmd("STOP", event_id="old-stop"), 1000), "scheduler"), mark=2) == g.REFUSED_STALE
    assert gate.admit(proven(at(cmd("STOP", event_id="stop"), 3000), "scheduler"), mark=3) == g.ADMIT
    assert gate.admit(proven(at(cmd(event_id="start"), 2000), "scheduler"), mark=4) == g.REFUSED_STALE
    assert gate.waiting == []
    gate.fold(deallocated({"e1.web/0": "m1"}))  # freed from here: its commands' times are forgotten with it
    assert gate.last == {}
    gate.fold(allocated({"e1.web/0": "m1"}))
    assert gate.admit(proven(at(cmd(event_id="again"), 1500), "scheduler"), mark=5) == g.ADMIT


def test_a_start_released_by_its_placement_counts_as_applied():
    gate = g.Gate("m1".__eq__)
    assert gate.admit(proven(at(cmd(), 2000), "scheduler"), mark=1) == g.WAIT
    assert [c.event_id for c in gate.fold(allocated({"e1.web/0": "m1"}))] == ["c1"]
    assert gate.last == {"e1.web/0": 2000}
    assert gate.admit(proven(at(cmd("STOP", event_id="s"), 1999), "scheduler"), mark=2) == g.REFUSED_STALE


def batch(lines, event_id="b1"):
    return new_event("TasksCommanded", {"job_id": "e1.web", "argv": ["x"], "env": {}, "part": 0, "parts": 1,
                                        "host_profile": None, "resources": None,
                                        "commands": [{"task_id": t, "machine_id": m, "command": "START",
                                                      "spec_version": 1, "reason": ""} for t, m in lines]},
                     entitlement="e1", entity_id="e1.web", producer="scheduler", event_id=event_id)


def test_a_forged_batch_is_answered_for_our_machines_only():
    out = g.forged(batch([("e1.web/0", "m1"), ("e1.web/1", "m2")]), "bad_proof", "the proof of scheduler does not "
                   "verify", "m1".__eq__, 1000)
    assert [(e.payload["task_id"], e.payload["reason"], e.producer) for e in out] == [("e1.web/0", "bad_proof",
                                                                                       "agent/m1")]
    assert "does not verify" in out[0].payload["message"]


class Refusing:
    """A consumer that refused records for their proof (``EventConsumer(keep_refused=True).refused``)."""

    def __init__(self, *refused):
        self.refused = list(refused)


class Letters:
    def __init__(self):
        self.routed = []

    def route(self, **kw):
        self.routed.append(kw)


def test_the_judge_answers_and_dead_letters_only_what_concerns_its_machines():
    judge = g.Judge(g.Gate("m1".__eq__), [])
    where = {"topic": "tasks", "partition": 0, "offset": 7, "key": b"e1", "value": b"..."}
    ours, theirs = batch([("e1.web/0", "m1")]), batch([("e1.web/1", "m2")], event_id="b2")
    consumer, letters = Refusing((ours, "unsigned", "no proof", where),
                                 (theirs, "unsigned", "no proof", {**where, "offset": 8})), Letters()
    assert judge.take_refused(consumer, "m1".__eq__, 1000, letters) == 1
    assert consumer.refused == []
    assert [(e.payload["task_id"], e.payload["reason"]) for e in judge.refused] == [("e1.web/0", "unsigned")]
    assert [(d["offset"], d["reason"]) for d in letters.routed] == [(7, "unsigned")]


def test_the_gate_keeps_the_times_and_the_proven_identities_across_a_restart():
    gate = g.Gate("m1".__eq__)
    gate.fold(allocated({"e1.web/0": "m1"}))
    gate.admit(proven(at(cmd(), 2000), "scheduler"), mark=1)
    gate.admit(proven(cmd(task="e1.web/9", event_id="w"), "scheduler"), mark=2)
    again = g.Gate("m1".__eq__)
    again.load_json(gate.to_json())
    assert again.last == {"e1.web/0": 2000}
    assert [c.identity for _, c in again.waiting] == ["scheduler"]


# -- issue 26: a START read before the move it is stale for ------------------------------------------------------
# A scheduler shard paused past its group's session timeout wakes up stale and commands a task where it was; an agent
# whose fold of ``allocations`` has not read the move yet admits it (its fold places the task here). Once the fold
# has read the move and caught up with the high watermarks measured after it, the Judge names the task to stop
# there (``take_stops``; the wiring stops it if it runs it: ``decide.Unplaced``). Steps: ("fold", allocations
# event), ("cmd", command), ("final",): the consumer reads up to the watermarks and the verdicts become final.
# Expected: the commands admitted, the refusals' reasons, the stops, in order.
T = "e1.web/0"


def start(event_id, ms, machine="m1"):
    return at(cmd(task=T, machine=machine, event_id=event_id), ms)


STALE_START_CASES = {
    "fresh START: placed here, admitted, nothing stopped": (
        [("fold", allocated({T: "m1"})), ("cmd", start("s1", 10)), ("final",)],
        ["s1"], [], []),
    "START racing ahead of its placement: waits, admitted when the fold reads it": (
        [("cmd", start("s1", 10)), ("fold", allocated({T: "m1"})), ("final",)],
        ["s1"], [], []),
    "stale START, fold behind the move: admitted, then stopped once the fold is final": (
        [("fold", allocated({T: "m1"})), ("cmd", start("s1", 10)), ("fold", allocated({T: "m9"})), ("final",)],
        ["s1"], [], [(T, "m1")]),
    "stale START, fold behind a free: admitted, then stopped": (
        [("fold", allocated({T: "m1"})), ("cmd", start("s1", 10)), ("fold", deallocated({T: "m1"})), ("final",)],
        ["s1"], [], [(T, "m1")]),
    "stale START read after the fold saw the move: waits, refused (nothing runs)": (
        [("fold", allocated({T: "m1"})), ("fold", allocated({T: "m9"})), ("cmd", start("s1", 10)), ("final",)],
        [], [g.REFUSED_NOT_ALLOCATED], [(T, "m1")]),  # the stop finds no run: the wiring does nothing
    "moved away and back before the fold is final: not stopped": (
        [("fold", allocated({T: "m1"})), ("cmd", start("s1", 10)), ("fold", allocated({T: "m9"})),
         ("fold", allocated({T: "m1"})), ("final",)],
        ["s1"], [], []),
    "moved back after a stop: the new START runs": (
        [("fold", allocated({T: "m1"})), ("cmd", start("s1", 10)), ("fold", allocated({T: "m9"})), ("final",),
         ("fold", allocated({T: "m1"})), ("cmd", start("s2", 20)), ("final",)],
        ["s1", "s2"], [], [(T, "m1")]),
    "moved between two machines of this agent (simulated): stopped on the one it left": (
        [("fold", allocated({T: "m1"})), ("cmd", start("s1", 10)), ("fold", allocated({T: "m2"})),
         ("cmd", start("s2", 20, machine="m2")), ("final",)],
        ["s1", "s2"], [], [(T, "m1")]),
    "placed on another agent's machine, never here: nothing to stop": (
        [("fold", allocated({T: "m9"})), ("fold", allocated({T: "m8"})), ("final",)],
        [], [], []),
}


MACHINES = {"m1", "m2"}.__contains__


def restarted(judge):
    """The agent killed and started again: a new Judge from the state file ``judge`` last wrote (a JSON round trip).
    The wiring saves it with the offsets past every record it folded; what it read after its last save it reads
    again (the records' offsets were not saved), so a kill at any moment is a restart just after a save."""
    again = g.Judge(g.Gate(MACHINES), judge.partitions)
    again.load_json(json.loads(json.dumps(judge.to_json())))
    return again


def run(steps, restart_at=None):
    """The case's steps through a Judge; at the ``restart_at``-th moment (a step, a look of ``refusals``, a stop
    made), the agent restarts (``restarted``). Returns (admitted, refused, stops) and the number of moments."""
    judge = g.Judge(g.Gate(MACHINES), [("a", 0)])
    consumer = FakeConsumer()
    got_admitted, got_refused, got_stops = [], [], []
    moments = 0

    def moment(j):
        nonlocal moments
        moments += 1
        return restarted(j) if moments == restart_at else j

    for step in steps:
        judge = moment(judge)
        if step[0] == "final":
            consumer.high[("a", 0)] += 1
            consumer.read[("a", 0)] = consumer.high[("a", 0)]
            for _ in range(4):  # measures the watermarks, then (read up to them) the verdicts are final
                got_refused += [ev.payload["reason"] for ev in judge.refusals(consumer, 0)]
                if not judge.gate.waiting and not judge.unplacing:
                    break
                judge = moment(judge)
            while judge.stops:  # each stop made (and saved) before the next is taken
                got_stops.append(next(judge.take_stops()))
                judge = moment(judge)
        else:
            got_admitted += [c.event_id for c in judge.take([step[1]], MACHINES, 0)]
            assert list(judge.take_stops()) == []  # never before the fold is final
    assert judge.unplacing == [] and judge.gate.unplaced == [] and judge.stops == []
    return (got_admitted, got_refused, got_stops), moments


@pytest.mark.parametrize("name", list(STALE_START_CASES))
def test_a_start_the_fold_later_finds_stale_is_stopped_once_the_fold_is_final(name):
    steps, admitted, refused, stops = STALE_START_CASES[name]
    assert run(steps)[0] == (admitted, refused, stops)


@pytest.mark.parametrize("name", list(STALE_START_CASES))
def test_an_agent_killed_at_any_moment_makes_the_same_stops(name):
    """Killed between reading a move and stopping the task it runs there (or at any other moment of the case), the
    agent makes the same stops after its restart: the pending ones are in its state file (``Judge.to_json``)."""
    steps, admitted, refused, stops = STALE_START_CASES[name]
    _, moments = run(steps)
    for restart_at in range(1, moments + 1):
        got, _ = run(steps, restart_at)
        assert got == (admitted, refused, stops), f"restarted at moment {restart_at}"


def test_the_fold_alone_would_not_find_a_pending_stop_again():
    """Why the pending stops are saved: the fold's own state (``Gate.to_json``) is saved with the offsets past the
    move, so a restarted agent never reads the move again; without them (an older agent's file) nothing is stopped."""
    judge = g.Judge(g.Gate(MACHINES), [("a", 0)])
    judge.take([allocated({T: "m1"})], MACHINES, 0)
    assert [c.event_id for c in judge.take([start("s1", 10)], MACHINES, 0)] == ["s1"]
    judge.take([allocated({T: "m9"})], MACHINES, 0)  # the move: the START above runs stale on m1
    saved = json.loads(json.dumps(judge.to_json()))
    assert saved["unplacing"] == [[T, "m1"]]
    consumer = FakeConsumer()
    consumer.read[("a", 0)] = consumer.high[("a", 0)]
    for doc, expected in ((saved, [(T, "m1")]), ({k: v for k, v in saved.items() if k != "unplacing"}, [])):
        again = g.Judge(g.Gate(MACHINES), [("a", 0)])
        again.load_json(doc)
        assert again.refusals(consumer, 0) == [] and list(again.take_stops()) == []  # not before the fold is final
        again.refusals(consumer, 0)
        assert list(again.take_stops()) == expected


def test_stops_not_yet_made_stay_in_the_state_file_while_one_is_made():
    """Two tasks moved off m1: the wiring stops the first (saving its state as it does); a kill then loses nothing."""
    judge = g.Judge(g.Gate(MACHINES), [("a", 0)])
    judge.take([allocated({T: "m1", "e1.web/1": "m1"})], MACHINES, 0)
    judge.take([allocated({T: "m9", "e1.web/1": "m8"})], MACHINES, 0)
    consumer = FakeConsumer()
    consumer.read[("a", 0)] = consumer.high[("a", 0)]
    judge.refusals(consumer, 0)
    judge.refusals(consumer, 0)
    stops = judge.take_stops()
    assert next(stops) == (T, "m1")
    again = restarted(judge)  # killed once the first stop was made and saved
    assert again.to_json()["unplacing"] == [["e1.web/1", "m1"]]
    again.refusals(consumer, 0)
    again.refusals(consumer, 0)
    assert list(again.take_stops()) == [("e1.web/1", "m1")]
