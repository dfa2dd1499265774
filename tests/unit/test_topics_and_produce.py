"""Topic catalogue rules and the pure part of `ropewalk produce`."""
import re

import pytest

from processors.frontend.produce import ProduceError, build_event, parse_documents
from streams.serde import SchemaRegistry
from streams.topics import CATALOGUE, TOPIC_OF_EVENT, Topics, check_copartitioning

REG = SchemaRegistry.from_dir()
T = Topics("p.", 8)


def test_every_event_schema_has_exactly_one_topic():
    assert sorted(TOPIC_OF_EVENT) == REG.event_names
    assert sum(len(t.events) for t in CATALOGUE) == len(REG.event_names)


@pytest.mark.parametrize("existing,problem", [
    ({}, None),
    ({"p.intents": 8, "p.tasks": 8, "p.deadletter": 1}, None),
    ({"p.intents": 8, "p.tasks": 4}, "p.tasks has 4 partitions, expected 8 (co-partitioned"),
    ({"p.deadletter": 3}, "p.deadletter has 3 partitions, expected 1 (configured)"),
    ({"other.intents": 3}, None),
])
def test_copartitioning(existing, problem):
    problems = check_copartitioning(T, existing)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0]


@pytest.mark.parametrize("topic,event_type,doc,ent,expect", [
    ("intents", "EntitlementCreated", {"name": "e1", "quota_machines": 4}, "e1", {"entity_id": "e1"}),
    ("intents", "JobResized", {"job_id": "j1", "tasks": 3, "envelope": {"entitlement": "e9"}}, None,
     {"entity_id": "j1", "entitlement": "e9"}),
    ("intents", "JobStopped", {"job_id": "j1", "envelope": {"causation_id": "c1", "timestamp_ms": 5}}, "e1",
     {"causation_id": "c1", "timestamp_ms": 5}),
    ("heartbeats", "AgentHeartbeat", {"machine_id": "m1"}, None, {"entity_id": "m1", "entitlement": ""}),
    ("intents", "JobResized", {"job_id": "j1", "tasks": "3"}, "e1", "JobResized.tasks: expected int"),
    ("intents", "JobResized", {"job_id": "j1"}, "e1", "JobResized.tasks: missing required field"),
    ("intents", "JobResized", {"job_id": "j1", "tasks": 3}, None, "envelope.entitlement is required"),
    ("machines", "JobResized", {"job_id": "j1", "tasks": 3}, "e1", "belongs on topic intents, not machines"),
    ("nowhere", "JobResized", {}, "e1", "unknown topic 'nowhere'"),
    ("intents", "JobExploded", {}, "e1", "unknown event type 'JobExploded'"),
    ("intents", "JobStopped", {"job_id": "j", "envelope": {"colour": 1}}, "e1", "envelope.colour: unknown field"),
    ("intents", "JobStopped", {"job_id": "j", "envelope": {"timestamp_ms": "now"}}, "e1",
     "JobStopped.envelope.timestamp_ms: expected long"),
    # the intent rules (processors/rules.py), refused at the door naming the field
    ("intents", "EntitlementCreated", {"name": "e1", "quota_machines": -5}, "e1",
     "EntitlementCreated.quota_machines: expected an integer from 0 to 1,000,000, got number -5"),
    ("intents", "EntitlementUpdated", {"quota_machines": 10**7}, "e1",
     "EntitlementUpdated.quota_machines: at most 1,000,000 machines (more than a region has), got 10,000,000"),
    ("intents", "EntitlementCreated", {"name": "e2", "quota_machines": 4}, "e1",
     "EntitlementCreated.name: must be the entitlement it is keyed to ('e1'"),
    ("intents", "JobResized", {"job_id": "e1.j", "tasks": -1}, "e1",
     "JobResized.tasks: expected an integer from 0 to 25,000, got number -1"),
    ("intents", "JobSubmitted", {"job_id": "e1.j", "name": "j", "tasks": 2, "command": ["x"],
                                 "resources": {"cpu_millicores": -1000, "memory_mib": 64}}, "e1",
     "JobSubmitted.resources.cpu_millicores: expected a positive integer up to 1,000,000, got number -1000"),
    ("intents", "JobSubmitted", {"job_id": "e1.j", "name": "j", "tasks": 30_000, "command": ["x"],
                                 "resources": {"cpu_millicores": 1000, "memory_mib": 64}}, "e1",
     "JobSubmitted.tasks: at most 25,000 tasks per job (ROPEWALK_MAX_TASKS_PER_JOB), got 30,000"),
    ("intents", "JobSpecChanged", {"job_id": "e1.j", "name": "j", "tasks": 2, "command": ["x"], "spec_version": 2,
                                   "resources": {"cpu_millicores": 1000, "memory_mib": 64}, "max_unavailable": 0},
     "e1", "JobSpecChanged.max_unavailable: expected a positive integer up to 25,000, got number 0"),
])
def test_build_event(topic, event_type, doc, ent, expect):
    if isinstance(expect, str):
        with pytest.raises(ProduceError, match=re.escape(expect)):
            build_event(REG, topic, event_type, doc, ent)
        return
    ev = build_event(REG, topic, event_type, doc, ent)
    assert ev.producer == "cli" and ev.event_id and ev.timestamp_ms > 0
    for k, v in expect.items():
        assert getattr(ev, k) == v


