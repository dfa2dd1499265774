"""The history (processors/history) on a region's log recorded without a broker (tests/history_log.py): the region
at any moment equals what the region showed then, through snapshot chains too; the live policy's shadow reproduces
the log and another policy's does not; a what-if of a maintenance names the moves it then made; explain finds the
decision and its causes."""
from __future__ import annotations

import dataclasses
import json

import pytest

import history_log as hl
from test_scheduler_decide import untag  # the scheduler tests' helpers (tests/unit is on sys.path)
from infra.config import Config
from processors.allocator.placement import LIVE, Policy, SCORE_CHOICES
from processors.frontend.console import CliError
from processors.history import explain, moments, shadow, snapshots, whatif
from processors.history.region import Region
from processors.resourcebroker import decide as rb
from processors.scheduler import records
from streams.events import Event, new_event
from streams.serde import SchemaRegistry


@pytest.fixture(scope="module")
def rec() -> hl.Recorded:
    return hl.regional_log()


@pytest.fixture(scope="module")
def registry() -> SchemaRegistry:
    return SchemaRegistry.from_dir()


def at(second: int) -> int:
    return hl.T0 + second * 1000


@pytest.mark.parametrize("second", hl.MOMENTS_S)
def test_the_region_at_a_moment_is_what_it_showed_then(rec, second):
    assert hl.view(hl.fold(rec, at(second))) == rec.views[at(second)]


def test_the_scripted_region_goes_through_what_it_should(rec):
    """The comparisons above are worth something only if the log moves tasks, resizes, stops and maintains."""
    types = {ev.type for ev, _ in rec.records}
    assert {"TasksDeallocated", "MachineStatusChanged", "UnavailabilityStarted", "UnavailabilityEnded", "JobResized",
            "JobStopped", "TaskControlRequested"} <= types
    moved = [ev for ev, _ in rec.records if ev.type == "AllocationRequested" and ev.payload["free_task_ids"]
             and ev.payload["place_task_ids"]]
    assert moved, "no task was moved"
    assert len({pos[1] for ev, pos in rec.records if ev.type == "JobSubmitted"}) == 3  # three partitions


def state_of(region: Region) -> dict:
    """Everything a region holds; its dormant jobs (a loaded snapshot's deleted ones, undecoded) as the jobs they are."""
    jobs = {j.id: records.job_to_record(j) for j in region.scheduler.jobs.values()}
    jobs.update({j: records.job_to_record(records.job_from_record(json.loads(raw)))
                 for j, (raw, _) in region.dormant.items()})
    return {"fold": region.fold.dump(), "jobs": jobs,
            "published": {j: e.payload for j, e in region.job_states().items()}, "buckets": region.buckets,
            "down": dict(region.scheduler.machines_down), "changed": region.changed_ms,
            "inputs": sorted((w, r, d[0].event_id) for w, r, _, k, d in region._queue if k == 0),
            "waiting": {p: [(e.event_id, s, t) for e, s, t in w] for p, w in region._waiting.items() if w}}


def test_a_snapshot_chain_gives_the_region_a_fold_from_the_beginning_gives(rec, registry, tmp_path):
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_PARTITIONS": str(hl.PARTITIONS)})
    region = Region(hl.TOPICS)
    files = []
    for i, second in enumerate((15, 25, 45, 65, 85, 105, 125)):
        hl.fold(rec, at(second), region)
        files.append(snapshots.write(cfg, region, registry, full=i == 0))
    assert [f.delta for f in files] == [False] + [True] * 6
    for f, later in zip(files, (30, 50, 70, 90, 110, 140, 200)):
        loaded = Region(hl.TOPICS)
        assert snapshots.usable(f, loaded) is None
        verify = snapshots.load(f, loaded, registry)
        assert verify == {tp: eid for tp, eid in loaded.last_ids.items()}
        fresh = hl.fold(rec, f.cut)
        assert state_of(loaded) == state_of(fresh), f.path.name
        assert hl.view(hl.fold(rec, at(later), loaded)) == hl.view(hl.fold(rec, at(later)))
    # a snapshot made under other conditions is not used
    other = Region(hl.TOPICS, lookahead_ms=5_000)
    assert "lookahead_ms" in snapshots.usable(files[-1], other)


