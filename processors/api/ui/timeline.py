"""A job's timeline for the UI's Gantt chart, folded from its events on the log (pure: events in, rows out).

``timeline(events, now_ms)`` takes a job's events as ``streams.replay.format_json`` writes them (the API's replay
documents), in time order, and returns ``{"groups": [...], "items": [...]}`` for vis-timeline: one group per task,
one range item per span a task spent in a state on a machine (``RUNNING on dc1-msb2-r01-m003``: a move is a new
range on another machine; each bar names the spec version the task runs, so a rolling update shows), and point items
for operations: commands (START, STOP, RESTART), TaskControl requests and acks (``waits``/``acks`` of the job's
controller), throttling, the job's intents, a task's machine failing (``machine failed``: the scheduler's report that
moved it), and the maintenance of the job's machines (``unavailability``: its notice, its deadline as a point, its
window as a background band). A task's open span ends at ``now_ms``. Items are capped at ``MAX_ITEMS`` (the newest kept) so a 20,000-event job
stays a page a browser draws at once; ``truncated`` says how many were left out.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

MAX_ITEMS = 5000
JOB_GROUP = "job"  # the row of the job's own events (intents, TaskControl, throttling, maintenance)
INTENTS = frozenset({"JobSubmitted", "JobResized", "JobSpecChanged", "JobStopped", "IntentRefused"})
MACHINE_LOST = frozenset({"machine_failed", "machine_unhealthy"})  # a report's reason: its machine was lost
BRIEF_MS = 2000  # a state a task left within this is not a bar of its own (its next bar's title names it)
SUBGROUPS = ("state", "ops", "intent", "wait", "ack", "throttled", "maintenance", "deadline")  # lines of a row


def timeline(events: Iterable[Mapping[str, Any]], now_ms: int, job: str,  # noqa: C901
             unavailability: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """``unavailability``: UnavailabilityStarted/Ended documents of the job's entitlement (its machines' are kept)."""
    events = list(events)
    groups: dict[str, dict] = {JOB_GROUP: {"id": JOB_GROUP, "content": job, "order": -1}}
    used = {r["machine_id"] for d in events if d["type"] == "TaskStatesChanged"
            for r in d["payload"].get("reports") or () if r.get("job_id") == job and r.get("machine_id")}
    used |= {c["machine_id"] for d in events if d["type"] == "TasksCommanded"
             for c in d["payload"].get("commands") or () if c.get("machine_id")}
    open_: dict[str, dict] = {}  # task -> its current span
    lost: set[tuple[str, int]] = set()  # (task, time) of a machine-lost mark made
    items: list[dict] = []

    def point(group: str, at: int, kind: str, text: str, title: str) -> None:
        # a line of its own under the row's bars (a task's commands and marks), or per kind (the job's row): marks
        # close in time stack there instead of overlapping (vis-timeline's subgroups, stacked: ``subgroupStack``)
        items.append({"id": f"p{len(items)}", "group": group, "start": at, "type": "point", "content": text,
                      "className": f"op-{kind}", "title": title, "subgroup": kind if group == JOB_GROUP else "ops"})

    passing: dict[str, list[str]] = {}  # task -> the brief states since its last bar (told in the next bar's title)

    def close(task: str, at: int) -> None:
        span = open_.pop(task, None)
        if span is None:
            return
        span["end"] = max(at, span["start"] + 1)
        before = span.pop("before")
        if span["end"] - span["start"] < BRIEF_MS:  # ALLOCATED → STARTING → RUNNING within a second: one bar, the
            passing[task] = [*before, span["content"]]  # next, names them (a sliver's label is noise)
            return
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
                version = f" v{r['spec_version']}" if r.get("spec_version") else ""
                before = passing.pop(task, [])
                open_[task] = {"id": f"s{len(items)}-{task}", "group": task, "start": ts, "type": "range",
                               "subgroup": "state",
                               "content": f"{r['state']}{version}{where}", "className": f"state-{r['state'].lower()}",
                               "title": f"{task}: {r['state']}{version}{where} ({r.get('reason') or 'no reason'})"
                                        + (f"; just before: {', '.join(before)}" if before else ""), "before": before}
                if r.get("reason") in MACHINE_LOST and (task, ts) not in lost:  # once per task and report batch
                    lost.add((task, ts))
                    point(task, ts, "failure", "machine failed", f"{task}: its machine {r.get('machine_id') or ''} "
                          f"was lost ({r['reason']}); the task moves")
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
    for doc in unavailability:
        p, ts = doc["payload"], doc["timestamp_ms"]
        machines = sorted(used.intersection(p.get("machine_ids") or [p.get("machine_id")]))
        if doc["type"] != "UnavailabilityStarted" or not machines:
            continue
        what = f"{p.get('kind', '').lower()} {p.get('unavailability_id')} of {', '.join(machines[:3])}" \
               + (" ..." if len(machines) > 3 else "") + (f": {p['reason']}" if p.get("reason") else "")
        if p.get("kind") == "MAINTENANCE":  # a failure is marked on each task it moved (above)
            point(JOB_GROUP, ts, "maintenance", "maintenance notice", f"announced: {what}")
            start, deadline = p.get("start_ms") or ts, p.get("deadline_ms")
            if deadline:
                point(JOB_GROUP, deadline, "deadline", "deadline", f"deadline of {what}: what remains is stopped")
            items.append({"id": f"b{len(items)}", "start": start, "end": start + (p.get("expected_duration_ms") or 1),
                          "type": "background", "className": "maintenance-window", "content": "maintenance",
                          "title": what})
    for task in list(open_):  # a task's current state: its bar ends now, however brief
        span = open_.pop(task)
        span.pop("before")
        span["end"] = max(now_ms, span["start"] + 1)
        span["className"] += " open"
        items.append(span)
    items.sort(key=lambda i: i["start"])
    truncated = max(0, len(items) - MAX_ITEMS)
    if truncated:
        items = items[-MAX_ITEMS:]
    for g in groups.values():  # the bars on one line (they follow each other); the marks stacked on theirs
        g["subgroupStack"] = {k: True for k in SUBGROUPS if k != "state"}
        g["subgroupOrder"] = "subgroupOrder"
    for i in items:
        i["subgroupOrder"] = SUBGROUPS.index(i["subgroup"]) if i.get("subgroup") in SUBGROUPS else len(SUBGROUPS)
    return {"groups": sorted(groups.values(), key=lambda g: (g["order"], g["id"])), "items": items,
            "truncated": truncated}


def _order(task: str) -> int:
    tail = task.rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else 1 << 30
