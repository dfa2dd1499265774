"""The job-level allocation cache (Twine §2.3): reuse the candidates of an earlier request of the same shape.

Pure: no I/O. ``index.allocate`` reads the few machines an entry names from Redis and hands them here.

Reading a whole snapshot (every free-pool machine plus the entitlement's) from Redis, then filtering and
ranking it, is the costly part of an allocation. Requests of one **shape** -- entitlement (with its type and
DC pin), cpu, memory, requirements, spread level, avoided machines -- filter the snapshot the same way and rank
it by the same key, so an **entry** keeps, per fault-domain bin and per class (held by the entitlement / free
pool), only the head of that ranking: the machines with the least free cpu (then the lowest id), enough of
them to hold ``HEADROOM`` times the request's tasks. A later request of the same shape -- another job with the
same spec, the same job growing after a resize -- reads only those machines (a few hundred instead of ten
thousand) and runs ``placement.run`` over them. The job, its task count and its placed tasks are not part of
the shape: they change how many tasks go to which bin, which ``lookup`` checks on every hit.

**A hit decides as a full placement would** (but for the free-pool case under *Staleness*). The entry's
machines rank ahead of every machine left out of their bin and class, and selection only ever takes a bin's
best candidate, so a left-out machine could only win once every kept machine of its class and bin stopped
fitting. ``lookup`` checks exactly that after the run: for every (bin, class) with machines left out, some kept
machine still of that class must fit at the end -- or, for free-pool machines left out, a machine the
entitlement held from the start (held machines rank before free ones in a bin). It answers None -- a **miss**: the caller places on the full
snapshot and stores a new entry -- when

* there is no entry for the shape, or it is older than ``max_age_s``                       (absent, expired)
* a kept machine's version differs from the entry's or it is gone; or the entitlement holds another number of
  machines, or its epoch moved (index.py adds every version bump of a machine the entitlement holds to
  ``epoch:<e>``): a machine of the entitlement, kept or not, changed                         (changed)
* the kept machines do not place every task, or could have let a left-out machine win         (insufficient)

so a hit never answers "unplaced": a rejection is always decided on the full snapshot.

**Write-through.** The allocator's own commits change the machines they place on (version, free capacity,
owner) and so the entitlement's epoch. It knows how, so ``AllocationCache.observe_commit`` updates every entry
instead of dropping it: in the committing entitlement's entries (``committed``; only if the epoch right before
the commit is still the entry's, i.e. nothing else changed meanwhile) a kept machine takes its new version --
it only got fuller or joined the entitlement, which never moves it behind a left-out machine -- and a touched
machine the entry did not keep but whose filters it now passes joins it as a non-blocker (it may rank ahead of
kept ones, so it proves nothing about left-out machines); in other entitlements' entries (``without``) the
machines the commit took leave the entry (fewer blockers: never unsound). A commit that conflicts drops the
entry of its shape: the next attempt is a miss. Deallocations are not written through: they move the epoch,
so the entitlement's entries miss once and are rebuilt.

**Staleness.** Free-pool machines outside the entry are not watched (that would mean reading the whole
snapshot, which the cache avoids): a machine registered or released since the entry was built is not
considered until the entry is rebuilt. Such machines are empty, and free-pool machines rank by free cpu, so
they rank behind the kept ones unless they are smaller; one taken by another entitlement meanwhile was not
in the entry, or the entry misses. Either way the cost is a placement another free machine could have served
as well, never an invalid one: a hit still goes through the optimistic commit, which re-checks every machine,
so a stale entry can only cost a retry, never an over-commit. ``max_age_s`` bounds how long an entry can be
stale. A hit's filter rejections are those counted when the entry was built (the event says ``cache_hit``).

Where it lives: in the allocator process (``AllocationCache``, one per ``Allocator``), not in Redis. An entry
is a few hundred machine ids and versions; keeping it in Redis would add a read and a write per request to
save only a rebuild after a restart, and every check that makes a hit safe reads Redis anyway (versions,
held count, epoch, then the commit). Allocator processes do not share entries; each keeps its own.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from processors.allocator import placement
from processors.allocator.placement import Entitlement, Machine, Plan, Request

HEADROOM = 4  # an entry keeps, per bin and class, machines for this many times the request's tasks
MAX_ENTRIES = 1024
MAX_AGE_S = 60.0

Shape = tuple


def shape_of(entitlement: Entitlement, request: Request) -> Shape:
    """What makes two requests filter and rank a snapshot the same way (the cache key). Not the job, the task
    count or the job's placed tasks: those only change how many tasks go where, which ``lookup`` checks."""
    return (entitlement.name, entitlement.machine_type, entitlement.dc_pin, request.cpu, request.mem,
            tuple(sorted(request.requirements.items())), request.spread, tuple(sorted(request.avoid_machine_ids)))


