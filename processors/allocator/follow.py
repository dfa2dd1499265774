"""Follow the log into a fold of the region, as the allocator does, for processors that decide on the allocator's
view without being the allocator (the ReBalancer, Sidekick).

    follower = Follower(cfg, registry, target, topics=SOURCES + extra, types=..., name="rebalancer")
    follower.catch_up()          # the log as it is, merged in causal order (fold.merged), into target.apply
    while ...: follower.poll()   # then each record as it arrives

``target`` is anything with ``apply(event, (topic, partition, offset))`` (a ``RegionFold``, or a view around one).
A record the target cannot apply (``FoldError``) is counted and logged, not dead-lettered: the allocator, which
reads the same records, dead-letters them once. A record that does not prove its writer (streams/auth.py) is refused
by the reading itself, and dead-lettered with ``dead_letters`` (Sidekick's: the host-profile answers it acts on).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Protocol

from infra.config import Config
from processors.allocator.fold import FoldError, merged
from streams.clients import EventConsumer
from streams.events import Event
from streams.replay import Replay, ReplayFilter
from streams.serde import SchemaRegistry
from streams.topics import Topics

log = logging.getLogger(__name__)

SOURCES = ("intents", "machines", "unavailability", "allocations")  # what the allocator folds (processor.SOURCES)


class Target(Protocol):
    def apply(self, event: Event, position: tuple[str, int, int]) -> Any: ...


class Follower:
    def __init__(self, cfg: Config, registry: SchemaRegistry, target: Target, *, topics: Iterable[str] = SOURCES,
                 types: Iterable[str] | None = None, name: str = "follower", dead_letters=None):
        self.cfg, self.registry, self.target, self.name = cfg, registry, target, name
        self.dead_letters = dead_letters
        self.topics = tuple(topics)
        self.types = None if types is None else frozenset(types)
        self.failed = 0  # records the target could not apply
        self.ends: dict[tuple[str, int], int] = {}
        self.consumer: EventConsumer | None = None

    def _apply(self, event: Event, position: tuple[str, int, int]) -> None:
        try:
            self.target.apply(event, position)
        except FoldError as exc:
            self.failed += 1
            log.warning("%s: %s at %s[%d]@%d not applied: %s", self.name, event.type, *position, exc)

    def catch_up(self, stall_timeout_s: float = 60.0) -> dict[str, int]:
        """Fold the log as it is now, in ``merged`` order; the live reading starts where this ended."""
        run = Replay(self.cfg, self.registry, ReplayFilter(topics=self.topics, types=self.types),
                     stall_timeout_s=stall_timeout_s, dead_letters=self.dead_letters)
        parts: dict[tuple[str, int], list] = defaultdict(list)
        for rec in run:
            parts[(rec.topic, rec.partition)].append((rec.event, (rec.topic, rec.partition, rec.offset)))
        n = 0
        for event, position in merged(parts):
            self._apply(event, position)
            n += 1
        self.ends = dict(run.ends)
        return {"records": n, "failed": self.failed}

    def poll(self, max_records: int = 5000, timeout_s: float = 0.2) -> int:
        """Apply the records that arrived (at most ``max_records``, waiting up to ``timeout_s`` for the first)."""
        if self.consumer is None:
            names = Topics(self.cfg.topic_prefix, self.cfg.partitions)
            self.consumer = EventConsumer(self.cfg, self.registry, [names.name(t) for t in self.topics],
                                          name=self.name, start_offsets=self.ends, types=self.types,
                                          dead_letters=self.dead_letters, follows=True)
        records = self.consumer.poll(max_records, timeout_s, linger_s=0.0)
        for rec in records:
            self._apply(rec.event, (rec.topic, rec.partition, rec.offset))
        return len(records)

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
