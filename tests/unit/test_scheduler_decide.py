"""Table-driven tests of the scheduler shard's pure decisions, playing the allocator and the agents by hand.

Every input goes through ``Sim.feed``, which also checks, for that input: the same input on the same state
gives the same output (ids included); delivering it a second time changes nothing and emits nothing (an intent
refused without a job to remember it, e.g. a resize of an unknown job, is refused again under the same event id);
every emitted event encodes with the real schemas and carries the envelope the scheduler promises.
"""
import dataclasses
import json
import re
from collections import deque
from types import MappingProxyType

import pytest

from infra.config import DEFAULT_MAX_TASKS_PER_JOB
from processors.agent import decide as ag
from processors.allocator.placement import Entitlement
from processors.cowmap import CowMap
from processors.scheduler import decide as sd
from processors.scheduler import model as sm
from processors.scheduler import reasons
from processors.scheduler import records
from processors.scheduler import work
from processors.scheduler.decide import decide, retry_unplaced
from processors.scheduler.lifecycle import (
    JOB_PENDING, JOB_REJECTED, JOB_RUNNING, JOB_STOPPED, JOB_STOPPING, JOB_UPDATING,
)
from processors.scheduler.model import SchedulerState, UnknownJob, job_detail
from processors.scheduler.reasons import (
    REASON_COMMAND_REPEATED, REASON_CRASHED, REASON_DUPLICATE_JOB_ID, REASON_EXITED, REASON_ILLEGAL_REPORT,
    REASON_INVALID_SPEC, REASON_JOB_NOT_ACTIVE, REASON_JOB_STOPPED, REASON_LOST_PLACEMENT, REASON_MACHINE_FAILED,
    REASON_MACHINE_MAINTENANCE,
    REASON_MACHINE_UNHEALTHY, REASON_NOT_AN_AGENT_STATE, REASON_RESIZED, REASON_RESTART_LIMIT, REASON_RESTART_POLICY,
    REASON_ROLLING_UPDATE, REASON_STALE_REPORT, REASON_STALE_SPEC_VERSION, REASON_UNKNOWN_ENTITLEMENT,
    REASON_UNKNOWN_JOB, REASON_UNKNOWN_TASK,
)
from processors.scheduler.steps import ANSWER_WAIT_MS, MAX_RESTARTS, RECOMMAND_MS, RESTART_RESET_MS
from processors.scheduler.work import PRODUCER
from processors.taskcontrol import limiter
from streams.batches import MAX_RECORD_BYTES, command_events, discovery_changes, task_commands, task_reports
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
T0 = 1_700_000_000_000
ENT = "e1"
TOPOLOGY = {f"m{i}": ("dc1", f"msb{(i - 1) % 3 + 1}", f"r{i}") for i in range(1, 21)}


# -- the other components, played by hand -----------------------------------------------------------------------

_ids = iter(range(10**9))


def ev(type_, payload, *, producer, ent=ENT, entity="x", ts=T0):
    return new_event(type_, payload, entitlement=ent, entity_id=entity, producer=producer, timestamp_ms=ts,
                     event_id=f"in-{type_}-{next(_ids)}")


def entitlement(name=ENT):
    return ev("EntitlementCreated", {"name": name, "quota_machines": 10, "machine_type": None, "dc_pin": None,
                                     "host_profile": None}, producer="cli", ent=name, entity=name)


def spec(job="j", n=3, *, version=1, cpu=1000, mem=2048, command=("sleep", "3600"), max_unavailable=1, **kw):
    p = {"job_id": job, "name": job, "spec_version": version, "tasks": n, "command": list(command),
         "resources": {"cpu_millicores": cpu, "memory_mib": mem}, "requirements": {}, "spread": "msb",
         "max_unavailable": max_unavailable, "env": {"ROLE": "web"}}
    p.update(kw)
    return p


def submit(job="j", n=3, ent=ENT, **kw):
    return ev("JobSubmitted", spec(job, n, **kw), producer="cli", ent=ent, entity=job)


def spec_changed(job="j", n=3, version=2, **kw):
    return ev("JobSpecChanged", spec(job, n, version=version, **kw), producer="cli", entity=job)


def resized(job, n):
    return ev("JobResized", {"job_id": job, "tasks": n}, producer="cli", entity=job)


def stopped(job, reason="done"):
    return ev("JobStopped", {"job_id": job, "reason": reason}, producer="cli", entity=job)


def placement(task, machine):
    dc, msb, rack = TOPOLOGY[machine]
    return {"task_id": task, "machine_id": machine, "dc": dc, "msb": msb, "rack": rack}


def allocated(request, placements):
    """The allocator's answer to ``request`` (an AllocationRequested): placements {task: machine}."""
    p = request.payload
    return ev("TasksAllocated", {"request_id": p["request_id"], "job_id": p["job_id"],
                                 "placements": [placement(t, m) for t, m in placements.items()]},
              producer="allocator", entity=p["request_id"])


def rejected(request, tasks, reason="quota_exceeded", message="entitlement e1 holds 3 of 3 machines"):
    p = request.payload
    return ev("AllocationRejected", {"request_id": p["request_id"], "job_id": p["job_id"], "reason": reason,
                                     "message": message, "unplaced_task_ids": list(tasks)},
              producer="allocator", entity=p["request_id"])


def deallocated(request):
    p = request.payload
    return ev("TasksDeallocated", {"request_id": p["request_id"], "job_id": p["job_id"], "placements": [],
                                   "machines_released": []}, producer="allocator", entity=p["request_id"])


def report(task, state, machine, *, version=1, exit_code=None, ts=T0):
    """An agent's TaskStateChanged."""
    return ev("TaskStateChanged", {"task_id": task, "job_id": task.rsplit("/", 1)[0], "machine_id": machine,
                                   "state": state, "previous_state": "STARTING", "exit_code": exit_code,
                                   "spec_version": version, "reason": ""}, producer="agent", entity=task, ts=ts)


def machine_status(machine, status, ent=ENT):
    return ev("MachineStatusChanged", {"machine_id": machine, "status": status, "previous_status": "UP",
                                       "reason": "operator"}, producer="resourcebroker", ent=ent, entity=machine)


def unavailability(machines, kind="FAILURE", ent=ENT):
    return ev("UnavailabilityStarted", {"unavailability_id": "ue1", "kind": kind, "machine_ids": list(machines),
                                        "start_ms": T0, "deadline_ms": None, "expected_duration_ms": None,
                                        "reason": "operator"}, producer="resourcebroker", ent=ent, entity="ue1")


def reports(*items, ts=T0):
    """An agent process's TaskStatesChanged: items (task, state, machine[, version[, exit_code]])."""
    rows = []
    for task, state, machine, *rest in items:
        version = rest[0] if rest else 1
        exit_code = rest[1] if len(rest) > 1 else None
        rows.append({"report_id": f"r-{task}-{state}-{next(_ids)}", "task_id": task, "job_id": task.rsplit("/", 1)[0],
                     "machine_id": machine, "state": state, "previous_state": "STARTING", "exit_code": exit_code,
                     "spec_version": version, "reason": "", "cause_id": None})
    return ev("TaskStatesChanged", {"reports": rows}, producer="agent/simulated", entity=rows[0]["task_id"], ts=ts)


def commands(out):
    """The per-task commands of the TasksCommanded in ``out``, in order."""
    return [c for e in out for c in task_commands(e)]


def agent_reactions(out):
    """What well-behaved agents report after the commands in ``out`` (one TaskStateChanged per transition, the
    form older logs hold: the scheduler reads both)."""
    for p in commands(out):
        if p["command"] in ("START", "RESTART"):
            yield report(p["task_id"], "STARTING", p["machine_id"], version=p["spec_version"])
            yield report(p["task_id"], "RUNNING", p["machine_id"], version=p["spec_version"])
        else:
            yield report(p["task_id"], "STOPPED", p["machine_id"], version=p["spec_version"], exit_code=0)


def batched_reactions(out):
    """The same as one TaskStatesChanged (as an agent process batches them), or nothing."""
    rows = []
    for p in commands(out):
        if p["command"] in ("START", "RESTART"):
            rows += [(p["task_id"], "STARTING", p["machine_id"], p["spec_version"]),
                     (p["task_id"], "RUNNING", p["machine_id"], p["spec_version"])]
        else:
            rows.append((p["task_id"], "STOPPED", p["machine_id"], p["spec_version"], 0))
    return [reports(*rows)] if rows else []


class Allocator:
    """Places each task on the next machine of ``pool`` not avoided."""

    def __init__(self, pool):
        self.pool = list(pool)

    def reactions(self, out):
        for e in out:
            if e.type == "AllocationRequested" and e.payload["place_task_ids"]:
                avoid = set(e.payload["avoid_machine_ids"])
                placements = {}
                for t in e.payload["place_task_ids"]:
                    m = next(m for m in self.pool if m not in avoid)
                    self.pool.remove(m)
                    placements[t] = m
                yield allocated(e, placements)


# -- the harness ------------------------------------------------------------------------------------------------

