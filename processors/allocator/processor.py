"""The allocator as a running processor: one faust agent over ``intents``, ``machines`` and ``allocations``.

    python -m processors.allocator.processor        # a worker; configuration from ROPEWALK_* (infra.config)

Every record is decoded by ``streams.faustwire.decoded`` (bad bytes -> ``deadletter``) and handed, one at a
time and in a worker thread (the Redis calls and the producer's flush block), to ``Allocator.handle``:

    EntitlementCreated/Updated   -> the entitlement table in Redis (quota, type, DC pin), so every allocator
                                    process sees it; other intents are ignored
    machines / allocations event -> ``MachineIndex.apply`` at its (topic, partition, offset): idempotent
    AllocationRequested          -> also: free ``free_task_ids``, then ``allocate`` ``place_task_ids``, and
                                    produce the decision (below)
    an event whose handling raises -> ``deadletter`` with reason ``processing_failed`` (after TRANSIENT_RETRIES
                                    tries if Redis or the broker failed); the agent goes on

The decision events, all with ids derived from the request's event id, causation = the request, entitlement =
the request's, producer ``allocator``:

    TasksDeallocated + MachineReleasedToFreePool per machine the entitlement no longer uses   (free_task_ids)
    TasksAllocated (placements with dc/msb/rack, filter_rejections, fault_domain_bins, machines_added,
                    cache_hit, commit_attempts) + MachineAssignedToEntitlement per machine added
    AllocationRejected (reason constant, a message a user can act on, unplaced tasks, filter_rejections)
    -- a partial placement emits both TasksAllocated and AllocationRejected

**Redelivery** (at-least-once; DESIGN.md). The decision is journaled in Redis, per request event id, in
``alloc:req:<event id>`` (a hash), each step written *before* the step it guards:

    free    the freeing events, written before the deallocation is applied to the index (the apply is
            idempotent by content, so applying again after a crash changes nothing)
    wal     before each commit attempt: the events that commit would make true. The commit is all or nothing,
            so after a crash "every placement of wal is in the index" means the commit happened, and the
            events are re-emitted from the journal instead of allocating again
    done    the whole decision, written before it is produced; a redelivered request (a crash before the
            offset commit, or the same event sent twice) finds it and re-produces the *same* events, same
            ids and timestamps: readers dedupe by event id, and the index applies them as no-ops

One process decides a request at a time (a Redis lock per request event id): while a rebalance moves a
partition, its old and new owner may both hold the request, and the second takes the first's decision.
So a request never allocates twice, and its result is produced at least once with one identity. ``done``
expires after ``JOURNAL_TTL_S``. Events the allocator produces come back to it on ``machines`` and
``allocations``; applying them finds their facts already written (the commit or the deallocation wrote them).

**The job-level cache** (cache.py, Twine §2.3). Each ``Allocator`` holds an ``AllocationCache``; ``allocate``
asks it before reading a snapshot, and ``TasksAllocated.cache_hit`` says whether it answered. Counters, added
with the ``done`` journal write (once per request, never for a redelivery) and derived from the decision's own
events: ``requests``, ``cache_hits``, ``cache_misses`` in ``metrics:allocator``; ``allocator_metrics()`` reads
them with ``cache_hit_ratio`` = hits / (hits + misses).

**state.machines.** Every change the index makes to a machine is queued in its outbox (index.py), atomically
with the change. ``publish_machine_states`` drains it: the current state of each queued machine as a
MachineStatePublished (key: machine id; event id derived from machine and version, so a state published twice
is the same event), flushed before it leaves the outbox. The agent drains at most every PUBLISH_INTERVAL_S
while events stream in, and a faust timer drains when idle; one process drains at a time (``outbox:lock``), so
one machine's records reach the log in version order. An event applied twice queues nothing the second time,
so it publishes nothing; a crash between producing and removing from the outbox publishes the same state
(same event id) again.

Redis keys of this module, under the prefix, beside the index's (``processors/allocator/index.py``)::

    entitlement:<e>       hash   quota_machines, machine_type, dc_pin, host_profile ("" = none)
    alloc:req:<event id>  hash   free, wal, done: JSON lists of events (see above)
    alloc:lock:<event id> string the process deciding the request now (expires after LOCK_TTL_S)
    applied:allocator     hash   the index's applied marks; the intents marks share it
    metrics:allocator     hash   requests, cache_hits, cache_misses (integers)
    outbox:lock           string the process draining the outbox to state.machines now (expires)
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import faust
import redis

from infra.config import Config
from processors.allocator import placement
from processors.allocator.cache import AllocationCache
from processors.allocator.index import DEFAULT_CONSUMER, EVENT_TYPES, MachineIndex, allocate
from processors.allocator.placement import Entitlement, Machine, Plan, Request
from streams.clients import DeliveryError, EventProducer
from streams.deadletter import PROCESSING_FAILED, DeadLetters
from streams.events import Event, derived_event_id, new_event
from streams.faustwire import decoded, make_app, route_dead_letter
from streams.serde import SchemaRegistry
from streams.topics import Topics, free_pool_key

log = logging.getLogger(__name__)

PRODUCER = "allocator"
APP_ID = "allocator"
SOURCES = ("intents", "machines", "allocations")
ENTITLEMENT_EVENTS = frozenset({"EntitlementCreated", "EntitlementUpdated"})
ENTITLEMENT_FIELDS = ("quota_machines", "machine_type", "dc_pin", "host_profile")

# Rejection reasons of the processor (beside placement's NO_FEASIBLE_MACHINE / QUOTA_EXCEEDED and the index's
# COMMIT_RETRIES_EXHAUSTED).
UNKNOWN_ENTITLEMENT = "unknown_entitlement"  # no EntitlementCreated seen for the request's entitlement
INVALID_REQUEST = "invalid_request"  # e.g. an unknown spread level or an unsupported requirement
RELEASED_EMPTY = "entitlement_empty"  # MachineReleasedToFreePool.reason: no task of the entitlement left

JOURNAL_TTL_S = 7 * 24 * 3600
# Errors worth another try before an event is given up to the dead letters (Redis or the broker away briefly).
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, DeliveryError)
TRANSIENT_RETRIES = 3
LOCK_TTL_S = 30.0  # longest one request's decision may hold its lock (a crashed holder's lock expires)
METRICS_KEY = "metrics:allocator"  # hash: cache_hits, cache_misses, requests (HINCRBY; allocator_metrics)
OUTBOX_LOCK = "outbox:lock"  # string: the process draining the index's outbox to state.machines now
PUBLISH_INTERVAL_S = 0.25  # machine states are published at most this long after their change (when running)


# ---------------------------------------------------------------------------------------------------------
# Pure: an AllocationRequested and a plan -> the decision events. No faust, Kafka or Redis here.

def entitlement_of(name: str, fields: Mapping[str, str]) -> Entitlement | None:
    """The Entitlement from its Redis hash (None when no quota was ever set: not created)."""
    if not fields.get("quota_machines"):
        return None
    return Entitlement(name, int(fields["quota_machines"]), machine_type=fields.get("machine_type") or None,
                       dc_pin=fields.get("dc_pin") or None)


def request_of(event: Event, existing: Mapping[str, str]) -> Request:
    """The placement Request of an AllocationRequested; raises ValueError if the request is invalid."""
    p = event.payload
    return Request(request_id=p["request_id"], job_id=p["job_id"], entitlement=event.entitlement,
                   task_ids=tuple(p["place_task_ids"]), cpu=p["resources"]["cpu_millicores"],
                   mem=p["resources"]["memory_mib"], requirements=dict(p.get("requirements") or {}),
                   spread=p.get("spread") or "msb", avoid_machine_ids=frozenset(p.get("avoid_machine_ids") or ()),
                   existing=dict(existing))


def _derived(request: Event, type_: str, payload: Mapping[str, Any], entity_id: str, ts: int,
             *id_parts: Any, entitlement: str | None = None) -> Event:
    return new_event(type_, payload, entitlement=entitlement or request.entitlement, entity_id=entity_id,
                     producer=PRODUCER, causation_id=request.event_id, timestamp_ms=ts,
                     event_id=derived_event_id(PRODUCER, request.event_id, type_, *id_parts))


def _placement_rows(pairs: Sequence[tuple[str, str]], machines: Mapping[str, Machine]) -> list[dict]:
    return [{"task_id": t, "machine_id": m, "dc": machines[m].dc, "msb": machines[m].msb, "rack": machines[m].rack}
            for t, m in pairs]


def rejection_events(request: Event, task_ids: Sequence[str], reason: str, message: str,
                     filter_rejections: Mapping[str, int], ts: int) -> list[Event]:
    p = request.payload
    return [_derived(request, "AllocationRejected", {
        "request_id": p["request_id"], "job_id": p["job_id"], "reason": reason, "message": message,
        "unplaced_task_ids": list(task_ids), "filter_rejections": dict(filter_rejections)},
        p["request_id"], ts)]


def plan_events(request: Event, plan: Plan, attempts: int, machines: Mapping[str, Machine], ts: int) -> list[Event]:
    """TasksAllocated (when something is placed), MachineAssignedToEntitlement per machine added,
    AllocationRejected (when tasks stay unplaced). ``machines`` holds at least every machine of the plan."""
    p = request.payload
    out = []
    if plan.placements:
        out.append(_derived(request, "TasksAllocated", {
            "request_id": p["request_id"], "job_id": p["job_id"],
            "placements": _placement_rows(plan.placements, machines),
            "filter_rejections": dict(plan.filter_rejections), "fault_domain_bins": dict(plan.fault_domain_bins),
            "machines_added": list(plan.machines_added), "cache_hit": plan.cache_hit, "commit_attempts": attempts},
            p["request_id"], ts))
        out += [_derived(request, "MachineAssignedToEntitlement", {
            "machine_id": mid, "dc": machines[mid].dc, "reason": f"allocation {p['request_id']}"},
            mid, ts, mid) for mid in plan.machines_added]
    if plan.unplaced:
        out += rejection_events(request, plan.unplaced, plan.reason or placement.NO_FEASIBLE_MACHINE,
                                plan.message or "", plan.filter_rejections, ts)
    return out


def free_events(request: Event, to_free: Mapping[str, str], released: Sequence[str],
                machines: Mapping[str, Machine], ts: int) -> list[Event]:
    """TasksDeallocated for ``to_free`` (task -> machine) and MachineReleasedToFreePool per released machine."""
    if not to_free:
        return []
    p = request.payload
    out = [_derived(request, "TasksDeallocated", {
        "request_id": p["request_id"], "job_id": p["job_id"],
        "placements": _placement_rows(sorted(to_free.items()), machines), "machines_released": list(released)},
        p["request_id"], ts)]
    out += [_derived(request, "MachineReleasedToFreePool", {"machine_id": mid, "dc": machines[mid].dc,
                                                            "reason": RELEASED_EMPTY}, mid, ts, mid)
            for mid in released]
    return out


def metric_increments(decision: Sequence[Event]) -> dict[str, int]:
    """The allocator counters one decided request adds (METRICS_KEY): ``requests`` always; ``cache_hits`` or
    ``cache_misses`` when tasks went through ``allocate`` -- read from the decision itself (TasksAllocated's
    ``cache_hit``; a rejection is never a hit), so the counters can be recomputed from the log."""
    out = {"requests": 1}
    placed = [e for e in decision if e.type == "TasksAllocated"]
    rejected = [e for e in decision if e.type == "AllocationRejected"
                and e.payload["reason"] not in (UNKNOWN_ENTITLEMENT, INVALID_REQUEST)]
    if placed:
        out["cache_hits" if placed[0].payload.get("cache_hit") else "cache_misses"] = 1
    elif rejected:
        out["cache_misses"] = 1
    return out


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


DECISION_EVENTS = frozenset({"TasksAllocated", "AllocationRejected", "TasksDeallocated",
                             "MachineAssignedToEntitlement", "MachineReleasedToFreePool"})


def decisions_on_log(events: Iterable[Event]) -> dict[str, list[Event]]:
    """The decisions the log holds, per request event id: the allocator's decision events (``DECISION_EVENTS``
    it produced, caused by a request), in the order given. ``rebuild`` makes the ``done`` journal of each
    from them, so a request redelivered after a restore is answered with its decision instead of deciding
    again. Pure."""
    out: dict[str, list[Event]] = {}
    for e in events:
        if e.type in DECISION_EVENTS and e.producer == PRODUCER and e.causation_id:
            out.setdefault(e.causation_id, []).append(e)
    return out


def dump_events(events: Sequence[Event]) -> str:
    return json.dumps([event_to_json(e) for e in events], separators=(",", ":"), sort_keys=True)


def load_events(blob: str | bytes) -> list[Event]:
    return [event_from_json(d) for d in json.loads(blob)]


# ---------------------------------------------------------------------------------------------------------
# Redis wiring.

# KEYS[1] applied-mark hash, KEYS[2] the entitlement hash. ARGV: mark field, offset, event type, JSON fields.
_LUA_ENTITLEMENT = r"""
local last = redis.call('HGET', KEYS[1], ARGV[1])
if last and tonumber(last) >= tonumber(ARGV[2]) then return 0 end
if ARGV[3] == 'EntitlementCreated' then redis.call('DEL', KEYS[2]) end
local a = cjson.decode(ARGV[4])
for f, v in pairs(a) do redis.call('HSET', KEYS[2], f, v) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# KEYS[1] the lock, ARGV[1] the holder's token: release only a lock this process still holds.
_LUA_UNLOCK = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