@dataclass(frozen=True)
class Kept:
    """A machine an entry keeps: the version it must still have, its bin, its class when it entered the entry
    (True: in the free pool), and whether it ranked ahead of every machine of that bin and class the entry left
    out (``blocker``: only those prove a left-out machine cannot win; see ``lookup``)."""

    version: int
    bin: str
    free: bool
    blocker: bool = True


@dataclass(frozen=True)
class Entry:
    entitlement: Entitlement  # the shape's entitlement and request (without tasks): to filter machines again
    request: Request
    machines: Mapping[str, Kept]
    truncated: frozenset[tuple[str, bool]]  # (bin, free) classes with machines left out of the entry
    filter_rejections: Mapping[str, int]  # as counted over the snapshot the entry was built from
    held: int  # machines the entitlement holds, as the entry expects
    epoch: int  # the entitlement's epoch (index.py) the entry expects: no machine it holds changed since
    built_at: float  # monotonic seconds


def _tasks_fitting(m: Machine, request: Request) -> int:
    by_cpu = m.cpu_free // request.cpu if request.cpu > 0 else len(request.task_ids) * HEADROOM
    by_mem = m.mem_free // request.mem if request.mem > 0 else len(request.task_ids) * HEADROOM
    return min(by_cpu, by_mem)


def build_entry(feasible: Iterable[Machine], entitlement: Entitlement, request: Request,
                filter_rejections: Mapping[str, int], held: int, epoch: int, now: float,
                headroom: int = HEADROOM) -> Entry:
    """The entry for ``request``'s shape from the machines of a full snapshot that passed the filters: per
    bin and class, the best-ranked machines (least free cpu, then id) that hold ``headroom`` x its tasks.
    ``held`` and ``epoch`` are the entitlement's, read before the snapshot."""
    groups: dict[tuple[str, bool], list[Machine]] = defaultdict(list)
    bin_of = placement.FAULT_DOMAIN_OF[request.spread]
    for m in feasible:
        groups[bin_of(m), m.entitlement != entitlement.name].append(m)
    need = max(1, headroom * len(request.task_ids))
    kept: dict[str, Kept] = {}
    truncated = set()
    for (b, free), ms in groups.items():
        ms.sort(key=lambda m: (m.cpu_free, m.id))
        room = 0
        for m in ms:
            if room >= need:
                truncated.add((b, free))
                break
            kept[m.id] = Kept(m.version, b, free)
            room += _tasks_fitting(m, request)
    return Entry(entitlement, replace(request, task_ids=(), existing={}), MappingProxyType(kept),
                 frozenset(truncated), MappingProxyType(dict(filter_rejections)), held, epoch, now)


def lookup(entry: Entry, machines: Mapping[str, Machine], existing_on: Mapping[str, Machine],
           entitlement: Entitlement, request: Request, held: int, epoch: int) -> Plan | None:
    """The plan of ``request`` over the entry's machines (``machines``: read now, at least the entry's), or
    None when the entry cannot answer (see the module doc). ``existing_on`` holds the machines of the job's
    placed tasks that a full snapshot would hold, for the spread bins; ``held`` and ``epoch`` are the
    entitlement's, read before ``machines``."""
    if held != entry.held or epoch != entry.epoch:
        return None
    now = {}
    for mid, k in entry.machines.items():
        m = machines.get(mid)
        if m is None or m.version != k.version:
            return None
        now[mid] = m
    # The kept machines passed the filters when they had these versions, except those commits filled since
    # (write-through): filtering again drops those; the plan reports the entry's counts.
    out = placement.run(now, entitlement, request, held, existing_on=existing_on, rejections=entry.filter_rejections)
    if out.plan.unplaced:
        return None
    sel = out.selection
    held_from_start = {mid for mid, m in now.items() if m.entitlement == entitlement.name}
    for b, free in entry.truncated:
        if not any(k.bin == b and sel.fits(mid) and (
                # a blocker of the class, still in it, fits: no left-out machine of the class ranked ahead of it
                (k.blocker and k.free == free and (not free or mid not in sel.state.members))
                # left-out free-pool machines also lose to any machine the entitlement held all along
                or (free and mid in held_from_start)) for mid, k in entry.machines.items()):
            return None
    return replace(out.plan, cache_hit=True)