class Sim:
    def __init__(self, state=None, max_tasks=DEFAULT_MAX_TASKS_PER_JOB, gc_ms=sd.DEFAULT_JOB_GC_MS):
        self.state = state or SchedulerState()
        self.now = T0
        self.max_tasks = max_tasks
        self.gc_ms = gc_ms

    def decide(self, state, event, now):
        return decide(state, event, now, max_tasks=self.max_tasks, gc_ms=self.gc_ms)

    def feed(self, event, now=None):
        now = self.now if now is None else now
        new, out = self.decide(self.state, event, now)
        again, out_again = self.decide(self.state, event, now)
        assert (again, out_again) == (new, out), "same input, same state: same output"
        dup_state, dup_out = self.decide(new, event, now)
        refused_again = dup_out == out and all(e.type == "IntentRefused" for e in out)
        assert (dup_out == [] or refused_again) and dup_state == new, \
            f"{event.type} delivered twice must change nothing"
        for e in out:
            REG.encode(e.type, e.to_record(schema_version=1))
            assert (e.producer, e.causation_id, e.timestamp_ms) == (PRODUCER, event.event_id, now)
            assert e.event_id and e.event_id != event.event_id
        assert len({e.event_id for e in out}) == len(out)
        self._check_slice(event, now, new, out)
        self._check_collected(event, now, new, out)
        self.state = new
        return out

    def _check_collected(self, event, now, new, out):
        """Deciding after the timer took the jobs whose grace passed out of the state (``collect``) gives the same
        events and jobs: no decision depends on when (or whether) the timer ran."""
        collected, gone = sd.collect(self.state, now, self.gc_ms)
        if not gone:
            return
        s3, out3 = self.decide(collected, event, now)
        assert out3 == out, f"{event.type}: decided after {gone} were collected, it must emit the same"
        kept = {j: job for j, job in new.jobs.items() if not (j in gone and job is self.state.jobs[j])}
        assert {j: s3.jobs[j] for j in s3.jobs} == kept, f"{event.type}: the jobs differ once {gone} were collected"

    def _check_slice(self, event, now, new, out):
        """Deciding on only the jobs ``concerned_jobs`` names (what a shard loads) gives the same events and jobs;
        every other job is left as it was."""
        concerned = sd.concerned_jobs(self.state, event)
        dormant = {j for j, job in self.state.jobs.items() if sd.is_dormant(job)}
        assert dormant & set(concerned) <= set(sd.named_jobs(event)), \
            f"{event.type} concerns a dormant job it does not name (processors/history keeps those undecoded)"
        held = [j for j in concerned if j in self.state.jobs]
        sliced = dataclasses.replace(self.state, jobs=CowMap((j, self.state.jobs[j]) for j in held))
        s2, out2 = self.decide(sliced, event, now)
        assert out2 == out, f"{event.type}: decided on its jobs {concerned} only, it must emit the same"
        for j in set(self.state.jobs) | set(new.jobs):
            if j in concerned or j not in self.state.jobs:
                assert s2.jobs.get(j) == new.jobs.get(j), f"{event.type}: job {j} differs when decided on its slice"
            else:
                assert new.jobs.get(j) is self.state.jobs[j], f"{event.type} changed job {j}, not in {concerned}"
        assert (s2.entitlements, s2.machines_down) == (new.entitlements, new.machines_down)

    def feed_all(self, events, now=None):
        out = []
        for e in events:
            out.extend(self.feed(e, now))
        return out

    def view(self, job="j"):
        return job_detail(self.state, job)

    def tasks(self, job="j"):
        return {t["id"]: (t["state"], t["machine"]) for t in self.view(job)["tasks"]}


def untag(name):
    """A request or operation id without its incarnation's tag (``model.incarnation_tag``): ``j:v1:r1``,
    ``j/0:move:1``, as the tables here name them."""
    return re.sub(r":([0-9a-f]{8})(?=:v)|(?<=:)[0-9a-f]{8}\.", "", name)


def kinds(out):
    """Emitted events in a comparable short form (the items of a batch, each in its place)."""
    short = []
    for e in out:
        p = e.payload
        if e.type == "AllocationRequested":
            short.append(("request", tuple(p["place_task_ids"]), tuple(p["free_task_ids"]),
                          tuple(p["avoid_machine_ids"])))
        elif e.type == "TaskStatesChanged":
            short += [("state", r["task_id"], r["state"], r["reason"]) for r in task_reports(e)]
        elif e.type == "TasksCommanded":
            short += [(c["command"], c["task_id"], c["machine_id"], c["spec_version"]) for c in task_commands(e)]
        elif e.type == "ServiceDiscoveryUpdated":
            short += [("discovery", c["task_id"], c["enabled"]) for c in discovery_changes(e)]
        elif e.type == "JobStatePublished":
            short.append(("published", p["state"], p["deleted"]))
    return short


def refusals(out):
    """The IntentRefused in ``out``: (refused event type, reason)."""
    return [(e.payload["intent_type"], e.payload["reason"]) for e in out if e.type == "IntentRefused"]


def of_type(out, type_):
    """The events of ``type_`` in ``out``; for TaskCommanded, TaskStateChanged and ServiceDiscoveryChanged, the
    items of the batches (TasksCommanded, TaskStatesChanged, ServiceDiscoveryUpdated) as single-item events, in
    order (what a test of behaviour looks at)."""
    if type_ == "TaskCommanded":
        return [c for e in out for c in command_events(e)]
    if type_ == "TaskStateChanged":
        return [dataclasses.replace(e, type=type_, payload=r, event_id=r["report_id"])
                for e in out for r in task_reports(e)]
    if type_ == "ServiceDiscoveryChanged":
        return [dataclasses.replace(e, type=type_, payload=c) for e in out for c in discovery_changes(e)]
    return [e for e in out if e.type == type_]


def running_job(n=3, machines=("m1", "m2", "m3"), job="j", sim=None, **kw):
    """A job with ``n`` tasks RUNNING on ``machines``; returns the Sim."""
    sim = sim or Sim()
    if ENT not in sim.state.entitlements:
        sim.feed(entitlement())
    out = sim.feed(submit(job, n, **kw))
    out = sim.feed(allocated(out[0], {f"{job}/{i}": machines[i] for i in range(n)}))
    sim.feed_all(list(agent_reactions(out)))
    assert all(s == "RUNNING" for s, _ in sim.tasks(job).values())
    return sim


# -- a batch decided again in another order ---------------------------------------------------------------------

@pytest.mark.parametrize("batched", [False, True], ids=["one-report-each", "an-agent-batch"])
def test_reports_read_before_the_placement_they_follow_apply_once_it_is_read(batched):
    """A shard stopped after producing a decision and before storing it decides its batch again from the older
    state; its topics may then come in another order: the agent's reports of the START it commanded (``tasks``)
    before the TasksAllocated it started from (``allocations``). The kill storm lost a task so (stop 41): the
    reports were ignored as another machine's, the START commanded again under the same id, which the agent had
    run already, and the task stayed STARTING for good. Held by the task until its placement is read, they apply
    then: the same task states and the same events as in order; a report of another machine is dropped."""
    sim = Sim()
    sim.feed(entitlement())
    out = sim.feed(submit("j", 2))
    before = sim.state  # what the shard stored before the decisions it makes again
    alloc = allocated(out[0], {"j/0": "m1", "j/1": "m2"})
    in_order = sim.feed(alloc)
    reactions = batched_reactions(in_order) if batched else list(agent_reactions(in_order))
    sim.feed_all(reactions)
    assert sim.tasks() == {"j/0": ("RUNNING", "m1"), "j/1": ("RUNNING", "m2")}
    want = sim.state

    again = Sim(before)
    stray = reports(("j/1", "RUNNING", "m9"))  # a report of a machine it is not placed on: dropped at placement
    assert again.feed_all([*reactions, stray]) == []  # held: nothing to decide before the placement
    assert [len(t.early_reports) for t in again.state.jobs["j"].tasks.values()] == [2, 3]
    redone = again.feed(alloc)
    assert [e.event_id for e in redone if e.type == "TasksCommanded"] == \
        [e.event_id for e in in_order if e.type == "TasksCommanded"]  # the START under the same id
    assert again.tasks() == {"j/0": ("RUNNING", "m1"), "j/1": ("RUNNING", "m2")}
    assert all(t.early_reports == () for t in again.state.jobs["j"].tasks.values())
    assert {t.id: (t.state, t.machine, t.discovery) for t in again.state.jobs["j"].tasks.values()} == \
        {t.id: (t.state, t.machine, t.discovery) for t in want.jobs["j"].tasks.values()}


def test_a_report_is_held_only_while_its_task_awaits_a_placement_of_its_version():
    """A report of another machine or spec version for a task placed or unplaced without a request is stale, as
    before: ignored with its reason, nothing held."""
    sim = running_job(1, machines=("m1",))
    sim.feed(reports(("j/0", "RUNNING", "m7")))
    assert sim.state.jobs["j"].tasks["j/0"].early_reports == () and "stale_report" in sim.view()["last_ignored"]


# -- a report lost: the command again (the timer) ------------------------------------------------------------------

class Agents:
    """The agents' own pure decisions (``processors/agent/decide.py``), one per machine: they carry out the commands
    they are given and say what they report."""

    def __init__(self):
        self.states = {}

    def run(self, out, now=T0):
        reports_out = []
        for e in out:
            for cmd in ag.commands(e, lambda m: True):
                m = cmd.payload["machine_id"]
                state = self.states.get(m) or ag.initial_state(m)
                state, evs, actions = ag.decide(state, ag.Command(cmd), now)
                for a in actions:  # the process starts at once, or exits once killed
                    if a.kind == ag.SPAWN:
                        state, more, _ = ag.decide(state, ag.Spawned(a.task_id), now)
                    else:
                        state, more, _ = ag.decide(state, ag.Exited(a.task_id, -15), now)
                    evs = [*evs, *more]
                self.states[m] = state
                reports_out += evs
        return reports_out


def _lost_start():
    """A job of two tasks started; the agents ran them, and their reports were lost (a batch decided again)."""
    sim, agents = Sim(), Agents()
    sim.feed(entitlement())
    out = sim.feed(allocated(sim.feed(submit("j", 2))[0], {"j/0": "m1", "j/1": "m2"}))
    assert len(agents.run(out)) == 4  # STARTING and RUNNING of each: never read
    return sim, agents, "STARTING"


def _lost_stop():
    """The same job running, then stopped; the agents stopped the tasks, and their STOPPED reports were lost."""
    sim, agents = Sim(), Agents()
    sim.feed(entitlement())
    out = sim.feed(allocated(sim.feed(submit("j", 2))[0], {"j/0": "m1", "j/1": "m2"}))
    sim.feed_all(agents.run(out))
    assert sim.tasks() == {"j/0": ("RUNNING", "m1"), "j/1": ("RUNNING", "m2")}
    assert len(agents.run(sim.feed(stopped("j")))) == 2
    return sim, agents, "STOPPING"


