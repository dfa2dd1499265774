"""The allocator's region as an in-memory fold of the log. Pure: no faust, Kafka or Redis.

    fold = RegionFold()
    fold.apply(event, (topic, partition, offset))     # every machine, allocation and entitlement event, in log order
    plan = fold.place(entitlement, request)            # placement over the whole region, as placement.run decides
    fold.commit(plan, ...)                             # the allocator's own decision, re-checked machine by machine

What the fold holds is what the allocator needs to decide: every machine (topology, type, capacity, free cpu and
memory, owner, status, host profile, the planned maintenances announced on it, version, the tasks on it), every
placement (task -> machine, with the task's resources), the resources of requests not yet answered, the entitlements
(quota, type, DC pin), and the decisions already on the log (by the request event id that caused them). Each record
of the log is applied at its (topic, partition, offset): an offset at or below the partition's mark changes nothing
(at-least-once redelivery), and every handler is idempotent by content as well, so a fact arriving twice (the
allocator's own decision read back, a decision of another allocator already reloaded) changes nothing.

**The rules** (one table, ``HANDLERS``; they are the rules the Redis index applied with Lua before the fold,
unchanged, so versions and the materialized Redis keys come out the same)::

    MachineRegistered              a new machine joins its DC's free pool, status REGISTERED_STATUS, version 1; a
                                   re-registration updates changed attributes (free capacity follows capacity)
                                   MachinesRegistered     the same, per machine
    MachineStatusChanged           set status                      MachinesStatusChanged  the same, per machine
    UnavailabilityStarted          kind MAINTENANCE: the machines are under that planned maintenance from its
                                   announcement (placement filters them: machine_in_maintenance); other kinds
                                   change nothing here (their status changes do)
    UnavailabilityEnded            the machines are no longer under that maintenance
    HostProfileApplied             set host_profile (and forget a failed switch)
    HostProfileFailed              remember the profile whose switch failed, under the machine's owner then
    MachineAssignedToEntitlement   free pool -> the entitlement, only if the machine is free; the allocator's own
                                   (an echo of its TasksAllocated.machines_added) changes nothing
    MachineReleasedToFreePool      the entitlement -> free pool, only if it still holds the machine and no task
                                   is on it (else the release is stale: the entitlement took it again)
    AllocationRequested            remember cpu/mem of the request's tasks until they are answered
    TasksAllocated                 machines_added join the entitlement (if free); each task not already placed on
                                   its machine is placed there (a task placed elsewhere is moved); answered
    AllocationRejected             the unplaced tasks are answered
    TasksDeallocated               each task placed on the named machine is removed; machines_released go back to
                                   the free pool as for MachineReleasedToFreePool
    EntitlementCreated/Updated     the entitlement's quota, machine type, DC pin, host profile; one that breaks an
                                   intent rule (processors/rules.py, e.g. a negative quota) changes
                                   nothing: the scheduler refused it (IntentRefused); a new host profile changes
                                   the state of every machine it holds (its wanted profile: ``profile_state``)

An event about a machine the fold does not know raises ``UnknownMachineEvent`` and changes nothing (not even the
mark); a TasksAllocated that places a task whose request's resources were never seen raises ``MissingResources``.

**Versions.** A machine's version counts changes: each kind of change one step makes to it (attributes, status, host
profile, maintenance, owner, tasks added, tasks removed) adds one, and a step that changes nothing adds none. So the
allocator's commit and the events that record it bump a machine by the same amount whichever comes first, and two
allocators folding the same log agree on every version (the optimistic commit in Redis compares them).

**Placement** runs on ``fastplace.PlacementIndex``, kept in step with every machine change; its plans equal
``placement.run`` over the snapshot the Redis index used to read (the entitlement's machines and the free pool,
narrowed by DC and machine type), proven by tests/unit/test_fastplace.py and tests/unit/test_fold.py.

**Changes.** Every machine a step changes is remembered in ``changed`` (id -> the event or request that
changed it last) until ``drain_changes`` takes them: the allocator writes them to Redis and publishes their states
to ``state.machines``.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from processors.allocator import placement
from processors.allocator.fastplace import PlacementIndex
from processors.allocator.placement import (
    CONFLICT_CAPACITY, CONFLICT_OWNER, CONFLICT_STATUS, CONFLICT_VERSION, ENTITLEMENT_FIELDS, Entitlement,
    Machine, Plan, Request,
)
from processors import rules
from streams.enums import MachineStatus, UnavailabilityKind
from streams.events import Event
from streams.topics import FREE_POOL_OWNER

# Commit-time conflict: a task of the plan is already placed (a duplicate or replayed request).
CONFLICT_TASK_PLACED = "task_already_placed"
REGISTERED_STATUS = MachineStatus.UP  # status of a newly registered machine until a status change says otherwise
ALLOCATOR_PRODUCER = "allocator"  # the allocator's producer name (decide.PRODUCER is this one)
DECISION_TYPES = frozenset({"TasksAllocated", "AllocationRejected", "TasksDeallocated"})
# What ``adopt`` takes of a machine besides its tasks and status (``MachineIndex.reload``'s fields).
ADOPTED_FIELDS = ("region", "dc", "msb", "rack", "type", "cpu_cap", "mem_cap", "cpu_free", "mem_free", "entitlement",
                  "host_profile", "version", "maintenance")
# A machine's fields in a snapshot's row, between its id and its tasks (``RegionFold.machine_rows``), in order.
ROW_FIELDS = ("region", "dc", "msb", "rack", "type", "cpu_cap", "mem_cap", "cpu_free", "mem_free", "entitlement",
              "status", "host_profile", "version", "maintenance", "profile_failed")
MAX_DECISIONS_REMEMBERED = 200_000  # request ids whose decision the fold has seen (oldest forgotten first)

Position = tuple[str, int, int]  # (physical topic, partition, offset)


class FoldError(RuntimeError):
    """An event the fold cannot apply; nothing was changed (not even the mark)."""


class UnknownMachineEvent(FoldError):
    """An event names a machine whose MachineRegistered the fold has not applied. (The Resource Broker's
    ``UnknownMachine`` is another thing: a request about a machine never registered, refused to its caller.)"""


class MissingResources(FoldError):
    """A TasksAllocated places a task whose AllocationRequested (with its cpu/mem) was not applied."""


@dataclass(slots=True)
class MachineRec:
    """A machine as the fold holds it (mutable, private to the fold; ``machine()`` gives the frozen view)."""

    id: str
    region: str
    dc: str
    msb: str
    rack: str
    type: str
    cpu_cap: int
    mem_cap: int
    cpu_free: int
    mem_free: int
    entitlement: str  # FREE_POOL_OWNER: in the free pool
    status: str
    host_profile: str  # "" = default
    version: int
    tasks: set[str] = field(default_factory=set)
    maintenance: tuple[str, ...] = ()  # planned maintenances (unavailability ids) announced and not ended, sorted
    profile_failed: tuple[str, str] | None = None  # (profile, owner) of the last switch that failed

    def view(self) -> Machine:
        return Machine(id=self.id, dc=self.dc, msb=self.msb, rack=self.rack, machine_type=self.type,
                       cpu_free=self.cpu_free, mem_free=self.mem_free, cpu_capacity=self.cpu_cap,
                       mem_capacity=self.mem_cap, entitlement=self.entitlement or None, status=self.status,
                       version=self.version, maintenance=self.maintenance)

    def fields(self) -> dict[str, Any]:
        """The machine's fields as the Redis index and MachineStatePublished name them."""
        return {"region": self.region, "dc": self.dc, "msb": self.msb, "rack": self.rack, "type": self.type,
                "cpu_cap": self.cpu_cap, "mem_cap": self.mem_cap, "cpu_free": self.cpu_free,
                "mem_free": self.mem_free, "entitlement": self.entitlement, "status": self.status,
                "host_profile": self.host_profile, "version": self.version,
                "maintenance": join_maintenance(self.maintenance)}


