"""Issue 30's pure pieces, table-driven: the Grafana dashboard against Grafana's own dashboard model, refusals in a
user's words, one time grammar, a task's story from its reports, where a task's output is."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from infra import metrics
from processors import times
from processors.agent.process import default_work_dir, task_log
from processors.api import authz
from processors.api.ui import feed_topics, fleet_filter
from processors.frontend import describe, logs
from processors.resourcebroker.decide import is_free

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "ropewalk.json"
NOW = 1_800_000_000_000


def _missing(ours, theirs, path="") -> list[str]:
    """Every key and value of ``ours`` that ``theirs`` lacks or holds otherwise."""
    if isinstance(ours, dict):
        if not isinstance(theirs, dict):
            return [f"{path}: not an object"]
        return [m for k, v in ours.items() for m in (_missing(v, theirs[k], f"{path}.{k}") if k in theirs
                                                     else [f"{path}.{k}: not in Grafana's model"])]
    if isinstance(ours, list):
        if not isinstance(theirs, list) or len(ours) != len(theirs):
            return [f"{path}: a list of another length"]
        return [m for i, (a, b) in enumerate(zip(ours, theirs)) for m in _missing(a, b, f"{path}[{i}]")]
    return [] if ours == theirs else [f"{path}: {ours!r} became {theirs!r}"]


def test_the_grafana_dashboard_is_grafanas_model_with_nothing_lost():
    """Decoded by Grafana's foundation SDK (its dashboard model, generated from Grafana's schema) and encoded again,
    the dashboard keeps every key and value: nothing it says is unknown to Grafana or of the wrong type."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: PLC0415 - start-up cost: Grafana's SDK, ~10 ms
    from grafana_foundation_sdk.models.dashboard import (  # noqa: PLC0415 - start-up cost: Grafana's SDK, ~10 ms
        Dashboard, Panel, RowPanel,
    )

    doc = json.loads(DASHBOARD.read_text())
    model = Dashboard.from_json(doc)
    assert _missing(doc, json.loads(JSONEncoder().encode(model))) == []
    panels = [p for p in model.panels if isinstance(p, Panel)]
    assert len(panels) >= 12 and all(isinstance(p, (Panel, RowPanel)) for p in model.panels)
    assert {p["type"] for p in doc["panels"]} <= {"row", "timeseries", "table", "stat"}
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", ())]
    assert all(e.count("(") == e.count(")") for e in exprs)
    named = {m for e in exprs for m in re.findall(r"\bropewalk_[a-z_]+", e)}

    exported = {m.name for m in vars(metrics).values() if isinstance(m, metrics.Metric)}
    base = {re.sub(r"_(bucket|count|sum)$", "", n) for n in named}
    assert base <= exported, base - exported  # each names a metric of the catalogue (the region test: exported)
    assert exported - {"ropewalk_reader_position", "ropewalk_timer_ticks_total"} <= base  # and shows all of them


def test_every_action_has_words_and_a_refusal_says_them_not_the_table_name():
    assert set(authz.WORDS) == set(authz.ACTIONS)
    bob = authz.User("bob", roles={"e1": authz.VIEWER})
    for action in authz.ACTIONS:
        for ent in ("e1", "e2", None):
            d = authz.decide(bob, action, ent)
            if not d.allowed:
                assert action not in d.message and "bob" in d.message, d.message
    assert authz.decide(bob, "machine.fail", None).message == ("failing a machine (machine fail) is for region "
                                                              "administrators; bob is not one")


@pytest.mark.parametrize("value, expected", [
    ("10m", NOW - 600_000), ("now-10m", NOW - 600_000), ("now-1m", NOW - 60_000), ("now", NOW), ("2d", NOW - 2 * 86_400_000),
    ("1700000000000", 1_700_000_000_000), ("2026-11-22T10:00:00Z", 1_795_341_600_000), (None, None),
])
def test_one_time_grammar(value, expected):
    assert times.parse_time(value, NOW) == expected


@pytest.mark.parametrize("value", ["ten minutes", "now-", "now-tenm", "now+5m", "1x"])
def test_a_bad_time_names_every_form(value):
    with pytest.raises(ValueError, match=re.escape("now-10m")):
        times.parse_time(value, NOW)


def _reports(ts, *reports):
    return {"type": "TaskStatesChanged", "timestamp_ms": ts, "entity_id": "x", "topic": "tasks", "partition": 0,
            "offset": ts, "payload": {"reports": [{"job_id": t.split("/")[0], "task_id": t, "state": s, "machine_id": m}
                                                  for t, s, m in reports]}}


STORIES = {
    # name: (the task's reports in order, its story: state, since, runs, moves, previous machine)
    "ran once": ([(1, "STARTING", "m1"), (2, "RUNNING", "m1")], ("RUNNING", 2, 1, 0, None)),
    "restarted in place": ([(1, "RUNNING", "m1"), (2, "FAILED", "m1"), (3, "STARTING", "m1"), (4, "RUNNING", "m1")],
                           ("RUNNING", 4, 2, 0, None)),
    "moved twice": ([(1, "RUNNING", "m1"), (2, "FAILED", "m1"), (3, "RUNNING", "m2"), (5, "RUNNING", "m3")],
                    ("RUNNING", 3, 3, 2, "m2")),
    "never ran": ([(1, "STARTING", "m1")], ("STARTING", 1, 0, 0, None)),
}


@pytest.mark.parametrize("reports, story", STORIES.values(), ids=STORIES)
def test_a_tasks_story_from_its_reports(reports, story):
    docs = [_reports(ts, ("e1.web/0", s, m), ("e2.other/0", "RUNNING", "m9")) for ts, s, m in reports]
    got = describe.task_stories(docs, "e1.web")
    assert set(got) == {"e1.web/0"}
    t = got["e1.web/0"]
    assert (t["state"], t["since_ms"], t["runs"], t["moves"], t["previous_machine"]) == story


