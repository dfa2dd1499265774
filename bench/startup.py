"""How fast a region is ready and what a heartbeat costs the health check (issue #28 items 3 and 5).

    .venv/bin/python -m bench.startup --machines N [--steady-s 60] [--json] [--keep]

On a region of its own (``bench.env.BenchEnv``: own broker, Redis, ports, run directory), with the bench's heartbeat
settings (``bench.env.heartbeat_interval_ms``: 5,000 heartbeats a second in all above 100,000 machines):

1. **fresh start**: the workers start on an empty log and the Resource Broker registers the region; ready when the
   allocator's index holds every machine UP and the scheduler committed the machine topics (``BenchEnv.start_region``,
   what ``ropewalk bench`` reports as ``ready_s``), then one probe job of 10 tasks is submitted and allocated (its
   latency says the region takes work). CPU seconds of every process from its start to ready.
2. **steady**: once the health check has read the registrations (``BenchEnv.wait_health_caught_up``: it folds them
   after the allocator and the scheduler are ready, ~40 s of a core at 1,000,000 machines, which a window opened at
   once counted as heartbeats' cost: 0.72 of a core, 2026-11-29), nothing but heartbeats for ``--steady-s`` seconds:
   the CPU each process uses, as a share of a core; the health check's per heartbeat (heartbeats counted on the log
   over the same window).

Each figure comes with the broker's raw consume rate of the same run (records/s of same-sized records), the
baseline to compare it with on a machine others use. CPU seconds (``/proc``) are what the process did, whatever
else the machine ran: the figures to compare before and after on a noisy machine.
3. **restart** (``--no-restart`` leaves it out): the control plane stopped, the allocator's Redis index rebuilt from
   the log's beginning, a snapshot of that fold written (as an allocator writes one), the index rebuilt again from the
   snapshot, then an allocator's start (its catch-up, Redis current) from the log and from the snapshot
   (``bench.workloads.rebuild``; processors/allocator/snapshot.py).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from bench import workloads as w
from bench.env import BenchEnv, cores, health_timeout_ms, heartbeat_interval_ms, sigterm_as_interrupt
from bench.observe import LogObserver
from streams.clients import consumer_conf
from streams.partitionmap import routed_producer
from streams.serde import SchemaRegistry
from streams.topics import Topics

PROBE_TASKS = 10
PROBE_ENTITLEMENT = "startup-e0"


def _heartbeats_on_log(cfg) -> int:
    """Records on ``heartbeats`` (end offsets summed): what the agents produced so far."""
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("heartbeats")
    c = Consumer(consumer_conf(cfg, None))
    try:
        md = c.list_topics(topic, timeout=10).topics[topic]
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in md.partitions)
    finally:
        c.close()


def _probe(env, registry, obs: LogObserver, producer, tag: str, timeout_s: float) -> float | None:
    """Submit one job of PROBE_TASKS tasks; seconds (log times) until all its tasks are allocated, None if not."""
    spec = {"name": f"probe{tag}", "entitlement": PROBE_ENTITLEMENT, "tasks": PROBE_TASKS, "command": ["sleep", "3600"],
            "resources": {"cpu_millicores": 100, "memory_mib": 128}, "spread": "msb"}
    job, ts = w.submit(producer, spec)
    producer.flush(30)
    obs.expect(job, PROBE_TASKS)
    if not obs.wait(lambda: job in obs.done_ms, timeout_s):
        return None
    return (obs.done_ms[job] - ts) / 1000


def _cpu(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 2) for k in sorted(after)}


def run(machines: int, steady_s: float, keep: bool, partitions: int, say, restart: bool = True) -> dict[str, Any]:
    registry = SchemaRegistry.from_dir()
    doc: dict[str, Any] = {"machines": machines, "cores": cores(), "partitions": partitions,
                           "heartbeat_interval_ms": heartbeat_interval_ms(machines),
                           "health_timeout_ms": health_timeout_ms(machines), "notes": {}}
    t_all = time.monotonic()
    with BenchEnv(partitions=partitions, keep=keep) as env:
        doc["run_dir"] = str(env.run_dir)
        say(f"fresh start: registering {machines:,} machines")
        region = env.start_region(machines, timeout_s=max(300.0, machines / 20))
        t_ready = time.monotonic()
        cpu_ready = env.cpu_seconds()
        doc["fresh"] = {"ready_s": round(region["seconds"], 2), "indexed_s": round(region["indexed_s"], 2),
                        "caught_up": region["caught_up"],
                        "cpu_s_to_ready": {k: round(v, 2) for k, v in sorted(cpu_ready.items()) if k != "harness"}}
        w.create_entitlements(env.cfg, registry, [PROBE_ENTITLEMENT], quota=machines)
        producer = routed_producer(env.cfg, registry, "bench", **{"linger.ms": 0})  # by the partition map
        producer.prepare("JobSubmitted")
        obs = LogObserver(env.cfg, registry)
        try:
            doc["fresh"]["probe_s"] = _probe(env, registry, obs, producer, "0", 120.0)

            say(f"steady: heartbeats only, {steady_s:.0f} s, once the health check has read the registrations")
            if not env.wait_health_caught_up(time.monotonic() + max(120.0, machines / 5000)):
                doc["notes"]["steady"] = "the health check had not read the machines topic to its end when measured"
            doc["fresh"]["health_caught_up_s"] = round(region["seconds"] + time.monotonic() - t_ready, 2)
            time.sleep(min(10.0, steady_s / 4))  # the probe's tasks start; then nothing but heartbeats
            hb0, cpu0, t0 = _heartbeats_on_log(env.cfg), env.cpu_seconds(), time.monotonic()
            time.sleep(steady_s)
            hb1, cpu1, t1 = _heartbeats_on_log(env.cfg), env.cpu_seconds(), time.monotonic()
            secs = t1 - t0
            beats = hb1 - hb0
            used = _cpu(cpu0, cpu1)
            doc["steady"] = {"seconds": round(secs, 1), "heartbeats": beats, "heartbeats_per_s": round(beats / secs, 1),
                             "cpu_share_of_a_core": {k: round(v / secs, 3) for k, v in used.items()},
                             "health_us_per_heartbeat": round(1e6 * used.get("health", 0.0) / beats, 1) if beats else None}
        finally:
            obs.close()
        doc["peak_rss_kib"] = env.peak_rss()
        if restart:
            say("restart: the control plane stopped; the index rebuilt and an allocator started, from the log's "
                "beginning and from a snapshot of the allocator's fold")
            env.stop_workers()
            doc["restart"] = w.rebuild(env, registry)
        raw = w.raw_rates(env.cfg, 100_000, w.mean_record_bytes(env.cfg))
        doc["raw_produce_per_s"], doc["raw_consume_per_s"] = raw["produce_per_s"], raw["consume_per_s"]
    doc["wall_s"] = round(time.monotonic() - t_all, 1)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0])
    ap.add_argument("--machines", type=int, default=10_000)
    ap.add_argument("--steady-s", type=float, default=60.0, help="seconds of heartbeats only (default 60)")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep the run directory (worker logs)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-restart", action="store_true", help="leave out the restart phase (rebuilds, starts)")
    args = ap.parse_args(argv)
    with sigterm_as_interrupt():
        doc = run(args.machines, args.steady_s, args.keep, args.partitions,
                  lambda m: print(f"startup: {m}", file=sys.stderr, flush=True), restart=not args.no_restart)
    print(json.dumps(doc, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
