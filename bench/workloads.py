"""The workloads of ``ropewalk bench`` (issue #5), each a function of a running ``BenchEnv`` returning plain numbers.

1. ``allocation``: jobs of 36 tasks on average through the whole pipeline (JobSubmitted intent -> scheduler shard
   -> AllocationRequested -> allocator -> TasksAllocated -> Redis), in three phases: *latency* (one job in flight
   at a time: submit to all tasks allocated, unloaded), *burst* (many jobs submitted at once: jobs/s and tasks/s
   at saturation, and the latency under that queue), *repeat* (every burst job grows by a few tasks: repeated
   allocations for jobs the allocator has seen, where its job-level cache can hit).
2. ``failover``: 1% of the machines fail at once (the benchmark picks machines that run tasks); from the failure
   event's timestamp to each affected task's RUNNING on another machine.
3. ``rebuild`` and ``replay``: every Redis index rebuilt from the log; an audit replay of one job in a log padded to
   a million events.
4. ``redis_bytes`` (INFO memory) and peak RSS (``BenchEnv.peak_rss``).
5. ``faust_overhead``: a trivial faust agent against raw aiokafka on the same topic (``bench/faust_overhead.py``).
And ``raw_rates``: the broker's own produce and consume rate for same-sized records with confluent-kafka, which
every pipeline rate is reported against.
"""
from __future__ import annotations

import cProfile
import pstats
import random
import statistics
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from bench import brokerstats, logcount
from bench.observe import LogObserver
from infra.config import PROJECT_ROOT, Config
from infra.trust import simulated_signer
from processors.frontend.jobspec import validate_spec
from processors.frontend.service import Frontend
from processors.resourcebroker import decide as broker
from processors.resourcebroker.region import iter_machines, load_region
from streams.clients import EventProducer, Record, consumer_conf, producer_conf
from streams.events import new_event
from streams.partitionmap import routed_producer
from streams.serde import SchemaRegistry
from streams.topics import CATALOGUE, Topics, provision

PRODUCER = "bench"
TASKS_MIN, TASKS_MAX = 12, 60  # tasks per job, uniform: 36 on average
SHAPES = ((1000, 2048), (1000, 2048), (2000, 4096), (500, 1024))  # (cpu millicores, memory MiB) per task
DC_REQUIREMENT_SHARE = 0.25  # jobs that require one DC; the others take any machine
REPEAT_GROW = 4  # tasks each job gets in the repeat phase


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between closest ranks; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


# -- the region's jobs -------------------------------------------------------------------------------------------

def entitlement_names(n: int) -> list[str]:
    return [f"bench-e{i}" for i in range(n)]


def create_entitlements(cfg: Config, registry: SchemaRegistry, names: list[str], quota: int, shards: int = 1,
                        wait_s: float = 30.0) -> dict[str, Any]:
    """Create the entitlements as ``ropewalk entitlement create`` does (the front end: each on the least-loaded
    scheduler shard's least-loaded partition, its map entry before it), once the scheduler group's ``shards``
    members own every partition (at most ``wait_s``: a shard that joins late would otherwise find the entitlements
    placed on the others). Returns where each went (``partitions``: name -> partition) and the shards' partitions
    the front end saw before (``shards``; empty: it placed by partition alone)."""
    producer = EventProducer(cfg, registry, PRODUCER)
    try:
        front = Frontend(cfg, registry, producer=PRODUCER, events=producer)
        deadline = time.monotonic() + wait_s
        while (len(owners := front.shard_owners() or {}) < cfg.partitions or len(set(owners.values())) < shards) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        shards = sorted(sorted(p for p, m in owners.items() if m == member) for member in set(owners.values())) \
            if len(owners) == cfg.partitions else []
        return {"partitions": {name: front.entitlement_create(name, quota)["partition"] for name in names},
                "shards": shards}
    finally:
        producer.close()


def job_specs(n: int, entitlements: list[str], dcs: list[str], rng: random.Random, tag: str) -> list[dict]:
    """``n`` job specs (as a user writes them), 36 tasks on average, a few resource shapes, some with a DC."""
    out = []
    for i in range(n):
        cpu, mem = rng.choice(SHAPES)
        spec = {"name": f"{tag}{i:05d}", "entitlement": entitlements[i % len(entitlements)],
                "tasks": rng.randint(TASKS_MIN, TASKS_MAX), "command": ["sleep", "3600"],
                "resources": {"cpu_millicores": cpu, "memory_mib": mem}, "spread": "msb"}
        if dcs and rng.random() < DC_REQUIREMENT_SHARE:
            spec["requirements"] = {"dc": rng.choice(dcs)}
        out.append(spec)
    return out


