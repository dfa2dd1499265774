"""The Health Check Service process on the real broker: five machines heartbeat; one goes silent → UNHEALTHY
(heartbeat_missed) for exactly that one, then DOWN + UnavailabilityStarted FAILURE (the broker's
machine_failed, health_check); its heartbeats resume → UP (heartbeat_resumed) + UnavailabilityEnded."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from infra import trust
from processors.health import decide as hd
from processors.resourcebroker import decide as bd
from processors.resourcebroker.region import generate_region, machines
from streams import batches
from streams.clients import EventConsumer, EventProducer
from streams.events import new_event
from streams.topics import Topics
from processes import start, stop, timer_ticks, value, wait_ready, worker_metrics


WORKER = "health"  # the worker name it serves its metrics under (its timer's ticks among them)
TIMEOUT_MS = 1500
TICK_MS = 200
BEAT_S = 0.2


class Heartbeats(threading.Thread):
    """Heartbeats for ``machine_ids`` every BEAT_S with increasing sequence; ``silent`` ones skip theirs."""

    def __init__(self, cfg, registry, machine_ids):
        super().__init__(daemon=True)
        self.producer = EventProducer(cfg, registry, "test-agents")
        self.machine_ids = list(machine_ids)
        self.silent: set[str] = set()
        self.seq = 0
        self.done = threading.Event()
        self.error: Exception | None = None

    def run(self):
        try:
            while not self.done.is_set():
                self.seq += 1
                for mid in self.machine_ids:
                    if mid not in self.silent:
                        self.producer.send(new_event("AgentHeartbeat", {"machine_id": mid, "running_task_ids": [],
                                                                        "sequence": self.seq},
                                                     entitlement="free/dc1", entity_id=mid, producer="test-agent"))
                self.producer.flush()
                time.sleep(BEAT_S)
        except Exception as exc:  # noqa: BLE001 - surfaced by the test
            self.error = exc

    def stop(self):
        self.done.set()
        self.join(5)


class Follow:
    """Follows topics from the beginning and keeps every record."""

    def __init__(self, cfg, registry, *logical):
        t = Topics(cfg.topic_prefix, cfg.partitions)
        self.consumer = EventConsumer(cfg, registry, [t.name(x) for x in logical], name="test-follow")
        self.records = []

    def until(self, pred, timeout_s, what):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.records += self.consumer.poll(5000, 0.2)
            if pred(self.events()):
                return self.events()
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; saw "
                             f"{[(e.type, e.entity_id, e.payload.get('status'), e.payload.get('reason')) for e in self.events()][-20:]}")

    def read_to_end(self, timeout_s: float = 20.0) -> list:
        """Read every partition up to the high watermark it has now: what is on the log now is in ``events``."""
        targets = self.consumer.high_watermarks(self.consumer.partitions())
        deadline = time.monotonic() + timeout_s
        while not self.consumer.read_up_to(targets, {}):
            assert time.monotonic() < deadline, "the test's reader did not reach the end of the log"
            self.records += self.consumer.poll(5000, 0.2)
        return self.events()

    def events(self):
        return [r.event for r in self.records]

    def close(self):
        self.consumer.close()


def ticks(run_dir) -> float:
    """The health check's timer rounds completed (their verdicts flushed), from its metrics."""
    return timer_ticks(run_dir, WORKER, hd.PRODUCER) or 0.0


def ticked(run_dir, n: int, timeout_s: float = 60.0) -> None:
    """The marker that time passed for the health check, instead of a sleep (which passes when the unwanted
    verdict is merely slow): ``n`` more of its ticks completed from now."""
    goal, deadline = ticks(run_dir) + n, time.monotonic() + timeout_s
    while ticks(run_dir) < goal:
        assert time.monotonic() < deadline, f"the health check did not tick {n} times in {timeout_s:.0f}s"
        time.sleep(0.05)


def status_changes(events, status=None):
    """Every machine's status change, one event per machine (a MachinesStatusChanged's machines each as a
    MachineStatusChanged with the machine as entity id)."""
    out = []
    for e in events:
        for m in batches.machine_statuses(e):
            if status is None or m["status"] == status:
                out.append(dataclasses.replace(e, type="MachineStatusChanged", entity_id=m["machine_id"], payload=m))
    return out


@pytest.fixture
def region(cfg, registry):
    ms = machines(generate_region(5, 1, 0))
    _, events = bd.register_all(bd.BrokerState(), ms, int(time.time() * 1000))
    p = EventProducer(cfg, registry, "test")
    for ev in events:
        p.send(ev)
    p.flush()
    return [m.id for m in ms]


@pytest.fixture
def health_proc(cfg, tmp_path):
    procs = []

    def started(*args):
        p = start(cfg, tmp_path, "processors.health.processor", "--timeout-ms", str(TIMEOUT_MS),
                  "--tick-ms", str(TICK_MS), *args, name="health", worker=WORKER)
        procs.append(p)
        return p

    yield started
    for p in procs:
        stop(p)


