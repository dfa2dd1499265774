"""The host profiles an entitlement may declare (Twine §2.6: "we offer 17 host profiles"; here a few). Pure data.

A profile is a set of host settings (sysctl-like name -> value) the machine's agent applies when the machine joins
an entitlement that declares it. ``""`` is the default profile: no customization (every setting a profile may
change back at its default). ``switch_ms`` is how long a switch to it takes on a simulated machine: the P90s of
the paper's Figure 17 where it gives them (CPU Turbo 3.0 s, HugePages 244 s), a few seconds otherwise; simulated
agents multiply it by ``ROPEWALK_PROFILE_SWITCH_SCALE`` (default 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

DEFAULT = ""


@dataclass(frozen=True)
class Profile:
    name: str
    settings: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    switch_ms: int = 3_000
    doc: str = ""


def _p(name: str, switch_ms: int, doc: str, **settings: str) -> Profile:
    return Profile(name, MappingProxyType({k.replace("__", "."): v for k, v in settings.items()}), switch_ms, doc)


PROFILES: Mapping[str, Profile] = MappingProxyType({p.name: p for p in (
    _p(DEFAULT, 2_000, "no customization", vm__nr_hugepages="0", cpu__turbo="off", kernel__sched_autogroup="1"),
    _p("web", 3_000, "web tier: CPU scheduler and network tuning (the paper's +11% web throughput)",
       kernel__sched_migration_cost_ns="5000000", kernel__sched_autogroup="0", net__core__somaxconn="65535",
       net__ipv4__tcp_mem="786432 1048576 1572864"),
    _p("hugepages", 244_000, "explicit 2 MB pages (P90 switch 244 s: fragmentation may need a reboot)",
       vm__nr_hugepages="16384", vm__hugetlb_shm_group="0"),
    _p("turbo", 3_000, "CPU Turbo Boost on (P90 switch 3.0 s)", cpu__turbo="on"),
    _p("cpu-affinity", 5_000, "memcache: NIC IRQs on 12 hyperthreads, the rest for the workers",
       irq__affinity="0-11", cpu__isolated="12-35"),
)})


def known(name: str | None) -> bool:
    return name is None or name in PROFILES


def switch_ms(name: str, scale: float = 1.0) -> int:
    """How long a simulated machine takes to switch to ``name`` (an unknown name: the default's time)."""
    return max(0, round((PROFILES.get(name) or PROFILES[DEFAULT]).switch_ms * scale))