def submit(producer: EventProducer, spec: dict) -> tuple[str, int]:
    """Produce the JobSubmitted of ``spec`` (as ``ropewalk job submit`` does); (job id, envelope timestamp)."""
    payload = validate_spec(spec)
    ent = payload.pop("entitlement")
    ev = new_event("JobSubmitted", {**payload, "spec_version": 1}, entitlement=ent, entity_id=payload["job_id"],
                   producer=PRODUCER)
    producer.send(ev)
    return payload["job_id"], ev.timestamp_ms


def resize(producer: EventProducer, job_id: str, entitlement: str, tasks: int) -> int:
    ev = new_event("JobResized", {"job_id": job_id, "tasks": tasks}, entitlement=entitlement, entity_id=job_id,
                   producer=PRODUCER)
    producer.send(ev)
    return ev.timestamp_ms


COUNTERS = ("requests", "placed", "rejected")


def allocator_counters(redis_client, prefix: str) -> dict[str, int] | None:
    """The allocator's counters (``processors.allocator.processor.allocator_metrics``); None when it has
    published none."""
    if not redis_client.exists(f"{prefix}metrics:allocator"):
        return None
    from processors.allocator.processor import allocator_metrics  # noqa: PLC0415 - start-up cost: processors.allocator.processor (~350 ms over what `ropewalk bench|experiment` load), only for a run

    got = allocator_metrics(redis_client, prefix)
    return {k: int(got.get(k) or 0) for k in COUNTERS}


def _counted(before: Mapping[str, int] | None, after: Mapping[str, int] | None) -> dict:
    """What the allocator counted between two readings. The allocator has no job-level cache any more (every
    decision runs on its in-memory fold of the region), so there is no hit ratio to report: None."""
    if after is None:
        return {**dict.fromkeys(COUNTERS), "cache_hit_ratio": None}
    before = before or {}
    return {**{k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}, "cache_hit_ratio": None}


def stages(obs: LogObserver, submitted: Mapping[str, int]) -> dict[str, Any]:
    """Where a job's latency goes, from the log: submit -> the scheduler's AllocationRequested (the scheduler
    shard, queueing included), then -> the TasksAllocated that completed it (the allocator, queueing included)."""
    sched = [obs.requested_ms[j] - t for j, t in submitted.items() if j in obs.requested_ms and j in obs.done_ms]
    alloc = [obs.done_ms[j] - obs.requested_ms[j] for j in submitted if j in obs.requested_ms and j in obs.done_ms]
    return {"scheduler_p50_ms": _ms(percentile(sched, 50)), "scheduler_p99_ms": _ms(percentile(sched, 99)),
            "allocator_p50_ms": _ms(percentile(alloc, 50)), "allocator_p99_ms": _ms(percentile(alloc, 99))}


BACKGROUND_S = 5.0  # how long the region's cost with no job in flight is measured before the burst


def background_cost(env, seconds: float) -> dict[str, Any]:
    """CPU (ms per second, per process) and broker requests (per second) of the region with nothing in flight: the
    heartbeats, the health check, idle fetches. A phase's cost per job holds this much per second of the phase."""
    req0 = brokerstats.read(env.cfg)
    cpu0 = env.cpu_seconds()
    time.sleep(seconds)
    cpu1 = env.cpu_seconds()
    return {"seconds": seconds, "cpu_ms_per_s": {k: round(1000 * (cpu1[k] - cpu0[k]) / seconds, 1)
                                                 for k in cpu1 if k in cpu0},
            "broker_per_s": brokerstats.per_job(req0, brokerstats.read(env.cfg), max(1, round(seconds)))}


def cpu_used(before: Mapping[str, float], after: Mapping[str, float], jobs: int) -> dict[str, Any]:
    """CPU seconds each process used between two ``BenchEnv.cpu_seconds`` readings, and per job (ms)."""
    used = {name: round(after[name] - before[name], 3) for name in after if name in before}
    return {"seconds": used, "total_s": round(sum(used.values()), 3),
            "ms_per_job": {name: round(1000 * v / jobs, 3) for name, v in used.items()} if jobs else None}