def join_maintenance(ids: tuple[str, ...]) -> str:
    """A machine's maintenances as the Redis index stores them: ids joined by ``,`` ("" = none)."""
    return ",".join(ids)


def split_maintenance(value: str | None) -> tuple[str, ...]:
    """``join_maintenance`` read back (None: a machine written before the field existed: none)."""
    return tuple(value.split(",")) if value else ()


@dataclass(slots=True)
class PendingRequest:
    """An AllocationRequested's resources per task, until each task is answered (placed or rejected)."""

    cpu: int
    mem: int
    tasks: set[str]


@dataclass(frozen=True)
class CommitResult:
    ok: bool
    conflicts: Mapping[str, str]  # machine id -> CONFLICT_* (empty when ok)
    versions: Mapping[str, int]  # machine id -> version after the commit (empty on conflict)


class _Step:
    """The kinds of change one step makes per machine (each counts once toward the version)."""

    __slots__ = ("kinds",)

    def __init__(self) -> None:
        self.kinds: dict[str, set[str]] = defaultdict(set)

    def add(self, machine_id: str, kind: str) -> None:
        self.kinds[machine_id].add(kind)


class RegionFold:
    def __init__(self, index: PlacementIndex | None = None,
                 max_decisions: int = MAX_DECISIONS_REMEMBERED) -> None:
        self.machines: dict[str, MachineRec] = {}
        self.statuses: Counter[str] = Counter()  # status -> machines with it (kept by _set and registrations)
        self.placement: dict[str, str] = {}  # task -> machine
        self.job_tasks: dict[str, set[str]] = defaultdict(set)  # job id -> its placed tasks (``<job>/<index>``)
        self.taskres: dict[str, tuple[int, int]] = {}  # task -> (cpu, mem) it holds
        self.requests: dict[str, PendingRequest] = {}  # request id -> resources of its unanswered tasks
        self.entitlements: dict[str, Entitlement] = {}
        self.entitlement_fields: dict[str, dict[str, Any]] = {}  # as EntitlementCreated/Updated set them
        self.marks: dict[tuple[str, int], int] = {}  # (topic, partition) -> last applied offset
        self._index = index  # the placement index: built on first use (see ``index``), then kept in step
        self.changed: dict[str, str] = {}  # machine id -> cause (event or request id) of its last change
        self.decided: OrderedDict[str, None] = OrderedDict()  # request event ids decided on the log
        self.max_decisions = max_decisions
        self.made: OrderedDict[str, None] = OrderedDict()  # decision event ids this fold applied when it made them
        self.unechoed: set[str] = set()  # of those, the ones not read back from the log yet
        self.adopted = 0  # machines taken from the shared index (``adopt``): maybe ahead of the log for good
        self.last_applied: dict[tuple[str, int], tuple[int, str]] = {}  # (topic, partition) -> (offset, event id)
        self.applied = 0  # events applied (not counting marks-only no-ops)

    @property
    def index(self) -> PlacementIndex:
        """The placement index over every machine. Built on first use, in bulk (``PlacementIndex.of``: one sort per
        list), and kept in step with every change from then on: a start folds the whole log before it places
        anything, and a rebuild never places, so neither pays for keeping it while the log is folded."""
        if self._index is None:
            self._index = PlacementIndex.of(m.view() for m in self.machines.values())
        return self._index

    def place_with(self, index: PlacementIndex) -> None:
        """Place from now on with ``index`` (over this fold's machines, kept in step as the built-in one is): a
        shadow's index that ranks by another policy (processors/history)."""
        self._index = index

    def reindex(self, m: MachineRec) -> None:
        """After any change to ``m``: the placement index follows (when it is built)."""
        if self._index is not None:
            self._index.upsert(m.view())

    def read_to(self, topic: str, partition: int, offset: int) -> None:
        """Every record of (topic, partition) up to ``offset`` was read, even those not applied (skipped by type,
        or refused): the mark says so, never moving back."""
        if offset > self.marks.get((topic, partition), -1):
            self.marks[(topic, partition)] = offset

    def adopt(self, machine_id: str, fields: Mapping[str, Any]) -> bool:
        """Take a machine as the shared index holds it (``MachineIndex.reload``: another allocator committed to it
        first, or a journaled decision did): its tasks (``fields["tasks"]``: task -> (cpu, mem)) moved onto it from
        wherever the fold had them, those it no longer holds taken off, its status (the status counts kept) and
        ``ADOPTED_FIELDS``. Not a change read on the log: nothing is marked changed (the index holds it already).
        False when the fold does not know the machine (nothing done)."""
        m = self.machines.get(machine_id)
        if m is None:
            return False
        self.adopted += 1
        tasks = fields["tasks"]
        for t in list(m.tasks):
            if t not in tasks:
                self._unplace(m, t)
        for t, (cpu, mem) in tasks.items():
            cur = self.placement.get(t)
            if cur != machine_id:
                if cur is not None:
                    self._unplace(self.machines[cur], t)
                self._place(m, t, cpu, mem)
        self._set(m, "status", fields["status"])
        for name in ADOPTED_FIELDS:
            setattr(m, name, fields[name])
        self.reindex(m)
        return True

    # -- reading -------------------------------------------------------------------------------------------
    def machine(self, machine_id: str) -> Machine | None:
        m = self.machines.get(machine_id)
        return None if m is None else m.view()

    def held_count(self, entitlement: str) -> int:
        return self.index.held_count(entitlement)

    def entitlement(self, name: str) -> Entitlement | None:
        return self.entitlements.get(name)

    def is_decided(self, request_event_id: str) -> bool:
        return request_event_id in self.decided

    def existing(self, job_id: str) -> dict[str, str]:
        """The job's placed tasks (task ids are ``<job>/<index>``), so spreading counts them."""
        return {t: self.placement[t] for t in self.job_tasks.get(job_id, ())}

    # -- applying the log ----------------------------------------------------------------------------------
    def apply(self, event: Event, position: Position | None) -> bool:
        """Apply ``event`` read at ``position`` (None: not from a partition, e.g. the allocator's own free);
        False if that offset was applied already. Raises FoldError (nothing changed) if it cannot apply."""
        if position is not None:
            tp = (position[0], position[1])
            last = self.marks.get(tp)
            if last is not None and position[2] <= last:
                return False
        handler = HANDLERS.get(event.type)
        if event.event_id in self.made:  # its own decision's echo: applied already
            self.unechoed.discard(event.event_id)
        elif handler is not None:
            handler(self, event)
            self.applied += 1
        if event.type in DECISION_TYPES and event.producer == ALLOCATOR_PRODUCER and event.causation_id:
            self.remember_decided(event.causation_id)
        if position is not None:
            tp = (position[0], position[1])
            self.marks[tp] = position[2]
            self.last_applied[tp] = (position[2], event.event_id)
        return True

    @property
    def as_logged(self) -> bool:
        """Whether the fold holds what a fold of the log up to its marks would: every decision it applied as it made
        it has been read back since, and it took no machine from the shared index (``adopt``: another allocator's
        commit, whose events may never reach the log if that allocator died before producing them; the request is
        then decided again from a fold without it, and the journal gives its events back; a snapshot holding the
        commit would place the request's tasks where they already are, and the journal would never be asked: the
        kill storm, stop 43, saw a machine's version in Redis two ahead of the log's). A snapshot is taken only then
        (processors/allocator/snapshot.py); a fold that adopted is as logged again only when folded anew."""
        return not self.unechoed and not self.adopted

    def remember_made(self, events: Iterable[Event]) -> None:
        """These decision events were applied as they were made (``free``/``commit``, or taken back from Redis): their
        echoes from the log change nothing. Before, an echo applied them again, and a TasksAllocated whose task a
        later decision of the same batch had freed put it back on its machine until the free's echo came: a phantom
        placement, and machine versions ahead of the log's (Redis no longer equal to a rebuild; the kill storm)."""
        for e in events:
            self.made[e.event_id] = None
            self.made.move_to_end(e.event_id)
            self.unechoed.add(e.event_id)
            if e.type == "TasksAllocated":  # the request's tasks are answered, as the echo would have said
                self._answer(e.payload["request_id"], [r["task_id"] for r in e.payload["placements"]])
            elif e.type == "AllocationRejected":
                self._answer(e.payload["request_id"], e.payload["unplaced_task_ids"])
        while len(self.made) > 8 * self.max_decisions:
            self.unechoed.discard(self.made.popitem(last=False)[0])

    def remember_decided(self, request_event_id: str) -> None:
        self.decided[request_event_id] = None
        self.decided.move_to_end(request_event_id)
        while len(self.decided) > self.max_decisions:
            self.decided.popitem(last=False)

    def dump(self, consumer: str = "allocator") -> dict[str, Any]:
        """The fold as the Redis index holds it after a projection (index.py's keys, values as strings; empty
        keys absent, as Redis drops them): what tests compare, and what a rebuild writes."""
        out: dict[str, Any] = {}
        for mid, m in self.machines.items():
            out[f"m:{mid}"] = {k: str(v) for k, v in m.fields().items()}
            if m.tasks:
                out[f"tasks:{mid}"] = sorted(m.tasks)
        if self.placement:
            out["placement"] = dict(self.placement)
            out["taskres"] = {t: f"{c} {m}" for t, (c, m) in self.taskres.items()}
        for name, fields in self.entitlement_fields.items():
            out[f"entitlement:{name}"] = {k: "" if v is None else str(v) for k, v in fields.items()}
        held: dict[str, list[str]] = defaultdict(list)
        for mid, m in self.machines.items():
            if m.entitlement != FREE_POOL_OWNER:
                held[m.entitlement].append(mid)
        for name, mids in held.items():  # index.HELD: what the commit checks quotas against
            out[f"held:{name}"] = sorted(mids)
        if self.marks:
            out[f"applied:{consumer}"] = {f"{t}/{p}": str(o) for (t, p), o in self.marks.items()}
        if self.machines:
            out["index:summary"] = {k: str(v) for k, v in self.summary().items()}
        return out

    # -- snapshots (processors/allocator/snapshot.py, and the history's: processors/history/snapshots.py) --------
    def machine_doc(self, m: MachineRec) -> dict[str, Any]:
        """A machine as the history's snapshots keep it (JSON, named fields): ``machine_rows``' row, named."""
        row = self._row(m.id, m)
        return {**dict(zip(ROW_FIELDS, row[1:-1])), "tasks": {t: [cpu, mem] for t, cpu, mem in row[-1]}}

    def restore_machines(self, docs: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """``machine_doc``'s machines back into an empty fold (``restore_rows``); a doc written before host profiles
        has no ``profile_failed``."""
        self.restore_rows([mid, *(doc.get(f) if f == "profile_failed" else doc[f] for f in ROW_FIELDS),
                           [[t, cpu, mem] for t, (cpu, mem) in doc["tasks"].items()]] for mid, doc in docs)

    def machine_rows(self) -> Iterator[list]:
        """Every machine as a row (positional: the allocator's snapshots, processors/allocator/snapshot.py, load 100,000
        machines in 0.2 s where named fields took 1.7), ``restore_rows``'s input."""
        for mid, m in self.machines.items():
            yield self._row(mid, m)

    def _row(self, mid: str, m: MachineRec) -> list:
        """``[id, *ROW_FIELDS, [[task, cpu, mem], ...]]``."""
        return [mid, m.region, m.dc, m.msb, m.rack, m.type, m.cpu_cap, m.mem_cap, m.cpu_free, m.mem_free,
                m.entitlement, m.status, m.host_profile, m.version, list(m.maintenance),
                list(m.profile_failed) if m.profile_failed else None,
                [[t, *self.taskres[t]] for t in sorted(m.tasks)]]

    def restore_rows(self, rows: Iterable[list]) -> None:
        """``machine_rows`` back into an empty fold (their placements with them; the status counts)."""
        machines, placement, taskres, job_tasks = self.machines, self.placement, self.taskres, self.job_tasks
        for (mid, region, dc, msb, rack, type_, cpu_cap, mem_cap, cpu_free, mem_free, owner, status, profile, version,
             maintenance, failed, tasks) in rows:
            machines[mid] = MachineRec(mid, region, dc, msb, rack, type_, cpu_cap, mem_cap, cpu_free, mem_free, owner,
                                       status, profile, version, {t[0] for t in tasks} if tasks else set(), tuple(maintenance),
                                       tuple(failed) if failed else None)
            for t, cpu, mem in tasks:
                placement[t] = mid
                taskres[t] = (cpu, mem)
                job_tasks[t.rpartition("/")[0]].add(t)
        self.statuses = Counter(m.status for m in machines.values())

    def requests_doc(self) -> dict[str, list]:
        return {rid: [r.cpu, r.mem, sorted(r.tasks)] for rid, r in self.requests.items()}

    def restore_requests(self, doc: Mapping[str, Sequence]) -> None:
        for rid, (cpu, mem, tasks) in doc.items():
            self.requests[rid] = PendingRequest(cpu, mem, set(tasks))

    def restore_entitlements(self, doc: Mapping[str, dict[str, Any]]) -> None:
        for name, fields in doc.items():
            self.entitlement_fields[name] = fields
            if (ent := entitlement_of(name, fields)) is not None:
                self.entitlements[name] = ent

    def summary(self) -> dict[str, int]:
        """How many machines the fold holds (``machines``), and per status how many have it."""
        return {"machines": len(self.machines), **{s: n for s, n in self.statuses.items() if n}}

    def drain_changes(self) -> dict[str, str]:
        """The machines changed since the last drain (id -> cause), and forget them."""
        out, self.changed = self.changed, {}
        return out

    # -- the allocator's own decision ----------------------------------------------------------------------
    def check(self, placements: Sequence[tuple[str, str]], machines_added: Iterable[str], entitlement: str,
              cpu: int, mem: int, expected: Mapping[str, int]) -> dict[str, str]:
        """Re-check each machine of a plan against the fold now (placement.commit_check, plus a task already
        placed): machine id -> CONFLICT_* for each that no longer holds; empty when the plan can commit."""
        tasks: dict[str, list[str]] = defaultdict(list)
        for t, mid in placements:
            tasks[mid].append(t)
        added = set(machines_added)
        conflicts = {}
        for mid in sorted(set(tasks) | added):
            m = self.machines.get(mid)
            if m is None or m.status != MachineStatus.UP:
                conflicts[mid] = CONFLICT_STATUS
                continue
            if m.entitlement != (FREE_POOL_OWNER if mid in added else entitlement):
                conflicts[mid] = CONFLICT_OWNER
            elif m.cpu_free < cpu * len(tasks[mid]) or m.mem_free < mem * len(tasks[mid]):
                conflicts[mid] = CONFLICT_CAPACITY
            elif m.version != expected.get(mid, m.version):
                conflicts[mid] = CONFLICT_VERSION
            elif any(t in self.placement for t in tasks[mid]):
                conflicts[mid] = CONFLICT_TASK_PLACED
        return conflicts

    def commit(self, placements: Sequence[tuple[str, str]], machines_added: Iterable[str], entitlement: str,
               cpu: int, mem: int, expected: Mapping[str, int], cause: str) -> CommitResult:
        """The allocator's decision, all or nothing: each machine re-checked, then the machines added join the
        entitlement and the tasks are placed; each machine's version grows by the kinds of change made."""
        conflicts = self.check(placements, machines_added, entitlement, cpu, mem, expected)
        if conflicts:
            return CommitResult(False, conflicts, {})
        step = _Step()
        for mid in machines_added:
            if self._set(self.machines[mid], "entitlement", entitlement):
                step.add(mid, "owner")
        for t, mid in placements:
            self._place(self.machines[mid], t, cpu, mem)
            step.add(mid, "added")
        versions = self._bump(step, cause)
        return CommitResult(True, {}, versions)

    def free(self, event: Event) -> None:
        """Apply the allocator's own TasksDeallocated (a request's free step) before it is produced: the
        request's placement then sees the capacity back. Its echo from the log changes nothing."""
        HANDLERS["TasksDeallocated"](self, event)

    # -- place ---------------------------------------------------------------------------------------------
    def place(self, entitlement: Entitlement, request: Request, *, wide: bool = False) -> Plan:
        """``placement.run`` over the snapshot the request is placed on (``wide``: over the entitlement and the
        whole free pool, not narrowed by DC and machine type: only to explain a NO_FEASIBLE_MACHINE)."""
        dc = None if wide else request.requirements.get("dc") or entitlement.dc_pin
        machine_type = None if wide else request.requirements.get("machine_type") or entitlement.machine_type
        held = self.held_count(entitlement.name)
        if request.targets and not wide:
            return self._place_pinned(entitlement, request, held, dc, machine_type)
        return self.index.run(entitlement, request, held, dc=dc, machine_type=machine_type)

    def _place_pinned(self, entitlement: Entitlement, request: Request, held: int, dc: str | None,
                      machine_type: str | None) -> Plan:
        """``placement.pin`` (the tasks with a target), then the other tasks as ``place`` places them, counting the
        pinned ones in the spread and on the pinned machines' capacity; one Plan of both."""
        targets = {mid: m.view() for mid in set(request.targets.values()) if (m := self.machines.get(mid))}
        pinned = placement.pin(targets, entitlement, request, held)
        on = Counter(mid for _, mid in pinned.placements)
        rest = dataclasses.replace(request, targets={},
                                   task_ids=tuple(t for t in request.task_ids if t not in dict(pinned.placements)),
                                   existing={**request.existing, **dict(pinned.placements)})
        for mid, n in on.items():  # the index sees the pinned tasks (and a pinned free machine as the entitlement's)
            v = targets[mid]
            self.index.upsert(dataclasses.replace(v, cpu_free=v.cpu_free - n * request.cpu,
                                                  mem_free=v.mem_free - n * request.mem,
                                                  entitlement=entitlement.name))
        try:
            plan = self.index.run(entitlement, rest, held + len(pinned.added), dc=dc, machine_type=machine_type)
        finally:
            for mid in on:
                self.reindex(self.machines[mid])
        order = {t: i for i, t in enumerate(request.task_ids)}
        return dataclasses.replace(
            plan, placements=tuple(sorted(pinned.placements + plan.placements, key=lambda p: order[p[0]])),
            machines_added=pinned.added + plan.machines_added,
            filter_rejections=MappingProxyType({**plan.filter_rejections, **pinned.rejected}))

    # -- internals: the rules ------------------------------------------------------------------------------
    def _get(self, machine_id: str) -> MachineRec:
        m = self.machines.get(machine_id)
        if m is None:
            raise UnknownMachineEvent(f"UNKNOWN_MACHINE {machine_id}")
        return m

    def _set(self, m: MachineRec, attr: str, value: Any) -> bool:
        old = getattr(m, attr)
        if old == value:
            return False
        setattr(m, attr, value)
        if attr == "status":
            self.statuses[old] -= 1
            self.statuses[value] += 1
        return True

    def _place(self, m: MachineRec, task: str, cpu: int, mem: int) -> None:
        self.placement[task] = m.id
        self.job_tasks[job_of(task)].add(task)
        self.taskres[task] = (cpu, mem)
        m.tasks.add(task)
        m.cpu_free -= cpu
        m.mem_free -= mem

    def _unplace(self, m: MachineRec, task: str) -> None:
        cpu, mem = self.taskres.pop(task)
        del self.placement[task]
        job = job_of(task)
        tasks = self.job_tasks[job]
        tasks.discard(task)
        if not tasks:
            del self.job_tasks[job]
        m.tasks.discard(task)
        m.cpu_free += cpu
        m.mem_free += mem

    def _releasable(self, m: MachineRec, entitlement: str) -> bool:
        return m.entitlement == entitlement and not m.tasks

    def _answer(self, request_id: str, tasks: Iterable[str]) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        req.tasks.difference_update(tasks)
        if not req.tasks:
            del self.requests[request_id]

    def _bump(self, step: _Step, cause: str) -> dict[str, int]:
        versions = {}
        for mid, kinds in step.kinds.items():
            m = self.machines[mid]
            if kinds:
                m.version += len(kinds)
                self.changed[mid] = cause
            self.reindex(m)
            versions[mid] = m.version
        return versions

    def _touch(self, m: MachineRec, kinds: int, cause: str) -> None:
        if kinds:
            m.version += kinds
            self.changed[m.id] = cause
            self.reindex(m)


# -- the handlers: one per event type (see the table in the module doc) ----------------------------------------

def _registered(f: RegionFold, e: Event) -> None:
    _register(f, e.payload, e.event_id)


def _registrations(f: RegionFold, e: Event) -> None:
    for p in e.payload["machines"]:
        _register(f, p, e.event_id)


def _register(f: RegionFold, p: Mapping[str, Any], cause: str) -> None:
    """The registration ``p`` (a MachineRegistered's payload or an item of a MachinesRegistered) caused by ``cause``."""
    mid, topo = p["machine_id"], p["topology"]
    cpu, mem = p["capacity"]["cpu_millicores"], p["capacity"]["memory_mib"]
    attrs = {"region": topo["region"], "dc": topo["dc"], "msb": topo["msb"], "rack": topo["rack"],
             "type": p["machine_type"], "host_profile": p.get("host_profile") or ""}
    m = f.machines.get(mid)
    if m is None:
        m = f.machines[mid] = MachineRec(id=mid, cpu_cap=cpu, mem_cap=mem, cpu_free=cpu, mem_free=mem,
                                         entitlement=FREE_POOL_OWNER, status=REGISTERED_STATUS, version=1, **attrs)
        f.statuses[REGISTERED_STATUS] += 1
        f.changed[mid] = cause
        f.reindex(m)
        return
    n = sum(f._set(m, a, v) for a, v in attrs.items())
    if m.cpu_cap != cpu or m.mem_cap != mem:
        m.cpu_free += cpu - m.cpu_cap
        m.mem_free += mem - m.mem_cap
        m.cpu_cap, m.mem_cap = cpu, mem
        n += 1
    f._touch(m, min(n, 1), cause)


def _status_changed(f: RegionFold, e: Event) -> None:
    m = f._get(e.payload["machine_id"])
    f._touch(m, int(f._set(m, "status", e.payload["status"])), e.event_id)


def _statuses_changed(f: RegionFold, e: Event) -> None:
    ms = [f._get(row["machine_id"]) for row in e.payload["machines"]]  # every machine known, or nothing changes
    for m in ms:
        f._touch(m, int(f._set(m, "status", e.payload["status"])), e.event_id)


def _maintenance(f: RegionFold, e: Event) -> None:
    """A planned maintenance announced (UnavailabilityStarted of kind MAINTENANCE) or ended (UnavailabilityEnded):
    its machines are under it, or no longer."""
    p = e.payload
    if e.type == "UnavailabilityStarted" and p["kind"] != UnavailabilityKind.MAINTENANCE:
        return
    ms = [f._get(mid) for mid in p["machine_ids"]]  # every machine known, or nothing changes
    ue = p["unavailability_id"]
    for m in ms:
        now = (tuple(sorted({*m.maintenance, ue})) if e.type == "UnavailabilityStarted"
               else tuple(x for x in m.maintenance if x != ue))
        f._touch(m, int(f._set(m, "maintenance", now)), e.event_id)


def _host_profile(f: RegionFold, e: Event) -> None:
    m = f._get(e.payload["machine_id"])
    changed = f._set(m, "host_profile", e.payload["host_profile"] or "")
    changed = f._set(m, "profile_failed", None) or changed
    f._touch(m, int(changed), e.event_id)


def _host_profile_failed(f: RegionFold, e: Event) -> None:
    m = f._get(e.payload["machine_id"])
    f._touch(m, int(f._set(m, "profile_failed", (e.payload["host_profile"] or "", m.entitlement))), e.event_id)


def _assigned(f: RegionFold, e: Event) -> None:
    m = f._get(e.payload["machine_id"])
    if e.producer == ALLOCATOR_PRODUCER:
        return  # an echo of TasksAllocated.machines_added: that event (or the commit) carries the fact
    if m.entitlement == FREE_POOL_OWNER:
        f._touch(m, int(f._set(m, "entitlement", e.entitlement)), e.event_id)


def _released(f: RegionFold, e: Event) -> None:
    m = f._get(e.payload["machine_id"])
    if f._releasable(m, e.entitlement):
        f._touch(m, int(f._set(m, "entitlement", FREE_POOL_OWNER)), e.event_id)


def _requested(f: RegionFold, e: Event) -> None:
    p = e.payload
    tasks = p["place_task_ids"]
    if not tasks:
        return
    res = p["resources"]
    req = f.requests.get(p["request_id"])
    if req is None:
        f.requests[p["request_id"]] = PendingRequest(res["cpu_millicores"], res["memory_mib"], set(tasks))
    else:
        req.cpu, req.mem = res["cpu_millicores"], res["memory_mib"]
        req.tasks.update(tasks)


def _rejected(f: RegionFold, e: Event) -> None:
    f._answer(e.payload["request_id"], e.payload["unplaced_task_ids"])


def _allocated(f: RegionFold, e: Event) -> None:
    p = e.payload
    added = [f._get(mid) for mid in p.get("machines_added") or ()]
    pairs = [(r["task_id"], r["machine_id"]) for r in p["placements"]]
    for _, mid in pairs:
        f._get(mid)
    moving = [(t, mid) for t, mid in pairs if f.placement.get(t) != mid]
    req = f.requests.get(p["request_id"])
    if moving and req is None:
        raise MissingResources(f"MISSING_RESOURCES {p['request_id']}")
    step = _Step()
    for m in added:
        if m.entitlement == FREE_POOL_OWNER and f._set(m, "entitlement", e.entitlement):
            step.add(m.id, "owner")
    for t, mid in moving:
        cur = f.placement.get(t)
        if cur is not None:
            f._unplace(f.machines[cur], t)
            step.add(cur, "removed")
        assert req is not None  # checked above: a task moves only with its request's resources
        f._place(f.machines[mid], t, req.cpu, req.mem)
        step.add(mid, "added")
    f._answer(p["request_id"], [t for t, _ in pairs])
    f._bump(step, e.event_id)


def _deallocated(f: RegionFold, e: Event) -> None:
    p = e.payload
    released = [f._get(mid) for mid in p.get("machines_released") or ()]
    step = _Step()
    for r in p["placements"]:
        t, mid = r["task_id"], r["machine_id"]
        if f.placement.get(t) == mid:
            f._unplace(f.machines[mid], t)
            step.add(mid, "removed")
    for m in released:
        if f._releasable(m, e.entitlement) and f._set(m, "entitlement", FREE_POOL_OWNER):
            step.add(m.id, "owner")
    f._bump(step, e.event_id)


def _entitlement(f: RegionFold, e: Event) -> None:
    if rules.intent_problems(e.type, e.payload, e.entitlement):
        return  # refused by the scheduler: never held
    name = e.entitlement
    given = {k: e.payload.get(k) for k in ENTITLEMENT_FIELDS}
    if e.type == "EntitlementCreated":
        fields = {k: "" if v is None else v for k, v in given.items()}
    else:
        fields = {**f.entitlement_fields.get(name, {}), **{k: v for k, v in given.items() if v is not None}}
    before = f.entitlement_fields.get(name, {}).get("host_profile") or ""
    f.entitlement_fields[name] = fields
    if (fields.get("host_profile") or "") != before:  # its machines want another profile: their state changed
        for m in f.machines.values():
            if m.entitlement == name:
                f._touch(m, 1, e.event_id)
    ent = entitlement_of(name, fields)
    if ent is None:
        f.entitlements.pop(name, None)
    else:
        f.entitlements[name] = ent


def entitlement_of(name: str, fields: Mapping[str, Any]) -> Entitlement | None:
    """The Entitlement from its fields (None when no quota was ever set: not created)."""
    if fields.get("quota_machines") in (None, ""):
        return None
    return Entitlement(name, int(fields["quota_machines"]), machine_type=fields.get("machine_type") or None,
                       dc_pin=fields.get("dc_pin") or None, host_profile=fields.get("host_profile") or None)


HANDLERS: Mapping[str, Callable[[RegionFold, Event], None]] = {
    "MachineRegistered": _registered,
    "MachinesRegistered": _registrations,
    "MachineStatusChanged": _status_changed,
    "MachinesStatusChanged": _statuses_changed,
    "UnavailabilityStarted": _maintenance,
    "UnavailabilityEnded": _maintenance,
    "HostProfileApplied": _host_profile,
    "HostProfileFailed": _host_profile_failed,
    "MachineAssignedToEntitlement": _assigned,
    "MachineReleasedToFreePool": _released,
    "AllocationRequested": _requested,
    "AllocationRejected": _rejected,
    "TasksAllocated": _allocated,
    "TasksDeallocated": _deallocated,
    "EntitlementCreated": _entitlement,
    "EntitlementUpdated": _entitlement,
}
EVENT_TYPES = frozenset(HANDLERS)


# -- the order a log is folded in -------------------------------------------------------------------------------

_RANK_REGISTERED, _RANK_INTENTS, _RANK_ALLOCATIONS, _RANK_MACHINES = range(4)


def _rank(event_type: str) -> int:
    """Within one millisecond: a machine exists before anything names it; then intents, then allocations, then
    the other machine events (an allocator decision's echoes carry its TasksAllocated's time and follow it)."""
    if event_type in ("MachineRegistered", "MachinesRegistered"):
        return _RANK_REGISTERED
    if event_type in ("EntitlementCreated", "EntitlementUpdated"):
        return _RANK_INTENTS
    if event_type in ("AllocationRequested", "TasksAllocated", "AllocationRejected", "TasksDeallocated"):
        return _RANK_ALLOCATIONS
    return _RANK_MACHINES


def order_key(event: Event) -> tuple[int, int]:
    """Where ``event`` goes in the merge: its envelope time, then its rank within one millisecond."""
    return event.timestamp_ms, _rank(event.type)


def merged(partitions: Mapping[tuple[str, int], Sequence[tuple[Event, Position]]]
           ) -> Iterable[tuple[Event, Position]]:
    """Every partition's records, each partition in its own (offset) order, merged by ``order_key``; equal keys
    in (topic, partition) order. A function of the log alone: the same records always give the same order.

    Why an order at all: the fold's state depends on the order facts about one machine are applied, and the
    log orders records only within a partition. Example: e1 frees a machine (TasksDeallocated, e1's partition),
    then e2 takes it (TasksAllocated, e2's partition); applied the other way round, the machine would stay e1's
    with e2's tasks on it. The allocator decides one request after another and stamps each decision with the
    time it began, so the merge by time replays its decisions in the order they were made. Not reproduced:
    decisions within one millisecond about one machine, and producers whose clocks disagree."""
    return heapq.merge(*(partitions[tp] for tp in sorted(partitions)), key=lambda rec: order_key(rec[0]))


PROFILE_APPLIED, PROFILE_PENDING, PROFILE_FAILED = "applied", "pending", "failed"  # MachineStatePublished


def profile_state(fold: RegionFold, m: MachineRec) -> dict[str, Any]:
    """The host profile the machine's entitlement wants ("" = the default; None in the free pool) and where the
    machine stands: applied, pending (a switch wanted, not done) or failed (the switch to it failed)."""
    if m.entitlement == FREE_POOL_OWNER:
        return {"host_profile_wanted": None, "host_profile_state": PROFILE_APPLIED}
    want = fold.entitlement_fields.get(m.entitlement, {}).get("host_profile") or ""
    if m.host_profile == want:
        state = PROFILE_APPLIED
    elif m.profile_failed == (want, m.entitlement):
        state = PROFILE_FAILED
    else:
        state = PROFILE_PENDING
    return {"host_profile_wanted": want, "host_profile_state": state}


def job_of(task_id: str) -> str:
    """The job of a task id ``<job>/<index>``."""
    return task_id.rpartition("/")[0]


def releases(fold: RegionFold, entitlement: str, to_free: Mapping[str, str]) -> tuple[str, ...]:
    """The machines the entitlement gives back to the free pool after freeing ``to_free`` (task -> machine):
    ``placement.release`` over the fold (remaining tasks of the machine after the free)."""
    by_machine: dict[str, list[str]] = defaultdict(list)
    for t, mid in to_free.items():
        by_machine[mid].append(t)
    out: list[str] = []
    machines = {mid: fold.machines[mid].view() for mid in by_machine if mid in fold.machines}
    for mid in sorted(by_machine):
        tasks = by_machine[mid]
        if mid not in machines:
            continue
        cpu = sum(fold.taskres[t][0] for t in tasks)
        mem = sum(fold.taskres[t][1] for t in tasks)
        n = len(tasks)
        remaining = {mid: len(fold.machines[mid].tasks) - n}
        out += placement.release(machines, entitlement, {t: mid for t in tasks}, math.ceil(cpu / n),
                                 math.ceil(mem / n), remaining)
    return tuple(out)


__all__ = ["RegionFold", "MachineRec", "PendingRequest", "CommitResult", "FoldError", "UnknownMachineEvent",
           "MissingResources", "HANDLERS", "EVENT_TYPES", "CONFLICT_TASK_PLACED", "REGISTERED_STATUS",
           "releases", "entitlement_of", "merged", "order_key", "job_of", "join_maintenance", "split_maintenance",
           "profile_state"]
