"""`ropewalk job describe JOB` and `job status -o wide`: a job's tasks with their story, its recent events and its
last refusals, folded from the job's events on the log (kubectl describe's shape). Pure: the job's state (a
``job_view``) and its events (``streams.replay.format_json`` documents, the API's replay lines) in, one document out.

Per task, from its ``TaskStatesChanged`` reports: how long it has been in its state (``since_ms``), how many times
it reached RUNNING (``runs``: a restart or a move starts it again), on how many machines it ran before this one
(``moves``) and the last of them (``previous_machine``), and the spec version it runs. The log holds the whole
story; the published state (``state.jobs``) only the present.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

EVENTS_SHOWN = 20  # the job's most recent events in `describe` (``--events N``)
REFUSALS_SHOWN = 5  # its last refusals
REFUSALS = frozenset({"IntentRefused", "AllocationRejected", "TaskCommandRefused", "OperationsThrottled"})
QUIET = frozenset({"AgentHeartbeat", "JobStatePublished", "JobTasksPublished"})  # the state, not its story


def task_stories(docs: Iterable[Mapping[str, Any]], job: str) -> dict[str, dict[str, Any]]:
    """Per task of ``job``: ``since_ms``, ``runs``, ``moves``, ``previous_machine``, from its reports (``docs`` in
    time order)."""
    out: dict[str, dict[str, Any]] = {}
    for doc in docs:
        if doc["type"] != "TaskStatesChanged":
            continue
        for r in doc["payload"].get("reports") or ():
            if r.get("job_id") != job:
                continue
            t = out.setdefault(r["task_id"], {"state": None, "since_ms": None, "runs": 0, "moves": 0,
                                               "machine": None, "previous_machine": None})
            if r["state"] != t["state"]:
                t["state"], t["since_ms"] = r["state"], doc["timestamp_ms"]
            machine = r.get("machine_id")
            if r["state"] == "RUNNING":
                t["runs"] += 1
                if t["machine"] is not None and machine and machine != t["machine"]:
                    t["moves"] += 1
                    t["previous_machine"] = t["machine"]
                if machine:
                    t["machine"] = machine
    return out


def describe(view: Mapping[str, Any], docs: list[Mapping[str, Any]], now_ms: int, *,
             events: int = EVENTS_SHOWN) -> dict[str, Any]:
    """The document of `job describe --json`: the job (``view``), its tasks with their story and placement, its
    last ``events`` events (not its heartbeats nor its published states) and its last refusals (``REFUSALS``),
    newest last."""
    stories = task_stories(docs, view["job"])
    tasks = []
    for t in view["tasks"]:
        s = stories.get(t["id"], {})
        tasks.append({**t, "since_ms": s.get("since_ms"), "runs": s.get("runs", 0), "restarts": max(0, s.get("runs", 0) - 1),
                      "moves": s.get("moves", 0), "previous_machine": s.get("previous_machine")})
    story = [d for d in docs if d["type"] not in QUIET]
    refusals = [d for d in story if d["type"] in REFUSALS]
    from streams.replay import summary  # noqa: PLC0415 - start-up: confluent-kafka (~40 ms); CLI path

    def line(d: Mapping[str, Any]) -> dict[str, Any]:
        p = d["payload"]
        return {"at_ms": d["timestamp_ms"], "type": d["type"], "entity": d["entity_id"],
                "principal": d.get("principal"), "summary": summary(d["type"], p),
                **({"reason": p.get("reason") or "", "message": p.get("message") or ""} if d["type"] in REFUSALS
                   else {}),
                "where": f"{d['topic']}/{d['partition']}@{d['offset']}"}

    return {"job": dict(view, tasks=tasks), "events_total": len(story), "events": [line(d) for d in story[-events:]],
            "refusals": [line(d) for d in refusals[-REFUSALS_SHOWN:]], "at_ms": now_ms}