def allocation(env, registry: SchemaRegistry, obs: LogObserver, *, machines: int, latency_jobs: int,
               burst_jobs: int, repeat_jobs: int, seed: int = 7, entitlements: int = 4, shards: int = 1,
               timeout_s: float = 600.0) -> dict[str, Any]:
    """Workload 1. Returns the figures and the jobs submitted (``jobs``: job id -> (entitlement, tasks))."""
    cfg = env.cfg
    rng = random.Random(seed)
    ents = entitlement_names(entitlements)
    placed = create_entitlements(cfg, registry, ents, quota=machines, shards=shards)
    dcs = sorted({m.split("-")[0] for m in _region_machines(env)})
    producer = routed_producer(cfg, registry, PRODUCER, **{"linger.ms": 0})  # to where the map says they live
    producer.prepare("JobSubmitted", "JobResized")  # connected, schemas on the log: not in the first job's time
    r = env.redis()
    jobs: dict[str, tuple[str, int]] = {}
    notes: list[str] = []
    out: dict[str, Any] = {"entitlements": entitlements, "seed": seed, "placement": placed}
    deadline = time.monotonic() + timeout_s

    # phase 1: latency, one job in flight
    lat = []
    lat_submitted: dict[str, int] = {}
    for spec in job_specs(latency_jobs, ents, dcs, rng, "lat"):
        job, ts = submit(producer, spec)
        lat_submitted[job] = ts
        producer.flush(30)
        jobs[job] = (spec["entitlement"], spec["tasks"])
        obs.expect(job, spec["tasks"])
        if not obs.wait(lambda: job in obs.done_ms, max(1.0, deadline - time.monotonic())):
            notes.append(f"latency phase: job {job} not allocated in time; phase cut short")
            break
        lat.append(obs.done_ms[job] - ts)
    out["latency"] = {"jobs": len(lat), "tasks": sum(jobs[j][1] for j in list(jobs)[:len(lat)]),
                      "p50_ms": _ms(percentile(lat, 50)), "p99_ms": _ms(percentile(lat, 99)),
                      "mean_ms": _ms(statistics.fmean(lat) if lat else None), **stages(obs, lat_submitted),
                      "samples_ms": [_ms(v) for v in lat]}  # in submit order: is an outlier the first job?

    # phase 2: burst, on a quiet pipeline (every task of phase 1 running)
    if not wait_running(obs, max(1.0, deadline - time.monotonic())):
        notes.append("burst phase: started before every task of the latency phase ran")
    c0 = allocator_counters(r, cfg.topic_prefix)
    background = background_cost(env, BACKGROUND_S)  # what the region costs with no job in flight, per second
    ends0 = logcount.topic_ends(cfg)
    req0 = brokerstats.read(cfg)
    cpu0 = env.cpu_seconds()
    specs = job_specs(burst_jobs, ents, dcs, rng, "job")
    submitted: dict[str, int] = {}
    t_first = int(time.time() * 1000)
    for spec in specs:
        job, ts = submit(producer, spec)
        submitted[job] = ts
        jobs[job] = (spec["entitlement"], spec["tasks"])
        obs.expect(job, spec["tasks"])
    producer.flush(60)
    ok = obs.wait(lambda: all(j in obs.done_ms for j in submitted), max(1.0, deadline - time.monotonic()))
    done = [j for j in submitted if j in obs.done_ms]
    if not ok:
        notes.append(f"burst phase: {len(submitted) - len(done)} of {len(submitted)} jobs not fully allocated "
                     f"within the time limit; rates count the allocated ones")
    t_last = max((obs.done_ms[j] for j in done), default=t_first)
    secs = max(t_last - t_first, 1) / 1000
    tasks = sum(jobs[j][1] for j in done)
    burst_lat = [obs.done_ms[j] - submitted[j] for j in done]
    c1 = allocator_counters(r, cfg.topic_prefix)
    cpu = cpu_used(cpu0, env.cpu_seconds(), len(done))
    req1 = brokerstats.read(cfg)
    burst_t_first = t_first
    out["burst"] = {"jobs": len(done), "tasks": tasks, "seconds": round(secs, 3), "t_first_ms": t_first,
                    "t_last_ms": t_last,
                    "jobs_per_s": round(len(done) / secs, 3), "tasks_per_s": round(tasks / secs, 1),
                    "p50_ms": _ms(percentile(burst_lat, 50)), "p99_ms": _ms(percentile(burst_lat, 99)),
                    **stages(obs, submitted), **_counted(c0, c1), "cpu": cpu}

    # phase 3: repeated allocations for known jobs, on a quiet pipeline again
    if not wait_running(obs, max(1.0, deadline - time.monotonic())):
        notes.append("repeat phase: started before every task of the burst ran")
    # the burst's jobs' whole life (submit, request, decision, commands, agents' reports, running): what it cost
    cpu_life = cpu_used(cpu0, env.cpu_seconds(), len(done))
    req2 = brokerstats.read(cfg)
    ends2 = logcount.topic_ends(cfg)
    out["burst"]["cost"] = {
        "to_allocated": {"cpu_ms_per_job": cpu["ms_per_job"], "broker_per_job": brokerstats.per_job(req0, req1,
                                                                                                    len(done))},
        "to_running": {"cpu_ms_per_job": cpu_life["ms_per_job"], "cpu_s": cpu_life["total_s"],
                       "broker_per_job": brokerstats.per_job(req0, req2, len(done)),
                       "records_per_job": logcount.records_between(cfg, ends0, ends2, len(done))},
        "background": background}
    # the burst's tasks all RUNNING and read so by the scheduler: the whole pipeline, submit to running
    burst_tasks = [t for j in done for t in obs.allocated[j]]
    if burst_tasks and all(t in obs.discovered for t in burst_tasks):
        running_s = max(max(obs.discovered[t][1] for t in burst_tasks) - burst_t_first, 1) / 1000
        out["burst"]["all_running_s"] = round(running_s, 2)
        out["burst"]["tasks_running_per_s"] = round(len(burst_tasks) / running_s, 1)
    else:
        out["burst"]["all_running_s"] = out["burst"]["tasks_running_per_s"] = None
    grow = [j for j in done][:repeat_jobs]
    t_first = int(time.time() * 1000)
    resized: dict[str, int] = {}
    for j in grow:
        ent, n = jobs[j]
        resized[j] = resize(producer, j, ent, n + REPEAT_GROW)
        jobs[j] = (ent, n + REPEAT_GROW)
        obs.expect(j, n + REPEAT_GROW)
    producer.flush(60)
    ok = obs.wait(lambda: all(j in obs.done_ms for j in resized), max(1.0, deadline - time.monotonic()))
    rdone = [j for j in resized if j in obs.done_ms]
    if not ok:
        notes.append(f"repeat phase: {len(resized) - len(rdone)} of {len(resized)} resized jobs not allocated in time")
    t_last = max((obs.done_ms[j] for j in rdone), default=t_first)
    secs = max(t_last - t_first, 1) / 1000
    rep_lat = [obs.done_ms[j] - resized[j] for j in rdone]
    c2 = allocator_counters(r, cfg.topic_prefix)
    out["repeat"] = {"jobs": len(rdone), "tasks": len(rdone) * REPEAT_GROW, "seconds": round(secs, 3),
                     "jobs_per_s": round(len(rdone) / secs, 3),
                     "p50_ms": _ms(percentile(rep_lat, 50)), "p99_ms": _ms(percentile(rep_lat, 99)),
                     **stages(obs, resized), **_counted(c1, c2)}
    out["whole_workload_cache"] = _counted(c0, c2)
    out["counters_available"] = c2 is not None
    out["rejected_tasks"] = dict(obs.rejected)
    out["notes"] = notes
    out["jobs"] = jobs
    r.close()
    return out