def test_silent_machine_fails_and_recovers(cfg, registry, region, health_proc, tmp_path):
    beats = Heartbeats(cfg, registry, region)  # the agents speak before the health check starts, as in a region
    beats.start()
    line = wait_ready(health_proc())
    assert "5 machines watched" in line, line
    follow = Follow(cfg, registry, "machines", "unavailability")
    try:
        # A few ticks: everyone heartbeats, nobody is judged (nobody could be before a timeout: clocks restart at start).
        ticked(tmp_path, 3)
        assert sum(len(batches.machine_registrations(e)) for e in follow.read_to_end()) >= 5, "the registrations"
        assert status_changes(follow.events()) == []

        victim = region[2]
        beats.silent.add(victim)
        t0 = time.monotonic()
        evs = follow.until(lambda evs: any(e.type == "UnavailabilityStarted" for e in evs),
                           (TIMEOUT_MS + TICK_MS) / 1000 + 8, "UNHEALTHY + UnavailabilityStarted")
        elapsed = time.monotonic() - t0
        assert elapsed < (TIMEOUT_MS + TICK_MS) / 1000 + 5
        unhealthy = status_changes(evs, bd.UNHEALTHY)
        assert [(e.entity_id, e.payload["reason"], e.payload["previous_status"]) for e in unhealthy] == \
            [(victim, hd.HEARTBEAT_MISSED, bd.UP)]
        assert unhealthy[0].entitlement == "free/dc1"
        down = status_changes(evs, bd.DOWN)
        assert [(e.entity_id, e.payload["reason"]) for e in down] == [(victim, bd.REASON_HEALTH_CHECK)]
        started = [e for e in evs if e.type == "UnavailabilityStarted"]
        assert len(started) == 1
        assert started[0].payload["kind"] == bd.KIND_FAILURE and started[0].payload["machine_ids"] == [victim]
        assert started[0].entitlement == "free/dc1" and started[0].payload["reason"] == bd.REASON_HEALTH_CHECK

        beats.silent.discard(victim)
        evs = follow.until(lambda evs: any(e.type == "UnavailabilityEnded" for e in evs), 10,
                           "UP + UnavailabilityEnded")
        up = status_changes(evs, bd.UP)
        assert [(e.entity_id, e.payload["reason"], e.payload["previous_status"]) for e in up] == \
            [(victim, hd.HEARTBEAT_RESUMED, bd.DOWN)]
        ended = [e for e in evs if e.type == "UnavailabilityEnded"]
        assert len(ended) == 1 and ended[0].payload["unavailability_id"] == started[0].payload["unavailability_id"]
        assert ended[0].entitlement == "free/dc1"

        # Stays healthy: no more status changes for anyone over a few timeouts (of its ticks).
        ticked(tmp_path, 2 * TIMEOUT_MS // TICK_MS)
        follow.read_to_end()
        assert len(status_changes(follow.events())) == 3
        assert beats.error is None
    finally:
        beats.stop()
        follow.close()


def test_grace_period_resume_opens_no_unavailability(cfg, registry, region, health_proc, tmp_path):
    """With a grace period, a machine that speaks again before it ends goes UNHEALTHY → UP, no UE."""
    beats = Heartbeats(cfg, registry, region)
    beats.start()
    wait_ready(health_proc("--grace-ms", "60000"))
    follow = Follow(cfg, registry, "machines", "unavailability")
    try:
        ticked(tmp_path, 3)
        victim = region[0]
        beats.silent.add(victim)
        follow.until(lambda evs: status_changes(evs, bd.UNHEALTHY), (TIMEOUT_MS + TICK_MS) / 1000 + 8, "UNHEALTHY")
        beats.silent.discard(victim)
        evs = follow.until(lambda evs: status_changes(evs, bd.UP), 10, "UP")
        assert [(e.entity_id, e.payload["reason"], e.payload["previous_status"]) for e in status_changes(evs)] == \
            [(victim, hd.HEARTBEAT_MISSED, bd.UP), (victim, hd.HEARTBEAT_RESUMED, bd.UNHEALTHY)]
        ticked(tmp_path, 1000 // TICK_MS)
        follow.read_to_end()
        assert not [e for e in follow.events() if e.type.startswith("Unavailability")]
    finally:
        beats.stop()
        follow.close()


def test_bad_heartbeat_record_goes_to_deadletter(cfg, registry, region, health_proc, tmp_path):
    """Garbage on heartbeats is dead-lettered and the service keeps judging."""
    beats = Heartbeats(cfg, registry, region)
    beats.silent.update(region[:2])  # two of five never speak: a normal zone, judged at once
    beats.start()
    wait_ready(health_proc())
    p = EventProducer(cfg, registry, "test")
    t = Topics(cfg.topic_prefix, cfg.partitions)
    ticked(tmp_path, 1)
    # A silent machine's heartbeat that reads and is proven by its machine's key (as its agent seals it) but is keyed
    # as another machine, and one cut short: neither counts, both are dead-lettered by the ordinary decode with their
    # reason.
    silent_beat = trust.simulated_signer(cfg).seal(registry, "AgentHeartbeat", new_event(
        "AgentHeartbeat", {"machine_id": region[0], "running_task_ids": ["t1"], "sequence": 10**6},
        entitlement="free/dc1", entity_id=region[0], producer="test-agent", timestamp_ms=2**50).to_record())
    p.send_raw(t.name("heartbeats"), region[0].encode(), b"not avro at all")
    p.send_raw(t.name("heartbeats"), region[2].encode(), silent_beat)
    p.send_raw(t.name("heartbeats"), region[0].encode(), silent_beat[:-3])
    p.flush()
    follow = Follow(cfg, registry, "deadletter", "machines")
    try:
        evs = follow.until(lambda evs: sum(e.type == "DeadLetterRecorded" for e in evs) >= 3, 15, "3 dead letters")
        dls = [e for e in evs if e.type == "DeadLetterRecorded"]
        assert {(dl.payload["consumer"], dl.payload["origin_topic"]) for dl in dls} == {
            (hd.PRODUCER, t.name("heartbeats"))}
        assert len({(dl.payload["origin_partition"], dl.payload["origin_offset"]) for dl in dls}) == 3
        assert "differs from the event's" in " ".join(dl.payload["detail"] for dl in dls)  # the mis-keyed one
        # Still alive: the two that never heartbeat go UNHEALTHY after the timeout.
        evs = follow.until(lambda evs: len(status_changes(evs, bd.UNHEALTHY)) == 2, (2 * TIMEOUT_MS) / 1000 + 8,
                           "two UNHEALTHY")
        assert sorted(e.entity_id for e in status_changes(evs, bd.UNHEALTHY)) == sorted(region[:2])
        records = [e for e in evs if e.type in ("MachineStatusChanged", "MachinesStatusChanged")]
        assert {e.type for e in records} == {"MachinesStatusChanged"} and len(records) < 4, \
            "one event per tick for the machines it finds silent, not one per machine"
        assert beats.error is None
    finally:
        beats.stop()
        follow.close()


# -- protection against mass failure (processors/health/zones.py) ----------------------------------------------

ZONE_RATE = 2.0  # machines a second failed in a dark zone (--zone-failure-rate)
ZONE_TIMEOUT_MS = 4000  # a longer timeout than the others': a busy machine must not make it count silences anew


@pytest.fixture
def two_dcs(cfg, registry):
    """A region of 2 DCs of 12 machines each, registered."""
    ms = machines(generate_region(24, 2, 0))
    _, events = bd.register_all(bd.BrokerState(), ms, int(time.time() * 1000))
    p = EventProducer(cfg, registry, "test")
    for ev in events:
        p.send(ev)
    p.flush()
    return {dc: [m.id for m in ms if m.dc == dc] for dc in sorted({m.dc for m in ms})}


def zone_events(events, dc=None):
    return [e for e in events if e.type == hd.ZONE_DISRUPTION_CHANGED and (dc is None or e.payload["dc"] == dc)]


def test_a_dc_gone_silent_at_once_is_failed_at_a_pace_and_announced(cfg, registry, two_dcs, health_proc, tmp_path):
    """Every agent of one DC falls silent at once while the other DC is heard: the DC is in full disruption
    (announced: ZoneDisruptionChanged, and the zone-state metric), and its machines are failed ZONE_RATE a second,
    not all at once; the other DC's machines are never judged."""
    dc1, dc2 = sorted(two_dcs)
    beats = Heartbeats(cfg, registry, two_dcs[dc1] + two_dcs[dc2])
    beats.start()
    wait_ready(health_proc("--zone-failure-rate", str(ZONE_RATE), "--timeout-ms", str(ZONE_TIMEOUT_MS)))
    follow = Follow(cfg, registry, "machines", "unavailability")
    try:
        ticked(tmp_path, 3)
        beats.silent.update(two_dcs[dc2])
        n = len(two_dcs[dc2])
        # the last verdict and its failure are two records on two topics: wait for both, not for the first
        evs = follow.until(lambda evs: len(status_changes(evs, bd.UNHEALTHY)) == n and sum(
            len(e.payload["machine_ids"]) for e in evs if e.type == "UnavailabilityStarted") >= n,
                           (ZONE_TIMEOUT_MS + 1000 * n / ZONE_RATE) / 1000 + 30, f"all {n} machines of {dc2} failed")
        zone = zone_events(evs)[0]
        assert zone.entitlement == f"free/{dc2}" and zone.payload["state"] == "FULL_DISRUPTION"
        assert (zone.payload["previous_state"], zone.payload["region_disrupted"]) == ("NORMAL", False)
        assert zone.payload["machines"] == n and zone.payload["silent"] == n
        assert zone.payload["failure_rate_per_s"] == ZONE_RATE and zone.payload["held"] == n - 1
        assert not zone_events(evs, dc1)
        verdicts = [e for e in evs if e.type == "MachinesStatusChanged" and e.payload["status"] == bd.UNHEALTHY]
        assert len(verdicts) >= n // 2, "paced: many small verdicts, not one"
        # Never more than the buckets allow: one token when the zone turns dark, then ZONE_RATE a second. (A busy
        # machine may pause the health check long enough for it to count every silence anew: the zone is then
        # dark again later, with a new bucket; counted as such.)
        first = verdicts[0].timestamp_ms
        judged, buckets = 0, 0
        for e in sorted(verdicts + zone_events(evs, dc2), key=lambda e: (e.timestamp_ms, e.type != hd.ZONE_DISRUPTION_CHANGED)):
            if e.type == hd.ZONE_DISRUPTION_CHANGED:
                buckets += e.payload["state"] == "FULL_DISRUPTION"
                continue
            judged += len(e.payload["machines"])
            assert judged <= buckets + ZONE_RATE * (e.timestamp_ms - first) / 1000 + 1e-9, (judged, e.timestamp_ms - first)
        assert verdicts[-1].timestamp_ms - first >= 1000 * (n - buckets) / ZONE_RATE - TICK_MS
        assert {e.entity_id for e in status_changes(evs)} == set(two_dcs[dc2])  # dc1 never judged
        started = [e for e in evs if e.type == "UnavailabilityStarted"]
        assert sorted(m for e in started for m in e.payload["machine_ids"]) == sorted(two_dcs[dc2])
        metrics_now = worker_metrics(tmp_path, WORKER)
        assert value(metrics_now, "ropewalk_health_zone_state", dc=dc2) == 2
        assert value(metrics_now, "ropewalk_health_zone_state", dc=dc1) == 0
        assert value(metrics_now, "ropewalk_health_zone_silent_machines", dc=dc2) == n
        assert beats.error is None
    finally:
        beats.stop()
        follow.close()


def test_a_region_silent_everywhere_fails_nobody_and_is_heard_again(cfg, registry, two_dcs, health_proc, tmp_path):
    """Every agent falls silent (a control-plane or network outage, as the health check sees it): nobody is
    failed, each zone is announced in full disruption with region_disrupted; when they speak again every silence
    counts anew (announced region_disruption_ended) and still nobody is failed."""
    everyone = [m for ids in two_dcs.values() for m in ids]
    beats = Heartbeats(cfg, registry, everyone)
    beats.start()
    wait_ready(health_proc("--timeout-ms", str(ZONE_TIMEOUT_MS)))
    follow = Follow(cfg, registry, "machines", "unavailability")
    try:
        ticked(tmp_path, 3)
        beats.silent.update(everyone)
        evs = follow.until(lambda evs: len(zone_events(evs)) == 2, ZONE_TIMEOUT_MS / 1000 + 20, "both zones dark")
        assert {(e.payload["dc"], e.payload["state"], e.payload["region_disrupted"], e.payload["reason"])
                for e in zone_events(evs)} == {(dc, "FULL_DISRUPTION", True, hd.REGION_DISRUPTION) for dc in two_dcs}
        assert all(e.payload["failure_rate_per_s"] == 0 for e in zone_events(evs))
        ticked(tmp_path, 3 * ZONE_TIMEOUT_MS // TICK_MS)  # three timeouts of the region dark
        assert value(worker_metrics(tmp_path, WORKER), "ropewalk_health_region_disrupted") == 1
        beats.silent.clear()
        evs = follow.until(lambda evs: len(zone_events(evs)) == 4, 20, "the region heard again")
        assert {(e.payload["dc"], e.payload["state"], e.payload["reason"]) for e in zone_events(evs)[2:]} == \
            {(dc, "NORMAL", hd.REGION_DISRUPTION_ENDED) for dc in two_dcs}
        ticked(tmp_path, 2 * ZONE_TIMEOUT_MS // TICK_MS)
        follow.read_to_end()
        assert status_changes(follow.events()) == [] and not [e for e in follow.events()
                                                               if e.type == "UnavailabilityStarted"]
        m = worker_metrics(tmp_path, WORKER)
        assert value(m, "ropewalk_health_clock_restarts_total", reason=hd.CLOCKS_REGION_DISRUPTION_ENDED) == 1
        assert value(m, "ropewalk_health_region_disrupted") == 0
        assert beats.error is None
    finally:
        beats.stop()
        follow.close()
