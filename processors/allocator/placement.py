"""Placement: which machines an allocation request's tasks go to. Pure: no I/O, no faust, Kafka or Redis.

The pipeline (Nomad ``feasible/stack.go``, the Kubernetes scheduler framework), in the order written down in
``FILTERS``, ``SCORES`` and ``run()``:

0. **pin** (``pin()``, before the rest; only for tasks the request gives a target, a ReBalancer move): a task goes
   to its target machine if the machine passes every filter and still fits it (after the tasks pinned before it),
   a free-pool target only while the quota has room; otherwise it is placed by the stages below like any other
   task, and the target's first failing filter is counted as ``target_<reason>``;
1. **filter** each machine of the snapshot through the hard filters, cheapest first; a machine is counted once,
   under the first filter that rejects it, so the event can say why machines were not used;
2. **bin** the feasible machines by fault domain at the request's spread level; in each bin two queues ordered by
   (free cpu, machine id), one of machines the entitlement holds and one of free-pool machines;
3. **select**, one task at a time on a local copy of free capacity, the candidate that ``SCORES`` rank first: a
   candidate must still fit the task, and a free-pool machine may join the entitlement only while its quota has
   room. Only the head of each bin's queues can rank first in its bin (the bin's task count is the same for all
   its machines), so a lazily updated heap over the bins' heads finds the best candidate in O(log bins) instead
   of scoring every machine for every task; the decisions are exactly those of ``min(SCORES)`` over all fitting
   candidates (tests/unit/test_placement.py compares both on seeded random regions).

Every reason is a plain string constant that travels in TasksAllocated / AllocationRejected.

**Where each runs.** The live allocator places with one path only: ``fastplace.PlacementIndex.run`` (through
``RegionFold.place``; ``pin()`` first for targeted tasks), whose plans are ``run()``'s field for field
(tests/unit/test_fastplace.py on seeded random regions; bench/fastplace_rate.py checks every plan it times). ``run()``
and ``select()`` here are the reference: the stages written plainly over a whole snapshot, run by the tests and the
benchmark, never by the live allocator. ``select_scored`` is ``SCORES`` itself (per task, the minimum over every
fitting candidate): the shadow replay's selection for a policy other than the live one (processors/history), and
what tests/unit/test_placement.py checks ``select()`` against.
"""
from __future__ import annotations

from collections import Counter
from heapq import heapify, heappop, heappush
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol

from streams.enums import MachineStatus

# Hard-filter reasons: why a machine of the snapshot cannot take any task of the request.
FILTER_STATUS = "machine_not_up"
FILTER_MAINTENANCE = "machine_in_maintenance"  # a planned maintenance is announced (or running) on it
FILTER_AVOIDED = "avoided"
FILTER_OTHER_ENTITLEMENT = "held_by_other_entitlement"
FILTER_MACHINE_TYPE = "machine_type_mismatch"
FILTER_DC = "dc_mismatch"
FILTER_CPU = "insufficient_cpu"
FILTER_MEMORY = "insufficient_memory"

# Rejection reasons: why (some) tasks of the request were not placed.
NO_FEASIBLE_MACHINE = "no_feasible_machine"
QUOTA_EXCEEDED = "quota_exceeded"
TARGET_REJECTED = "target_"  # + the filter (or QUOTA_EXCEEDED) a task's target failed: counted in filter_rejections
UNKNOWN_TARGET = "unknown_machine"  # a target the region does not have (TARGET_REJECTED + this)

# Commit-time conflicts: why a proposed placement no longer holds on the machine (Nomad plan_apply).
CONFLICT_STATUS = "machine_not_up_at_commit"
CONFLICT_OWNER = "machine_owner_changed"
CONFLICT_CAPACITY = "machine_capacity_changed"
CONFLICT_VERSION = "machine_version_changed"
# ... and a machine the plan adds to its entitlement would take it over its quota: another allocator added machines
# to the entitlement first (two allocators deciding for one entitlement: one moving between partitions).
CONFLICT_QUOTA = "quota_exceeded_at_commit"

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
    maintenance: tuple[str, ...] = ()  # the planned maintenances (unavailability ids) announced and not ended