def _region_machines(env) -> list[str]:
    return [m.id for m in iter_machines(load_region(env.cfg.run_dir / "region.yaml"))]


# -- failover ----------------------------------------------------------------------------------------------------

def wait_running(obs: LogObserver, timeout_s: float) -> bool:
    """Until every task allocated so far runs where it is placed and the scheduler has read that it does (its
    ServiceDiscoveryChanged enabling the task there): the pipeline is quiet, no backlog of reports left."""
    def quiet() -> bool:
        for task, machine in obs.placement.items():
            run = obs.running.get(task)
            if run is None or run[0] != machine or obs.discovered.get(task, ("",))[0] != machine:
                return False
        return True
    return obs.wait(quiet, timeout_s)


def failover(env, registry: SchemaRegistry, obs: LogObserver, *, machines: int, fraction: float = 0.01,
             seed: int = 11, timeout_s: float = 300.0) -> dict[str, Any]:
    """Workload 2: fail ``fraction`` of the machines at once, drawn uniformly at random over the region (seeded);
    if none of them runs a task, one drawn machine is swapped for a machine that does."""
    from processors.resourcebroker.processor import fold_machines, produce  # noqa: PLC0415 - start-up cost: processors.resourcebroker.processor (~16 ms over what `ropewalk bench|experiment` load), only for a run

    rng = random.Random(seed)
    n_fail = max(1, round(machines * fraction))
    victims = rng.sample(_region_machines(env), n_fail)
    occupied = sorted(set(obs.placement.values()))
    notes = []
    if occupied and not set(victims) & set(occupied):
        victims[0] = rng.choice(occupied)
        notes.append("no machine drawn ran a task: one was swapped for a machine that does")
    gone = set(victims)
    affected = {t for t, m in obs.placement.items() if m in gone}
    state = fold_machines(env.cfg, registry)
    # The health check's producer is connected long before a failure: this one is too, before the clock starts
    # (a first send's connection and schema publication took ~0.5 s, counted as failover before).
    producer = routed_producer(env.cfg, registry, broker.PRODUCER)  # by the partition map, as the health check's
    producer.prepare("MachinesStatusChanged", "UnavailabilityStarted")
    ends0 = logcount.topic_ends(env.cfg)  # the counters read before the clock starts (a JMX reading takes seconds)
    req0 = brokerstats.read(env.cfg)
    now = int(time.time() * 1000)
    # One decision for all of them, as the health check takes for the machines gone silent in one tick: one
    # MachinesStatusChanged and one UnavailabilityStarted per owner, not two events per machine.
    state, events = broker.machines_failed(state, victims, broker.REASON_OPERATOR, now)
    fail_ts = min((e.timestamp_ms for e in events), default=now)
    cpu0 = env.cpu_seconds()
    produce(producer, events)

    def moved(t: str) -> bool:
        run = obs.running.get(t)
        return run is not None and run[0] not in gone and run[1] >= fail_ts

    ok = obs.wait(lambda: all(moved(t) for t in affected), timeout_s)
    cpu = cpu_used(cpu0, env.cpu_seconds(), 1)
    cost = {"broker": brokerstats.per_job(req0, brokerstats.read(env.cfg), 1),
            "records": logcount.records_between(env.cfg, ends0, logcount.topic_ends(env.cfg), since_ms=fail_ts)}
    lat = [obs.running[t][1] - fail_ts for t in affected if moved(t)]
    hops = failover_hops(obs, [t for t in affected if moved(t)], fail_ts)
    if not ok:
        notes.append(f"{len(affected) - len(lat)} of {len(affected)} affected tasks not running elsewhere within "
                     f"{timeout_s:.0f} s")
    return {"machines_failed": len(victims), "tasks_affected": len(affected), "tasks_moved": len(lat),
            "p50_ms": _ms(percentile(lat, 50)), "p99_ms": _ms(percentile(lat, 99)),
            "all_moved_ms": _ms(max(lat) if lat and ok else None), "hops": hops, "cpu_s": cpu["seconds"],
            "cost": cost, "notes": notes}