def machines_after(before: Mapping[str, Machine], plan: Plan, entitlement: str, cpu: int, mem: int,
                   versions: Mapping[str, int]) -> dict[str, Machine]:
    """The machines a committed ``plan`` touched, as the commit left them (``before``: as the plan saw them;
    ``versions``: what the commit returned)."""
    n = Counter(mid for _, mid in plan.placements)
    return {mid: replace(before[mid], entitlement=entitlement, cpu_free=before[mid].cpu_free - cpu * n[mid],
                         mem_free=before[mid].mem_free - mem * n[mid], version=v)
            for mid, v in versions.items()}


def committed(entry: Entry, after: Mapping[str, Machine], added: int, epoch_before: int,
              epoch_after: int) -> Entry | None:
    """An entry of the committing entitlement after a commit of this allocator (any shape): ``after`` holds the
    machines it touched as it left them, ``added`` how many joined the entitlement, and the entitlement's epoch
    right before and after it. None when the entry cannot vouch for its ranking any more: something else
    changed a machine of the entitlement since the entry last saw its epoch.

    The touched machines only got fuller or joined the entitlement. A kept one keeps its place (a fuller machine
    ranks only better); one the entry did not keep that now passes its filters joins it as a held machine that
    proves nothing about left-out machines (``blocker`` False) -- it may now rank ahead of kept ones."""
    if epoch_before != entry.epoch:
        return None
    kept = dict(entry.machines)
    bin_of = placement.FAULT_DOMAIN_OF[entry.request.spread]
    new = [m for mid, m in after.items() if mid not in kept]
    feasible, _ = placement.filter_machines(new, entry.entitlement, entry.request)
    for mid, m in after.items():
        if mid in kept:
            kept[mid] = replace(kept[mid], version=m.version)
    for m in feasible:
        kept[m.id] = Kept(m.version, bin_of(m), False, blocker=False)
    return replace(entry, machines=MappingProxyType(kept), held=entry.held + added, epoch=epoch_after)


def without(entry: Entry, taken: Iterable[str]) -> Entry:
    """An entry of another entitlement after a commit took ``taken`` (out of its snapshot: that entitlement
    holds them now). Dropping kept machines never lets a left-out one win unseen: fewer blockers, not more."""
    gone = set(taken) & set(entry.machines)
    if not gone:
        return entry
    return replace(entry, machines=MappingProxyType({mid: k for mid, k in entry.machines.items() if mid not in gone}))


class AllocationCache:
    """Entries by shape, least recently used first out; held by one allocator instance (in memory)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_age_s: float = MAX_AGE_S) -> None:
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._entries: OrderedDict[Shape, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, shape: Shape, now: float) -> Entry | None:
        entry = self._entries.get(shape)
        if entry is None:
            return None
        if now - entry.built_at > self.max_age_s:
            del self._entries[shape]
            return None
        self._entries.move_to_end(shape)
        return entry

    def put(self, shape: Shape, entry: Entry | None) -> None:
        if entry is None:
            self.drop(shape)
            return
        self._entries[shape] = entry
        self._entries.move_to_end(shape)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def drop(self, shape: Shape) -> None:
        self._entries.pop(shape, None)

    def observe_commit(self, entitlement: str, after: Mapping[str, Machine], added: int, epoch_before: int,
                       epoch_after: int) -> None:
        """Write a commit of this allocator through every entry (``committed``/``without``)."""
        for shape, entry in list(self._entries.items()):
            if entry.entitlement.name == entitlement:
                self._entries[shape] = committed(entry, after, added, epoch_before, epoch_after)
                if self._entries[shape] is None:
                    del self._entries[shape]
            else:
                self._entries[shape] = without(entry, after)

    def clear(self) -> None:
        self._entries.clear()