def test_describe_keeps_the_last_events_and_refusals():
    view = {"job": "e1.web", "tasks": [{"id": "e1.web/0", "state": "RUNNING", "machine": "m2", "dc": "d", "msb": "s",
                                       "rack": "r", "spec_version": 2, "reason": ""}]}
    docs = [_reports(1, ("e1.web/0", "RUNNING", "m1")), _reports(2, ("e1.web/0", "RUNNING", "m2"))]
    docs += [{"type": "IntentRefused", "timestamp_ms": 10 + i, "entity_id": "e1.web", "topic": "intents",
              "partition": 0, "offset": i, "principal": "bob",
              "payload": {"intent_type": "JobSubmitted", "intent_event_id": "i", "job_id": "e1.web",
                          "reason": "duplicate_job_id", "message": f"m{i}"}}
             for i in range(8)]
    docs.append({"type": "JobStatePublished", "timestamp_ms": 30, "entity_id": "e1.web", "topic": "state.jobs",
                 "partition": 0, "offset": 0, "payload": {}})
    doc = describe.describe(view, docs, NOW, events=3)
    (task,) = doc["job"]["tasks"]
    assert (task["moves"], task["previous_machine"], task["restarts"], task["spec_version"]) == (1, "m1", 1, 2)
    assert doc["events_total"] == 10 and [e["summary"] for e in doc["events"]][-1].endswith("message=m7 intent=i")
    assert [e["message"] for e in doc["refusals"]] == ["m3", "m4", "m5", "m6", "m7"]
    assert all(e["type"] != "JobStatePublished" for e in doc["events"])


def test_where_a_tasks_output_is_or_why_not(tmp_path):
    log = task_log(default_work_dir(tmp_path, "local-m1"), "e1.web/0")
    log.parent.mkdir(parents=True)
    log.write_text("one\ntwo\nthree\n")
    (default_work_dir(tmp_path, "local-m2") / "logs").mkdir(parents=True)
    task = {"state": "RUNNING", "dc": None, "msb": None, "rack": None, "reason": ""}
    view = {"job": "e1.web", "tasks": [{**task, "id": "e1.web/0", "machine": "local-m1"},
                                       {**task, "id": "e1.web/1", "machine": "sim-m3"},
                                       {**task, "id": "e1.web/2", "machine": "local-m2"},
                                       {**task, "id": "e1.web/3", "machine": None, "state": "PENDING",
                                        "reason": "quota_exceeded"}]}
    srcs = logs.sources(view, tmp_path)
    assert [s["path"] is not None for s in srcs] == [True, False, False, False]
    assert "simulated machine" in srcs[1]["why"] and "no output yet" in srcs[2]["why"]
    assert srcs[3]["why"] == "not placed (PENDING: quota_exceeded): no output yet"
    assert [s["task"] for s in logs.sources(view, tmp_path, "0")] == ["e1.web/0"]
    with pytest.raises(LookupError, match="no task 'e1.web/9'"):
        logs.sources(view, tmp_path, "9")
    reader = logs.Reader(srcs)
    assert reader.first(2) == [("e1.web/0", "two"), ("e1.web/0", "three")]
    assert reader.new() == []
    with open(log, "a") as fh:
        fh.write("four\nfi")
    assert reader.new() == [("e1.web/0", "four")]  # a line is printed once whole
    with open(log, "a") as fh:
        fh.write("ve\n")
    assert reader.new() == [("e1.web/0", "five")]
    assert logs.no_output({"a/0": "why", "a/1": "why"}) == "a/0: why; and 1 more tasks without output"


def test_the_event_feed_reads_only_the_topics_that_carry_what_it_shows():
    assert feed_topics(None, None) is None  # nothing filtered: every topic
    assert "heartbeats" not in feed_topics(None, frozenset({"AgentHeartbeat"}))  # the feed's default
    assert feed_topics(frozenset({"JobSubmitted", "TasksCommanded"}), None) == ("intents", "tasks")


FLEET = [{"id": f"dc{d}-msb1-r0{r}-m00{m}", "dc": f"dc{d}", "msb": "msb1", "rack": f"r0{r}", "status": s, "entitlement": e}
         for d, r, m, s, e in [(2, 1, 1, "UP", None), (1, 2, 1, "DOWN", "e1"), (1, 1, 2, "UP", "e1"),
                               (1, 1, 1, "UP", None)]]


@pytest.mark.parametrize("f, ids", [
    ({}, ["dc1-msb1-r01-m001", "dc1-msb1-r01-m002", "dc1-msb1-r02-m001", "dc2-msb1-r01-m001"]),
    ({"status": "DOWN"}, ["dc1-msb1-r02-m001"]), ({"owner": "free"}, ["dc1-msb1-r01-m001", "dc2-msb1-r01-m001"]),
    ({"dc": "dc2"}, ["dc2-msb1-r01-m001"]), ({"q": "r01-m002"}, ["dc1-msb1-r01-m002"]),
    ({"owner": "e1", "status": "UP"}, ["dc1-msb1-r01-m002"]),
])
def test_the_fleet_filters(f, ids):
    assert [m["id"] for m in fleet_filter(FLEET, {"status": "", "owner": "", "dc": "", "q": "", **f})] == ids


@pytest.mark.parametrize("owner, status, maintenance, free", [
    (None, "UP", False, True), (None, "DOWN", False, False), (None, "UP", True, False), ("e1", "UP", False, False),
    (None, "UNHEALTHY", False, False)])
def test_one_rule_for_a_free_machine(owner, status, maintenance, free):
    assert is_free(owner, status, maintenance) is free