def test_a_loaded_snapshot_s_deleted_jobs_wake_when_an_input_names_one(rec, registry, tmp_path):
    """A snapshot's deleted jobs are loaded undecoded (``Region.dormant``); a resubmission of one's id, or an intent
    about it, decides on the loaded region exactly as on the region folded from the beginning (the next incarnation,
    the duplicate ring), and the next snapshot keeps the ones still dormant."""
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_PARTITIONS": str(hl.PARTITIONS)})
    snap = snapshots.write(cfg, hl.fold(rec, at(hl.UNTIL_S)), registry)
    loaded = Region(hl.TOPICS)
    snapshots.load(snap, loaded, registry)
    fresh = hl.fold(rec, snap.cut)
    assert loaded.dormant, "the recorded region deletes no job: nothing is tested"
    assert not set(loaded.dormant) & set(loaded.scheduler.jobs)
    job_id, dormant = sorted(loaded.dormant)[0], len(loaded.dormant)
    submitted = next(ev for ev, _ in rec.records if ev.type == "JobSubmitted" and ev.payload["job_id"] == job_id)
    now = snap.cut + 1_000
    again = [dataclasses.replace(submitted, event_id="resubmitted-once", timestamp_ms=now),
             dataclasses.replace(submitted, event_id="resubmitted-once", timestamp_ms=now + 1)]  # a redelivery
    docs = [whatif.simulate(r, again, now, now + whatif.SETTLE_MS) for r in (loaded, fresh)]
    assert docs[0] == docs[1]
    assert state_of(loaded) == state_of(fresh)
    assert job_id not in loaded.dormant and loaded.scheduler.jobs[job_id].incarnation == 2
    assert len(loaded.dormant) == dormant - 1  # the others stay undecoded
    again_snap = snapshots.write(cfg, loaded, registry)
    reloaded = Region(hl.TOPICS)
    snapshots.load(again_snap, reloaded, registry)
    assert state_of(reloaded) == state_of(loaded)


def shadow_of(rec: hl.Recorded, since: int, policy: Policy, until: int = hl.UNTIL_S):
    region = hl.fold(rec, at(since))
    at_since, log = shadow.begin(region, policy)
    shadow.replay(region, rec.merged(region.positions), at(until))
    return shadow.compare(log, region, at_since, at(until), rec.registry), log


@pytest.mark.parametrize("since", (0, 10, 30, 55, 95))
def test_the_live_policy_s_shadow_reproduces_the_log(rec, since):
    diff, log = shadow_of(rec, since, LIVE)
    assert diff["decisions_differ"] == 0, diff["decisions"]
    assert diff["scheduler_events_differ"] == 0, diff["scheduler"]
    assert diff["empty"], diff["totals_equal"]
    assert diff["decisions_compared"] > 0 and diff["scheduler_events_compared"] > 0
    assert log.synthesized == 0 and log.dropped_reports == 0  # every report was the log's own


def _report_batch(**item) -> Event:
    """A scheduler's TaskStatesChanged of one report as ``decide`` emits it (no ``proof``: only agents prove)."""
    report = {"report_id": "r1", "task_id": "e1.web/0", "job_id": "e1.web", "machine_id": "m1", "state": "ALLOCATED",
              "previous_state": "PENDING", "exit_code": None, "spec_version": 1, "reason": "allocated",
              "cause_id": None, **item}
    return new_event("TaskStatesChanged", {"reports": [report]}, entitlement="e1", entity_id="e1.web/0",
                     producer="scheduler", timestamp_ms=hl.T0, event_id="b1")