@pytest.mark.parametrize("lose, command, then", [
    (_lost_start, "START", {"j/0": ("RUNNING", "m1"), "j/1": ("RUNNING", "m2")}),
    (_lost_stop, "STOP", {"j/0": ("STOPPED", "m1"), "j/1": ("STOPPED", "m2")}),
], ids=["start", "stop"])
def test_a_task_whose_report_was_lost_is_commanded_again_and_its_agent_says_again(lose, command, then):
    """Reports are edge-triggered: one lost (a shard deciding a batch again read it before the decision it follows,
    and passed its record: the kill storm's tasks left STARTING or STOPPING for good) left the task waiting for
    ever. The timer commands a task left STARTING or STOPPING ``RECOMMAND_MS`` again, under a new id, not sooner;
    the agent, which carried the first command out, says again where the task is (``already_running``,
    ``already_stopped``), and the task moves on. Deterministic; once a report came, nothing more."""
    sim, agents, waiting = lose()
    assert {s for s, _ in sim.tasks().values()} == {waiting}
    assert retry_unplaced(sim.state, T0 + RECOMMAND_MS - 1) == (sim.state, [])  # not sooner
    state, out = retry_unplaced(sim.state, T0 + RECOMMAND_MS)
    assert retry_unplaced(sim.state, T0 + RECOMMAND_MS) == (state, out)
    again = [(c["command"], c["task_id"], c["machine_id"], c["reason"]) for c in commands(out)]
    assert again == [(command, "j/0", "m1", REASON_COMMAND_REPEATED), (command, "j/1", "m2", REASON_COMMAND_REPEATED)]
    assert retry_unplaced(state, T0 + 2 * RECOMMAND_MS - 1) == (state, [])  # the next repeat a while after this one
    sim.state = state
    told = agents.run(out, T0 + RECOMMAND_MS)
    assert {r.payload["reason"] for r in told} == {"already_running" if command == "START" else "already_stopped"}
    out = sim.feed_all(told)
    assert sim.tasks() == then
    if command == "STOP":  # all stopped: freed, then gone
        assert kinds(sim.feed(deallocated(of_type(out, "AllocationRequested")[0])))[-1] == \
            ("published", JOB_STOPPED, True)
    assert retry_unplaced(sim.state, T0 + 10 * RECOMMAND_MS) == (sim.state, [])  # nothing awaits a report


def test_a_placement_whose_answer_was_lost_is_asked_again_as_a_move():
    """An answer read before the request it answers (a batch decided again: the request made again is the same
    event, which the allocator answered already and does not answer twice) left the task PENDING for good. The timer
    asks again ``ANSWER_WAIT_MS`` after the request, not sooner, as a new request that frees the task first
    (wherever the lost answer put it) and places it; the old answer is stale then, the new one applies, and where
    the free says the lost answer had put it, a STOP goes (it may run there)."""
    sim = Sim()
    sim.feed(entitlement())
    (first,) = of_type(sim.feed(submit("j", 2)), "AllocationRequested")
    assert retry_unplaced(sim.state, T0 + ANSWER_WAIT_MS - 1) == (sim.state, [])
    state, out = retry_unplaced(sim.state, T0 + ANSWER_WAIT_MS)
    assert retry_unplaced(sim.state, T0 + ANSWER_WAIT_MS) == (state, out)  # deterministic
    assert kinds(out) == [("request", ("j/0", "j/1"), ("j/0", "j/1"), ())]
    (again,) = out
    assert again.payload["request_id"] != first.payload["request_id"]
    sim.state = state
    assert sim.feed(allocated(first, {"j/0": "m1", "j/1": "m2"}), T0 + ANSWER_WAIT_MS) == []  # stale now
    # the answer to the request made again frees the tasks where the lost answer had put them (the decision that read
    # it may have started them there): a STOP goes there first, then the START where they are placed now
    freed = ev("TasksDeallocated", {"request_id": again.payload["request_id"], "job_id": "j", "placements": [
        placement("j/0", "m1"), placement("j/1", "m2")], "machines_released": []}, producer="allocator")
    out = sim.feed(freed, T0 + ANSWER_WAIT_MS)
    assert [(c["command"], c["task_id"], c["machine_id"], c["reason"]) for c in commands(out)] == [
        ("STOP", "j/0", "m1", REASON_LOST_PLACEMENT), ("STOP", "j/1", "m2", REASON_LOST_PLACEMENT)]
    assert sim.tasks() == {"j/0": ("PENDING", None), "j/1": ("PENDING", None)}
    out = sim.feed(allocated(again, {"j/0": "m3", "j/1": "m4"}), T0 + ANSWER_WAIT_MS)
    assert [(c["command"], c["task_id"], c["machine_id"]) for c in commands(out)] == [
        ("START", "j/0", "m3"), ("START", "j/1", "m4")]
    assert not any(t.asked_again for t in sim.state.jobs["j"].tasks.values())


def test_a_stopped_job_whose_free_answer_was_lost_asks_again_and_is_deleted():
    """The same for a stopped job's final free request: made again (its tasks hold nothing any more, and the
    allocator answers that it freed nothing) ``ANSWER_WAIT_MS`` after it was made; deleted on the answer."""
    sim = running_job(2, machines=("m1", "m2"))
    out = sim.feed_all(list(agent_reactions(sim.feed(stopped("j")))))
    (first,) = of_type(out, "AllocationRequested")
    assert retry_unplaced(sim.state, T0 + ANSWER_WAIT_MS - 1) == (sim.state, [])
    state, out = retry_unplaced(sim.state, T0 + ANSWER_WAIT_MS)
    assert kinds(out) == [("request", (), ("j/0", "j/1"), ())]
    sim.state = state
    assert sim.feed(deallocated(first), T0 + ANSWER_WAIT_MS) == []  # the old answer: stale
    assert kinds(sim.feed(deallocated(out[0]), T0 + ANSWER_WAIT_MS)) == [("published", JOB_STOPPED, True)]
    assert retry_unplaced(sim.state, T0 + 10 * ANSWER_WAIT_MS) == (sim.state, [])


def test_a_stop_decided_again_after_the_timer_commanded_its_task_again_is_a_command_of_its_own():
    """The kill storm (stop 43): a shard decided a machine's failure (STOP of the task STARTING there) and was stopped
    before it stored it; from the stored state the timer commanded the task again (START, ``command_repeated``); the
    failure decided again gave the same STOP under the first STOP's id, which readers (the agents among them) drop as
    a duplicate: the repeated START was never stopped on the log. The id of a command batch holds when the decision
    found each task last commanded: that STOP is another event; the same STOP decided again on the same state is the
    same event."""
    sim = Sim()
    sim.feed(entitlement())
    sim.feed(allocated(sim.feed(submit("j", 1))[0], {"j/0": "m1"}))  # START: the task STARTING on m1, no report read
    stored = sim.state
    down = machine_status("m1", "DOWN")
    (first,), (same,) = (of_type(decide(stored, down, T0 + 1)[1], "TasksCommanded") for _ in range(2))
    repeated, out = retry_unplaced(stored, T0 + RECOMMAND_MS)
    assert [(c["command"], c["reason"]) for c in commands(out)] == [("START", REASON_COMMAND_REPEATED)]
    (again,) = of_type(decide(repeated, down, T0 + RECOMMAND_MS + 1)[1], "TasksCommanded")
    assert first.payload["commands"] == again.payload["commands"]  # the same STOP ...
    assert [c["command"] for c in first.payload["commands"]] == ["STOP"]
    assert same.event_id == first.event_id and again.event_id != first.event_id  # ... after another START


def test_a_task_on_a_machine_that_is_down_is_not_commanded_again():
    """A task whose machine is down is the failure's (moved away, or left for the machine's return): not sent a
    command it cannot carry out."""
    sim, _, _ = _lost_start()
    sim.state = dataclasses.replace(sim.state, machines_down=MappingProxyType({"m1": "DOWN"}))
    _, out = retry_unplaced(sim.state, T0 + RECOMMAND_MS)
    assert [(c["command"], c["task_id"]) for c in commands(out)] == [("START", "j/1")]


# -- submit → allocate → start → run ----------------------------------------------------------------------------

def test_deploy_step_by_step():
    sim = Sim()
    assert sim.feed(entitlement()) == []
    out = sim.feed(submit("j", 3))
    assert kinds(out) == [("request", ("j/0", "j/1", "j/2"), (), ()), ("published", JOB_PENDING, False)]
    req = out[0]
    assert untag(req.payload["request_id"]) == "j:v1:r1" and req.entity_id == req.payload["request_id"]
    assert req.payload["request_id"] == f"j:{sm.incarnation_tag(sim.state.jobs['j'].submission)}:v1:r1"
    assert req.entitlement == ENT
    assert req.payload["resources"] == {"cpu_millicores": 1000, "memory_mib": 2048}
    assert sim.tasks() == {"j/0": ("PENDING", None), "j/1": ("PENDING", None), "j/2": ("PENDING", None)}

    out = sim.feed(allocated(req, {"j/0": "m1", "j/1": "m2", "j/2": "m3"}))
    assert kinds(out) == [  # one TaskStatesChanged, one TasksCommanded, the job's state
        ("state", "j/0", "ALLOCATED", "allocated"), ("state", "j/1", "ALLOCATED", "allocated"),
        ("state", "j/2", "ALLOCATED", "allocated"),
        ("START", "j/0", "m1", 1), ("START", "j/1", "m2", 1), ("START", "j/2", "m3", 1),
        ("published", JOB_PENDING, False)]
    assert [e.type for e in out] == ["TaskStatesChanged", "TasksCommanded", "JobStatePublished"]
    start = commands(out)[0]
    assert start["argv"] == ["sleep", "3600"] and start["env"] == {"ROLE": "web"}
    batch = of_type(out, "TasksCommanded")[0]  # the spec once, then one line per task
    assert batch.payload["argv"] == ["sleep", "3600"] and batch.payload["env"] == {"ROLE": "web"}
    assert batch.payload["commands"][0] == {"task_id": "j/0", "machine_id": "m1", "command": "START",
                                            "spec_version": 1, "reason": "placed"}
    assert sim.view()["tasks"][1] == {"id": "j/1", "state": "STARTING", "machine": "m2", "dc": "dc1", "msb": "msb2",
                                      "rack": "r2", "spec_version": 1, "reason": "submitted"}

    assert kinds(sim.feed(report("j/0", "STARTING", "m1"))) == []  # the agent acks the scheduler's own step
    assert kinds(sim.feed(report("j/0", "RUNNING", "m1"))) == [("discovery", "j/0", True),
                                                               ("published", JOB_PENDING, False)]
    sim.feed_all([report("j/1", "RUNNING", "m2")])
    assert kinds(sim.feed(report("j/2", "RUNNING", "m3"))) == [("discovery", "j/2", True),
                                                               ("published", JOB_RUNNING, False)]
    view = sim.view()
    assert {k: view[k] for k in ("job", "entitlement", "state", "spec_version", "last_reason")} == {
        "job": "j", "entitlement": ENT, "state": JOB_RUNNING, "spec_version": 1, "last_reason": ""}