@dataclass(frozen=True)
class Entitlement:
    """A quota of machines; ``machine_type`` and ``dc_pin`` restrict which machines may join it; ``host_profile``
    is the host profile its machines run (None: the default). One class for the concept: the allocator's fold and
    the scheduler's shard (``processors/scheduler/model.py``) both hold entitlements as these."""

    name: str
    quota_machines: int
    machine_type: str | None = None
    dc_pin: str | None = None
    host_profile: str | None = None


ENTITLEMENT_FIELDS = ("quota_machines", "machine_type", "dc_pin", "host_profile")  # what an EntitlementCreated or
#                                                                                     EntitlementUpdated may set


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
    targets: Mapping[str, str] = field(default_factory=dict)  # task -> the machine it should go to (stage ``pin``)

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
    cache_hit: bool = False  # the job-level allocation cache answered (processors/allocator/cache.py)


class Located(Protocol):
    """What has a place in the region's fault domains: a ``Machine``, the ReBalancer's ``MachineLoad``."""

    @property
    def dc(self) -> str: ...
    @property
    def msb(self) -> str: ...
    @property
    def rack(self) -> str: ...


# The bin of a machine at each spread level (``fault_domain``), as a function: select() calls it per machine.
FAULT_DOMAIN_OF: Mapping[str, Callable[[Located], str]] = MappingProxyType({
    "dc": lambda m: m.dc,
    "msb": lambda m: f"{m.dc}/{m.msb}",
    "rack": lambda m: f"{m.dc}/{m.msb}/{m.rack}",
})


def fault_domain(machine: Machine, level: str) -> str:
    """The bin of ``machine`` at spread ``level``: ``dc``, ``dc/msb`` or ``dc/msb/rack``."""
    return FAULT_DOMAIN_OF[level](machine)


def _by_id(snapshot: Mapping[str, Machine] | Iterable[Machine]) -> dict[str, Machine]:
    return {m.id: m for m in (snapshot.values() if isinstance(snapshot, Mapping) else snapshot)}


def _wanted(*values: str | None) -> Callable[[str], bool] | None:
    """A test that a machine's value equals every wanted value that is set; None when nothing is wanted."""
    wanted = {v for v in values if v is not None}
    if not wanted:
        return None
    if len(wanted) > 1:  # two different requirements: no machine meets both
        return lambda value: False
    (only,) = wanted
    return lambda value: value == only


def _attr_filter(attr: str, *wanted: str | None) -> Callable[[Machine], bool] | None:
    test = _wanted(*wanted)
    return None if test is None else (lambda m: test(getattr(m, attr)))


# A filter builds, for one request, the predicate a machine must pass (True: passes), or None when every
# machine passes (nothing is required), so that a request without requirements costs nothing.
Filter = Callable[[Entitlement, "Request"], Callable[[Machine], bool] | None]

# The hard filters, cheapest first: (reason, predicate builder).
FILTERS: tuple[tuple[str, Filter], ...] = (
    (FILTER_STATUS, lambda e, r: lambda m: m.status == MachineStatus.UP),
    (FILTER_MAINTENANCE, lambda e, r: lambda m: not m.maintenance),
    (FILTER_AVOIDED, lambda e, r: (lambda m: m.id not in r.avoid_machine_ids) if r.avoid_machine_ids else None),
    (FILTER_OTHER_ENTITLEMENT, lambda e, r: lambda m: m.entitlement is None or m.entitlement == e.name),
    (FILTER_MACHINE_TYPE, lambda e, r: _attr_filter("machine_type", r.requirements.get("machine_type"),
                                                    e.machine_type)),
    (FILTER_DC, lambda e, r: _attr_filter("dc", r.requirements.get("dc"), e.dc_pin)),
    (FILTER_CPU, lambda e, r: lambda m: m.cpu_free >= r.cpu),
    (FILTER_MEMORY, lambda e, r: lambda m: m.mem_free >= r.mem),
)


@dataclass
class _Round:
    """The working copy one ``select()`` call updates as it places tasks; never outlives the call."""

    request: Request
    cpu_free: dict[str, int]  # feasible machines only
    mem_free: dict[str, int]
    members: set[str]  # machines in the entitlement, including those this plan adds
    bins: Counter[str]  # the job's tasks per fault domain

    def fits(self, machine_id: str) -> bool:
        return (machine_id in self.cpu_free and self.cpu_free[machine_id] >= self.request.cpu
                and self.mem_free[machine_id] >= self.request.mem)


