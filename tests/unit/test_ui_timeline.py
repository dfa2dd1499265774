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
        doc(10, "TaskStatesChanged", reports=[report(0, "PENDING")]),
        doc(20, "TasksCommanded", commands=[{"task_id": f"{JOB}/0", "machine_id": "m1", "command": "START",
                                             "reason": "placed"}]),
        doc(30, "TaskStatesChanged", reports=[report(0, "RUNNING", "m1")]),
        doc(40, "TaskStatesChanged", reports=[report(0, "PENDING", reason="machine_failed")]),
        doc(45, "TaskControlRequested", sequence=1, pending_operations=[{"operation_id": "x"}]),
        doc(46, "TaskControlAcked", sequence=1, approved_operation_ids=["x"], controller="c"),
        doc(50, "TaskStatesChanged", reports=[report(0, "RUNNING", "m2"), {**report(1, "RUNNING", "m9"),
                                                                            "job_id": "e1.other"}]),
    ]
    out = timeline(events, now_ms=100, job=JOB)
    assert [g["id"] for g in out["groups"]] == [JOB_GROUP, f"{JOB}/0"]  # another job's report is not drawn
    bars = [(i["start"], i["end"], i["content"]) for i in out["items"] if i["type"] == "range"]
    assert bars == [(10, 30, "PENDING"), (30, 40, "RUNNING on m1"), (40, 50, "PENDING"), (50, 100, "RUNNING on m2")]
    points = [(i["start"], i["group"], i["className"]) for i in out["items"] if i["type"] == "point"]
    assert points == [(0, JOB_GROUP, "op-intent"), (20, f"{JOB}/0", "op-start"), (45, JOB_GROUP, "op-wait"),
                      (46, JOB_GROUP, "op-ack")]
    assert out["truncated"] == 0


def test_a_long_history_is_capped_to_the_newest_items():
    rnd = random.Random(13)
    events, ts = [], 0
    for _ in range(20_000):  # a 20,000-event job history
        ts += rnd.randint(1, 50)
        events.append(doc(ts, "TaskStatesChanged", reports=[report(rnd.randrange(200), rnd.choice(
            ["PENDING", "RUNNING", "STOPPING"]), f"m{rnd.randrange(50)}")]))
    out = timeline(events, now_ms=ts + 1, job=JOB)
    assert len(out["items"]) == MAX_ITEMS and out["truncated"] == 20_000 - MAX_ITEMS
    assert out["items"][-1]["start"] == max(i["start"] for i in out["items"])
    assert len(out["groups"]) == 201
