"""What-if: what a maintenance or a machine failure would do, before it happens. ``ropewalk maintenance plan ...
--dry-run``, ``ropewalk machine fail M --dry-run``.

The events the real command would produce (the Ops Planner's ``plan``, the Resource Broker's ``machine_failed``:
the same builders) are injected into the region as it is now (``moments.region_at``) and the processors' own
decisions run forward in memory (``Region.start_what_if``): the scheduler's ``decide`` and its timer (every
``retry_ms``: the maintenance deadline is enforced at the first tick after it), the allocator's decision of every
request it asks, and simulated agents (the agent's ``decide``; a STOP ends at once, a START runs after
``start_delay_ms``). Nothing is produced.

What it cannot know: the TaskControllers' answers. A job with a controller gets its advance notice (the
TaskControlRequested the scheduler would send is reported under ``controllers``), and the simulation assumes no
answer comes: at the deadline its tasks still on the machines are stopped and held until the maintenance ends
(``stop``). A controller that answers MOVE or STOP earlier changes that; the report says which jobs depend on one.
Without a controller, tasks still on the machines at the deadline are stopped and moved (``move``), or wait for
capacity when nothing fits (``wait``, with the allocator's reason and the filters' counts).

The outcome per task: ``move`` (from, to), ``stop`` (held on its machine until the maintenance ends), ``wait``
(unplaced: the reason; or an operation held by the rate limiter), ``keep`` (still running on a machine of the
maintenance when the simulation ends). Then ``capacity``: per entitlement its quota, machines held and the cpu and
memory free on them (UP, not under maintenance), and the free pool per DC, before and after.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from infra.config import Config
from processors.allocator.fold import job_of
from processors.history import moments
from processors.history.region import RETRY_MS, START_DELAY_MS, Region
from processors.opsplanner import decide as opd
from processors.resourcebroker import decide as rb
from processors.resourcebroker.processor import fold_machines
from processors.scheduler import lifecycle as lc
from processors.scheduler import model as sm
from streams import batches
from streams.deadletter import Skipped
from streams.enums import MachineStatus
from streams.events import Event
from streams.serde import SchemaRegistry
from streams.topics import FREE_POOL_OWNER

SETTLE_MS = 2 * RETRY_MS + 5_000  # simulated after the deadline (or the failure): a timer tick, a stop, a start


def maintenance(cfg: Config, registry: SchemaRegistry, plan, now_ms: int, *, skipped: Skipped | None = None
                ) -> dict[str, Any]:
    """``ropewalk maintenance plan ... --dry-run``: ``plan`` an ``opsplanner.decide.Plan``."""
    events = opd.plan(fold_machines(cfg, registry, skipped=skipped), plan, now_ms)
    deadline = max((e.payload["deadline_ms"] or e.payload["start_ms"]) for e in events)
    return what_if(cfg, registry, events, now_ms, max(deadline, now_ms) + SETTLE_MS, skipped=skipped)


def machine_failure(cfg: Config, registry: SchemaRegistry, machine_id: str, now_ms: int, *,
                    skipped: Skipped | None = None) -> dict[str, Any]:
    """``ropewalk machine fail M --dry-run``."""
    _, events = rb.machine_failed(fold_machines(cfg, registry, skipped=skipped), machine_id, rb.REASON_OPERATOR,
                                  now_ms)
    if not events:
        return {"events": [], "tasks": [], "note": f"{machine_id} is down already: nothing would happen"}
    return what_if(cfg, registry, events, now_ms, now_ms + SETTLE_MS, skipped=skipped)


def what_if(cfg: Config, registry: SchemaRegistry, events: Sequence[Event], now_ms: int, until_ms: int, *,
            skipped: Skipped | None = None, retry_ms: int = RETRY_MS, start_delay_ms: int = START_DELAY_MS
            ) -> dict[str, Any]:
    region, stats = moments.region_at(cfg, registry, now_ms, skipped=skipped)
    return simulate(region, events, now_ms, until_ms, retry_ms=retry_ms, start_delay_ms=start_delay_ms,
                    stats=stats)


def simulate(region: Region, events: Sequence[Event], now_ms: int, until_ms: int, *, retry_ms: int = RETRY_MS,  # noqa: C901
             start_delay_ms: int = START_DELAY_MS, stats: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the what-if on ``region`` (pure) and report the outcome."""
    region.advance(now_ms)
    before_tasks = _tasks(region)
    before_capacity = capacity(region)
    machines = sorted({m for e in events for m in batches.machine_ids(e)})
    log = region.start_what_if(events, now_ms, retry_ms=retry_ms, start_delay_ms=start_delay_ms)
    region.advance(until_ms)
    after_tasks = _tasks(region)
    rejected: dict[str, Event] = {}
    throttled: dict[str, Event] = {}
    for evs in log.decided.values():
        for e in evs:
            if e.type == "AllocationRejected":
                rejected[e.payload["job_id"]] = e
    for e in log.scheduler_decided.values():
        if e.type == "OperationsThrottled":
            throttled[e.payload["job_id"]] = e
    on = set(machines)
    tasks = []
    for tid in sorted(set(before_tasks) | set(after_tasks), key=_task_order):
        b, a = before_tasks.get(tid), after_tasks.get(tid)
        if b == a and (b is None or b["machine"] not in on):
            continue
        tasks.append(_outcome(tid, b, a, on, rejected, throttled))
    controllers: dict[str, dict[str, Any]] = {}
    for e in log.controller_requests:
        p = e.payload
        c = controllers.setdefault(p["job_id"], {"job": p["job_id"], "controller": p.get("controller"),
                                                  "requests": 0, "tasks_noticed": set(), "operations": set()})
        c["requests"] += 1
        for n in p.get("advance_notices") or ():
            c["tasks_noticed"].update(n.get("task_ids") or ())
        for op in p.get("pending_operations") or ():
            c["operations"].add(f"{op.get('kind')} {op.get('task_id')}")
    return {
        "at_ms": now_ms, "until_ms": until_ms, "machines": machines,
        "events": [e.to_json() for e in events],
        "tasks": tasks,
        "counts": {k: sum(t["outcome"] == k for t in tasks) for k in ("move", "stop", "wait", "keep")},
        "controllers": [{**c, "tasks_noticed": sorted(c["tasks_noticed"]), "operations": sorted(c["operations"])}
                        for _, c in sorted(controllers.items())],
        "unplaced": [{"job": j, "request": e.payload["request_id"], "reason": e.payload["reason"],
                      "message": e.payload["message"], "tasks": list(e.payload["unplaced_task_ids"]),
                      "filter_rejections": dict(e.payload.get("filter_rejections") or {})}
                     for j, e in sorted(rejected.items())],
        "throttled": [{"job": j, "reason": e.payload["reason"], "waiting": e.payload["waiting_count"],
                       "retry_at_ms": e.payload["retry_at_ms"]} for j, e in sorted(throttled.items())],
        "capacity": {"before": before_capacity, "after": capacity(region)},
        "assumptions": (f"simulated from the log at {_when(now_ms)} to {_when(until_ms)}: scheduler timer every "
                        f"{retry_ms / 1000:g} s, agents start in {start_delay_ms / 1000:g} s, TaskControllers do not "
                        f"answer"),
        **({"history": dict(stats)} if stats else {}),
    }


