"""The allocator's decisions, pure: an AllocationRequested on the region's fold -> the decision's events.

No faust, Kafka or Redis, no clock: the time of a decision (``ts``) is given, and the same request on the same fold
gives the same events, event ids included (they derive from the request's event id). The fold is read here, never
written: the processor (``processor.py``) applies what is decided to the fold, commits it to Redis, produces it.

    frees(fold, request, ts)               TasksDeallocated + MachineReleasedToFreePool (what the request frees)
    placing(fold, request, attempt, ts)    the placement on the fold, as events: TasksAllocated +
                                           MachineAssignedToEntitlement, or AllocationRejected with its reason
    exhausted / failed                     the rejections the processor decides (conflicts, a bug)
    in_decision_order, drain_of            which request goes first

Each rejection carries one of the reasons below (or placement's ``NO_FEASIBLE_MACHINE`` / ``QUOTA_EXCEEDED``).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import orjson

from processors.allocator.fold import ALLOCATOR_PRODUCER, RegionFold, releases, split_maintenance
from processors.allocator.placement import NO_FEASIBLE_MACHINE, Machine, Plan, Request
from streams.batches import ENVELOPE_BYTES, size_of, split
from streams.events import Event, derived_event_id, new_event
from streams.partitionmap import MapEntry
from streams.topics import free_pool_key

T = TypeVar("T")

PRODUCER = ALLOCATOR_PRODUCER  # the producer of every event the allocator decides

# Rejection reasons of the allocator (beside placement's NO_FEASIBLE_MACHINE / QUOTA_EXCEEDED).
UNKNOWN_ENTITLEMENT = "unknown_entitlement"  # no EntitlementCreated for the request's entitlement in the fold
INVALID_REQUEST = "invalid_request"  # e.g. an unknown spread level or an unsupported requirement
COMMIT_RETRIES_EXHAUSTED = "commit_retries_exhausted"  # every attempt met a conflict in Redis
ALLOCATOR_ERROR = "allocator_error"  # deciding raised (a bug): the request is answered, the fold folded again
RELEASED_EMPTY = "entitlement_empty"  # MachineReleasedToFreePool.reason: no task of the entitlement left

# A row of a decision's Redis commit (index.Decision.rows): machine, the version placed on, added, its new tasks.
CommitRow = tuple[str, int, bool, tuple[str, ...]]


# ---------------------------------------------------------------------------------------------------------
# A request and a plan -> the decision events.

def request_of(event: Event, existing: Mapping[str, str]) -> Request:
    """The placement Request of an AllocationRequested; raises ValueError if the request is invalid."""
    p = event.payload
    return Request(request_id=p["request_id"], job_id=p["job_id"], entitlement=event.entitlement,
                   task_ids=tuple(p["place_task_ids"]), cpu=p["resources"]["cpu_millicores"],
                   mem=p["resources"]["memory_mib"], requirements=dict(p.get("requirements") or {}),
                   spread=p.get("spread") or "msb", avoid_machine_ids=frozenset(p.get("avoid_machine_ids") or ()),
                   existing=dict(existing), targets={t: m for t, m in (p.get("target_machine_ids") or {}).items()
                                                     if t in p["place_task_ids"]})


def _derived(request: Event, type_: str, payload: Mapping[str, Any], entity_id: str, ts: int,
             *id_parts: Any) -> Event:
    return new_event(type_, payload, entitlement=request.entitlement, entity_id=entity_id, producer=PRODUCER,
                     causation_id=request.event_id, timestamp_ms=ts,
                     event_id=derived_event_id(PRODUCER, request.event_id, type_, *id_parts))


def _placement_rows(pairs: Sequence[tuple[str, str]], machines: Mapping[str, Machine]) -> list[dict]:
    return [{"task_id": t, "machine_id": m, "dc": machines[m].dc, "msb": machines[m].msb, "rack": machines[m].rack}
            for t, m in pairs]


def _fixed(payload: Mapping[str, Any]) -> int:
    """The estimated bytes of a decision event besides its split list (envelope and other fields)."""
    return ENVELOPE_BYTES + size_of(payload)


def rejection_events(request: Event, task_ids: Sequence[str], reason: str, message: str,
                     filter_rejections: Mapping[str, int], ts: int) -> list[Event]:
    """AllocationRejected; beyond what one record holds (``streams.batches``), several, the unplaced task ids cut
    into parts (the first keeps the undivided event's id and the filter counts)."""
    p = request.payload
    head = {"request_id": p["request_id"], "job_id": p["job_id"], "reason": reason, "message": message}
    parts = split(list(task_ids), fixed=_fixed({**head, "filter_rejections": dict(filter_rejections)}))
    return [_derived(request, "AllocationRejected", {
        **head, "unplaced_task_ids": part, "filter_rejections": dict(filter_rejections) if i == 0 else {}},
        p["request_id"], ts, *(("part", i) if i else ())) for i, part in enumerate(parts)]


def plan_events(request: Event, plan: Plan, attempts: int, machines: Mapping[str, Machine], ts: int) -> list[Event]:
    """TasksAllocated (when something is placed), MachineAssignedToEntitlement per machine added,
    AllocationRejected (when tasks stay unplaced). ``machines`` holds at least every machine of the plan.

    However many tasks, no record exceeds what one holds (``streams.batches.split``): the placements are cut into
    parts, each a TasksAllocated of its own (the first keeps the undivided event's id, the filter counts and the
    fault-domain bins), each naming among ``machines_added`` the machines its placements are the first to use."""
    p = request.payload
    out = []
    if plan.placements:
        head = {"request_id": p["request_id"], "job_id": p["job_id"]}
        first = {"filter_rejections": dict(plan.filter_rejections), "fault_domain_bins": dict(plan.fault_domain_bins)}
        rows = _placement_rows(plan.placements, machines)
        parts = split(rows, fixed=_fixed({**head, **first, "machines_added": list(plan.machines_added)}))
        added, named = set(plan.machines_added), set()
        for i, part in enumerate(parts):
            new = [r["machine_id"] for r in part if r["machine_id"] in added and r["machine_id"] not in named]
            named.update(new)
            if i == len(parts) - 1:  # an added machine no placement uses (none should be) goes with the last part
                new += [m for m in plan.machines_added if m not in named]
            out.append(_derived(request, "TasksAllocated", {
                **head, "placements": part, **(first if i == 0 else {"filter_rejections": {}, "fault_domain_bins": {}}),
                "machines_added": list(dict.fromkeys(new)), "cache_hit": False, "commit_attempts": attempts},
                p["request_id"], ts, *(("part", i) if i else ())))
        out += [_derived(request, "MachineAssignedToEntitlement", {
            "machine_id": mid, "dc": machines[mid].dc, "reason": f"allocation {p['request_id']}"},
            mid, ts, mid) for mid in plan.machines_added]
    if plan.unplaced:
        out += rejection_events(request, plan.unplaced, plan.reason or NO_FEASIBLE_MACHINE, plan.message or "",
                                plan.filter_rejections, ts)
    return out


def free_events(request: Event, to_free: Mapping[str, str], released: Sequence[str],
                machines: Mapping[str, Machine], ts: int) -> list[Event]:
    """TasksDeallocated for ``to_free`` (task -> machine; in parts beyond what one record holds, the released
    machines named by the last) and MachineReleasedToFreePool per released machine."""
    if not to_free:
        return []
    p = request.payload
    head = {"request_id": p["request_id"], "job_id": p["job_id"]}
    parts = split(_placement_rows(sorted(to_free.items()), machines),
                  fixed=_fixed({**head, "machines_released": list(released)}))
    out = [_derived(request, "TasksDeallocated", {
        **head, "placements": part, "machines_released": list(released) if i == len(parts) - 1 else []},
        p["request_id"], ts, *(("part", i) if i else ())) for i, part in enumerate(parts)]
    out += [_derived(request, "MachineReleasedToFreePool", {"machine_id": mid, "dc": machines[mid].dc,
                                                            "reason": RELEASED_EMPTY}, mid, ts, mid)
            for mid in released]
    return out


def nothing_freed(request: Event, ts: int) -> list[Event]:
    """The answer to a request with nothing to place whose tasks hold no placement (a stopped job's tasks that never
    ran): a TasksDeallocated freeing nothing. Every request is answered: before, such a request got no answer, and
    its stopped job waited for it for good."""
    p = request.payload
    return [_derived(request, "TasksDeallocated", {"request_id": p["request_id"], "job_id": p["job_id"],
                                                   "placements": [], "machines_released": []},
                     p["request_id"], ts)]


def metric_increments(decision: Sequence[Event]) -> dict[str, int]:
    """The counters one decided request adds (METRICS_KEY), read from the decision itself so they can be
    recomputed from the log: ``requests`` always, ``placed`` / ``rejected`` when it placed / rejected tasks."""
    out = {"requests": 1}
    if any(e.type == "TasksAllocated" for e in decision):
        out["placed"] = 1
    if any(e.type == "AllocationRejected" for e in decision):
        out["rejected"] = 1
    return out


def decision_result(placing: Sequence[Event]) -> str:
    """``ropewalk_allocation_decision_duration_seconds``'s result of one request's placing events."""
    if not placing:
        return "freed"
    return "placed" if any(e.type == "TasksAllocated" for e in placing) else "unplaceable"



def machines_of(events: Iterable[Event]) -> frozenset[str]:
    """The machines a decision's events change: placements, machines added and released."""
    out: set[str] = set()
    for e in events:
        p = e.payload
        out.update(r["machine_id"] for r in p.get("placements") or ())
        out.update(p.get("machines_added") or ())
        out.update(p.get("machines_released") or ())
    return frozenset(out)


def placement_with(plan: Plan, **changes: Any) -> Plan:
    return replace(plan, **changes)



MACHINE_STATUSES = frozenset({"UP", "UNHEALTHY", "DOWN", "MAINTENANCE"})  # MachineStatePublished's enum


def machine_state_event(fields: Mapping[str, Any], cause: str | None, ts: int) -> Event:
    """The MachineStatePublished of a machine as the index holds it (``MachineIndex.states``). Its id is derived
    from (machine, version): a state published again is the same event, and readers dedupe by id."""
    mid, version = fields["id"], int(fields["version"])
    ent = fields["entitlement"] or None
    return new_event("MachineStatePublished", {
        "machine_id": mid,
        "topology": {f: fields[f] for f in ("region", "dc", "msb", "rack")},
        "machine_type": fields["type"],
        "status": fields["status"] if fields["status"] in MACHINE_STATUSES else "UNKNOWN",
        "assigned_entitlement": ent,
        "capacity": {"cpu_millicores": int(fields["cpu_cap"]), "memory_mib": int(fields["mem_cap"])},
        "free": {"cpu_millicores": int(fields["cpu_free"]), "memory_mib": int(fields["mem_free"])},
        "host_profile": fields["host_profile"] or None,
        "task_ids": list(fields["task_ids"]),
        "version": version,
        "maintenance_ids": list(split_maintenance(fields.get("maintenance"))),
        "host_profile_wanted": fields.get("host_profile_wanted"),
        "host_profile_state": fields.get("host_profile_state") or "",  # "" read back from Redis: not known
    }, entitlement=ent or free_pool_key(fields["dc"]), entity_id=mid, producer=PRODUCER, causation_id=cause or None,
        timestamp_ms=ts, event_id=derived_event_id(PRODUCER, "MachineStatePublished", mid, version))


def event_to_json(e: Event) -> dict:
    return {"type": e.type, "entitlement": e.entitlement, "entity_id": e.entity_id, "payload": dict(e.payload),
            "producer": e.producer, "causation_id": e.causation_id, "timestamp_ms": e.timestamp_ms,
            "event_id": e.event_id}


def event_from_json(d: Mapping[str, Any]) -> Event:
    return Event(type=d["type"], entitlement=d["entitlement"], entity_id=d["entity_id"], payload=d["payload"],
                 producer=d["producer"], causation_id=d["causation_id"], timestamp_ms=d["timestamp_ms"],
                 event_id=d["event_id"])


def dump_events(events: Sequence[Event]) -> str:
    """The events as JSON (journaled in Redis with their decision: ``index.Decision.events``); orjson, as the
    standard library's encoder was a quarter of the allocator's CPU in a burst (py-spy, stop 41)."""
    return orjson.dumps([event_to_json(e) for e in events], option=orjson.OPT_NON_STR_KEYS).decode()


def load_events(blob: str | bytes) -> list[Event]:
    return [event_from_json(d) for d in orjson.loads(blob)]


# ---------------------------------------------------------------------------------------------------------
# The decisions on the fold (read, never written).

def frees(fold: RegionFold, request: Event, ts: int) -> list[Event]:
    """What ``request`` frees: its ``free_task_ids`` placed on machines its entitlement holds (a task id already
    freed, or one on another entitlement's machine, is not this request's to free), and the machines the
    entitlement then gives back to the free pool. [] when it frees nothing."""
    to_free = {t: mid for t in request.payload.get("free_task_ids") or ()
               if (mid := fold.placement.get(t)) is not None and fold.machines[mid].entitlement == request.entitlement}
    if not to_free:
        return []
    released = releases(fold, request.entitlement, to_free)
    views = {mid: fold.machines[mid].view() for mid in set(to_free.values())}
    return free_events(request, to_free, released, views, ts)


@dataclass(frozen=True)
class Placing:
    """One request's placement, decided on the fold: its events, and (when it placed) the plan the processor
    commits to the fold and to Redis."""

    events: list[Event]
    plan: Plan | None = None  # None: rejected before placement ran (nothing to commit)
    request: Request | None = None
    machines: Mapping[str, Machine] | None = None  # the plan's machines as the fold held them (their versions)

    @property
    def rows(self) -> tuple[CommitRow, ...]:
        """The plan as the Redis commit takes it: per machine (sorted), the version it was placed on, whether it
        is added to the entitlement, the tasks placed on it."""
        if self.plan is None or not self.plan.placements or self.machines is None:
            return ()
        by_machine: dict[str, list[str]] = defaultdict(list)
        for t, mid in self.plan.placements:
            by_machine[mid].append(t)
        added = set(self.plan.machines_added)
        return tuple((mid, self.machines[mid].version, mid in added, tuple(by_machine.get(mid, ())))
                     for mid in sorted(set(by_machine) | added))


def placing(fold: RegionFold, request: Event, attempt: int, ts: int) -> Placing:
    """The placement of ``request``'s ``place_task_ids`` on the fold (after its frees were applied to it):
    placed (TasksAllocated, MachineAssignedToEntitlement), and/or rejected with a reason (AllocationRejected):
    ``UNKNOWN_ENTITLEMENT``, ``INVALID_REQUEST``, or placement's. ``attempt`` is the commit attempt it is."""
    p = request.payload
    tasks = list(p["place_task_ids"])
    if not tasks:
        return Placing([])
    ent = fold.entitlement(request.entitlement)
    if ent is None:
        # Not "create it": the scheduler asks only for entitlements it knows, so this fold has not read the
        # EntitlementCreated yet, and creating it again would overwrite its quota. The scheduler asks again.
        return Placing(rejection_events(
            request, tasks, UNKNOWN_ENTITLEMENT, f"entitlement {request.entitlement} is not in the allocator's fold "
            f"of the log yet (no EntitlementCreated read); the scheduler asks again", {}, ts))
    try:
        req = request_of(request, fold.existing(p["job_id"]))
    except ValueError as exc:
        return Placing(rejection_events(request, tasks, INVALID_REQUEST, f"job {p['job_id']}: {exc}", {}, ts))
    plan = fold.place(ent, req)
    if not plan.placements and plan.reason == NO_FEASIBLE_MACHINE and (
            req.requirements.get("dc") or ent.dc_pin or req.requirements.get("machine_type") or ent.machine_type):
        # The narrowed snapshot hides why the other machines did not fit: explain over all of them
        # (only the explanation is taken).
        wide = fold.place(ent, req, wide=True)
        if not wide.placements and wide.reason == NO_FEASIBLE_MACHINE:
            plan = placement_with(plan, filter_rejections=wide.filter_rejections, message=wide.message)
    machines = {mid: fold.machines[mid].view() for mid in {m for _, m in plan.placements} | set(plan.machines_added)}
    return Placing(plan_events(request, plan, attempt, machines, ts), plan, req, machines)


def exhausted(request: Event, attempts: int, conflicts: Mapping[str, str], ts: int) -> list[Event]:
    """The rejection of a request whose every commit attempt met a conflict (``COMMIT_RETRIES_EXHAUSTED``)."""
    p = request.payload
    reasons = ", ".join(sorted(set(conflicts.values())))
    return rejection_events(request, p["place_task_ids"], COMMIT_RETRIES_EXHAUSTED,
                            f"{len(p['place_task_ids'])} tasks of job {p['job_id']} unplaced: {attempts} commit "
                            f"attempts met conflicts ({reasons})", {}, ts)


def failed(request: Event, exc: BaseException, ts: int) -> list[Event]:
    """The rejection of a request whose deciding raised (``ALLOCATOR_ERROR``: a bug; the request is answered)."""
    return rejection_events(request, request.payload["place_task_ids"], ALLOCATOR_ERROR,
                            f"the allocator failed deciding this request ({type(exc).__name__}: {exc}); "
                            f"it was left unplaced", {}, ts)


# ---------------------------------------------------------------------------------------------------------
# Which request first.

def in_decision_order(batch: Sequence[T], partition: Callable[[T], int], when_ms: int, partitions: int) -> list[T]:
    """The order in which one batch's requests are decided: by partition, from the one the batch's decision time
    names (``when_ms`` modulo ``partitions``: no entitlement's partition always goes first where decisions meet in
    the free pool), each partition's in log order (the order they arrive in). The order of arrival across
    partitions is the consumer's and is not on the log; this one is a function of the log (each batch's decision
    time is its own, later than the one before), so a replay (processors/history/region.py) decides the batch in
    the same order and takes the same decisions."""
    return sorted(batch, key=lambda item: (partition(item) - when_ms) % partitions)


def drain_of(entry: MapEntry | None, partition: int) -> tuple[int, int] | None:
    """The requests a request of an entitlement on ``partition`` must wait for, by the partition map's ``entry`` of
    the entitlement: (the partition it moved from, the end of that partition of allocations when it left), when
    ``partition`` is where it moved to; None when it never moved, or ``partition`` is one it left (its requests there
    precede the move). Pure. (The scheduler's README, "Moving an entitlement": a job's requests are decided in the
    order they were asked, across the move.)"""
    if entry is None or entry.epoch == 0 or entry.drain_offset is None:
        return None
    target = entry.moving_to if entry.moving_to is not None else entry.partition
    if partition != target:
        return None
    source = entry.partition if entry.moving_to is not None else (entry.history[-1] if entry.history else None)
    return None if source is None or source == target else (source, entry.drain_offset)


def expected_partitions(entry: MapEntry | None, hash_partition: int) -> set[int]:
    """The partitions an entitlement's requests may be on, by what the map says (else: the map is behind). Pure."""
    return {hash_partition} if entry is None else {hash_partition, *entry.partitions_ever}

