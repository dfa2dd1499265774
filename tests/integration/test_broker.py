"""What the embedded broker (Apache Kafka) gives the log, checked on the real broker: compacted state topics
that compact for real, standard clients (Debian's kcat) that read it with no extra flags, and aborted
transactions that stay invisible to Ropewalk's readers."""
from __future__ import annotations

import subprocess
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from streams.clients import EventConsumer, EventProducer, OffsetQueries, producer_conf
from streams.events import new_event
from streams.partitioner import partition_for
from streams.state import current
from streams.topics import CATALOGUE, COMPACT_SEGMENT_MS, Topics

OVERWRITES = 400


def job_state(job: str, version: int):
    return new_event("JobStatePublished", {
        "job_id": job, "name": job.split(".")[1], "state": "running", "spec_version": version, "desired_tasks": 1,
        "tasks": [{"task_id": f"{job}/0", "state": "RUNNING", "machine_id": f"m{version}"}]},
        entitlement=job.split(".")[0], entity_id=job, producer="test")


def topic_config(admin: AdminClient, topic: str) -> dict[str, str]:
    res = ConfigResource(ConfigResource.Type.TOPIC, topic)
    return {k: v.value for k, v in admin.describe_configs([res])[res].result().items()}


def records_of(cfg, topic: str, partition: int, isolation: str = "read_committed") -> list:
    """Every record of one partition, from its start to its end, as a plain confluent-kafka consumer sees it."""
    c = Consumer({**cfg.kafka_conf(), "group.id": "unused", "enable.partition.eof": True,
                  "auto.offset.reset": "earliest", "isolation.level": isolation, "log_level": 3})
    try:
        c.assign([TopicPartition(topic, partition, 0)])
        out = []
        while True:
            msg = c.poll(5.0)
            if msg is None:
                raise AssertionError(f"{topic}[{partition}]: no end of partition")
            if msg.error():
                return out
            out.append(msg)
    finally:
        c.close()


def test_compacted_topics_are_configured_to_compact(cfg):
    admin = AdminClient({**cfg.kafka_conf()})
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    compacted = [s.name for s in CATALOGUE if s.config.get("cleanup.policy") == "compact"]
    assert set(compacted) == {"state.jobs", "state.tasks", "state.machines", "partitionmap", "_schemas"}
    for name in compacted:
        conf = topic_config(admin, topics.name(name))
        assert conf["cleanup.policy"] == "compact" and conf["segment.ms"] == str(COMPACT_SEGMENT_MS), name
    assert topic_config(admin, topics.name("intents"))["cleanup.policy"] == "delete"  # the log itself is kept
    assert topic_config(admin, topics.name("intents"))["retention.ms"] == "-1"