def _task_order(tid: str) -> tuple[str, int]:
    job, _, index = tid.rpartition("/")
    return job, int(index) if index.isdigit() else -1


def _tasks(region: Region) -> dict[str, dict[str, Any]]:
    out = {}
    for job in region.scheduler.jobs.values():
        if job.deleted:
            continue
        for t in job.tasks.values():
            out[t.id] = {"machine": t.machine, "state": t.state, "reason": t.reason, "controller": job.spec.controller,
                         "held": t.maint_choice in sm.HELD, "op": t.op}
    return out


def _outcome(tid: str, b: Mapping | None, a: Mapping | None, on: set[str], rejected: Mapping[str, Event],
             throttled: Mapping[str, Event]) -> dict[str, Any]:
    job = job_of(tid)
    row: dict[str, Any] = {"task": tid, "job": job, "from": b and b["machine"], "to": a and a["machine"],
                           "state": a and a["state"]}
    if a is None:
        row.update(outcome="stop", reason="gone")
    elif a["machine"] is not None and b is not None and a["machine"] != b["machine"] and a["machine"] not in on:
        row["outcome"] = "move"
    elif a["machine"] is None or a["state"] == lc.PENDING:
        rej = rejected.get(job)
        row.update(outcome="wait", reason=a["reason"] or (rej.payload["reason"] if rej else ""),
                   **({"message": rej.payload["message"]} if rej else {}))
    elif a["state"] in (lc.STOPPED, lc.STOPPING) or a["held"]:
        row.update(outcome="stop", reason=a["reason"])
    elif a["op"] is not None and job in throttled:
        row.update(outcome="wait", reason=throttled[job].payload["reason"])
    else:
        row.update(outcome="keep", reason=a["reason"])
    if b is not None and b["controller"]:
        row["controller"] = b["controller"]
    return row


