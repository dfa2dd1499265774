"""Mass-failure protection of the Health Check Service: per zone (a DC), how fast silent machines are failed. Pure.

When many machines of a zone fall silent at once, the likelier cause is the control plane or the network between
it and the zone (or the agents falling behind, as in a 100,000-machine bench of issue 25: 4,745 machines judged in
one event, six times in 30 s), not as many machines dying together; evacuating them all at once would move every
task of the zone for nothing. The rules are those of Kubernetes' node lifecycle controller
(``pkg/controller/nodelifecycle``: ``ComputeZoneState``, ``handleDisruption``, ``setLimiterInZone``):

* a zone's **state** (``zone_state``) from its machines the health check judges and how many of them are silent:
  ``FULL_DISRUPTION`` when none is heard, ``PARTIAL_DISRUPTION`` when at least ``min_silent`` are silent and they
  are at least ``unhealthy_zone_threshold`` of the zone (``--unhealthy-zone-threshold``, 0.55), else ``NORMAL``;
* the zone's **rate** of failing silent machines (``DisruptionPolicy.rate``, the table ``RATE_OF_STATE``):
  ``NORMAL`` every silent machine at once (Twine's batching: 1% of a region failing is one event per owner; Kubernetes
  paces even this, at ``--node-eviction-rate``), ``FULL_DISRUPTION`` (the zone alone dark while others are heard:
  most likely really down) ``full_rate_per_s`` (``--node-eviction-rate``'s role), ``PARTIAL_DISRUPTION``
  ``partial_rate_per_s`` (``--secondary-node-eviction-rate``), and nothing at all in a zone of at most
  ``large_zone_size`` machines (``--large-cluster-size-threshold``: a small zone half silent is too ambiguous);
* **every zone in full disruption** (nobody heard anywhere: the health check's own view of the region is cut off):
  nobody is failed; when a machine is heard again the silence clocks of every machine start over (Kubernetes'
  "exiting master disruption mode" resets every node's probe time), so the fleet gets one timeout to speak.

Each zone paces with a token bucket (``Zone``): a new state starts a new bucket holding ``burst`` tokens; it fills at
the state's rate; a machine failed takes a token; what is left over a tick is at most ``burst``. The machines failed
first are the longest silent (then by id).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType

from streams.enums import ZoneState

ZONE_NORMAL = ZoneState.NORMAL
ZONE_PARTIAL = ZoneState.PARTIAL_DISRUPTION
ZONE_FULL = ZoneState.FULL_DISRUPTION

# Which rate of the policy each state fails its silent machines at (None: no limit).
RATE_OF_STATE = MappingProxyType({ZONE_NORMAL: None, ZONE_PARTIAL: "partial_rate_per_s",
                                  ZONE_FULL: "full_rate_per_s"})


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class DisruptionPolicy:
    """The health check's protection against mass failure (defaults: Kubernetes' threshold and sizes; rates sized
    for regions of tens of thousands of machines per DC, where Kubernetes' 0.1 node/s would take days)."""

    unhealthy_zone_threshold: float = 0.55  # share of a zone silent (with at least min_silent) → PARTIAL_DISRUPTION
    full_rate_per_s: float = 10.0  # machines failed per second in a zone fully silent while others are heard
    partial_rate_per_s: float = 1.0  # ... in a partially disrupted zone of more than large_zone_size machines
    large_zone_size: int = 50  # a partially disrupted zone of at most this many machines fails none
    burst: int = 1  # tokens a zone's bucket starts with and keeps at most over a tick
    min_silent: int = 3  # Kubernetes: more than 2 not-ready nodes

    def __post_init__(self):
        if not 0.0 < self.unhealthy_zone_threshold <= 1.0:
            raise PolicyError(f"unhealthy_zone_threshold: expected a share in (0, 1], got {self.unhealthy_zone_threshold!r}")
        for name in ("full_rate_per_s", "partial_rate_per_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or math.isnan(value):
                raise PolicyError(f"{name}: expected a rate >= 0 (machines per second), got {value!r}")
        for name in ("large_zone_size", "burst", "min_silent"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "min_silent" else 0):
                raise PolicyError(f"{name}: expected a whole number >= {1 if name == 'min_silent' else 0}, "
                                  f"got {value!r}")

    def rate(self, state: str, zone_size: int) -> float | None:
        """Machines per second a zone in ``state`` of ``zone_size`` machines fails (None: no limit)."""
        field = RATE_OF_STATE[state]
        if field is None:
            return None
        if state == ZONE_PARTIAL and zone_size <= self.large_zone_size:
            return 0.0
        return float(getattr(self, field))


def zone_state(machines: int, silent: int, policy: DisruptionPolicy) -> str:
    """A zone's state from how many of its judged machines there are and how many are silent."""
    if machines <= 0 or silent <= 0:
        return ZONE_NORMAL
    if silent >= machines:
        return ZONE_FULL
    if silent >= policy.min_silent and silent / machines >= policy.unhealthy_zone_threshold:
        return ZONE_PARTIAL
    return ZONE_NORMAL


@dataclass(frozen=True, slots=True)
class Zone:
    """One zone as the last tick left it: its state, its bucket, and its counts then."""

    state: str = ZONE_NORMAL
    tokens: float = 0.0
    tokens_ms: int = 0  # when the bucket was last filled
    machines: int = 0
    silent: int = 0
    held: int = 0  # silent machines the limit kept from being failed


def allowance(zone: Zone | None, state: str, rate: float | None, now_ms: int, policy: DisruptionPolicy
              ) -> tuple[Zone, int | None]:
    """The zone's bucket at ``now_ms`` in ``state`` and how many machines it lets fail now (None: no limit). A new
    state starts a new bucket of ``burst`` tokens; an old one fills at ``rate`` since it was last filled."""
    if rate is None:
        return replace(zone or Zone(), state=state, tokens=float(policy.burst), tokens_ms=now_ms), None
    if rate <= 0:  # stopped (Kubernetes swaps in a limiter that refuses everything)
        tokens = 0.0
    elif zone is None or zone.state != state:
        tokens = float(policy.burst)
    else:
        tokens = zone.tokens + rate * max(0, now_ms - zone.tokens_ms) / 1000.0
    z = replace(zone or Zone(), state=state, tokens=tokens, tokens_ms=now_ms)
    return z, int(math.floor(tokens + 1e-9))


def spend(zone: Zone, used: int, policy: DisruptionPolicy) -> Zone:
    """The bucket after ``used`` machines were failed: what is left, at most ``burst``."""
    return replace(zone, tokens=min(max(0.0, zone.tokens - used), float(policy.burst)))