def test_a_key_overwritten_many_times_reads_back_as_its_latest_value(cfg, registry):
    """The log cleaner compacts state.jobs: after it ran, the partition holds one record of a job written
    OVERWRITES times, the last one. What makes it run within seconds here: the segment rolls after 100 ms
    (segment.ms, set on this topic; Ropewalk's own is COMPACT_SEGMENT_MS), any dirty share makes it eligible
    (min.cleanable.dirty.ratio 0.01), and the embedded broker's cleaner looks every second
    (log.cleaner.backoff.ms, infra/broker.py)."""
    admin = AdminClient({**cfg.kafka_conf()})
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("state.jobs")
    res = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[
        ConfigEntry("segment.ms", "100", incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("min.cleanable.dirty.ratio", "0.01", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([res])[res].result()
    producer = EventProducer(cfg, registry, "test")
    for v in range(1, OVERWRITES + 1):
        producer.send(job_state("e1.hot", v))
    producer.send(job_state("e1.cold", 1))
    producer.flush()
    partition = next(m.partition() for m in records_of_all(cfg, topic) if m.key() == b"e1.hot")
    assert sum(m.key() == b"e1.hot" for m in records_of(cfg, topic, partition)) == OVERWRITES
    # Later records of other jobs on the same partition roll the segment the overwrites are in (the cleaner
    # never touches the active segment).
    roll = next(f"e1.roll{i}" for i in range(1000) if partition_for(f"e1.roll{i}", cfg.partitions) == partition)
    deadline = time.monotonic() + 60
    while True:
        time.sleep(0.3)
        producer.send(job_state(roll, 1))
        producer.flush()
        hot = [m for m in records_of(cfg, topic, partition) if m.key() == b"e1.hot"]
        if len(hot) == 1 or time.monotonic() > deadline:
            break
    assert len(hot) == 1, f"{len(hot)} records of e1.hot still in {topic}[{partition}] after 60 s"
    assert registry.decode(hot[0].value())[1]["spec_version"] == OVERWRITES
    latest = current(cfg, registry, "jobs")
    assert latest["e1.hot"].payload["spec_version"] == OVERWRITES and "e1.cold" in latest


def records_of_all(cfg, topic: str, isolation: str = "read_committed") -> list:
    return [m for p in range(cfg.partitions) for m in records_of(cfg, topic, p, isolation)]


@pytest.mark.parametrize("tool", ["kcat"])
def test_debians_kcat_lists_topics_and_reads_a_state_stream_from_the_beginning(cfg, registry, tool):
    producer = EventProducer(cfg, registry, "test")
    jobs = [f"e{i % 3}.job{i}" for i in range(12)]
    for i, job in enumerate(jobs):
        producer.send(job_state(job, i + 1))
    producer.flush()
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("state.jobs")
    # The broker takes only authenticated clients: kcat as the operator, with the settings file `up` writes.
    conf = ["-F", str(cfg.secrets / "kcat.conf")]
    listed = subprocess.run([tool, *conf, "-b", cfg.bootstrap_servers, "-L"], capture_output=True, text=True,
                            timeout=30)
    assert listed.returncode == 0, listed.stderr
    assert f'topic "{topic}" with {cfg.partitions} partitions' in listed.stdout
    read = subprocess.run([tool, *conf, "-b", cfg.bootstrap_servers, "-C", "-t", topic, "-o", "beginning", "-e",
                           "-f", "%k %p %o\n"], capture_output=True, text=True, timeout=30)
    assert read.returncode == 0, read.stderr
    keys = sorted(line.split()[0] for line in read.stdout.splitlines() if line.strip())
    assert keys == sorted(jobs)


def test_aborted_transactions_stay_invisible_to_ropewalks_readers(cfg, registry):
    """Records of an aborted transaction are on the log but no Ropewalk reader sees them: EventConsumer (and so
    replay, state readers, agents) reads committed records only (librdkafka's default, read_committed)."""
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    tx = Producer(producer_conf(cfg, **{"transactional.id": f"{cfg.topic_prefix}test-tx"}))
    tx.init_transactions(10)
    value = registry.encode("JobStatePublished", job_state("e1.aborted", 1).to_record())
    tx.begin_transaction()
    tx.produce(topics.name("state.jobs"), key=b"e1.aborted", value=value)
    tx.flush()
    tx.abort_transaction(10)
    tx.begin_transaction()
    tx.produce(topics.name("state.jobs"), key=b"e1.kept", value=registry.encode(
        "JobStatePublished", job_state("e1.kept", 1).to_record()))
    tx.commit_transaction(10)
    reader = EventConsumer(cfg, registry, [topics.name("state.jobs")], name="test")
    try:
        seen = []
        deadline = time.monotonic() + 20
        while not set(reader.partitions()) <= reader.eof and time.monotonic() < deadline:
            seen += [r.event.payload["job_id"] for r in reader.poll(100, 0.2)]
    finally:
        reader.close()
    assert seen == ["e1.kept"]
    # it is on the log: only the isolation level hides it
    keys = [m.key() for m in records_of_all(cfg, topics.name("state.jobs"), "read_uncommitted")]
    assert sorted(keys) == [b"e1.aborted", b"e1.kept"]


def test_offset_queries_list_the_ends_the_readers_see(cfg, registry):
    """``OffsetQueries`` is the one ListOffsets client: what it lists is what an EventConsumer's watermarks say, and a
    closed one asks again with a new client."""
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("state.jobs")
    producer = EventProducer(cfg, registry, "test")
    for i in range(3):
        producer.send(job_state("e1.ends", i + 1))
    producer.flush()
    partition = partition_for("e1.ends", cfg.partitions)
    queries = OffsetQueries(cfg, "test-offsets")
    reader = EventConsumer(cfg, registry, [topic], name="test-ends")
    try:
        assert queries.watermarks(topic, partition) == (0, 3)
        assert queries.high_watermark(topic, (partition + 1) % cfg.partitions) == 0
        assert reader.high_watermarks([(topic, partition)]) == {(topic, partition): 3}
        assert reader.watermarks()[topic, partition] == (0, 3)
        queries.close()
        producer.send(job_state("e1.ends", 4))
        producer.flush()
        assert queries.high_watermark(topic, partition) == 4  # a new client after close
    finally:
        queries.close()
        reader.close()