@pytest.mark.parametrize("recorded, decided, same", [
    # the log's copy holds the schema's default for the field the decision left out: the same decision
    (dict(proof=None), {}, True),
    ({}, {}, True),
    # a real difference is one, however the two are held
    (dict(proof=None), dict(state="RUNNING"), False),
    (dict(proof=None), dict(machine_id="m2"), False),
    # a proof is compared like any field: a shadow's report proven where the log's is not is not the same event
    (dict(proof=None), dict(proof=b"\x01" * 32), False),
    # what no producer could write (a report without its state) is no decision the log could hold
    (dict(proof=None), dict(state=None), False),
])
def test_the_shadow_compares_events_as_the_log_holds_them(registry, recorded, decided, same):
    """``shadow.same``: the recorded event is read back from the log (defaults filled), the shadow's is as decided;
    both are compared written and read back with the schemas (issue 27's ``proof`` in a report: CI's fresh-clone runs
    of test_history_region and test_shadow_bench differed in every scheduler TaskStatesChanged before)."""
    logged = _report_batch(**recorded)
    logged = Event.from_record(*registry.decode(registry.encode(logged.type, logged.to_record(
        registry.reader(logged.type).version))))
    assert shadow.same([logged], [_report_batch(**decided)], registry) is same
    assert shadow.same([_report_batch(**decided)], [logged], registry) is same


def test_another_policy_s_shadow_places_elsewhere_and_says_so(rec):
    policy = Policy("spread-load", scores=(("spread", SCORE_CHOICES["spread"]),
                                           ("least_loaded", SCORE_CHOICES["least_loaded"])))
    diff, log = shadow_of(rec, 0, policy)
    assert diff["decisions_differ"] > 0 and not diff["empty"]
    rec_t, mine = diff["totals"]["recorded"], diff["totals"]["shadow"]
    # packing less, it uses more machines for the same tasks
    assert mine["machines_used"] > rec_t["machines_used"]
    assert mine["tasks_placed"] >= 18
    first = next(d for d in diff["decisions"] if untag(d["request"]) == "e1.web:v1:r1")
    assert len(set(first["shadow"]["placed"].values())) > len(set(first["recorded"]["placed"].values()))
    # tasks the shadow placed where the log's never were got their reports from simulated agents
    assert log.synthesized > 0


@pytest.mark.parametrize("spec, expected", [
    ("live", LIVE),
    ("spread=rack", Policy("spread=rack", spread="rack")),
    ("scores=spread,least_loaded", ("spread", "least_loaded", "machine_id")),
    ("processors.allocator.placement:LIVE", LIVE),
])
def test_policies_from_the_command_line(spec, expected):
    got = shadow.policy_of(spec)
    if isinstance(expected, tuple):
        assert tuple(n for n, _ in got.scores) == expected
    else:
        assert (got.spread, [n for n, _ in got.scores]) == (expected.spread, [n for n, _ in expected.scores])


@pytest.mark.parametrize("spec, says", [
    ("scores=spread,nope", "unknown score 'nope'"),
    ("scores=", "unknown score"),
    ("spread=zone", "expected one of dc, msb, rack"),
    ("colour=red", "unknown setting 'colour'"),
    ("no_such_module_here", "cannot import module"),
    ("processors.allocator.placement:SCORES", "is not a placement.Policy"),
])
def test_a_bad_policy_is_refused_naming_what_is_wrong(spec, says):
    with pytest.raises(shadow.PolicyError, match=says):
        shadow.policy_of(spec)