def capacity(region: Region) -> dict[str, Any]:
    """Per entitlement: quota, machines held, cpu and memory free on the held machines that can take tasks (UP, no
    maintenance); the free pool per DC the same way."""
    fold = region.fold
    ents: dict[str, dict[str, int]] = {}
    pool: dict[str, dict[str, int]] = defaultdict(lambda: {"machines": 0, "cpu_millicores": 0, "memory_mib": 0})
    for name, ent in sorted(fold.entitlements.items()):
        ents[name] = {"quota": ent.quota_machines, "held": 0, "usable": 0, "free_cpu_millicores": 0,
                      "free_memory_mib": 0}
    for m in fold.machines.values():
        usable = m.status == MachineStatus.UP and not m.maintenance
        if m.entitlement == FREE_POOL_OWNER:
            if usable:
                p = pool[m.dc]
                p["machines"] += 1
                p["cpu_millicores"] += m.cpu_free
                p["memory_mib"] += m.mem_free
            continue
        e = ents.setdefault(m.entitlement, {"quota": 0, "held": 0, "usable": 0, "free_cpu_millicores": 0,
                                            "free_memory_mib": 0})
        e["held"] += 1
        if usable:
            e["usable"] += 1
            e["free_cpu_millicores"] += m.cpu_free
            e["free_memory_mib"] += m.mem_free
    return {"entitlements": ents, "free_pool": dict(sorted(pool.items()))}


def _when(ms: int) -> str:
    """A moment as the dry runs' text says it (UTC to the second, as the CLI's tables do; --json keeps the ms)."""
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def text(doc: Mapping[str, Any]) -> str:
    """The report for people."""
    lines = [f"what if: {', '.join(sorted({e['type'] for e in doc.get('events', [])}))} on "
             f"{len(doc.get('machines', []))} machines (dry run: nothing was produced)"]
    if doc.get("note"):
        return doc["note"]
    c = doc["counts"]
    lines.append(f"tasks: {c['move']} move, {c['stop']} stop, {c['wait']} wait, {c['keep']} keep")
    for t in doc["tasks"]:
        where = f"{t['from']} -> {t['to']}" if t["outcome"] == "move" else (t["from"] or "-")
        lines.append(f"  {t['outcome']:5} {t['task']:28} {where}"
                     + (f"  ({t['reason']})" if t.get("reason") else "")
                     + (f"  controller {t['controller']}" if t.get("controller") else ""))
    for ctl in doc["controllers"]:
        lines.append(f"controller {ctl['controller']} of {ctl['job']} would be asked ({ctl['requests']} requests; "
                     f"tasks under notice: {', '.join(ctl['tasks_noticed']) or '-'})")
    for u in doc["unplaced"]:
        lines.append(f"cannot place {len(u['tasks'])} tasks of {u['job']}: {u['reason']}: {u['message']}")
    for t in doc["throttled"]:
        lines.append(f"rate-limited: {t['job']} ({t['waiting']} operations wait: {t['reason']})")
    for name, e in doc["capacity"]["after"]["entitlements"].items():
        b = doc["capacity"]["before"]["entitlements"].get(name, {})
        lines.append(f"entitlement {name}: {e['held']}/{e['quota']} machines ({e['usable']} usable), free "
                     f"{e['free_cpu_millicores']}m cpu / {e['free_memory_mib']} MiB"
                     + (f" (before: {b.get('usable')} usable, {b.get('free_cpu_millicores')}m)" if b else ""))
    for dc, p in doc["capacity"]["after"]["free_pool"].items():
        lines.append(f"free pool {dc}: {p['machines']} machines, {p['cpu_millicores']}m cpu, {p['memory_mib']} MiB")
    lines.append(doc["assumptions"])
    return "\n".join(lines)

