"""The loop shared by the upper floors' workers (Job Control Plane, SRM, the Resource Broker's loans): fold some
topics from their beginning, then follow them, deciding as records come and on a timer. Thin wiring: the
decisions are each package's pure ``decide``.

    class Lender(Follower):
        TOPICS = ("machines", "intents")     # logical names, every partition, from offset 0
        TYPES = frozenset({...})             # decoded; records of other types are passed over by their header
        def handle(self, records, live) -> list[Event]: ...   # fold; decide only when ``live``
        def tick(self, now_ms) -> list[Event]: ...             # every TICK_S while following

1. **Catch up**: ``handle(records, live=False)`` over the topics up to where they ended when the worker started
   (``streams.catchup.read_to_end``); nothing is produced. The worker's own events on those topics are
   facts it folds like any other (a restarted worker knows what it decided). ``caught_up()`` then returns what
   must still be produced (a decision made but not produced before a crash), if the worker can tell.
2. **Follow**: each poll's records through ``handle(records, live=True)``, then ``tick(now)`` every ``TICK_S``;
   what they return is produced and flushed before the next poll.

A batch whose handling raises is handled again record by record; a record that still raises is dead-lettered
(``processing_failed``) and the worker goes on. A record that does not decode is dead-lettered by the consumer.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from infra import metrics
from infra.config import Config
from processors.worker import LoopWorker, close_clients
from streams.catchup import read_to_end
from streams.partitionmap import routed_producer
from streams.clients import BACKGROUND_READER, EventConsumer, Record
from streams.deadletter import DeadLetters
from streams.events import Event
from streams.serde import SchemaRegistry
from streams.topics import Topics

POLL_S = 0.2
POLL_MAX = 5000


class Follower(LoopWorker):
    NAME = "follower"  # producer name (events, dead letters, client id)
    PRINCIPAL = "operator"  # who the worker is on the broker (infra/credentials.py); each worker names its own
    TOPICS: tuple[str, ...] = ()
    TYPES: frozenset[str] | None = None
    TICK_S = 1.0

    def __init__(self, cfg: Config, *, registry: SchemaRegistry | None = None, background: bool = False):
        self.cfg = cfg
        self.registry = registry or SchemaRegistry.from_dir()
        self.topics = Topics(cfg.topic_prefix, cfg.partitions)
        self.producer = routed_producer(cfg, self.registry, self.NAME)
        self.dead_letters = DeadLetters(self.producer, self.NAME)
        self.consumer: EventConsumer | None = None
        self.background = background  # a reader nobody waits on: fetches wait to fill (BACKGROUND_READER)
        self.log = logging.getLogger(f"ropewalk.{self.NAME}")
        self.errors = 0
        self.produced = 0
        self._next_tick = 0.0
        self._due_at: dict[str, int] = {}  # what ``log_time_due`` counts: the log time it last said so, by name
        self.live = False  # caught up: following, deciding

    # -- to override ---------------------------------------------------------------------------------------------
    def handle(self, records: list[Record], live: bool) -> list[Event]:
        raise NotImplementedError

    def tick(self, now_ms: int) -> list[Event]:
        return []

    def caught_up(self) -> list[Event]:
        return []

    def log_time_due(self, name: str, records: list[Record], every_ms: int) -> int | None:
        """The log time of ``records`` (their latest envelope time) when ``every_ms`` or more of it passed since this
        last said so for ``name``, else None: a chore run as the log's time passes (a fold's ``collect``), the same
        at a catch-up as when following, whatever the wall clock says."""
        now = max((r.event.timestamp_ms for r in records), default=0)
        if now - self._due_at.get(name, 0) < every_ms:
            return None
        self._due_at[name] = now
        return now

    # -- the loop ------------------------------------------------------------------------------------------------
    def start(self) -> int:
        """Catch up; produce what ``caught_up`` says is missing. Returns the records folded."""
        conf = BACKGROUND_READER if self.background else {}
        self.consumer = EventConsumer(self.cfg, self.registry, [self.topics.name(t) for t in self.TOPICS],
                                      name=self.NAME, dead_letters=self.dead_letters, types=self.TYPES, follows=True,
                                      **conf)
        t0 = time.monotonic()
        n = read_to_end(self.consumer, lambda recs: self._handle(recs, live=False), stop=self.stopping)
        missing = self.caught_up()
        self.produce(missing)
        self.live = True
        self.log.info("%s: caught up with %d records in %.1fs; %d events produced that were missing", self.NAME, n,
                      time.monotonic() - t0, len(missing))
        return n

    def step(self) -> None:
        try:
            records = self.consumer.poll(POLL_MAX, POLL_S, linger_s=0.005)
        except Exception as exc:  # noqa: BLE001 - broker hiccup: log, go on
            self.errors += 1
            self.log.warning("%s: poll failed: %s", self.NAME, exc)
            time.sleep(POLL_S)
            return
        out = self._handle(records, live=True) if records else []
        if time.monotonic() >= self._next_tick:
            self._next_tick = time.monotonic() + self.TICK_S
            try:
                out += self.tick(int(time.time() * 1000))
            except Exception:  # noqa: BLE001 - a bug in a timer decision must not stop the worker
                self.errors += 1
                self.log.exception("%s: tick failed", self.NAME)
        self.produce(out)

    def produce(self, events: Iterable[Event]) -> None:
        events = list(events)
        if not events:
            return
        for ev in events:
            self.producer.send(ev, validate=False)
        self.producer.flush()
        self.produced += len(events)

    def _handle(self, records: list[Record], live: bool) -> list[Event]:
        try:
            return self.handle(records, live)
        except Exception:  # noqa: BLE001 - record by record, to find the one that fails
            out = []
            for rec in records:
                try:
                    out += self.handle([rec], live)
                except Exception as exc:  # noqa: BLE001
                    self.errors += 1
                    self.log.exception("%s: %s at %s[%d]@%d failed", self.NAME, rec.event.type, rec.topic,
                                       rec.partition, rec.offset)
                    self.dead_letters.route_failed(rec, self.registry, exc, self.log)
            return out

    def run(self) -> None:
        if not self.begin(self.start):  # stopped while catching up
            return
        print(f"{self.NAME} ready", flush=True)
        self.loop()

    def close(self) -> None:
        close_clients(self.consumer, self.producer, self.log, self.NAME)

    def logical(self, rec: Record) -> str:
        return self.topics.logical(rec.topic) or rec.topic


def fold_log(cfg: Config, registry: SchemaRegistry, topics: Iterable[str], name: str, types, step, state, *,
             skipped=None):
    """``state`` folded by ``step(state, record) -> state`` over the logical ``topics`` read to their end (every
    partition, from the beginning): what the views show of a worker's picture (its own pure fold, no deciding)."""
    t = Topics(cfg.topic_prefix, cfg.partitions)
    consumer = EventConsumer(cfg, registry, [t.name(x) for x in topics], name=name, skipped=skipped, types=types)
    try:
        def fold(records) -> None:
            nonlocal state
            for r in records:
                state = step(state, r)

        read_to_end(consumer, fold)
    finally:
        consumer.close()
    return state


def main_of(cls: type[Follower], argv: list[str] | None = None, **kwargs) -> int:
    """``python -m`` entry of a follower: configuration from the environment, as the worker's principal; stops on
    SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    metrics.serve_worker(Config.from_env().run_dir)  # infra/metrics.py; `ropewalk up` lists the targets
    worker = cls(Config.from_env().as_principal(cls.PRINCIPAL), **kwargs)
    worker.stop_on_signals()
    worker.run()
    return 0
