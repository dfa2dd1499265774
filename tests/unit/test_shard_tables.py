"""The scheduler shard around a recovery and its retry timer, without a broker: which jobs the timer loads
(``decide.has_timer_work``, kept in each job's header by ``store.plan``), a job the tables cannot give back whole
(``ShardTables.load`` leaves it out and says why; ``shard.unreadable_named`` says what to do with an event naming
it), and when faust's tables may be read at all (``faustwire.tables_ready``, on faust's own App object).

``ShardTables`` is built on a real faust app that is not started (its tables' memory stores are plain mappings).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from infra.config import Config
from processors.cowmap import CowMap
from processors.scheduler import handover as ho
from processors.scheduler import store as st
from processors.scheduler.decide import REASK_MS, has_timer_work, retry_unplaced
from processors.scheduler.steps import RECOMMAND_MS
from processors.scheduler.shard import ShardTables, unreadable_named
from streams.faustwire import make_app, tables_ready
from test_maintenance import maintenance  # the scheduler tests' harness (tests/unit is on sys.path)
from test_scheduler_decide import (
    ENT, T0, Sim, agent_reactions, allocated, deallocated, entitlement, rejected, report, reports, running_job,
    spec_changed, stopped, submit,
)
from test_taskcontrol_scheduler import CTL, controlled_job


# -- which jobs the timer has work for ----------------------------------------------------------------------------

def _running():
    return running_job()


def _parked():
    sim = Sim()
    sim.feed(entitlement())
    (req, _) = sim.feed(submit("j", 3))
    sim.feed(rejected(req, ["j/0", "j/1", "j/2"]))
    return sim


def _partly_parked():
    sim = Sim()
    sim.feed(entitlement())
    (req, _) = sim.feed(submit("j", 3))
    sim.feed(allocated(req, {"j/0": "m1", "j/1": "m2"}))
    sim.feed(rejected(req, ["j/2"]))
    return sim


def _stopped_and_freed():
    sim = running_job()
    out = sim.feed(stopped("j"))
    out = sim.feed_all(list(agent_reactions(out)))
    (free,) = [e for e in out if e.type == "AllocationRequested"]
    sim.feed(deallocated(free))
    return sim


def _under_maintenance():
    sim = running_job()
    sim.feed(maintenance(["m1"]))
    return sim


def _controller_not_answering():
    sim = controlled_job(2)
    sim.feed(spec_changed("j", 2, version=2, controller=CTL))  # a request to the controller, unanswered
    return sim


def _rejected_then_running_elsewhere():
    sim = _partly_parked()
    (again,) = [e for e in retry_unplaced(sim.state, T0 + 30_000)[1] if e.type == "AllocationRequested"]
    sim.state = retry_unplaced(sim.state, T0 + 30_000)[0]
    out = sim.feed(allocated(again, {"j/2": "m3"}))
    sim.feed_all(list(agent_reactions(out)))
    sim.feed(reports(("j/0", "RUNNING", "m1"), ("j/1", "RUNNING", "m2")))
    return sim


# (scenario, the job has timer work?)
TIMER_WORK = [
    ("running, nothing waits", _running, False),
    ("every task parked by an AllocationRejected", _parked, True),
    ("one task of three parked", _partly_parked, True),
    ("placed after a retry: nothing parked any more", _rejected_then_running_elsewhere, False),
    ("stopped and freed", _stopped_and_freed, False),
    ("a planned maintenance of its machine, deadline ahead", _under_maintenance, True),
    ("operations open, its TaskController not answering", _controller_not_answering, True),
]


@pytest.mark.parametrize("why, build, expected", TIMER_WORK, ids=[c[0] for c in TIMER_WORK])
def test_the_timer_loads_only_jobs_with_work_and_decides_the_same(why, build, expected):
    """``has_timer_work`` is what the header says (``store.plan``); the timer over only the jobs it says True of
    emits the same and leaves the same state as over every job, at every moment (the deadline, the re-ask)."""
    sim = build()
    idle = running_job(job="idle", machines=("m7", "m8", "m9"), sim=Sim(sim.state))  # a job with nothing to do
    state = idle.state
    job = state.jobs["j"]
    assert has_timer_work(job) is expected
    assert has_timer_work(state.jobs["idle"]) is False
    header = st.plan(None, None, {}, job).header
    assert st.wants_timer(header) is expected
    flagged = dataclasses.replace(state, jobs=CowMap((j, x) for j, x in state.jobs.items() if has_timer_work(x)))
    for now in (T0 + 1, T0 + 30_000, T0 + REASK_MS, T0 + 300_000, T0 + 3_600_000):
        whole, out = retry_unplaced(state, now)
        part, part_out = retry_unplaced(flagged, now)
        assert part_out == out
        assert {j: part.jobs.get(j) for j in part.jobs} == {j: whole.jobs[j] for j in part.jobs}
        assert all(whole.jobs[j] is state.jobs[j] for j in state.jobs if j not in flagged.jobs)


def test_a_header_written_before_the_flag_counts_as_timer_work():
    sim = running_job()
    header = st.plan(None, None, {}, sim.state.jobs["j"]).header
    assert st.wants_timer(header) is False
    del header["timer"]
    assert st.wants_timer(header) is True


# -- the shard's tables: the timer's selection, a job that cannot be read --------------------------------------------

@pytest.fixture()
def tables(tmp_path):
    return ShardTables(make_app(Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)}), "recovery-test"), 8)


def _put(tables, state):
    for name, ent in state.entitlements.items():
        tables.entitlements.data[name] = dataclasses.asdict(ent)
    for job_id, job in state.jobs.items():
        plan = st.plan(None, None, {}, job)
        for key, value in plan.chunks.items():
            tables.job_chunks.data[key] = value
        tables.jobs.data[job_id] = plan.header


def _two_jobs():
    """Job "j" parked (timer work) and job "k" running, both of ENT."""
    sim = _parked()
    return running_job(job="k", machines=("m4", "m5", "m6"), sim=sim)


def test_timer_job_keys_are_the_flagged_jobs_of_each_active_partition(tables):
    sim = _two_jobs()
    _put(tables, sim.state)
    part = tables.hash_partition(ENT)
    other = (part + 1) % 8
    assert tables.timer_job_keys({part, other}) == {part: ["j"], other: []}
    assert tables.timer_job_keys({other}) == {other: []}
    del tables.jobs.data["k"]["timer"]  # an older header: loaded to be sure
    assert tables.timer_job_keys({part}) == {part: ["j", "k"]}


def test_a_job_in_flight_is_loaded_by_the_timer_once_its_repair_is_due(tables):
    """A job whose tasks await their agents' reports (STARTING since ``T0``) has timer work only once a report is
    ``RECOMMAND_MS`` late: its header says from when (``timer_at``), so a round before then loads nothing (a burst's
    jobs in flight are not decoded at every round); a round without a clock loads it as before."""
    sim = Sim()
    sim.feed(entitlement())
    sim.feed(allocated(sim.feed(submit("j", 2))[0], {"j/0": "m1", "j/1": "m2"}))
    _put(tables, sim.state)
    part = tables.hash_partition(ENT)
    assert tables.jobs.data["j"]["timer_at"] == T0 + RECOMMAND_MS
    assert tables.timer_job_keys({part}, T0 + RECOMMAND_MS - 1) == {part: []}
    assert tables.timer_job_keys({part}, T0 + RECOMMAND_MS) == {part: ["j"]}
    assert tables.timer_job_keys({part}) == {part: ["j"]}
    del tables.jobs.data["j"]["timer_at"]  # an older header: by its flag
    assert tables.timer_job_keys({part}, T0) == {part: ["j"]}


def test_timer_job_keys_follow_a_moved_entitlement_and_skip_a_frozen_one(tables):
    """A job of an entitlement that moved to another partition is kept under ``<job>~<partition>`` and belongs to
    that partition's round; an entitlement frozen on a partition (leaving it) is decided nowhere there."""
    sim = _parked()
    job = sim.state.jobs["j"]
    here = tables.hash_partition(ENT)
    there = (here + 1) % 8
    key = tables.key("j", ENT, there)
    tables.jobs.data[key] = st.plan(None, None, {}, job, key=key).header
    assert key == f"j~{there}" and tables.timer_job_keys({here, there}) == {here: [], there: [key]}
    tables.homes.data[ho.home_key(ENT, there)] = ho.home_record(ho.Home(there, epoch=1, moving_to=here))
    assert tables.timer_job_keys({here, there}) == {here: [], there: []}


