"""Ops Planner decisions: an operator's maintenance plan → UnavailabilityStarted / UnavailabilityEnded. Pure.

    plan(broker_state, Plan(machines=[...] | rack="dc/msb/rack" | msb="dc/msb", start_ms, duration_ms,
         deadline_ms), now_ms) -> [UnavailabilityStarted(MAINTENANCE), one per owner of the machines]
    end(broker_state, unavailability_id, machine_ids, now_ms)
        -> [MachinesStatusChanged(→UP) per owner..., UnavailabilityEnded per owner]

The machines come from the region: ``broker_state`` is the Resource Broker's fold of the ``machines`` topic
(``processors/resourcebroker``), whose ``plan_maintenance`` / ``maintenance_ended`` these wrap, with the Ops
Planner as producer. A bad plan raises ``PlanError`` with a one-line reason. What happens next is the
scheduler's (``processors/scheduler/decide.py``): the jobs' TaskControllers get the notice and choose per task
(move now, stop and restart after, keep running); at the deadline the scheduler stops what remains; on
UnavailabilityEnded the tasks stopped for it start again.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from processors.resourcebroker import decide as rb
from streams.events import Event

PRODUCER = "opsplanner"


class PlanError(ValueError):
    """A maintenance plan that cannot be carried out, with the reason."""


@dataclass(frozen=True)
class Plan:
    start_ms: int
    duration_ms: int
    deadline_ms: int | None = None  # default: the start
    machines: tuple[str, ...] | list[str] | None = None
    rack: str | None = None  # dc/msb/rack
    msb: str | None = None  # dc/msb
    reason: str = rb.REASON_MAINTENANCE

    def targets(self) -> list[rb.Target]:
        given = [x for x in (self.machines, self.rack, self.msb) if x]
        if len(given) != 1:
            raise PlanError("give exactly one of --machines, --rack, --msb")
        if self.machines:
            return [rb.Target(rb.TARGET_MACHINE, m) for m in self.machines]
        if self.rack:
            return [rb.Target(rb.TARGET_RACK, self.rack)]
        assert self.msb  # the one given
        return [rb.Target(rb.TARGET_MSB, self.msb)]


def plan(state: rb.BrokerState, p: Plan, now_ms: int) -> list[Event]:
    """The UnavailabilityStarted(MAINTENANCE) events of plan ``p`` (ids derived from the plan: a repeat names
    them alike, and consumers drop the second copy)."""
    try:
        targets = [rb.parse_target(t) for t in p.targets()]
        _, events = rb.plan_maintenance(state, targets, p.start_ms, p.duration_ms, p.deadline_ms, now_ms,
                                        reason=p.reason, producer=PRODUCER)
    except rb.BrokerError as exc:
        raise PlanError(str(exc)) from None
    return events


def end(state: rb.BrokerState, unavailability_id: str, machine_ids: Iterable[str], now_ms: int) -> list[Event]:
    """The maintenance ``unavailability_id`` is over: machines in MAINTENANCE back UP, UnavailabilityEnded."""
    ids = sorted(set(machine_ids))
    if not ids:
        raise PlanError(f"maintenance {unavailability_id} names no machines (unknown unavailability id?)")
    try:
        _, events = rb.maintenance_ended(state, unavailability_id, ids, now_ms, producer=PRODUCER)
    except rb.BrokerError as exc:
        raise PlanError(str(exc)) from None
    return events