Score = Callable[[Machine, _Round], object]

# The soft preferences, most important first; lower is better, the machine id makes the order total. select()
# ranks candidates by exactly this key without calling these functions per machine (see the module doc): the
# bin's task count, then machines the entitlement holds before free-pool ones, then the least free cpu left
# (pack), then the id. tests/unit/test_placement.py checks select() against min() over SCORES.
SCORES: tuple[tuple[str, Score], ...] = (
    ("spread", lambda m, w: w.bins[fault_domain(m, w.request.spread)]),
    ("stack_in_entitlement", lambda m, w: m.id not in w.members),
    ("pack", lambda m, w: w.cpu_free[m.id] - w.request.cpu),
    ("machine_id", lambda m, w: m.id),
)


def rank(count: int, from_pool: bool, cpu_free: int, machine_id: str) -> tuple:
    """A candidate's ``SCORES`` key as the selection heaps hold it (``select`` here, ``fastplace``): its bin's task
    count (spread), whether it would join from the free pool (stack in the entitlement), its free cpu (pack: the
    same order as ``SCORES``' free cpu after the task, the task's cpu being the same for all), its id."""
    return (count, from_pool, cpu_free, machine_id)


def filter_machines(machines: Iterable[Machine], entitlement: Entitlement,
                    request: Request) -> tuple[list[Machine], dict[str, int]]:
    """Run ``FILTERS``: the machines that pass all, and the count of rejected machines per first failing reason.

    One pass per filter over the machines still in: a machine is counted under the first filter it fails."""
    remaining = list(machines)
    rejected: dict[str, int] = {}
    for reason, build in FILTERS:
        passes = build(entitlement, request)
        if passes is None:
            continue
        kept = [m for m in remaining if passes(m)]
        if len(kept) < len(remaining):
            rejected[reason] = len(remaining) - len(kept)
        remaining = kept
    return remaining, rejected


def existing_bins(machines: Mapping[str, Machine], request: Request) -> Counter[str]:
    """The job's tasks per fault domain before placing: ``request.existing`` on machines of ``machines`` (the
    snapshot), leaving out the tasks this request places again."""
    placing = set(request.task_ids)
    return Counter(fault_domain(machines[mid], request.spread) for tid, mid in request.existing.items()
                   if tid not in placing and mid in machines)


@dataclass(frozen=True)
class Selection:
    """What ``select()`` decided, and the working state it ended with (free capacity, members, bins)."""

    placements: tuple[tuple[str, str], ...]
    added: tuple[str, ...]
    unplaced: tuple[str, ...]
    quota_hit: bool  # tasks stayed unplaced while a free-pool machine fitted: the quota was full
    state: _Round

    def fits(self, machine_id: str) -> bool:
        """Whether a feasible machine still fits one more task of the request after the selection."""
        return self.state.fits(machine_id)


