"""Why is this task here, and why not there: ``ropewalk explain TASK [--at TIME] [--why-not MACHINE]``.

From the log alone (the task's entitlement's partition of every topic, ``streams.replay``, up to ``--at``):

* **the decision** that placed the task: the allocator's last TasksAllocated naming it (request id, time, position,
  commit attempts, machines it took from the free pool, the job's tasks per fault domain after it), or, when the
  task is not placed, the last AllocationRejected naming it (reason and message);
* **the filters** that rejected the other machines: the decision's ``filter_rejections``, counts per reason (each
  machine counted under the first filter it failed; ``placement.FILTERS`` is the order);
* **the events that led to it**: the AllocationRequested it answers (resources, requirements, spread, machines to
  avoid), the event the scheduler decided that on (an intent, an agent's report, a machine's failure, a
  maintenance, or its timer), and what caused that one; then the task's own history (the job's intents and every
  event naming the task), one line each as ``ropewalk replay`` prints them;
* with ``--why-not MACHINE``: that machine as the allocator saw it just before the decision (the region at that
  moment, ``moments.region_at``): the first filter it failed, or, if it passed them all, how it ranked against the
  chosen machine by ``placement.SCORES`` for the request's first task. Other decisions of the allocator's batch in
  the same millisecond are not in that region; the log does not order them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infra.config import Config
from processors.allocator.decide import request_of
from processors.allocator.fold import job_of
from processors.allocator.placement import FILTERS, SCORES, existing_bins, fault_domain, _Round
from streams import batches
from streams.deadletter import Skipped
from streams.replay import Record, ReplayFilter, format_text, iso_time, logical_topic, replay
from streams.serde import SchemaRegistry

TOPICS = ("intents", "machines", "unavailability", "allocations", "tasks", "taskcontrol")


class ExplainError(LookupError):
    pass


class BadTaskId(ExplainError, ValueError):
    pass


def explain(cfg: Config, registry: SchemaRegistry, task_id: str, at_ms: int | None = None, *,
            why_not: str | None = None, skipped: Skipped | None = None) -> dict[str, Any]:
    job = job_of(task_id)
    if not job or not task_id.rpartition("/")[2].isdigit():
        raise BadTaskId(f"bad task id {task_id!r}: a task id is <job>/<index>, e.g. e1.web/0")
    entitlement = job.split(".", 1)[0]
    flt = ReplayFilter(entitlement=entitlement, until_ms=None if at_ms is None else at_ms + 1, topics=TOPICS)
    records = list(replay(cfg, registry, flt, skipped=skipped))
    doc = story(records, task_id, at_ms)
    if why_not is not None:
        doc["why_not"] = why_not_there(cfg, registry, doc, why_not, records, skipped=skipped)
    return doc


def _about_task(rec: Record, task_id: str, job: str) -> bool:
    ev, p = rec.event, rec.event.payload
    if ev.entity_id == task_id or p.get("task_id") == task_id:
        return True
    if ev.type in ("JobSubmitted", "JobSpecChanged", "JobResized", "JobStopped"):
        return p.get("job_id") == job or ev.entity_id == job
    if p.get("job_id") != job and ev.type not in ("TaskStatesChanged",):
        return False
    names = set(p.get("place_task_ids") or ()) | set(p.get("free_task_ids") or ()) | set(p.get("unplaced_task_ids") or ())
    names |= {r["task_id"] for r in p.get("placements") or ()}
    names |= {c["task_id"] for c in batches.task_commands(ev)}
    names |= {r["task_id"] for r in batches.task_reports(ev)}
    names |= {c["task_id"] for c in batches.discovery_changes(ev)}
    return task_id in names


def story(records: Sequence[Record], task_id: str, at_ms: int | None = None) -> dict[str, Any]:  # noqa: C901
    """The explanation from the entitlement's records up to ``at_ms`` (pure)."""
    job = job_of(task_id)
    if at_ms is not None:
        records = [r for r in records if r.event.timestamp_ms <= at_ms]
    by_id = {r.event.event_id: r for r in records}
    placed = [r for r in records if r.event.type == "TasksAllocated" and r.event.producer == "allocator"
              and any(p["task_id"] == task_id for p in r.event.payload["placements"])]
    rejected = [r for r in records if r.event.type == "AllocationRejected"
                and task_id in r.event.payload["unplaced_task_ids"]]
    history = sorted((r for r in records if _about_task(r, task_id, job)),
                     key=lambda r: (r.event.timestamp_ms, TOPICS.index(logical_topic(r)), r.offset))
    if not history:
        raise ExplainError(f"no event names task {task_id}" + (f" up to {at_ms}" if at_ms is not None else ""))
    last = max(placed, key=lambda r: (r.event.timestamp_ms, r.offset), default=None)
    last_rejection = max(rejected, key=lambda r: (r.event.timestamp_ms, r.offset), default=None)
    freed_after = last is not None and any(
        r.event.type == "TasksDeallocated" and (r.event.timestamp_ms, r.offset) > (last.event.timestamp_ms, last.offset)
        and any(p["task_id"] == task_id for p in r.event.payload["placements"]) for r in records)
    doc: dict[str, Any] = {"task": task_id, "job": job, "at_ms": at_ms, "machine": None, "decision": None,
                           "history": [format_text(r) for r in history]}
    if last is not None and not freed_after:
        row = next(p for p in last.event.payload["placements"] if p["task_id"] == task_id)
        doc["machine"] = row["machine_id"]
        doc["fault_domain"] = {k: row[k] for k in ("dc", "msb", "rack")}
        parts = [r for r in records if r.event.type == "TasksAllocated"
                 and r.event.causation_id == last.event.causation_id and r.event.producer == "allocator"]
        p = last.event.payload
        counts: dict[str, int] = {}
        bins: dict[str, int] = {}
        for r in parts:
            counts = counts or dict(r.event.payload.get("filter_rejections") or {})
            bins = bins or dict(r.event.payload.get("fault_domain_bins") or {})
        doc["decision"] = {
            "type": "TasksAllocated", "request_id": p["request_id"], "event_id": last.event.event_id,
            "time_ms": last.event.timestamp_ms, "time": iso_time(last.event.timestamp_ms),
            "position": f"allocations/{last.partition}@{last.offset}", "commit_attempts": p.get("commit_attempts", 1),
            "tasks_placed": sum(len(r.event.payload["placements"]) for r in parts),
            "machines_added": sorted({m for r in parts for m in r.event.payload.get("machines_added") or ()}),
            "filter_rejections": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
            "filters_in_order": [reason for reason, _ in FILTERS],
            "fault_domain_bins": bins}
        cause_id = last.event.causation_id
    elif last_rejection is not None:
        p = last_rejection.event.payload
        doc["decision"] = {"type": "AllocationRejected", "request_id": p["request_id"],
                           "event_id": last_rejection.event.event_id, "time_ms": last_rejection.event.timestamp_ms,
                           "time": iso_time(last_rejection.event.timestamp_ms),
                           "position": f"allocations/{last_rejection.partition}@{last_rejection.offset}",
                           "reason": p["reason"], "message": p["message"],
                           "filter_rejections": dict(p.get("filter_rejections") or {})}
        cause_id = last_rejection.event.causation_id
    else:
        cause_id = None
    chain: list[dict[str, Any]] = []
    seen = set()
    while cause_id is not None and cause_id not in seen and len(chain) < 4:
        seen.add(cause_id)
        rec = by_id.get(cause_id)
        if rec is None:
            if not chain or chain[-1].get("type") != "TaskStatesChanged":  # reports are caused by commands' lines
                chain.append({"event_id": cause_id, "note": f"its cause {cause_id} is not on this entitlement's "
                                                            f"partition (or is after --at)"})
            break
        chain.append(_link(rec))
        cause_id = rec.event.causation_id
        if rec.event.type == "AllocationRequested" and cause_id is None:
            chain.append({"note": "asked by the scheduler's timer (retry_unplaced: a retry, a deadline, a throttled "
                                  "operation released)"})
    doc["caused_by"] = chain
    if chain and chain[0].get("type") == "AllocationRequested":
        rec = by_id[chain[0]["event_id"]]
        rp = rec.event.payload
        doc["request"] = {"request_id": rp["request_id"], "time_ms": rec.event.timestamp_ms,
                          "place": len(rp["place_task_ids"]), "free": len(rp["free_task_ids"]),
                          "resources": dict(rp["resources"]), "requirements": dict(rp.get("requirements") or {}),
                          "spread": rp.get("spread"), "avoid_machine_ids": list(rp.get("avoid_machine_ids") or ())}
    return doc