HOPS = ("failed -> requested", "requested -> allocated", "allocated -> commanded", "commanded -> running")


def failover_hops(obs: LogObserver, moved: list[str], fail_ts: int) -> dict[str, dict[str, float | None]]:
    """Where a moved task's time went, hop by hop (log times; p50/p99 over the moved tasks): the failure to its job's
    AllocationRequested naming it (the scheduler), to the TasksAllocated placing it (the allocator), to the START on
    its new machine (the scheduler), to its RUNNING (the agent)."""
    spans: dict[str, list[float]] = {h: [] for h in HOPS}
    for t in moved:
        asked, (m, placed), (m2, started), (_, running) = (obs.asked_ms.get(t), obs.allocated_ms.get(t, ("", None)),
                                                            obs.started_ms.get(t, ("", None)), obs.running[t])
        if asked is None or placed is None or started is None or m2 != m:
            continue
        for hop, (a, b) in zip(HOPS, ((fail_ts, asked), (asked, placed), (placed, started), (started, running))):
            spans[hop].append(b - a)
    return {h: {"p50_ms": _ms(percentile(v, 50)), "p99_ms": _ms(percentile(v, 99)), "n": len(v)}
            for h, v in spans.items()}


# -- raw broker rates --------------------------------------------------------------------------------------------

def raw_read(c: Consumer, todo: set[tuple[str, int]], *, limit: int | None = None, deadline: float | None = None,
             poll_s: float = 1.0) -> tuple[int, int]:
    """Consume the partitions ``todo`` (assigned to ``c``, partition EOF on) to their ends, undecoded: (records, key +
    value bytes). Stops early after ``limit`` records or at the monotonic ``deadline``. ``todo`` is emptied."""
    n = size = 0
    while todo and (limit is None or n < limit) and (deadline is None or time.monotonic() < deadline):
        for m in c.consume(10000, poll_s):
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    todo.discard((m.topic(), m.partition()))
                continue
            n += 1
            size += len(m.key() or b"") + len(m.value() or b"")
    return n, size


def mean_record_bytes(cfg: Config, logical: tuple[str, ...] = ("allocations", "tasks"), limit: int = 200_000) -> int:
    """Mean key + value size of the records on ``logical`` topics (raw bytes, read to end of partition)."""
    names = Topics(cfg.topic_prefix, cfg.partitions)
    c = Consumer(consumer_conf(cfg, None))
    try:
        md = c.list_topics(timeout=10)
        todo = {(names.name(t), p) for t in logical for p in md.topics[names.name(t)].partitions}
        c.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in todo])
        n, size = raw_read(c, todo, limit=limit, deadline=time.monotonic() + 60, poll_s=0.5)
        return round(size / n) if n else 200
    finally:
        c.close()


