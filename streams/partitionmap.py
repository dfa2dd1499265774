"""The entitlement → partition map: which partition of the entitlement-keyed topics each entitlement lives on.

Twine shards its schedulers by entitlement: a new entitlement goes to the least-loaded shard, and one can move to
another shard without restarting its tasks (the seeds, §3.1). Here a shard is the set of partitions a scheduler
process owns through its consumer group, so an entitlement's shard is its partition. Which partition that is, is
a fact on the log: the compacted topic ``partitionmap`` holds, per entitlement, its latest
``EntitlementPartitionAssigned`` (``MapEntry``); an entitlement without one lives on its key's hash partition (what
every producer did before the map, and still does for the free pool's ``free/<dc>`` keys).

Who writes it: the front end when it creates an entitlement (``least_loaded``: on the scheduler shard whose
entitlements' quotas sum least, its partition whose quotas sum least), the scheduler shard an entitlement leaves
(``moving_to`` set: producers still send to the old partition, whose shard forwards) and the shard that adopts it
(``partition`` the new one). The hand-over itself is the scheduler's (``processors/scheduler/handover.py`` and its
README, "Moving an entitlement").

Who reads it: every producer of entitlement-keyed records routes by it (``EventProducer(route=...)`` with a
``MapFollower``, a thread that follows the topic); a producer that has not seen the latest record sends to the old
partition, whose shard forwards the record: the map is an optimisation for producers, never a condition of
correctness. The allocator reads it to order an entitlement's requests across a move (``drain_offset``), replay to
find every partition an entitlement's events are on (``history``).

``MapEntry``, ``PartitionMap`` and ``least_loaded`` are pure; ``MapFollower`` and ``read_map`` read the topic.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streams.events import Event, derived_event_id, new_event
from streams.partitioner import partition_for
from streams.serde import SchemaRegistry
from streams.topics import Topics

log = logging.getLogger(__name__)

TOPIC = "partitionmap"
EVENT = "EntitlementPartitionAssigned"
REASON_CREATED = "created"  # the front end placed a new entitlement
REASON_MOVING = "moving"  # the shard it leaves: a move is under way
REASON_MOVED = "moved"  # the shard it moved to adopted it
REASON_HELD = "held"  # a shard republished where an entitlement it holds lives (its weight changed, or it had none)


@dataclass(frozen=True)
class MapEntry:
    """Where an entitlement lives (the payload of an ``EntitlementPartitionAssigned``)."""

    entitlement: str
    partition: int  # where producers send its records
    epoch: int = 0  # how many times it moved
    moving_to: int | None = None  # a move under way: where it goes
    history: tuple[int, ...] = ()  # where it lived before ``partition``, oldest first
    drain_offset: int | None = None  # the end of allocations' previous partition when it left
    weight: int = 0  # its quota in machines (least_loaded)
    reason: str = ""

    @classmethod
    def of(cls, event: Event) -> "MapEntry":
        p = event.payload
        return cls(event.entitlement, p["partition"], p.get("epoch", 0), p.get("moving_to"),
                   tuple(p.get("history") or ()), p.get("drain_offset"), p.get("weight", 0), p.get("reason", ""))

    def payload(self) -> dict[str, Any]:
        return {"partition": self.partition, "epoch": self.epoch, "moving_to": self.moving_to,
                "history": list(self.history), "drain_offset": self.drain_offset, "weight": self.weight,
                "reason": self.reason}

    def same_place(self, other: "MapEntry | None") -> bool:
        """Whether ``other`` says the same of where the entitlement lives (its reason aside)."""
        return other is not None and (self.partition, self.epoch, self.moving_to, self.history, self.drain_offset,
                                      self.weight) == (other.partition, other.epoch, other.moving_to, other.history,
                                                       other.drain_offset, other.weight)

    @property
    def partitions_ever(self) -> tuple[int, ...]:
        """Every partition the entitlement's records may be on: before, now, and where it moves."""
        out = [*self.history, self.partition]
        if self.moving_to is not None:
            out.append(self.moving_to)
        return tuple(dict.fromkeys(out))


