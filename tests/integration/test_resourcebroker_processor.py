"""The Resource Broker process on the real broker: registers a generated region once (a restart folds the log
and registers nothing again); the CLI-facing fail_machine / recover_machine produce status and unavailability
events keyed to the machine's owner, and name an unknown machine."""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from processors.resourcebroker import decide as d
from processors.resourcebroker.processor import fail_machine, fold_machines, recover_machine
from processors.resourcebroker.region import generate_region, machines
from streams import batches
from streams.catchup import CatchUpTimeout, read_to_end
from streams.clients import EventConsumer, EventProducer
from streams.events import new_event
from streams.topics import Topics
from processes import start, stop, wait_ready

N = 50


def read_all(cfg, registry, logical, settle_s=1.0, timeout_s=20.0):
    """Every event of a topic (read to end-of-partition on every partition)."""
    topic = Topics(cfg.topic_prefix, cfg.partitions).name(logical)
    c = EventConsumer(cfg, registry, [topic], name="test-reader")
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        want = set(c.partitions())
        while time.monotonic() < deadline:
            recs = c.poll(5000, 0.2)
            out += recs
            if not recs and want <= c.eof:
                break
    finally:
        c.close()
    return out


@pytest.fixture
def broker_proc(cfg, tmp_path):
    procs = []

    def started(*args):
        p = start(cfg, tmp_path, "processors.resourcebroker.processor", *args, name="resourcebroker")
        procs.append(p)
        return p

    yield started
    for p in procs:
        stop(p)


def test_registers_a_generated_region_once(cfg, registry, broker_proc):
    p = broker_proc("--machines", str(N), "--seed", "3")
    line = wait_ready(p)
    assert f"{N} registered" in line
    recs = read_all(cfg, registry, "machines")
    regs = [(r, m) for r in recs for m in batches.machine_registrations(r.event)]
    assert len(regs) == N
    assert {r.event.type for r, _ in regs} == {"MachinesRegistered"}  # a record per DC's free pool and thousand
    expected = {m.id: m for m in machines(generate_region(N, 2, 3))}
    assert len({(r.partition, r.offset) for r, _ in regs}) == len({m.dc for m in expected.values()})  # N < 1,000
    assert {m["machine_id"] for _, m in regs} == set(expected)
    for r, m in regs:
        dc = expected[m["machine_id"]].dc
        assert r.key == f"free/{dc}".encode() and r.event.entitlement == f"free/{dc}"
    stop(p)
    assert p.returncode == 0  # SIGTERM: a clean stop, not a kill

    p2 = broker_proc("--machines", str(N), "--seed", "3")
    line = wait_ready(p2)
    assert f"{N} machines, 0 registered" in line, line
    stop(p2)  # the marker: all it would (wrongly) register again is on the log once it has stopped cleanly
    assert p2.returncode == 0
    regs2 = [m for r in read_all(cfg, registry, "machines") for m in batches.machine_registrations(r.event)]
    assert len(regs2) == N


def test_fail_and_recover_machine(cfg, registry, broker_proc):
    wait_ready(broker_proc("--machines", "10", "--dcs", "1"))
    mid = machines(generate_region(10, 1, 0))[4].id
    ids = fail_machine(cfg, mid, registry=registry)
    assert len(ids) == 2
    ms = {r.event.event_id: r for r in read_all(cfg, registry, "machines")}
    ue = {r.event.event_id: r for r in read_all(cfg, registry, "unavailability")}
    down, started = ms[ids[0]], ue[ids[1]]
    assert down.event.type == "MachineStatusChanged" and down.event.payload["status"] == d.DOWN
    assert down.event.payload["reason"] == d.REASON_OPERATOR and down.key == b"free/dc1"
    assert started.event.type == "UnavailabilityStarted" and started.key == b"free/dc1"
    assert started.event.payload["kind"] == d.KIND_FAILURE and started.event.payload["machine_ids"] == [mid]
    assert fold_machines(cfg, registry).get(mid).status == d.DOWN
    assert fail_machine(cfg, mid, registry=registry) == []  # DOWN already: nothing

    ids2 = recover_machine(cfg, mid, registry=registry)
    ms = {r.event.event_id: r for r in read_all(cfg, registry, "machines")}
    ue = {r.event.event_id: r for r in read_all(cfg, registry, "unavailability")}
    up, ended = ms[ids2[0]], ue[ids2[1]]
    assert up.event.payload["status"] == d.UP and up.event.payload["previous_status"] == d.DOWN
    assert ended.event.type == "UnavailabilityEnded" and ended.key == b"free/dc1"
    assert ended.event.payload["unavailability_id"] == started.event.payload["unavailability_id"]
    assert Counter(r.event.type for r in ue.values()) == {"UnavailabilityStarted": 1, "UnavailabilityEnded": 1}

    with pytest.raises(d.UnknownMachine, match="no-such-machine"):
        fail_machine(cfg, "no-such-machine", registry=registry)
    with pytest.raises(d.UnknownMachine, match="no-such-machine"):
        recover_machine(cfg, "no-such-machine", registry=registry)


