"""Tests of the replay filter `matches()` and the output formats: pure, no broker."""
from __future__ import annotations

import json

import pytest

from streams.clients import Record
from streams.events import Event
from streams.replay import DATA_TOPICS, ReplayFilter, format_json, format_text, iso_time, matches
from streams.topics import TopicError


def ev(type_, entity_id, payload=None, *, entitlement="ads", ts=1_000):
    return Event(type=type_, entitlement=entitlement, entity_id=entity_id, payload=payload or {},
                 producer="test", timestamp_ms=ts, event_id=f"id-{entity_id}")


SUBMITTED = ev("JobSubmitted", "job-1", {"job_id": "job-1", "name": "web"})
TASK = ev("TaskStateChanged", "job-1/0", {"task_id": "job-1/0", "job_id": "job-1", "machine_id": "m1"}, ts=2_000)
TASK_ENTITY_ONLY = ev("TaskControlAcked", "job-1/2")  # neither job_id nor task_id in the payload
REQUEST_FOR_TASK = ev("TaskControlRequested", "req-9", {"task_id": "job-1/5"})
OTHER_JOB = ev("JobSubmitted", "job-10", {"job_id": "job-10"}, entitlement="search")
OTHER_JOB_TASK = ev("TaskStateChanged", "job-10/0", {"task_id": "job-10/0", "job_id": "job-10", "machine_id": "m10"})
UNAVAILABLE = ev("UnavailabilityStarted", "ue-1", {"machine_ids": ["m3", "m1"]})
ALLOCATED = ev("TasksAllocated", "req-1", {"job_id": "job-2", "placements": [
    {"task_id": "job-2/0", "machine_id": "m7"}, {"task_id": "job-2/1", "machine_id": "m1"}]})
NULL_MACHINE = ev("TaskStateChanged", "job-3/0", {"task_id": "job-3/0", "job_id": "job-3", "machine_id": None})
COMMANDS = ev("TasksCommanded", "job-4", {"job_id": "job-4", "commands": [
    {"task_id": "job-4/0", "machine_id": "m8"}, {"task_id": "job-4/1", "machine_id": "m1"}]})
REPORTS = ev("TaskStatesChanged", "job-5/0", {"reports": [  # an agent process's batch: two jobs
    {"task_id": "job-5/0", "job_id": "job-5", "machine_id": "m2"}, {"task_id": "job-6/3", "job_id": "job-6",
                                                                    "machine_id": "m1"}]})
STATUSES = ev("MachinesStatusChanged", "ads", {"status": "DOWN", "machines": [{"machine_id": "m4"},
                                                                             {"machine_id": "m1"}]})

CASES = [
    # (name, filter, event, expected)
    ("empty filter matches all", ReplayFilter(), SUBMITTED, True),
    ("entitlement equal", ReplayFilter(entitlement="ads"), SUBMITTED, True),
    ("entitlement differs", ReplayFilter(entitlement="ads"), OTHER_JOB, False),
    ("job by payload job_id", ReplayFilter(job="job-2"), ALLOCATED, True),
    ("job by entity id", ReplayFilter(job="job-1"), SUBMITTED, True),
    ("job by task entity id", ReplayFilter(job="job-1"), TASK_ENTITY_ONLY, True),
    ("job by payload task_id", ReplayFilter(job="job-1"), REQUEST_FOR_TASK, True),
    ("job-1 is not a prefix match of job-10", ReplayFilter(job="job-1"), OTHER_JOB, False),
    ("job-1 does not take job-10's tasks", ReplayFilter(job="job-1"), OTHER_JOB_TASK, False),
    ("job absent", ReplayFilter(job="job-1"), UNAVAILABLE, False),
    ("machine by machine_id", ReplayFilter(machine="m1"), TASK, True),
    ("machine by machine_ids", ReplayFilter(machine="m1"), UNAVAILABLE, True),
    ("machine by placements", ReplayFilter(machine="m1"), ALLOCATED, True),
    ("machine m1 is not m10", ReplayFilter(machine="m1"), OTHER_JOB_TASK, False),
    ("machine null machine_id", ReplayFilter(machine="m1"), NULL_MACHINE, False),
    ("machine absent", ReplayFilter(machine="m1"), SUBMITTED, False),
    ("job of a TasksCommanded", ReplayFilter(job="job-4"), COMMANDS, True),
    ("machine of one of its commands", ReplayFilter(machine="m1"), COMMANDS, True),
    ("machine of none of its commands", ReplayFilter(machine="m2"), COMMANDS, False),
    ("job of one report of a batch", ReplayFilter(job="job-6"), REPORTS, True),
    ("job of no report of a batch", ReplayFilter(job="job-7"), REPORTS, False),
    ("machine of one report of a batch", ReplayFilter(machine="m1"), REPORTS, True),
    ("machine of a MachinesStatusChanged", ReplayFilter(machine="m1"), STATUSES, True),
    ("machine not in a MachinesStatusChanged", ReplayFilter(machine="m2"), STATUSES, False),
    ("since inclusive", ReplayFilter(since_ms=1_000), SUBMITTED, True),
    ("since after", ReplayFilter(since_ms=1_001), SUBMITTED, False),
    ("until exclusive", ReplayFilter(until_ms=1_000), SUBMITTED, False),
    ("until after", ReplayFilter(until_ms=1_001), SUBMITTED, True),
    ("window holds", ReplayFilter(since_ms=1_500, until_ms=2_500), TASK, True),
    ("window misses", ReplayFilter(since_ms=1_500, until_ms=2_500), SUBMITTED, False),
    ("topic of the event", ReplayFilter(topics=("intents",)), SUBMITTED, True),
    ("topic not of the event", ReplayFilter(topics=("intents",)), TASK, False),
    ("all set, all match", ReplayFilter(entitlement="ads", job="job-1", machine="m1", since_ms=2_000,
                                        until_ms=2_001, topics=("tasks",)), TASK, True),
    ("all set, one differs", ReplayFilter(entitlement="ads", job="job-1", machine="m2", since_ms=2_000,
                                          until_ms=2_001, topics=("tasks",)), TASK, False),
]


