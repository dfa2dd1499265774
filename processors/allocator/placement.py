"""Placement: which machines an allocation request's tasks go to. Pure: no I/O, no faust, Kafka or Redis.

The pipeline (Nomad ``feasible/stack.go``, the Kubernetes scheduler framework), in the order written down in
``FILTERS``, ``SCORES`` and ``place()``:

1. **filter** each machine of the snapshot through the hard filters, cheapest first; a machine is counted once,
   under the first filter that rejects it, so the event can say why machines were not used;
2. **place tasks one at a time** on a local copy of free capacity: a candidate must still fit the task, and a
   machine from the free pool may join the entitlement only while its quota has room;
3. **score** the candidates (lower is better, compared in ``SCORES`` order) and **select** the best.

Every reason is a plain string constant that travels in TasksAllocated / AllocationRejected.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Hard-filter reasons: why a machine of the snapshot cannot take any task of the request.
FILTER_STATUS = "machine_not_up"
FILTER_AVOIDED = "avoided"
FILTER_OTHER_ENTITLEMENT = "held_by_other_entitlement"
FILTER_MACHINE_TYPE = "machine_type_mismatch"
FILTER_DC = "dc_mismatch"
FILTER_CPU = "insufficient_cpu"
FILTER_MEMORY = "insufficient_memory"

# Rejection reasons: why (some) tasks of the request were not placed.
NO_FEASIBLE_MACHINE = "no_feasible_machine"
QUOTA_EXCEEDED = "quota_exceeded"

# Commit-time conflicts: why a proposed placement no longer holds on the machine (Nomad plan_apply).
CONFLICT_STATUS = "machine_not_up_at_commit"
CONFLICT_OWNER = "machine_owner_changed"
CONFLICT_CAPACITY = "machine_capacity_changed"
CONFLICT_VERSION = "machine_version_changed"

MACHINE_UP = "UP"
SPREAD_LEVELS = ("dc", "msb", "rack")
REQUIREMENT_KEYS = frozenset({"machine_type", "dc"})


@dataclass(frozen=True)
class Machine:
    """A machine as the allocator's index sees it (cpu in millicores, memory in MiB)."""

    id: str
    dc: str
    msb: str
    rack: str
    machine_type: str
    cpu_free: int
    mem_free: int
    cpu_capacity: int
    mem_capacity: int
    entitlement: str | None  # None: in the region's free pool
    status: str
    version: int


@dataclass(frozen=True)
class Entitlement:
    """A quota of machines; ``machine_type`` and ``dc_pin`` restrict which machines may join it."""

    name: str
    quota_machines: int
    machine_type: str | None = None
    dc_pin: str | None = None


@dataclass(frozen=True)
class Request:
    """Place ``task_ids`` of one job, each needing ``cpu`` millicores and ``mem`` MiB.

    ``existing`` maps the job's already placed tasks to their machines, so spreading counts them.
    """

    request_id: str
    job_id: str
    entitlement: str
    task_ids: tuple[str, ...]
    cpu: int
    mem: int
    requirements: Mapping[str, str] = field(default_factory=dict)
    spread: str = "msb"
    avoid_machine_ids: frozenset[str] = frozenset()
    existing: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.spread not in SPREAD_LEVELS:
            raise ValueError(f"spread must be one of {SPREAD_LEVELS}, not {self.spread!r}")
        if unknown := set(self.requirements) - REQUIREMENT_KEYS:
            raise ValueError(f"unsupported requirements {sorted(unknown)}; supported: {sorted(REQUIREMENT_KEYS)}")
        object.__setattr__(self, "task_ids", tuple(self.task_ids))
        object.__setattr__(self, "avoid_machine_ids", frozenset(self.avoid_machine_ids))


@dataclass(frozen=True)
class Plan:
    """The outcome of ``place()``: what to commit, and why, in the fields the result events carry."""

    placements: tuple[tuple[str, str], ...]  # (task_id, machine_id)
    machines_added: tuple[str, ...]  # taken from the free pool into the entitlement
    filter_rejections: Mapping[str, int]  # machines rejected per FILTER_* reason
    fault_domain_bins: Mapping[str, int]  # the job's tasks per fault domain after placement
    unplaced: tuple[str, ...]
    reason: str | None  # None when every task was placed
    message: str | None


