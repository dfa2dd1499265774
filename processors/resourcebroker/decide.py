"""Resource Broker decisions: the machine registry, failures and recoveries, planned maintenance. Pure.

No faust, Kafka or Redis; no clock (every time is an argument). The broker's state is a fold of the
``machines`` topic (``apply``/``apply_all``), and every decision returns ``(new_state, events)`` where
``new_state`` is exactly the state with its own machine events applied, so deciding and replaying agree.

Decisions (all keyed to the machine's current owner: its entitlement, or ``free/<dc>`` in the free pool):

* ``register``/``register_all``: MachinesRegistered, one per owner key and thousand machines
  (``batches.REGISTRATIONS_PER_RECORD``); nothing for a machine already registered identically; a change of type or
  capacity re-registers; a change of place (region/dc/msb/rack) raises RegistrationConflict. (A log written before
  is read as well: a MachineRegistered per machine.)
* ``machine_failed``: MachineStatusChanged(→DOWN) + UnavailabilityStarted(FAILURE) for that machine.
* ``machines_failed``: many machines at once (a Health Check tick, a power loss): per owner key ONE
  MachinesStatusChanged(→DOWN) and ONE UnavailabilityStarted(FAILURE) listing them.
* ``machine_recovered``: MachineStatusChanged(DOWN→UP) + UnavailabilityEnded of the failure's UE;
  ``machines_recovered``: many, per owner ONE MachinesStatusChanged(DOWN→UP), an UnavailabilityEnded per UE.
* ``power_lost`` / ``power_restored``: a power controller's (or an operator's) announcement that a fault domain
  (DC, MSB, rack) lost its power: ``machines_failed`` of its machines with kind POWER and reason ``power``; power
  back: ``machines_recovered`` of those of its machines DOWN for that reason (reason ``power_restored``).
* ``plan_maintenance``: UnavailabilityStarted(MAINTENANCE) with advance notice and deadline, one per owner,
  listing that owner's affected machines (the Ops Planner's input path; statuses do not change yet).
* ``maintenance_started``/``maintenance_ended``: per owner ONE MachinesStatusChanged(→MAINTENANCE / →UP), and on
  the end UnavailabilityEnded, one per owner.

Status transitions live in ``status.STATUS_TRANSITIONS`` (the one table, the health check's too); a trigger that finds the machine already where it leads
(``NO_CHANGE``) emits nothing, anything else raises IllegalStatusTransition. Event ids come from
``derived_event_id`` over what caused them, so replaying a decision emits the same ids (at-least-once
delivery: consumers drop an id they have seen). A failure's unavailability id is derived from the id of the
MachineStatusChanged(DOWN) that recorded it, so the recovery can name it from the state alone.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from processors.cowmap import MACHINE_SHARDS, CowMap
from streams import batches
from streams.enums import UnavailabilityKind
from streams.events import Event, derived_event_id, new_event
from streams.batches import MACHINES_REGISTERED, MACHINES_STATUS_CHANGED  # many machines of one owner per record
from streams.topics import free_pool_key, is_free_pool_key

from .region import MachineSpec
from .status import (  # noqa: F401  (the table's names, as the broker's callers know them)
    DOWN, FAILED, MAINTENANCE, MAINTENANCE_ENDED, MAINTENANCE_STARTED, NO_CHANGE, RECOVERED, STATUS_TRANSITIONS,
    UNHEALTHY, UNKNOWN, UP, BrokerError, IllegalStatusTransition, next_status)

PRODUCER = "resourcebroker"

# Reasons: MachineStatusChanged.reason and UnavailabilityStarted.reason (callers may pass their own words).
REASON_OPERATOR = "operator"  # an operator said so: ropewalk machine fail / recover
REASON_HEALTH_CHECK = "health_check"  # failed after the Health Check Service's verdict
REASON_MAINTENANCE = "maintenance"  # planned maintenance: the UE's default reason, and status → MAINTENANCE
REASON_MAINTENANCE_ENDED = "maintenance_ended"  # the maintenance window closed: status → UP
REASON_POWER = "power"  # the machine's fault domain lost its power: DOWN, UnavailabilityStarted POWER
REASON_POWER_RESTORED = "power_restored"  # power back: DOWN (power) → UP, the POWER UE ended

# UnavailabilityKind symbols of schemas/UnavailabilityStarted.avsc.
KIND_FAILURE = UnavailabilityKind.FAILURE
KIND_MAINTENANCE = UnavailabilityKind.MAINTENANCE
KIND_POWER = UnavailabilityKind.POWER

# Maintenance targets: "machine:<id>" (or a bare id), "rack:<dc>/<msb>/<rack>", "msb:<dc>/<msb>", "dc:<dc>".
TARGET_MACHINE = "machine"
TARGET_RACK = "rack"
TARGET_MSB = "msb"
TARGET_DC = "dc"
DOMAIN_DEPTH = MappingProxyType({TARGET_DC: 1, TARGET_MSB: 2, TARGET_RACK: 3})  # path parts of a fault domain

MACHINE_EVENTS = ("MachineRegistered", "MachineStatusChanged", "MachineAssignedToEntitlement",
                  "MachineReleasedToFreePool", MACHINES_STATUS_CHANGED, MACHINES_REGISTERED)


def is_free(owner: str | None, status: str, under_maintenance: bool) -> bool:
    """A machine of the free pool that can be given now: no owner, UP, under no maintenance. The one rule the
    lender's headroom and the web UI's free pool (Entitlements, Loans) count by: a DOWN machine, or one under
    maintenance, is unowned but not free."""
    return owner is None and status == UP and not under_maintenance


class UnknownMachine(BrokerError):
    def __init__(self, machine_id: str):
        self.machine_id = machine_id
        super().__init__(f"unknown machine {machine_id!r}: not registered with the resource broker")


class RegistrationConflict(BrokerError):
    """A machine id re-registered at another place: a machine does not move between racks."""


class BadTarget(BrokerError):
    """A maintenance target does not parse or matches no registered machine."""


class BadMaintenance(BrokerError):
    """Maintenance times that do not make sense (deadline after start, window in the past, ...)."""


# -- the state -------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MachineRecord:
    """What the broker knows of one machine (cpu in millicores, memory in MiB)."""

    id: str
    region: str
    dc: str
    msb: str
    rack: str
    machine_type: str
    cpu_millicores: int
    memory_mib: int
    host_profile: str | None = None
    status: str = UP  # a newly registered machine is UP until a MachineStatusChanged says otherwise
    owner: str | None = None  # the entitlement holding it; None: its DC's free pool
    status_reason: str = ""
    status_event_id: str = ""  # the MachineStatusChanged that set ``status`` (names a failure's UE)
    registered: bool = True  # False: only later events were seen so far (cross-partition order)
    status_ms: int = 0  # the time of the event that set ``status``: an older one changes it no more
    owner_ms: int = 0  # the time of the event that set ``owner``: an older one changes it no more

    @property
    def owner_key(self) -> str:
        """The key of events about this machine: its entitlement, or ``free/<dc>``."""
        return self.owner if self.owner is not None else free_pool_key(self.dc)

    def fault_domain(self, level: str) -> str:
        """``dc``, ``dc/msb`` or ``dc/msb/rack`` for level dc, msb or rack."""
        return "/".join((self.dc, self.msb, self.rack)[: DOMAIN_DEPTH[level]])


@dataclass(frozen=True)
class BrokerState:
    """The broker's registry: machine id → MachineRecord (immutable; decisions return a new state)."""

    machines: CowMap[MachineRecord] = field(default_factory=lambda: CowMap(shards=MACHINE_SHARDS))

    def __len__(self) -> int:
        return len(self.machines)

    def get(self, machine_id: str) -> MachineRecord | None:
        """The machine's record if it is registered."""
        rec = self.machines.get(machine_id)
        return rec if rec is not None and rec.registered else None