def test_fail_machine_keys_to_the_owner_entitlement(cfg, registry, broker_proc):
    """A machine held by an entitlement: its failure is keyed to that entitlement (the scheduler shard's)."""
    wait_ready(broker_proc("--machines", "4", "--dcs", "1"))
    mid = machines(generate_region(4, 1, 0))[0].id
    p = EventProducer(cfg, registry, "test")
    p.send(new_event("MachineAssignedToEntitlement", {"machine_id": mid, "dc": "dc1"}, entitlement="e7",
                     entity_id=mid, producer="test"), validate=False)
    p.flush()
    ids = fail_machine(cfg, mid, "power", registry=registry)
    ue = {r.event.event_id: r for r in read_all(cfg, registry, "unavailability")}
    assert ue[ids[1]].key == b"e7" and ue[ids[1]].event.payload["reason"] == "power"


# -- catching up (read_to_end) -------------------------------------------------------------------------------------

def registrations(n: int, seed: int, now_ms: int = 1_795_000_000_000) -> list:
    """MachinesRegistered events of a generated region of ``n`` machines over 2 DCs (two partitions' keys);
    the event ids derive from the machine ids and ``now_ms``."""
    _, events = d.register_all(d.BrokerState(), machines(generate_region(n, 2, seed)), now_ms)
    return events


def produced_registrations(cfg, registry, n: int, seed: int) -> tuple[str, list]:
    """``registrations(n, seed)`` produced on ``machines``: (the topic, the events)."""
    events = registrations(n, seed)
    p = EventProducer(cfg, registry, "test")
    for ev in events:
        p.send(ev, validate=False)
    p.flush()
    return Topics(cfg.topic_prefix, cfg.partitions).name("machines"), events


def test_read_to_end_terminates_while_the_topic_is_written(cfg, registry):
    """Another producer keeps writing to ``machines`` for the whole catch-up (as a big region registering does):
    the read ends at where the partitions ended when it started (everything written before it is read), long
    before its timeout. Reading until a poll comes back empty never ends here: polls keep returning records."""
    topic, before = produced_registrations(cfg, registry, 3000, seed=1)

    stop_writing = threading.Event()
    written_during = []

    def writer() -> None:
        wp = EventProducer(cfg, registry, "test-writer")
        # more than can be written before the test stops it
        for m in machines(generate_region(50_000, 2, 2)):  # a record per machine
            ev = d.register(d.BrokerState(), m, 1_795_000_000_001)[1][0]
            if stop_writing.is_set():
                break
            wp.send(ev, validate=False)
            wp.flush()
            written_during.append(ev.event_id)
            time.sleep(0.005)
        wp.flush()

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        while len(written_during) < 20:  # the writer is going before catching up starts
            time.sleep(0.01)
        flushed_before = {ev.event_id for ev in before} | set(written_during)
        consumer = EventConsumer(cfg, registry, [topic], name="test-catch-up")
        seen: list = []
        t0 = time.monotonic()
        try:
            n = read_to_end(consumer, seen.extend, timeout_s=10.0)
        finally:
            consumer.close()
        elapsed = time.monotonic() - t0
        assert t.is_alive() and not stop_writing.is_set(), "the writer must still be writing when the read ends"
    finally:
        stop_writing.set()
        t.join(30)
    assert elapsed < 10.0, elapsed
    assert n == len(seen)
    ids = [r.event.event_id for r in seen]
    assert flushed_before <= set(ids)  # nothing written before the start is missing
    assert len(ids) == len(set(ids))
    for r in seen:
        assert r.topic == topic
    # Per partition, in offset order with no gap up to where the read stopped.
    by_partition: dict[int, list[int]] = {}
    for r in seen:
        by_partition.setdefault(r.partition, []).append(r.offset)
    for offsets in by_partition.values():
        assert offsets == list(range(offsets[0], offsets[0] + len(offsets)))


def test_read_to_end_of_empty_partitions_returns_at_once(cfg, registry):
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("machines")
    consumer = EventConsumer(cfg, registry, [topic], name="test-catch-up")
    t0 = time.monotonic()
    try:
        assert read_to_end(consumer, lambda recs: None, timeout_s=5.0) == 0
    finally:
        consumer.close()
    assert time.monotonic() - t0 < 5.0


def test_read_to_end_times_out_when_a_partition_is_stuck(cfg, registry):
    """A partition that never advances (here: paused, so nothing is fetched from it, as with a broker away)
    ends the catch-up with CatchUpTimeout naming it, after the stall timeout; the other partitions were read."""
    topic, events = produced_registrations(cfg, registry, 200, seed=4)
    consumer = EventConsumer(cfg, registry, [topic], name="test-catch-up")
    seen: list = []
    try:
        low_high = consumer.watermarks()
        written = sorted(tp for tp, (low, high) in low_high.items() if high > low)
        assert len(written) == 2  # two DCs: two free-pool keys
        stuck = written[0]
        consumer.pause([stuck])
        t0 = time.monotonic()
        with pytest.raises(CatchUpTimeout, match=rf"{topic}\[{stuck[1]}\]"):
            read_to_end(consumer, seen.extend, timeout_s=2.0)
        elapsed = time.monotonic() - t0
    finally:
        consumer.close()
    assert 2.0 <= elapsed < 15.0
    assert seen and {r.partition for r in seen} == {written[1][1]}