def fault_domain(machine: Machine, level: str) -> str:
    """The bin of ``machine`` at spread ``level``: ``dc``, ``dc/msb`` or ``dc/msb/rack``."""
    return "/".join((machine.dc, machine.msb, machine.rack)[: SPREAD_LEVELS.index(level) + 1])


def _by_id(snapshot: Mapping[str, Machine] | Iterable[Machine]) -> dict[str, Machine]:
    return {m.id: m for m in (snapshot.values() if isinstance(snapshot, Mapping) else snapshot)}


def _meets(value: str, *wanted: str | None) -> bool:
    """Whether ``value`` equals every wanted value that is set (None: no requirement)."""
    return all(w in (None, value) for w in wanted)


Filter = Callable[[Machine, Entitlement, Request], bool]

# The hard filters, cheapest first: (reason, predicate that is True when the machine passes).
FILTERS: tuple[tuple[str, Filter], ...] = (
    (FILTER_STATUS, lambda m, e, r: m.status == MACHINE_UP),
    (FILTER_AVOIDED, lambda m, e, r: m.id not in r.avoid_machine_ids),
    (FILTER_OTHER_ENTITLEMENT, lambda m, e, r: m.entitlement in (None, e.name)),
    (FILTER_MACHINE_TYPE, lambda m, e, r: _meets(m.machine_type, r.requirements.get("machine_type"), e.machine_type)),
    (FILTER_DC, lambda m, e, r: _meets(m.dc, r.requirements.get("dc"), e.dc_pin)),
    (FILTER_CPU, lambda m, e, r: m.cpu_free >= r.cpu),
    (FILTER_MEMORY, lambda m, e, r: m.mem_free >= r.mem),
)


@dataclass
class _Round:
    """The working copy one ``place()`` call updates as it places tasks; never outlives the call."""

    request: Request
    cpu_free: dict[str, int]
    mem_free: dict[str, int]
    members: set[str]  # machines in the entitlement, including those this plan adds
    bins: Counter[str]  # the job's tasks per fault domain

    def fits(self, m: Machine) -> bool:
        return self.cpu_free[m.id] >= self.request.cpu and self.mem_free[m.id] >= self.request.mem


Score = Callable[[Machine, _Round], object]

# The soft preferences, most important first; lower is better, the machine id makes the order total.
SCORES: tuple[tuple[str, Score], ...] = (
    ("spread", lambda m, w: w.bins[fault_domain(m, w.request.spread)]),
    ("stack_in_entitlement", lambda m, w: m.id not in w.members),
    ("pack", lambda m, w: w.cpu_free[m.id] - w.request.cpu),
    ("machine_id", lambda m, w: m.id),
)


def filter_machines(machines: Iterable[Machine], entitlement: Entitlement,
                    request: Request) -> tuple[list[Machine], dict[str, int]]:
    """Run ``FILTERS``: the machines that pass all, and the count of rejected machines per first failing reason."""
    feasible, rejected = [], Counter()
    for m in machines:
        reason = next((reason for reason, passes in FILTERS if not passes(m, entitlement, request)), None)
        if reason is None:
            feasible.append(m)
        else:
            rejected[reason] += 1
    return feasible, {reason: rejected[reason] for reason, _ in FILTERS if rejected[reason]}