def test_a_job_whose_chunk_is_missing_is_left_out_and_the_others_load(tables, caplog):
    """The 2026-11-27 crash: a header naming a chunk the table did not hold (read during a recovery) raised
    MissingChunk out of the retry timer and stopped the worker. Now the job is left out, with the reason."""
    sim = _two_jobs()
    _put(tables, sim.state)
    [chunk] = [k for k in tables.job_chunks.data if st.job_of_key(k) == "j"]
    del tables.job_chunks.data[chunk]
    for _ in range(2):
        state, headers, _ = tables.load((), ["j", "k", "unknown"])
        assert list(state.jobs) == ["k"] and list(headers) == ["k"]
        assert state.jobs["k"] == sim.state.jobs["k"]
        assert list(tables.unreadable) == ["j"]
        assert tables.unreadable["j"].startswith("MissingChunk: job j: its header names chunk 0 at version 1")
    assert len([r for r in caplog.records if "cannot be read" in r.getMessage()]) == 1  # once per stored header
    new, out = retry_unplaced(tables.with_bucket(state, tables.hash_partition(ENT)), T0 + 30_000)
    assert out == [] and new.jobs["k"] is state.jobs["k"]  # the timer goes on with the others
    tables.job_chunks.data[chunk] = st.plan(None, None, {}, sim.state.jobs["j"]).chunks[chunk]  # mended
    state, headers, _ = tables.load((), ["j", "k"])
    assert sorted(state.jobs) == ["j", "k"] and tables.unreadable == {}