def select(feasible: Iterable[Machine], bins: Mapping[str, int], entitlement: Entitlement, request: Request,  # noqa: C901
           held_machine_count: int) -> Selection:
    """Place ``request``'s tasks one at a time on the best candidate by ``SCORES`` (see the module doc).

    ``feasible`` passed ``FILTERS``; ``bins`` holds the job's tasks per fault domain already placed."""
    feasible = list(feasible)
    cpu, mem, bin_of = request.cpu, request.mem, FAULT_DOMAIN_OF[request.spread]
    w = _Round(request=request, cpu_free={m.id: m.cpu_free for m in feasible},
               mem_free={m.id: m.mem_free for m in feasible},
               members={m.id for m in feasible if m.entitlement == entitlement.name}, bins=Counter(bins))
    # Per bin: [held queue, free-pool queue], each a heap of (cpu_free, machine id) of machines that fit.
    queues: dict[str, tuple[list, list]] = {}
    members = w.members
    for m in feasible:
        b = bin_of(m)
        q = queues.get(b)
        if q is None:
            q = queues[b] = ([], [])
        q[m.id not in members].append((m.cpu_free, m.id))
    for held_q, free_q in queues.values():
        heapify(held_q)
        heapify(free_q)
    room = entitlement.quota_machines - held_machine_count
    added: list[str] = []

    def head(b: str) -> tuple | None:
        """The bin's best candidate as its ``rank``, or None."""
        held_q, free_q = queues[b]
        if held_q:
            return rank(w.bins[b], False, *held_q[0])
        if free_q and len(added) < room:
            return rank(w.bins[b], True, *free_q[0])
        return None

    # The bins' heads, lazily updated: a bin's key only grows (its count grows when it takes a task, its
    # candidates only shrink), so a popped entry that still equals its bin's head is the best candidate.
    tops = [(*h, b) for b in queues if (h := head(b)) is not None]
    heapify(tops)
    placements: list[tuple[str, str]] = []
    unplaced: tuple[str, ...] = ()
    quota_hit = False
    for i, task_id in enumerate(request.task_ids):
        best = None
        while tops:
            entry = heappop(tops)
            b = entry[-1]
            now = head(b)
            if now is None:
                continue
            if now == entry[:-1]:
                best = (now, b)
                break
            heappush(tops, (*now, b))
        if best is None:
            # later tasks need the same: stop; a fitting machine left means the quota stopped us
            unplaced, quota_hit = request.task_ids[i:], any(hq or fq for hq, fq in queues.values())
            break
        (_, is_free, _, mid), b = best
        held_q, free_q = queues[b]
        heappop(free_q if is_free else held_q)
        if is_free:
            w.members.add(mid)
            added.append(mid)
        w.cpu_free[mid] -= cpu
        w.mem_free[mid] -= mem
        w.bins[b] += 1
        if w.cpu_free[mid] >= cpu and w.mem_free[mid] >= mem:
            heappush(held_q, (w.cpu_free[mid], mid))
        placements.append((task_id, mid))
        if (h := head(b)) is not None:
            heappush(tops, (*h, b))
    return Selection(tuple(placements), tuple(added), unplaced, quota_hit, w)


def plan_of(selection: Selection, entitlement: Entitlement, request: Request, held_machine_count: int,
            rejections: Mapping[str, int]) -> Plan:
    """The Plan of a selection: its placements, and the reason and message when tasks stayed unplaced."""
    unplaced = selection.unplaced
    reason = message = None
    if unplaced:
        counts = f"{len(unplaced)} of {len(request.task_ids)} tasks of job {request.job_id} unplaced"
        if selection.quota_hit:
            reason = QUOTA_EXCEEDED
            message = (f"entitlement {entitlement.name} holds {held_machine_count + len(selection.added)} of "
                       f"{entitlement.quota_machines} machines; raise its quota or free capacity ({counts})")
        else:
            reason = NO_FEASIBLE_MACHINE
            why = ("machines rejected: " + ", ".join(f"{n} {r}" for r, n in rejections.items())
                   if rejections else "the feasible machines are full")
            message = (f"no machine fits a task of {request.cpu}m cpu and {request.mem} MiB"
                       f"{''.join(f', {k}={v}' for k, v in sorted(request.requirements.items()))}"
                       f" ({counts}); {why}")
    return Plan(
        placements=selection.placements,
        machines_added=selection.added,
        filter_rejections=MappingProxyType(dict(rejections)),
        fault_domain_bins=MappingProxyType(dict(sorted(selection.state.bins.items()))),
        unplaced=unplaced,
        reason=reason,
        message=message,
    )


@dataclass(frozen=True)
class Outcome:
    """``run()``'s result: the plan, the machines that passed the filters, and the selection behind the plan."""

    plan: Plan
    feasible: tuple[Machine, ...]
    selection: Selection


def run(snapshot: Mapping[str, Machine] | Iterable[Machine], entitlement: Entitlement, request: Request,
        held_machine_count: int, *, existing_on: Mapping[str, Machine] | None = None,
        rejections: Mapping[str, int] | None = None) -> Outcome:
    """The pipeline: filter -> bin -> select -> plan. ``place()`` is this without the working parts.

    ``existing_on`` (default: the snapshot) holds the machines of ``request.existing`` to count in the spread
    bins; ``rejections`` (default: those the filters count here) are the ones the plan reports. The job-level
    cache passes both: it runs the pipeline over the few machines of a cache entry."""
    machines = _by_id(snapshot)
    feasible, counted = filter_machines(machines.values(), entitlement, request)
    bins = existing_bins(machines if existing_on is None else existing_on, request)
    selection = select(feasible, bins, entitlement, request, held_machine_count)
    plan = plan_of(selection, entitlement, request, held_machine_count, counted if rejections is None else rejections)
    return Outcome(plan, tuple(feasible), selection)