def raw_rates(cfg: Config, records: int, record_bytes: int, repeat: int = 2) -> dict[str, Any]:  # noqa: C901
    """confluent-kafka produce then consume of ``records`` records of ``record_bytes`` (key included) on a topic of
    the configured partition count, with Ropewalk's producer settings (idempotent, acks=all, murmur2); the best
    of ``repeat`` runs of each (the machine may be shared: noise only slows a run down)."""
    from confluent_kafka.admin import AdminClient, NewTopic  # noqa: PLC0415 - start-up cost: confluent_kafka.admin (~6 ms over what `ropewalk bench|experiment` load), only for a run

    admin = AdminClient({**cfg.kafka_conf(), "log_level": 0})
    keys = [f"bench-e{i}".encode() for i in range(100)]
    value = b"x" * max(1, record_bytes - len(keys[0]))
    produce_rates, consume_rates = [], []
    for run in range(repeat):
        topic = f"{cfg.topic_prefix}raw-rate-{run}"
        for fut in admin.create_topics([NewTopic(topic, cfg.partitions, 1)], operation_timeout=15).values():
            fut.result()
        p = Producer(producer_conf(cfg))
        t0 = time.perf_counter()
        for i in range(records):
            while True:
                try:
                    p.produce(topic, key=keys[i % 100], value=value)
                    break
                except BufferError:
                    p.poll(0.05)
            if i % 1000 == 0:
                p.poll(0)
        left = p.flush(120)
        produce_rates.append(records / (time.perf_counter() - t0))
        if left:
            raise RuntimeError(f"raw produce: {left} records undelivered")
        del p
        c = Consumer(consumer_conf(cfg, None, **{"enable.partition.eof": False}))
        c.assign([TopicPartition(topic, part, OFFSET_BEGINNING) for part in range(cfg.partitions)])
        got, t_first = 0, None
        t0 = time.perf_counter()
        deadline = time.monotonic() + 120
        while got < records and time.monotonic() < deadline:
            t_poll = time.perf_counter()
            n = sum(1 for m in c.consume(10000, 0.5) if m.error() is None)
            if n and t_first is None:
                t_first = t_poll  # the clock starts with the fetch that brought the first batch
            got += n
        consume_rates.append(got / (time.perf_counter() - (t_first or t0)))
        c.close()
        if got < records:
            raise RuntimeError(f"raw consume: {got} of {records} records read")
    return {"records": records, "record_bytes": record_bytes, "runs": repeat,
            "produce_per_s": round(max(produce_rates)), "consume_per_s": round(max(consume_rates)),
            "produce_runs": [round(x) for x in produce_rates], "consume_runs": [round(x) for x in consume_rates]}


# -- Redis memory --------------------------------------------------------------------------------------------------

def redis_used_memory(redis_client) -> int:
    return int(redis_client.info("memory")["used_memory"])


# -- rebuild and replay --------------------------------------------------------------------------------------------

def rebuild(env, registry: SchemaRegistry) -> dict[str, Any]:
    """Workload 3a: every Redis index rebuilt from the log (the allocator must be stopped); then, from a snapshot of
    the fold that rebuild made (written as an allocator writes one: processors/allocator/snapshot.py), again:
    ``from_snapshot`` (the snapshot's load, the log after it, the write and the swap)."""
    from processors.allocator import snapshot  # noqa: PLC0415 - start-up cost, as below
    from processors.allocator.rebuild import SWAP_TIMEOUT_S, Rebuild  # noqa: PLC0415 - start-up cost: processors.allocator.rebuild (~480 ms over what `ropewalk bench|experiment` load), only for a run

    r = env.cfg.redis_client(socket_timeout=SWAP_TIMEOUT_S)
    try:
        t0 = time.monotonic()
        rb = Rebuild(env.cfg, registry, r, from_snapshot=False)
        st = rb.run().as_dict()
        wall = time.monotonic() - t0
        t1 = time.monotonic()
        path = snapshot.write(env.cfg, rb.fold, [], records=st["events"])
        written_s = time.monotonic() - t1
        del rb  # its fold: a region's worth of memory
        again = Rebuild(env.cfg, registry, r).run().as_dict()
        starts = {"from_log": allocator_start(env, registry, r, snapshots=False),
                  "from_snapshot": allocator_start(env, registry, r, snapshots=True)}
    finally:
        r.close()
    return {"impl": "processors.allocator.rebuild.rebuild_index", "events": st["events"],
            "index_events": st.get("index_events"), "keys": st["keys"], "seconds": round(st["seconds"], 3),
            "wall_s": round(wall, 3), "events_per_s": round(st["events_per_s"], 1),
            "failed": st.get("failed"), "skipped": st.get("skipped"),
            "from_snapshot": {"snapshot_bytes": path.stat().st_size, "snapshot_write_s": round(written_s, 3),
                              **{k: again[k] for k in ("snapshot", "snapshot_records", "events", "seconds",
                                                       "read_s", "apply_s", "write_s", "swap_s", "log_events_per_s")}},
            "allocator_start": starts}