def test_a_maintenance_what_if_names_the_moves_it_then_made(rec):
    """The recorded region planned dc1/msb1's maintenance at 60 s (deadline 75 s): a what-if of the same events on the
    region at 60 s says which tasks move where, which job's controller is asked, which task is stopped and held,
    and that agrees, task for task, with what the region then did."""
    events = [ev for ev, _ in rec.records if ev.type == "UnavailabilityStarted" and ev.payload["kind"] == "MAINTENANCE"]
    region = hl.fold(rec, at(60) - 1)
    doc = whatif.simulate(region, events, at(60), at(60) + 15_000 + whatif.SETTLE_MS)
    after = rec.views[at(110)]["jobs"]
    machines = set(doc["machines"])
    moved = {t["task"]: t["to"] for t in doc["tasks"] if t["outcome"] == "move"}
    assert moved, doc["tasks"]
    for task, to in moved.items():
        real = next(t for t in after[task.rpartition("/")[0]]["tasks"] if t["id"] == task)
        assert real["machine"] == to and to not in machines
    held = {t["task"] for t in doc["tasks"] if t["outcome"] == "stop"}
    for task in held:  # e1.cache has a controller that never answers: stopped at the deadline, held on its machine
        real = next(t for t in after[task.rpartition("/")[0]]["tasks"] if t["id"] == task)
        assert real["state"] == "STOPPED" and real["machine"] in machines
    assert {c["job"] for c in doc["controllers"]} <= {"e1.cache"}
    assert set(doc["capacity"]["after"]["entitlements"]) == set(hl.ENTITLEMENTS)
    assert "move" in whatif.text(doc)


def test_a_machine_failure_what_if_moves_its_tasks(rec):
    region = hl.fold(rec, at(120))
    busy = sorted(m.id for m in region.fold.machines.values()  # tasks of jobs without a controller, running
                  if m.tasks and m.status == "UP" and not any(t.startswith("e1.cache/") for t in m.tasks))[0]
    tasks = set(region.fold.machines[busy].tasks)

    broker = rec.broker
    _, events = rb.machine_failed(broker, busy, rb.REASON_OPERATOR, at(121))
    doc = whatif.simulate(region, events, at(121), at(121) + whatif.SETTLE_MS)
    outcome = {t["task"]: t for t in doc["tasks"]}
    assert set(outcome) >= tasks
    for t in tasks:
        assert outcome[t]["outcome"] in ("move", "wait") and outcome[t]["from"] == busy
        assert outcome[t]["to"] != busy


def test_explain_finds_the_decision_its_filters_and_its_causes(rec):
    records = rec.records_of()
    failed = next(ev for ev, _ in rec.records if ev.type == "MachineStatusChanged")
    moved = next(ev for ev, _ in rec.records if ev.type == "AllocationRequested" and ev.payload["free_task_ids"]
                 and ev.payload["place_task_ids"] and ev.timestamp_ms < at(40))
    task = moved.payload["place_task_ids"][0]
    doc = explain.story(records, task, at(35))
    assert doc["decision"]["type"] == "TasksAllocated"
    assert doc["decision"]["request_id"] == moved.payload["request_id"]
    assert doc["decision"]["filter_rejections"].get("machine_not_up") == 1
    assert doc["request"]["avoid_machine_ids"] == [failed.payload["machine_id"]]
    causes = [c.get("type") for c in doc["caused_by"]]
    assert causes[0] == "AllocationRequested" and causes[1] in ("MachineStatusChanged", "UnavailabilityStarted")
    assert doc["machine"] != failed.payload["machine_id"]
    before = explain.story(records, task, at(15))
    assert before["machine"] == failed.payload["machine_id"] and before["decision"]["request_id"].endswith(":r1")
    assert "JobSubmitted" in explain.text(doc)
    with pytest.raises(explain.ExplainError):
        explain.story(records, "e1.nothing/0")


@pytest.mark.parametrize("value, expected", [
    ("1700000000000", 1_700_000_000_000),
    ("2023-11-14T22:13:20Z", 1_700_000_000_000),
    ("now", 1_700_000_500_000),
    ("now-90s", 1_700_000_410_000),
    ("now-15m", 1_700_000_500_000 - 900_000),
    ("tasks/3@120", 42),
])
def test_moments(value, expected):
    assert moments.parse_moment(value, 1_700_000_500_000, lambda t, p, o: 42 if (t, p, o) == ("tasks", 3, 120) else 0) \
        == expected


