"""Health Check Service decisions: agent heartbeats → machine health. Pure: no I/O, no clock.

The service watches every machine it learns of from the ``machines`` topic (``on_machine_event``: that is
also where it learns the key of a machine's events — its entitlement or ``free/<dc>``) and every heartbeat:

* ``on_heartbeats`` (``on_heartbeat`` for one): each heartbeat is judged by ``classify`` (a duplicate or an
  out-of-order one changes nothing); the machines marked UNHEALTHY that an accepted heartbeat newer than that
  verdict resumes are announced together: one MachinesStatusChanged(UNHEALTHY→UP, ``heartbeat_resumed``) per
  owner key;
* ``on_tick``: every UP machine silent for longer than ``timeout_ms`` becomes UNHEALTHY, once, announced
  together: one MachinesStatusChanged(UP→UNHEALTHY, ``heartbeat_missed``) per owner key (1% of a region
  failing is one event per owner, not one per machine; Twine §2.1 has the HCS update the Resource Broker).

Only UP and UNHEALTHY are the service's to judge, by the triggers SILENT and HEARD of the machines' one status
table (``resourcebroker/status.py``, the Resource Broker's too). DOWN and MAINTENANCE belong to the Resource Broker: a
machine there is not judged (its heartbeats are still recorded), and when it comes back UP its silence is
counted from then. A status event older than the status held is ignored (the service's own decisions come
back on the log after it has moved on). Heartbeat time is the heartbeat's own timestamp.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import NamedTuple

from processors.cowmap import MACHINE_SHARDS, CowMap
from processors.resourcebroker.decide import REASON_HEALTH_CHECK
from processors.resourcebroker.status import DOWN, HEALTH_JUDGED, HEARD, SILENT, UP, moves, next_status
from streams import batches
from streams.batches import MACHINES_REGISTERED, MACHINES_STATUS_CHANGED
from streams.events import Event, derived_event_id, new_event
from streams.topics import free_pool_key

from . import zones as z
from .liveness import Liveness
from .zones import DisruptionPolicy, Zone

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
HB_FROM_THE_FUTURE = "from_the_future"  # dated more than MAX_CLOCK_SKEW_MS after the service's clock: refused
COUNTED = frozenset({HB_ACCEPTED, HB_AGENT_RESTARTED})
# How far ahead of the health check's clock a heartbeat may be dated. Silence is judged on the heartbeat's own time,
# so one dated a day ahead would keep its machine UP for a day after its agent died (issue 27): such a heartbeat is
# refused (dead-lettered, ``from_the_future``), not recorded. Clocks of a region agree within seconds (NTP).
MAX_CLOCK_SKEW_MS = 30_000

JUDGED = HEALTH_JUDGED  # statuses this service moves between (UP, UNHEALTHY); the rest are the broker's

ZONE_DISRUPTION_CHANGED = "ZoneDisruptionChanged"
# ZoneDisruptionChanged.reason
ZONE_STATE_CHANGED = "zone_state_changed"  # the zone's own state changed (zones.zone_state)
REGION_DISRUPTION = "region_disruption"  # every zone is dark: nobody is failed anywhere
REGION_DISRUPTION_ENDED = "region_disruption_ended"  # someone is heard again: every silence counts anew

# Why the silence clocks restarted (HealthState.clocks_reason): every UP machine's silence counts from then.
CLOCKS_STARTED = "started"  # the service (re)started: it does not know the heartbeats sent while it was away
CLOCKS_TICK_GAP = "tick_gap"  # its ticks stopped for longer than the timeout (paused, or its loop held)
CLOCKS_READING_BEHIND = "reading_behind"  # it reads heartbeats late: the ones it has not read would speak
CLOCKS_REGION_DISRUPTION_ENDED = REGION_DISRUPTION_ENDED  # see REGION_DISRUPTION_ENDED


class HealthError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class MachineHealth:
    """What the service knows of one machine besides when it was last heard (``HealthState.heard``; times in ms
    since epoch)."""

    machine_id: str
    owner_key: str  # key of the machine's events: its entitlement or free/<dc>
    status: str = UP
    status_ms: int = 0  # time of the event that set ``status``
    owner_ms: int = 0  # time of the event that set ``owner_key``: an older one changes it no more
    dc: str = ""  # its zone (from its registration or an ownership event; "" until one is read)
    status_reason: str = ""  # the reason of the event that set ``status`` (DOWN by health_check: still silent)


class Beat(NamedTuple):
    """What the service reads of an AgentHeartbeat: whose, when (its own time), its sequence and id."""

    machine_id: str
    timestamp_ms: int
    sequence: int
    event_id: str


# The AgentHeartbeat fields a Beat is read from, in its fields' order (a reader that skims them: ``Beat(*values)``).
BEAT_FIELDS = ("machine_id", "envelope.timestamp_ms", "sequence", "envelope.event_id")


_NO_ZONES: Mapping[str, tuple[int, int]] = MappingProxyType({})


@dataclass(frozen=True)
class HealthState:
    """machine id → MachineHealth; when each was last heard (``heard``: liveness.py); the protection's zones; and
    what a tick needs without a scan of the machines: the UNHEALTHY ones, those this service failed, and per zone
    how many machines it counts and how many of those are not UP. Immutable; decisions return a new state."""

    machines: CowMap[MachineHealth] = field(default_factory=lambda: CowMap(shards=MACHINE_SHARDS))
    heard: Liveness = field(default_factory=Liveness)
    unhealthy: frozenset[str] = frozenset()  # the machines marked UNHEALTHY
    failed: frozenset[str] = frozenset()  # the machines this service failed (DOWN, health_check): still silent
    zone_sizes: Mapping[str, tuple[int, int]] = field(default_factory=lambda: _NO_ZONES)  # dc -> (its ``_member``s, those of them not UP)
    zones: Mapping[str, Zone] = field(default_factory=lambda: MappingProxyType({}))  # dc → its zone, last tick
    region_disrupted: bool = False  # every zone was in full disruption at the last tick
    last_tick_ms: int = 0  # the last tick's time (0: none yet)
    clocks_from_ms: int = 0  # silence counts from no earlier than this (``restart_clocks``)
    clocks_reason: str = ""  # why the clocks last restarted (CLOCKS_*)

    def last_heard(self, machine_id: str) -> tuple[int, int] | None:
        """(its last heartbeat's time — or since when it is watched, or back UP —, its last sequence, -1: none)."""
        return self.heard.get(machine_id)

    def silent_since_ms(self, machine_id: str) -> int:
        """Since when its silence counts: its last heartbeat (or return UP), or the last restart of the clocks."""
        seen = self.heard.get(machine_id)
        return max(seen[0] if seen else 0, self.clocks_from_ms)

    def _with(self, changes: Mapping[str, MachineHealth], heard: Liveness | None = None) -> "HealthState":
        """With ``changes`` (and ``heard``), the derived sets and counts kept in step."""
        if not changes:
            return self if heard is None or heard is self.heard else replace(self, heard=heard)
        unhealthy, failed = set(self.unhealthy), set(self.failed)
        sizes = dict(self.zone_sizes)
        for mid, new in changes.items():
            old = self.machines.get(mid)
            for rec, sign in ((old, -1), (new, 1)):
                if rec is not None and _member(rec):
                    n, away = sizes.get(rec.dc, (0, 0))
                    sizes[rec.dc] = (n + sign, away + sign * (rec.status != UP))
            (unhealthy.add if moves(new.status, HEARD) else unhealthy.discard)(mid)  # those a heartbeat resumes
            (failed.add if _failed_here(new) else failed.discard)(mid)
        return replace(self, machines=self.machines.updated(changes), heard=self.heard if heard is None else heard,
                       unhealthy=frozenset(unhealthy), failed=frozenset(failed),
                       zone_sizes=MappingProxyType({dc: c for dc, c in sorted(sizes.items()) if c[0]}))


# -- folding the machines topic --------------------------------------------------------------------------------

def _owner_key(ev: Event) -> str:
    if ev.type == "MachineReleasedToFreePool":
        return free_pool_key(ev.payload["dc"])
    return ev.entitlement


def _dc(ev: Event) -> str:
    """The DC an event of the machines topic names ("" when it names none)."""
    if ev.type == "MachineRegistered":
        return ev.payload["topology"]["dc"]
    return ev.payload.get("dc") or ""


def _apply(cur: MachineHealth | None, ev: Event) -> tuple[MachineHealth, int | None]:
    """``cur`` (None: not watched yet) after ``ev``, one machine's event of ``APPLIED`` (``apply_all`` filters), and
    the time it came back UP if it did (its silence counts from then at the latest)."""
    ts = ev.timestamp_ms
    dc = _dc(ev)
    if cur is None:  # watched from the first event about it, whichever partition brings it first
        cur = MachineHealth(machine_id=ev.payload["machine_id"], owner_key=_owner_key(ev), owner_ms=ts, dc=dc)
    elif dc and dc != cur.dc:
        cur = replace(cur, dc=dc)
    # A machine's events change partitions with its owner, so they may be read out of their order (a restart
    # reads every partition at once): an owner or status older than the one held changes nothing (newest wins).
    # Before, a restarted health check that read an old assignment after a newer one keyed its verdicts on the
    # machine to the old owner's partition.
    if ev.type == "MachineStatusChanged":
        status = ev.payload["status"]
        if ts < cur.status_ms:
            return cur, None  # older than the status held (e.g. our own verdict, overtaken by a heartbeat)
        back_up = ts if status == UP and cur.status != UP else None
        moved = ev.entitlement != cur.owner_key and ts >= cur.owner_ms  # a status event carries its owner's key
        owner = (ev.entitlement, ts) if moved else (cur.owner_key, cur.owner_ms)
        return replace(cur, status=status, status_ms=ts, owner_key=owner[0], owner_ms=owner[1],
                       status_reason=ev.payload.get("reason", "")), back_up
    if ev.type == "MachineAssignedToEntitlement":
        return (replace(cur, owner_key=ev.entitlement, owner_ms=ts) if ts >= cur.owner_ms else cur), None
    if ev.type == "MachineReleasedToFreePool":
        ok = cur.owner_key == ev.entitlement and ts >= cur.owner_ms
        return (replace(cur, owner_key=_owner_key(ev), owner_ms=ts) if ok else cur), None
    return cur, None  # MachineRegistered: watched from its registration; a re-registration changes nothing here


APPLIED = frozenset({"MachineRegistered", "MachineStatusChanged", "MachineAssignedToEntitlement",
                     "MachineReleasedToFreePool", MACHINES_STATUS_CHANGED, MACHINES_REGISTERED})


def on_machine_event(state: HealthState, event: Event) -> HealthState:
    """Fold one event of the ``machines`` topic (others change nothing). Applying it twice changes nothing more."""
    return apply_all(state, (event,))


def _per_machine(events: Iterable[Event]) -> Iterable[Event]:
    """The events with each MachinesStatusChanged as a MachineStatusChanged per machine, and each MachinesRegistered as
    a MachineRegistered per machine (same key, time, id)."""
    for ev in events:
        if ev.type == MACHINES_REGISTERED:
            for p in ev.payload["machines"]:
                yield Event(type="MachineRegistered", entitlement=ev.entitlement, entity_id=p["machine_id"], payload=p,
                            producer=ev.producer, causation_id=ev.causation_id, timestamp_ms=ev.timestamp_ms,
                            event_id=ev.event_id)
            continue
        if ev.type != MACHINES_STATUS_CHANGED:
            yield ev
            continue
        for m in batches.machine_statuses(ev):
            yield Event(type="MachineStatusChanged", entitlement=ev.entitlement, entity_id=m["machine_id"],
                        payload=m, producer=ev.producer, causation_id=ev.causation_id,
                        timestamp_ms=ev.timestamp_ms, event_id=ev.event_id)


def apply_all(state: HealthState, events: Iterable[Event]) -> HealthState:
    """Fold many machine events in one step (one copy of the touched shards). A machine is watched from its first
    event (its silence counts from that event's time), and its silence counts anew from its return to UP."""
    changes: dict[str, MachineHealth] = {}
    watch: dict[str, int] = {}  # machine -> since when it is watched (its first event)
    back_up: dict[str, int] = {}  # machine -> when it came back UP
    for ev in _per_machine(events):
        if ev.type not in APPLIED:
            continue
        mid = ev.payload["machine_id"]
        cur = changes[mid] if mid in changes else state.machines.get(mid)
        if cur is None and mid not in watch:
            watch[mid] = ev.timestamp_ms
        new, up_at = _apply(cur, ev)
        if up_at is not None:
            back_up[mid] = max(back_up.get(mid, up_at), up_at)
        if new != cur:
            changes[mid] = new
    heard = state.heard.watched(watch)
    if back_up:
        seen = {}
        for mid, ts in back_up.items():
            i = heard.slot(mid)
            if i is not None and ts > heard.seen[i]:
                seen[i] = ts
        heard = heard.heard(seen, {})
    return state._with(changes, heard)


# -- heartbeats ------------------------------------------------------------------------------------------------

def beat_of(heartbeat: Event) -> Beat:
    """The ``Beat`` of an AgentHeartbeat (HealthError for any other event)."""
    if heartbeat.type != "AgentHeartbeat":
        raise HealthError(f"expected an AgentHeartbeat, got {heartbeat.type}")
    p = heartbeat.payload
    return Beat(p["machine_id"], heartbeat.timestamp_ms, p.get("sequence", 0), heartbeat.event_id)


def from_the_future(heartbeat: Event | Beat, now_ms: int, skew_ms: int = MAX_CLOCK_SKEW_MS) -> bool:
    """Whether ``heartbeat`` (decoded or skimmed) is dated further ahead of ``now_ms`` than ``skew_ms`` (refused:
    HB_FROM_THE_FUTURE)."""
    return heartbeat.timestamp_ms > now_ms + skew_ms


def classify(state: HealthState, heartbeat: Event) -> str:
    """The verdict on ``heartbeat`` (HB_*): whether it counts, and why not."""
    b = beat_of(heartbeat)
    held = state.heard.get(b.machine_id)
    return HB_UNKNOWN_MACHINE if held is None else verdict(held[1], held[0], b.sequence, b.timestamp_ms)


def verdict(last_sequence: int, last_seen_ms: int, sequence: int, timestamp_ms: int) -> str:
    """A heartbeat's verdict against the last one counted of its machine (HB_*; the machine is watched)."""
    if sequence > last_sequence:
        return HB_ACCEPTED
    if timestamp_ms > last_seen_ms:
        return HB_AGENT_RESTARTED
    return HB_DUPLICATE if sequence == last_sequence else HB_STALE


def _statuses(changes: Iterable[tuple[MachineHealth, str]], reason: str, now_ms: int, id_parts,
              causation_id: str | None, producer: str) -> list[Event]:
    """One MachinesStatusChanged(→ new status) per owner key and new status for ``changes`` (record before, its new
    status; keys and machines sorted; split to at most ``batches.MAX_ITEMS`` machines). An event's id derives from
    ``reason``, its key and ``id_parts(rec)`` of its machines: what it says, not when it is said."""
    groups: dict[tuple[str, str], list[MachineHealth]] = {}
    for rec, status in changes:
        groups.setdefault((rec.owner_key, status), []).append(rec)
    out = []
    for (key, status), group in sorted(groups.items()):
        for part in batches.split(sorted(group, key=lambda h: h.machine_id)):
            out.append(new_event(
                MACHINES_STATUS_CHANGED,
                {"status": status, "reason": reason,
                 "machines": [{"machine_id": h.machine_id, "previous_status": h.status} for h in part]},
                entitlement=key, entity_id=key, producer=producer, causation_id=causation_id, timestamp_ms=now_ms,
                event_id=derived_event_id(PRODUCER, reason, key, *(id_parts(h) for h in part))))
    return out


def _to(h: MachineHealth, trigger: str) -> str:
    """The status ``trigger`` moves ``h`` to (the machines' one table: ``resourcebroker.status``); only called where
    it moves it (raises otherwise: a decision here that the table does not allow)."""
    to = next_status(h.machine_id, h.status, trigger)
    if to is None:
        raise HealthError(f"machine {h.machine_id}: {trigger!r} changes nothing in status {h.status}")
    return to


def on_heartbeat(state: HealthState, heartbeat: Event, *,
                 producer: str = PRODUCER) -> tuple[HealthState, list[Event]]:
    """``on_heartbeats`` of one heartbeat."""
    return on_heartbeats(state, (heartbeat,), producer=producer)


def on_heartbeats(state: HealthState, heartbeats: Iterable[Event], *,
                  producer: str = PRODUCER) -> tuple[HealthState, list[Event]]:
    """``on_beats`` of AgentHeartbeat events."""
    return on_beats(state, [beat_of(hb) for hb in heartbeats], producer=producer)


def on_beats(state: HealthState, beats: Iterable[Beat], *, producer: str = PRODUCER) -> tuple[HealthState, list[Event]]:
    """Record heartbeats, in order (``verdict``: only HB_ACCEPTED and HB_AGENT_RESTARTED count; a machine not
    watched yet, HB_UNKNOWN_MACHINE, is not counted). The machines marked UNHEALTHY that a counted heartbeat newer
    than that verdict resumes are UP again, announced as one MachinesStatusChanged(UNHEALTHY→UP, HEARTBEAT_RESUMED)
    per owner key, at the newest of those heartbeats' times, caused by the first of them; its id derives from the
    machines and their resuming heartbeats. A heartbeat of an UP machine changes only when it was last heard
    (``HealthState.heard``): a few array cells, not its record."""
    heard = state.heard
    slots, seen_of, seq_of = heard.slots, heard.seen, heard.seq
    seen: dict[int, int] = {}  # slot -> last heard, as this poll leaves it
    seq: dict[int, int] = {}
    unhealthy = state.unhealthy
    resumed: dict[str, tuple[MachineHealth, Beat]] = {}  # machine -> (its record before, the heartbeat)
    for b in beats:
        mid, ts, n = b.machine_id, b.timestamp_ms, b.sequence
        i = slots.get(mid)
        if i is None:  # not (yet) seen on the machines topic: HB_UNKNOWN_MACHINE, not counted
            continue
        last_seen = seen[i] if i in seen else seen_of[i]
        last_seq = seq[i] if i in seq else seq_of[i]
        if not (n > last_seq or ts > last_seen):  # HB_DUPLICATE or HB_STALE (``verdict``)
            continue
        seq[i] = n
        if ts > last_seen:
            seen[i] = ts
        if mid in unhealthy and mid not in resumed:
            rec = state.machines[mid]
            if ts > rec.status_ms:
                resumed[mid] = (rec, b)
    heard = heard.heard({i: ts for i, ts in seen.items() if ts != seen_of[i]}, {i: n for i, n in seq.items()
                                                                                 if n != seq_of[i]})
    if not resumed:
        return state._with({}, heard), []
    now = max(b.timestamp_ms for _, b in resumed.values())
    first = next(iter(resumed.values()))[1]
    moved = [(rec, _to(rec, HEARD)) for rec, _ in resumed.values()]
    events = _statuses(moved, HEARTBEAT_RESUMED, now,
                       lambda h: f"{h.machine_id}@{resumed[h.machine_id][1].event_id or resumed[h.machine_id][1].timestamp_ms}",
                       first.event_id or None, producer)
    changes = {rec.machine_id: replace(rec, status=to, status_ms=now, status_reason=HEARTBEAT_RESUMED)
               for rec, to in moved}
    return state._with(changes, heard), events


def heard_while_failed(state: HealthState, beats: Iterable[Beat]) -> dict[str, Beat]:
    """The machines this service failed (DOWN, health_check) that a heartbeat speaks for: one counted against
    ``state`` (``verdict``) and newer than the failure; the first such heartbeat of each (the service recovers them:
    ``resourcebroker.machines_recovered``)."""
    failed = state.failed
    out: dict[str, Beat] = {}
    if not failed:
        return out
    for b in beats:
        if b.machine_id not in failed or b.machine_id in out:
            continue
        held = state.heard.get(b.machine_id)
        rec = state.machines[b.machine_id]
        if (held is not None and verdict(held[1], held[0], b.sequence, b.timestamp_ms) in COUNTED
                and b.timestamp_ms > rec.status_ms):
            out[b.machine_id] = b
    return out


def restart_clocks(state: HealthState, now_ms: int, reason: str) -> HealthState:
    """Every machine's silence counts from ``now_ms`` at the earliest: nobody is judged silent before ``now_ms`` plus
    the timeout (the service (re)started, paused, read heartbeats late, or heard the region again after it was all
    dark: it cannot tell who spoke meanwhile). One field: no machine is rewritten."""
    return replace(state, clocks_from_ms=max(state.clocks_from_ms, now_ms), clocks_reason=reason)


def _member(h: MachineHealth) -> bool:
    """Whether the protection counts the machine in its zone: the statuses this service judges, and the machines it
    failed itself (DOWN by health_check: still silent). DOWN for another reason (an operator, a power loss) and
    MAINTENANCE are the broker's: known to be away, not silent."""
    return h.status in JUDGED or (h.status == DOWN and h.status_reason == REASON_HEALTH_CHECK)


def _failed_here(h: MachineHealth) -> bool:
    """DOWN because this service failed it (still silent)."""
    return h.status == DOWN and h.status_reason == REASON_HEALTH_CHECK


def _silent(state: HealthState, now_ms: int, timeout_ms: int) -> tuple[HealthState, list[MachineHealth]]:
    """The UP machines silent for longer than ``timeout_ms`` at ``now_ms`` (silence counted from their last heartbeat
    or the last ``restart_clocks``, whichever is later), from the silence index (``Liveness.sweep``: what went silent
    since the last tick, not a scan of every machine); the state with the index swept."""
    cut = now_ms - timeout_ms
    heard = state.heard.sweep(cut)
    state = state._with({}, heard)
    if state.clocks_from_ms >= cut:  # the clocks restarted less than a timeout ago: nobody is silent yet
        return state, []
    machines = state.machines
    return state, [h for mid in heard.silent_ids() if moves((h := machines[mid]).status, SILENT)]


def _missed(state: HealthState, judged: list[MachineHealth], now_ms: int,
            producer: str) -> tuple[HealthState, list[Event]]:
    def silence(h: MachineHealth) -> str:
        seen, seq = state.heard.get(h.machine_id) or (0, -1)
        return f"{h.machine_id}@{seen}:{seq}"

    moved = [(h, _to(h, SILENT)) for h in judged]
    events = _statuses(moved, HEARTBEAT_MISSED, now_ms, silence, None, producer)
    return state._with({h.machine_id: replace(h, status=to, status_ms=now_ms, status_reason=HEARTBEAT_MISSED)
                        for h, to in moved}), events


def on_tick(state: HealthState, now_ms: int, timeout_ms: int, *, policy: DisruptionPolicy | None = None,
            producer: str = PRODUCER) -> tuple[HealthState, list[Event]]:
    """Mark UP machines silent for longer than ``timeout_ms`` at ``now_ms`` UNHEALTHY, announced as one
    MachinesStatusChanged(UP→UNHEALTHY, HEARTBEAT_MISSED) per owner key. A machine is reported once per
    silence; an event's id derives from its machines' silences (each one's last heartbeat), so a replayed tick
    that finds the same silences emits the same ids. No scan of the watched machines: the silence index gives the
    ones that went silent (``_silent``). Silence counts from a machine's last heartbeat or from the last
    ``restart_clocks``, whichever is later.

    Without ``policy`` every silent machine is marked. With one (the service's), the protection against mass
    failure (``zones.py``): a tick more than ``timeout_ms`` after the previous one restarts the clocks instead
    (CLOCKS_TICK_GAP: the service was paused or its loop held; it did not hear what was said meanwhile); each
    zone (DC) fails its silent machines at its state's rate, longest silent first; when every zone is in full
    disruption nobody is failed, and when one is heard again the clocks restart (REGION_DISRUPTION_ENDED). A zone
    whose state changes is announced in a ZoneDisruptionChanged keyed free/<dc>."""
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms <= 0:
        raise HealthError(f"timeout_ms must be a positive number of ms, got {timeout_ms!r}")
    if policy is None:
        state, silent = _silent(state, now_ms, timeout_ms)
        state, missed = _missed(state, silent, now_ms, producer)
        return replace(state, last_tick_ms=now_ms), missed
    if state.last_tick_ms and now_ms - state.last_tick_ms > timeout_ms:
        return replace(restart_clocks(state, now_ms, CLOCKS_TICK_GAP), last_tick_ms=now_ms), []
    return _zoned_tick(state, now_ms, timeout_ms, policy, producer, ended=False)


def _zoned_tick(state: HealthState, now_ms: int, timeout_ms: int, policy: DisruptionPolicy, producer: str, *,  # noqa: C901
                ended: bool) -> tuple[HealthState, list[Event]]:
    """``on_tick`` with a policy (``ended``: the region was just heard again; every zone is announced)."""
    # per zone: its machines and those not UP (``zone_sizes``, kept by every change), plus its UP machines silent
    counts: dict[str, list[int]] = {dc: [n, away] for dc, (n, away) in state.zone_sizes.items()}
    candidates: dict[str, list[MachineHealth]] = {}  # dc -> UP machines silent past the timeout
    state, silent = _silent(state, now_ms, timeout_ms)
    for h in silent:
        counts[h.dc][1] += 1
        candidates.setdefault(h.dc, []).append(h)
    states = {dc: z.zone_state(n, s, policy) for dc, (n, s) in counts.items()}
    if states and all(st == z.ZONE_FULL for st in states.values()):
        return _region_disrupted(state, counts, candidates, now_ms, policy, producer)
    if state.region_disrupted:  # heard again after the whole region was dark: every silence counts anew
        state = replace(restart_clocks(state, now_ms, CLOCKS_REGION_DISRUPTION_ENDED), region_disrupted=False)
        return _zoned_tick(state, now_ms, timeout_ms, policy, producer, ended=True)
    events: list[Event] = []
    zones: dict[str, Zone] = {}
    judged: list[MachineHealth] = []
    for dc in sorted(set(states) | set(state.zones)):
        n, s = counts.get(dc, (0, 0))
        st = states.get(dc, z.ZONE_NORMAL)
        old = state.zones.get(dc)
        rate = policy.rate(st, n)
        zone, allowed = z.allowance(old, st, rate, now_ms, policy)
        cand = sorted(candidates.get(dc, ()), key=lambda h: (state.silent_since_ms(h.machine_id), h.machine_id))
        take = cand if allowed is None else cand[:allowed]
        judged += take
        if allowed is not None:
            zone = z.spend(zone, len(take), policy)
        zone = replace(zone, machines=n, silent=s, held=len(cand) - len(take))
        before = old.state if old is not None else z.ZONE_NORMAL
        if before != st or (ended and old is not None):
            events.append(_zone_event(dc, zone, before, False, rate, policy, now_ms,
                                      REGION_DISRUPTION_ENDED if ended else ZONE_STATE_CHANGED, producer))
        if n or st != z.ZONE_NORMAL:
            zones[dc] = zone
    state, missed = _missed(state, judged, now_ms, producer)
    return replace(state, zones=MappingProxyType(zones), last_tick_ms=now_ms), events + missed


def _region_disrupted(state: HealthState, counts: dict[str, list[int]], candidates: dict[str, list[MachineHealth]],
                      now_ms: int, policy: DisruptionPolicy, producer: str) -> tuple[HealthState, list[Event]]:
    """Every zone is in full disruption: nobody is failed; each zone is announced once as the region goes dark."""
    events = []
    zones: dict[str, Zone] = {}
    for dc in sorted(counts):
        n, s = counts[dc]
        old = state.zones.get(dc)
        zone = replace(old or Zone(), state=z.ZONE_FULL, tokens=0.0, tokens_ms=now_ms, machines=n, silent=s,
                       held=len(candidates.get(dc, ())))
        if not state.region_disrupted:
            events.append(_zone_event(dc, zone, old.state if old is not None else z.ZONE_NORMAL, True, 0.0, policy,
                                      now_ms, REGION_DISRUPTION, producer))
        zones[dc] = zone
    return replace(state, zones=MappingProxyType(zones), region_disrupted=True, last_tick_ms=now_ms), events


def _zone_event(dc: str, zone: Zone, before: str, region: bool, rate: float | None, policy: DisruptionPolicy,
                now_ms: int, reason: str, producer: str) -> Event:
    key = free_pool_key(dc)
    return new_event(
        ZONE_DISRUPTION_CHANGED,
        {"dc": dc, "state": zone.state, "previous_state": before, "region_disrupted": region,
         "machines": zone.machines, "silent": zone.silent, "held": zone.held,
         "threshold": float(policy.unhealthy_zone_threshold), "failure_rate_per_s": rate, "reason": reason},
        entitlement=key, entity_id=dc, producer=producer, timestamp_ms=now_ms,
        event_id=derived_event_id(PRODUCER, "zone", dc, before, zone.state, region, reason, now_ms))
