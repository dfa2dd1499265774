"""The Ops Planner's actions on the log (``ropewalk maintenance plan|end`` calls them): thin IO around ``decide.py``.

``plan`` folds the ``machines`` topic (the Resource Broker's registry: where every machine is) to resolve the
targets, and produces the UnavailabilityStarted events on ``unavailability``. ``end`` reads ``unavailability``
for the plan's machines, folds ``machines``, and produces MachinesStatusChanged(→UP), one per owner, for machines
in MAINTENANCE and UnavailabilityEnded. Cost: one full fold of ``machines`` per call (as ``ropewalk machine fail``).
A record these reads cannot decode is skipped and counted in ``skipped`` (the command reports it once).
"""
from __future__ import annotations

import dataclasses
import time

from infra.config import Config
from processors.opsplanner import decide as op
from processors.opsplanner.decide import Plan, PlanError
from processors.resourcebroker.processor import fold_machines, produce
from streams.catchup import read_to_end
from streams.clients import EventConsumer, EventProducer
from streams.deadletter import Skipped
from streams.events import Event
from streams.topics import Topics


def _now_ms() -> int:
    return int(time.time() * 1000)


def _produce(cfg: Config, registry, events: list[Event], principal: str | None = None) -> list[str]:
    """Produce ``events``, recording who asked (``principal``) in their envelopes."""
    return produce(EventProducer(cfg, registry, op.PRODUCER),
                   [dataclasses.replace(ev, principal=principal) for ev in events])


def plan_maintenance(cfg: Config, registry, plan: Plan, now_ms: int | None = None, *,
                     skipped: Skipped | None = None, principal: str | None = None) -> list[Event]:
    """Resolve ``plan`` against the region and produce its UnavailabilityStarted events; returns them."""
    events = op.plan(fold_machines(cfg, registry, skipped=skipped), plan, _now_ms() if now_ms is None else now_ms)
    _produce(cfg, registry, events, principal)
    return events


def planned_machines(cfg: Config, registry, unavailability_id: str, *, skipped: Skipped | None = None) -> list[str]:
    """The machines of maintenance ``unavailability_id``, from its UnavailabilityStarted events on the log."""
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("unavailability")
    consumer = EventConsumer(cfg, registry, [topic], name=f"{op.PRODUCER}-read", skipped=skipped)
    found: set[str] = set()
    try:
        def take(records) -> None:
            for r in records:
                p = r.event.payload
                if r.event.type == "UnavailabilityStarted" and p["unavailability_id"] == unavailability_id:
                    found.update(p["machine_ids"])

        read_to_end(consumer, take)
    finally:
        consumer.close()
    return sorted(found)


def end_maintenance(cfg: Config, registry, unavailability_id: str, now_ms: int | None = None, *,
                    skipped: Skipped | None = None, principal: str | None = None) -> list[Event]:
    machines = planned_machines(cfg, registry, unavailability_id, skipped=skipped)
    if not machines:
        raise PlanError(f"no maintenance {unavailability_id!r} on the log")
    events = op.end(fold_machines(cfg, registry, skipped=skipped), unavailability_id, machines,
                    _now_ms() if now_ms is None else now_ms)
    _produce(cfg, registry, events, principal)
    return events