@pytest.mark.parametrize("value", ["yesterday", "now-5x", "tasks/x@1", "@3"])
def test_a_bad_moment_is_refused(value):
    with pytest.raises((moments.MomentError, CliError)):
        moments.parse_moment(value, 0, lambda *a: 0)


def test_a_partial_region_decides_only_its_partitions_and_writes_no_snapshot(rec, registry, tmp_path):
    whole = hl.fold(rec, at(110))
    part = hl.fold(rec, at(110), Region(hl.TOPICS, scheduler_partitions=frozenset({1})))
    assert part.fold.dump() == whole.fold.dump()
    assert {j: e.payload for j, e in part.job_states().items() if j.startswith("e1.")} == \
        {j: e.payload for j, e in whole.job_states().items() if j.startswith("e1.")}
    assert not any(j.startswith("e3.") for j in part.job_states())
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)})
    with pytest.raises(snapshots.SnapshotError, match="partial"):
        snapshots.write(cfg, part, registry)


def test_the_determinism_check_would_see_a_difference(rec):
    """The empty diff above is not an artefact of comparing a run with itself: a log whose decision was changed
    (one task placed elsewhere) is reported."""
    doctored = dataclasses.replace(rec, records=list(rec.records))
    for i, (ev, pos) in enumerate(doctored.records):
        if ev.type == "TasksAllocated" and ev.timestamp_ms > at(1):
            p = dict(ev.payload)
            rows = [dict(r) for r in p["placements"]]
            rows[0]["machine_id"] = "dc9-nowhere"
            p["placements"] = rows
            doctored.records[i] = (dataclasses.replace(ev, payload=p), pos)
            break
    diff, _ = shadow_of(doctored, 0, LIVE, until=30)
    assert diff["decisions_differ"] >= 1 and not diff["empty"]


def test_a_broken_snapshot_file_is_passed_over(rec, registry, tmp_path):
    """Snapshots are a cache under the run directory: garbage or a truncated file there is set aside, never fatal."""
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_PARTITIONS": str(hl.PARTITIONS)})
    region = hl.fold(rec, at(30))
    good = snapshots.write(cfg, region, registry)
    data = good.path.read_bytes()
    truncated = good.path.with_name(f"{good.cut + 1:015d}-{good.applied:012d}.avro")
    truncated.write_bytes(data[: len(data) // 2])
    garbage = good.path.with_name(f"{good.cut + 2:015d}-{good.applied:012d}.avro")
    garbage.write_bytes(b"not a snapshot at all")
    files = snapshots.latest_before(cfg, good.cut + 10)
    assert [f.path for f in files] == [garbage, truncated, good.path]
    for f in files[:2]:
        fresh = Region(hl.TOPICS)
        why = snapshots.usable(f, fresh)
        if why is None:  # the truncated file's header is intact: loading it fails instead
            with pytest.raises(Exception):
                snapshots.load(f, fresh, registry)
        else:
            assert "unreadable" in why


def test_a_snapshot_keeps_a_machine_s_failed_profile_switch(rec, registry, tmp_path):
    """The profile a machine failed to switch to (and its owner then) is kept: a region loaded from a snapshot shows
    the switch failed, as the allocator published it, not pending."""
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_PARTITIONS": str(hl.PARTITIONS)})
    region = hl.fold(rec, at(45))
    mid = sorted(region.fold.machines)[0]
    m = region.fold.machines[mid]
    region.fold.machines[mid] = dataclasses.replace(m, profile_failed=("turbo", m.entitlement))
    loaded = Region(hl.TOPICS)
    snapshots.load(snapshots.write(cfg, region, registry, full=True), loaded, registry)
    assert loaded.fold.machines[mid].profile_failed == ("turbo", m.entitlement)
    assert [e.payload for e in loaded.machine_states()] == [e.payload for e in region.machine_states()]