def test_job_detail_of_unknown_job_raises():
    with pytest.raises(UnknownJob):
        job_detail(SchedulerState(), "nope")


def test_own_events_coming_back_change_nothing():
    sim = Sim()
    sim.feed(entitlement())
    out = sim.feed(submit("j", 2))
    out += sim.feed(allocated(out[0], {"j/0": "m1", "j/1": "m2"}))
    for e in out:
        assert decide(sim.state, e, T0) == (sim.state, [])


# -- refusals ---------------------------------------------------------------------------------------------------

REFUSED_SUBMISSIONS = {
    "unknown-entitlement": (submit("j", 2, ent="e9"), REASON_UNKNOWN_ENTITLEMENT),
    "negative-tasks": (submit("j", -1), REASON_INVALID_SPEC),
    "bad-spread": (submit("j", 2, spread="zone"), REASON_INVALID_SPEC),
    "no-unavailability-allowed": (submit("j", 2, max_unavailable=0), REASON_INVALID_SPEC),
    "unknown-requirement": (submit("j", 2, requirements={"gpu": "a100"}), REASON_INVALID_SPEC),
    "no-cpu": (submit("j", 2, cpu=0), REASON_INVALID_SPEC),
}


@pytest.mark.parametrize("event, reason", REFUSED_SUBMISSIONS.values(), ids=REFUSED_SUBMISSIONS)
def test_refused_submission_is_recorded_with_its_reason(event, reason):
    sim = Sim()
    sim.feed(entitlement())
    out = sim.feed(event)
    assert kinds(out) == [("published", JOB_REJECTED, False)] and refusals(out) == [("JobSubmitted", reason)]
    refused = of_type(out, "IntentRefused")[0]
    assert (refused.entitlement, refused.payload["job_id"], refused.payload["intent_event_id"]) == (
        event.entitlement, "j", event.event_id)
    view = sim.view()
    assert view["state"] == JOB_REJECTED and view["tasks"] == [] and view["last_reason"].startswith(reason + ":")
    assert view["last_reason"] == f"{reason}: {refused.payload['message']}"
    out = sim.feed(ev("JobResized", {"job_id": "j", "tasks": 4}, producer="cli", ent=event.entitlement))
    assert refusals(out) == [("JobResized", REASON_JOB_NOT_ACTIVE)]
    assert kinds(out) == [("published", JOB_REJECTED, False)]


def test_rejected_submission_can_be_submitted_again():
    sim = Sim()
    sim.feed(submit("j", 2))  # before the entitlement exists
    assert sim.view()["state"] == JOB_REJECTED
    sim.feed(entitlement())
    out = sim.feed(submit("j", 2))
    assert kinds(out) == [("request", ("j/0", "j/1"), (), ()), ("published", JOB_PENDING, False)]


def test_duplicate_job_id():
    sim = running_job(2, ("m1", "m2"))
    before = sim.state
    assert sim.feed(submit("j", 2)) == []  # the same submission again (a new event id): a no-op
    assert job_detail(sim.state, "j") == job_detail(before, "j")
    out = sim.feed(submit("j", 5, command=("other",)))  # another job under the same id: refused, shown
    assert refusals(out) == [("JobSubmitted", REASON_DUPLICATE_JOB_ID)]
    assert kinds(out) == [("published", JOB_RUNNING, False)]
    view = sim.view()
    assert view["last_reason"].startswith(REASON_DUPLICATE_JOB_ID + ":")
    assert [t["state"] for t in view["tasks"]] == ["RUNNING", "RUNNING"] and view["desired_tasks"] == 2


IGNORED_INPUTS = {
    "allocation-for-unknown-job": ev("TasksAllocated", {"request_id": "zz:v1:r1", "job_id": "zz", "placements": []},
                                     producer="allocator"),
    "entitlement-updated": ev("EntitlementUpdated", {"quota_machines": 3}, producer="cli"),
    "machine-registered": ev("MachineRegistered", {"machine_id": "m1"}, producer="resourcebroker"),
    "machine-up": machine_status("m1", "UP"),
    "deallocated-not-asked": ev("TasksDeallocated", {"request_id": "j:v1:r1", "job_id": "j", "placements": []},
                                producer="allocator"),
    "stop-of-a-stopping-job": None,  # (fed after a stop) what was asked already: a no-op, not a refusal
}


@pytest.mark.parametrize("event", IGNORED_INPUTS.values(), ids=IGNORED_INPUTS)
def test_ignored_inputs(event):
    sim = running_job(2, ("m1", "m2"))
    if event is None:
        sim.feed(stopped("j"))
        event = stopped("j", "again")
    before = sim.view()
    assert sim.feed(event) == []
    assert sim.view() == before


REFUSED_INTENTS = {  # event -> the reason it is refused with (IntentRefused, and the job's last_reason if it has one)
    "resize-unknown-job": (resized("zz", 3), REASON_UNKNOWN_JOB),
    "stop-unknown-job": (stopped("zz"), REASON_UNKNOWN_JOB),
    "update-unknown-job": (spec_changed("zz", 2, version=2), REASON_UNKNOWN_JOB),
    "resize-keyed-to-another-entitlement": (ev("JobResized", {"job_id": "j", "tasks": 9}, producer="cli", ent="e2"),
                                            reasons.REASON_ENTITLEMENT_MISMATCH),
    "negative-resize": (resized("j", -1), REASON_INVALID_SPEC),
    "invalid-spec-change": (spec_changed("j", 2, version=2, spread="zone"), REASON_INVALID_SPEC),
    "negative-cpu-in-a-spec-change": (spec_changed("j", 2, version=2, cpu=-5), REASON_INVALID_SPEC),
    "absurd-memory-in-a-spec-change": (spec_changed("j", 2, version=2, mem=2**31 - 1), REASON_INVALID_SPEC),
    "stale-spec-version": (spec_changed("j", 2, version=1, command=("x",)), REASON_STALE_SPEC_VERSION),
    "negative-quota": (ev("EntitlementCreated", {"name": "e7", "quota_machines": -5, "machine_type": None,
                                                 "dc_pin": None, "host_profile": None}, producer="cli", ent="e7"),
                       reasons.REASON_INVALID_ENTITLEMENT),
    "negative-quota-update": (ev("EntitlementUpdated", {"quota_machines": -1}, producer="cli"),
                              reasons.REASON_INVALID_ENTITLEMENT),
}


@pytest.mark.parametrize("event, reason", REFUSED_INTENTS.values(), ids=REFUSED_INTENTS)
def test_refused_intents_are_events(event, reason):
    """Every intent the scheduler refuses emits an IntentRefused with the reason constant, keyed to the intent's
    entitlement and caused by it; the job it is about (if any) shows it, published; nothing of it is applied."""
    sim = running_job(2, ("m1", "m2"))
    before = sim.view()
    ents = dict(sim.state.entitlements)
    out = sim.feed(event)
    assert refusals(out) == [(event.type, reason)]
    refused = of_type(out, "IntentRefused")[0]
    assert (refused.entitlement, refused.causation_id, refused.payload["intent_event_id"]) == (
        event.entitlement, event.event_id, event.event_id)
    assert refused.payload["message"]
    after = sim.view()
    assert after["tasks"] == before["tasks"] and after["desired_tasks"] == 2 and after["spec_version"] == 1
    assert dict(sim.state.entitlements) == ents
    if event.payload.get("job_id") == "j":
        assert after["last_reason"] == f"{reason}: {refused.payload['message']}"
        assert kinds(out) == [("published", JOB_RUNNING, False)]  # the job shows it
    else:
        assert after["last_reason"] == "" and kinds(out) == []


def test_a_negative_quantity_is_refused_with_the_field_name():
    sim = running_job(2, ("m1", "m2"))
    out = sim.feed(spec_changed("j", 2, version=2, cpu=-5))
    assert of_type(out, "IntentRefused")[0].payload["message"] == (
        "resources.cpu_millicores: expected a positive integer up to 1,000,000, got number -5")


# -- allocation rejected ----------------------------------------------------------------------------------------

def test_allocation_rejected_shows_why_and_retry_places_it():
    sim = Sim()
    sim.feed(entitlement())
    req = sim.feed(submit("j", 3))[0]
    sim.feed(allocated(req, {"j/0": "m1", "j/1": "m2"}))
    out = sim.feed(rejected(req, ["j/2"]))
    assert kinds(out) == [("published", JOB_PENDING, False)]
    assert out[0].payload["last_reason"] == "quota_exceeded: entitlement e1 holds 3 of 3 machines"
    view = sim.view()
    assert view["last_reason"] == "quota_exceeded: entitlement e1 holds 3 of 3 machines"
    assert view["tasks"][2] == {"id": "j/2", "state": "PENDING", "machine": None, "dc": None, "msb": None,
                                "rack": None, "spec_version": 1, "reason": "quota_exceeded"}
    assert sim.feed(rejected(req, ["j/2"])) == []  # the same answer again: no longer outstanding
    sim.feed(reports(("j/0", "RUNNING", "m1"), ("j/1", "RUNNING", "m2")))  # else the timer commands them again

    state, out = retry_unplaced(sim.state, T0 + 30_000)
    assert kinds(out) == [("request", ("j/2",), (), ())]
    assert retry_unplaced(sim.state, T0 + 30_000) == (state, out)  # deterministic
    assert retry_unplaced(state, T0 + 30_000 + ANSWER_WAIT_MS - 1) == (state, [])  # outstanding now: nothing to retry
    sim.state = state
    out = sim.feed(allocated(out[0], {"j/2": "m3"}))
    assert ("START", "j/2", "m3", 1) in kinds(out) and sim.view()["last_reason"] == ""


