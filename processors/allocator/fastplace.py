"""Placement on an incrementally maintained in-memory index: ``placement.run``'s Plan without its snapshot.

Pure: no I/O, no faust, Kafka or Redis. ``PlacementIndex.run(entitlement, request, held, dc, machine_type)``
returns exactly ``placement.run(snapshot, entitlement, request, held).plan``, where the snapshot is what
``index.MachineIndex.snapshot(dc, machine_type, entitlement)`` reads (the entitlement's machines and the free
pool, narrowed to ``dc`` and ``machine_type`` when given, any status; ``PlacementIndex.snapshot`` builds it),
in time that grows with the request and the bins it can use, not with the region: ``placement.run`` visits
every machine of the snapshot; this visits a few counters per machine group, a sorted list per fault-domain
bin, the request's avoided and ``existing`` machines, and the machines selection actually considers.

**Data structures.** A machine's **group** is (owner, machine type, dc), owner being its entitlement or
``FREE_POOL_ENTITLEMENT`` (None: the free pool). A snapshot is a union of whole groups -- those of the entitlement
and of the free pool whose dc and type match the narrowing -- so everything is kept per group (``_Group``):

* ``ids``: every machine of the group, any status (the snapshot's members); ``down``: how many are not UP;
  ``maint``: how many are UP under a planned maintenance (``Machine.maintenance``);
* ``shapes``: the UP machines not under maintenance (the **open** ones) counted per (cpu_free, mem_free): one
  shape for a group of empty machines, as the free pool's are; at most the entitlement's size for its groups;
* ``lists[level][fault domain]``, at the spread levels finer than a group (msb, rack): the open machines of the
  group in that fault domain as entries ``(cpu_free, machine id, mem_free)``, sorted (by cpu, then id).

``upsert`` and ``remove`` unlink a machine from its old group and link it into its new one, whatever field
changed: two bisections and list inserts/deletes in lists of a rack's and an MSB's size, a counter or two.
``held_count`` is a counter per entitlement.

**Why the filter counts are placement's.** ``filter_machines`` counts a machine under the first of ``FILTERS``
it fails. In FILTERS' order (checked when this module is imported):

1. ``FILTER_STATUS`` rejects exactly the non-UP machines: ``down`` of each snapshot group.
   ``FILTER_MAINTENANCE`` rejects exactly the UP machines under maintenance: ``maint`` of each snapshot group.
2. ``FILTER_AVOIDED`` rejects the open avoided machines: each machine of ``request.avoid_machine_ids`` in the
   snapshot is run through the real FILTERS predicates twice, with and without the avoided filter, and moves
   from the reason it would have without (or from the feasible ones) to the reason it has.
3. The filters in between (other entitlement, machine type, dc) read only a machine's owner, type and dc: its
   group's key. So their FILTERS predicates are evaluated once per group, on a machine of it, and the first
   that fails rejects all the group's open machines (an owner other than the entitlement never occurs in a
   snapshot; the type and dc filters do reject when it is not narrowed, or requirements conflict).
4. In a group they all pass, ``FILTER_CPU`` rejects the UP machines with ``cpu_free < request.cpu``, then
   ``FILTER_MEMORY`` those with ``mem_free < request.mem``: both summed over ``shapes`` (open machines). The rest are
   **feasible**.

The counts are reported in FILTERS' order, zero ones left out, as filter_machines does.

**Why the selection is select()'s.** ``placement.select`` places each task on the minimum, over the feasible
machines that still fit it, of (the bin's task count, not held, cpu_free, id) -- held meaning owned by the
entitlement or added by this plan; free-pool machines take part only while ``len(added) < quota - held``. It
finds that minimum with a lazy heap over the bins' heads (a bin's best candidate), each bin with a heap per
class (held, free pool) of (cpu_free, id). ``_Run.select`` runs the same loop over the same keys; only the
two per-bin heaps are made differently, without visiting the bin's machines:

* a bin's lists are those of the feasible groups at the spread level (one per owner and machine type); at
  spread dc, where a group lies in one bin, all its msb lists. Entries at or after the bisection position of
  ``(request.cpu,)`` fit the cpu; a **cursor** per list walks forward past those whose ``mem_free`` is short
  or that are avoided (they stay unfit: a run changes no list). What is left are exactly the bin's feasible
  machines of that owner, in (cpu_free, id) order;
* the class's heap holds each cursor's current entry: a k-way merge, whose top is the least feasible machine
  of the class -- select()'s queue head. Taking the top moves its cursor on and pushes its next entry;
* the machine a task lands on thus leaves its list, and, while it still fits another task, is pushed into the
  bin's held heap with its working capacity: a free-pool machine that takes a task joins the entitlement.
  That is select()'s re-push into its held queue;
* at spread rack (``POOLED_UNDER``) a region has thousands of bins, most of them without a task of the job:
  opening them all would cost what the region costs. So a rack becomes a bin as above only once it has a task
  (from ``existing``, or the first one placed); the racks without one are reached through a **pool** per MSB,
  the same merge over the MSB's lists, whose top is skipped for good while it lies in a rack with a task.
  All those racks have count 0, so the least of their heads is the least entry, held before free, of the
  pool outside the racks with a task: the pool's head, which enters the lazy heap with count 0. Its key only
  grows, as a bin's does. When it wins, its rack is opened: that rack's own head is the same machine.

When a task finds no candidate, select() stops and reports the quota as hit iff a free-pool queue is not
empty: a feasible free-pool machine this plan did not take, i.e. the feasible free-pool machines outnumber the
ones added. The bins start from ``placement.existing_bins`` over the request's ``existing`` machines that are
in the snapshot, and the Plan is made by ``placement.plan_of``: reasons and messages are placement's.

tests/unit/test_fastplace.py compares ``run`` with ``placement.run`` on ``snapshot`` over seeded random
regions and sequences of plans, status changes, releases and removals; bench/fastplace_rate.py times both.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from types import MappingProxyType
from typing import Self

from processors.allocator import placement
from processors.allocator.placement import (
    FAULT_DOMAIN_OF, FILTER_AVOIDED, FILTER_CPU, FILTER_MAINTENANCE, FILTER_MEMORY, FILTER_STATUS, FILTERS,
    SPREAD_LEVELS,
    Entitlement, Machine, Plan, Request, Selection, existing_bins, plan_of, rank,
)
from streams.enums import MachineStatus
from streams.topics import FREE_POOL_ENTITLEMENT

GroupKey = tuple[str | None, str, str]  # (owner, machine type, dc)
Entry = tuple[int, str, int]  # (cpu_free, machine id, mem_free) of an open machine, ordered by cpu then id
Cursor = list  # [entries, position]: a walk through one sorted list during one run
Predicate = Callable[[Machine], bool]

REASONS = tuple(reason for reason, _ in FILTERS)
# How run() counts each filter (see the module doc). It relies on this order; a change to FILTERS must be
# reflected here, so fail at import rather than count differently from placement.
if (REASONS[:3] != (FILTER_STATUS, FILTER_MAINTENANCE, FILTER_AVOIDED)
        or REASONS[-2:] != (FILTER_CPU, FILTER_MEMORY)):
    raise ImportError("fastplace counts FILTERS as status, maintenance, avoided, <per group>, cpu, memory; "
                      f"FILTERS is {REASONS}")
GROUP_FILTERS = frozenset(REASONS[3:-2])  # decided by a machine's owner, type and dc: once per group

GROUP_LEVEL = "dc"  # a group lies within one fault domain at this level (its key holds the dc)
LIST_LEVELS = tuple(level for level in SPREAD_LEVELS if level != GROUP_LEVEL)  # sorted lists kept per domain
GROUP_LEVEL_LISTS = LIST_LEVELS[0]  # at spread GROUP_LEVEL a bin is all the group's lists at this level
# At these spread levels (many small bins: a region has thousands of racks) the bins without a task of the job
# are searched through their parent's lists instead of one by one; see the module doc.
POOLED_UNDER: Mapping[str, str] = MappingProxyType({"rack": "msb"})
assert set(POOLED_UNDER) | set(POOLED_UNDER.values()) <= set(LIST_LEVELS)


@dataclass(eq=False)
class _Group:
    """The machines of one (owner, machine type, dc); see the module doc."""

    example: Machine  # the machine that made the group: only its owner, type and dc are read (the group's key)
    ids: set[str] = field(default_factory=set)
    down: int = 0
    maint: int = 0
    shapes: Counter[tuple[int, int]] = field(default_factory=Counter)
    lists: dict[str, dict[str, list[Entry]]] = field(default_factory=lambda: {level: {} for level in LIST_LEVELS})


class _Bin:
    """One fault-domain bin (or pool) during one run: per class a heap of (entry, cursor) -- each cursor's
    current entry, or (held) a machine this run placed a task on, with its working capacity and no cursor."""

    __slots__ = ("held", "free")

    def __init__(self) -> None:
        self.held: list[tuple[Entry, Cursor | None]] = []
        self.free: list[tuple[Entry, Cursor | None]] = []

    def add(self, entries: list[Entry], is_free: bool, request: Request) -> None:
        """Take part in the bin with the entries of one list that fit ``request``: a cursor from the first."""
        cursor = [entries, bisect_left(entries, (request.cpu,))]
        if (entry := _fit_from(cursor, request.mem, request.avoid_machine_ids)) is not None:
            heappush(self.free if is_free else self.held, (entry, cursor))


def _fit_from(cursor: Cursor, mem: int, avoid: frozenset[str]) -> Entry | None:
    """The first entry at the cursor's position or after whose memory fits and which is not avoided; the cursor
    moves to it, past the entries skipped (they cannot fit during the run). None at the end of the list."""
    entries, pos = cursor
    n = len(entries)
    while pos < n and (entries[pos][2] < mem or entries[pos][1] in avoid):
        pos += 1
    cursor[1] = pos
    return entries[pos] if pos < n else None


def _first_failing(m: Machine, predicates: Iterable[tuple[str, Predicate]]) -> str | None:
    return next((reason for reason, passes in predicates if not passes(m)), None)


class PlacementIndex:
    """The region's machines, kept for placing requests on them fast; see the module doc."""

    def __init__(self) -> None:
        self._machines: dict[str, Machine] = {}
        self._groups: dict[GroupKey, _Group] = {}
        self._group_keys: dict[str | None, set[GroupKey]] = {}  # per owner
        self._held: Counter[str] = Counter()

    @classmethod
    def of(cls, machines: Iterable[Machine]) -> Self:
        """An index of these machines (ids distinct), built in bulk: entries appended, then each list sorted once
        (the same lists ``upsert`` one by one gives, without an insertion per machine)."""
        index = cls()
        for m in machines:
            index._machines[m.id] = m
            index._link(m, insert=list.append)
        for g in index._groups.values():
            for by_domain in g.lists.values():
                for entries in by_domain.values():
                    entries.sort()
        return index

    # --- maintenance ------------------------------------------------------------------------------------

    def upsert(self, m: Machine) -> None:
        """Add ``m``, or replace the machine of its id (any field may change)."""
        old = self._machines.get(m.id)
        if old is not None:
            self._unlink(old)
        self._machines[m.id] = m
        self._link(m)

    def remove(self, machine_id: str) -> None:
        """Forget a machine; nothing happens if it is not here."""
        m = self._machines.pop(machine_id, None)
        if m is not None:
            self._unlink(m)

    def _link(self, m: Machine, insert: Callable[[list[Entry], Entry], None] = insort) -> None:
        key = (m.entitlement, m.machine_type, m.dc)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(example=m)
            self._group_keys.setdefault(m.entitlement, set()).add(key)
        g.ids.add(m.id)
        if m.entitlement is not FREE_POOL_ENTITLEMENT:
            self._held[m.entitlement] += 1
        if m.status != MachineStatus.UP:
            g.down += 1
            return
        if m.maintenance:
            g.maint += 1
            return
        g.shapes[m.cpu_free, m.mem_free] += 1
        entry = (m.cpu_free, m.id, m.mem_free)
        for level in LIST_LEVELS:
            insert(g.lists[level].setdefault(FAULT_DOMAIN_OF[level](m), []), entry)

    def _unlink(self, m: Machine) -> None:
        key = (m.entitlement, m.machine_type, m.dc)
        g = self._groups[key]
        g.ids.remove(m.id)
        if m.entitlement is not FREE_POOL_ENTITLEMENT:
            self._held[m.entitlement] -= 1
            if not self._held[m.entitlement]:
                del self._held[m.entitlement]
        if m.status != MachineStatus.UP:
            g.down -= 1
        elif m.maintenance:
            g.maint -= 1
        else:
            shape = (m.cpu_free, m.mem_free)
            g.shapes[shape] -= 1
            if not g.shapes[shape]:
                del g.shapes[shape]
            entry = (m.cpu_free, m.id, m.mem_free)
            for level in LIST_LEVELS:
                by_domain = g.lists[level]
                domain = FAULT_DOMAIN_OF[level](m)
                _discard(by_domain[domain], entry)
                if not by_domain[domain]:
                    del by_domain[domain]
        if not g.ids:
            del self._groups[key]
            owned = self._group_keys[m.entitlement]
            owned.discard(key)
            if not owned:
                del self._group_keys[m.entitlement]

    # --- reading ----------------------------------------------------------------------------------------

    def get(self, machine_id: str) -> Machine | None:
        return self._machines.get(machine_id)

    def held_count(self, entitlement: str) -> int:
        """Machines whose entitlement is ``entitlement``, any status."""
        return self._held[entitlement]

    def __len__(self) -> int:
        return len(self._machines)

    def _snapshot_groups(self, entitlement: str, dc: str | None, machine_type: str | None) -> list[GroupKey]:
        """The groups a snapshot consists of: the entitlement's and the free pool's, narrowed."""
        return [key for owner in (entitlement, FREE_POOL_ENTITLEMENT) for key in self._group_keys.get(owner, ())
                if dc in (None, key[2]) and machine_type in (None, key[1])]

    def snapshot(self, entitlement: str, dc: str | None = None,
                 machine_type: str | None = None) -> dict[str, Machine]:
        """What ``MachineIndex.snapshot(dc, machine_type, entitlement)`` reads: the entitlement's machines and
        the free pool, narrowed to ``dc`` and ``machine_type`` when given, any status, by id. O(snapshot)."""
        ids = sorted(mid for key in self._snapshot_groups(entitlement, dc, machine_type)
                     for mid in self._groups[key].ids)
        return {mid: self._machines[mid] for mid in ids}

    # --- placing ----------------------------------------------------------------------------------------

    def run(self, entitlement: Entitlement, request: Request, held_machine_count: int,
            dc: str | None = None, machine_type: str | None = None) -> Plan:
        """``placement.run(self.snapshot(entitlement.name, dc, machine_type), entitlement, request,
        held_machine_count).plan``, without reading the snapshot; see the module doc."""
        keys = set(self._snapshot_groups(entitlement.name, dc, machine_type))
        rejections, feasible_groups, feasible_free = self._filter(keys, entitlement, request)
        on = {mid: m for mid in set(request.existing.values())
              if (m := self._machines.get(mid)) is not None and (m.entitlement, m.machine_type, m.dc) in keys}
        selection = _Run(self._machines, feasible_groups, existing_bins(on, request), entitlement, request,
                         held_machine_count).select(feasible_free)
        return plan_of(selection, entitlement, request, held_machine_count, rejections)

    def _filter(self, keys: set[GroupKey], entitlement: Entitlement,  # noqa: C901
                request: Request) -> tuple[dict[str, int], list[_Group], int]:
        """``filter_machines`` on the snapshot of groups ``keys``: the rejections per reason (in FILTERS' order),
        the groups with feasible machines, and how many feasible machines are in the free pool."""
        predicates = [(reason, passes) for reason, build in FILTERS
                      if (passes := build(entitlement, request)) is not None]
        per_group = [(reason, passes) for reason, passes in predicates if reason in GROUP_FILTERS]
        rejected: Counter[str] = Counter()
        feasible_groups: list[_Group] = []
        feasible_free = 0
        for key in keys:
            g = self._groups[key]
            rejected[FILTER_STATUS] += g.down
            rejected[FILTER_MAINTENANCE] += g.maint
            if (reason := _first_failing(g.example, per_group)) is not None:
                rejected[reason] += len(g.ids) - g.down - g.maint
                continue
            short_cpu = short_mem = feasible = 0
            for (cpu, mem), n in g.shapes.items():
                if cpu < request.cpu:
                    short_cpu += n
                elif mem < request.mem:
                    short_mem += n
                else:
                    feasible += n
            rejected[FILTER_CPU] += short_cpu
            rejected[FILTER_MEMORY] += short_mem
            if feasible:
                feasible_groups.append(g)
                if key[0] is FREE_POOL_ENTITLEMENT:
                    feasible_free += feasible
        if request.avoid_machine_ids:
            unavoided = [(reason, passes) for reason, passes in predicates if reason != FILTER_AVOIDED]
            for mid in request.avoid_machine_ids:
                m = self._machines.get(mid)
                if m is None or (m.entitlement, m.machine_type, m.dc) not in keys:
                    continue
                before, after = _first_failing(m, unavoided), _first_failing(m, predicates)
                if before == after:
                    continue
                assert after is not None  # it fails the avoid-list: a machine that passes both has before == after
                if before is not None:
                    rejected[before] -= 1
                elif m.entitlement is FREE_POOL_ENTITLEMENT:
                    feasible_free -= 1
                rejected[after] += 1
        return {reason: rejected[reason] for reason in REASONS if rejected[reason] > 0}, feasible_groups, feasible_free


