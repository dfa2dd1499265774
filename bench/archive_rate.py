"""Archive and restore rates against the raw confluent-kafka rates, measured in the same run.

Starts the embedded broker and redis (bench.env.BenchEnv: free ports, a temporary run directory), produces N
events (~200-byte values) across the catalogue's topics, then measures:

  raw consume   confluent Consumer reading the same records (assign, to end of every partition): baseline
  archive       streams.archive.archive (codec null, and deflate) into a temp dir
  read archive  fastavro reading the segments back
  -- a second, fresh broker (the disaster-recovery case) --
  raw produce   confluent idempotent Producer writing the archived records to other topics: baseline
  restore       streams.archive.restore into the empty topics

and stops everything it started.  Usage: .venv/bin/python bench/archive_rate.py [--records N] [--partitions P]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import confluent_kafka
import fastavro
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.env import BenchEnv  # noqa: E402
from bench.workloads import raw_read  # noqa: E402
from infra.broker import KAFKA_VERSION  # noqa: E402
from infra.config import Config  # noqa: E402
from streams.archive import archive, read_archive, restore  # noqa: E402
from streams.clients import EventProducer, consumer_conf, producer_conf  # noqa: E402
from streams.events import new_event  # noqa: E402
from streams.serde import SchemaRegistry  # noqa: E402
from streams.topics import CATALOGUE, Topics, provision  # noqa: E402


def events(i: int):
    """Five event types on four topics; values of about 200 bytes."""
    ent, job, m = f"entitlement-{i % 97:03d}", f"job-{i:09d}", f"machine-{i % 1009:05d}"
    kw = dict(producer="bench/archive", entitlement=ent, entity_id=job, timestamp_ms=1_700_000_000_000 + i)
    kind = i % 4
    if kind == 0:
        return new_event("AgentHeartbeat", {"machine_id": m, "running_task_ids": [f"{job}/{t}" for t in range(2)],
                                            "sequence": i}, **{**kw, "entity_id": m})
    if kind == 1:
        return new_event("TaskStateChanged", {"task_id": f"{job}/0", "job_id": job, "state": "RUNNING",
                                              "previous_state": "STARTING", "machine_id": m, "spec_version": 1,
                                              "exit_code": None, "reason": "started"}, **kw)
    if kind == 2:
        return new_event("JobSubmitted", {"job_id": job, "name": "bench", "spec_version": 1, "tasks": 2,
                                          "command": ["run"], "resources": {"cpu_millicores": 500, "memory_mib": 256},
                                          "requirements": {}, "spread": "msb", "max_unavailable": 1, "env": {}}, **kw)
    return new_event("JobStatePublished", {"job_id": job, "name": "bench", "state": "running", "spec_version": 1,
                                           "desired_tasks": 1, "last_reason": "", "deleted": False,
                                           "tasks": [{"task_id": f"{job}/0", "state": "RUNNING", "machine_id": m,
                                                      "dc": None, "msb": None, "rack": None, "spec_version": 1,
                                                      "reason": ""}]}, **kw)


def raw_consume(cfg: Config) -> tuple[int, int, float]:
    """Read every partition of every catalogue topic to its end. (records, bytes, seconds)"""
    cat = Topics(cfg.topic_prefix, cfg.partitions)
    c = Consumer(consumer_conf(cfg, None))
    md = c.list_topics(timeout=10)
    todo = {(t, p) for t in cat.all() for p in md.topics[t].partitions}
    t0 = time.monotonic()
    c.assign([TopicPartition(t, p, 0) for t, p in todo])
    n, size = raw_read(c, todo)
    dt = time.monotonic() - t0
    c.close()
    return n, size, dt


def raw_produce(cfg: Config, records: list[dict]) -> tuple[int, int, float]:
    """Produce archived records with a plain idempotent producer, same partitions. (records, bytes, seconds)"""
    cat = Topics(cfg.topic_prefix, cfg.partitions)
    provision(AdminClient({**cfg.kafka_conf()}), cat)
    p = Producer(producer_conf(cfg, **{"linger.ms": 20}))
    size = 0
    t0 = time.monotonic()
    for r in records:
        while True:
            try:
                p.produce(cat.name(r["topic"]), key=r["key"], value=r["value"], partition=r["partition"],
                          timestamp=r["timestamp_ms"])
                break
            except BufferError:
                p.poll(0.1)
        size += len(r["key"] or b"") + len(r["value"] or b"")
    assert p.flush(60) == 0
    return len(records), size, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=8)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rw-bench-archive-"))
    rows = []
    try:
        with BenchEnv(partitions=args.partitions) as source:
            cfg = source.cfg
            registry = SchemaRegistry.from_dir()
            producer = EventProducer(cfg, registry, "bench")
            t0 = time.monotonic()
            for i in range(args.records):
                producer.send(events(i), validate=False)
            producer.flush(120)
            produce_s = time.monotonic() - t0

            n, size, dt = raw_consume(cfg)
            raw_rate = n / dt
            rows.append(("raw consume (baseline)", n, size, dt, "1.00"))
            st = archive(cfg, work / "arc")
            assert st.records == n and st.complete, (st.records, n)
            rows.append(("archive (codec null)", st.records, st.bytes, st.seconds, f"{st.records_per_s / raw_rate:.2f}"))
            sd = archive(cfg, work / "arc-deflate", codec="deflate")
            rows.append(("archive (codec deflate)", sd.records, sd.bytes, sd.seconds,
                         f"{sd.records_per_s / raw_rate:.2f}"))
            t0 = time.monotonic()
            recs = list(read_archive(work / "arc"))
            read_s = time.monotonic() - t0
            rows.append(("read archive (fastavro)", len(recs), st.bytes, read_s, "-"))
        with BenchEnv(partitions=args.partitions) as target:  # a fresh broker: the disaster-recovery case
            cfg = target.cfg
            n2, size2, dt2 = raw_produce(cfg.with_(topic_prefix="rawproduce."), recs)
            rows.append(("raw produce (baseline 2)", n2, size2, dt2, f"{(n2 / dt2) / raw_rate:.2f}"))
            rs = restore(cfg.with_(topic_prefix=source.cfg.topic_prefix), work / "arc")
            rows.append(("restore", rs.records, rs.bytes, rs.seconds,
                         f"{rs.records_per_s / raw_rate:.2f} ({rs.records_per_s / (n2 / dt2):.2f} of raw produce)"))
            n3, size3, dt3 = raw_consume(cfg.with_(topic_prefix=source.cfg.topic_prefix))
            assert n3 == n, (n3, n)
            rows.append(("raw consume of restored", n3, size3, dt3, f"{(n3 / dt3) / raw_rate:.2f}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    cores = len(os.sched_getaffinity(0))
    total_parts = sum(Topics("", args.partitions).partitions_of(t.name) for t in CATALOGUE)
    print(f"\nconditions: {n} records ({args.records} events + {n - args.records} _schemas), avg key+value "
          f"{size / n:.0f} B, {args.partitions} partitions per topic ({total_parts} in all), {cores} cores, "
          f"confluent-kafka {confluent_kafka.__version__} / librdkafka {confluent_kafka.libversion()[0]}, "
          f"fastavro {fastavro.__version__}, Kafka {KAFKA_VERSION}; setup produce: {args.records / produce_s:,.0f} events/s")
    print(f"archive file bytes: null {st.file_bytes / 1e6:.1f} MB, deflate {sd.file_bytes / 1e6:.1f} MB; "
          f"payload {st.bytes / 1e6:.1f} MB\n")
    print(f"{'step':<28}{'records':>10}{'MB':>8}{'s':>8}{'records/s':>12}{'MB/s':>8}  ratio to raw consume")
    for name, recs_n, b, s, ratio in rows:
        print(f"{name:<28}{recs_n:>10,}{b / 1e6:>8.1f}{s:>8.2f}{recs_n / s:>12,.0f}{b / 1e6 / s:>8.1f}  {ratio}")


if __name__ == "__main__":
    main()