# -- folding the log -------------------------------------------------------------------------------------------

def _owner_of_key(key: str) -> str | None:
    return None if is_free_pool_key(key) else key


def _stub(machine_id: str, dc: str = "") -> MachineRecord:
    return MachineRecord(id=machine_id, region="", dc=dc, msb="", rack="", machine_type="", cpu_millicores=0,
                         memory_mib=0, registered=False)


def _registered(cur: MachineRecord | None, p: Mapping[str, Any], ev: Event) -> MachineRecord:
    """``cur`` after the registration ``p`` (a MachineRegistered's payload, or an item of a MachinesRegistered)."""
    topo, cap = p["topology"], p["capacity"]
    attrs = dict(region=topo["region"], dc=topo["dc"], msb=topo["msb"], rack=topo["rack"],
                 machine_type=p["machine_type"], cpu_millicores=cap["cpu_millicores"],
                 memory_mib=cap["memory_mib"], host_profile=p.get("host_profile"), registered=True)
    if cur is None:
        return MachineRecord(id=p["machine_id"], owner=_owner_of_key(ev.entitlement), owner_ms=ev.timestamp_ms,
                             **attrs)
    return replace(cur, **attrs)  # status and owner stay: re-registration changes attributes only


def _apply_registered(cur: MachineRecord | None, ev: Event) -> MachineRecord:
    return _registered(cur, ev.payload, ev)


