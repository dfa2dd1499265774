"""Sidekick's decisions: which machines switch host profile now. Pure.

    view = SidekickView()
    view.apply(event, (topic, partition, offset))   # the allocator's sources + HostProfileRequested (tasks)
    events = view.switches(now_ms, max_switching=0.1)    # HostProfileRequested to produce

Twine §2.6: an entitlement has one host profile; every machine it holds gets it, and when a machine moves to
another entitlement Sidekick applies that one's. Here the machine's agent applies it (``agent/hostprofile.py``)
when Sidekick asks, and no task starts on it before (the agent holds the START).

**Which machines.** A machine *wants* a switch when an entitlement holds it, it is UP, its applied profile differs
from its entitlement's (``""`` when the entitlement declares none), no switch of it is in flight, and the switch
to that profile did not fail while this entitlement held it (a failed one is not retried: the machine's tasks go
elsewhere, and the machine is free again once empty).

**At most a fraction at once.** Per entitlement, at most ``max(1, floor(max_switching x machines it holds))``
switches are in flight (requested, not yet answered by HostProfileApplied or HostProfileFailed); the others wait
for the next call. A switch not answered in ``SWITCH_TIMEOUT_MS`` (its agent is gone) no longer counts, and is
asked again. Machines are taken in id order.

**Ids.** A request's id is ``<machine>@v<version>:<profile>``, the machine's version in the fold when asked, and
its event id derives from it: asked again from the same log (a restart), the same request is the same event.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from processors.allocator.fold import MachineRec, RegionFold
from processors.sidekick import catalogue
from streams.enums import MachineStatus
from streams.events import Event, derived_event_id, new_event
from streams.topics import FREE_POOL_OWNER

PRODUCER = "sidekick"
SWITCH_TIMEOUT_MS = 15 * 60_000  # longer than any profile's switch (HugePages: 244 s P90)
DEFAULT_MAX_SWITCHING = 0.1  # ROPEWALK_PROFILE_MAX_SWITCHING: fraction of an entitlement's machines switching at once
EVENT_TYPES = frozenset({"HostProfileRequested", "HostProfileApplied", "HostProfileFailed"})


@dataclass(frozen=True)
class InFlight:
    request_id: str
    host_profile: str
    entitlement: str
    at_ms: int


def wanted(fold: RegionFold, m: MachineRec) -> str | None:
    """The profile machine ``m`` should have: its entitlement's (``""`` when it declares none); None when free."""
    if m.entitlement == FREE_POOL_OWNER:
        return None
    return fold.entitlement_fields.get(m.entitlement, {}).get("host_profile") or catalogue.DEFAULT


def limit(held: int, max_switching: float) -> int:
    """How many of an entitlement's ``held`` machines may switch at once."""
    return max(1, math.floor(max_switching * held))


class SidekickView:
    def __init__(self) -> None:
        self.fold = RegionFold()
        self.in_flight: dict[str, InFlight] = {}  # machine -> its switch asked and not answered

    def apply(self, event: Event, position: tuple[str, int, int] | None) -> bool:
        if position is not None:
            last = self.fold.marks.get((position[0], position[1]))
            if last is not None and position[2] <= last:
                return False
        p = event.payload
        if event.type == "HostProfileRequested":
            self.in_flight[p["machine_id"]] = InFlight(p["request_id"], p["host_profile"], event.entitlement,
                                                       event.timestamp_ms)
        elif event.type in ("HostProfileApplied", "HostProfileFailed"):
            cur = self.in_flight.get(p["machine_id"])
            if cur is not None and (p.get("request_id") in (None, cur.request_id)):
                del self.in_flight[p["machine_id"]]
        return self.fold.apply(event, position)

    def switches(self, now_ms: int, max_switching: float = DEFAULT_MAX_SWITCHING) -> list[Event]:  # noqa: C901
        """The HostProfileRequested to send now (they are applied to the view at once: in flight)."""
        for mid in [m for m, f in self.in_flight.items() if now_ms - f.at_ms >= SWITCH_TIMEOUT_MS]:
            del self.in_flight[mid]
        fold = self.fold
        held: dict[str, list[MachineRec]] = defaultdict(list)
        for m in fold.machines.values():
            if m.entitlement != FREE_POOL_OWNER:
                held[m.entitlement].append(m)
        busy: dict[str, int] = defaultdict(int)
        for mid, f in self.in_flight.items():
            cur = fold.machines.get(mid)
            if cur is not None and cur.entitlement == f.entitlement:
                busy[f.entitlement] += 1
        out = []
        for ent in sorted(held):
            room = limit(len(held[ent]), max_switching) - busy[ent]
            if room <= 0:
                continue
            for m in sorted(held[ent], key=lambda m: m.id):
                if room <= 0:
                    break
                want = wanted(fold, m)
                if (want is None or m.status != MachineStatus.UP or m.host_profile == want or m.id in self.in_flight
                        or m.profile_failed == (want, ent)):
                    continue
                ev = self._request(m, want, ent, now_ms)
                self.apply(ev, None)
                out.append(ev)
                room -= 1
        return out

    def _request(self, m: MachineRec, profile: str, ent: str, now_ms: int) -> Event:
        rid = f"{m.id}@v{m.version}:{profile}"
        settings = catalogue.PROFILES[profile].settings if profile in catalogue.PROFILES else {}
        return new_event("HostProfileRequested", {
            "request_id": rid, "machine_id": m.id, "host_profile": profile, "previous_host_profile": m.host_profile,
            "settings": dict(settings)}, entitlement=ent, entity_id=m.id, producer=PRODUCER, timestamp_ms=now_ms,
            event_id=derived_event_id(PRODUCER, rid))
