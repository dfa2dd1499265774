"""``ropewalk bench``: the whole-pipeline benchmark of issue #5, one command.

    ropewalk bench [--machines N] [--schedulers N] [--allocators M] [--brokers B] [--quick] [--json]

It starts an embedded broker, a private Redis and the control plane on free ports, a temporary run directory and
a topic prefix of its own (a running ``ropewalk up`` is left alone), registers a simulated region of N machines
with simulated agents, runs the workloads of ``bench/workloads.py`` and stops everything it started (also on an
error or Ctrl-C). It prints a table, or with ``--json`` one JSON document, with every figure and its conditions.

Every run also measures the broker's raw rate (confluent-kafka produce and consume of records of the pipeline's
mean size, same broker, same run) and reports each pipeline rate as a ratio to it (``ratios``): rates at which the
pipeline *writes* the log (allocation) against raw produce, rates at which it *reads* the log (rebuild, replay,
faust, aiokafka) against raw consume.

Order of the run (what runs beside what matters on a small machine):

    infrastructure + topics, Redis baseline
    region: Resource Broker registers N machines, agents, health, allocators, scheduler shards  -> Redis bytes
    1 allocation: latency phase (1 job in flight), burst phase, repeat phase (every burst job grows)
    raw rates (the control plane running, as for the pipeline figures, but quiet: no backlog left)
    2 failover of 1% of the machines
    4 peak RSS of every process; workers stopped
    3 rebuild of the Redis index from the log; log padded to the replay size; audit replay of one job
    5 faust agent vs raw aiokafka
    profile: cProfile of the allocator's request handling, in-process on the region's index
    identities: what sealing and checking a record's proof costs per event, in-process (bench/identities.py)
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any, Callable

import confluent_kafka

from bench import identities
from bench import workloads as w
from bench.env import BenchEnv, cores, health_timeout_ms, heartbeat_interval_ms, sigterm_as_interrupt
from infra.broker import KAFKA_VERSION
from infra.config import check_brokers, embedded_replication_factor
from processors.frontend.console import Progress
from processors.resourcebroker.region import load_region
from streams.serde import SchemaRegistry

REQUIRED = ("machines", "cores", "raw_produce_per_s", "raw_consume_per_s", "alloc_jobs_per_s", "alloc_tasks_per_s",
            "alloc_p50_ms", "alloc_p99_ms", "cache_hit_ratio", "failover_p50_ms", "failover_p99_ms",
            "rebuild_events_per_s", "replay_events_per_s", "redis_bytes_per_machine")

# rate -> the raw rate it is reported against
RATIO_BASES = MappingProxyType({
    "alloc_jobs_per_s": "raw_produce_per_s",
    "alloc_tasks_per_s": "raw_produce_per_s",
    "alloc_events_per_s": "raw_produce_per_s",
    "pipeline_tasks_running_per_s": "raw_produce_per_s",
    "rebuild_events_per_s": "raw_consume_per_s",
    "rebuild_from_snapshot_log_events_per_s": "raw_consume_per_s",
    "replay_events_per_s": "raw_consume_per_s",
    "replay_narrowed_events_per_s": "raw_consume_per_s",
    "faust_events_per_s": "raw_consume_per_s",
    "aiokafka_events_per_s": "raw_consume_per_s",
})


@dataclass(frozen=True)
class Options:
    machines: int = 10_000
    latency_jobs: int = 20  # phase 1: jobs submitted one at a time
    burst_jobs: int = 400  # phase 2: jobs submitted at once
    repeat_jobs: int = 200  # phase 3: burst jobs that grow by a few tasks
    partitions: int = 8
    replay_events: int = 1_000_000  # the log is padded to this many events before the audit replay
    raw_records: int = 200_000
    faust_records: int = 100_000
    profile_requests: int = 10
    identity_events: int = 20_000  # heartbeats sealed and checked (bench/identities.py)
    failover_fraction: float = 0.01
    phase_timeout_s: float = 300.0  # cap of each waiting phase; a capped phase reports what finished, with a note
    seed: int = 7
    schedulers: int = 1  # scheduler shards, each its own process (scheduler-0..N-1)
    allocators: int = 1  # allocators, each its own process (allocator-0..M-1)
    brokers: int = 1  # nodes of the embedded Kafka cluster (3: replication factor 3, min.insync.replicas 2)
    keep: bool = False  # keep the run directory (logs) after the run
    quick: bool = False


QUICK = MappingProxyType(dict(machines=1000, latency_jobs=3, burst_jobs=20, repeat_jobs=10, replay_events=50_000,
             raw_records=50_000, faust_records=20_000, profile_requests=3, phase_timeout_s=60.0, quick=True,
             identity_events=5_000))


def options_for(machines: int | None = None, quick: bool = False, **overrides: Any) -> Options:
    opts = Options(**QUICK) if quick else Options()
    if machines is not None:
        opts = replace(opts, machines=machines)
    return replace(opts, **{k: v for k, v in overrides.items() if v is not None})


def _ratio(rate: float | None, base: float | None) -> float | None:
    """rate / base to 4 significant digits."""
    if rate is None or not base:
        return None
    return float(f"{rate / base:.4g}")


def run(opts: Options, progress: Callable[[str], None] | None = None) -> dict[str, Any]:  # noqa: C901
    """Run every workload on a region of its own; the JSON document (see README: ``ropewalk bench``)."""
    say = progress or (lambda msg: None)
    if opts.machines < 2:
        raise ValueError(f"--machines: at least 2 machines (one per DC), got {opts.machines}")
    for flag, n in (("--schedulers", opts.schedulers), ("--allocators", opts.allocators)):
        if not 1 <= n <= opts.partitions:
            raise ValueError(f"{flag}: expected from 1 to {opts.partitions} (the partitions: each owns one at least), "
                             f"got {n}")

    try:
        check_brokers(opts.brokers)
    except ValueError as exc:
        raise ValueError(f"--brokers: {exc}") from None

    t_start = time.monotonic()
    registry = SchemaRegistry.from_dir()
    notes: dict[str, str] = {}
    details: dict[str, Any] = {}
    doc: dict[str, Any] = {"machines": opts.machines, "cores": cores(), "partitions": opts.partitions,
                           "schedulers": opts.schedulers, "allocators": opts.allocators, "brokers": opts.brokers}
    with BenchEnv(partitions=opts.partitions, keep=opts.keep, brokers=opts.brokers) as env:
        say(f"infrastructure up on {env.cfg.bootstrap_servers} / {env.cfg.redis_url} (run dir {env.run_dir})")
        r = env.redis()
        redis_empty = w.redis_used_memory(r)
        say(f"registering a simulated region of {opts.machines} machines")
        say(f"{opts.schedulers} scheduler shards, {opts.allocators} allocators, {opts.brokers} broker nodes")
        region = env.start_region(opts.machines, timeout_s=max(120.0, opts.machines / 50),
                                  schedulers=opts.schedulers, allocators=opts.allocators)
        redis_region = w.redis_used_memory(r)
        doc["redis_bytes_per_machine"] = round((redis_region - redis_empty) / opts.machines, 1)
        details["region"] = {"machines_up": region["machines_up"], "ready_s": round(region["seconds"], 2),
                             "indexed_s": round(region["indexed_s"], 2), "caught_up": region["caught_up"],
                             **_region_shape(env)}

        def check_workers(phase: str) -> None:
            for name, tail in env.dead_workers().items():
                notes.setdefault(f"worker.{name}", f"exited during or before {phase}: {tail}")

        obs = w.LogObserver(env.cfg, registry)
        try:
            say(f"1/5 allocation: {opts.latency_jobs} jobs one at a time, a burst of {opts.burst_jobs}, "
                f"{opts.repeat_jobs} repeated")
            alloc = w.allocation(env, registry, obs, machines=opts.machines, latency_jobs=opts.latency_jobs,
                                 burst_jobs=opts.burst_jobs, repeat_jobs=opts.repeat_jobs, seed=opts.seed,
                                 shards=opts.schedulers, timeout_s=opts.phase_timeout_s * 2)
            jobs = alloc.pop("jobs")
            check_workers("the allocation workload")
            redis_loaded = w.redis_used_memory(r)
            tasks_placed = len(obs.placement)
            burst = alloc["burst"]
            doc["alloc_jobs_per_s"] = burst["jobs_per_s"]
            doc["alloc_tasks_per_s"] = burst["tasks_per_s"]
            doc["alloc_p50_ms"] = alloc["latency"]["p50_ms"]
            doc["alloc_p99_ms"] = alloc["latency"]["p99_ms"]
            doc["pipeline_tasks_running_per_s"] = burst.get("tasks_running_per_s")
            doc["alloc_burst_p50_ms"] = burst["p50_ms"]
            doc["alloc_burst_p99_ms"] = burst["p99_ms"]
            # CPU per job of the burst, per process (every scheduler shard and allocator on its own), and summed
            doc["cpu_ms_per_job"] = (burst["cpu"]["ms_per_job"] or {})
            doc["cpu_ms_per_job_total"] = round(sum(doc["cpu_ms_per_job"].values()), 3) if burst["cpu"]["ms_per_job"] \
                else None
            # ... and over the burst jobs' whole life (to every task RUNNING), with the broker's requests and the
            # records written per job (bench/brokerstats.py, bench/logcount.py) and the region's cost with nothing in
            # flight (a phase's figure per job holds that much per second of the phase)
            cost = burst["cost"]
            life = cost["to_running"]
            doc["cpu_ms_per_job_to_running"] = life["cpu_ms_per_job"] or {}
            doc["cpu_ms_per_job_to_running_total"] = round(sum(doc["cpu_ms_per_job_to_running"].values()), 3) \
                if life["cpu_ms_per_job"] else None
            doc["broker_requests_per_job"] = (cost["to_allocated"]["broker_per_job"] or {}).get("requests_total")
            doc["broker_requests_per_job_to_running"] = (life["broker_per_job"] or {}).get("requests_total")
            doc["records_per_job"] = life["records_per_job"]["total"]
            doc["background_cpu_ms_per_s"] = cost["background"]["cpu_ms_per_s"]
            doc["cache_hit_ratio"] = alloc["repeat"]["cache_hit_ratio"]
            doc["cache_hit_ratio_whole_workload"] = alloc["whole_workload_cache"]["cache_hit_ratio"]
            notes["cache_hit_ratio"] = ("no job-level cache: every decision runs on the allocator's in-memory fold "
                                        "of the region, a miss costs what a hit did (profile: decide_p50_ms)")
            for i, n in enumerate(alloc.pop("notes")):
                notes[f"allocation.{i}"] = n
            doc["jobs"] = len(jobs)
            doc["tasks_per_job"] = round(sum(n for _, n in jobs.values()) / len(jobs), 2) if jobs else None
            doc["alloc_events_per_s"] = _events_rate(obs, burst)
            details["allocation"] = alloc
            details["redis"] = {"empty_bytes": redis_empty, "region_bytes": redis_region, "loaded_bytes": redis_loaded,
                                "tasks_placed": tasks_placed,
                                "bytes_per_machine_loaded": round((redis_loaded - redis_empty) / opts.machines, 1),
                                "bytes_per_placed_task": round((redis_loaded - redis_region) / tasks_placed, 1)
                                if tasks_placed else None}
            doc["redis_bytes_per_machine_loaded"] = details["redis"]["bytes_per_machine_loaded"]

            if not w.wait_running(obs, opts.phase_timeout_s):
                notes["pipeline.quiet"] = ("the pipeline still had a backlog after the allocation workload (not every "
                                           "task RUNNING and read so by the scheduler) when the raw rates and the "
                                           "failover were measured")
            say("raw broker rates (confluent-kafka, same-sized records)")
            size = w.mean_record_bytes(env.cfg)
            raw = w.raw_rates(env.cfg, opts.raw_records, size)
            doc["raw_produce_per_s"] = raw["produce_per_s"]
            doc["raw_consume_per_s"] = raw["consume_per_s"]
            doc["record_bytes"] = size
            details["raw"] = raw

            say(f"2/5 failover: {opts.failover_fraction:.0%} of the machines fail at once")
            fo = w.failover(env, registry, obs, machines=opts.machines, fraction=opts.failover_fraction,
                            seed=opts.seed + 4, timeout_s=opts.phase_timeout_s)
            for i, n in enumerate(fo.pop("notes")):
                notes[f"failover.{i}"] = n
            doc["failover_broker_requests"] = (fo["cost"]["broker"] or {}).get("requests_total")
            doc["failover_records"] = fo["cost"]["records"]["total"]
            doc["failover_p50_ms"] = fo["p50_ms"]
            doc["failover_p99_ms"] = fo["p99_ms"]
            if fo["p50_ms"] is None:
                notes["failover_p50_ms"] = notes["failover_p99_ms"] = (
                    f"no affected task ran elsewhere ({fo['tasks_affected']} affected)")
            details["failover"] = fo
            check_workers("the failover workload")
        finally:
            obs.close()

        say("4/5 peak RSS of every process; stopping the control plane")
        env.stop_workers()
        details["peak_rss_kib"] = env.peak_rss()

        say("3/5 rebuild of the Redis index from the log")
        try:  # a failed rebuild is a finding of its own: the figures measured before it are still printed
            details["rebuild"] = w.rebuild(env, registry)
            doc["rebuild_events_per_s"] = details["rebuild"]["events_per_s"]
            doc["rebuild_seconds"] = details["rebuild"]["seconds"]
            snap = details["rebuild"]["from_snapshot"]  # the same log's index, from a snapshot of its fold
            doc["rebuild_from_snapshot_seconds"] = snap["seconds"]
            doc["rebuild_from_snapshot_log_events_per_s"] = snap["log_events_per_s"]
            for how, start in details["rebuild"]["allocator_start"].items():
                doc[f"allocator_start_{how}_s"] = start["seconds"]
        except Exception as exc:  # noqa: BLE001 - reported in the document
            notes["rebuild_events_per_s"] = f"the rebuild failed: {type(exc).__name__}: {exc}"
            say(f"3/5 rebuild failed: {exc}")
        say(f"3/5 audit replay of one job in a log of {opts.replay_events:,} events")
        job, (ent, _) = next(iter(jobs.items()))
        rp = w.replay_audit(env, registry, job, ent, opts.replay_events)
        details["replay"] = rp
        doc["replay_events_per_s"] = rp["job"]["events_per_s"]
        doc["replay_seconds"] = rp["job"]["seconds"]
        doc["replay_log_events"] = rp["job"]["examined"]
        doc["replay_narrowed_events_per_s"] = rp["job_and_entitlement"]["events_per_s"]

        say(f"5/5 per-event overhead: a trivial faust agent vs raw aiokafka, {opts.faust_records:,} records")
        fa = w.faust_overhead(env, opts.faust_records)
        details["faust"] = fa
        doc["faust_events_per_s"] = fa.get("faust_events_per_s")
        doc["aiokafka_events_per_s"] = fa.get("aiokafka_events_per_s")
        doc["faust_overhead_us_per_event"] = fa.get("faust_overhead_us_per_event")
        if doc["faust_events_per_s"] is None:
            notes["faust_events_per_s"] = f"a reader failed: {fa.get('faust')} / {fa.get('aiokafka')}"

        say(f"profile: the allocator handling {opts.profile_requests} requests, in-process")
        details["profile"] = w.profile_allocator(env, registry, opts.profile_requests)
        say("identities: sealing and checking proofs, per event, in-process")

        ids = identities.measure(opts.identity_events)
        details["identities"] = ids
        doc["heartbeat_sign_us"] = ids["heartbeat"]["sign_cost_us"]
        doc["heartbeat_verify_us"] = ids["heartbeat"]["verify_cost_us"]
        doc["heartbeat_decode_us"] = ids["heartbeat"]["decode_us"]
        doc["health_verify_core_share_5000_per_s"] = ids["health_check_at_5000_per_s"]["hmac_core_share"]
        r.close()
        pids = env.pids
        workers = [p.name.rpartition("-")[0] if p.name.rpartition("-")[2].isdigit() else p.name.split("-")[0]
                   for p in env.workers]

    doc["ratios"] = {rate: {"base": base, "ratio": _ratio(doc.get(rate), doc.get(base))}
                     for rate, base in RATIO_BASES.items() if rate in doc}
    doc["worker_processes"] = {name: workers.count(name) for name in sorted(set(workers))}
    doc["conditions"] = _conditions(opts, doc, details)
    doc["memory"] = {"peak_rss_kib": details.pop("peak_rss_kib"), "redis": details.pop("redis")}
    doc["profile"] = details.pop("profile")
    alloc = details.get("allocation", {})
    doc["profile"]["pipeline_stages"] = {
        phase: {k: v for k, v in alloc[phase].items() if k.startswith(("scheduler_", "allocator_"))}
        for phase in ("latency", "burst", "repeat") if phase in alloc}
    doc["pids"] = dict(pids)
    doc["details"] = details
    doc["notes"] = notes
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    return doc


def _events_rate(obs, burst: dict) -> float | None:
    """Records on ``allocations`` and ``tasks`` with a log time within the burst, per second of the burst."""
    lo, hi = burst["t_first_ms"], burst["t_last_ms"]
    if hi <= lo:
        return None
    return round(sum(lo <= t <= hi for t in obs.times) / ((hi - lo) / 1000), 1)


def _region_shape(env) -> dict:
    spec = load_region(env.cfg.run_dir / "region.yaml")
    return {"dcs": len(spec.dcs), "msbs": sum(len(dc.msbs) for dc in spec.dcs),
            "racks": sum(dc.racks for dc in spec.dcs)}


def _conditions(opts: Options, doc: dict, details: dict) -> dict:
    import redis as redis_py  # noqa: PLC0415 - start-up cost: redis (~45 ms over what `ropewalk bench|experiment` load), only for a run's report

    versions = {"python": platform.python_version(), "confluent_kafka": confluent_kafka.__version__,
                "librdkafka": confluent_kafka.libversion()[0], "redis_py": redis_py.__version__}
    for mod in ("faust", "aiokafka", "fastavro"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = None

    versions["kafka (embedded broker)"] = KAFKA_VERSION
    return {"machines": opts.machines, "region": details.get("region"), "jobs": doc.get("jobs"),
            "tasks_per_job": doc.get("tasks_per_job"),
            "tasks_per_job_range": [w.TASKS_MIN, w.TASKS_MAX], "task_shapes": [list(s) for s in w.SHAPES],
            "dc_requirement_share": w.DC_REQUIREMENT_SHARE, "partitions": opts.partitions,
            "worker_processes": doc["worker_processes"], "cores": doc["cores"],
            "heartbeat_interval_ms": heartbeat_interval_ms(opts.machines),
            "health_timeout_ms": health_timeout_ms(opts.machines), "record_bytes": doc.get("record_bytes"),
            "options": asdict(opts), "versions": versions, "platform": platform.platform(),
            "broker": f"embedded Apache Kafka (KRaft, {_nodes(opts.brokers)}, data on disk)", "clock": "log timestamps (CreateTime) of one machine"}


def _nodes(brokers: int) -> str:
    return "one node" if brokers == 1 else f"{brokers} nodes, replication factor {embedded_replication_factor(brokers)}"


# -- output ----------------------------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


ROWS = (
    ("raw_produce_per_s", "records/s", "confluent-kafka produce, record_bytes each"),
    ("raw_consume_per_s", "records/s", "confluent-kafka consume, same records"),
    ("alloc_jobs_per_s", "jobs/s", "burst: submit -> all tasks allocated"),
    ("alloc_tasks_per_s", "tasks/s", "burst"),
    ("alloc_events_per_s", "records/s", "burst: allocations+tasks records written"),
    ("pipeline_tasks_running_per_s", "tasks/s", "burst: submit -> every task RUNNING, read by the scheduler"),
    ("alloc_p50_ms", "ms", "one job in flight: submit -> all allocated"),
    ("alloc_p99_ms", "ms", "one job in flight"),
    ("alloc_burst_p50_ms", "ms", "burst (queueing included)"),
    ("alloc_burst_p99_ms", "ms", "burst"),
    ("cpu_ms_per_job_total", "ms", "burst: CPU of every process per job, to all allocated"),
    ("cpu_ms_per_job_to_running_total", "ms", "burst: the same to every task RUNNING (the job's whole life)"),
    ("broker_requests_per_job", "requests", "burst: broker requests per job, to all allocated (JMX)"),
    ("broker_requests_per_job_to_running", "requests", "burst: the same to every task RUNNING"),
    ("records_per_job", "records", "burst: records written per job to RUNNING (heartbeats aside)"),
    ("failover_broker_requests", "requests", "failover: broker requests, failure to every task moved"),
    ("failover_records", "records", "failover: records written (heartbeats aside)"),
    ("cache_hit_ratio", "", "allocator cache (none: see notes)"),
    ("cache_hit_ratio_whole_workload", "", "allocator cache (none)"),
    ("failover_p50_ms", "ms", "failure event -> task RUNNING elsewhere"),
    ("failover_p99_ms", "ms", ""),
    ("rebuild_events_per_s", "events/s", "log -> Redis index"),
    ("rebuild_seconds", "s", ""),
    ("rebuild_from_snapshot_log_events_per_s", "events/s", "the same log's index from a snapshot of its fold"),
    ("rebuild_from_snapshot_seconds", "s", "load, the log after it, write, swap"),
    ("allocator_start_from_log_s", "s", "an allocator's catch-up from the log's beginning (Redis current)"),
    ("allocator_start_from_snapshot_s", "s", "the same from the newest snapshot of its fold"),
    ("replay_events_per_s", "events/s", "audit of one job (--job), whole log"),
    ("replay_seconds", "s", ""),
    ("replay_log_events", "events", "log size examined"),
    ("replay_narrowed_events_per_s", "events/s", "--job with --entitlement"),
    ("faust_events_per_s", "events/s", "trivial faust agent"),
    ("aiokafka_events_per_s", "events/s", "raw aiokafka getmany"),
    ("faust_overhead_us_per_event", "us", "faust minus aiokafka"),
    ("heartbeat_decode_us", "us", "a heartbeat decoded: the baseline every reader pays"),
    ("heartbeat_sign_us", "us", "a heartbeat sealed by its machine (HMAC-SHA256), beyond encoding"),
    ("heartbeat_verify_us", "us", "a heartbeat's proof checked by the health check, beyond decoding"),
    ("health_verify_core_share_5000_per_s", "cores", "checking 5,000 heartbeats/s (1,000,000 machines)"),
    ("redis_bytes_per_machine", "bytes", "used_memory of the region / machines"),
    ("redis_bytes_per_machine_loaded", "bytes", "after the allocation workload"),
)


def _failover_lines(doc: dict) -> list[str]:
    hops = (doc["details"].get("failover") or {}).get("hops")
    if not hops:
        return []
    return ["", "where a failover's time goes (from the log, per moved task; the agents' start delay is in the last "
                "hop), ms:"] + [f"  {hop:24} p50 {_fmt(hops[hop]['p50_ms'])} p99 {_fmt(hops[hop]['p99_ms'])}"
                               for hop in w.HOPS if hop in hops]


def format_table(doc: dict) -> str:
    c = doc["conditions"]
    lines = [f"ropewalk bench: {doc['machines']:,} machines ({c['region']['dcs']} DCs, {c['region']['msbs']} MSBs, "
             f"{c['region']['racks']} racks), {doc.get('jobs')} jobs x {doc.get('tasks_per_job')} tasks on average, "
             f"{doc['partitions']} partitions, {sum(doc['worker_processes'].values())} worker processes "
             f"({doc['worker_processes'].get('scheduler')} scheduler shards, {doc['worker_processes'].get('allocator')} "
             f"allocators), {doc['cores']} cores, records of {doc.get('record_bytes')} bytes, "
             f"wall time {doc['wall_s']:.0f} s", ""]
    lines.append(f"{'figure':32} {'value':>14} {'unit':10} {'x raw':>8}  conditions")
    for key, unit, cond in ROWS:
        ratio = doc["ratios"].get(key, {}).get("ratio")
        base = doc["ratios"].get(key, {}).get("base", "")
        r = f"{ratio:.3g}" if ratio is not None else ""
        cond = f"{cond} (vs {base.replace('_per_s', '')})" if base else cond
        lines.append(f"{key:32} {_fmt(doc.get(key)):>14} {unit:10} {r:>8}  {cond}")
    lines += ["", "peak RSS (MiB): " + ", ".join(f"{k} {v / 1024:.0f}" for k, v in doc["memory"]["peak_rss_kib"].items()
                                                 if v is not None)]
    prof = doc["profile"]
    lines += ["", "where a job's latency goes (from the log: submit -> AllocationRequested -> all TasksAllocated), ms:"]
    for phase, st in prof.get("pipeline_stages", {}).items():
        lines.append(f"  {phase:8} scheduler p50 {_fmt(st.get('scheduler_p50_ms'))} p99 {_fmt(st.get('scheduler_p99_ms'))}"
                     f" | allocator p50 {_fmt(st.get('allocator_p50_ms'))} p99 {_fmt(st.get('allocator_p99_ms'))}")
    lines += _failover_lines(doc)
    burst = doc["details"].get("allocation", {}).get("burst", {})
    cpu = burst.get("cpu")
    if cpu and cpu.get("ms_per_job"):
        lines += ["", f"CPU per job of the burst, ms (user + system, from /proc; {cpu['total_s']:.1f} s in all): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu["ms_per_job"].items(), key=lambda kv: -kv[1]))]
    cost = burst.get("cost")
    if cost:
        life = cost["to_running"]
        if life["cpu_ms_per_job"]:
            lines.append("... to every task RUNNING: " + ", ".join(
                f"{k} {v:.2f}" for k, v in sorted(life["cpu_ms_per_job"].items(), key=lambda kv: -kv[1])))
        lines.append("with nothing in flight, CPU ms per s: " + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(cost["background"]["cpu_ms_per_s"].items(), key=lambda kv: -kv[1])))
        for label, b in (("broker requests per job, to allocated", cost["to_allocated"]["broker_per_job"]),
                         ("broker requests per job, to RUNNING", life["broker_per_job"]),
                         ("broker requests per s, nothing in flight", cost["background"]["broker_per_s"])):
            if b:
                lines.append(f"{label}: {b['requests_total']} (" + ", ".join(
                    f"{k} {v}" for k, v in b["requests"].items()) + ")")
        lines.append("records per job to RUNNING, by producer and type: " + ", ".join(
            f"{k} {v}" for k, v in life["records_per_job"]["by_type"].items()))
    each = ", ".join(f"{q['ms']:.1f}" for q in prof["per_request"])
    lines += ["", f"where the allocator's time goes ({prof['target']}; {prof['requests']} requests after a fold of "
                  f"the log in {prof.get('fold_s')} s; ms each: {each}):"]
    for row in prof["top_cumulative"][:10]:
        lines.append(f"  {row['cumulative_s']:8.3f} s cum {row['self_s']:8.3f} s self {row['calls']:>9}  {row['function']}")
    if doc["notes"]:
        lines += ["", "notes:"] + [f"  {k}: {v}" for k, v in doc["notes"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ropewalk bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The bench's flags (``ropewalk bench``: bench/cli.py; ``python bench/harness.py``: ``main``)."""
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--machines", type=int, help="simulated machines of the region (default 10000; --quick 1000)")
    ap.add_argument("--quick", action="store_true", help="smoke size: about a minute")
    ap.add_argument("--jobs", type=int, help="jobs of the burst phase (default 400; --quick 20)")
    ap.add_argument("--partitions", type=int, help="partitions of each entitlement-keyed topic (default 8)")
    ap.add_argument("--schedulers", type=int, help="scheduler shards, each its own process (default 1)")
    ap.add_argument("--allocators", type=int, help="allocators, each its own process (default 1)")
    ap.add_argument("--brokers", type=int, help="nodes of the embedded Kafka cluster (default 1; 3: every topic "
                    "replicated 3 times, min.insync.replicas 2, as `ropewalk up --brokers 3`)")
    ap.add_argument("--replay-events", type=int, help="log size of the audit replay (default 1,000,000)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (worker logs) after the run")


def run_cli(args) -> int:
    opts = options_for(args.machines, args.quick, burst_jobs=args.jobs, partitions=args.partitions,
                       replay_events=args.replay_events, keep=args.keep or None, schedulers=args.schedulers,
                       allocators=args.allocators, brokers=args.brokers)

    with sigterm_as_interrupt(), Progress(name="bench") as progress:  # each phase on stderr (console.Progress)
        doc = run(opts, progress)
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else format_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