@pytest.mark.parametrize("text,count,error", [
    ('{"a": 1}', 1, None),
    ('[{"a": 1}, {"a": 2}]', 2, None),
    ('{"a": 1}\n{"a": 2}\n\n{"a": 3}', 3, None),
    ("", 0, "input is empty"),
    ("[1]", 0, "document 1: expected a JSON object"),
    ("{nope", 0, "input is not JSON"),
    ('{"a": 1}\n{nope', 0, "line 2: not JSON"),
])
def test_parse_documents(text, count, error):
    if error:
        with pytest.raises(ProduceError, match=error):
            parse_documents(text)
    else:
        assert len(parse_documents(text)) == count


# --- retention, chosen per topic (streams/topics.py, README "Retention") ------------------------------------------

KEPT = ("intents", "machines", "unavailability", "allocations", "tasks", "taskcontrol", "loans", "keys")  # folded from 0
COMPACTED = ("state.jobs", "state.tasks", "state.machines", "partitionmap", "_schemas")  # the latest per key
TIME_BOUNDED = {  # read from an offset a reader stores or from the end, or judged on recent samples: -> at most
    "heartbeats": 24 * 3600 * 1000, "metrics": 24 * 3600 * 1000, "handoff": 7 * 24 * 3600 * 1000,
    "deadletter": 30 * 24 * 3600 * 1000}


def test_every_topic_has_its_retention_chosen():
    by_name = {t.name: t for t in CATALOGUE}
    assert set(by_name) == set(KEPT) | set(COMPACTED) | set(TIME_BOUNDED)  # a new topic must choose here
    for name in KEPT:
        assert by_name[name].config.get("retention.ms") == "-1", name
        assert by_name[name].config.get("cleanup.policy", "delete") == "delete", name  # a log, never compacted
    for name in COMPACTED:
        conf = by_name[name].config
        assert conf.get("cleanup.policy") == "compact" and conf.get("retention.ms") == "-1", name
        assert int(conf["segment.ms"]) <= 3600 * 1000 and int(conf["delete.retention.ms"]) > 0, name
    for name, most in TIME_BOUNDED.items():
        conf = by_name[name].config
        assert conf.get("cleanup.policy", "delete") == "delete", name
        assert 0 < int(conf["retention.ms"]) <= most, name
        # Kafka deletes closed segments only: one rolls well within the retention, or nothing would go on time
        assert 0 < int(conf["segment.ms"]) <= int(conf["retention.ms"]) // 6, name