# A machine's events travel on its owner's partition, so they change partitions with its owner, and a reader of
# several partitions (a restarted health check or broker, a CLI's fold) may read them out of their order: a
# status or ownership event older than the one that set the machine's status or owner changes it no more (newest
# wins; events of one time apply in read order). Before, a health check that read an old assignment after a newer
# one kept the old owner's key for the machine's verdicts, and a broker that read UP before an older UNHEALTHY
# held the machine UNHEALTHY for good.

def _apply_status(cur: MachineRecord | None, ev: Event) -> MachineRecord:
    cur = cur or _stub(ev.payload["machine_id"])
    if ev.timestamp_ms < cur.status_ms:
        return cur
    return replace(cur, status=ev.payload["status"], status_reason=ev.payload.get("reason", ""),
                   status_event_id=ev.event_id, status_ms=ev.timestamp_ms)


def _apply_assigned(cur: MachineRecord | None, ev: Event) -> MachineRecord:
    cur = cur or _stub(ev.payload["machine_id"], ev.payload["dc"])
    if ev.timestamp_ms < cur.owner_ms:
        return cur
    # A free machine joins an entitlement (as the allocator's index); one held by another entitlement too when the
    # assignment is newer: the release it implies was read later than it happened.
    return replace(cur, owner=ev.entitlement, owner_ms=ev.timestamp_ms)


def _apply_released(cur: MachineRecord | None, ev: Event) -> MachineRecord:
    cur = cur or _stub(ev.payload["machine_id"], ev.payload["dc"])
    if cur.owner == ev.entitlement and ev.timestamp_ms >= cur.owner_ms:  # only the holder can give it back
        return replace(cur, owner=None, owner_ms=ev.timestamp_ms)
    return cur


APPLIERS = MappingProxyType({
    "MachineRegistered": _apply_registered,
    "MachineStatusChanged": _apply_status,
    "MachineAssignedToEntitlement": _apply_assigned,
    "MachineReleasedToFreePool": _apply_released,
})


class _Fold:
    """The working copy of one call: reads through to the state and applies each event it is given.

    Lives only inside a call (the returned state is immutable). A machine event about a machine not yet
    registered makes an unregistered stub, so a status or owner seen before the registration (they travel on
    other partitions) is kept and the registration later fills in the rest.
    """

    def __init__(self, state: BrokerState):
        self.state = state
        self.changes: dict[str, MachineRecord] = {}
        self.events: list[Event] = []

    def get(self, machine_id: str) -> MachineRecord | None:
        return self.changes[machine_id] if machine_id in self.changes else self.state.machines.get(machine_id)

    def known(self, machine_id: str) -> MachineRecord:
        rec = self.get(machine_id)
        if rec is None or not rec.registered:
            raise UnknownMachine(machine_id)
        return rec

    def apply(self, ev: Event) -> None:
        if ev.type == MACHINES_STATUS_CHANGED:  # one status for many machines: as one event per machine
            for m in ev.payload["machines"]:
                mid = m["machine_id"]
                cur = self.get(mid) or _stub(mid)
                if ev.timestamp_ms < cur.status_ms:  # newest wins, as for one machine's (``_apply_status``)
                    continue
                new = replace(cur, status=ev.payload["status"], status_reason=ev.payload.get("reason", ""),
                              status_event_id=ev.event_id, status_ms=ev.timestamp_ms)
                if new != cur:
                    self.changes[mid] = new
            return
        if ev.type == MACHINES_REGISTERED:  # many machines: as one MachineRegistered per machine
            for p in ev.payload["machines"]:
                mid = p["machine_id"]
                held = self.get(mid)
                new = _registered(held, p, ev)
                if new != held:
                    self.changes[mid] = new
            return
        fn = APPLIERS.get(ev.type)
        if fn is None:
            return
        mid = ev.payload["machine_id"]
        held = self.get(mid)  # None: the first event about it (an applier makes the stub)
        new = fn(held, ev)
        if new != held:
            self.changes[mid] = new

    def emit(self, ev: Event) -> None:
        self.apply(ev)
        self.events.append(ev)

    def result(self) -> tuple[BrokerState, list[Event]]:
        state = BrokerState(self.state.machines.updated(self.changes)) if self.changes else self.state
        return state, self.events


