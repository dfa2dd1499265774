"""Stopped jobs leave the scheduler's state once their grace passed (processors/scheduler/README.md, "Stopped jobs
leave"): ``decide.collect`` (the timer's), ``decide`` taking an expired job for gone, ids that stay unique across
incarnations without the dead job, and old events redelivered after the job left."""
from __future__ import annotations

import dataclasses

import pytest

from processors.scheduler import decide as sd
from processors.scheduler import model as sm
from processors.scheduler import offsets, records, store, work
from processors.scheduler.lifecycle import JOB_ACTIVE, JOB_PENDING, JOB_REJECTED, JOB_STOPPED, JOB_STOPPING
from processors.scheduler.reasons import REASON_UNKNOWN_JOB
from processors.taskcontrol import protocol as tc
from test_scheduler_decide import (  # the scheduler tests' harness (tests/unit is on sys.path)
    ENT, T0, Sim, allocated, deallocated, ev, kinds, machine_status, of_type, refusals, report, resized,
    running_job, stopped, submit,
)

GC_MS = 60_000  # the grace in these tests


def gone_job(n=2, sim=None):
    """A job of ``n`` tasks that ran, was stopped and freed (deleted) at T0; returns (sim, its last requests)."""
    sim = running_job(n, tuple(f"m{i + 1}" for i in range(n)), sim=sim or Sim(gc_ms=GC_MS))
    sim.feed(stopped("j"))
    out = []
    for i in range(n):
        out += sim.feed(report(f"j/{i}", "STOPPED", f"m{i + 1}", exit_code=0))
    free = of_type(out, "AllocationRequested")[-1]
    sim.feed(deallocated(free))
    job = sim.state.jobs["j"]
    assert job.deleted and job.ended_ms == T0
    return sim, [free]


# -- collect: the timer's decision, a table ----------------------------------------------------------------------

def job(status=JOB_ACTIVE, deleted=False, ended_ms=None):
    spec = sm.Spec(name="j", command=("x",), cpu=1, mem=1)
    return sm.Job(id="j", entitlement=ENT, spec=spec, spec_version=1, desired=0, status=status, deleted=deleted,
                  ended_ms=ended_ms)