# -- stale and duplicate answers --------------------------------------------------------------------------------

def test_stale_and_duplicate_tasks_allocated_are_ignored():
    sim = Sim()
    sim.feed(entitlement())
    req = sim.feed(submit("j", 2))[0]
    placed = sim.feed(allocated(req, {"j/0": "m1", "j/1": "m2"}))
    assert len(commands(placed)) == 2
    before = sim.view()
    assert sim.feed(allocated(req, {"j/0": "m4", "j/1": "m5"})) == []  # same request answered again
    fake = new_event("AllocationRequested", {"request_id": "j:v1:r99", "job_id": "j"}, entitlement=ENT,
                     entity_id="j:v1:r99", producer="scheduler")
    assert sim.feed(allocated(fake, {"j/0": "m6"})) == []  # a request never sent
    assert sim.feed(rejected(fake, ["j/1"])) == []
    assert sim.view() == before


def test_spec_change_supersedes_an_outstanding_request():
    sim = Sim()
    sim.feed(entitlement())
    old = sim.feed(submit("j", 2))[0]
    out = sim.feed(spec_changed("j", 2, cpu=2000))
    assert kinds(out)[0] == ("request", ("j/0", "j/1"), ("j/0", "j/1"), ())  # free first: the old one may land
    new = out[0]
    assert new.payload["resources"]["cpu_millicores"] == 2000 and new.payload["spec_version"] == 2
    assert sim.feed(allocated(old, {"j/0": "m1", "j/1": "m2"})) == []  # superseded: stale
    out = sim.feed(allocated(new, {"j/0": "m3", "j/1": "m4"}))
    assert [k for k in kinds(out) if k[0] == "START"] == [("START", "j/0", "m3", 2), ("START", "j/1", "m4", 2)]


# -- agent reports ----------------------------------------------------------------------------------------------

# A job of three tasks: j/0 RUNNING on m1, j/1 STARTING on m2, j/2 PENDING (rejected).
BOGUS_REPORTS = {
    "running-while-pending": (report("j/2", "RUNNING", None), REASON_ILLEGAL_REPORT),
    "starting-after-running (lagging agent)": (report("j/0", "STARTING", "m1"), REASON_ILLEGAL_REPORT),
    "from-another-machine": (report("j/0", "FAILED", "m7", exit_code=1), REASON_STALE_REPORT),
    "old-spec-version": (report("j/1", "RUNNING", "m2", version=0), REASON_STALE_REPORT),
    "pending-is-not-an-agent-state": (report("j/0", "PENDING", "m1"), REASON_NOT_AN_AGENT_STATE),
    "stopping-is-not-an-agent-state": (report("j/0", "STOPPING", "m1"), REASON_NOT_AN_AGENT_STATE),
    "unknown-task": (report("j/9", "RUNNING", "m1"), REASON_UNKNOWN_TASK),
    "unknown-job": (report("zz/0", "RUNNING", "m1"), None),
}


@pytest.mark.parametrize("event, reason", BOGUS_REPORTS.values(), ids=BOGUS_REPORTS)
def test_bogus_agent_report_is_ignored_with_a_reason(event, reason):
    sim = Sim()
    sim.feed(entitlement())
    req = sim.feed(submit("j", 3))[0]
    sim.feed(allocated(req, {"j/0": "m1", "j/1": "m2"}))
    sim.feed(rejected(req, ["j/2"]))
    sim.feed(report("j/0", "RUNNING", "m1"))
    before = sim.tasks()
    assert sim.feed(event) == []
    assert sim.tasks() == before
    if reason is not None:
        assert sim.view()["last_ignored"].startswith(reason + ":")


def test_restart_policy_then_give_up():
    sim = running_job(2, ("m1", "m2"))
    for n in range(1, MAX_RESTARTS + 1):
        out = sim.feed(report("j/0", "FAILED", "m1", exit_code=1))
        assert kinds(out) == [("discovery", "j/0", False), ("RESTART", "j/0", "m1", 1),
                              ("published", JOB_PENDING, False)]
        assert commands(out)[0]["reason"] == REASON_RESTART_POLICY
        assert sim.view()["tasks"][0]["reason"] == REASON_CRASHED
        sim.feed_all(list(agent_reactions(out)))
    out = sim.feed(report("j/0", "FAILED", "m1", exit_code=1))
    assert kinds(out) == [("discovery", "j/0", False), ("published", JOB_PENDING, False)]
    assert sim.view()["tasks"][0] | {} == {"id": "j/0", "state": "FAILED", "machine": "m1", "dc": "dc1",
                                           "msb": "msb1", "rack": "r1", "spec_version": 1,
                                           "reason": REASON_RESTART_LIMIT}
    assert sim.tasks()["j/1"] == ("RUNNING", "m2")


def test_restart_budget_comes_back_after_a_long_run():
    sim = running_job(1, ("m1",))
    for _ in range(MAX_RESTARTS):
        out = sim.feed(report("j/0", "FAILED", "m1", exit_code=1))
        sim.feed_all(list(agent_reactions(out)))  # running again at T0
    later = T0 + RESTART_RESET_MS
    out = sim.feed(report("j/0", "STOPPED", "m1", exit_code=0), now=later)  # ran long enough, then exited
    assert ("RESTART", "j/0", "m1", 1) in kinds(out)
    assert sim.view()["tasks"][0]["reason"] == REASON_EXITED


# -- machine failure --------------------------------------------------------------------------------------------

UNAVAILABLE = {
    "status-down": (lambda: machine_status("m1", "DOWN"), REASON_MACHINE_FAILED),
    "status-unhealthy": (lambda: machine_status("m1", "UNHEALTHY"), REASON_MACHINE_UNHEALTHY),
    "status-maintenance": (lambda: machine_status("m1", "MAINTENANCE"), REASON_MACHINE_MAINTENANCE),
    "ue-failure": (lambda: unavailability(["m1"], "FAILURE"), REASON_MACHINE_FAILED),
    "ue-power": (lambda: unavailability(["m1", "m9"], "POWER"), REASON_MACHINE_FAILED),
}


@pytest.mark.parametrize("make, reason", UNAVAILABLE.values(), ids=UNAVAILABLE)
def test_machine_failure_moves_exactly_the_affected_tasks(make, reason):
    sim = running_job(4, ("m1", "m1", "m2", "m3"), job="a")
    sim = running_job(2, ("m2", "m3"), job="b", sim=sim)
    before_a, before_b = sim.state.jobs["a"].tasks, sim.state.jobs["b"]

    out = sim.feed(make())
    assert kinds(out) == [
        ("request", ("a/0", "a/1"), ("a/0", "a/1"), ("m1",)),
        ("discovery", "a/0", False), ("discovery", "a/1", False),  # on tasks: before the state changes and stops
        ("state", "a/0", "FAILED", reason), ("state", "a/0", "PENDING", reason),
        ("state", "a/1", "FAILED", reason), ("state", "a/1", "PENDING", reason),
        ("STOP", "a/0", "m1", 1), ("STOP", "a/1", "m1", 1),  # the fences
        ("published", JOB_PENDING, False)]
    assert task_reports(of_type(out, "TaskStatesChanged")[0])[0]["machine_id"] == "m1"
    tasks = sim.state.jobs["a"].tasks
    assert tasks["a/2"] is before_a["a/2"] and tasks["a/3"] is before_a["a/3"]  # untouched
    assert sim.state.jobs["b"] is before_b  # another job, not on m1: not even its duplicate ring moved
    assert sim.tasks("a")["a/0"] == ("PENDING", None) and sim.view("a")["tasks"][0]["reason"] == reason

    # the other notification of the same failure finds nothing left on m1
    other = unavailability(["m1"]) if make().type == "MachineStatusChanged" else machine_status("m1", "DOWN")
    assert sim.feed(other) == []

    out = sim.feed(allocated(of_type(out, "AllocationRequested")[0], {"a/0": "m4", "a/1": "m5"}))
    assert [k for k in kinds(out) if k[0] == "START"] == [("START", "a/0", "m4", 1), ("START", "a/1", "m5", 1)]
    out = sim.feed_all(list(agent_reactions(out)))
    assert [k for k in kinds(out) if k[0] == "discovery"] == [("discovery", "a/0", True), ("discovery", "a/1", True)]
    assert sim.view("a")["state"] == JOB_RUNNING
    assert sim.tasks("a") == {"a/0": ("RUNNING", "m4"), "a/1": ("RUNNING", "m5"), "a/2": ("RUNNING", "m2"),
                              "a/3": ("RUNNING", "m3")}
    # the old machine's agent, obeying the fence or lagging, still reports a/0: stale
    assert sim.feed(report("a/0", "STOPPED", "m1", exit_code=0)) == []
    assert sim.view("a")["last_ignored"].startswith(REASON_STALE_REPORT)


@pytest.mark.parametrize("key, moved", [
    (ENT, True),  # the machines' owner: its jobs on them move
    ("free/dc1", True),  # a key no entitlement of the shard has (a free pool's): every job is looked at
    ("e2", False),  # another entitlement of the shard owns them: this job's tasks there are not its concern
])
def test_a_machine_event_concerns_the_jobs_of_its_owner(key, moved):
    sim = running_job(2, ("m1", "m2"))
    sim.feed(entitlement("e2"))
    assert sd.concerned_jobs(sim.state, machine_status("m1", "DOWN", ent=key)) == (["j"] if moved else [])
    out = sim.feed(machine_status("m1", "DOWN", ent=key))  # Sim also decides it on the concerned jobs alone
    assert (sim.tasks()["j/0"] == ("PENDING", None)) is moved and bool(out) is moved


