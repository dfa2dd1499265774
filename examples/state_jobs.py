#!/usr/bin/env python3
"""Read Ropewalk's job states from the log with confluent-kafka and fastavro alone (no Ropewalk code).

    python examples/state_jobs.py                        # every job's latest state, then exit
    python examples/state_jobs.py --follow --json        # ... then each change, one JSON object per line

How a record is read (README, "The log"):
* `state.jobs` holds the latest JobStatePublished per job (key: the job id). Its value is Avro single-object
  encoded: the bytes C3 01, the writer schema's CRC-64-AVRO fingerprint (8 bytes), then the Avro body.
* The writer schemas are on the log itself: the `_schemas` topic holds each one, whole (the envelope inlined), keyed
  by the fingerprint in hex. Read it first; a fingerprint not seen yet is looked up there again.
* A job of more than 500 tasks has its tasks on `state.tasks` instead (`task_parts` > 0); this reader counts them
  from `task_count` and does not read them.
* A record marked `deleted` is a job stopped and gone (its last state).

The broker authenticates every client: the operator's librdkafka settings are in `.run/secrets/kcat.conf` (written
by `ropewalk up`), the file `--config` reads.
"""
import argparse
import io
import json
import sys

import fastavro
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

MARKER = b"\xc3\x01"


def client_conf(path: str, bootstrap: str) -> dict:
    conf = {"bootstrap.servers": bootstrap, "group.id": "example-state-jobs", "enable.auto.commit": False,
            "enable.partition.eof": True, "auto.offset.reset": "earliest"}
    with open(path) as fh:  # librdkafka properties: key=value per line
        for line in fh:
            if "=" in line and not line.lstrip().startswith("#"):
                key, value = line.rstrip("\n").split("=", 1)
                conf[key.strip()] = value.strip()
    return conf


def read_to_end(consumer: Consumer, topic: str):
    """Every record of every partition of ``topic``, from the start to where it ends now."""
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    live = {p for p in parts if consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] > 0}
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])  # all: --follow reads on
    while live:
        for msg in consumer.consume(500, 1.0):
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    live.discard(msg.partition())
                    continue
                raise RuntimeError(msg.error().str())
            yield msg


class Schemas:
    """The writer schemas of the `_schemas` topic, by fingerprint (hex)."""

    def __init__(self, conf: dict, topic: str):
        self.conf, self.topic, self.by_fingerprint = conf, topic, {}
        self.load()

    def load(self) -> None:
        consumer = Consumer(self.conf)
        try:
            for msg in read_to_end(consumer, self.topic):
                self.by_fingerprint[msg.key().decode()] = fastavro.parse_schema(json.loads(msg.value()))
        finally:
            consumer.close()

    def decode(self, value: bytes) -> dict:
        if value is None or value[:2] != MARKER or len(value) < 10:
            raise ValueError("not Avro single-object encoded")
        fingerprint = value[2:10].hex()
        if fingerprint not in self.by_fingerprint:
            self.load()  # a writer newer than what was read: its schema was published before its first record
        return fastavro.schemaless_reader(io.BytesIO(value[10:]), self.by_fingerprint[fingerprint], None)


def line(job: dict) -> str:
    tasks = job["tasks"]
    running = sum(t["state"] == "RUNNING" for t in tasks)
    count = job["task_count"] if job["task_parts"] else len(tasks)
    return (f"{job['job_id']:28} {job['state']:9} {running}/{job['desired_tasks']} running ({count} tasks)  "
            f"spec v{job['spec_version']}" + ("  (stopped and gone)" if job["deleted"] else "")
            + (f"  {job['last_reason']}" if job["last_reason"] else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default="127.0.0.1:19092", help="the broker (default: ropewalk up's)")
    ap.add_argument("--config", default=".run/secrets/kcat.conf", help="librdkafka settings (credentials)")
    ap.add_argument("--prefix", default="", help="the region's topic prefix (ROPEWALK_TOPIC_PREFIX)")
    ap.add_argument("--follow", action="store_true", help="after the current states, print each change")
    ap.add_argument("--json", action="store_true", help="one JSON object per job (times in ms since epoch)")
    args = ap.parse_args()
    conf = client_conf(args.config, args.bootstrap)
    schemas = Schemas(conf, args.prefix + "_schemas")

    def show(value: bytes) -> None:
        try:
            job = schemas.decode(value)
        except (ValueError, KeyError, EOFError) as exc:  # not a record this reader can read: say so, go on
            print(f"skipped a record: {exc}", file=sys.stderr)
            return
        print(json.dumps(job, default=str) if args.json else line(job), flush=True)

    consumer = Consumer(conf)
    topic = args.prefix + "state.jobs"
    try:
        latest = {}  # job id -> its last record: the topic is compacted, but may still hold older ones
        for msg in read_to_end(consumer, topic):
            latest[msg.key()] = msg.value()
        for _, value in sorted(latest.items()):
            show(value)
        while args.follow:
            for msg in consumer.consume(100, 1.0):
                if msg.error() is None:
                    show(msg.value())
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
