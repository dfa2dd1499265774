"""state.machines: the allocator publishes the latest state of every machine its index changed, and
`ropewalk machine list` / `ropewalk watch machines` read it. Real broker, real Redis, the real CLI."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from processors.allocator.processor import PRODUCER, Allocator, build_app
from streams.clients import EventProducer, Record
from streams.topics import Topics
from streams.events import Event, derived_event_id, new_event
from streams.state import StateReader
from test_allocator_processor import wait_for

ROOT = Path(__file__).resolve().parents[2]
FAST = {"broker_session_timeout": 2.0, "broker_heartbeat_interval": 0.5, "broker_rebalance_timeout": 2.0,
        "broker_commit_interval": 0.5}
CPU, MEM = 4000, 8192
MACHINES = {f"m{msb}{i}": f"msb{msb}" for msb in (1, 2, 3) for i in "ab"}


def registered(mid: str, msb: str) -> Event:
    return new_event("MachineRegistered", {
        "machine_id": mid, "topology": {"region": "reg1", "dc": "dc1", "msb": msb, "rack": f"{msb}-r1"},
        "machine_type": "skylake", "capacity": {"cpu_millicores": CPU, "memory_mib": MEM}, "host_profile": None},
        entitlement="free/dc1", entity_id=mid, producer="test")


def entitlement_created(name: str, quota: int) -> Event:
    return new_event("EntitlementCreated", {"name": name, "quota_machines": quota, "machine_type": None,
                                            "dc_pin": None, "host_profile": None},
                     entitlement=name, entity_id=name, producer="test")


def requested(rid: str, job: str, n: int = 0, *, free=(), cpu=1000, mem=1024) -> Event:
    return new_event("AllocationRequested", {
        "request_id": rid, "job_id": job, "spec_version": 1, "place_task_ids": [f"{job}/{i}" for i in range(n)],
        "free_task_ids": list(free), "resources": {"cpu_millicores": cpu, "memory_mib": mem}, "requirements": {},
        "spread": "msb", "avoid_machine_ids": []}, entitlement="e1", entity_id=rid, producer="test")


def cli(cfg, *args):
    env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
           "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions)}
    return subprocess.run([sys.executable, "-m", "processors.frontend.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)



class States:
    """Every record of state.machines read so far, and the latest per machine (StateReader)."""

    def __init__(self, cfg, registry):
        self.reader = StateReader(cfg, registry, "machines")
        self.records: list[Event] = []

    def poll(self):
        self.records += [r.event for r in self.reader.poll(0.2)]
        return self.reader.latest

    def until(self, predicate, what, timeout_s=30.0):
        wait_for(lambda: predicate(self.poll()), what, timeout_s)
        return self.reader.latest


# --- the allocator's publisher, driven by hand -----------------------------------------------------------------

@pytest.fixture
def allocator(cfg, registry):
    """An Allocator fed by hand (no faust, no fold consumer): each record applied, then the pending requests
    decided and the changes projected to Redis, as one turn of its loop does. Returns the events produced."""
    r = cfg.redis_client()
    a = Allocator(cfg, registry, r, EventProducer(cfg, registry, PRODUCER))
    a.assign(range(cfg.partitions), fenced=False)
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    offsets = Counter()

    def feed(event, topic="allocations", offset=None):
        if offset is None:
            offset = offsets[topic]
            offsets[topic] += 1
        a.on_records([Record(event, topics.name(topic), 0, offset, event.entitlement.encode(), 0)])
        produced = a.decide_pending()
        a.project_changes(force=True)
        return produced

    a.feed = feed
    yield a
    a.index.clear()
    r.close()


def test_every_changed_machine_is_published_once_per_state(allocator, cfg, registry):
    states = States(cfg, registry)
    regs = [registered(mid, msb) for mid, msb in MACHINES.items()]
    for e in regs:
        allocator.feed(e, "machines")
    allocator.feed(entitlement_created("e1", 10), "intents")
    assert allocator.publish_machine_states() == len(MACHINES)
    latest = states.until(lambda s: len(s) == len(MACHINES), "the registrations")
    for mid, ev in latest.items():
        p = ev.payload
        assert (p["status"], p["assigned_entitlement"], p["version"], p["task_ids"]) == ("UP", None, 1, [])
        assert p["free"] == p["capacity"] == {"cpu_millicores": CPU, "memory_mib": MEM}
        assert ev.event_id == derived_event_id(PRODUCER, "MachineStatePublished", mid, 1)
        assert ev.entitlement == "free/dc1" and ev.causation_id in {e.event_id for e in regs}

    # Nothing changed, nothing to publish; a registration delivered again (same offset, or a new one) changes
    # nothing in the index, so it publishes nothing either.
    assert allocator.publish_machine_states() == 0
    allocator.feed(regs[0], "machines", offset=0)
    allocator.feed(regs[0], "machines", offset=50)
    assert allocator.publish_machine_states() == 0

    req = requested("r1", "web", 3)
    [done, *_] = allocator.feed(req)
    used = {p["machine_id"] for p in done.payload["placements"]}
    assert allocator.publish_machine_states() == 3  # the commit changed three machines
    latest = states.until(lambda s: all(s[m].payload["assigned_entitlement"] == "e1" for m in used), "allocation")
    for mid in used:
        p = latest[mid].payload
        assert p["free"] == {"cpu_millicores": CPU - 1000, "memory_mib": MEM - 1024}
        assert len(p["task_ids"]) == 1 and p["version"] == allocator.index.machine(mid).version
        assert latest[mid].causation_id == req.event_id
    # the allocator's own TasksAllocated comes back to it: its facts are in the index already, nothing to publish
    allocator.feed(done, offset=10)
    assert allocator.publish_machine_states() == 0

    allocator.feed(requested("r2", "web", free=[f"web/{i}" for i in range(3)]))  # freed: back to the pool
    assert allocator.publish_machine_states() == 3
    latest = states.until(lambda s: all(s[m].payload["assigned_entitlement"] is None for m in used), "freeing")
    assert all(latest[m].payload["free"]["cpu_millicores"] == CPU and latest[m].payload["task_ids"] == []
               for m in used)
    assert len({e.event_id for e in states.records}) == len(states.records) == len(MACHINES) + 6
    states.reader.close()


def test_a_reader_keeps_the_newest_state_when_an_older_one_arrives_late(allocator, cfg, registry):
    allocator.feed(registered("m1", "msb1"), "machines")
    allocator.feed(new_event("MachineStatusChanged", {"machine_id": "m1", "status": "DOWN", "previous_status": "UP",
                                                      "reason": "test"}, entitlement="free/dc1", entity_id="m1",
                             producer="test"), "machines")
    allocator.publish_machine_states()  # version 2, DOWN
    old = new_event("MachineStatePublished", {
        "machine_id": "m1", "topology": {"region": "reg1", "dc": "dc1", "msb": "msb1", "rack": "msb1-r1"},
        "machine_type": "skylake", "status": "UP", "assigned_entitlement": None,
        "capacity": {"cpu_millicores": CPU, "memory_mib": MEM}, "free": {"cpu_millicores": CPU, "memory_mib": MEM},
        "host_profile": None, "task_ids": [], "version": 1}, entitlement="free/dc1", entity_id="m1",
        producer="other-allocator")
    allocator.producer.send(old)  # another allocator's publish of version 1, landing after version 2
    allocator.producer.flush()
    states = States(cfg, registry)
    states.reader.catch_up()
    assert states.reader.latest["m1"].payload["status"] == "DOWN" and states.reader.latest["m1"].payload["version"] == 2
    states.reader.close()


# --- the running allocator and the CLI ---------------------------------------------------------------------------

@pytest.mark.timeout(200)
def test_machine_list_and_watch_show_what_the_running_allocator_published(cfg, registry):
    r = cfg.redis_client()
    producer = EventProducer(cfg, registry, "test")

    def body(allocator):
        for mid, msb in MACHINES.items():
            producer.send(registered(mid, msb))
        producer.send(entitlement_created("e1", 10))
        producer.flush()
        wait_for(lambda: len(allocator.index.machines(MACHINES)) == len(MACHINES), "the machines in the index")
        wait_for(lambda: allocator.fold.entitlement("e1"), "the entitlement")
        producer.send(requested("r1", "web", 6, cpu=1500, mem=2048))  # 2 per MSB: stacked on one machine each
        producer.flush()
        wait_for(lambda: len(allocator.index.placements()) == 6, "the allocation")
        used = {m for m in allocator.index.placements().values()}
        versions = {mid: m.version for mid, m in allocator.index.machines(MACHINES).items()}

        def listed(*args):
            out = cli(cfg, "machine", "list", "--json", *args)
            assert out.returncode == 0, out.stderr
            return {row["id"]: row for row in json.loads(out.stdout)}

        # published by the running allocator without anyone asking: the throttled drain or its timer
        rows = wait_for(lambda: (rows := listed()) and {m: rw["version"] for m, rw in rows.items()} == versions
                        and rows, "machine list to show the allocation", 60)
        assert set(rows) == set(MACHINES) and len(used) == 3
        for mid, row in rows.items():
            assert (row["dc"], row["msb"], row["rack"], row["type"], row["status"]) == (
                "dc1", MACHINES[mid], f"{MACHINES[mid]}-r1", "skylake", "UP")
            assert row["capacity"] == {"cpu_millicores": CPU, "memory_mib": MEM}
            if mid in used:
                assert row["entitlement"] == "e1" and len(row["tasks"]) == 2
                assert row["free"] == {"cpu_millicores": CPU - 3000, "memory_mib": MEM - 4096}
            else:
                assert row["entitlement"] is None and row["tasks"] == []
                assert row["free"] == {"cpu_millicores": CPU, "memory_mib": MEM}
        assert set(listed("--entitlement", "e1")) == used
        assert set(listed("--free")) == set(MACHINES) - used
        assert listed("--entitlement", "nobody") == {}
        text = cli(cfg, "machine", "list")
        assert text.returncode == 0 and len(text.stdout.splitlines()) == len(MACHINES) + 1  # a header row
        assert text.stdout.split()[:3] == ["MACHINE", "STATUS", "OWNER"]
        assert "1000/4000" in text.stdout and "free" in text.stdout
        assert cli(cfg, "machine", "list", "--free", "--entitlement", "e1").returncode != 0

        watch = cli(cfg, "watch", "machines", "--once", "--json")
        assert watch.returncode == 0, watch.stderr
        watched = {row["id"]: row for row in map(json.loads, watch.stdout.splitlines())}
        assert set(watched) == set(MACHINES)
        assert {mid for mid, row in watched.items() if row["entitlement"] == "e1"} == used
        assert all(row["status"] == "UP" and row["msb"] == MACHINES[mid] for mid, row in watched.items())

    async def scenario():
        app, _, allocator = build_app(cfg, registry=registry, redis_client=r, **FAST)
        await app.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, body, allocator)
        finally:
            crash = app.crash_reason
            await app.stop()
            allocator.index.clear()
            assert crash is None, crash

    try:
        asyncio.run(asyncio.wait_for(scenario(), 180))
    finally:
        r.close()