def allocator_start(env, registry: SchemaRegistry, r, *, snapshots: bool) -> dict[str, Any]:
    """An allocator's start on this log (its catch-up: ready to decide), from the log's beginning or from the newest
    snapshot of its fold, with Redis holding the index already (as after a restart)."""
    from processors.allocator.processor import Allocator  # noqa: PLC0415 - start-up cost, as rebuild's

    a = Allocator(env.cfg, registry, r, None, snapshots=snapshots)
    t0 = time.monotonic()
    st = a.catch_up()
    return {"seconds": round(time.monotonic() - t0, 3), **{k: st[k] for k in ("records", "machines", "read_s",
                                                                             "snapshot", "snapshot_load_s",
                                                                             "redis_behind")}}


def log_size(cfg: Config) -> int:
    """Records in every data topic (listed end offsets)."""
    names = Topics(cfg.topic_prefix, cfg.partitions)
    c = Consumer(consumer_conf(cfg, None))
    try:
        md = c.list_topics(timeout=10)
        total = 0
        for spec in CATALOGUE:
            if spec.name == "_schemas":
                continue
            t = md.topics.get(names.name(spec.name))
            if t is None or t.error is not None:
                continue
            for p in t.partitions:
                lo, hi = c.get_watermark_offsets(TopicPartition(t.topic, p), timeout=10)
                total += hi - lo
        return total
    finally:
        c.close()


def pad_log(cfg: Config, registry: SchemaRegistry, n: int, templates: int = 1000) -> float:
    """Append ``n`` TaskStateChanged events of 100 other entitlements to ``tasks`` (``templates`` distinct events
    encoded once, each sealed as its machine's report, and produced raw, keyed as the catalogue says); seconds
    taken. Sealed as the agents seal theirs (streams/auth.py): the replay checks every one, as it would a real log's."""
    signer = simulated_signer(cfg)
    version = registry.reader("TaskStateChanged").version
    events = []
    for i in range(templates):
        ent = f"pad-e{i % 100:03d}"
        job = f"{ent}.filler{i % 7}"
        ev = new_event("TaskStateChanged", {
            "task_id": f"{job}/{i}", "job_id": job, "machine_id": f"dc1-msb1-r01-m{i % 997:03d}", "state": "RUNNING",
            "previous_state": "STARTING", "exit_code": None, "spec_version": 1, "reason": "started"},
            entitlement=ent, entity_id=f"{job}/{i}", producer=PRODUCER)
        value = (signer.seal(registry, "TaskStateChanged", ev.to_record(version)) if signer is not None
                 else registry.encode("TaskStateChanged", ev.to_record(version)))
        events.append((ent.encode(), value))
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("tasks")
    p = Producer(producer_conf(cfg, **{"linger.ms": 20}))
    t0 = time.perf_counter()
    for i in range(n):
        key, value = events[i % templates]
        while True:
            try:
                p.produce(topic, key=key, value=value)
                break
            except BufferError:
                p.poll(0.05)
        if i % 1000 == 0:
            p.poll(0)
    if p.flush(180):
        raise RuntimeError("padding the log: records undelivered")
    return time.perf_counter() - t0


def replay_audit(env, registry: SchemaRegistry, job: str, entitlement: str, target_events: int) -> dict[str, Any]:
    """Workload 3b: the log padded to ``target_events``, then ``ropewalk replay --job JOB`` (every record examined)
    and the same narrowed by ``--entitlement`` (one partition per co-partitioned topic)."""
    from streams.replay import ReplayFilter, replay  # noqa: PLC0415 - start-up cost: streams.replay (~7 ms over what `ropewalk bench|experiment` load), only for a run

    before = log_size(env.cfg)
    pad = max(0, target_events - before)
    pad_s = pad_log(env.cfg, registry, pad) if pad else 0.0
    out: dict[str, Any] = {"job": job, "log_before_padding": before, "padded": pad, "pad_seconds": round(pad_s, 2)}
    for name, flt in (("job", ReplayFilter(job=job)), ("job_and_entitlement", ReplayFilter(entitlement=entitlement, job=job))):
        run = replay(env.cfg, registry, flt)
        matched = sum(1 for _ in run)
        st = run.stats
        out[name] = {"examined": st.read, "matched": matched, "seconds": round(st.elapsed_s, 3),
                     "events_per_s": round(st.read / st.elapsed_s, 1) if st.elapsed_s else None}
    return out


# -- per-event overhead of faust -------------------------------------------------------------------------------------

