"""A job's timeline for the UI's Gantt chart, folded from its events on the log (pure: events in, rows out).

``timeline(events, now_ms)`` takes a job's events as ``streams.replay.format_json`` writes them (the API's replay
documents), in time order, and returns ``{"groups": [...], "items": [...]}`` for vis-timeline: one group per task,
one range item per span a task spent in a state on a machine (``RUNNING on dc1-msb2-r01-m003``: a move is a new
range on another machine), and point items for operations: commands (START, STOP, RESTART), TaskControl requests
and acks (``waits``/``acks`` of the job's controller), throttling, maintenance notices and the job's intents.
A task's open span ends at ``now_ms``. Items are capped at ``MAX_ITEMS`` (the newest kept) so a 20,000-event job
stays a page a browser draws at once; ``truncated`` says how many were left out.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

MAX_ITEMS = 5000
JOB_GROUP = "job"  # the row of the job's own events (intents, TaskControl, throttling, maintenance)
INTENTS = frozenset({"JobSubmitted", "JobResized", "JobSpecChanged", "JobStopped", "IntentRefused"})


def timeline(events: Iterable[Mapping[str, Any]], now_ms: int, job: str) -> dict[str, Any]:
    groups: dict[str, dict] = {JOB_GROUP: {"id": JOB_GROUP, "content": job, "order": -1}}
    open_: dict[str, dict] = {}  # task -> its current span
    items: list[dict] = []

    def point(group: str, at: int, kind: str, text: str, title: str) -> None:
        items.append({"id": f"p{len(items)}", "group": group, "start": at, "type": "point", "content": text,
                      "className": f"op-{kind}", "title": title})

    def close(task: str, at: int) -> None:
        span = open_.pop(task, None)
        if span is not None:
            span["end"] = max(at, span["start"] + 1)
            items.append(span)

    for doc in events:
        ts, type_, p = doc["timestamp_ms"], doc["type"], doc["payload"]
        if type_ in INTENTS:
            point(JOB_GROUP, ts, "intent", type_.removeprefix("Job"), f"{type_} {p.get('reason') or ''}".strip())
        elif type_ == "TaskStatesChanged":
            for r in p.get("reports") or ():
                if r.get("job_id") != job:
                    continue
                task = r["task_id"]
                groups.setdefault(task, {"id": task, "content": task.rsplit("/", 1)[-1], "order": _order(task)})
                close(task, ts)
                where = f" on {r['machine_id']}" if r.get("machine_id") else ""
                open_[task] = {"id": f"s{len(items)}-{task}", "group": task, "start": ts, "type": "range",
                               "content": f"{r['state']}{where}", "className": f"state-{r['state'].lower()}",
                               "title": f"{task}: {r['state']}{where} ({r.get('reason') or 'no reason'})"}
        elif type_ == "TasksCommanded":
            for c in p.get("commands") or ():
                task = c["task_id"]
                groups.setdefault(task, {"id": task, "content": task.rsplit("/", 1)[-1], "order": _order(task)})
                point(task, ts, c["command"].lower(), c["command"],
                      f"{c['command']} {task} on {c['machine_id']} ({c.get('reason') or ''})")
        elif type_ == "TaskControlRequested":
            n = len(p.get("pending_operations") or ())
            point(JOB_GROUP, ts, "wait", f"waits {n}", f"TaskControl request #{p.get('sequence')}: {n} operations "
                                                       f"wait for the controller")
        elif type_ == "TaskControlAcked":
            n = len(p.get("approved_operation_ids") or ())
            point(JOB_GROUP, ts, "ack", f"ack {n}", f"controller {p.get('controller')} acked #{p.get('sequence')}: "
                                                    f"{n} approved")
        elif type_ == "OperationsThrottled":
            point(JOB_GROUP, ts, "throttled", "throttled", f"operations throttled: {p.get('reason') or ''}")
        elif type_ in ("UnavailabilityStarted", "UnavailabilityEnded"):
            point(JOB_GROUP, ts, "maintenance", "maintenance" if type_ == "UnavailabilityStarted" else "maint. end",
                  f"{type_} {p.get('unavailability_id')} {p.get('kind') or ''}".strip())
    for task in list(open_):
        span = open_[task]
        close(task, max(now_ms, span["start"] + 1))
        span["className"] += " open"
    items.sort(key=lambda i: i["start"])
    truncated = max(0, len(items) - MAX_ITEMS)
    if truncated:
        items = items[-MAX_ITEMS:]
    return {"groups": sorted(groups.values(), key=lambda g: (g["order"], g["id"])), "items": items,
            "truncated": truncated}


def _order(task: str) -> int:
    tail = task.rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else 1 << 30