def test_planned_maintenance_notice_moves_nothing_yet():
    sim = running_job(2, ("m1", "m2"))
    assert sim.feed(unavailability(["m1"], "MAINTENANCE")) == []


def test_placement_on_a_machine_that_failed_meanwhile_is_moved_at_once():
    sim = Sim()
    sim.feed(entitlement())
    req = sim.feed(submit("j", 2))[0]
    assert sim.feed(machine_status("m1", "DOWN")) == []  # no task there yet
    out = sim.feed(allocated(req, {"j/0": "m1", "j/1": "m2"}))  # the allocator had not seen it
    assert kinds(out) == [
        ("request", ("j/0",), ("j/0",), ("m1",)),
        ("state", "j/0", "ALLOCATED", "allocated"), ("state", "j/0", "FAILED", REASON_MACHINE_FAILED),
        ("state", "j/0", "PENDING", REASON_MACHINE_FAILED), ("state", "j/1", "ALLOCATED", "allocated"),
        ("START", "j/1", "m2", 1), ("published", JOB_PENDING, False)]
    sim.feed(machine_status("m1", "UP"))
    assert sim.state.machines_down == {}


# -- resize -----------------------------------------------------------------------------------------------------

def test_resize_up():
    sim = running_job(3)
    out = sim.feed(resized("j", 5))
    assert kinds(out) == [("request", ("j/3", "j/4"), (), ()), ("published", JOB_PENDING, False)]
    assert sim.view()["desired_tasks"] == 5 and sim.tasks()["j/4"] == ("PENDING", None)
    assert sim.feed(resized("j", 5)) == []  # already that size


def test_resize_down_stops_the_highest_then_frees_them():
    sim = running_job(4, ("m1", "m2", "m3", "m4"))
    out = sim.feed(resized("j", 2))
    assert kinds(out) == [("discovery", "j/3", False), ("discovery", "j/2", False),  # out of discovery first
                          ("STOP", "j/3", "m4", 1), ("STOP", "j/2", "m3", 1),
                          ("published", JOB_RUNNING, False)]  # the two tasks it keeps run: retiring ones don't count
    assert commands(out)[0]["reason"] == REASON_RESIZED
    assert sim.tasks()["j/3"] == ("STOPPING", "m4")
    out = sim.feed(report("j/3", "STOPPED", "m4", exit_code=0))
    assert kinds(out) == [("request", (), ("j/3",), ()), ("published", JOB_RUNNING, False)]
    assert out[0].payload["spec_version"] == 1
    out = sim.feed(report("j/2", "STOPPED", "m3", exit_code=0))
    assert kinds(out) == [("request", (), ("j/2",), ()), ("published", JOB_RUNNING, False)]
    assert sim.tasks() == {"j/0": ("RUNNING", "m1"), "j/1": ("RUNNING", "m2")}
    assert sim.feed(report("j/3", "STOPPED", "m4", exit_code=0)) == []  # gone


def test_resize_down_then_up_again_keeps_the_stopping_tasks():
    sim = running_job(3)
    sim.feed(resized("j", 1))
    out = sim.feed(resized("j", 3))
    assert kinds(out) == [("published", JOB_PENDING, False)]  # j/1, j/2 are still stopping: no new tasks
    out = sim.feed(report("j/2", "STOPPED", "m3", exit_code=0))
    assert [k for k in kinds(out) if k[0] in ("START", "request")] == [("START", "j/2", "m3", 1)]  # in place
    out = sim.feed_all([report("j/1", "STOPPED", "m2", exit_code=0), report("j/1", "RUNNING", "m2"),
                        report("j/2", "RUNNING", "m3")])
    assert sim.view()["state"] == JOB_RUNNING and len(sim.tasks()) == 3


def test_regrow_after_partial_shrink_keeps_index_order():
    sim = running_job(4, ("m1", "m2", "m3", "m4"))
    sim.feed(resized("j", 1))
    sim.feed(report("j/3", "STOPPED", "m4", exit_code=0))  # j/3 freed and gone; j/1, j/2 still stopping
    out = sim.feed(resized("j", 4))
    assert kinds(out) == [("request", ("j/3",), (), ()), ("published", JOB_PENDING, False)]
    assert list(sim.tasks()) == ["j/0", "j/1", "j/2", "j/3"]
    assert [t["task_id"] for t in out[-1].payload["tasks"]] == ["j/0", "j/1", "j/2", "j/3"]


def test_shrink_a_task_never_placed_is_dropped():
    sim = Sim()
    sim.feed(entitlement())
    req = sim.feed(submit("j", 2))[0]
    sim.feed(allocated(req, {"j/0": "m1"}))
    sim.feed(rejected(req, ["j/1"]))
    out = sim.feed(resized("j", 1))
    assert kinds(out) == [("state", "j/1", "STOPPED", REASON_RESIZED), ("published", JOB_PENDING, False)]
    assert set(sim.tasks()) == {"j/0"}


# -- stop -------------------------------------------------------------------------------------------------------

def test_stop_stops_everything_then_frees_then_deletes():
    sim = Sim()
    sim.feed(entitlement())
    req = sim.feed(submit("j", 3))[0]
    out = sim.feed(allocated(req, {"j/0": "m1", "j/1": "m2"}))
    sim.feed_all(list(agent_reactions(out)))
    sim.feed(rejected(req, ["j/2"]))

    out = sim.feed(stopped("j"))
    assert kinds(out) == [("discovery", "j/1", False), ("discovery", "j/0", False),
                          ("state", "j/2", "STOPPED", REASON_JOB_STOPPED),
                          ("STOP", "j/1", "m2", 1), ("STOP", "j/0", "m1", 1),
                          ("published", JOB_STOPPING, False)]
    assert sim.feed(stopped("j")) == []  # stopping already: what was asked
    assert refusals(sim.feed(resized("j", 5))) == [("JobResized", REASON_JOB_NOT_ACTIVE)]
    assert sim.view()["last_reason"].startswith(REASON_JOB_NOT_ACTIVE)
    assert refusals(sim.feed(submit("j", 3))) == [("JobSubmitted", REASON_JOB_NOT_ACTIVE)]  # the old one still stops
    assert kinds(sim.feed(report("j/0", "STOPPED", "m1", exit_code=0))) == [("published", JOB_STOPPING, False)]
    out = sim.feed(report("j/1", "FAILED", "m2", exit_code=143))  # killed while stopping: stopped all the same
    assert kinds(out) == [("request", (), ("j/0", "j/1", "j/2"), ()), ("published", JOB_STOPPED, False)]
    assert [t["state"] for t in out[-1].payload["tasks"]] == ["STOPPED"] * 3
    out = sim.feed(deallocated(out[0]))
    assert kinds(out) == [("published", JOB_STOPPED, True)] and out[0].payload["tasks"] == []
    assert sim.view()["state"] == JOB_STOPPED and sim.view()["tasks"] == []
    assert refusals(sim.feed(resized("j", 2))) == [("JobResized", REASON_UNKNOWN_JOB)]  # gone


def test_an_answer_read_before_its_request_is_asked_again_applies_when_it_comes_again():
    """A scheduler killed right after asking re-reads its input from its last committed offsets: it may read the
    allocator's answer (another topic) before it asks again — the same request, the same ids. The early answer is
    stale then and must not be remembered as applied, because the allocator answers the repeated request again (the
    same event) and that one must apply. Before, the stopped job of the kill storm waited for good (ks-e0.j0013)."""
    sim = running_job(2, ("m1", "m2"))
    sim.feed(stopped("j"))
    sim.feed(report("j/0", "STOPPED", "m1", exit_code=0))
    before = sim.state
    last = report("j/1", "STOPPED", "m2", exit_code=0)
    out = sim.feed(last)
    free = out[0]
    assert kinds(out)[0] == ("request", (), ("j/0", "j/1"), ())
    answer = deallocated(free)

    sim.state = before  # killed: what it did since its last commit is done again, but the answer is read first
    assert sim.feed(answer) == [] and sim.state == before  # stale, and not remembered
    again = sim.feed(last)
    assert again[0] == free  # the same request, the same event
    out = sim.feed(answer)  # the allocator's answer to the repeated request: the same event
    assert kinds(out) == [("published", JOB_STOPPED, True)] and sim.view()["tasks"] == []


def test_a_placement_read_before_its_request_applies_when_it_comes_again():
    sim = running_job(1, ("m1",))
    before = sim.state
    grow = resized("j", 2)
    req = sim.feed(grow)[0]
    answer = allocated(req, {"j/1": "m2"})
    sim.state = before  # killed after asking: the answer is read before the resize is done again
    assert sim.feed(answer) == [] and sim.state == before
    assert sim.feed(grow)[0] == req
    assert ("START", "j/1", "m2", 1) in kinds(sim.feed(answer))


