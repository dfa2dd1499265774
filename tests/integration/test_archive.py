"""Archive and restore against real brokers: a dedicated broker is archived, stopped (its log is gone), and
the archive is restored into a fresh broker; plus incremental runs, resume after an interrupted run, and
refusal to restore into topics that hold records."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

import streams.archive as arch
from infra import services
from infra.broker import BrokerLayout
from infra.config import Config
from infra.process import free_ports, port_open
from streams.archive import ArchiveError, archive, read_archive, restore
from streams.clients import EventProducer, consumer_conf
from streams.deadletter import DeadLetters
from streams.events import Event, new_event
from streams.replay import replay
from streams.serde import NO_MARKER, UNKNOWN_FINGERPRINT, DecodeError, SchemaRegistry
from streams.topics import CATALOGUE, Topics, provision
from streams import schemalog

GARBAGE = b"\x00\xffnot avro at all\xc3"  # no C3 01 marker: undecodable, must survive byte for byte


# -- helpers -------------------------------------------------------------------------------------------
@pytest.fixture
def dedicated_brokers(infra_cfg, tmp_path):
    """start(name) -> a Config with a broker of its own (the session's redis); all stopped at the end."""
    started: list[Config] = []

    def start(name: str) -> Config:
        broker_port, controller_port = free_ports(2)
        c = Config.from_env({"ROPEWALK_BROKER_PORT": str(broker_port), "ROPEWALK_CONTROLLER_PORT": str(controller_port),
                             "ROPEWALK_REDIS_URL": infra_cfg.redis_url, "ROPEWALK_SECRETS_DIR": str(infra_cfg.secrets),
                             "ROPEWALK_RUN_DIR": str(tmp_path / f"run-{name}"), "ROPEWALK_PARTITIONS": "4",
                             "ROPEWALK_TOPIC_PREFIX": "rw."})
        started.append(c)
        services.up(c)
        provision(AdminClient({**c.kafka_conf()}), Topics(c.topic_prefix, c.partitions))
        return c

    yield start
    for c in started:
        services.down(c)


def _events(i: int) -> list[Event]:
    """A handful of events of different types and topics for entitlement e<i % 5>."""
    ent, job, m = f"e{i % 5}", f"job-{i}", f"m-{i % 17}"
    mk = lambda t, payload, **kw: new_event(t, payload, producer="test", entity_id=kw.pop("entity", job),
                                            entitlement=kw.pop("entitlement", ent), **kw)
    return [
        mk("JobSubmitted", {"job_id": job, "name": f"n{i}", "tasks": 2, "command": ["sleep", str(i)],
                            "resources": {"cpu_millicores": 500, "memory_mib": 256}}),
        mk("TaskStateChanged", {"task_id": f"{job}/0", "job_id": job, "state": "RUNNING",
                                "previous_state": "STARTING", "machine_id": m}, entity=f"{job}/0"),
        mk("AgentHeartbeat", {"machine_id": m, "running_task_ids": [f"{job}/0"], "sequence": i}, entity=m),
        mk("MachineRegistered", {"machine_id": m, "machine_type": "skylake",
                                 "topology": {"region": "r", "dc": "dc1", "msb": "msb1", "rack": "r1"},
                                 "capacity": {"cpu_millicores": 4000, "memory_mib": 8192}},
           entity=m, entitlement="free/dc1"),
        mk("JobStatePublished", {"job_id": job, "name": f"n{i}", "state": "RUNNING", "desired_tasks": 1,
                                 "tasks": [{"task_id": f"{job}/0", "state": "RUNNING", "machine_id": m}]}),
    ]


def _produce(cfg: Config, registry: SchemaRegistry, start: int, n: int, producer: EventProducer | None = None,
             extras: bool = True) -> list[Event]:
    """n rounds of _events (5 events each); with extras also a garbage record, a tombstone, a null-key record
    with headers and explicit timestamps, and a dead letter."""
    p = producer or EventProducer(cfg, registry, "test")
    cat = Topics(cfg.topic_prefix, cfg.partitions)
    sent = []
    for i in range(start, start + n):
        for e in _events(i):
            p.send(e)
            sent.append(e)
    if extras:
        p.send_raw(cat.name("intents"), b"e1", GARBAGE, timestamp_ms=1_600_000_000_123,
                   headers=[("origin", b"fuzzer"), ("empty", None), ("origin", b"dup-key")])
        p.send_raw(cat.name("state.jobs"), b"job-tombstoned", None, partition=2)
        p.send_raw(cat.name("heartbeats"), None, b"\xc3\x01" + b"\x00" * 8, partition=1, timestamp_ms=42,
                   headers=[("h", b"\x00\x01")])
        DeadLetters(p, "test").route(topic=cat.name("intents"), partition=0, offset=7, key=b"e1", value=GARBAGE,
                                     reason="no_marker", detail="test")
    p.flush()
    return sent


def read_log(cfg: Config, timeout_s: float = 20.0) -> dict[tuple[str, int], list[tuple]]:
    """Every record of every catalogue topic, read to the end of each partition (end-of-partition events):
    (logical, partition) -> [(offset, key, value, headers, (timestamp type, timestamp))]."""
    cat = Topics(cfg.topic_prefix, cfg.partitions)
    c = Consumer(consumer_conf(cfg, None))
    out: dict[tuple[str, int], list[tuple]] = {}
    try:
        md = c.list_topics(timeout=10)
        for spec in CATALOGUE:
            for p in md.topics[cat.name(spec.name)].partitions:
                out[(spec.name, p)] = []
        todo = {(cat.name(t), p) for t, p in out}
        c.assign([TopicPartition(t, p, 0) for t, p in todo])
        deadline = time.monotonic() + timeout_s
        while todo and time.monotonic() < deadline:
            for m in c.consume(10000, 0.5):
                if m.error() is not None:
                    assert m.error().code() == KafkaError._PARTITION_EOF, m.error().str()
                    todo.discard((m.topic(), m.partition()))
                    continue
                out[(cat.logical(m.topic()), m.partition())].append(
                    (m.offset(), m.key(), m.value(), list(m.headers() or []), m.timestamp()))
        assert not todo, f"partitions not read to the end: {sorted(todo)[:5]}"
    finally:
        c.close()
    return out


def _without_offsets(log):
    return {tp: [r[1:] for r in recs] for tp, recs in log.items()}


def _decoded(registry: SchemaRegistry, log) -> dict[tuple[str, int], list]:
    out = {}
    for (topic, p), recs in log.items():
        if topic == "_schemas":
            continue
        evs = []
        for _, _, value, _, _ in recs:
            try:
                evs.append(Event.from_record(*registry.decode(value)))
            except DecodeError as exc:
                evs.append(("undecodable", exc.reason, value))
        out[(topic, p)] = evs
    return out


def _replayed(cfg: Config, registry: SchemaRegistry) -> tuple[dict[tuple[str, int], list[Event]], dict[str, int]]:
    """What `streams.replay` yields, per (topic, partition) in order (offsets aside), and what it skipped."""
    run = replay(cfg, registry)
    per_partition: dict[tuple[str, int], list[Event]] = {}
    for rec in run:
        per_partition.setdefault((rec.topic, rec.partition), []).append(rec.event)
    assert sum(map(len, per_partition.values())) > 0
    return per_partition, dict(run.stats.skipped_by_reason)


def _segments(d: Path) -> set[str]:
    return {str(f.relative_to(d)) for f in d.rglob("*.avro")}


# -- tests ---------------------------------------------------------------------------------------------
def test_archive_stop_broker_restore_into_fresh_broker(dedicated_brokers, registry, tmp_path):
    a = dedicated_brokers("a")
    sent = _produce(a, registry, 0, 300)
    original = read_log(a)
    replayed = _replayed(a, registry)
    assert replayed[1] == {NO_MARKER: 1, UNKNOWN_FINGERPRINT: 1}  # the garbage, the bare header (a tombstone is no bad record)
    n_records = sum(len(v) for v in original.values())
    stats = archive(a, tmp_path / "arc")
    assert stats.records == n_records and stats.complete
    assert stats.per_topic["_schemas"] >= 5 and stats.per_topic["deadletter"] == 1
    garbage = [r for r in read_archive(tmp_path / "arc") if r["value"] == GARBAGE]
    assert len(garbage) == 1 and garbage[0]["topic"] == "intents" and garbage[0]["timestamp_ms"] == 1_600_000_000_123
    assert garbage[0]["headers"] == [{"key": "origin", "value": b"fuzzer"}, {"key": "empty", "value": None},
                                     {"key": "origin", "value": b"dup-key"}]
    # archived offsets are the broker's real offsets
    for (topic, p), recs in original.items():
        assert [r["offset"] for r in read_archive(tmp_path / "arc") if (r["topic"], r["partition"]) == (topic, p)] \
            == [r[0] for r in recs]

    services.down(a)  # the in-memory log is gone now
    assert not port_open(a.broker_port)

    b = dedicated_brokers("b")
    rstats = restore(b, tmp_path / "arc")
    assert rstats.records == n_records and rstats.per_topic == stats.per_topic
    restored = read_log(b)
    assert _without_offsets(restored) == _without_offsets(original)  # key, value, headers, timestamp, in order
    assert _decoded(registry, restored) == _decoded(registry, original)
    assert _replayed(b, registry) == replayed  # the audit reader sees the same events, same order, same skips
    decoded_ids = {e.event_id for evs in _decoded(registry, restored).values() for e in evs if isinstance(e, Event)}
    assert {e.event_id for e in sent} <= decoded_ids
    # _schemas came back: a reader with no schemas of its own learns every writer schema from the log
    blank = SchemaRegistry({})
    assert schemalog.load(b, blank) == stats.per_topic["_schemas"]
    assert {s.name for s in blank.writers()} == {e.type for e in sent} | {"DeadLetterRecorded"}


def test_incremental_archive_then_restore_exactly_once(cfg, registry, tmp_path):
    producer = EventProducer(cfg, registry, "test")
    _produce(cfg, registry, 0, 150, producer)
    first = archive(cfg, tmp_path / "arc")
    log1 = read_log(cfg)
    segs1 = _segments(tmp_path / "arc")
    assert first.records == sum(len(v) for v in log1.values()) and first.segments == len(segs1)

    _produce(cfg, registry, 150, 100, producer, extras=False)
    log2 = read_log(cfg)
    second = archive(cfg, tmp_path / "arc")
    assert second.records == sum(len(v) for v in log2.values()) - first.records
    new_segs = _segments(tmp_path / "arc") - segs1
    assert len(new_segs) == second.segments and segs1 <= _segments(tmp_path / "arc")
    manifest = arch._read_manifest(tmp_path / "arc")
    for (topic, p), recs in log2.items():
        pstate = manifest["topics"][topic]["partitions"][str(p)]
        assert pstate["next_offset"] == (recs[-1][0] + 1 if recs else 0)
        old = len(log1[(topic, p)])
        if len(recs) > old:  # the new segment starts right after the first run's last offset
            assert pstate["segments"][-1][:2] == [recs[old][0], recs[-1][0]]

    assert archive(cfg, tmp_path / "arc").records == 0  # nothing new: no new segment
    assert _segments(tmp_path / "arc") == segs1 | new_segs

    target = cfg.with_(topic_prefix=f"r{uuid.uuid4().hex[:8]}.")
    assert restore(target, tmp_path / "arc").records == sum(len(v) for v in log2.values())
    assert _without_offsets(read_log(target)) == _without_offsets(log2)


def test_resume_after_interrupted_runs(cfg, registry, tmp_path, monkeypatch):
    _produce(cfg, registry, 0, 400)
    log = read_log(cfg)
    total = sum(len(v) for v in log.values())
    d = tmp_path / "arc"

    stopped = archive(cfg, d, max_records=500)  # stopped early: complete segments only
    assert stopped.records == 500 and not stopped.complete

    class CrashingWriter(arch.Writer):  # a crash in the middle of writing segments
        written = 0

        def write(self, record):
            CrashingWriter.written += 1
            if CrashingWriter.written > 300:
                raise RuntimeError("simulated crash")
            return super().write(record)

    monkeypatch.setattr(arch, "Writer", CrashingWriter)
    with pytest.raises(RuntimeError, match="simulated crash"):
        archive(cfg, d)
    monkeypatch.undo()
    assert not list(d.rglob("*.tmp")), "no half-written segment may stay"

    real_write = arch._write_manifest
    calls = {"n": 0}

    def crash_after_segment_renamed(out_dir, manifest):
        calls["n"] += 1
        if calls["n"] == 3:  # the 1st is the plan; later ones follow a renamed segment
            raise RuntimeError("crash between segment rename and manifest update")
        real_write(out_dir, manifest)

    monkeypatch.setattr(arch, "_write_manifest", crash_after_segment_renamed)
    with pytest.raises(RuntimeError, match="crash between"):
        archive(cfg, d)
    monkeypatch.undo()
    listed = {f"{t}/p{p}/{arch._segment_name(a, b)}" for t, ts in arch._read_manifest(d)["topics"].items()
              for p, ps in ts["partitions"].items() for a, b, _ in ps["segments"]}
    assert _segments(d) - listed, "the simulated crash should have left an unlisted segment"

    final = archive(cfg, d)
    assert final.complete and _segments(d) == {f"{t}/p{p}/{arch._segment_name(a, b)}"
                                               for t, ts in arch._read_manifest(d)["topics"].items()
                                               for p, ps in ts["partitions"].items() for a, b, _ in ps["segments"]}
    archived: dict[tuple[str, int], list] = {}
    for r in read_archive(d):
        archived.setdefault((r["topic"], r["partition"]), []).append(
            (r["offset"], r["key"], r["value"], [(h["key"], h["value"]) for h in r["headers"]]))
    assert sum(len(v) for v in archived.values()) == total
    assert archived == {tp: [r[:4] for r in recs] for tp, recs in log.items() if recs}  # no gaps, no duplicates


def test_restore_into_non_empty_topics_is_refused(cfg, registry, tmp_path):
    _produce(cfg, registry, 0, 20, extras=False)
    archive(cfg, tmp_path / "arc")
    with pytest.raises(ArchiveError, match="already hold records"):
        restore(cfg, tmp_path / "arc")
    other = cfg.with_(topic_prefix=f"x{uuid.uuid4().hex[:8]}.")
    restore(other, tmp_path / "arc")
    with pytest.raises(ArchiveError, match="already hold records"):
        restore(other, tmp_path / "arc")


def _status(cfg: Config, *args: str) -> subprocess.CompletedProcess:
    """`ropewalk status` against ``cfg``'s broker, its run directory (where a restore leaves its note)."""
    env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
           "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions),
           "ROPEWALK_RUN_DIR": str(cfg.run_dir)}
    return subprocess.run([sys.executable, "-m", "processors.frontend.cli", "status", *args], env=env,
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)