def place(snapshot: Mapping[str, Machine] | Iterable[Machine], entitlement: Entitlement,
          request: Request, held_machine_count: int) -> Plan:
    """Place ``request``'s tasks on ``snapshot``: filter, then per task score and select; see the module doc.

    ``held_machine_count`` is how many machines the entitlement holds now (the snapshot may show only some);
    the plan may add machines from the free pool up to ``entitlement.quota_machines``. Tasks that cannot be
    placed are listed in ``unplaced`` with ``reason`` QUOTA_EXCEEDED (a free machine fitted but the quota is
    full) or NO_FEASIBLE_MACHINE.
    """
    return run(snapshot, entitlement, request, held_machine_count).plan


@dataclass(frozen=True)
class Pinned:
    """What ``pin()`` decided: the tasks placed on their targets, the free-pool targets added, and the targets
    refused per ``TARGET_REJECTED + reason``."""

    placements: tuple[tuple[str, str], ...]
    added: tuple[str, ...]
    rejected: Mapping[str, int]


def pin(targets: Mapping[str, Machine], entitlement: Entitlement, request: Request,
        held_machine_count: int) -> Pinned:
    """Stage 0: each task of ``request.targets`` (in task order) on its target machine (``targets``: the target
    machines as they are), if the machine passes ``FILTERS`` with room for it after the tasks pinned before it;
    a free-pool target joins the entitlement only while its quota has room. See the module doc."""
    checks = [(reason, passes) for reason, build in FILTERS if reason not in (FILTER_CPU, FILTER_MEMORY)
              and (passes := build(entitlement, request)) is not None]
    taken: Counter[str] = Counter()
    placements: list[tuple[str, str]] = []
    added: list[str] = []
    rejected: Counter[str] = Counter()
    for tid in request.task_ids:
        mid = request.targets.get(tid)
        if mid is None:
            continue
        m = targets.get(mid)
        if m is None:
            rejected[TARGET_REJECTED + UNKNOWN_TARGET] += 1
            continue
        why = next((r for r, passes in checks if not passes(m)), None)
        if why is None:
            n = taken[mid] + 1
            if m.cpu_free < n * request.cpu:
                why = FILTER_CPU
            elif m.mem_free < n * request.mem:
                why = FILTER_MEMORY
            elif m.entitlement is None and mid not in added and held_machine_count + len(added) >= \
                    entitlement.quota_machines:
                why = QUOTA_EXCEEDED
        if why is not None:
            rejected[TARGET_REJECTED + why] += 1
            continue
        taken[mid] += 1
        placements.append((tid, mid))
        if m.entitlement is None and mid not in added:
            added.append(mid)
    return Pinned(tuple(placements), tuple(added), MappingProxyType(dict(rejected)))


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
    if machine_now.status != MachineStatus.UP:
        return CONFLICT_STATUS
    if entitlement is not None and machine_now.entitlement not in (None, entitlement):
        return CONFLICT_OWNER
    if machine_now.cpu_free < cpu * n_tasks or machine_now.mem_free < mem * n_tasks:
        return CONFLICT_CAPACITY
    if machine_now.version != expected_version:
        return CONFLICT_VERSION
    return None


# --- policies: the one seam through which placement's preferences change -------------------------------------
# The live allocator places by SCORES (through fastplace, which equals ``run``). A shadow replay
# (processors/history) places recorded requests again under another ``Policy`` and compares the outcomes.

# Preferences a policy may rank by: SCORES' own, and alternatives. Lower is better.
SCORE_CHOICES: Mapping[str, Score] = MappingProxyType({
    **dict(SCORES),
    "least_loaded": lambda m, w: w.request.cpu - w.cpu_free[m.id],  # the most free cpu left first (no packing)
})