def test_a_stopped_job_id_is_used_again_by_a_new_incarnation():
    """A job stopped and freed (deleted): its id may be submitted again. The new incarnation (2) keeps the id
    ``<job>`` and its task ids; its requests are named by its own submission (``model.incarnation_tag``): its r1 is
    not the old incarnation's r1, so a late result for an old request is stale; the old incarnation's events stay
    no-ops."""
    sim = running_job(2, ("m1", "m2"))
    sim.feed(stopped("j"))
    sim.feed(report("j/0", "STOPPED", "m1", exit_code=0))
    free = of_type(sim.feed(report("j/1", "STOPPED", "m2", exit_code=0)), "AllocationRequested")[0]
    assert untag(free.payload["request_id"]) == "j:v1:r2"
    sim.feed(deallocated(free))
    assert sim.view()["state"] == JOB_STOPPED and sim.state.jobs["j"].deleted
    first = sim.state.jobs["j"].submission
    out = sim.feed(submit("j", 3, command=("v2",)))  # the name again, another spec
    assert refusals(out) == []
    req = of_type(out, "AllocationRequested")[0]
    assert untag(req.payload["request_id"]) == "j:v1:r1" and req.payload["place_task_ids"] == ["j/0", "j/1", "j/2"]
    assert req.payload["request_id"] != sm.request_id("j", 1, 1, sm.incarnation_tag(first))
    published = of_type(out, "JobStatePublished")[-1].payload
    assert (published["incarnation"], published["state"], published["deleted"]) == (2, JOB_PENDING, False)
    view = sim.view()
    assert view["incarnation"] == 2 and view["desired_tasks"] == 3 and view["last_reason"] == ""
    assert records.job_from_record(records.job_to_record(sim.state.jobs["j"])) == sim.state.jobs["j"]  # a table value
    assert sim.feed(deallocated(free)) == []  # the old incarnation's answer, delivered again: nothing
    out = sim.feed(allocated(req, {"j/0": "m3", "j/1": "m4", "j/2": "m5"}))
    assert [c["command"] for c in commands(out)] == ["START"] * 3 and commands(out)[0]["argv"] == ["v2"]


def test_stop_a_job_with_no_tasks():
    sim = Sim()
    sim.feed(entitlement())
    out = sim.feed(submit("j", 1))
    sim.feed(rejected(out[0], ["j/0"]))
    sim.feed(resized("j", 0))
    assert kinds(sim.feed(stopped("j"))) == [("published", JOB_STOPPED, True)]


def test_machine_failure_while_stopping():
    sim = running_job(2, ("m1", "m2"))
    sim.feed(stopped("j"))
    out = sim.feed(machine_status("m1", "DOWN"))
    assert kinds(out) == [("state", "j/0", "STOPPED", REASON_MACHINE_FAILED), ("published", JOB_STOPPING, False)]
    out = sim.feed(report("j/1", "STOPPED", "m2", exit_code=0))
    assert kinds(out)[0] == ("request", (), ("j/0", "j/1"), ())


# -- rolling update ---------------------------------------------------------------------------------------------

ROLLING_UPDATES = {  # tasks, max_unavailable, spec change, tasks expected to move
    "in-place-one-at-a-time": (4, 1, dict(command=("sleep", "7200")), False),
    "in-place-two-at-a-time": (5, 2, dict(command=("sleep", "7200")), False),
    "in-place-smaller": (3, 1, dict(cpu=500), False),
    "move-more-cpu": (4, 1, dict(cpu=4000), True),
    "move-more-memory-three-at-a-time": (6, 3, dict(mem=8192), True),
    "move-new-requirement": (3, 2, dict(requirements={"machine_type": "skylake"}), True),
}


@pytest.mark.parametrize("n, max_unavailable, change, moves", ROLLING_UPDATES.values(), ids=ROLLING_UPDATES)
def test_rolling_update_never_exceeds_max_unavailable(n, max_unavailable, change, moves):
    machines = tuple(f"m{i}" for i in range(1, n + 1))
    sim = running_job(n, machines)
    allocator = Allocator(f"m{i}" for i in range(n + 1, 21))
    out = sim.feed(spec_changed("j", n, version=2, max_unavailable=max_unavailable, **change))
    assert sim.view()["state"] == JOB_UPDATING
    queue = deque([*agent_reactions(out), *allocator.reactions(out)])
    stops = sum(k[0] == "STOP" for k in kinds(out))
    assert stops == max_unavailable
    seen_worst = 0
    while queue:
        out = sim.feed(queue.popleft())
        down = sum(t["state"] != "RUNNING" for t in sim.view()["tasks"])
        assert down <= max_unavailable
        seen_worst = max(seen_worst, down)
        for k in kinds(out):
            if k[0] == "request":
                assert k[1] == k[2] and k[3] == ()  # a move: free and place the task, avoiding nothing
        queue.extend([*agent_reactions(out), *allocator.reactions(out)])
    assert seen_worst == max_unavailable
    view = sim.view()
    assert view["state"] == JOB_RUNNING and view["spec_version"] == 2
    assert all(t["spec_version"] == 2 and t["state"] == "RUNNING" for t in view["tasks"])
    on_old_machines = [t["machine"] in machines for t in view["tasks"]]
    assert on_old_machines == [not moves] * n


def test_rolling_update_starts_the_new_version_in_place_with_start():
    sim = running_job(2, ("m1", "m2"))
    out = sim.feed(spec_changed("j", 2, version=2, command=("sleep", "7200")))
    assert kinds(out) == [("discovery", "j/0", False), ("STOP", "j/0", "m1", 1), ("published", JOB_UPDATING, False)]
    assert commands(out)[0]["reason"] == REASON_ROLLING_UPDATE
    out = sim.feed(report("j/0", "STOPPED", "m1", exit_code=0))
    assert kinds(out) == [("START", "j/0", "m1", 2), ("published", JOB_UPDATING, False)]
    assert commands(out)[0]["argv"] == ["sleep", "7200"]
    assert sim.feed(report("j/0", "RUNNING", "m1", version=1)) == []  # the old version's report: stale
    out = sim.feed(report("j/0", "RUNNING", "m1", version=2))
    assert kinds(out) == [("discovery", "j/0", True), ("discovery", "j/1", False), ("STOP", "j/1", "m2", 1),
                          ("published", JOB_UPDATING, False)]


def test_rolling_update_waits_for_tasks_down_for_other_reasons():
    sim = running_job(3)
    sim.feed(machine_status("m3", "DOWN"))  # j/2 is moving: already one task unavailable
    out = sim.feed(spec_changed("j", 3, version=2, command=("v2",)))
    assert [k for k in kinds(out) if k[0] == "STOP"] == []
    assert sim.view()["state"] == JOB_UPDATING


def test_rolling_update_replaces_a_task_that_gave_up():
    sim = running_job(2, ("m1", "m2"))
    for _ in range(MAX_RESTARTS):
        sim.feed_all(list(agent_reactions(sim.feed(report("j/1", "FAILED", "m2", exit_code=1)))))
    sim.feed(report("j/1", "FAILED", "m2", exit_code=1))
    assert sim.view()["tasks"][1]["reason"] == REASON_RESTART_LIMIT
    out = sim.feed(spec_changed("j", 2, version=2, command=("fixed",)))
    assert [k for k in kinds(out) if k[0] in ("START", "STOP")] == [("START", "j/1", "m2", 2)]  # costs nothing


def test_machine_failure_under_a_task_being_updated():
    sim = running_job(2, ("m1", "m2"))
    sim.feed(spec_changed("j", 2, version=2, command=("v2",)))  # j/0 STOPPING on m1 for the update
    out = sim.feed(machine_status("m1", "DOWN"))
    assert kinds(out) == [("request", ("j/0",), ("j/0",), ("m1",)),
                          ("state", "j/0", "STOPPED", REASON_MACHINE_FAILED),
                          ("state", "j/0", "PENDING", REASON_MACHINE_FAILED), ("published", JOB_UPDATING, False)]
    out = sim.feed(allocated(of_type(out, "AllocationRequested")[0], {"j/0": "m3"}))
    assert ("START", "j/0", "m3", 2) in kinds(out)  # moved tasks start the new version
    out = sim.feed(report("j/0", "RUNNING", "m3", version=2))
    assert ("STOP", "j/1", "m2", 1) in kinds(out)


def test_a_move_the_allocator_cannot_place_waits_with_the_reason():
    sim = running_job(2, ("m1", "m2"))
    req = of_type(sim.feed(machine_status("m1", "DOWN")), "AllocationRequested")[0]
    out = sim.feed(rejected(req, ["j/0"], reason="no_feasible_machine", message="no machine fits"))
    assert kinds(out) == [("published", JOB_PENDING, False)]
    assert sim.view()["tasks"][0]["reason"] == "no_feasible_machine"
    state, out = retry_unplaced(sim.state, T0 + 1)
    assert kinds(out) == [("request", ("j/0",), (), ())]  # placed anew: its old placement was freed already


def test_stale_spec_change_is_refused():
    sim = running_job(2, ("m1", "m2"))
    out = sim.feed(spec_changed("j", 2, version=1, command=("x",)))
    assert refusals(out) == [("JobSpecChanged", REASON_STALE_SPEC_VERSION)]
    assert sim.view()["last_reason"].startswith(REASON_STALE_SPEC_VERSION) and sim.view()["spec_version"] == 1


def test_spec_change_redelivered_under_another_id_is_a_no_op():
    sim = running_job(2, ("m1", "m2"))
    sim.feed(spec_changed("j", 2, version=2, command=("v2",)))
    before = sim.view()
    assert sim.feed(spec_changed("j", 2, version=2, command=("v2",))) == []
    assert sim.view() == before


def test_rolling_update_with_resize():
    sim = running_job(2, ("m1", "m2"))
    out = sim.feed(spec_changed("j", 3, version=2, command=("v2",)))
    # the new task counts as unavailable until it runs: no stop yet
    assert kinds(out) == [("request", ("j/2",), (), ()), ("published", JOB_UPDATING, False)]
    out = sim.feed(allocated(out[0], {"j/2": "m3"}))
    assert ("START", "j/2", "m3", 2) in kinds(out)
    out = sim.feed(report("j/2", "RUNNING", "m3", version=2))
    assert ("STOP", "j/0", "m1", 1) in kinds(out)


# -- determinism and duplicates over a whole history -------------------------------------------------------------

def test_replaying_a_history_gives_the_same_state_and_events():
    sim = running_job(3)
    history = [resized("j", 4), machine_status("m2", "DOWN"), spec_changed("j", 4, version=2, command=("v2",))]
    states, outs = [], []
    for _ in range(2):
        s = Sim(sim.state)
        outs.append([s.feed(e) for e in history])
        states.append(s.state)
    assert states[0] == states[1] and outs[0] == outs[1]