def faust_overhead(env, records: int) -> dict[str, Any]:
    """Workload 5: ``bench/faust_overhead.py``'s trivial faust agent and raw aiokafka ``getmany`` reading the same
    ``records`` records (~200 bytes) of one topic, each in a fresh process."""
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - start-up cost: confluent_kafka.admin (~6 ms over what `ropewalk bench|experiment` load), only for a run

    from bench import faust_overhead as fo  # noqa: PLC0415 - start-up cost: bench.faust_overhead (~9 ms over what `ropewalk bench|experiment` load: multiprocessing), only for workload 5

    cfg = env.cfg.with_(topic_prefix=env.cfg.topic_prefix + "faust.")
    provision(AdminClient({**cfg.kafka_conf(), "log_level": 0}),
              Topics(cfg.topic_prefix, cfg.partitions))
    produced = fo.produce(cfg, records)
    raw = fo.isolated(fo.read_aiokafka, cfg, records)
    agent = fo.isolated(fo.read_faust, cfg, records, "iterate", {}, {})
    out = {"records": records, "value_bytes": produced["value_bytes"], "aiokafka": raw, "faust": agent}
    if "rate" in raw and "rate" in agent and agent.get("records") == records:
        out["aiokafka_events_per_s"] = round(raw["rate"], 1)
        out["faust_events_per_s"] = round(agent["rate"], 1)
        out["faust_overhead_us_per_event"] = round(1e6 / agent["rate"] - 1e6 / raw["rate"], 2)
    return out


# -- where the allocation time goes ---------------------------------------------------------------------------------

def profile_allocator(env, registry: SchemaRegistry, requests: int, seed: int = 13, top: int = 15) -> dict[str, Any]:
    """cProfile of the allocator deciding ``requests`` AllocationRequested events one at a time (each a batch of
    one: placement on the fold, the Redis commit, producing the decision), in this process, on a fold of the
    region's log made first (``Allocator.catch_up``, timed: ``fold_s``). The requests are drawn like the allocation
    workload's jobs (same entitlements, shapes and DC requirements)."""
    from processors.allocator.processor import Allocator  # noqa: PLC0415 - start-up cost: processors.allocator.processor (~350 ms over what `ropewalk bench|experiment` load), only for --profile

    r = env.redis()
    producer = EventProducer(env.cfg, registry, "allocator")
    alloc = Allocator(env.cfg, registry, r, producer)
    t0 = time.monotonic()
    folded = alloc.catch_up()
    fold_s = time.monotonic() - t0
    alloc.assign(range(env.cfg.partitions), fenced=False)
    topic = Topics(env.cfg.topic_prefix, env.cfg.partitions).name("allocations")
    dcs = sorted({m.split("-")[0] for m in _region_machines(env)})
    specs = job_specs(requests + 1, entitlement_names(4), dcs, random.Random(seed), "profile")

    def request(spec: dict):
        p = validate_spec(spec)
        job = p["job_id"]
        return new_event("AllocationRequested", {
            "request_id": f"{job}:v1:r1", "job_id": job, "spec_version": 1,
            "place_task_ids": [f"{job}/{k}" for k in range(p["tasks"])], "free_task_ids": [],
            "resources": p["resources"], "requirements": p["requirements"], "spread": p["spread"],
            "avoid_machine_ids": []}, entitlement=p["entitlement"], entity_id=job, producer="scheduler")

    offset = 10**12  # positions past the log's: these requests are fed by hand, not read

    def decide(ev) -> list:
        nonlocal offset
        offset += 1
        alloc.on_records([Record(ev, topic, 0, offset, ev.entitlement.encode(), 0)])
        return alloc.decide_pending()

    # Warm-up, not profiled: the producer's first connection and schema publications are not allocation work.
    decide(request(specs[0]))
    events = [request(spec) for spec in specs[1:]]
    prof = cProfile.Profile()
    per_request = []
    for ev in events:
        t0 = time.perf_counter()
        prof.enable()
        decide(ev)
        prof.disable()
        per_request.append({"ms": round(1000 * (time.perf_counter() - t0), 2), "tasks": len(ev.payload["place_task_ids"])})
    producer.flush(30)
    st = pstats.Stats(prof)
    total = st.total_tt

    def rows(sort: str) -> list[dict]:
        keyed = sorted(st.stats.items(), key=lambda kv: kv[1][3 if sort == "cumulative" else 2], reverse=True)
        out = []
        for (filename, line, func), (cc, nc, tt, ct, _callers) in keyed[:top]:
            out.append({"function": f"{_short(filename)}:{line}({func})", "calls": nc, "self_s": round(tt, 4),
                        "cumulative_s": round(ct, 4), "self_share": round(tt / total, 4) if total else None})
        return out

    r.close()
    ms = sorted(q["ms"] for q in per_request)
    return {"target": "processors.allocator.processor.Allocator.decide_pending (one request per batch), in-process, "
                      "cProfile", "requests": requests, "per_request": per_request,
            "decide_p50_ms": percentile(ms, 50), "decide_p99_ms": percentile(ms, 99),
            "fold_s": round(fold_s, 3), "fold": folded,
            "profiled_s": round(total, 3), "top_cumulative": rows("cumulative"), "top_self": rows("self")}


def _short(filename: str) -> str:
    root = str(PROJECT_ROOT) + "/"
    if filename.startswith(root):
        return filename[len(root):]
    if "/site-packages/" in filename:
        return filename.split("/site-packages/", 1)[1]
    return filename