@dataclass(frozen=True)
class Policy:
    """How placement ranks candidates: ``scores`` in order (lower first; the machine id is appended when missing,
    so the order is total), and optionally ``spread``, the fault-domain level every request is spread over instead
    of its own. ``LIVE`` is the live allocator's. Filters are not a policy's to change: they are hard facts."""

    name: str = "live"
    scores: tuple[tuple[str, Score], ...] = SCORES
    spread: str | None = None

    def __post_init__(self) -> None:
        if self.spread is not None and self.spread not in SPREAD_LEVELS:
            raise ValueError(f"spread must be one of {SPREAD_LEVELS}, not {self.spread!r}")
        if not self.scores:
            raise ValueError("a policy needs at least one score")
        if all(name != "machine_id" for name, _ in self.scores):
            object.__setattr__(self, "scores", (*self.scores, ("machine_id", SCORE_CHOICES["machine_id"])))

    @property
    def live_scores(self) -> bool:
        """Whether it ranks as the live allocator does (then fastplace can place it, whatever its spread)."""
        return [n for n, _ in self.scores] == [n for n, _ in SCORES] and all(
            f is g for (_, f), (_, g) in zip(self.scores, SCORES))

    @property
    def live(self) -> bool:
        return self.live_scores and self.spread is None

    def request(self, request: Request) -> Request:
        """``request`` as this policy places it (its spread level replaced when the policy sets one)."""
        if self.spread is None or self.spread == request.spread:
            return request
        return replace(request, spread=self.spread)

    def describe(self) -> str:
        return (f"{self.name}: scores {', '.join(n for n, _ in self.scores)}"
                + (f"; spread {self.spread}" if self.spread else ""))


LIVE = Policy()


def select_scored(feasible: Iterable[Machine], bins: Mapping[str, int], entitlement: Entitlement,
                  request: Request, held_machine_count: int, scores: tuple[tuple[str, Score], ...]) -> Selection:
    """``select()`` as the minimum, per task, of ``scores`` over every candidate that still fits (and, for a free-pool
    machine, while the quota has room): what select() computes for SCORES with heaps, for any table of scores.
    O(tasks x feasible machines)."""
    fitting = sorted(feasible, key=lambda m: m.id)
    w = _Round(request=request, cpu_free={m.id: m.cpu_free for m in fitting},
               mem_free={m.id: m.mem_free for m in fitting},
               members={m.id for m in fitting if m.entitlement == entitlement.name}, bins=Counter(bins))
    room = entitlement.quota_machines - held_machine_count
    bin_of = FAULT_DOMAIN_OF[request.spread]
    fns = [fn for _, fn in scores]
    placements: list[tuple[str, str]] = []
    added: list[str] = []
    unplaced: tuple[str, ...] = ()
    quota_hit = False
    for i, task_id in enumerate(request.task_ids):
        fitting = [m for m in fitting if w.fits(m.id)]
        candidates = fitting if len(added) < room else [m for m in fitting if m.id in w.members]
        if not candidates:
            unplaced, quota_hit = request.task_ids[i:], bool(fitting)
            break
        best = min(candidates, key=lambda m: tuple(fn(m, w) for fn in fns))
        if best.id not in w.members:
            w.members.add(best.id)
            added.append(best.id)
        w.cpu_free[best.id] -= request.cpu
        w.mem_free[best.id] -= request.mem
        w.bins[bin_of(best)] += 1
        placements.append((task_id, best.id))
    return Selection(tuple(placements), tuple(added), unplaced, quota_hit, w)


def run_policy(snapshot: Mapping[str, Machine] | Iterable[Machine], entitlement: Entitlement, request: Request,
               held_machine_count: int, policy: Policy) -> Plan:
    """``run()``'s plan under ``policy``: the same filters and plan, the selection by the policy's scores."""
    request = policy.request(request)
    if policy.live_scores:
        return run(snapshot, entitlement, request, held_machine_count).plan
    machines = _by_id(snapshot)
    feasible, counted = filter_machines(machines.values(), entitlement, request)
    selection = select_scored(feasible, existing_bins(machines, request), entitlement, request,
                              held_machine_count, policy.scores)
    return plan_of(selection, entitlement, request, held_machine_count, counted)
