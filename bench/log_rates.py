"""Produce/consume rates of Ropewalk's log wrappers against the broker's raw rate, in the same run.

    .venv/bin/python bench/log_rates.py [--events N] [--brokers 1 3]

Starts its own embedded broker on free ports in a temporary run directory (bench.env.BenchEnv), and measures:
raw confluent-kafka produce and consume of same-sized bytes; EventProducer (Avro encode, with and without
field validation); EventConsumer (Avro decode + key/topic checks). Prints a table with ratios to the raw
rates and the conditions. Stops what it started.

``--brokers 1 3`` measures the same on a one-node broker and then on a cluster of 3 nodes (every topic replicated
3 times, ``min.insync.replicas=2``; the producers ``acks=all`` and idempotent either way), one after the other, and
prints what replication costs: each rate on 3 nodes against the same rate on one. The load average before and
after each run is printed with it: on a shared machine the neighbours' load is part of the conditions.
"""
from __future__ import annotations

import argparse
import os
import time

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from bench.env import BenchEnv
from infra.broker import KAFKA_VERSION
from infra.config import Config
from streams.clients import EventConsumer, EventProducer, producer_conf
from streams.events import new_event
from streams.serde import SchemaRegistry
from streams.topics import Topics, min_insync_replicas, provision


def events(n: int, entitlements: int = 100):
    for i in range(n):
        ent = f"e{i % entitlements}"
        yield new_event("TaskStateChanged", {
            "task_id": f"{ent}-job{i % 7}/{i}", "job_id": f"{ent}-job{i % 7}", "machine_id": f"m{i % 5000:05d}",
            "state": "RUNNING", "previous_state": "STARTING", "exit_code": None, "spec_version": 1,
            "reason": "started"}, entitlement=ent, entity_id=f"{ent}-job{i % 7}/{i}", producer="bench")


def raw_consume(cfg: Config, topic: str, n: int) -> float:
    c = Consumer({**cfg.kafka_conf(), "group.id": "bench-raw", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 100, "log_level": 3})
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, 0) for p in parts])
    got, t0 = 0, time.perf_counter()
    while got < n:
        got += sum(1 for m in c.consume(10000, 1.0) if m.error() is None)
    dt = time.perf_counter() - t0
    c.close()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--brokers", type=int, nargs="+", default=[1],
                    help="nodes of the embedded cluster; several: one run each, then the rates compared")
    args = ap.parse_args()
    runs = {b: measure(args.events, b) for b in args.brokers}
    if len(runs) > 1:
        first = args.brokers[0]
        print(f"\n{'measure':42} " + " ".join(f"{f'{b} node(s)':>12}" for b in runs)
              + " " + " ".join(f"{f'x {first}':>7}" for b in args.brokers[1:]))
        for label in runs[first]:
            print(f"{label:42} " + " ".join(f"{runs[b][label]:12,.0f}" for b in runs) + " "
                  + " ".join(f"{runs[b][label] / runs[first][label]:7.2f}" for b in args.brokers[1:]))


def measure(n: int, brokers: int) -> dict[str, float]:
    """One run of the table on an embedded cluster of ``brokers`` nodes; its rates by measure."""
    load_before = os.getloadavg()
    with BenchEnv(partitions=8, brokers=brokers) as env:
        cfg = env.cfg
        reg = SchemaRegistry.from_dir()
        rows = []
        evs = list(events(n))
        size = len(reg.encode("TaskStateChanged", evs[0].to_record(1)))
        for label, prefix in (("raw", "raw."), ("validated", "val."), ("trusted", "fast.")):
            c = cfg.with_(topic_prefix=prefix)
            provision(AdminClient({**cfg.kafka_conf()}), Topics(prefix, cfg.partitions),
                      replication=cfg.replication_factor, conf=cfg.kafka_conf())
            topic = Topics(prefix).name("tasks")
            t0 = time.perf_counter()
            if label == "raw":
                p = Producer(producer_conf(cfg))
                value = b"x" * size
                for i, ev in enumerate(evs):
                    while True:
                        try:
                            p.produce(topic, key=ev.entitlement.encode(), value=value)
                            break
                        except BufferError:
                            p.poll(0.1)
                    if i % 1000 == 0:
                        p.poll(0)
                p.flush()
            else:
                ep = EventProducer(c, reg, "bench")
                for ev in evs:
                    ep.send(ev, validate=(label == "validated"))
                ep.flush()
            rows.append((f"produce {label}", n / (time.perf_counter() - t0)))
        raw_c = raw_consume(cfg, Topics("raw.").name("tasks"), n)
        rows.append(("consume raw", raw_c))
        ec = EventConsumer(cfg.with_(topic_prefix="fast."), reg, [Topics("fast.").name("tasks")], name="bench")
        got, t0 = 0, time.perf_counter()
        while got < n:
            got += len(ec.poll(10000, 1.0))
        rows.append(("consume EventConsumer (decode+checks)", n / (time.perf_counter() - t0)))
        ec.close()
        raw_p = rows[0][1]

        rf = cfg.replication_factor or 1
        load_after = os.getloadavg()
        print(f"conditions: {n} events of {size} bytes, {cfg.partitions} partitions, 100 entitlements, "
              f"{os.cpu_count()} cores, embedded Apache Kafka {KAFKA_VERSION} on {brokers} node(s) (replication "
              f"factor {rf}, min.insync.replicas {min_insync_replicas(rf)}), confluent-kafka acks=all idempotent; "
              f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (a shared machine)")
        print(f"{'measure':42} {'events/s':>12} {'x raw':>7}")
        for label, rate in rows:
            base = raw_p if label.startswith("produce") else raw_c
            print(f"{label:42} {rate:12,.0f} {rate / base:7.2f}")
        return dict(rows)


if __name__ == "__main__":
    main()