@pytest.mark.parametrize("name,flt,event,expected", CASES, ids=[c[0] for c in CASES])
def test_matches(name, flt, event, expected):
    assert matches(flt, event) is expected


def test_unknown_topic_is_refused():
    with pytest.raises(TopicError, match="nope"):
        ReplayFilter(topics=("intents", "nope"))
    with pytest.raises(TopicError):
        ReplayFilter(topics=("_schemas",))  # not a data topic


@pytest.mark.parametrize("topics,expected", [
    (None, tuple(t for t in DATA_TOPICS if t != "handoff")),  # copies of the other topics' records: asked by name
    (("handoff", "tasks"), ("tasks", "handoff")),
    (("tasks", "intents"), ("intents", "tasks")),  # catalogue order
    (("deadletter",), ("deadletter",)),
])
def test_logical_topics(topics, expected):
    assert ReplayFilter(topics=topics).logical_topics() == expected
    assert "deadletter" in DATA_TOPICS and "_schemas" not in DATA_TOPICS


def rec(event, topic="t1.allocations", partition=2, offset=15):
    return Record(event, topic, partition, offset, event.entitlement.encode(), 0)


REJECTED = ev("AllocationRejected", "req-2", {
    "request_id": "req-2", "job_id": "job-4", "reason": "no_feasible_machine",
    "message": "no machine has 64 cores free", "unplaced_task_ids": ["job-4/0", "job-4/1"],
    "filter_rejections": {"insufficient_cpu": 12}}, ts=1_700_000_000_123)


@pytest.mark.parametrize("event,expected", [
    (REJECTED, ["2023-11-14T22:13:20.123Z", "allocations", "2@15", "AllocationRejected", "req-2", "job=job-4",
                "reason=no_feasible_machine", 'message="no machine has 64 cores free"', "unplaced=2",
                "filter_rejections={insufficient_cpu:12}"]),
    (ALLOCATED, ["TasksAllocated", "placements=2", "filter_rejections={}"]),
    (SUBMITTED, ["intents", "JobSubmitted", "job-1", "job_id=job-1", "name=web"]),
])
def test_format_text(event, expected):
    line = format_text(rec(event))
    assert "\n" not in line
    for part in expected:
        assert part in line, (part, line)


def test_format_json():
    dead = ev("DeadLetterRecorded", "t1.intents/0/7", {"origin_topic": "t1.intents", "origin_partition": 0,
                                                     "origin_offset": 7, "origin_key": b"ads", "payload": b"\x00\xff",
                                                     "reason": "no_marker", "detail": "x", "consumer": "c"})
    line = format_json(rec(dead, topic="t1.deadletter", partition=0, offset=3))
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["type"] == "DeadLetterRecorded" and doc["topic"] == "deadletter"
    assert (doc["partition"], doc["offset"]) == (0, 3)
    assert doc["payload"]["payload"] == "00ff" and doc["payload"]["origin_key"] == "616473"
    assert {"event_id", "entitlement", "entity_id", "timestamp_ms", "producer", "causation_id",
            "schema_version"} <= doc.keys()


def test_iso_time():
    assert iso_time(0) == "1970-01-01T00:00:00.000Z"
    assert iso_time(1_700_000_000_123) == "2023-11-14T22:13:20.123Z"