@dataclass
class Allocator:
    """Applies events to the index and answers AllocationRequested; blocking (call it from a worker thread)."""

    r: redis.Redis
    prefix: str
    producer: EventProducer
    consumer: str = DEFAULT_CONSUMER
    max_attempts: int = 5
    cache: AllocationCache | None = None  # the job-level allocation cache; one per allocator (None: a new one)
    publish_interval_s: float = PUBLISH_INTERVAL_S

    def __post_init__(self) -> None:
        if self.cache is None:
            self.cache = AllocationCache()
        self._publishing = threading.Lock()
        self._published_at = 0.0
        self.index = MachineIndex(self.r, self.prefix, self.consumer)
        # Deallocations are written by the allocator itself (as commits are), through the index's idempotent
        # TasksDeallocated handler, under a mark field of their own that is removed right after.
        self._direct = MachineIndex(self.r, self.prefix, f"{self.consumer}.direct")
        self._apply_entitlement = self.r.register_script(_LUA_ENTITLEMENT)
        self._unlock = self.r.register_script(_LUA_UNLOCK)

    def key(self, name: str) -> str:
        return self.prefix + name

    # --- any event --------------------------------------------------------------------------------------

    def handle(self, event: Event, position: tuple[str, int, int]) -> list[Event]:
        """Apply ``event`` read at ``position``; for an AllocationRequested also decide and produce (flushed
        before returning). Returns the events produced."""
        if event.type in ENTITLEMENT_EVENTS:
            self.apply_entitlement(event, position)
            return []
        if event.type not in EVENT_TYPES:
            return []  # other intents
        self.index.apply(event, position)
        if event.type != "AllocationRequested":
            return []
        events = self.decide(event)
        for e in events:
            self.producer.send(e)
        self.producer.flush()
        return events

    def apply_entitlement(self, event: Event, position: tuple[str, int, int]) -> bool:
        topic, partition, offset = position
        fields = {f: event.payload.get(f) for f in ENTITLEMENT_FIELDS}
        if event.type == "EntitlementCreated":
            fields = {f: "" if v is None else v for f, v in fields.items()}
        else:
            fields = {f: v for f, v in fields.items() if v is not None}
        return bool(self._apply_entitlement(
            keys=[self.key(f"applied:{self.consumer}"), self.key(f"entitlement:{event.entitlement}")],
            args=[f"{topic}/{partition}", int(offset), event.type, json.dumps(fields)]))

    def entitlement(self, name: str) -> Entitlement | None:
        return entitlement_of(name, {_s(k): _s(v) for k, v in self.r.hgetall(self.key(f"entitlement:{name}")).items()})

    # --- state.machines ---------------------------------------------------------------------------------

    def publish_machine_states(self, limit: int = 2000) -> int:
        """Publish the current state of every machine in the index's outbox to ``state.machines``, flush, then
        take them out of the outbox (a machine that changed again meanwhile stays). Returns how many were
        published. One process drains at a time (``outbox:lock``), so records of one machine reach the log in
        version order; a state published twice has the same event id (machine, version)."""
        with self._publishing:
            self._published_at = time.monotonic()
            lock, token = self.key(OUTBOX_LOCK), uuid.uuid4().hex
            if not self.r.set(lock, token, nx=True, px=int(LOCK_TTL_S * 1000)):
                return 0  # another allocator is draining; what it misses stays for the next drain
            try:
                total = 0
                while queued := self.index.outbox(limit):
                    states = self.index.states(queued)
                    ts = int(time.time() * 1000)
                    for mid, fields in states.items():
                        self.producer.send(machine_state_event(fields, queued[mid][1], ts))
                    self.producer.flush()
                    gone = {mid: 2**62 for mid in queued if mid not in states}  # cleared from the index
                    self.index.outbox_done({**{mid: int(f["version"]) for mid, f in states.items()}, **gone})
                    total += len(states)
                    if len(queued) < limit:
                        break
                return total
            finally:
                self._unlock(keys=[lock], args=[token])

    def maybe_publish_machine_states(self) -> int:
        """``publish_machine_states`` unless the last drain was less than ``publish_interval_s`` ago: one
        flush per interval, not per event, while events stream in (a timer drains the rest when idle)."""
        if time.monotonic() - self._published_at < self.publish_interval_s:
            return 0
        return self.publish_machine_states()

    # --- an AllocationRequested -------------------------------------------------------------------------

    def decide(self, request: Event) -> list[Event]:
        """The request's decision: from the journal if it was made already, else made now (see module doc).

        One process decides a request at a time (``alloc:lock:<event id>``): during a rebalance the old and
        the new owner of a partition may both hold the request; the second waits and takes the first's."""
        jkey = self.key(f"alloc:req:{request.event_id}")
        lock, token = self.key(f"alloc:lock:{request.event_id}"), uuid.uuid4().hex
        deadline = time.monotonic() + LOCK_TTL_S * 2
        while not self.r.set(lock, token, nx=True, px=int(LOCK_TTL_S * 1000)):
            if (done := self.r.hget(jkey, "done")) is not None:
                return load_events(done)
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request.event_id} stays locked by another allocator")
            time.sleep(0.05)
        try:
            return self._decide(request, jkey)
        finally:
            self._unlock(keys=[lock], args=[token])

    def _decide(self, request: Event, jkey: str) -> list[Event]:
        journal = {_s(k): _s(v) for k, v in self.r.hgetall(jkey).items()}
        if "done" in journal:
            return load_events(journal["done"])
        ts = int(time.time() * 1000)

        if "free" in journal:
            freeing = load_events(journal["free"])
        else:
            freeing = self._free_events(request, ts)
            self.r.hset(jkey, "free", dump_events(freeing))
            self.r.expire(jkey, JOURNAL_TTL_S)
        if freeing:
            mark = f"request:{request.event_id}"
            self._direct.apply(freeing[0], (mark, 0, 0))
            self.r.hdel(self._direct.key(f"applied:{self._direct.consumer}"), f"{mark}/0")

        placing = None
        if "wal" in journal:
            wal = load_events(journal["wal"])
            if self._committed(wal):
                placing = wal
        if placing is None:
            placing = self._place_events(request, ts, jkey)

        done = freeing + placing
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(jkey, "done", dump_events(done))
        pipe.hdel(jkey, "free", "wal")
        pipe.expire(jkey, JOURNAL_TTL_S)
        for counter, n in metric_increments(done).items():  # counted once per request, with its decision
            pipe.hincrby(self.key(METRICS_KEY), counter, n)
        pipe.execute()
        return done

    def _committed(self, wal: Sequence[Event]) -> bool:
        pairs = [(p["task_id"], p["machine_id"]) for e in wal if e.type == "TasksAllocated"
                 for p in e.payload["placements"]]
        if not pairs:
            return False
        now = self.r.hmget(self.key("placement"), [t for t, _ in pairs])
        return all(_s(m) == mid for m, (_, mid) in zip(now, pairs))

    def _existing(self, job_id: str) -> dict[str, str]:
        """The job's placed tasks (task ids are ``<job>/<index>``), so spreading counts them."""
        return {_s(t): _s(m) for t, m in self.r.hscan_iter(self.key("placement"), match=_glob_escape(job_id) + "/*",
                                                            count=1000)}

    def _place_events(self, request: Event, ts: int, jkey: str) -> list[Event]:
        p = request.payload
        tasks = list(p["place_task_ids"])
        if not tasks:
            return []
        ent = self.entitlement(request.entitlement)
        if ent is None:
            return rejection_events(request, tasks, UNKNOWN_ENTITLEMENT,
                                    f"entitlement {request.entitlement} does not exist; create it "
                                    f"(ropewalk entitlement create {request.entitlement} --quota N)", {}, ts)
        try:
            req = request_of(request, self._existing(p["job_id"]))
        except ValueError as exc:
            return rejection_events(request, tasks, INVALID_REQUEST, f"job {p['job_id']}: {exc}", {}, ts)

        def build(plan: Plan, attempts: int, machines: Mapping[str, Machine]) -> list[Event]:
            return plan_events(request, plan, attempts, machines, ts)

        def write_wal(events: list[Event]) -> None:
            self.r.hset(jkey, "wal", dump_events(events))
            self.r.expire(jkey, JOURNAL_TTL_S)

        def before_commit(plan: Plan, attempt: int, machines: Mapping[str, Machine]) -> None:
            write_wal(build(plan, attempt, machines))  # the events this commit would make true

        plan, attempts, _conflicts = allocate(self.index, ent, req, max_attempts=self.max_attempts, cache=self.cache,
                                              before_commit=before_commit, cause=request.event_id)
        involved = {m for _, m in plan.placements} | set(plan.machines_added)
        return plan_events(request, plan, attempts, self.index.machines(involved), ts)

    def _free_events(self, request: Event, ts: int) -> list[Event]:
        task_ids = list(request.payload.get("free_task_ids") or ())
        if not task_ids:
            return []
        where = {t: _s(m) for t, m in zip(task_ids, self.r.hmget(self.key("placement"), task_ids)) if m is not None}
        machines = self.index.machines(set(where.values()))
        # Only placements on machines the request's entitlement holds: a task id already freed, or one on
        # another entitlement's machine, is not this request's to free.
        to_free = {t: m for t, m in where.items()
                   if m in machines and machines[m].entitlement == request.entitlement}
        if not to_free:
            return []
        res = self.r.hmget(self.key("taskres"), list(to_free))
        cost: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for (t, mid), r in zip(to_free.items(), res):
            cpu, mem = map(int, _s(r).split()) if r is not None else (0, 0)
            cost[mid][0] += cpu
            cost[mid][1] += mem
        pipe = self.r.pipeline(transaction=False)
        mids = sorted(set(to_free.values()))
        for mid in mids:
            pipe.scard(self.key(f"tasks:{mid}"))
        freed = Counter(to_free.values())
        remaining = {mid: n - freed[mid] for mid, n in zip(mids, pipe.execute())}
        released = []
        for mid in mids:  # one machine at a time: the freed tasks of one machine may differ in size
            n = freed[mid]
            released += placement.release(machines, request.entitlement,
                                          {t: m for t, m in to_free.items() if m == mid},
                                          math.ceil(cost[mid][0] / n), math.ceil(cost[mid][1] / n), remaining)
        return free_events(request, to_free, released, machines, ts)