def test_a_header_that_is_no_job_is_left_out_too(tables):
    sim = _two_jobs()
    _put(tables, sim.state)
    tables.jobs.data["j"] = {**tables.jobs.data["j"], "spec": "garbage"}
    state, _, _ = tables.load((), ["j", "k"])
    assert list(state.jobs) == ["k"] and list(tables.unreadable) == ["j"]


# (event, unreadable jobs) -> None (decide it), or (names only unreadable jobs: skip it, dead-letter detail start)
UNREADABLE = [
    ("an intent of another job", submit("other", 1), None),
    ("a submission of the unreadable job", submit("j", 1), (True, "JobSubmitted names jobs the shard cannot read: j:")),
    ("an agent's reports of it and another job", reports(("j/0", "RUNNING", "m1"), ("k/0", "RUNNING", "m4")),
     (False, "TaskStatesChanged names jobs the shard cannot read: j:")),
    ("an agent's report of it alone", report("j/0", "RUNNING", "m1"),
     (True, "TaskStateChanged names jobs the shard cannot read: j:")),
    ("a machine event (names no job)", maintenance(["m1"]), None),
]


@pytest.mark.parametrize("why, event, expected", UNREADABLE, ids=[c[0] for c in UNREADABLE])
def test_what_the_agent_does_with_an_event_naming_an_unreadable_job(why, event, expected):
    got = unreadable_named(event, {"j": "MissingChunk: job j: ..."})
    if expected is None:
        assert got is None
    else:
        assert got[0] is expected[0] and got[1].startswith(expected[1])


# -- when faust's tables may be read ----------------------------------------------------------------------------

def test_tables_are_ready_only_between_a_recovery_and_the_next_rebalance(tmp_path):
    """What faust's own App and TableManager say, driven by the methods faust calls (faust-streaming 0.15.3)."""
    app = make_app(Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)}), "ready-test")
    assert tables_ready(app) is False  # before the first recovery
    app.on_rebalance_start()  # the consumer's rebalance listener, as partitions are revoked
    assert tables_ready(app) is False
    app.tables.on_actives_ready()  # the recovery read every active changelog
    assert tables_ready(app) is False  # ...but the rebalance is not over
    app.on_rebalance_end()
    assert tables_ready(app) is True
    app.on_rebalance_start()  # the next rebalance: not ready from its first moment, before any recovery runs
    assert tables_ready(app) is False and app.in_recovery is False
    app.on_rebalance_end()  # both flags count: the actives were not recovered since the rebalance began
    assert tables_ready(app) is False


def test_the_retry_round_bench_runs_at_a_small_size(capsys):
    """``bench/retry_round.py`` (its figures are in BENCHMARKS.md) at CI size: it runs and says what it measured;
    the sliced round decides on the parked jobs only (a selection, then one slice per partition here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import retry_round  # noqa: PLC0415 - bench/retry_round.py is a script: importable once bench/ is on sys.path

    assert retry_round.main(["--jobs", "40", "--tasks", "3", "--parked", "0.25", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["jobs"] == 40 and doc["jobs_parked"] == 10
    assert doc["baseline_warm"]["decisions"] == 1
    assert doc["now_warm"]["decisions"] == 1 + 1  # the selection, then one slice: every 4th job is bench-e0's
    assert all(doc[k]["round_ms"] >= 0 for k in ("baseline_cold", "baseline_warm", "now_cold", "now_warm"))
