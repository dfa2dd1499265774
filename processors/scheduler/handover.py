"""Moving an entitlement to another partition (another scheduler shard), its jobs running on. Pure.

The protocol, on the log (the scheduler's README, "Moving an entitlement", has it as a diagram):

1. ``ropewalk entitlement move E --partition P1`` puts an ``EntitlementMoveRequested`` on ``intents``, routed to E's
   partition P0. The shard of P0 decides it (``begin``): E is **frozen** there — its home on P0 says ``moving_to``
   P1 — and stored. From then on every record of E that reaches P0 is **forwarded** (``route``), the same bytes with
   the headers ``forwarded_from`` and ``epoch``, to partition P1 of ``handoff``; P0 decides nothing more of E.
2. Once that is durable, P0 publishes ``E moving to P1`` on the partition map (producers still send to P0, the
   allocator learns the drain offset) and sends E's state to P1 (``hand_over``): its entitlement, its jobs (headers
   and task records, as the shard's tables keep them) and the machines they know to be down, in
   ``EntitlementHandedOver`` parts on ``handoff``; then it drops E's jobs from its tables. A crash anywhere in 2.
   repeats it from the frozen state, which no longer changes: the same parts, the same ids.
3. The shard of P1 adopts the parts (``adopt``); records of E that P0 forwarded before them are **held** until the
   hand-over is complete (nothing of E is decided on a partial state), then decided in order. Once the adoption is
   durable, P1 publishes ``E lives on P1`` on the map, and producers send there.

Nothing is decided twice: a record is decided on P0 before the freeze or on P1 after the adoption, never both (a
redelivery after a crash is caught by the jobs' duplicate rings, which travel with them). Nothing is lost: a record
on P0 after the freeze is forwarded, a record sent to the wrong partition by a producer with a stale map is
forwarded by the shard that finds it there (its map says where E lives), and a forwarded record is held until its
epoch is adopted. Tasks keep running: a hand-over moves the scheduler's picture of them, not them; an update under
way, a move of a failed machine's tasks, TaskControl's operations carry on from the same state on P1. Requests of
E's jobs still on P0's allocations partition are decided before any of P1's (``drain_offset``, the allocator's
``processors/allocator/README.md``), so the allocator answers a job's requests in order across the move.

Where an entitlement's data is kept on one shard is a ``Home`` per (entitlement, partition); the shard keeps them
in a table of its own, keyed ``<entitlement>@<partition>``.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any

from processors.allocator.placement import Entitlement
from processors.scheduler import store as st
from processors.scheduler.decide import machines_of, refuse
from processors.scheduler.model import Job, SchedulerState
from processors.scheduler.reasons import REASON_UNKNOWN_ENTITLEMENT
from processors.scheduler.records import job_from_record
from processors.scheduler.work import PRODUCER, Fold
from streams.batches import ENVELOPE_BYTES, split
from streams.events import Event, derived_event_id, new_event
from streams.partitionmap import MapEntry

MOVE_REQUESTED = "EntitlementMoveRequested"
HANDED_OVER = "EntitlementHandedOver"

# Why a move is refused (IntentRefused.reason).
REASON_INVALID_PARTITION = "invalid_partition"  # not a partition of the region's entitlement-keyed topics
REASON_ALREADY_THERE = "already_on_partition"  # the entitlement lives on that partition already

# What a shard does with a record of an entitlement (``route``).
DECIDE = "decide"
FORWARD = "forward"  # to partition ``Route.to`` of handoff
HOLD = "hold"  # until the entitlement's hand-over (``Route.epoch``) is adopted here


@dataclass(frozen=True)
class Route:
    action: str
    to: int | None = None  # FORWARD: the partition
    epoch: int = 0  # FORWARD: the entitlement's move count the forwarded record carries; HOLD: the one it awaits


@dataclass(frozen=True)
class Home:
    """What one shard partition knows of where an entitlement lives."""

    partition: int  # the partition this home is on
    epoch: int = 0  # the entitlement's move count (0: never moved)
    moving_to: int | None = None  # leaving for that partition: its records are forwarded there
    sent: bool = False  # leaving: its state is on the log (the hand-over's parts), its jobs gone from here
    handover_id: str | None = None  # the move that made this home (leaving: its own; here: the one it came by)
    parts: tuple[int, ...] = ()  # arriving: the parts of the hand-over received so far
    parts_total: int = 0  # arriving: how many there are (0: not arriving)
    history: tuple[int, ...] = ()  # the partitions it lived on before this one, oldest first
    drain_offset: int | None = None  # arriving or here after a move: see EntitlementHandedOver.drain_offset

    @property
    def arriving(self) -> bool:
        return self.parts_total > 0

    @property
    def here(self) -> bool:
        """Its events are decided on this partition."""
        return self.moving_to is None and not self.arriving


def home_key(entitlement: str, partition: int) -> str:
    """The key of a home in the shard's table (one per partition: the same entitlement has a home on the partition
    it left and one on the partition it moved to, and one worker may hold both)."""
    return f"{entitlement}@{partition}"


def home_record(h: Home) -> dict[str, Any]:
    r = asdict(h)
    r["parts"], r["history"] = list(h.parts), list(h.history)
    return r


def home_of(r: Mapping[str, Any] | None) -> Home | None:
    if r is None:
        return None
    return Home(**{**r, "parts": tuple(r.get("parts") or ()), "history": tuple(r.get("history") or ())})


def storage_key(key: str, entitlement: str, partition: int, hash_partition: int) -> str:
    """The key under which a value of ``entitlement``'s data on ``partition`` is kept in the shard's tables (a job's
    header, a chunk, the entitlement's fields): ``key`` itself on its hash partition (where every entitlement lived
    before the map, and most still do), else ``key~<partition>``. Two partitions never share a key, so a worker that
    recovers both changelogs cannot take one's tombstone for the other's value, whatever the order it reads them."""
    return key if partition == hash_partition else f"{key}~{partition}"


def route(home: Home | None, entry: MapEntry | None, partition: int, record_epoch: int | None) -> Route:
    """What the shard of ``partition`` does with a record of an entitlement (not a hand-over part): ``home`` is what
    this partition knows of the entitlement (None: nothing), ``entry`` what the partition map says (None: no entry,
    it lives on its hash partition), ``record_epoch`` the epoch header of a record forwarded here (None: a record
    produced here)."""
    if home is not None:
        if home.moving_to is not None:
            return Route(FORWARD, home.moving_to, home.epoch)
        if home.arriving or (record_epoch is not None and home.epoch < record_epoch):
            return Route(HOLD, epoch=record_epoch if record_epoch is not None else home.epoch)
        return Route(DECIDE)
    if record_epoch:  # forwarded here by a move (epoch >= 1) whose hand-over's parts were not read yet
        return Route(HOLD, epoch=record_epoch)
    if entry is not None and entry.partition != partition:  # a producer's stale map: where the map says it lives
        return Route(FORWARD, entry.partition, entry.epoch)
    return Route(DECIDE)


# -- 1. the move requested: frozen on the partition it leaves ---------------------------------------------------------

def begin(state: SchedulerState, home: Home | None, ev: Event, partition: int, partitions: int, now_ms: int
          ) -> tuple[Home | None, list[Event]]:
    """Decide an ``EntitlementMoveRequested`` on the partition the entitlement lives on: the home that freezes it
    (``moving_to``), or the same home and an ``IntentRefused`` (an unknown entitlement, a partition that does not
    exist or where it lives already). A request decided already (its id made the home) is a no-op."""
    ent = ev.entitlement
    to = ev.payload["to_partition"]
    if home is not None and home.handover_id == ev.event_id:
        return home, []  # this very move: decided already (redelivered, or forwarded back by the new partition)
    given = home
    if home is None and ent in state.entitlements:
        home = Home(partition)  # it lives here without a home record: it never moved
    problem = None
    if home is None or not home.here or ent not in state.entitlements:
        problem = (REASON_UNKNOWN_ENTITLEMENT, f"entitlement {ent!r} does not live on partition {partition}")
    elif not isinstance(to, int) or not 0 <= to < partitions:
        problem = (REASON_INVALID_PARTITION, f"to_partition: expected a partition from 0 to {partitions - 1}, "
                                             f"got {to!r}")
    elif to == partition:
        problem = (REASON_ALREADY_THERE, f"entitlement {ent!r} lives on partition {partition} already")
    if problem is not None:
        fold = Fold(state, now_ms, ev)
        refuse(fold, ev, *problem)
        return given, fold.events
    assert home is not None  # without one, ``problem`` says the entitlement does not live here
    return Home(partition, home.epoch + 1, moving_to=to, handover_id=ev.event_id,
                history=home.history, drain_offset=home.drain_offset), []


# -- 2. its state sent to the partition it goes to --------------------------------------------------------------------

def jobs_of(state: SchedulerState, entitlement: str) -> list[Job]:
    return [j for _, j in sorted(state.jobs.items()) if j.entitlement == entitlement]


def items_of(state: SchedulerState, entitlement: str) -> list[str]:
    """The entitlement's state as JSON documents: its fields, then per job its task records (a chunk of
    ``store.CHUNK_TASKS`` at most per document, as the tables keep them) each with the job's header, so that a part
    stands alone, then the machines its jobs know down."""
    items: list[dict[str, Any]] = []
    ent = state.entitlements.get(entitlement)
    if ent is not None:
        items.append({"entitlement": asdict(ent)})
    down: dict[str, str] = {}
    for job in jobs_of(state, entitlement):
        header = st.plan(None, None, {}, job).header
        for kept in ("chunks", "key", "format", "version"):  # how a shard keeps it, not what it is
            header.pop(kept, None)
        tasks = [st.task_record(t) for t in job.tasks.values()]
        for i in range(0, max(len(tasks), 1), st.CHUNK_TASKS):  # each with the header: parts stand alone
            items.append({"job": header, "tasks": tasks[i:i + st.CHUNK_TASKS]})
        for m in machines_of(job):
            if (s := state.machines_down.get(m)) is not None:
                down[m] = s
    if down:
        items.append({"down": dict(sorted(down.items()))})
    return [json.dumps(i, separators=(",", ":"), sort_keys=True) for i in items]


def hand_over(state: SchedulerState, home: Home, entitlement: str, *, drain_offset: int, now_ms: int
              ) -> tuple[SchedulerState, Home, list[Event]]:
    """Send a frozen entitlement's state (``home.moving_to`` set, ``sent`` not yet): the ``EntitlementHandedOver``
    parts (for partition ``home.moving_to`` of handoff; ids derived from the move, so a repeat is the same events), the
    state without the entitlement and its jobs, and the home marked sent. ``drain_offset``: the end of allocations'
    partition ``home.partition`` now (every request of the entitlement's jobs from this partition is below it)."""
    assert home.moving_to is not None and not home.sent, home
    items = items_of(state, entitlement)
    fixed = ENVELOPE_BYTES + 64 * (len(home.history) + 2) + 200
    parts = split(items, fixed=fixed) if items else [[]]
    events = []
    for i, part in enumerate(parts):
        events.append(new_event(HANDED_OVER, {
            "from_partition": home.partition, "to_partition": home.moving_to, "epoch": home.epoch,
            "handover_id": home.handover_id or "", "part": i, "parts": len(parts), "drain_offset": drain_offset,
            "history": [*home.history, home.partition], "items": part},
            entitlement=entitlement, entity_id=entitlement, producer=PRODUCER, causation_id=home.handover_id,
            timestamp_ms=now_ms, event_id=derived_event_id(home.handover_id, HANDED_OVER, home.epoch, i)))
    return without(state, entitlement), replace(home, sent=True, drain_offset=drain_offset), events


def without(state: SchedulerState, entitlement: str) -> SchedulerState:
    """``state`` without the entitlement and its jobs (the machines known down stay: another entitlement's jobs may
    know them too)."""
    gone = [j.id for j in jobs_of(state, entitlement)]
    ents = {k: v for k, v in state.entitlements.items() if k != entitlement}
    return replace(state, entitlements=MappingProxyType(ents), jobs=state.jobs.without(gone))


# -- 3. adopted by the partition it goes to ---------------------------------------------------------------------------

def adopt(state: SchedulerState, home: Home | None, ev: Event, partition: int
          ) -> tuple[SchedulerState, Home | None]:
    """Take one part of an ``EntitlementHandedOver`` for ``partition``: its entitlement, jobs and down machines join the
    state; the home says which parts are in, and once they all are, that the entitlement lives here. A part of a
    hand-over adopted already, or of an older one, changes nothing (the same state, the same home)."""
    p = ev.payload
    epoch, n, total = p["epoch"], p["part"], p["parts"]
    if p["to_partition"] != partition:
        return state, home  # not for this partition (a record on the wrong partition of handoff): ignored
    if home is not None:
        if home.epoch > epoch or (home.epoch == epoch and (not home.arriving or n in home.parts)):
            return state, home  # an older hand-over, this one complete already, or this part taken already
        if home.moving_to is not None and home.epoch >= epoch:
            return state, home
    taken = () if home is None or not home.arriving or home.epoch != epoch else home.parts
    state = _take_items(state, ev.entitlement, p["items"])
    taken = tuple(sorted({*taken, n}))
    if len(taken) >= total:
        new = Home(partition, epoch, handover_id=p["handover_id"], history=tuple(p["history"]),
                   drain_offset=p["drain_offset"])
    else:
        new = Home(partition, epoch, handover_id=p["handover_id"], parts=taken, parts_total=total,
                   history=tuple(p["history"]), drain_offset=p["drain_offset"])
    return state, new


def job_ids_of(ev: Event) -> list[str]:
    """The jobs an ``EntitlementHandedOver`` part carries (the shard loads them: a part adds to what earlier ones
    brought)."""
    out = []
    for text in ev.payload["items"]:
        doc = json.loads(text)
        if "job" in doc:
            out.append(doc["job"]["id"])
    return sorted(set(out))


def _take_items(state: SchedulerState, entitlement: str, items: Iterable[str]) -> SchedulerState:
    ents = dict(state.entitlements)
    down = dict(state.machines_down)
    jobs: dict[str, Job] = {}
    for text in items:
        doc = json.loads(text)
        if "entitlement" in doc:
            ents[entitlement] = Entitlement(**doc["entitlement"])
        elif "job" in doc:
            job_id = doc["job"]["id"]
            job = jobs.get(job_id) or state.jobs.get(job_id) or job_from_record({**doc["job"], "tasks": []})
            tasks = dict(job.tasks)
            for r in doc["tasks"]:
                t = st.task_of(r)
                tasks[t.id] = t
            jobs[job.id] = replace(job, tasks=MappingProxyType(dict(sorted(tasks.items(),
                                                                            key=lambda kv: kv[1].index))))
        elif "down" in doc:
            down.update(doc["down"])
    return replace(state, entitlements=MappingProxyType(ents), jobs=state.jobs.updated(jobs),
                   machines_down=MappingProxyType(down))


# -- the map -----------------------------------------------------------------------------------------------------------

def map_entry(entitlement: str, home: Home, weight: int, reason: str) -> MapEntry:
    """What the partition map says of an entitlement whose home (here, or leaving) is ``home``."""
    if home.moving_to is not None:
        return MapEntry(entitlement, home.partition, home.epoch, home.moving_to, home.history, home.drain_offset,
                        weight, reason)
    return MapEntry(entitlement, home.partition, home.epoch, None, home.history, home.drain_offset, weight, reason)


__all__ = ["DECIDE", "FORWARD", "HANDED_OVER", "HOLD", "Home", "MOVE_REQUESTED", "REASON_ALREADY_THERE",
           "REASON_INVALID_PARTITION", "Route", "adopt", "begin", "hand_over", "home_key", "home_of", "home_record",
           "items_of", "job_ids_of", "jobs_of", "map_entry", "route", "storage_key", "without"]