def allocator_metrics(redis_client: redis.Redis, prefix: str) -> dict[str, Any]:
    """The allocator's counters under ``prefix`` (every allocator process adds to the same hash):
    ``requests`` (AllocationRequested decided, each once), ``cache_hits`` and ``cache_misses`` (those whose
    tasks went through the job-level cache), and ``cache_hit_ratio`` = hits / (hits + misses), None before any."""
    raw = {_s(k): int(v) for k, v in redis_client.hgetall(prefix + METRICS_KEY).items()}
    out = {k: raw.get(k, 0) for k in ("cache_hits", "cache_misses", "requests")}
    looked = out["cache_hits"] + out["cache_misses"]
    return {**out, "cache_hit_ratio": out["cache_hits"] / looked if looked else None}


# ---------------------------------------------------------------------------------------------------------
# faust wiring.

def build_app(cfg: Config, *, registry: SchemaRegistry | None = None, redis_client: redis.Redis | None = None,
              consumer: str = DEFAULT_CONSUMER, **settings: Any):
    """The allocator's faust app, its agent, and the ``Allocator`` it drives; ``settings`` override faust's."""
    registry = registry or SchemaRegistry.from_dir()
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    producer = EventProducer(cfg, registry, PRODUCER)
    dead_letters = DeadLetters(producer, PRODUCER)
    allocator = Allocator(redis_client or redis.Redis.from_url(cfg.redis_url), cfg.topic_prefix, producer,
                          consumer=consumer)
    app = make_app(cfg, APP_ID, **settings)
    source = app.topic(*(catalogue.name(t) for t in SOURCES), key_serializer="raw", value_serializer="raw",
                       partitions=cfg.partitions)

    @app.agent(source, name=f"{APP_ID}.allocate")
    async def allocate_agent(stream):
        loop = asyncio.get_running_loop()
        async for record, event in decoded(stream, registry, dead_letters, catalogue, cfg=cfg):
            position = (record.topic, record.partition, record.offset)
            try:
                for attempt in range(1, TRANSIENT_RETRIES + 1):
                    try:  # handle() is idempotent (index marks, the request journal): retrying is safe
                        await loop.run_in_executor(None, allocator.handle, event, position)
                        break
                    except TRANSIENT as exc:
                        if attempt == TRANSIENT_RETRIES:
                            raise
                        log.warning("allocator: %s at %s: %s; retrying", event.type, position, exc)
                        await asyncio.sleep(0.5 * attempt)
            except Exception as exc:  # noqa: BLE001 - one bad event must not stop the allocator
                log.exception("allocator: %s at %s failed", event.type, position)
                message = stream.current_event.message if stream.current_event is not None else None
                await route_dead_letter(dead_letters, message or _Origin(record, registry, event),
                                        PROCESSING_FAILED, f"{event.type}: {type(exc).__name__}: {exc}")
            await _publish(loop, allocator.maybe_publish_machine_states)

    @app.timer(interval=allocator.publish_interval_s, name=f"{APP_ID}.publish_machine_states")
    async def publish_machine_states():
        """Drain what the agent's throttled drains left (the last changes before a pause)."""
        await _publish(asyncio.get_running_loop(), allocator.publish_machine_states)

    return app, allocate_agent, allocator


async def _publish(loop, drain) -> None:
    try:  # the outbox keeps what was not published: a failure here only delays state.machines
        await loop.run_in_executor(None, drain)
    except Exception:  # noqa: BLE001
        log.exception("allocator: publishing machine states failed; the outbox keeps them for the next drain")


@dataclass(frozen=True)
class _Origin:
    """Where a record came from, for route_dead_letter when faust's message is not at hand (re-encoded)."""

    record: Any
    registry: SchemaRegistry
    event: Event

    topic = property(lambda self: self.record.topic)
    partition = property(lambda self: self.record.partition)
    offset = property(lambda self: self.record.offset)
    key = property(lambda self: self.record.key)

    @property
    def value(self) -> bytes:
        return self.registry.encode(self.event.type, self.event.to_record())


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, _, _ = build_app(Config.from_env())
    faust.Worker(app, loglevel="INFO").execute_from_commandline()


if __name__ == "__main__":
    main()
