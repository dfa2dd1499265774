"""What `ropewalk rebalance plan` reads and prints (the front end's command calls these).

* ``plans``: the ReBalancer's plans as they are on the log (``RebalancePlanned`` on ``intents``; the latest per
  entitlement, or all), each move with its progress read from ``state.jobs`` (done, elsewhere, moving, waiting).
* ``dry_run``: a plan made now from the log, as the processor would make it, without producing anything: what
  the next round would do (the processor's goals, or others given on the command line).
"""
from __future__ import annotations

import time
from typing import Any

from infra.config import Config
from processors.allocator import fold as region_fold
from processors.allocator.follow import Follower
from processors.rebalancer import view as rv
from processors.rebalancer.processor import TOPICS
from processors.rebalancer.solver import Goals, solve
from streams import state
from streams.deadletter import Skipped
from streams.replay import ReplayFilter, replay
from streams.serde import SchemaRegistry


def plans(cfg: Config, registry: SchemaRegistry, entitlement: str | None = None, *, every: bool = False,
          skipped: Skipped | None = None) -> list[dict[str, Any]]:
    run = replay(cfg, registry, ReplayFilter(entitlement=entitlement, topics=("intents",),
                                             types=frozenset({"RebalancePlanned"})), skipped=skipped)
    found = [rec.event for rec in run if rec.event.type == "RebalancePlanned"]
    if not every:
        latest: dict[str, Any] = {}
        for ev in found:
            held = latest.get(ev.entitlement)
            if held is None or rv.plan_number(ev.payload["plan_id"]) > rv.plan_number(held.payload["plan_id"]):
                latest[ev.entitlement] = ev
        found = [latest[e] for e in sorted(latest)]
    if not found:
        return []
    jobs = state.current(cfg, registry, "jobs", entitlement, skipped=skipped)
    tasks = {t["task_id"]: t for ev in jobs.values() for t in ev.payload["tasks"]}
    return [rv.plan_view(ev, tasks) for ev in found]


def dry_run(cfg: Config, registry: SchemaRegistry, goals: Goals, entitlement: str | None = None) -> list[dict]:
    view = rv.RebalanceView(goals.no_bounce_ms)
    Follower(cfg, registry, view, topics=TOPICS, types=region_fold.EVENT_TYPES | rv.EVENT_TYPES,
             name="cli/rebalance").catch_up()
    now = int(time.time() * 1000)
    out = []
    for ent in [entitlement] if entitlement else view.due(now):
        plan = solve(view.scope(ent, now), goals)
        events = view.plan_events(plan, goals, now)
        if events:
            on = {t: {"machine_id": m, "state": "RUNNING"} for t, m in view.fold.placement.items()}
            out.append({**rv.plan_view(events[0], on), "dry_run": True})
        else:
            out.append({"plan": None, "entitlement": ent, "status": plan.status, "dry_run": True,
                        "before": rv.balance_record(plan.before), "after": rv.balance_record(plan.after),
                        "moves": [], "progress": {}, "excluded": dict(plan.excluded), "solve_ms": plan.solve_ms})
    return out


def format_views(views: list[dict[str, Any]]) -> str:
    blocks = []
    for v in views:
        if v["plan"] is None:
            b = v["before"]
            blocks.append(f"entitlement {v['entitlement']}: {v['status']} (max/mean {b['ratio']:.3f}, mean load "
                          f"{b['mean_load']:.3f}, {b['machines']} machines): nothing to move")
        else:
            blocks.append(("(dry run) " if v.get("dry_run") else "") + rv.format_plan(v))
    return "\n\n".join(blocks)