def test_status_after_a_restore_says_what_it_holds_and_what_the_restore_renumbered(dedicated_brokers, registry,
                                                                                    tmp_path):
    """Issue 13: `status` after `archive` + `restore`. A partition whose log no longer starts at 0 (retention: here
    DeleteRecords) is restored from offset 0: its records are the same, its end offset lower. Status says records
    held and end offsets, each for what it is, and that the restore renumbered that partition; a new log in the same
    run directory is not said to be the restored one."""
    a = dedicated_brokers("a")
    _produce(a, registry, 0, 40)
    hb = Topics(a.topic_prefix, a.partitions).name("heartbeats")
    admin = AdminClient({**a.kafka_conf()})
    c = Consumer(consumer_conf(a, None))
    ends = {p: c.get_watermark_offsets(TopicPartition(hb, p), timeout=10)[1] for p in range(a.partitions)}
    c.close()
    part = max(ends, key=ends.get)  # the fullest heartbeats partition loses its first 5 records, as to retention
    assert ends[part] > 5
    for fut in admin.delete_records([TopicPartition(hb, part, 5)]).values():
        fut.result(15)
    before = _status(a, "--json")
    assert before.returncode == 0, before.stderr
    before = json.loads(before.stdout)
    assert before["restored"] is None and before["topic_offsets"][hb]["start_offsets"] == 5
    archive(a, tmp_path / "arc")
    services.down(a)

    b = dedicated_brokers("b")
    rstats = restore(b, tmp_path / "arc")
    assert rstats.offsets_moved == [f"{hb}[{part}]"]
    after = _status(b, "--json")
    assert after.returncode == 0, after.stderr
    after = json.loads(after.stdout)
    assert after["restored"]["archive"] == str((tmp_path / "arc").resolve())
    assert after["restored"]["offsets_moved"] == [f"{hb}[{part}]"]
    for topic, was in before["topic_offsets"].items():
        now = after["topic_offsets"][topic]
        assert now["records"] == was["records"], topic  # the same records
        assert now["start_offsets"] == 0
        assert now["end_offsets"] == was["end_offsets"] - (5 if topic == hb else 0), topic  # renumbered: 5 lower
    assert after["topics"] == before["topics"]  # --json's records per topic, as it always was
    text = _status(b).stdout
    header = next(line for line in text.splitlines() if line.startswith("TOPIC"))
    assert header.split() == ["TOPIC", "PARTITIONS", "RECORDS", "END", "OFFSETS"]
    assert re.search(rf"^{re.escape(hb)} +{b.partitions} +{before['topics'][hb]} +{before['topics'][hb]}$", text, re.M)
    assert re.search(r"^(\S+\.)?state\.jobs +\d+ +≤ \d+ +\d+ +compacted: at most this many records$", text, re.M)
    assert (f"restored from {(tmp_path / 'arc').resolve()} at " in text
            and f"renumbered the offsets of 1 partitions ({hb}[{part}])" in text), text

    # A new log in the same run directory (the broker's data removed): not the restored one.
    services.down(b)
    shutil.rmtree(BrokerLayout.of(b).data)
    services.up(b)
    provision(AdminClient({**b.kafka_conf()}), Topics(b.topic_prefix, b.partitions))
    fresh = json.loads(_status(b, "--json").stdout)
    assert fresh["restored"] is None and "restored from" not in _status(b).stdout