def _link(rec: Record) -> dict[str, Any]:
    ev = rec.event
    return {"type": ev.type, "event_id": ev.event_id, "time_ms": ev.timestamp_ms, "time": iso_time(ev.timestamp_ms),
            "producer": ev.producer, "position": f"{logical_topic(rec)}/{rec.partition}@{rec.offset}",
            "line": format_text(rec)}


def why_not_there(cfg: Config, registry: SchemaRegistry, doc: Mapping[str, Any], machine_id: str,
                  records: Sequence[Record], *, skipped: Skipped | None = None) -> dict[str, Any]:
    """``machine_id`` against the request of the decision, on the region just before the decision."""
    from processors.history import moments  # noqa: PLC0415 - start-up: moments loads faust (~0.5 s); --why-not only

    decision = doc.get("decision")
    if decision is None or not doc.get("caused_by") or doc["caused_by"][0].get("type") != "AllocationRequested":
        return {"machine": machine_id, "answer": "no placement decision to compare with"}
    request = next(r.event for r in records if r.event.event_id == doc["caused_by"][0]["event_id"])
    region, _ = moments.region_at(cfg, registry, decision["time_ms"] - 1, skipped=skipped,
                                  scheduler_partitions=frozenset())  # the allocator's fold alone
    fold = region.fold
    m = fold.machine(machine_id)
    if m is None:
        return {"machine": machine_id, "answer": "unknown machine at that moment"}
    owner = {"owner": m.entitlement or None}  # who held it then (None: the free pool): the API shows it to whom may see
    ent = fold.entitlement(request.entitlement)
    if ent is None:
        return {"machine": machine_id, "answer": f"entitlement {request.entitlement} unknown at that moment"}
    req = request_of(request, fold.existing(request.payload["job_id"]))
    for reason, build in FILTERS:
        passes = build(ent, req)
        if passes is not None and not passes(m):
            return {"machine": machine_id, **owner, "answer": "filtered", "filter": reason,
                    "state": {"status": m.status, "entitlement": m.entitlement, "type": m.machine_type, "dc": m.dc,
                              "cpu_free": m.cpu_free, "mem_free": m.mem_free, "maintenance": list(m.maintenance)}}
    chosen = fold.machine(doc["machine"]) if doc.get("machine") else None
    machines = {x.id: x for x in (m, chosen) if x is not None}
    snapshot = {mid: x for mid in req.existing.values() if (x := fold.machine(mid)) is not None}
    w = _Round(request=req, cpu_free={x.id: x.cpu_free for x in machines.values()},
               mem_free={x.id: x.mem_free for x in machines.values()},
               members={x.id for x in machines.values() if x.entitlement == ent.name},
               bins=existing_bins({**snapshot, **machines}, req))

    def key(x):
        return {name: score(x, w) for name, score in SCORES}

    out = {"machine": machine_id, **owner, "answer": "passed every filter", "its_scores": key(m),
           "scores_in_order": [n for n, _ in SCORES], "spread_bin": fault_domain(m, req.spread)}
    if chosen is not None:
        out["chosen"] = chosen.id
        out["chosen_scores"] = key(chosen)
        out["ranked_behind_by"] = next((n for n, _ in SCORES if key(chosen)[n] != key(m)[n]), None)
    return out