def place(snapshot: Mapping[str, Machine] | Iterable[Machine], entitlement: Entitlement,
          request: Request, held_machine_count: int) -> Plan:
    """Place ``request``'s tasks on ``snapshot``: filter, then per task score and select; see the module doc.

    ``held_machine_count`` is how many machines the entitlement holds now (the snapshot may show only some);
    the plan may add machines from the free pool up to ``entitlement.quota_machines``. Tasks that cannot be
    placed are listed in ``unplaced`` with ``reason`` QUOTA_EXCEEDED (a free machine fitted but the quota is
    full) or NO_FEASIBLE_MACHINE.
    """
    machines = _by_id(snapshot)
    feasible, rejections = filter_machines(sorted(machines.values(), key=lambda m: m.id), entitlement, request)
    placing = set(request.task_ids)
    w = _Round(
        request=request,
        cpu_free={m.id: m.cpu_free for m in feasible},
        mem_free={m.id: m.mem_free for m in feasible},
        members={m.id for m in feasible if m.entitlement == entitlement.name},
        bins=Counter(fault_domain(machines[mid], request.spread) for tid, mid in request.existing.items()
                     if tid not in placing and mid in machines),
    )
    room = entitlement.quota_machines - held_machine_count
    placements: list[tuple[str, str]] = []
    added: list[str] = []
    unplaced: tuple[str, ...] = ()
    quota_hit = False
    for i, task_id in enumerate(request.task_ids):
        fitting = [m for m in feasible if w.fits(m)]
        candidates = [m for m in fitting if m.id in w.members or len(added) < room]
        if not candidates:
            unplaced, quota_hit = request.task_ids[i:], len(fitting) > 0  # later tasks need the same: stop
            break
        best = min(candidates, key=lambda m: tuple(score(m, w) for _, score in SCORES))
        if best.id not in w.members:
            w.members.add(best.id)
            added.append(best.id)
        w.cpu_free[best.id] -= request.cpu
        w.mem_free[best.id] -= request.mem
        w.bins[fault_domain(best, request.spread)] += 1
        placements.append((task_id, best.id))

    reason = message = None
    if unplaced:
        counts = f"{len(unplaced)} of {len(request.task_ids)} tasks of job {request.job_id} unplaced"
        if quota_hit:
            reason = QUOTA_EXCEEDED
            message = (f"entitlement {entitlement.name} holds {held_machine_count + len(added)} of "
                       f"{entitlement.quota_machines} machines; raise its quota or free capacity ({counts})")
        else:
            reason = NO_FEASIBLE_MACHINE
            why = ("machines rejected: " + ", ".join(f"{n} {r}" for r, n in rejections.items())
                   if rejections else "the feasible machines are full")
            message = (f"no machine fits a task of {request.cpu}m cpu and {request.mem} MiB"
                       f"{''.join(f', {k}={v}' for k, v in sorted(request.requirements.items()))}"
                       f" ({counts}); {why}")
    return Plan(
        placements=tuple(placements),
        machines_added=tuple(added),
        filter_rejections=MappingProxyType(rejections),
        fault_domain_bins=MappingProxyType(dict(sorted(w.bins.items()))),
        unplaced=unplaced,
        reason=reason,
        message=message,
    )


def release(snapshot: Mapping[str, Machine] | Iterable[Machine], entitlement_name: str,
            placements_to_free: Mapping[str, str], cpu: int, mem: int,
            remaining: Mapping[str, int]) -> tuple[str, ...]:
    """The machines to give back to the free pool after freeing ``placements_to_free`` (task_id -> machine_id).

    A machine goes back when the entitlement holds it, ``remaining`` (tasks of the entitlement left on each
    machine) says none is left, and freeing these tasks (``cpu``/``mem`` each) empties it in the snapshot
    taken before the release. Machines the snapshot lacks are kept: their owner cannot be verified.
    """
    machines = _by_id(snapshot)
    freed = Counter(placements_to_free.values())
    return tuple(
        mid for mid in sorted(freed)
        if (m := machines.get(mid)) is not None and m.entitlement == entitlement_name
        and remaining.get(mid, 0) == 0
        and m.cpu_free + freed[mid] * cpu >= m.cpu_capacity and m.mem_free + freed[mid] * mem >= m.mem_capacity
    )


def commit_check(machine_now: Machine, expected_version: int, cpu: int, mem: int, n_tasks: int,
                 *, entitlement: str | None = None) -> str | None:
    """Re-check one machine of a plan at commit time: None if the placement still holds, else a CONFLICT_*.

    The specific causes are checked first (status, owner when ``entitlement`` is given, capacity for
    ``n_tasks`` tasks); a bare version change comes last. Any conflict means: re-plan on a fresh snapshot.
    """
    if machine_now.status != MACHINE_UP:
        return CONFLICT_STATUS
    if entitlement is not None and machine_now.entitlement not in (None, entitlement):
        return CONFLICT_OWNER
    if machine_now.cpu_free < cpu * n_tasks or machine_now.mem_free < mem * n_tasks:
        return CONFLICT_CAPACITY
    if machine_now.version != expected_version:
        return CONFLICT_VERSION
    return None