COLLECT = {  # case -> (job, now - T0, collected)
    "active, however old": (job(), 10 * GC_MS, False),
    "stopping": (job(JOB_STOPPING), 10 * GC_MS, False),
    "stopped, its free not answered": (job(JOB_STOPPED), 10 * GC_MS, False),
    "deleted, within its grace": (job(JOB_STOPPED, True, T0), GC_MS - 1, False),
    "deleted, its grace just passed": (job(JOB_STOPPED, True, T0), GC_MS, True),
    "rejected, within its grace": (job(JOB_REJECTED, ended_ms=T0), GC_MS // 2, False),
    "rejected, its grace passed": (job(JOB_REJECTED, ended_ms=T0), 2 * GC_MS, True),
    "deleted before ended_ms was kept (an older record)": (job(JOB_STOPPED, True, None), 0, True),
}


@pytest.mark.parametrize("j, after, collected", COLLECT.values(), ids=COLLECT)
def test_collect_takes_the_jobs_whose_grace_passed(j, after, collected):
    other = dataclasses.replace(j, id="k")
    state = sm.state_of([j, dataclasses.replace(job(), id="live")])
    new, gone = sd.collect(state, T0 + after, GC_MS)
    assert gone == (["j"] if collected else [])
    assert ("j" in new.jobs) is not collected and "live" in new.jobs
    assert sd.is_expired(j, T0 + after, GC_MS) is collected
    # the shard asks the same of a stored header, without decoding the job
    header = store.plan(None, None, {}, j).header
    assert store.expired(header, T0 + after, GC_MS) is collected
    assert sd.collect(sm.state_of([other]), T0 + after, GC_MS)[1] == (["k"] if collected else [])


def test_a_job_s_ending_is_timed_and_kept_in_its_record():
    sim, _ = gone_job()
    j = sim.state.jobs["j"]
    assert records.job_from_record(records.job_to_record(j)) == j
    assert j.maint == () and j.tc_notices == ()  # a deleted job is tied to no machine: only its id concerns it
    rejected = Sim(gc_ms=GC_MS)
    rejected.feed(submit("k", 1, ent="nope"), T0 + 5)
    assert rejected.state.jobs["k"].status == JOB_REJECTED and rejected.state.jobs["k"].ended_ms == T0 + 5


def test_the_state_keys_of_a_job_name_every_part_it_published():
    """A job of more than 500 tasks published parts on state.tasks: when it leaves, each gets a tombstone."""
    sim = Sim(gc_ms=GC_MS)
    sim.feed(ev("EntitlementCreated", {"name": ENT, "quota_machines": 10_000, "machine_type": None, "dc_pin": None,
                                       "host_profile": None}, producer="cli", entity=ENT))
    sim.feed(submit("j", 1_200))
    sim.feed(resized("j", 10))
    j = sim.state.jobs["j"]
    assert j.parts == 3  # 1,200 tasks: parts 0..2, published once; it keeps the most it published
    assert work.state_keys(j) == [("state.jobs", "j"), ("state.tasks", "j#0"), ("state.tasks", "j#1"),
                                  ("state.tasks", "j#2")]
    assert work.state_keys(dataclasses.replace(j, parts=0)) == [("state.jobs", "j")]


# -- after the grace: a new incarnation that owes nothing to the old one ------------------------------------------

def test_within_the_grace_a_resubmission_is_the_next_incarnation():
    sim, (free,) = gone_job()
    out = sim.feed(submit("j", 2), T0 + GC_MS - 1)
    published = of_type(out, "JobStatePublished")[-1].payload
    assert (published["incarnation"], published["state"]) == (2, JOB_PENDING)


@pytest.mark.parametrize("collected", (False, True), ids=("held, expired", "collected"))
def test_after_the_grace_the_job_id_starts_afresh_and_old_answers_stay_stale(collected):
    """After its grace the old job is gone, whether the timer took it out yet or not (the Sim checks both on every
    event): a submission of its id is incarnation 1 again, and no id of the new one is the old one's: the old
    incarnation's requests, operations and TaskControl sequence cannot be answered into the new one."""
    sim, (free,) = gone_job()
    old = sim.state.jobs["j"]
    later = T0 + GC_MS + 5_000
    if collected:
        sim.state, gone = sd.collect(sim.state, later, GC_MS)
        assert gone == ["j"] and "j" not in sim.state.jobs
    out = sim.feed(submit("j", 2), later)
    new = sim.state.jobs["j"]
    assert new.incarnation == 1 and new.seen == (new.submission,) and new.submission != old.submission
    (req,) = of_type(out, "AllocationRequested")
    assert req.payload["request_id"] == sm.request_id("j", 1, 1, sm.incarnation_tag(new.submission))
    assert req.payload["request_id"] != sm.request_id("j", 1, 1, sm.incarnation_tag(old.submission))
    assert new.tc_seq == sm.first_sequence(later) > old.tc_seq
    # the allocator's late (or journaled, re-sent) answer to the old incarnation's first request: stale
    old_first = dataclasses.replace(req, payload={**req.payload, "request_id": sm.request_id(
        "j", 1, 1, sm.incarnation_tag(old.submission))})
    assert sim.feed(allocated(old_first, {"j/0": "m9", "j/1": "m8"}), later) == []
    assert sim.feed(deallocated(free), later) == []
    assert {t.state for t in sim.state.jobs["j"].tasks.values()} == {"PENDING"}
    # its own answer places it
    out = sim.feed(allocated(req, {"j/0": "m1", "j/1": "m2"}), later)
    assert [k[:2] for k in kinds(out) if k[0] == "START"] == [("START", "j/0"), ("START", "j/1")]


# -- an old event redelivered after the job left -------------------------------------------------------------------

def _old_events(sim, free):
    """Events of the gone job's life, as they were on the log (each delivered again below)."""
    return {
        "JobStopped": stopped("j"),
        "JobResized": resized("j", 5),
        "TasksDeallocated of its final free": deallocated(free),
        "TasksAllocated of its first request": allocated(free, {"j/0": "m1"}),
        "an agent's late RUNNING": report("j/0", "RUNNING", "m1"),
        "an agent's late FAILED": report("j/1", "FAILED", "m2", exit_code=1),
        "a controller's late ack": ev("TaskControlAcked", tc.ack_payload("j", 7, ["j/0:update:1"], "ctl"),
                                      producer="taskcontroller/ctl", entity="j"),
        "a machine of it going down": machine_status("m1", "DOWN"),
    }


OLD = ("JobStopped", "JobResized", "TasksDeallocated of its final free", "TasksAllocated of its first request",
       "an agent's late RUNNING", "an agent's late FAILED", "a controller's late ack", "a machine of it going down")


@pytest.mark.parametrize("name", OLD)
def test_an_old_event_after_the_job_left_changes_nothing(name):
    """Delivered again once the job is gone (collected): an intent is refused as about an unknown job (an
    IntentRefused, nothing applied), anything else changes nothing and emits nothing. Delivered again once the job
    id lives again as a new incarnation, what is not an intent changes nothing either: the old answers, acks and
    reports name requests, operations, sequences or placements of the old incarnation (an intent names a job id,
    not an incarnation: ``test_a_very_old_event_is_never_read_again``)."""
    sim, (free,) = gone_job()
    later = T0 + GC_MS + 1
    sim.state, _ = sd.collect(sim.state, later, GC_MS)
    old = _old_events(sim, free)[name]
    before = sim.state
    out = sim.feed(old, later)
    assert sim.state.jobs == before.jobs and "j" not in sim.state.jobs
    assert out == [] or refusals(out) == [(old.type, REASON_UNKNOWN_JOB)]
    assert refusals(out) == ([(old.type, REASON_UNKNOWN_JOB)] if old.type in ("JobStopped", "JobResized") else [])
    if old.type in ("JobStopped", "JobResized"):
        return
    sim.feed(submit("j", 2), later)
    fresh = sim.state.jobs["j"]
    assert sim.feed(old, later + 1) == []
    assert sim.state.jobs["j"].tasks == fresh.tasks


def test_within_the_grace_the_duplicate_ring_guards_the_next_incarnation():
    """An intent of the old incarnation delivered again while the job is still held (its grace): the ring it passed
    to the next incarnation knows it."""
    sim = running_job(1, ("m1",), sim=Sim(gc_ms=GC_MS))
    stop = stopped("j")
    sim.feed(stop)
    sim.feed(deallocated(of_type(sim.feed(report("j/0", "STOPPED", "m1", exit_code=0)), "AllocationRequested")[-1]))
    sim.feed(submit("j", 1), T0 + 10)
    assert sim.state.jobs["j"].incarnation == 2 and stop.event_id in sim.state.jobs["j"].seen
    assert sim.feed(stop, T0 + 20) == [] and sim.state.jobs["j"].status == JOB_ACTIVE


@pytest.mark.parametrize("offset, next_offset", [(0, 1), (5, 9), (0, 10**9)])
def test_a_very_old_event_is_never_read_again(offset, next_offset):
    """What guards an intent (a JobSubmitted above all: it would start again the job the user stopped) from being
    applied again after its job left: the shard reads a partition only after the offset it stored with the state
    that record changed (``offsets.verdict``); a record below it is a DUPLICATE, passed over, however old. The
    producers are idempotent (a retry is not a second record), so a second copy is a read again, never a write."""
    assert offsets.verdict(next_offset, offset) == offsets.DUPLICATE
    assert offsets.verdict(offset, offset) == offsets.APPLY


def test_an_event_about_a_held_expired_job_leaves_the_state_as_it_came():
    """The shard stores a batch's state only if it changed (``state is not start``): an answer or a report about a
    job held past its grace (the timer not come yet) changes nothing, the very state object comes back."""
    sim, (free,) = gone_job()
    later = T0 + GC_MS + 1
    for old in (deallocated(free), report("j/0", "RUNNING", "m1")):
        new, out = sd.decide(sim.state, old, later, gc_ms=GC_MS)
        assert new is sim.state and out == []
