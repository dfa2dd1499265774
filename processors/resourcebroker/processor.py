"""The Resource Broker process: thin wiring of confluent-kafka around the pure decisions of ``decide.py``.

    python -m processors.resourcebroker.processor --region FILE
    python -m processors.resourcebroker.processor --machines N [--dcs D] [--seed S]

(Config from the environment: ``infra.config.Config.from_env``.)

1. **Catch up**: fold the ``machines`` topic from the beginning into a BrokerState, up to where each partition
   ended when catching up started (``read_to_end``: the high watermark of the first fetch response, or
   end-of-partition), so it ends while the topic is written.
2. **Register**: ``register_all`` the region's machines against that state — only machines not registered yet
   (or whose type/capacity changed) are registered, in MachinesRegistered records of a thousand machines (keyed
   ``free/<dc>``), so a restart registers nothing twice: idempotence comes from folding the log, not from a local
   file. Its own registrations read back are passed over (they are in the state as decided).
3. **Follow** ``machines`` (to keep the state current: assignments, statuses from the Health Check Service)
   and ``unavailability`` (counted and logged; no broker decision is driven by it yet — the Ops Planner names
   maintenance windows itself). A bad record goes to ``deadletter``; a handler error is logged and skipped.

CLI-facing helpers (``ropewalk machine fail|recover``): ``fail_machine(cfg, machine_id, reason)`` and
``recover_machine(cfg, machine_id)`` each fold the whole ``machines`` topic to learn the machine's status and
owner, take the pure decision and produce its events. **Cost**: one full fold of ``machines`` per call.
Measured against the embedded broker (2 cores): ~13k machine events/s, dominated by Avro decoding — a
100k-machine region folds in ~7.6 s (``fail_machine`` ~8.7 s), a few thousand machines well under a second.
Fine for an operator's pace at thousands of machines; not for a hot path (a long-running broker would answer
from its own state, or the fold would read ``state.machines`` instead).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Iterable

from infra.config import Config
from streams import batches
from streams.catchup import CATCH_UP_TIMEOUT_S, read_to_end
from streams.partitionmap import routed_producer
from streams.clients import BACKGROUND_READER, EventConsumer, EventProducer, Record
from streams.deadletter import DeadLetters, Skipped
from streams.events import Event
from streams.gc_control import GrowthFreezer, folding
from streams.serde import SchemaRegistry
from streams.topics import Topics

from . import decide as d
from .region import RegionSpec, generate_region, iter_machines, load_region
from processors.worker import LoopWorker, close_clients

log = logging.getLogger("ropewalk.resourcebroker")

PRODUCER = d.PRODUCER
POLL_S = 0.2
POLL_MAX = 10000
REGISTER_BATCH = 5000  # machines registered (decided and produced) per step: bounded memory for big regions


def now_ms() -> int:
    return int(time.time() * 1000)


def _registry(registry: SchemaRegistry | None) -> SchemaRegistry:
    return registry or SchemaRegistry.from_dir()


# -- reading the log -----------------------------------------------------------------------------------------------

def fold_machines(cfg: Config, registry: SchemaRegistry | None = None, *,
                  timeout_s: float = CATCH_UP_TIMEOUT_S, skipped: Skipped | None = None) -> d.BrokerState:
    """The BrokerState of the whole ``machines`` topic, read from the beginning to its end (one full fold). A
    record it cannot decode is skipped and counted in ``skipped``."""
    registry = _registry(registry)
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("machines")
    consumer = EventConsumer(cfg, registry, [topic], name=f"{PRODUCER}-fold", skipped=skipped)
    state = d.BrokerState()
    try:
        def fold(records: list[Record]) -> None:
            nonlocal state
            state = d.apply_all(state, (r.event for r in records))

        read_to_end(consumer, fold, timeout_s=timeout_s)
    finally:
        consumer.close()
    return state


def produce(producer: EventProducer, events: Iterable[Event]) -> list[str]:
    """Send ``events`` (each to its own topic, keyed per the catalogue), flush, return their ids."""
    ids = []
    for ev in events:
        producer.send(ev, validate=False)
        ids.append(ev.event_id)
    producer.flush()
    return ids


# -- CLI-facing helpers --------------------------------------------------------------------------------------------

def fail_machine(cfg: Config, machine_id: str, reason: str = d.REASON_OPERATOR, *,
                 registry: SchemaRegistry | None = None, now: int | None = None,
                 skipped: Skipped | None = None, principal: str | None = None) -> list[str]:
    """Mark ``machine_id`` DOWN: MachineStatusChanged(→DOWN) on ``machines`` and UnavailabilityStarted(FAILURE)
    on ``unavailability``, both keyed to its owner (entitlement or ``free/<dc>``). Returns the event ids (empty
    if it is DOWN already). Raises ``decide.UnknownMachine`` for a machine never registered.
    Cost: one full fold of the ``machines`` topic per call."""
    registry = _registry(registry)
    state = fold_machines(cfg, registry, skipped=skipped)
    _, events = d.machine_failed(state, machine_id, reason, now_ms() if now is None else now)
    return _produce_once(cfg, registry, events, principal)


def recover_machine(cfg: Config, machine_id: str, reason: str = d.REASON_OPERATOR, *,
                    registry: SchemaRegistry | None = None, now: int | None = None,
                    skipped: Skipped | None = None, principal: str | None = None) -> list[str]:
    """Bring a DOWN machine back: MachineStatusChanged(DOWN→UP) and UnavailabilityEnded of its failure's UE,
    keyed to its owner. Returns the event ids (empty if it is UP already). Raises ``decide.UnknownMachine``,
    or ``decide.IllegalStatusTransition`` if it is UNHEALTHY or in MAINTENANCE.
    Cost: one full fold of the ``machines`` topic per call."""
    registry = _registry(registry)
    state = fold_machines(cfg, registry, skipped=skipped)
    _, events = d.machine_recovered(state, machine_id, reason, now_ms() if now is None else now)
    return _produce_once(cfg, registry, events, principal)


def power_event(cfg: Config, action: str, targets: list[str], *, registry: SchemaRegistry | None = None,
                now: int | None = None, skipped: Skipped | None = None, principal: str | None = None) -> list[Event]:
    """A power loss (``action`` ``loss``) of the fault domains ``targets`` (``dc:<dc>``, ``msb:<dc>/<msb>``,
    ``rack:<dc>/<msb>/<rack>``), as a power controller or an operator announces it: DOWN (reason power) and an
    UnavailabilityStarted POWER per owner for every machine there not down already; or power back (``restore``):
    those DOWN for a power loss UP again and their POWER UEs ended. Returns the events produced (none: nothing to
    do). Raises ``decide.BadTarget``. Cost: one full fold of the ``machines`` topic per call."""
    decide = {POWER_LOSS: d.power_lost, POWER_RESTORE: d.power_restored}.get(action)
    if decide is None:
        raise ValueError(f"action: expected {POWER_LOSS} or {POWER_RESTORE}, got {action!r}")
    registry = _registry(registry)
    state = fold_machines(cfg, registry, skipped=skipped)
    _, events = decide(state, targets, now_ms() if now is None else now)
    _produce_once(cfg, registry, events, principal)
    return events


POWER_LOSS, POWER_RESTORE = "loss", "restore"  # power_event's actions


def _produce_once(cfg: Config, registry: SchemaRegistry, events: list[Event], principal: str | None = None
                  ) -> list[str]:
    """Produce ``events`` (an operator's action: ``principal`` asked for it, recorded in their envelopes)."""
    if not events:
        return []
    producer = EventProducer(cfg, registry, PRODUCER)
    return produce(producer, [dataclasses.replace(ev, principal=principal) for ev in events])


# -- the process ---------------------------------------------------------------------------------------------------

class ResourceBroker(LoopWorker):
    """Catches up with ``machines``, registers the region, then follows ``machines`` and ``unavailability``."""

    def __init__(self, cfg: Config, region: RegionSpec, *, registry: SchemaRegistry | None = None):
        self.cfg = cfg
        self.region = region
        self.registry = _registry(registry)
        self.topics = Topics(cfg.topic_prefix, cfg.partitions)
        self.producer = routed_producer(cfg, self.registry, PRODUCER)
        self.dead_letters = DeadLetters(self.producer, PRODUCER)
        self.state = d.BrokerState()
        self.consumer: EventConsumer | None = None
        self.registered = 0  # machines registered by this process
        self._own: set[str] = set()  # ids of the registrations it produced, applied as decided: passed over when read
        self.unavailability_seen = 0
        self.errors = 0
        self._freezer = GrowthFreezer()  # machines registering while this process runs: streams/gc_control.py

    def start(self) -> None:
        """Catch up with the log, then register what is missing. After this, ``step`` follows the topics."""
        machines = self.topics.name("machines")
        self.consumer = EventConsumer(self.cfg, self.registry, [machines, self.topics.name("unavailability")],
                                      name=PRODUCER, dead_letters=self.dead_letters, follows=True, **BACKGROUND_READER)
        t0 = time.monotonic()
        with folding(freeze=True):  # the registry this process holds from now on (streams/gc_control.py)
            n = read_to_end(self.consumer, self.handle,
                            partitions=[tp for tp in self.consumer.partitions() if tp[0] == machines],
                            stop=self.stopping)
            log.info("resourcebroker: caught up with %d records (%d machines known) in %.1fs", n, len(self.state),
                     time.monotonic() - t0)
            self.register_region()

    def register_region(self) -> int:
        """``register_all`` the region in batches; produce and flush. Returns how many were registered."""
        ts = now_ms()
        batch: list = []
        before = self.registered

        def flush_batch() -> None:
            self.state, events = d.register_all(self.state, batch, ts)
            produce(self.producer, events)
            self._own.update(ev.event_id for ev in events)
            self.registered += sum(len(batches.machine_registrations(ev)) for ev in events)
            batch.clear()

        for m in iter_machines(self.region):
            batch.append(m)
            if len(batch) >= REGISTER_BATCH:
                flush_batch()
        if batch:
            flush_batch()
        n = self.registered - before
        log.info("resourcebroker: region %s: %d machines, %d newly registered", self.region.name,
                 self.region.n_machines, n)
        return n

    def handle(self, records: list[Record]) -> None:
        """Fold machine events; count unavailability. A failing batch is retried record by record, and a
        record that still fails is logged and dead-lettered, so one bad event never stops the broker."""
        try:
            self._handle(records)
        except Exception:  # noqa: BLE001
            for rec in records:
                try:
                    self._handle([rec])
                except Exception as exc:  # noqa: BLE001
                    self.errors += 1
                    log.exception("resourcebroker: %s at %s[%d]@%d failed", rec.event.type, rec.topic,
                                  rec.partition, rec.offset)
                    self.dead_letters.route_failed(rec, self.registry, exc, log)

    def _handle(self, records: list[Record]) -> None:
        own = self._own
        machine_events = [r.event for r in records if r.event.type in d.MACHINE_EVENTS
                          and (not own or r.event.event_id not in own)]  # its own registrations: in the state
        if own:
            own.difference_update(r.event.event_id for r in records)
        if machine_events:
            self.state = d.apply_all(self.state, machine_events)
        for r in records:
            if r.event.type in ("UnavailabilityStarted", "UnavailabilityEnded"):
                self.unavailability_seen += 1
                log.debug("resourcebroker: %s %s %s", r.event.type, r.event.entitlement,
                         r.event.payload.get("machine_ids"))

    def step(self) -> None:
        try:
            records = self.consumer.poll(POLL_MAX, POLL_S)
        except Exception as exc:  # noqa: BLE001 - broker hiccup: log, go on
            self.errors += 1
            log.warning("resourcebroker: poll failed: %s", exc)
            time.sleep(POLL_S)
            return
        if records:
            self.handle(records)
            self._freezer.grew(len(self.state))

    def run(self) -> None:
        if not self.begin(self.start):  # stopped while catching up: no registration from a partial registry
            return
        print(f"resourcebroker ready: {len(self.state)} machines, {self.registered} registered", flush=True)
        self.loop()

    def close(self) -> None:
        close_clients(self.consumer, self.producer, log, "resourcebroker")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m processors.resourcebroker.processor",
                                 description="Ropewalk Resource Broker: registers a region, follows machines.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--region", help="region spec file (YAML, or JSON for .json)")
    src.add_argument("--machines", type=int, help="generate a simulated region of N machines")
    ap.add_argument("--dcs", type=int, default=2, help="DCs of a generated region (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of a generated region (default 0)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from infra import metrics  # noqa: PLC0415 - start-up: prometheus_client (~20 ms); main only

    metrics.serve_worker(Config.from_env().run_dir)  # infra/metrics.py; `ropewalk up` lists the targets
    try:
        region = load_region(args.region) if args.region else generate_region(args.machines, args.dcs, args.seed)
    except ValueError as exc:
        print(f"resourcebroker: {exc}", file=sys.stderr)
        return 2
    broker = ResourceBroker(Config.from_env().as_principal("resourcebroker"), region)
    broker.stop_on_signals()
    broker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
