"""Replay rate: how fast streams.replay reads the log, against a raw confluent-kafka consumer of the same topic.

    .venv/bin/python bench/replay_rate.py [--events 200000] [--entitlements 100] [--partitions 8]

Starts its own broker and redis (bench.env.BenchEnv: free ports, a temporary run directory), produces N
TaskStateChanged events (~200 bytes each) over the entitlements to the `tasks` topic, their event times (and log
times, as an import keeps them) 100 ms apart, so the log spans N/10 seconds, then measures:

  raw          a confluent-kafka Consumer in assign mode over every partition of `tasks`, bytes only
  replay all   streams.replay with no filter: every record decoded (Avro), checked and yielded
  replay ent   streams.replay --entitlement: one partition per co-partitioned topic (murmur2), other keys
               skipped undecoded
  replay since streams.replay --since (the last tenth of the log's time): each partition starts at the offset
               Kafka's offsets-for-times gives (less the slack), the records before are never read

For each: records examined, events yielded, seconds (consumer creation to the last record), examined/s, and
the "log rate" (the N events of the log covered per second, i.e. N / seconds) relative to the raw rate.
Stops the infrastructure it started, even on error.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient  # noqa: E402

from bench.env import BenchEnv  # noqa: E402
from infra.config import Config  # noqa: E402
from streams.clients import EventProducer, consumer_conf  # noqa: E402
from streams.events import new_event  # noqa: E402
from streams.replay import ReplayFilter, replay  # noqa: E402
from streams.serde import SchemaRegistry  # noqa: E402
from streams.topics import Topics, provision  # noqa: E402

EVENT_GAP_MS = 100  # between two events' times (the last one a minute ago: the broker refuses future times)


def entitlement(i: int) -> str:
    return f"ent-{i:03d}"


def make_event(i: int, ent: str, ts: int):
    job = f"{ent}-job-{i % 50:02d}"
    machine = f"dc1-msb{i % 4}-rack{i % 32:02d}-m{i % 997:05d}"
    return new_event("TaskStateChanged",
                     {"task_id": f"{job}/{i % 17}", "job_id": job, "machine_id": machine,
                      "state": "RUNNING", "previous_state": "STARTING", "exit_code": None, "spec_version": 1,
                      "reason": "started_after_image_pull_and_health_check"},
                     entitlement=ent, entity_id=f"{job}/{i % 17}", producer="bench/replay", timestamp_ms=ts)


def first_event_ms(n: int) -> int:
    return int(time.time() * 1000) - 60_000 - n * EVENT_GAP_MS


def produce(cfg: Config, registry: SchemaRegistry, n: int, entitlements: int) -> tuple[float, int, int]:
    rng = random.Random(42)
    p = EventProducer(cfg, registry, "bench")
    t0 = time.monotonic()
    ts = first_event_ms(n)
    size = len(registry.encode("TaskStateChanged", make_event(0, entitlement(0), ts).to_record(1)))
    for i in range(n):
        t = ts + i * EVENT_GAP_MS
        p.send(make_event(i, entitlement(rng.randrange(entitlements)), t), validate=False, log_timestamp_ms=t)
    p.flush(120)
    return time.monotonic() - t0, size, ts


def raw_rate(cfg: Config, topic: str, expected: int) -> tuple[int, int, float]:
    """Consume every partition of `topic` from the beginning, touching only the bytes."""
    t0 = time.monotonic()
    c = Consumer(consumer_conf(cfg, None))
    try:
        parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        n = nbytes = 0
        eof: set[int] = set()
        while len(eof) < len(parts) and n < expected:
            for msg in c.consume(5000, 0.1):
                if msg.error() is not None:
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        eof.add(msg.partition())
                    continue
                n += 1
                nbytes += len(msg.value())
        return n, n, time.monotonic() - t0  # examined, yielded, seconds
    finally:
        c.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--entitlements", type=int, default=100)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is kept")
    args = ap.parse_args(argv)

    with BenchEnv(partitions=args.partitions) as env:
        cfg = env.cfg
        topics = Topics(cfg.topic_prefix, cfg.partitions)
        provision(AdminClient({**cfg.kafka_conf()}), topics)
        registry = SchemaRegistry.from_dir()
        n = args.events
        produce_s, size, first_ms = produce(cfg, registry, n, args.entitlements)
        print(f"produced {n} TaskStateChanged events ({size} bytes each) over {args.entitlements} entitlements, "
              f"{cfg.partitions} partitions, in {produce_s:.1f}s ({n / produce_s:,.0f}/s)\n")

        def best(measure):  # the fastest of --repeat runs: the machine may be shared, noise only slows down
            return min((measure() for _ in range(max(1, args.repeat))), key=lambda row: row[-1])

        def replayed(name, flt):
            def measure():
                run = replay(cfg, registry, flt)
                got = sum(1 for _ in run)
                return name, run.stats.read, got, run.stats.elapsed_s
            return measure

        raw = best(lambda: ("raw confluent-kafka (bytes)", *raw_rate(cfg, topics.name("tasks"), n)))
        raw_s = raw[3]
        ent = entitlement(42)
        since = first_ms + n * EVENT_GAP_MS * 9 // 10
        rows = [raw, best(replayed("replay all", ReplayFilter())),
                best(replayed(f"replay --entitlement {ent}", ReplayFilter(entitlement=ent))),
                best(replayed("replay --since (last 10% of time)", ReplayFilter(since_ms=since)))]

        raw_rate_per_s = n / raw_s
        print(f"{'mode':<30} {'examined':>9} {'yielded':>8} {'seconds':>8} {'examined/s':>11} {'log/s':>11} "
              f"{'vs raw':>7}")
        for name, examined, yielded, secs in rows:
            print(f"{name:<30} {examined:>9} {yielded:>8} {secs:>8.2f} {examined / secs:>11,.0f} "
                  f"{n / secs:>11,.0f} {n / secs / raw_rate_per_s:>6.2f}x")
        print("\nlog/s: events of the whole log covered per second (N / seconds); vs raw: log/s over the raw rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