@dataclass
class PartitionMap:
    """The latest entry per entitlement (a fold of the topic) and the partition count of the keyed topics."""

    partitions: int
    entries: dict[str, MapEntry] = field(default_factory=dict)

    def apply(self, event: Event | None, key: str | None = None) -> None:
        """Fold one record: an assignment, or a tombstone (``event`` None) of entitlement ``key``."""
        if event is None:
            if key is not None:
                self.entries.pop(key, None)
            return
        if event.type == EVENT:
            self.entries[event.entitlement] = MapEntry.of(event)

    def entry(self, entitlement: str) -> MapEntry | None:
        return self.entries.get(entitlement)

    def partition_of(self, entitlement: str) -> int:
        """The partition a record of ``entitlement`` goes to: its entry's, else its key's hash partition."""
        e = self.entries.get(entitlement)
        return e.partition if e is not None else partition_for(entitlement, self.partitions)

    def partitions_ever(self, entitlement: str) -> tuple[int, ...]:
        """Every partition ``entitlement``'s records may be on (replay reads these)."""
        e = self.entries.get(entitlement)
        home = partition_for(entitlement, self.partitions)
        if e is None:
            return (home,)
        return tuple(dict.fromkeys((home, *e.partitions_ever)))


def least_loaded(entries: Iterable[MapEntry], partitions: int, weight: int = 0,
                 owners: Mapping[int, str] | None = None) -> int:
    """The partition a new entitlement goes to. With ``owners`` (partition -> the scheduler shard that owns it: the
    group's assignment, ``streams.groups.owners``): the least-loaded shard first — the one whose entitlements'
    quotas (``weight``, machines) sum least, then the one with fewest entitlements, then the one with the lowest
    partition — and on it, its least-loaded partition by the same order. Without owners, or when one partition has
    none (no shard running, a rebalance under way, the group not asked), the least-loaded partition by that order.
    A move under way counts at its destination. Pure.

    Machines, because a shard's work grows with the machines its entitlements hold (Twine sizes shards by machines:
    ~50K per shard, 20 shards for a million); the quota is what an entitlement may hold, known when it is created.
    Shards before partitions, because the assignor decides which partitions a shard gets: the least-loaded
    partitions may all be one shard's (the lowest, when several are empty), and Twine places by shard."""
    load = [0] * partitions
    count = [0] * partitions
    for e in entries:
        p = e.moving_to if e.moving_to is not None else e.partition
        if 0 <= p < partitions:
            load[p] += max(e.weight, 0)
            count[p] += 1
    candidates: Sequence[int] = range(partitions)
    if owners is not None and all(owners.get(p) is not None for p in candidates):
        shards: dict[str, list[int]] = {}
        for p in candidates:
            shards.setdefault(owners[p], []).append(p)
        candidates = min(shards.values(), key=lambda ps: (sum(load[p] for p in ps), sum(count[p] for p in ps), ps[0]))
    return min(candidates, key=lambda p: (load[p], count[p], p))