def text(doc: Mapping[str, Any]) -> str:
    lines = []
    d = doc.get("decision")
    if doc.get("machine"):
        fd = doc.get("fault_domain") or {}
        lines.append(f"task {doc['task']} is on {doc['machine']} ({fd.get('dc')}/{fd.get('msb')}/{fd.get('rack')})"
                     + (f" at {iso_time(doc['at_ms'])}" if doc.get("at_ms") is not None else ""))
    else:
        lines.append(f"task {doc['task']} is not placed" + (f" at {iso_time(doc['at_ms'])}" if doc.get("at_ms") else ""))
    if d is not None and d["type"] == "TasksAllocated":
        lines.append(f"placed by the allocator at {d['time']} ({d['position']}), request {d['request_id']}, "
                     f"{d['tasks_placed']} tasks, commit attempts {d['commit_attempts']}"
                     + (f", took {len(d['machines_added'])} machines from the free pool" if d["machines_added"] else ""))
        rej = ", ".join(f"{n} {r}" for r, n in d["filter_rejections"].items()) or "none"
        lines.append(f"machines rejected by the filters (first failing filter each): {rej}")
        lines.append("the job's tasks per fault domain after it: "
                     + ", ".join(f"{k} {v}" for k, v in sorted(d["fault_domain_bins"].items())))
    elif d is not None:
        lines.append(f"last rejected at {d['time']} ({d['position']}), request {d['request_id']}: {d['reason']}: "
                     f"{d['message']}")
    r = doc.get("request")
    if r:
        lines.append(f"the request: place {r['place']}, free {r['free']} tasks of {r['resources']['cpu_millicores']}m "
                     f"cpu / {r['resources']['memory_mib']} MiB, spread {r['spread']}, requirements "
                     f"{r['requirements'] or '-'}, avoid {', '.join(r['avoid_machine_ids']) or '-'}")
    for i, link in enumerate(doc.get("caused_by") or ()):
        lines.append(("because of " if i == 0 else "  caused by ") + (link.get("line") or link.get("note") or link["event_id"]))
    w = doc.get("why_not")
    if w:
        if w["answer"] == "filtered":
            lines.append(f"why not {w['machine']}: rejected by filter {w['filter']} ({w['state']})")
        elif w["answer"] == "passed every filter":
            lines.append(f"why not {w['machine']}: it passed every filter and ranked behind {w.get('chosen')} by "
                         f"{w.get('ranked_behind_by')} (scores {w['its_scores']} vs {w.get('chosen_scores')})")
        else:
            lines.append(f"why not {w['machine']}: {w['answer']}")
    lines.append(f"history of {doc['task']}:")
    lines += [f"  {line}" for line in doc["history"]]
    return "\n".join(lines)


__all__ = ["explain", "story", "text", "ExplainError"]