def apply(state: BrokerState, event: Event) -> BrokerState:
    """Fold one event of the ``machines`` topic into the state; other events leave it as it is.

    MachineRegistered (and each machine of a MachinesRegistered) creates the machine (UP; owner from the key) or
    updates its attributes;
    MachineStatusChanged sets status, reason and the event id; MachineAssignedToEntitlement sets the owner if
    the machine is free; MachineReleasedToFreePool frees it if the releasing entitlement holds it. Applying an
    event twice gives the same state.
    """
    return apply_all(state, (event,))


def apply_all(state: BrokerState, events: Iterable[Event]) -> BrokerState:
    """Fold many events at once (one copy of the touched shards: rebuilding a region from its log)."""
    fold = _Fold(state)
    for ev in events:
        fold.apply(ev)
    return fold.result()[0]


# -- status transitions ----------------------------------------------------------------------------------------

def _status_event(rec: MachineRecord, status: str, reason: str, now_ms: int, event_id: str,
                  causation_id: str | None, producer: str) -> Event:
    return new_event("MachineStatusChanged",
                     {"machine_id": rec.id, "status": status, "previous_status": rec.status, "reason": reason},
                     entitlement=rec.owner_key, entity_id=rec.id, producer=producer, causation_id=causation_id,
                     timestamp_ms=now_ms, event_id=event_id)


def _transitions(fold: "_Fold", machine_ids: Iterable[str], trigger: str) -> list[tuple[MachineRecord, str]]:
    """(machine, new status) of each of ``machine_ids`` that ``trigger`` moves (``next_status``), in order.
    Raises UnknownMachine for a machine the broker does not know."""
    changes = []
    for mid in machine_ids:
        rec = fold.known(mid)
        status = next_status(mid, rec.status, trigger)
        if status is not None:
            changes.append((rec, status))
    return changes


def _statuses_events(fold: "_Fold", changes: Iterable[tuple[MachineRecord, str]], reason: str, now_ms: int,
                     trigger: str, causation_id: str | None, producer: str) -> list[Event]:
    """One MachinesStatusChanged per owner key and new status for ``changes`` (machine, new status), each split
    to at most ``batches.MAX_ITEMS`` machines, applied to ``fold``; returned in (owner, status) order. An event's
    id derives from the trigger, the owner, the time, the cause and its machines: the same call, the same ids."""
    groups: dict[tuple[str, str], list[MachineRecord]] = {}
    for rec, status in changes:
        groups.setdefault((rec.owner_key, status), []).append(rec)
    out = []
    for (key, status), recs in sorted(groups.items()):
        rows = sorted(({"machine_id": r.id, "previous_status": r.status} for r in recs), key=lambda r: r["machine_id"])
        for part in batches.split(rows):
            ids = [r["machine_id"] for r in part]
            ev = new_event(MACHINES_STATUS_CHANGED, {"status": status, "reason": reason, "machines": part},
                           entitlement=key, entity_id=key, producer=producer, causation_id=causation_id,
                           timestamp_ms=now_ms,
                           event_id=derived_event_id(PRODUCER, trigger, key, status, now_ms, causation_id, *ids))
            fold.emit(ev)
            out.append(ev)
    return out


def failure_unavailability_id(status_event_id: str) -> str:
    """The id of the FAILURE UE opened by the MachineStatusChanged(DOWN) with ``status_event_id``."""
    return derived_event_id(PRODUCER, "failure", status_event_id)


# -- decisions: registration -----------------------------------------------------------------------------------

def _spec_record(m: MachineSpec, held: MachineRecord | None) -> MachineRecord:
    """The record of ``m`` as just registered (over ``held``, the state's record, whose owner and profile stay)."""
    return MachineRecord(id=m.id, region=m.region, dc=m.dc, msb=m.msb, rack=m.rack, machine_type=m.machine_type,
                         cpu_millicores=m.cpu_millicores, memory_mib=m.memory_mib,
                         owner=held.owner if held is not None else None,
                         host_profile=held.host_profile if held is not None else None)