class _Run:
    """``placement.select`` on the feasible groups' lists (see the module doc): the state of one run."""

    def __init__(self, machines: dict[str, Machine], feasible_groups: list[_Group], bins: Counter[str],
                 entitlement: Entitlement, request: Request, held_machine_count: int) -> None:
        self.machines, self.groups, self.bins, self.request = machines, feasible_groups, bins, request
        self.domain_of = FAULT_DOMAIN_OF[request.spread]
        self.room = entitlement.quota_machines - held_machine_count
        self.added: list[str] = []
        self.queues: dict[str, _Bin] = {}  # the bins
        self.pools: dict[str, _Bin] = {}  # per parent domain: its bins that have no task yet (POOLED_UNDER)
        spread = request.spread
        if spread in POOLED_UNDER:
            for b in bins:
                self.open(b)
            for g in feasible_groups:
                for parent, entries in g.lists[POOLED_UNDER[spread]].items():
                    in_free_pool = g.example.entitlement is FREE_POOL_ENTITLEMENT
                    self.pools.setdefault(parent, _Bin()).add(entries, in_free_pool, request)
        else:
            for g in feasible_groups:
                lists: Iterable[tuple[str, list[Entry]]]
                if spread in LIST_LEVELS:
                    lists = g.lists[spread].items()
                else:  # the group lies in one bin at this level
                    domain = FAULT_DOMAIN_OF[spread](g.example)
                    lists = ((domain, entries) for entries in g.lists[GROUP_LEVEL_LISTS].values())
                for domain, entries in lists:
                    q = self.queues.get(domain)
                    if q is None:
                        q = self.queues[domain] = _Bin()
                    q.add(entries, g.example.entitlement is FREE_POOL_ENTITLEMENT, request)

    def open(self, b: str) -> _Bin:
        """Bin ``b`` of a pooled level, from its lists: when it gets its first task (or had one already)."""
        q = self.queues[b] = _Bin()
        for g in self.groups:
            if (entries := g.lists[self.request.spread].get(b)) is not None:
                q.add(entries, g.example.entitlement is FREE_POOL_ENTITLEMENT, self.request)
        return q

    def head(self, b: str) -> tuple | None:
        """The bin's best candidate as its ``rank``, or None."""
        q = self.queues[b]
        if q.held:
            entry = q.held[0][0]
            return rank(self.bins[b], False, entry[0], entry[1])
        if q.free and len(self.added) < self.room:
            entry = q.free[0][0]
            return rank(self.bins[b], True, entry[0], entry[1])
        return None

    def pool_head(self, parent: str) -> tuple | None:
        """The best candidate of the parent's bins that have no task: the least of their heads (their count
        is 0), which is the least entry, held first, of the pool's lists outside the bins that have a task.
        Entries of those are skipped for good: a bin's count only grows."""
        q = self.pools[parent]
        for heap, is_free in ((q.held, False), (q.free, True)):
            if is_free and len(self.added) >= self.room:
                return None
            while heap:
                entry, cursor = heap[0]
                assert cursor is not None  # a pool's lists hold cursors only: placed machines are in their bins
                if self.domain_of(self.machines[entry[1]]) not in self.bins:
                    return rank(0, is_free, entry[0], entry[1])
                heappop(heap)
                cursor[1] += 1
                if (following := _fit_from(cursor, self.request.mem, self.request.avoid_machine_ids)) is not None:
                    heappush(heap, (following, cursor))
        return None

    def select(self, feasible_free: int) -> Selection:  # noqa: C901
        """select()'s loop: the bins' (and pools') heads in a lazily updated heap, each task on the best."""
        request, bins, added = self.request, self.bins, self.added
        cpu, mem, avoid = request.cpu, request.mem, request.avoid_machine_ids
        # (*rank, pooled, bin or parent domain)
        tops = [(*h, False, b) for b in self.queues if (h := self.head(b)) is not None]
        tops += [(*h, True, p) for p in self.pools if (h := self.pool_head(p)) is not None]
        heapify(tops)
        cpu_now: dict[str, int] = {}  # the machines this run placed tasks on: their working capacity
        mem_now: dict[str, int] = {}
        placements: list[tuple[str, str]] = []
        unplaced: tuple[str, ...] = ()
        quota_hit = False
        for i, task_id in enumerate(request.task_ids):
            best = None
            while tops:
                top = heappop(tops)
                pooled, name = top[4:]
                now = self.pool_head(name) if pooled else self.head(name)
                if now is None:
                    continue
                if now == top[:4]:
                    best = top
                    break
                heappush(tops, (*now, pooled, name))
            if best is None:
                # a feasible free-pool machine not taken: select()'s free queue not empty
                unplaced, quota_hit = request.task_ids[i:], feasible_free > len(added)
                break
            _, is_free, _, mid, pooled, name = best
            if pooled:  # the machine's bin gets its first task: it leaves the pool
                b = self.domain_of(self.machines[mid])
                q = self.open(b)
            else:
                b, q = name, self.queues[name]
            heap = q.free if is_free else q.held
            entry, cursor = heappop(heap)
            assert entry[1] == mid, "the bin's head is the candidate chosen"
            if cursor is not None:
                cursor[1] += 1
                if (following := _fit_from(cursor, mem, avoid)) is not None:
                    heappush(heap, (following, cursor))
            if is_free:
                added.append(mid)
            cpu_left, mem_left = entry[0] - cpu, entry[2] - mem
            cpu_now[mid], mem_now[mid] = cpu_left, mem_left
            bins[b] += 1
            if cpu_left >= cpu and mem_left >= mem:
                heappush(q.held, ((cpu_left, mid, mem_left), None))
            placements.append((task_id, mid))
            if (h := self.head(b)) is not None:
                heappush(tops, (*h, False, b))
            if pooled and (h := self.pool_head(name)) is not None:
                heappush(tops, (*h, True, name))
        # The working state of the machines this run placed on (select()'s holds every feasible machine's);
        # plan_of reads only its bins.
        state = placement._Round(request=request, cpu_free=cpu_now, mem_free=mem_now, members=set(cpu_now),
                                 bins=bins)
        return Selection(tuple(placements), tuple(added), unplaced, quota_hit, state)


def _discard(entries: list[Entry], entry: Entry) -> None:
    i = bisect_left(entries, entry)
    if i == len(entries) or entries[i] != entry:
        raise KeyError(f"machine {entry[1]} is not in its list: the index is inconsistent")
    del entries[i]
