"""Power events as the simulated machines live them. Pure: no I/O, no clock.

A power loss is announced region-wide as an UnavailabilityStarted of kind POWER listing the machines of the fault
domain that lost its power (``ropewalk machine power-loss``; the Resource Broker's ``power_lost``), and its end as the
UnavailabilityEnded of that UE (``power-restore``). The scheduler moves the machines' tasks; the machines themselves
are off: a simulated agent stands for them, so it takes the announcement as the physics (``on_unavailability``):

* UnavailabilityStarted POWER naming machines it simulates → those go dark (``off``): no heartbeats, no reports,
  their tasks gone, commands to them ignored, until
* the UnavailabilityEnded of that same UE names them → they boot again (``on``): a new incarnation, empty, beating.

Other kinds (FAILURE, MAINTENANCE) change nothing here: a failure's machine is dead or not whatever the log says,
and maintenance is the scheduler's to drain. A UE that ends a power loss the machine is not under (another UE,
or one read twice) changes nothing.

**The boomerang** (the seeds' system card: a power UE shut Twine's own control plane down, orphaning everything). A
power UE is meant for the tasks on the machines, not for what runs Ropewalk: the region's workers run under its
supervisor and none of them acts on a power UE for its own host (the process agent does not read them: the machine
it runs — ``local`` in ``ropewalk up`` — is the one that also runs the control plane), so a power loss of the DC
that hosts the control plane leaves the control plane running to bring the region back; only the tasks there are
stopped, by the scheduler (the fence of a lost machine). Tested end to end in tests/integration/test_power.py.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from streams.enums import UnavailabilityKind
from streams.events import Event

KIND_POWER = UnavailabilityKind.POWER
TYPES = frozenset({"UnavailabilityStarted", "UnavailabilityEnded"})  # what an agent reads of `unavailability`


@dataclass(frozen=True)
class PowerState:
    """The simulated machines that are dark: machine id → the POWER UE that turned it off."""

    off: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class PowerChange:
    """What an event does to the machines: those that go dark now, those that boot again now."""

    off: tuple[str, ...] = ()
    on: tuple[str, ...] = ()


def on_unavailability(state: PowerState, event: Event, mine: Callable[[str], bool]) -> tuple[PowerState, PowerChange]:
    """``state`` after ``event`` (an event of the unavailability topic) for the machines ``mine`` accepts, and what
    changed. Idempotent: the same event twice changes nothing more."""
    p = event.payload
    if event.type == "UnavailabilityStarted" and p.get("kind") == KIND_POWER:
        ue = p["unavailability_id"]
        dark = tuple(sorted(m for m in set(p["machine_ids"]) if mine(m) and m not in state.off))
        if not dark:
            return state, PowerChange()
        return PowerState(MappingProxyType({**state.off, **{m: ue for m in dark}})), PowerChange(off=dark)
    if event.type == "UnavailabilityEnded":
        ue = p["unavailability_id"]
        back = tuple(sorted(m for m in set(p["machine_ids"]) if state.off.get(m) == ue))
        if not back:
            return state, PowerChange()
        return (PowerState(MappingProxyType({m: u for m, u in state.off.items() if m not in back})),
                PowerChange(on=back))
    return state, PowerChange()


def to_json(state: PowerState) -> dict[str, str]:
    return dict(sorted(state.off.items()))


def from_json(doc: Mapping[str, str] | None, known: Callable[[str], bool]) -> PowerState:
    return PowerState(MappingProxyType({m: ue for m, ue in (doc or {}).items() if known(m)}))
