"""The Health Check Service process: thin confluent-kafka wiring around ``decide.py`` (and the Resource
Broker's pure ``machines_failed`` / ``machines_recovered`` for the unavailability events).

    python -m processors.health.processor --timeout-ms T --tick-ms K [--grace-ms G]

(Config from the environment: ``infra.config.Config.from_env``.) confluent-kafka, not faust: heartbeats are
high volume and a faust agent reads only ~12k records/s.

```
 machines (from the beginning) ──► on_machine_event ─► HealthState   (which machines, status, owner key)
                               └─► resourcebroker.apply ─► BrokerState (status reason, failure UE ids)
 heartbeats (from the end) ──────► skimmed (Beat) ─► on_beats (a poll's) ─► UNHEALTHY→UP heartbeat_resumed
                               └─ DOWN by health_check, newer heartbeat
                                   ─► machines_recovered(reason heartbeat_resumed)
                                   ─► MachinesStatusChanged DOWN→UP + UnavailabilityEnded
 timer, every K ms ──────────────► on_tick(now, T) ─► UP→UNHEALTHY heartbeat_missed
                               └─ UNHEALTHY for ≥ G ms ─► machines_failed(REASON_HEALTH_CHECK)
                                   ─► MachinesStatusChanged UNHEALTHY→DOWN + UnavailabilityStarted FAILURE
```

**In batches.** Every status change is announced for many machines at once: one MachinesStatusChanged (and one
UnavailabilityStarted / UnavailabilityEnded) per owner key per tick, or per poll of heartbeats, however many
machines it concerns (1% of a 100,000-machine region failing is a handful of events, not 2,000), so the
scheduler asks for all replacements of a tick in one AllocationRequested per job.

How the two combine (resourcebroker README, "Left to the wiring"): the UNHEALTHY verdict opens no UE by
itself; after a grace period (``--grace-ms``, default 0: at once, in the same tick) the process asks the
broker's pure ``machines_failed(..., REASON_HEALTH_CHECK)`` for the DOWN status and the FAILURE UE, so the
scheduler moves the machines' tasks. A machine the health check failed comes back when its heartbeats do:
``machines_recovered(..., reason=heartbeat_resumed)`` emits DOWN→UP and ends that UE. A machine an operator
failed (any other reason) is not recovered by heartbeats: only ``ropewalk machine recover`` does that.
Every decision is re-taken from the log after a restart: an UNHEALTHY machine not yet failed is failed at
the next tick; a DOWN(health_check) machine whose agent heartbeats is recovered.

**Where reading starts.** ``machines`` from the beginning (to its end before the first tick), ``heartbeats``
from the end: history is not needed (silence is judged on the heartbeat's own timestamp) and the topic is
the biggest. Because the process does not know the last heartbeat of each machine at start, it restarts every
silence clock once caught up (``restart_clocks``, CLOCKS_STARTED): nobody is judged before one timeout (``T``) has
passed, so every live agent has had a chance to speak, however long the control plane was away.

**A heartbeat costs little** (issue 28): the body of an AgentHeartbeat is not decoded into an ``Event``; the skimmer
(``streams/skim.py``) walks its bytes as the writer's schema says and keeps its id, time, machine and sequence (a
``Beat``), its writer's proof checked as the ordinary decode checks it (``streams.clients.SkimReader``: the same
``identity_of`` over the same bytes, the same key check), and ``on_beats`` changes only when that machine was last
heard (``liveness.py``: a few array cells). A record the skimmer declines (unproven, keyed or proven as another
machine, another writer schema, malformed) is decoded the ordinary way, which dead-letters it with its reason.

**Protection against mass failure** (``zones.py``, README): ticks pass ``DisruptionPolicy`` (the flags
``--unhealthy-zone-threshold``, ``--zone-failure-rate``, ``--secondary-zone-failure-rate``, ``--large-zone-size``):
a zone (DC) with many machines silent at once has them failed at a pace, a region silent everywhere none, each
zone's change announced (ZoneDisruptionChanged) and its state, silent and held machines exported as metrics. The
clocks also restart when the process sees it was away: a tick more than ``T`` after the previous one (paused, or
its loop held: ``on_tick``), or heartbeats read more than ``T/2`` late (a full poll, so a backlog waits, whose newest
heartbeat is older than that; no machine is judged until it has caught up, and then each gets ``T`` anew).

Own events are applied to both states at once and skipped when they come back on ``machines`` (an id set),
so a tick never sees its own verdict undone by the log's slower echo. A bad record goes to ``deadletter``
(EventConsumer + DeadLetters), and so does a heartbeat or machine event that does not prove its writer (a machine's
own key for its heartbeats, a component's for its verdicts: streams/auth.py) or a heartbeat dated more than
``MAX_CLOCK_SKEW_MS`` ahead of the service's clock (``from_the_future``); a handler that raises is logged to stderr, its record dead-lettered as
``processing_failed``, and the loop goes on; a tick that raises is logged and retried at the next tick.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from confluent_kafka import OFFSET_END

from infra import metrics
from infra.config import Config
from processors.resourcebroker import decide as broker
from streams import batches
from streams.catchup import read_to_end
from streams.partitionmap import routed_producer
from streams.clients import BACKGROUND_READER, EventConsumer, Record, SkimReader
from streams.deadletter import DeadLetters
from streams.enums import MachineStatus
from streams.events import Event
from streams.gc_control import GrowthFreezer, folding
from streams.serde import SchemaRegistry
from streams.topics import Topics

from . import decide as d
from . import zones
from processors.worker import LoopWorker, close_clients

log = logging.getLogger("ropewalk.health")

PRODUCER = d.PRODUCER
POLL_MAX = 10000
MAX_POLL_S = 0.2
OWN_IDS_LIMIT = 100_000  # own event ids awaiting their echo; beyond this (echo lost?) the set starts over


def now_ms() -> int:
    return int(time.time() * 1000)


class Skimmed(NamedTuple):
    """A heartbeat read without decoding its body (``streams.skim``): its ``Beat``, and the raw record (decoded
    only if its processing fails, to dead-letter it). ``topic`` and ``log_timestamp_ms`` feed the lag metric."""

    beat: d.Beat
    msg: Any
    topic: str
    log_timestamp_ms: int


ZONE_STATE_VALUE = {zones.ZONE_NORMAL: 0, zones.ZONE_PARTIAL: 1, zones.ZONE_FULL: 2}  # the zone-state gauge's values


class HealthCheck(LoopWorker):
    def __init__(self, cfg: Config, timeout_ms: int, tick_ms: int, *, grace_ms: int = 0,
                 registry: SchemaRegistry | None = None, policy: zones.DisruptionPolicy | None = None):
        if timeout_ms <= 0 or tick_ms <= 0 or grace_ms < 0:
            raise ValueError("timeout and tick must be positive, grace not negative (ms)")
        self.cfg = cfg
        self.timeout_ms, self.tick_ms, self.grace_ms = timeout_ms, tick_ms, grace_ms
        self.policy = policy or zones.DisruptionPolicy()
        self.behind_ms = 0  # how old the newest heartbeat of the last full poll was (0: the last poll was not full)
        self.registry = registry or SchemaRegistry.from_dir()
        self.topics = Topics(cfg.topic_prefix, cfg.partitions)
        self.machines_topic = self.topics.name("machines")
        self.heartbeats_topic = self.topics.name("heartbeats")
        self.producer = routed_producer(cfg, self.registry, PRODUCER)
        self.dead_letters = DeadLetters(self.producer, PRODUCER)
        self.health = d.HealthState()
        self.broker = broker.BrokerState()
        self.consumer: EventConsumer | None = None
        self.skim: SkimReader | None = None  # heartbeats read without decoding them, proven (made with the consumer)
        self.skimmed = 0  # heartbeats read by the skimmer (the others were decoded: another writer schema, ...)
        self._own: set[str] = set()
        self._freezer = GrowthFreezer()  # machines registering while this process runs: streams/gc_control.py
        self._next_tick_ms = 0
        self.emitted = 0
        self.errors = 0
        self.refused_future = 0  # heartbeats dated too far ahead (d.from_the_future)

    # -- start -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        hb_start = {(self.heartbeats_topic, p): OFFSET_END
                    for p in range(self.topics.partitions_of("heartbeats"))}
        self.consumer = EventConsumer(self.cfg, self.registry, [self.machines_topic, self.heartbeats_topic],
                                      name=PRODUCER, dead_letters=self.dead_letters, start_offsets=hb_start,
                                      follows=True, **BACKGROUND_READER)
        self.skim = SkimReader(self.consumer, "heartbeats", "AgentHeartbeat", d.BEAT_FIELDS)
        t0 = time.monotonic()
        with folding(freeze=True):  # the machines this process watches from now on (streams/gc_control.py)
            n = read_to_end(self.consumer, self.handle,
                            partitions=[tp for tp in self.consumer.partitions() if tp[0] == self.machines_topic],
                            stop=self.stopping)
        self.restart_clocks(now_ms(), d.CLOCKS_STARTED)  # every live agent gets one timeout to speak
        log.info("health: caught up with %d records (%d machines watched) in %.1fs; nobody judged for %d ms", n,
                 len(self.health.machines), time.monotonic() - t0, self.timeout_ms)

    def restart_clocks(self, now: int, reason: str) -> None:
        if self.health.clocks_reason != reason or now - self.health.clocks_from_ms > self.timeout_ms:
            log.warning("health: every silence counts anew from now (%s)", reason)  # once a timeout while it lasts
        self.health = d.restart_clocks(self.health, now, reason)
        metrics.HEALTH_CLOCK_RESTARTS.labels(reason=reason).inc()

    # -- records ---------------------------------------------------------------------------------------------
    def read(self, msgs: list) -> list[Record | Skimmed]:
        """A poll's raw records (``poll_raw``), read: a heartbeat by the skimmer (no decode of its body: its id,
        time, machine and sequence), proven and placed as the ordinary decode proves and places it
        (``SkimReader``: the same check of its writer's proof over the same bytes); any other record, and a
        heartbeat the skimmer declines (unproven, keyed as another machine, another writer schema, malformed),
        decoded the ordinary way (a bad one dead-lettered with its reason there)."""
        out: list[Record | Skimmed] = []
        hb_topic, skim = self.heartbeats_topic, self.skim
        consumer = self.consumer
        assert skim is not None and consumer is not None, "read before start"
        for msg in msgs:
            if msg.topic() == hb_topic:
                v = skim.read(msg)
                if v is not None:
                    out.append(Skimmed(d.Beat(*v), msg, hb_topic, msg.timestamp()[1]))
                    continue
            rec = consumer.decode(msg)
            if rec is not None:
                out.append(rec)
        self.skimmed += sum(1 for r in out if isinstance(r, Skimmed))
        consumer.observe_lag(out)
        return out

    def handle(self, records: Sequence[Record | Skimmed]) -> None:
        """A poll's records in order; the heartbeats between two machine events are judged together
        (``on_beats``: one event per owner for the machines they resume), and the machine events between two
        heartbeats are folded together (``_fold``: a registration's thousands in one step, not one copy each). A
        heartbeat dated too far ahead is refused (``d.from_the_future``: it would blind the check to its machine)."""
        beats: list[Record | Skimmed] = []
        folds: list[Record] = []
        now = now_ms()
        for rec in records:
            if isinstance(rec, Skimmed) or rec.event.type == "AgentHeartbeat":
                self._fold(folds)
                folds = []
                if d.from_the_future(self._beat(rec), now):
                    self._from_the_future(rec, now)
                    continue
                beats.append(rec)
            else:
                self._heartbeats(beats)
                beats = []
                folds.append(rec)
        self._fold(folds)
        self._heartbeats(beats)
        self._freezer.grew(len(self.health.machines))

    def _fold(self, recs: list[Record]) -> None:
        """Machine events, in order, folded in one step into both states (our own coming back skipped: applied
        when we took them); if the batch raises, each on its own, the bad ones dead-lettered."""
        if not recs:
            return
        evs = [r.event for r in recs if r.event.type in d.APPLIED and r.event.event_id not in self._own]
        try:
            health, brk = d.apply_all(self.health, evs), broker.apply_all(self.broker, evs)
        except Exception:  # noqa: BLE001 - one bad event must not stop the service
            log.exception("health: a batch of %d machine events failed; folding them one by one", len(recs))
            for rec in recs:
                try:
                    self._handle(rec)
                except Exception as exc:  # noqa: BLE001
                    self._failed([rec], exc)
            return
        self.health, self.broker = health, brk
        self._own.difference_update(r.event.event_id for r in recs if r.event.type in d.APPLIED)

    def _from_the_future(self, rec: Record | Skimmed, now: int) -> None:
        """Refuse a heartbeat dated more than ``d.MAX_CLOCK_SKEW_MS`` after ``now``: dead-lettered, reason
        ``from_the_future`` (a skimmed one decoded for it: the dead letter holds the event)."""
        self.refused_future += 1
        full = self._decoded(rec)
        if full is not None:
            self.dead_letters.route_failed(
                full, self.registry, f"dated {full.event.timestamp_ms - now} ms after the health check's clock "
                f"(more than {d.MAX_CLOCK_SKEW_MS} ms)", log, reason=d.HB_FROM_THE_FUTURE)

    def _decoded(self, rec: Record | Skimmed) -> Record | None:
        """A skimmed heartbeat decoded the ordinary way (to dead-letter it); a decoded one as it is."""
        if isinstance(rec, Skimmed):
            assert self.consumer is not None
            return self.consumer.decode(rec.msg)
        return rec

    def _failed(self, recs: list[Record], exc: Exception) -> None:
        for rec in recs:
            self.errors += 1
            log.error("health: %s at %s[%d]@%d failed: %s", rec.event.type, rec.topic, rec.partition, rec.offset,
                      exc)
            self.dead_letters.route_failed(rec, self.registry, exc, log)

    @staticmethod
    def _beat(rec: Record | Skimmed) -> d.Beat:
        return rec.beat if isinstance(rec, Skimmed) else d.beat_of(rec.event)

    def _heartbeats(self, beats: list[Record | Skimmed]) -> None:
        if not beats:
            return
        try:
            self.on_beats([self._beat(r) for r in beats])
        except Exception:  # noqa: BLE001 - a bad batch: each heartbeat on its own, the bad ones dead-lettered
            log.exception("health: a batch of %d heartbeats failed; judging them one by one", len(beats))
            for rec in beats:
                try:
                    self.on_beats([self._beat(rec)])
                except Exception as one:  # noqa: BLE001
                    full = self._decoded(rec)
                    if full is not None:
                        self._failed([full], one)

    def _handle(self, rec: Record) -> None:
        ev = rec.event
        if ev.type in d.APPLIED:
            if ev.event_id in self._own:  # our own decision coming back: applied when we took it
                self._own.discard(ev.event_id)
                return
            self.health = d.on_machine_event(self.health, ev)
            self.broker = broker.apply(self.broker, ev)

    def on_heartbeat(self, hb: Event) -> None:
        self.on_heartbeats([hb])

    def on_heartbeats(self, heartbeats: list[Event]) -> None:
        """``on_beats`` of decoded AgentHeartbeat events."""
        self.on_beats([d.beat_of(hb) for hb in heartbeats])

    def on_beats(self, beats: list[d.Beat]) -> None:
        """Judge a poll's heartbeats: UNHEALTHY machines they resume are UP (``d.on_beats``, one event per owner);
        machines this service failed (DOWN, ``health_check``) that a counted heartbeat newer than the failure
        speaks for (``d.heard_while_failed``), and that the broker's fold holds so, are recovered together
        (``broker.machines_recovered``)."""
        before = self.health
        self.health, events = d.on_beats(self.health, beats)
        self.emit(events)
        back: dict[str, d.Beat] = {}
        for mid, b in d.heard_while_failed(before, beats).items():
            rec = self.broker.get(mid)
            if rec is not None and rec.status == MachineStatus.DOWN and rec.status_reason == broker.REASON_HEALTH_CHECK:
                back[mid] = b
        if back:
            first = next(iter(back.values()))
            _, events = broker.machines_recovered(self.broker, back, d.HEARTBEAT_RESUMED,
                                                  max(b.timestamp_ms for b in back.values()),
                                                  causation_id=first.event_id or None, producer=PRODUCER)
            self.emit(events)

    # -- timer -----------------------------------------------------------------------------------------------
    def tick(self, now: int) -> None:
        """Silent machines become UNHEALTHY, zone by zone at the policy's pace; UNHEALTHY ones past the grace fail,
        all of a tick together (``broker.machines_failed``: one MachinesStatusChanged and one
        UnavailabilityStarted per owner). While heartbeats are read late (``behind_ms`` over half the timeout), the
        clocks restart instead: the heartbeats not read yet may speak for anyone."""
        if self.behind_ms > self.timeout_ms // 2:
            self.restart_clocks(now, d.CLOCKS_READING_BEHIND)
            self.health = dataclasses.replace(self.health, last_tick_ms=now)
            return
        before = self.health
        self.health, events = d.on_tick(self.health, now, self.timeout_ms, policy=self.policy)
        if self.health.clocks_from_ms != before.clocks_from_ms:
            metrics.HEALTH_CLOCK_RESTARTS.labels(reason=self.health.clocks_reason).inc()
            log.warning("health: every silence counts anew from now (%s)", self.health.clocks_reason)
        self.export_zones(before)
        self.emit(events)
        due = []
        for mid in sorted(self.health.unhealthy):
            held = self.health.machines[mid]
            rec = self.broker.get(mid)
            if now - held.status_ms < self.grace_ms or rec is None or rec.status != MachineStatus.UNHEALTHY:
                continue
            due.append(mid)
        if not due:
            return
        cause = self.broker.get(due[0]).status_event_id or None  # the verdict (one for a tick's machines)
        try:
            _, events = broker.machines_failed(self.broker, due, broker.REASON_HEALTH_CHECK, now,
                                               causation_id=cause, producer=PRODUCER)
        except broker.BrokerError as exc:
            log.warning("health: cannot fail %d machines: %s", len(due), exc)
            return
        self.emit(events)

    def export_zones(self, before: d.HealthState) -> None:
        metrics.HEALTH_REGION_DISRUPTED.set(1 if self.health.region_disrupted else 0)
        for dc in set(before.zones) - set(self.health.zones):
            for gauge in (metrics.HEALTH_ZONE_STATE, metrics.HEALTH_ZONE_SILENT, metrics.HEALTH_ZONE_HELD):
                gauge.labels(dc=dc).set(0)
        for dc, zone in self.health.zones.items():
            metrics.HEALTH_ZONE_STATE.labels(dc=dc).set(ZONE_STATE_VALUE.get(zone.state, 0))
            metrics.HEALTH_ZONE_SILENT.labels(dc=dc).set(zone.silent)
            metrics.HEALTH_ZONE_HELD.labels(dc=dc).set(zone.held)

    # -- output ----------------------------------------------------------------------------------------------
    def emit(self, events: list[Event]) -> None:
        """Produce ``events`` (flushed: they are rare) and apply the machine events to both states now."""
        if not events:
            return
        for ev in events:
            self.producer.send(ev)
            if ev.type == d.ZONE_DISRUPTION_CHANGED:
                p = ev.payload
                log.warning("health: zone %s %s → %s (%s): %d of %d machines silent, %d held; failing %s", p["dc"],
                            p["previous_state"], p["state"], p["reason"], p["silent"], p["machines"], p["held"],
                            "every one at once" if p["failure_rate_per_s"] is None
                            else f"{p['failure_rate_per_s']:g} a second")
                continue
            log.info("health: %s %s %s %s %s", ev.type, ev.entity_id, ev.payload.get("status", ""),
                     ev.payload.get("reason", ""), f"({len(batches.machine_ids(ev))} machines)")
        self.producer.flush()
        self.emitted += len(events)
        machine_events = [ev for ev in events if ev.type in d.APPLIED]
        self.health = d.apply_all(self.health, machine_events)
        self.broker = broker.apply_all(self.broker, machine_events)
        if len(self._own) > OWN_IDS_LIMIT:
            self._own.clear()
        self._own.update(ev.event_id for ev in machine_events)

    # -- loop ------------------------------------------------------------------------------------------------
    def step(self) -> None:
        try:
            records = self.read(self.consumer.poll_raw(POLL_MAX, min(MAX_POLL_S, self.tick_ms / 1000)))
        except Exception as exc:  # noqa: BLE001 - broker hiccup: log, go on
            self.errors += 1
            log.warning("health: poll failed: %s", exc)
            time.sleep(MAX_POLL_S)
            records = []
        if records:
            self.handle(records)
        now = now_ms()
        # Behind: a full poll (a backlog waits) whose newest heartbeat is old. A poll that is not full has read up to
        # the end; on a quiet log, the fetch's wait alone makes the newest heartbeat a little old.
        beats = [self._beat(r).timestamp_ms for r in records if isinstance(r, Skimmed) or r.event.type == "AgentHeartbeat"]
        self.behind_ms = max(0, now - max(beats)) if len(records) >= POLL_MAX and beats else 0
        if now >= self._next_tick_ms:
            self._next_tick_ms = now + self.tick_ms
            try:
                self.tick(now)
                metrics.TIMER_TICKS.labels(worker=PRODUCER).inc()  # its verdicts flushed (``emit``)
            except Exception:  # noqa: BLE001
                self.errors += 1
                log.exception("health: tick at %d failed", now)

    def run(self) -> None:
        if not self.begin(self.start):  # stopped while catching up
            return
        p = self.policy
        print(f"health ready: {len(self.health.machines)} machines watched, timeout {self.timeout_ms} ms, "
              f"tick {self.tick_ms} ms, grace {self.grace_ms} ms; zones: threshold {p.unhealthy_zone_threshold:g}, "
              f"failure rate {p.full_rate_per_s:g}/s (full), {p.partial_rate_per_s:g}/s (partial, zones over "
              f"{p.large_zone_size})", flush=True)
        self.loop()

    def close(self) -> None:
        close_clients(self.consumer, self.producer, log, "health")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m processors.health.processor",
                                 description="Ropewalk Health Check Service: heartbeats → machine health.")
    ap.add_argument("--timeout-ms", type=int, required=True, help="silence after which a machine is UNHEALTHY")
    ap.add_argument("--tick-ms", type=int, required=True, help="how often silences are checked")
    ap.add_argument("--grace-ms", type=int, default=0,
                    help="UNHEALTHY this long → DOWN + FAILURE unavailability (default 0: at once)")
    p = zones.DisruptionPolicy()
    ap.add_argument("--unhealthy-zone-threshold", type=float, default=p.unhealthy_zone_threshold,
                    help="share of a zone's machines silent (at least 3) from which it is partially disrupted "
                         f"(default {p.unhealthy_zone_threshold})")
    ap.add_argument("--zone-failure-rate", type=float, default=p.full_rate_per_s,
                    help="machines failed per second in a zone fully silent while others are heard "
                         f"(default {p.full_rate_per_s})")
    ap.add_argument("--secondary-zone-failure-rate", type=float, default=p.partial_rate_per_s,
                    help=f"machines failed per second in a partially disrupted zone (default {p.partial_rate_per_s})")
    ap.add_argument("--large-zone-size", type=int, default=p.large_zone_size,
                    help=f"a partially disrupted zone of at most this many machines fails none (default "
                         f"{p.large_zone_size})")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    metrics.serve_worker(Config.from_env().run_dir, (metrics.TIMER_TICKS,))  # infra/metrics.py
    try:
        policy = zones.DisruptionPolicy(unhealthy_zone_threshold=args.unhealthy_zone_threshold,
                                        full_rate_per_s=args.zone_failure_rate,
                                        partial_rate_per_s=args.secondary_zone_failure_rate,
                                        large_zone_size=args.large_zone_size)
        hc = HealthCheck(Config.from_env().as_principal("health"), args.timeout_ms, args.tick_ms,
                         grace_ms=args.grace_ms, policy=policy)
    except ValueError as exc:
        print(f"health: {exc}", file=sys.stderr)
        return 2
    hc.stop_on_signals()
    hc.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
