"""A region's life recorded as a log, without a broker, for the history's unit tests (not a test module).

``record()`` runs a scripted region on the processors' own decisions in memory (processors/history's what-if engine
from an empty region: the scheduler's ``decide`` and timer, the allocator's decisions, simulated agents) and keeps
every event it makes and every event the script injects, each at the position the broker would give it (topic of its
type, partition of its key, next offset) and as a reader of the broker gets it (written with its type's schema and
read back: a field the schema gives a default and the decision left out holds that default, as on a real log). ``Recorded.merged()`` is that log in ``fold.merged`` order, as
``reader.merged`` reads a real one; ``views`` are what ``machine list`` / ``job status`` would have printed at
chosen moments (the simulation's own state then).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import count

from processors.allocator.fold import merged
from processors.frontend.service import job_view
from processors.history.region import STATE_TYPES, Region
from processors.resourcebroker import decide as rb
from processors.resourcebroker.region import generate_region, machines as region_machines
from streams import state as states
from streams.clients import Record
from streams.events import Event, new_event
from streams.partitioner import partition_for
from streams.serde import SchemaRegistry
from streams.topics import TOPIC_OF_EVENT, Topics

PARTITIONS = 4
T0 = 1_700_000_000_000
TOPICS = Topics("", PARTITIONS)
# entitlements on three partitions (e1: 1, e3: 0, batch: 2) and the free pools (free/dc1: 0, free/dc2: 3)
ENTITLEMENTS = {"e1": 6, "e3": 5, "batch": 4}


def entitlement(name: str, quota: int, ts: int) -> Event:
    return new_event("EntitlementCreated", {"name": name, "quota_machines": quota, "machine_type": None,
                                            "dc_pin": None, "host_profile": None},
                     entitlement=name, entity_id=name, producer="cli", timestamp_ms=ts, event_id=f"ent-{name}")


def submit(job: str, tasks: int, ts: int, cpu: int = 4000, mem: int = 4096, controller: str | None = None) -> Event:
    ent, name = job.split(".", 1)
    return new_event("JobSubmitted", {
        "job_id": job, "name": name, "spec_version": 1, "tasks": tasks, "command": ["serve"],
        "resources": {"cpu_millicores": cpu, "memory_mib": mem}, "requirements": {}, "spread": "msb",
        "max_unavailable": 1, "env": {}, "controller": controller},
        entitlement=ent, entity_id=job, producer="cli", timestamp_ms=ts, event_id=f"submit-{job}-{ts}")


def resize(job: str, tasks: int, ts: int) -> Event:
    return new_event("JobResized", {"job_id": job, "tasks": tasks}, entitlement=job.split(".", 1)[0], entity_id=job,
                     producer="cli", timestamp_ms=ts, event_id=f"resize-{job}-{ts}")


def stop(job: str, ts: int) -> Event:
    return new_event("JobStopped", {"job_id": job, "reason": "test"}, entitlement=job.split(".", 1)[0],
                     entity_id=job, producer="cli", timestamp_ms=ts, event_id=f"stop-{job}-{ts}")


@dataclass
class Recorded:
    records: list[tuple[Event, tuple[str, int, int]]] = field(default_factory=list)
    views: dict[int, dict] = field(default_factory=dict)  # moment -> {"machines": [...], "jobs": {...}}
    broker: rb.BrokerState = field(default_factory=rb.BrokerState)
    registry: SchemaRegistry = field(default_factory=SchemaRegistry.from_dir)
    _next: dict = field(default_factory=lambda: defaultdict(count))

    def add(self, event: Event) -> None:
        if event.type in STATE_TYPES:
            return
        record = event.to_record(self.registry.reader(event.type).version)
        event = Event.from_record(*self.registry.decode(self.registry.encode(event.type, record)))  # as read back
        topic = TOPIC_OF_EVENT[event.type]
        key = event.entitlement if topic != "heartbeats" else event.entity_id
        partition = partition_for(key, PARTITIONS)
        self.records.append((event, (topic, partition, next(self._next[topic, partition]))))
        if topic == "machines":
            self.broker = rb.apply(self.broker, event)

    def merged(self, since_offsets: dict | None = None) -> list[tuple[Event, tuple[str, int, int]]]:
        parts: dict = defaultdict(list)
        for ev, pos in self.records:
            if since_offsets is None or pos[2] >= since_offsets.get((pos[0], pos[1]), 0):
                parts[(pos[0], pos[1])].append((ev, pos))
        return list(merged(parts))

    def records_of(self) -> list[Record]:
        return [Record(ev, pos[0], pos[1], pos[2], ev.entitlement.encode(), ev.timestamp_ms)
                for ev, pos in self.records]


def view(region: Region) -> dict:
    """What ``machine list --json`` and ``job status --json`` show of a region (machines without updated_ms)."""
    machines = []
    for ev in region.machine_states():
        v = states.machine_view(ev)
        v.pop("updated_ms")
        machines.append(v)
    return {"machines": machines, "jobs": {j: job_view(ev) for j, ev in region.job_states().items()}}


def record(script: dict[int, list], until_s: int, moments_s: tuple[int, ...] = (), machines: int = 24,
           seed_events: bool = True) -> Recorded:
    """Run ``script`` ({second: [event builders called with (rec, ts)]}) on a region of ``machines`` from T0 until
    ``until_s``; remember the views at ``moments_s``."""
    rec = Recorded()
    region = Region(TOPICS)
    region.start_what_if([], T0)
    region.on_emit = rec.add
    specs = region_machines(generate_region(machines))
    rec.broker, registered = rb.register_all(rec.broker, specs, T0)
    first = [*registered, *(entitlement(n, q, T0 + 1) for n, q in ENTITLEMENTS.items())]
    for ev in first:
        rec.add(ev)
    region.inject(first)
    for second in range(1, until_s + 1):
        ts = T0 + second * 1000
        out = []
        for make in script.get(second, ()):
            made = make(rec, ts)
            out += made if isinstance(made, list) else [made]
        for ev in out:
            rec.add(ev)
        region.inject(out)
        region.advance(ts)
        if second in moments_s:
            rec.views[ts] = view(region)
    return rec


def busy_machine(rec: Recorded, region_records=None) -> str:
    """A machine with tasks in the recorded log so far (for a failure)."""
    placed: dict[str, str] = {}
    for ev, _ in rec.records:
        if ev.type == "TasksAllocated":
            for r in ev.payload["placements"]:
                placed[r["task_id"]] = r["machine_id"]
        elif ev.type == "TasksDeallocated":
            for r in ev.payload["placements"]:
                if placed.get(r["task_id"]) == r["machine_id"]:
                    del placed[r["task_id"]]
    return sorted(placed.values())[0]


def fail(rec: Recorded, ts: int) -> list[Event]:
    rec.broker, evs = rb.machine_failed(rec.broker, busy_machine(rec), rb.REASON_OPERATOR, ts)
    return evs


def maintenance(msb: str, ts: int, rec: Recorded, deadline_s: int = 15, duration_s: int = 120) -> list[Event]:
    rec.broker, evs = rb.plan_maintenance(rec.broker, [rb.Target(rb.TARGET_MSB, msb)], ts + 60_000,
                                          duration_s * 1000, ts + deadline_s * 1000, ts)
    rec.maintenance = (evs[0].payload["unavailability_id"], sorted({m for e in evs for m in e.payload["machine_ids"]}))
    return evs


def maintenance_end(rec: Recorded, ts: int) -> list[Event]:
    ue, ids = rec.maintenance
    rec.broker, evs = rb.maintenance_ended(rec.broker, ue, ids, ts)
    return evs


SCRIPT = {
    1: [lambda r, t: submit("e1.web", 6, t), lambda r, t: submit("e3.api", 4, t, cpu=8000),
        lambda r, t: submit("batch.crunch", 5, t, cpu=2000)],
    2: [lambda r, t: submit("e1.cache", 3, t, cpu=6000, controller="cachectl")],
    20: [fail],
    40: [lambda r, t: resize("e3.api", 2, t), lambda r, t: resize("batch.crunch", 8, t)],
    60: [lambda r, t: maintenance("dc1/msb1", t, r)],
    100: [lambda r, t: stop("e3.api", t)],
    150: [maintenance_end],
}
UNTIL_S = 200
MOMENTS_S = (10, 30, 50, 70, 90, 110, 160, 200)


def regional_log() -> Recorded:
    """The scripted region of the history's tests (about 200 s of it)."""
    return record(SCRIPT, UNTIL_S, MOMENTS_S)


def fold(rec: Recorded, moment: int, region: Region | None = None, lookahead_ms: int | None = None) -> Region:
    """A Region folded from ``rec``'s log to ``moment`` (from ``region``'s positions when given)."""
    region = region or Region(TOPICS, **({"lookahead_ms": lookahead_ms} if lookahead_ms else {}))
    for ev, pos in rec.merged(region.positions):
        region.read(ev, pos)
        if ev.timestamp_ms > moment + region.lookahead_ms:
            break
    region.advance(moment)
    return region