def register(state: BrokerState, machine: MachineSpec, now_ms: int, *, causation_id: str | None = None,
             producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """Register one machine: a MachinesRegistered of it keyed ``free/<dc>`` (its owner's key on a re-registration).

    Nothing if it is registered with the same place, type and capacity. Raises RegistrationConflict if the
    id is registered at another place.
    """
    return register_all(state, (machine,), now_ms, causation_id=causation_id, producer=producer)


def register_all(state: BrokerState, machines: Iterable[MachineSpec], now_ms: int, *,
                 causation_id: str | None = None, producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """``register`` for many machines in one step: one MachinesRegistered per owner key (in order of first
    appearance) and ``batches.REGISTRATIONS_PER_RECORD`` machines (the region's order within a key), one copy of the
    state however many machines. An event's id derives from its key, the time and each machine's id, type and
    capacity: the same registration at the same time, the same ids. Raises RegistrationConflict (nothing decided)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    listed: dict[str, MachineSpec] = {}  # a machine listed twice: its second listing is read as a re-registration
    for m in machines:
        cur = state.machines.get(m.id)
        if m.id in listed:
            cur = _spec_record(listed[m.id], cur)
        if cur is not None and cur.registered:
            if (cur.region, cur.dc, cur.msb, cur.rack) != (m.region, m.dc, m.msb, m.rack):
                raise RegistrationConflict(
                    f"machine {m.id} is registered at {cur.region}/{cur.fault_domain(TARGET_RACK)}, "
                    f"not {m.region}/{m.dc}/{m.msb}/{m.rack}: a machine does not move; give it a new id")
            if (cur.machine_type, cur.cpu_millicores, cur.memory_mib) == (m.machine_type, m.cpu_millicores,
                                                                          m.memory_mib):
                continue
        key = cur.owner if cur is not None and cur.owner is not None else free_pool_key(m.dc)
        listed[m.id] = m
        groups.setdefault(key, []).append(
            {"machine_id": m.id, "topology": m.topology(), "machine_type": m.machine_type, "capacity": m.capacity(),
             "host_profile": cur.host_profile if cur is not None else None})
    fold = _Fold(state)
    for key, items in groups.items():
        for part in batches.split(items, max_items=batches.REGISTRATIONS_PER_RECORD):
            fold.emit(new_event(
                MACHINES_REGISTERED, {"machines": part}, entitlement=key, entity_id=key, producer=producer,
                causation_id=causation_id, timestamp_ms=now_ms,
                event_id=derived_event_id(PRODUCER, "registered", key, now_ms, *(
                    f"{r['machine_id']}/{r['machine_type']}/{r['capacity']['cpu_millicores']}/"
                    f"{r['capacity']['memory_mib']}" for r in part))))
    return fold.result()


# -- decisions: failure and recovery ---------------------------------------------------------------------------

def machine_failed(state: BrokerState, machine_id: str, reason: str, now_ms: int, *,
                   causation_id: str | None = None, producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """A machine failed: MachineStatusChanged(→DOWN) and UnavailabilityStarted(FAILURE, start now), both keyed
    to its owner. Nothing if it is DOWN already. Raises UnknownMachine."""
    def started(rec: MachineRecord, status_ev: Event) -> Event:
        ue_id = failure_unavailability_id(status_ev.event_id)
        return new_event("UnavailabilityStarted", {
            "unavailability_id": ue_id, "kind": KIND_FAILURE, "machine_ids": [machine_id], "start_ms": now_ms,
            "deadline_ms": None, "expected_duration_ms": None, "reason": reason},
            entitlement=rec.owner_key, entity_id=ue_id, producer=producer, causation_id=causation_id,
            timestamp_ms=now_ms, event_id=derived_event_id(ue_id, "started", rec.owner_key))

    return _status_change(state, machine_id, FAILED, reason, now_ms, causation_id, producer, started)


def machines_failed(state: BrokerState, machine_ids: Iterable[str], reason: str, now_ms: int, *,
                    causation_id: str | None = None, producer: str = PRODUCER,
                    kind: str = KIND_FAILURE) -> tuple[BrokerState, list[Event]]:
    """Many machines failed at once (a Health Check tick, a power loss): per owner key, ONE
    MachinesStatusChanged(→DOWN) listing its machines and ONE UnavailabilityStarted(``kind``: FAILURE, or POWER)
    naming them (its id derived from the status event's, which every machine's record keeps:
    ``machine_recovered`` names it). Machines DOWN already are left out; nothing to do, nothing emitted. Raises
    UnknownMachine (nothing emitted)."""
    _check_reason(reason)
    fold = _Fold(state)
    changes = _transitions(fold, sorted(set(machine_ids)), FAILED)
    for ev in _statuses_events(fold, changes, reason, now_ms, FAILED, causation_id, producer):
        ue_id = failure_unavailability_id(ev.event_id)
        fold.emit(new_event(
            "UnavailabilityStarted",
            {"unavailability_id": ue_id, "kind": kind,
             "machine_ids": [m["machine_id"] for m in ev.payload["machines"]], "start_ms": now_ms,
             "deadline_ms": None, "expected_duration_ms": None, "reason": reason},
            entitlement=ev.entitlement, entity_id=ue_id, producer=producer, causation_id=causation_id,
            timestamp_ms=now_ms, event_id=derived_event_id(ue_id, "started", ev.entitlement)))
    return fold.result()


def machines_recovered(state: BrokerState, machine_ids: Iterable[str], reason: str, now_ms: int, *,
                       causation_id: str | None = None,
                       producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """Many failed machines are back: per owner key ONE MachinesStatusChanged(DOWN→UP), and per failure UE of
    theirs (per owner) one UnavailabilityEnded listing them. Machines UP already are left out; UNHEALTHY or in
    MAINTENANCE raise IllegalStatusTransition and unknown ones UnknownMachine (nothing emitted)."""
    _check_reason(reason)
    fold = _Fold(state)
    changes: list[tuple[MachineRecord, str]] = []
    ues: dict[tuple[str, str], list[str]] = {}  # (owner key, failure UE id) -> its machines recovered
    for mid in sorted(set(machine_ids)):
        rec = fold.known(mid)
        status = next_status(mid, rec.status, RECOVERED)
        if status is not None:
            changes.append((rec, status))
            ues.setdefault((rec.owner_key, failure_unavailability_id(rec.status_event_id)), []).append(mid)
    _statuses_events(fold, changes, reason, now_ms, RECOVERED, causation_id, producer)
    for (key, ue_id), ids in sorted(ues.items()):
        fold.emit(new_event(
            "UnavailabilityEnded", {"unavailability_id": ue_id, "machine_ids": ids},
            entitlement=key, entity_id=ue_id, producer=producer, causation_id=causation_id, timestamp_ms=now_ms,
            event_id=derived_event_id(ue_id, "ended", key, *ids)))
    return fold.result()


def power_lost(state: BrokerState, targets: Iterable[str | "Target"], now_ms: int, *, causation_id: str | None = None,
               producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """The fault domains ``targets`` (``dc:<dc>``, ``msb:<dc>/<msb>``, ``rack:...``, machines; ``parse_target``)
    lost their power: ``machines_failed`` of every machine they cover, kind POWER, reason ``power`` (one
    MachinesStatusChanged(→DOWN) and one UnavailabilityStarted(POWER) per owner). Machines DOWN already (failed
    before) are left out: they keep their own UE. Raises BadTarget (nothing emitted)."""
    return machines_failed(state, resolve_targets(state, targets), REASON_POWER, now_ms, causation_id=causation_id,
                           producer=producer, kind=KIND_POWER)


def power_restored(state: BrokerState, targets: Iterable[str | "Target"], now_ms: int, *,
                   causation_id: str | None = None, producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """Power is back in ``targets``: their machines DOWN because of a power loss (reason ``power``) are UP again
    (``machines_recovered``, reason ``power_restored``: one MachinesStatusChanged(DOWN→UP) per owner, the POWER
    UEs ended). Machines down for another reason (a failure, the health check's verdict) stay down. Nothing to do,
    nothing emitted. Raises BadTarget (nothing emitted)."""
    ids = [m for m in resolve_targets(state, targets)
           if (rec := state.get(m)) is not None and rec.status == DOWN and rec.status_reason == REASON_POWER]
    return machines_recovered(state, ids, REASON_POWER_RESTORED, now_ms, causation_id=causation_id,
                              producer=producer)


def machine_recovered(state: BrokerState, machine_id: str, reason: str, now_ms: int, *,
                      causation_id: str | None = None,
                      producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """A failed machine is back: MachineStatusChanged(DOWN→UP) and UnavailabilityEnded of its failure's UE,
    keyed to its owner now. Nothing if it is UP; raises IllegalStatusTransition if UNHEALTHY (the health
    check decides) or in MAINTENANCE (``maintenance_ended`` does), UnknownMachine if unknown."""
    def ended(rec: MachineRecord, _status_ev: Event) -> Event:
        ue_id = failure_unavailability_id(rec.status_event_id)  # the record as it was: DOWN by that failure
        return new_event("UnavailabilityEnded", {"unavailability_id": ue_id, "machine_ids": [machine_id]},
                         entitlement=rec.owner_key, entity_id=ue_id, producer=producer, causation_id=causation_id,
                         timestamp_ms=now_ms, event_id=derived_event_id(ue_id, "ended", rec.owner_key))

    return _status_change(state, machine_id, RECOVERED, reason, now_ms, causation_id, producer, ended)


def _status_change(state: BrokerState, machine_id: str, trigger: str, reason: str, now_ms: int,
                   causation_id: str | None, producer: str,
                   unavailability: Callable[[MachineRecord, Event], Event]) -> tuple[BrokerState, list[Event]]:
    """One machine's status change by ``trigger``: its MachineStatusChanged (id derived from trigger, machine, time
    and cause), then ``unavailability(record as it was, that event)``; nothing if ``trigger`` changes nothing.
    Raises BrokerError (no reason), UnknownMachine, IllegalStatusTransition."""
    _check_reason(reason)
    fold = _Fold(state)
    rec = fold.known(machine_id)
    status = next_status(machine_id, rec.status, trigger)
    if status is None:
        return state, []
    status_ev = _status_event(rec, status, reason, now_ms,
                              derived_event_id(PRODUCER, trigger, machine_id, now_ms, causation_id),
                              causation_id, producer)
    fold.emit(status_ev)
    fold.emit(unavailability(rec, status_ev))
    return fold.result()


def _check_reason(reason: str) -> None:
    if not isinstance(reason, str) or not reason:
        raise BrokerError(f"a reason is required (e.g. {REASON_OPERATOR!r}), got {reason!r}")


# -- decisions: planned maintenance ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """What maintenance is for: one machine, or every machine of a rack, an MSB or a DC."""

    level: str  # TARGET_MACHINE, TARGET_RACK, TARGET_MSB or TARGET_DC
    path: str  # machine id, or dc[/msb[/rack]]

    def __str__(self) -> str:
        return f"{self.level}:{self.path}"


def parse_target(target: str | Target) -> Target:
    """``machine:<id>`` or a bare id, ``rack:<dc>/<msb>/<rack>``, ``msb:<dc>/<msb>``, ``dc:<dc>``; a bare
    ``<dc>/<msb>[/<rack>]`` is read by its depth."""
    if isinstance(target, Target):
        level, path = target.level, target.path
    elif not isinstance(target, str) or not target:
        raise BadTarget(f"maintenance target {target!r}: expected machine:<id>, rack:<dc>/<msb>/<rack>, "
                        f"msb:<dc>/<msb> or dc:<dc>")
    elif ":" in target:
        level, path = target.split(":", 1)
    elif "/" in target:
        level = {2: TARGET_MSB, 3: TARGET_RACK}.get(target.count("/") + 1, "")
        path = target
    else:
        level, path = TARGET_MACHINE, target
    if level == TARGET_MACHINE:
        ok = bool(path) and "/" not in path
    else:
        depth = DOMAIN_DEPTH.get(level)
        ok = depth is not None and all(path.split("/")) and path.count("/") + 1 == depth
    if not ok:
        raise BadTarget(f"maintenance target {target!s}: expected machine:<id>, rack:<dc>/<msb>/<rack>, "
                        f"msb:<dc>/<msb> or dc:<dc>")
    return Target(level, path)


def resolve_targets(state: BrokerState, targets: Iterable[str | Target]) -> tuple[str, ...]:  # noqa: C901
    """The registered machines ``targets`` cover, sorted, each once. Raises BadTarget for a target that does
    not parse or covers no registered machine. Fault-domain targets cost one scan of the registry."""
    parsed = [parse_target(t) for t in targets]
    if not parsed:
        raise BadTarget("no maintenance targets given")
    hits: dict[Target, list[str]] = {t: [] for t in parsed}
    for t in parsed:
        if t.level == TARGET_MACHINE and state.get(t.path) is not None:
            hits[t].append(t.path)
    domains = {level: {t.path: t for t in parsed if t.level == level} for level in DOMAIN_DEPTH}
    domains = {level: paths for level, paths in domains.items() if paths}
    if domains:
        for rec in state.machines.values():
            if not rec.registered:
                continue
            for level, paths in domains.items():
                hit = paths.get(rec.fault_domain(level))
                if hit is not None:
                    hits[hit].append(rec.id)
    for t, ids in hits.items():
        if not ids:
            raise BadTarget(f"maintenance target {t} matches no registered machine")
    return tuple(sorted({mid for ids in hits.values() for mid in ids}))


def _by_owner(fold: _Fold, machine_ids: Iterable[str]) -> dict[str, list[str]]:
    """Machine ids grouped by their owner key, keys and ids sorted."""
    groups: dict[str, list[str]] = {}
    for mid in sorted(set(machine_ids)):
        groups.setdefault(fold.known(mid).owner_key, []).append(mid)
    return dict(sorted(groups.items()))


def plan_maintenance(state: BrokerState, targets: Iterable[str | Target], start_ms: int, duration_ms: int,
                     deadline_ms: int | None, now_ms: int, *, reason: str = REASON_MAINTENANCE,
                     unavailability_id: str | None = None, causation_id: str | None = None,
                     producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """Announce planned maintenance of ``targets`` (machines, racks, MSBs, DCs; see ``parse_target``).

    One UnavailabilityStarted(MAINTENANCE) per owner (entitlement or ``free/<dc>``), listing that owner's
    machines, all with one ``unavailability_id`` (derived from the plan unless given), ``start_ms``,
    ``deadline_ms`` (when the scheduler stops what is left; default ``start_ms``) and ``duration_ms``. Statuses
    do not change until ``maintenance_started``. Requires ``now_ms <= deadline_ms <= start_ms`` and a positive
    duration (BadMaintenance); unknown targets raise BadTarget.
    """
    _check_reason(reason)
    deadline_ms = start_ms if deadline_ms is None else deadline_ms
    if isinstance(duration_ms, bool) or not isinstance(duration_ms, int) or duration_ms <= 0:
        raise BadMaintenance(f"duration_ms must be a positive number of ms, got {duration_ms!r}")
    if not now_ms <= deadline_ms <= start_ms:
        def rel(ms: int) -> str:  # how a person gave it: relative to now
            return f"now{'+' if ms >= now_ms else '-'}{abs(ms - now_ms) // 1000}s"

        raise BadMaintenance(f"the deadline must come after now and no later than the start (deadline {rel(deadline_ms)}"
                             f", start {rel(start_ms)}): tasks are told before the deadline and what remains is "
                             f"stopped at it, so that the maintenance can start (e.g. --start +15m --deadline +10m)")
    targets = [parse_target(t) for t in targets]
    machine_ids = resolve_targets(state, targets)
    ue_id = unavailability_id or derived_event_id(PRODUCER, "maintenance", ",".join(sorted(map(str, targets))),
                                                  start_ms, duration_ms, deadline_ms, now_ms)
    fold = _Fold(state)
    for key, ids in _by_owner(fold, machine_ids).items():
        fold.emit(new_event(
            "UnavailabilityStarted",
            {"unavailability_id": ue_id, "kind": KIND_MAINTENANCE, "machine_ids": ids, "start_ms": start_ms,
             "deadline_ms": deadline_ms, "expected_duration_ms": duration_ms, "reason": reason},
            entitlement=key, entity_id=ue_id, producer=producer, causation_id=causation_id, timestamp_ms=now_ms,
            event_id=derived_event_id(ue_id, "started", key)))
    return fold.result()


def maintenance_started(state: BrokerState, unavailability_id: str, machine_ids: Iterable[str], now_ms: int, *,
                        causation_id: str | None = None,
                        producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """The window of UE ``unavailability_id`` opened: per owner key ONE MachinesStatusChanged(→MAINTENANCE,
    reason maintenance) of its machines among ``machine_ids`` that are UP or UNHEALTHY (DOWN ones stay DOWN;
    repeats emit nothing)."""
    fold = _Fold(state)
    changes = _transitions(fold, sorted(set(machine_ids)), MAINTENANCE_STARTED)
    _statuses_events(fold, changes, REASON_MAINTENANCE, now_ms, f"{MAINTENANCE_STARTED}/{unavailability_id}",
                     causation_id, producer)
    return fold.result()


def maintenance_ended(state: BrokerState, unavailability_id: str, machine_ids: Iterable[str], now_ms: int, *,
                      causation_id: str | None = None,
                      producer: str = PRODUCER) -> tuple[BrokerState, list[Event]]:
    """The window of UE ``unavailability_id`` closed: per owner key ONE MachinesStatusChanged(MAINTENANCE→UP)
    of its machines in maintenance, then UnavailabilityEnded per owner listing its machines (all of
    ``machine_ids``: the UE is over even for a machine that failed meanwhile — that one stays DOWN under its own
    FAILURE UE). Ids are derived from the UE, so repeating the call re-emits the same UnavailabilityEnded ids."""
    fold = _Fold(state)
    ids = sorted(set(machine_ids))
    changes = _transitions(fold, ids, MAINTENANCE_ENDED)
    _statuses_events(fold, changes, REASON_MAINTENANCE_ENDED, now_ms, f"{MAINTENANCE_ENDED}/{unavailability_id}",
                     causation_id, producer)
    for key, group in _by_owner(fold, ids).items():
        fold.emit(new_event(
            "UnavailabilityEnded", {"unavailability_id": unavailability_id, "machine_ids": group},
            entitlement=key, entity_id=unavailability_id, producer=producer, causation_id=causation_id,
            timestamp_ms=now_ms, event_id=derived_event_id(unavailability_id, "ended", key)))
    return fold.result()