class MapFollower:
    """Follows ``partitionmap`` in a thread of its own and keeps a ``PartitionMap`` of it: ``partition_of`` is what
    an ``EventProducer`` routes by (pass the follower as its ``route``). ``catch_up`` waits until the map holds
    everything on the topic when it was called (a reader that must not judge on a stale map)."""

    POLL_S = 0.2

    def __init__(self, cfg, registry=None, *, name: str = "partitionmap"):
        from streams.clients import EventConsumer, OffsetQueries  # noqa: PLC0415 - start-up: confluent-kafka, CLI path
        self.cfg = cfg
        topics = Topics(cfg.topic_prefix, cfg.partitions)
        self.topic = topics.name(TOPIC)
        self.map = PartitionMap(cfg.partitions)
        self._consumer = EventConsumer(cfg, registry or SchemaRegistry.from_dir(), [self.topic], name=name,
                                       types=(EVENT,))
        self._offsets = OffsetQueries(cfg, "partitionmap")  # a client of its own for the ends of partitions
        self._position = 0  # the next offset to read
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-follower", daemon=True)
        self.errors = 0

    @classmethod
    def start(cls, cfg, registry=None, *, wait_s: float = 10.0, name: str = "partitionmap") -> "MapFollower":
        """A follower, started, once it has read the map as it is now (at most ``wait_s``: a producer that starts
        before it does sends to hash partitions meanwhile, which forward)."""
        f = cls(cfg, registry, name=name)
        f._thread.start()
        if wait_s > 0:
            f.catch_up(wait_s)
        return f

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                msgs = self._consumer.poll_raw(500, self.POLL_S)
            except Exception as exc:  # noqa: BLE001 - the broker away: try again (the map only routes)
                self.errors += 1
                log.warning("partition map: %s", exc)
                time.sleep(self.POLL_S)
                continue
            with self._cond:
                for msg in msgs:
                    key = msg.key().decode("utf-8", "replace") if msg.key() is not None else None
                    if msg.value() is None:
                        self.map.apply(None, key)
                    else:
                        rec = self._consumer.decode(msg)
                        if rec is not None:
                            self.map.apply(rec.event)
                    self._position = msg.offset() + 1
                for (t, _), offset in list(self._consumer.eof_offsets.items()):
                    if t == self.topic:
                        self._position = max(self._position, offset)
                self._cond.notify_all()

    def catch_up(self, timeout_s: float = 10.0) -> bool:
        """Wait until every record on the topic now is in the map; False if that took longer than ``timeout_s``."""
        try:
            high = self.high_watermark(self.topic, 0)
        except Exception as exc:  # noqa: BLE001 - the broker away: judge on what is known
            log.warning("partition map: cannot read the end of %s: %s", self.topic, exc)
            return False
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._position < high:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, self.POLL_S))
        return True

    def high_watermark(self, topic: str, partition: int, timeout_s: float = 10.0) -> int:
        """The broker's end of ``topic``'s ``partition`` now (ListOffsets): a scheduler's drain offset."""
        return self._offsets.high_watermark(topic, partition, timeout_s)

    def partition_of(self, entitlement: str) -> int:
        with self._cond:
            return self.map.partition_of(entitlement)

    def __call__(self, entitlement: str) -> int:  # EventProducer's ``route``
        return self.partition_of(entitlement)

    def entry(self, entitlement: str) -> MapEntry | None:
        with self._cond:
            return self.map.entry(entitlement)

    def entries(self) -> dict[str, MapEntry]:
        with self._cond:
            return dict(self.map.entries)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self._consumer.close()
        self._offsets.close()


def read_map(cfg, registry=None, timeout_s: float = 10.0) -> PartitionMap:
    """The map as it is on the log now (a one-shot command's)."""
    f = MapFollower.start(cfg, registry, wait_s=0)
    try:
        f.catch_up(timeout_s)
        return PartitionMap(cfg.partitions, f.entries())
    finally:
        f.close()


def assignment_event(entry: MapEntry, *, producer: str, cause: str | None = None, timestamp_ms: int | None = None,
                     event_id: str | None = None, principal: str | None = None) -> Event:
    """The ``EntitlementPartitionAssigned`` that records ``entry``. The adoption of a move (``REASON_MOVED``) is one
    event however often it is published: the shard publishes it after the batch that adopted it and again from its
    timer while its map follower has not read it back (a busy machine), under the id of the entitlement's epoch."""
    if event_id is None and entry.reason == REASON_MOVED:
        event_id = derived_event_id(EVENT, REASON_MOVED, entry.entitlement, entry.epoch)
    return new_event(EVENT, entry.payload(), entitlement=entry.entitlement, entity_id=entry.entitlement,
                     producer=producer, causation_id=cause, timestamp_ms=timestamp_ms, event_id=event_id,
                     principal=principal)


def routed_producer(cfg, registry, name: str, **conf):
    """An ``EventProducer`` that routes by a ``MapFollower`` of its own (a worker's), closed with it
    (``stop_following``, which ``processors.worker.close_clients`` calls)."""
    from streams.clients import EventProducer  # noqa: PLC0415 - start-up: confluent-kafka ~35 ms; CLI path

    return EventProducer(cfg, registry, name, route=MapFollower.start(cfg, registry, name=f"{name}-map"),
                         owns_route=True, **conf)


def entries_of(mapping: Mapping[str, MapEntry]) -> list[MapEntry]:
    return [mapping[k] for k in sorted(mapping)]


__all__ = ["EVENT", "MapEntry", "MapFollower", "PartitionMap", "REASON_CREATED", "REASON_HELD", "REASON_MOVED",
           "REASON_MOVING", "TOPIC", "assignment_event", "entries_of", "least_loaded", "read_map", "routed_producer"]
