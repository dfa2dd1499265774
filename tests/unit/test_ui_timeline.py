"""The UI's job timeline (processors/api/ui/timeline.py): a pure fold of a job's replayed events into Gantt rows."""
import random

from processors.api.ui.timeline import JOB_GROUP, MAX_ITEMS, timeline

JOB = "e1.web"


def doc(ts, type_, **payload):
    return {"timestamp_ms": ts, "type": type_, "payload": payload, "entity_id": JOB, "topic": "tasks",
            "partition": 0, "offset": ts}


def report(task, state, machine=None, reason=""):
    return {"task_id": f"{JOB}/{task}", "job_id": JOB, "state": state, "machine_id": machine, "reason": reason}


def test_a_move_is_a_new_bar_on_another_machine_and_operations_are_points():
    events = [
        doc(0, "JobSubmitted"),
        doc(10000, "TaskStatesChanged", reports=[report(0, "PENDING")]),
        doc(20000, "TasksCommanded", commands=[{"task_id": f"{JOB}/0", "machine_id": "m1", "command": "START",
                                             "reason": "placed"}]),
        doc(30000, "TaskStatesChanged", reports=[report(0, "RUNNING", "m1")]),
        doc(40000, "TaskStatesChanged", reports=[report(0, "PENDING", reason="machine_failed")]),
        doc(45000, "TaskControlRequested", sequence=1, pending_operations=[{"operation_id": "x"}]),
        doc(46000, "TaskControlAcked", sequence=1, approved_operation_ids=["x"], controller="c"),
        doc(50000, "TaskStatesChanged", reports=[report(0, "RUNNING", "m2"), {**report(1, "RUNNING", "m9"),
                                                                            "job_id": "e1.other"}]),
    ]
    out = timeline(events, now_ms=100_000, job=JOB)
    assert [g["id"] for g in out["groups"]] == [JOB_GROUP, f"{JOB}/0"]  # another job's report is not drawn
    bars = [(i["start"], i["end"], i["content"]) for i in out["items"] if i["type"] == "range"]
    assert bars == [(10000, 30000, "PENDING"), (30000, 40000, "RUNNING on m1"), (40000, 50000, "PENDING"), (50000, 100000, "RUNNING on m2")]
    points = [(i["start"], i["group"], i["className"]) for i in out["items"] if i["type"] == "point"]
    assert points == [(0, JOB_GROUP, "op-intent"), (20000, f"{JOB}/0", "op-start"), (40000, f"{JOB}/0", "op-failure"),
                      (45000, JOB_GROUP, "op-wait"), (46000, JOB_GROUP, "op-ack")]  # its machine's loss marked (issue 30)
    assert out["truncated"] == 0


def test_bars_name_the_version_and_the_maintenance_of_the_jobs_machines_shows():
    """Issue 30: a rolling update shows (each bar names its spec version), and a maintenance of a machine the job
    ran on is marked (its notice, its deadline, its window); another machine's maintenance is not."""
    events = [doc(10000, "TaskStatesChanged", reports=[{**report(0, "RUNNING", "m1"), "spec_version": 1}]),
              doc(60000, "TaskStatesChanged", reports=[{**report(0, "RUNNING", "m1"), "spec_version": 2}])]
    window = {"kind": "MAINTENANCE", "unavailability_id": "u1", "start_ms": 40_000, "deadline_ms": 30_000,
              "expected_duration_ms": 50_000, "reason": "kernel", "machine_ids": ["m1", "m7"]}
    down = [doc(20000, "UnavailabilityStarted", **window),
            doc(21000, "UnavailabilityStarted", **{**window, "unavailability_id": "u2", "machine_ids": ["m8"]})]
    out = timeline(events, now_ms=100_000, job=JOB, unavailability=down)
    assert [i["content"] for i in out["items"] if i["type"] == "range"] == ["RUNNING v1 on m1", "RUNNING v2 on m1"]
    marks = [(i["start"], i["className"], i["title"]) for i in out["items"] if i["type"] in ("point", "background")]
    assert [(at, kind) for at, kind, _ in marks] == [(20_000, "op-maintenance"), (30_000, "op-deadline"),
                                                    (40_000, "maintenance-window")]
    assert all("u1 of m1: kernel" in title for _, _, title in marks)


def test_a_long_history_is_capped_to_the_newest_items():
    rnd = random.Random(13)
    events, ts = [], 0
    for _ in range(20_000):  # a 20,000-event job history
        ts += rnd.randint(2, 50) * 1000  # seconds apart: no state is brief
        events.append(doc(ts, "TaskStatesChanged", reports=[report(rnd.randrange(200), rnd.choice(
            ["PENDING", "RUNNING", "STOPPING"]), f"m{rnd.randrange(50)}")]))
    out = timeline(events, now_ms=ts + 1, job=JOB)
    assert len(out["items"]) == MAX_ITEMS and out["truncated"] == 20_000 - MAX_ITEMS
    assert out["items"][-1]["start"] == max(i["start"] for i in out["items"])
    assert len(out["groups"]) == 201


def test_a_brief_state_is_no_bar_of_its_own():
    """ALLOCATED → STARTING → RUNNING within a second: one RUNNING bar whose title names them (slivers were drawn
    with cut labels, "RU")."""
    events = [doc(10_000, "TaskStatesChanged", reports=[report(0, "ALLOCATED", "m1")]),
              doc(10_300, "TaskStatesChanged", reports=[report(0, "STARTING", "m1")]),
              doc(10_600, "TaskStatesChanged", reports=[report(0, "RUNNING", "m1")]),
              doc(20_000, "TaskStatesChanged", reports=[report(0, "STOPPING", "m1")])]
    out = timeline(events, now_ms=20_100, job=JOB)  # the current state is drawn however brief
    bars = [(i["start"], i["content"]) for i in out["items"] if i["type"] == "range"]
    assert bars == [(10_600, "RUNNING on m1"), (20_000, "STOPPING on m1")]
    assert out["items"][0]["title"].endswith("just before: ALLOCATED on m1, STARTING on m1")