def test_every_input_delivered_twice_in_a_row():
    """A whole scenario with each input delivered twice: the same final state and events as once."""
    once, twice = Sim(), Sim()
    pool = Allocator(f"m{i}" for i in range(1, 21))
    inputs = deque([entitlement(), submit("j", 3)])
    emitted_once, emitted_twice = [], []
    scripted = deque([machine_status("m1", "DOWN"), resized("j", 2),
                      spec_changed("j", 2, version=2, command=("v2",)), stopped("j")])
    while inputs or scripted:
        e = inputs.popleft() if inputs else scripted.popleft()
        out = once.feed(e)
        emitted_once += out
        emitted_twice += twice.feed(e) + twice.feed(e)
        inputs.extend([*agent_reactions(out), *pool.reactions(out)])
        if not inputs and e.type == "JobStopped":
            break
    assert once.state == twice.state and emitted_once == emitted_twice
    assert once.view()["state"] == JOB_STOPPED


def test_state_survives_a_table_round_trip():
    """Jobs as faust table values (JSON): read back equal, and the next decision is the same."""
    sim = running_job(3)
    sim.feed(resized("j", 5))
    sim.feed(machine_status("m2", "UNHEALTHY"))
    sim.feed(spec_changed("j", 5, version=2, command=("v2",), requirements={"dc": "dc1"}))
    jobs = [records.job_from_record(json.loads(json.dumps(records.job_to_record(j)))) for j in sim.state.jobs.values()]
    ents = [Entitlement(**json.loads(json.dumps(dataclasses.asdict(e))))
            for e in sim.state.entitlements.values()]
    shard_bucket = limiter.bucket_of(json.loads(json.dumps(limiter.bucket_record(sim.state.shard_bucket))))
    state = sm.state_of(jobs, ents, json.loads(json.dumps(dict(sim.state.machines_down))), shard_bucket)
    assert state == sim.state
    nxt = report("j/0", "STOPPED", "m1", exit_code=0)
    assert decide(state, nxt, T0) == decide(sim.state, nxt, T0)


def test_a_record_made_from_the_previous_one_reuses_the_unchanged_tasks_and_equals_a_full_one():
    """What the shard writes back after a decision: ``job_to_record(job, (before, its record))`` equals the record
    built from scratch, and only the tasks the decision changed are built again."""
    sim = running_job(3)
    before = sim.state.jobs["j"]
    record = records.job_to_record(before)
    for e in (report("j/1", "FAILED", "m2", exit_code=1), resized("j", 4), report("j/1", "RUNNING", "m2")):
        sim.feed(e)
        after = sim.state.jobs["j"]
        incremental = records.job_to_record(after, (before, record))
        assert incremental == records.job_to_record(after)
        old = {id(r) for r in record["tasks"]}
        rebuilt = {t.id for t, r in zip(after.tasks.values(), incremental["tasks"]) if id(r) not in old}
        assert rebuilt == {t.id for t in after.tasks.values() if before.tasks.get(t.id) is not t}
        assert 0 < len(rebuilt) < len(after.tasks)
        before, record = after, incremental


def test_duplicate_ring_is_bounded():
    sim = running_job(1, ("m1",))
    for i in range(work.SEEN_LIMIT + 10):
        sim.feed(report("j/0", "RUNNING", "m1"))
    assert len(sim.state.jobs["j"].seen) == work.SEEN_LIMIT


# -- batches: agents' reports, many machines at once, big jobs -------------------------------------------------------

def test_an_agent_processs_batch_of_reports_moves_the_tasks_of_several_jobs():
    sim = Sim()
    sim.feed(entitlement())
    for job, machines in (("a", ("m1", "m2")), ("b", ("m3",))):
        req = sim.feed(submit(job, len(machines)))[0]
        sim.feed(allocated(req, {f"{job}/{i}": m for i, m in enumerate(machines)}))
    batch = reports(("a/0", "RUNNING", "m1"), ("b/0", "RUNNING", "m3"), ("a/1", "RUNNING", "m2"),
                    ("a/9", "RUNNING", "m1"))  # the last one about a task that does not exist
    out = sim.feed(batch)  # Sim.feed: delivered twice, the second time changes nothing
    assert sorted(k for k in kinds(out) if k[0] == "discovery") == [
        ("discovery", "a/0", True), ("discovery", "a/1", True), ("discovery", "b/0", True)]
    assert {v["job"]: v["state"] for v in (sim.view("a"), sim.view("b"))} == {"a": JOB_RUNNING, "b": JOB_RUNNING}
    assert sim.view("a")["last_ignored"].startswith(f"{REASON_UNKNOWN_TASK}: r-a/9-RUNNING")
    assert batch.event_id in sim.state.jobs["a"].seen and batch.event_id in sim.state.jobs["b"].seen


def test_many_machines_down_in_one_event_make_one_request_per_job():
    sim = running_job(4, ("m1", "m2", "m3", "m4"), job="a")
    sim = running_job(2, ("m5", "m6"), job="b", sim=sim)
    down = ev("MachinesStatusChanged", {"status": "DOWN", "reason": "health_check", "machines": [
        {"machine_id": m, "previous_status": "UNHEALTHY"} for m in ("m1", "m3", "m6", "m9")]},
        producer="health", entity=ENT)
    out = sim.feed(down)
    requests = [(k[1], k[2], k[3]) for k in kinds(out) if k[0] == "request"]
    assert requests == [(("a/0", "a/2"), ("a/0", "a/2"), ("m1", "m3")), (("b/1",), ("b/1",), ("m6",))]
    assert sorted(sim.state.machines_down) == ["m1", "m3", "m6", "m9"]
    back = ev("MachinesStatusChanged", {"status": "UP", "reason": "heartbeat_resumed", "machines": [
        {"machine_id": m, "previous_status": "DOWN"} for m in ("m1", "m3", "m6", "m9")]}, producer="health",
        entity=ENT)
    sim.feed(back)
    assert dict(sim.state.machines_down) == {}


TOO_MANY = {  # an intent beyond the limit (here 100 tasks) -> the job's state, its last_reason
    "submitted": (lambda: [submit("j", 101)], JOB_REJECTED),
    "resized": (lambda: [submit("j", 2), resized("j", 101)], JOB_PENDING),
    "spec-changed": (lambda: [submit("j", 2), spec_changed("j", 150, version=2)], JOB_PENDING),
}


@pytest.mark.parametrize("inputs, state", TOO_MANY.values(), ids=TOO_MANY)
def test_a_job_beyond_the_limit_is_refused_with_a_reason(inputs, state):
    sim = Sim(max_tasks=100)
    sim.feed(entitlement())
    for e in inputs():
        sim.feed(e)
    view = sim.view()
    assert view["state"] == state and view["desired_tasks"] <= 2 and len(view["tasks"]) <= 2
    assert view["last_reason"].startswith(reasons.REASON_TOO_MANY_TASKS + ": tasks: at most 100 tasks per job")
    at_limit = Sim(max_tasks=101)
    at_limit.feed(entitlement())
    assert at_limit.feed(submit("k", 101))[0].type == "AllocationRequested"  # the limit itself is served


def test_a_spec_too_big_to_travel_is_refused():
    sim = Sim()
    sim.feed(entitlement())
    sim.feed(submit("j", 2, env={f"K{i}": "x" * 1000 for i in range(300)}))
    assert sim.view()["state"] == JOB_REJECTED and "at most 262,144" in sim.view()["last_reason"]


def test_a_20000_task_job_is_commanded_and_published_in_records_below_the_limit():
    n = 20_000
    sim = Sim()
    sim.feed(entitlement())
    (req,) = of_type(sim.feed(submit("big", n)), "AllocationRequested")
    machines = [f"dc1-msb{i % 20:02d}-r{i % 9:02d}-m{i:05d}" for i in range(n)]
    placements = [{"task_id": f"big/{i}", "machine_id": machines[i], "dc": "dc1", "msb": f"msb{i % 20:02d}",
                   "rack": f"r{i % 9:02d}"} for i in range(n)]
    out = sim.feed(ev("TasksAllocated", {"request_id": req.payload["request_id"], "job_id": "big",
                                         "placements": placements}, producer="allocator"))
    sizes = {}
    for e in out:
        size = len(REG.encode(e.type, e.to_record(schema_version=1)))
        assert size < MAX_RECORD_BYTES, (e.type, size)
        sizes.setdefault(e.type, []).append(size)
    assert len(sizes["TasksCommanded"]) >= 4 and len(sizes["TaskStatesChanged"]) >= 4  # at most 5,000 items each
    assert len(sizes["JobTasksPublished"]) == 40 and sizes["JobStatePublished"][0] < 10_000
    assert len(commands(out)) == n and len(of_type(out, "TaskStateChanged")) == n
    (head,) = of_type(out, "JobStatePublished")
    assert head.payload["task_parts"] == 40 and head.payload["task_count"] == n and head.payload["tasks"] == []
    # one agent report later: the header and the one part whose task changed, nothing else
    out = sim.feed(reports(("big/7777", "RUNNING", machines[7777])))
    assert [(e.type, e.entity_id) for e in out if e.type.startswith("Job")] == [
        ("JobStatePublished", "big"), ("JobTasksPublished", "big#15")]


def test_a_job_crossing_500_tasks_publishes_its_tasks_in_parts_and_back():
    sim = running_job(2, ("m1", "m2"))
    out = sim.feed(resized("j", 1_001))
    parts = of_type(out, "JobTasksPublished")
    assert [(p.payload["part"], len(p.payload["tasks"]), p.payload["deleted"]) for p in parts] == [
        (0, 500, False), (1, 500, False), (2, 1, False)]
    assert of_type(out, "JobStatePublished")[0].payload["task_parts"] == 3
    out = sim.feed(resized("j", 2))  # the retired tasks never ran: dropped at once
    (head,) = of_type(out, "JobStatePublished")
    assert head.payload["task_parts"] == 0 and [t["task_id"] for t in head.payload["tasks"]] == ["j/0", "j/1"]
    assert [(p.payload["part"], p.payload["deleted"]) for p in of_type(out, "JobTasksPublished")] == [
        (0, True), (1, True), (2, True)]
