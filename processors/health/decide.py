"""Health Check Service decisions: agent heartbeats → machine health. Pure: no I/O, no clock.

The service watches every machine it learns of from the ``machines`` topic (``on_machine_event``: that is
also where it learns the key of a machine's events — its entitlement or ``free/<dc>``) and every heartbeat:

* ``on_heartbeat``: a heartbeat is judged by ``classify`` (a duplicate or an out-of-order one changes
  nothing); an accepted heartbeat from a machine marked UNHEALTHY, newer than that verdict, emits
  MachineStatusChanged(UNHEALTHY→UP, ``heartbeat_resumed``);
* ``on_tick``: every UP machine silent for longer than ``timeout_ms`` emits
  MachineStatusChanged(UP→UNHEALTHY, ``heartbeat_missed``), once: it is UNHEALTHY afterwards.

Only UP and UNHEALTHY are the service's to judge. DOWN and MAINTENANCE belong to the Resource Broker: a
machine there is not judged (its heartbeats are still recorded), and when it comes back UP its silence is
counted from then. A status event older than the status held is ignored (the service's own decisions come
back on the log after it has moved on). Heartbeat time is the heartbeat's own timestamp.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from processors.cowmap import CowMap
from processors.resourcebroker.decide import UNHEALTHY, UP
from streams.events import Event, derived_event_id, new_event
from streams.topics import free_pool_key

PRODUCER = "health"

# Reasons carried by the MachineStatusChanged events this service emits.
HEARTBEAT_MISSED = "heartbeat_missed"  # UP → UNHEALTHY: silent for longer than the timeout
HEARTBEAT_RESUMED = "heartbeat_resumed"  # UNHEALTHY → UP: a heartbeat newer than the verdict arrived

# Heartbeat verdicts (``classify``): why a heartbeat counted or not.
HB_ACCEPTED = "accepted"  # a higher sequence than the last one
HB_AGENT_RESTARTED = "agent_restarted"  # a sequence not higher, but newer in time: the agent started over
HB_DUPLICATE = "duplicate"  # the last sequence again, not newer (at-least-once redelivery)
HB_STALE = "stale"  # a lower sequence, not newer: delivered out of order
HB_UNKNOWN_MACHINE = "unknown_machine"  # not (yet) seen on the machines topic
COUNTED = frozenset({HB_ACCEPTED, HB_AGENT_RESTARTED})

JUDGED = frozenset({UP, UNHEALTHY})  # statuses this service moves between; the rest are the broker's


class HealthError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class MachineHealth:
    """What the service knows of one machine (times in ms since epoch)."""

    machine_id: str
    owner_key: str  # key of the machine's events: its entitlement or free/<dc>
    status: str = UP
    status_ms: int = 0  # time of the event that set ``status``
    last_seen_ms: int = 0  # last heartbeat, or since when the machine is watched (registration, back UP)
    last_sequence: int = -1  # -1: no heartbeat yet


@dataclass(frozen=True)
class HealthState:
    """machine id → MachineHealth (immutable; decisions return a new state)."""

    machines: CowMap[MachineHealth] = field(default_factory=CowMap)

    @property
    def unhealthy(self) -> frozenset[str]:
        """The machines marked UNHEALTHY."""
        return frozenset(h.machine_id for h in self.machines.values() if h.status == UNHEALTHY)

    def _with(self, changes: dict[str, MachineHealth]) -> "HealthState":
        return HealthState(self.machines.updated(changes)) if changes else self


# -- folding the machines topic --------------------------------------------------------------------------------

def _owner_key(ev: Event) -> str:
    if ev.type == "MachineReleasedToFreePool":
        return free_pool_key(ev.payload["dc"])
    return ev.entitlement


def _apply(cur: MachineHealth | None, ev: Event) -> MachineHealth | None:
    if ev.type not in APPLIED:
        return cur
    if cur is None:  # watched from the first event about it, whichever partition brings it first
        cur = MachineHealth(machine_id=ev.payload["machine_id"], owner_key=_owner_key(ev),
                            last_seen_ms=ev.timestamp_ms)
    if ev.type == "MachineStatusChanged":
        status = ev.payload["status"]
        if ev.timestamp_ms < cur.status_ms:
            return cur  # older than the status held (e.g. our own verdict, overtaken by a heartbeat)
        seen = max(cur.last_seen_ms, ev.timestamp_ms) if status == UP and cur.status != UP else cur.last_seen_ms
        return replace(cur, status=status, status_ms=ev.timestamp_ms, owner_key=ev.entitlement, last_seen_ms=seen)
    if ev.type == "MachineAssignedToEntitlement":
        ok = cur.owner_key.startswith("free/") or cur.owner_key == ev.entitlement
        return replace(cur, owner_key=ev.entitlement) if ok else cur
    if ev.type == "MachineReleasedToFreePool":
        return replace(cur, owner_key=_owner_key(ev)) if cur.owner_key == ev.entitlement else cur
    return cur  # MachineRegistered: watched from its registration; a re-registration changes nothing here


APPLIED = frozenset({"MachineRegistered", "MachineStatusChanged", "MachineAssignedToEntitlement",
                     "MachineReleasedToFreePool"})


def on_machine_event(state: HealthState, event: Event) -> HealthState:
    """Fold one event of the ``machines`` topic (others change nothing). Applying it twice changes nothing more."""
    return apply_all(state, (event,))


def apply_all(state: HealthState, events: Iterable[Event]) -> HealthState:
    """Fold many machine events in one step (one copy of the touched shards)."""
    changes: dict[str, MachineHealth] = {}
    for ev in events:
        if ev.type not in APPLIED:
            continue
        mid = ev.payload["machine_id"]
        cur = changes[mid] if mid in changes else state.machines.get(mid)
        new = _apply(cur, ev)
        if new != cur:
            changes[mid] = new
    return state._with(changes)


# -- heartbeats ------------------------------------------------------------------------------------------------

def _check_heartbeat(heartbeat: Event) -> None:
    if heartbeat.type != "AgentHeartbeat":
        raise HealthError(f"expected an AgentHeartbeat, got {heartbeat.type}")


def classify(state: HealthState, heartbeat: Event) -> str:
    """The verdict on ``heartbeat`` (HB_*): whether it counts, and why not."""
    _check_heartbeat(heartbeat)
    rec = state.machines.get(heartbeat.payload["machine_id"])
    if rec is None:
        return HB_UNKNOWN_MACHINE
    seq = heartbeat.payload.get("sequence", 0)
    if seq > rec.last_sequence:
        return HB_ACCEPTED
    if heartbeat.timestamp_ms > rec.last_seen_ms:
        return HB_AGENT_RESTARTED
    return HB_DUPLICATE if seq == rec.last_sequence else HB_STALE


def _status_event(rec: MachineHealth, status: str, reason: str, now_ms: int, event_id: str,
                  causation_id: str | None, producer: str) -> Event:
    return new_event("MachineStatusChanged",
                     {"machine_id": rec.machine_id, "status": status, "previous_status": rec.status,
                      "reason": reason},
                     entitlement=rec.owner_key, entity_id=rec.machine_id, producer=producer,
                     causation_id=causation_id, timestamp_ms=now_ms, event_id=event_id)


def on_heartbeat(state: HealthState, heartbeat: Event, *,
                 producer: str = PRODUCER) -> tuple[HealthState, list[Event]]:
    """Record a heartbeat (``classify``: only HB_ACCEPTED and HB_AGENT_RESTARTED count). If the machine is
    marked UNHEALTHY and the heartbeat is newer than that verdict, emit MachineStatusChanged(UNHEALTHY→UP,
    HEARTBEAT_RESUMED) caused by the heartbeat."""
    verdict = classify(state, heartbeat)
    if verdict not in COUNTED:
        return state, []
    mid, seq, ts = heartbeat.payload["machine_id"], heartbeat.payload.get("sequence", 0), heartbeat.timestamp_ms
    rec = state.machines[mid]
    new = replace(rec, last_sequence=seq, last_seen_ms=max(rec.last_seen_ms, ts))
    events = []
    if rec.status == UNHEALTHY and ts > rec.status_ms:
        ev = _status_event(rec, UP, HEARTBEAT_RESUMED, ts,
                           derived_event_id(PRODUCER, HEARTBEAT_RESUMED, mid, heartbeat.event_id or f"{seq}@{ts}"),
                           heartbeat.event_id or None, producer)
        events.append(ev)
        new = replace(new, status=UP, status_ms=ts)
    return state._with({mid: new}), events


def on_tick(state: HealthState, now_ms: int, timeout_ms: int, *,
            producer: str = PRODUCER) -> tuple[HealthState, list[Event]]:
    """Mark every UP machine silent for longer than ``timeout_ms`` at ``now_ms`` UNHEALTHY:
    MachineStatusChanged(UP→UNHEALTHY, HEARTBEAT_MISSED), in machine id order. A machine is reported once
    per silence (the event id is derived from the silence: its last heartbeat), so a replayed tick emits the
    same ids. One scan of the watched machines."""
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms <= 0:
        raise HealthError(f"timeout_ms must be a positive number of ms, got {timeout_ms!r}")
    silent = sorted((h for h in state.machines.values() if h.status == UP and now_ms - h.last_seen_ms > timeout_ms),
                    key=lambda h: h.machine_id)
    events, changes = [], {}
    for h in silent:
        events.append(_status_event(
            h, UNHEALTHY, HEARTBEAT_MISSED, now_ms,
            derived_event_id(PRODUCER, HEARTBEAT_MISSED, h.machine_id, h.last_seen_ms, h.last_sequence),
            None, producer))
        changes[h.machine_id] = replace(h, status=UNHEALTHY, status_ms=now_ms)
    return state._with(changes), events

