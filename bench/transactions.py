"""What do Kafka transactions cost a consume-transform-produce loop, against at-least-once, on one broker?

    .venv/bin/python bench/transactions.py [--records N] [--json]

Starts its own embedded broker (Apache Kafka, KRaft, one node) and Redis via infra.services, on free ports and
a temporary run directory, and stops them at the end (also on an error, Ctrl-C or `kill`). It produces N
records (8-byte distinct keys, 300-byte values) to an input topic of 8 partitions, then runs each variant of
one loop over it: read input records, write one output record per input record (the identity transform, so
what is measured is the clients' and the broker's work) to an output topic of 8 partitions of its own, and
commit the input offsets in the variant's consumer group.

* baseline: raw confluent-kafka produce (the project's producer settings: idempotent, acks=all, linger 5 ms)
  of the N input records, and raw consume of them (assign mode), in this run on this broker;
* confluent at-least-once, batch B: idempotent acks=all producer; consumer with enable.auto.commit=False;
  per batch of B input records: produce B outputs, flush(), commit the offsets synchronously;
* confluent transactional, batch B: producer with a transactional.id (init_transactions once); per batch:
  begin_transaction, produce B, send_offsets_to_transaction(position, consumer_group_metadata),
  commit_transaction. Its consumer reads with isolation.level=read_committed;
* faust at_least_once / exactly_once: a faust-streaming agent that awaits `topic.send` of one output per
  event, app from streams.faustwire.make_app with lowered group timing, run in-process (`app.start()`).

B is 1, 100 and 1000. Two sets of rows beyond those: the transactional loops again with
retry.backoff.ms=10 (librdkafka retries the CONCURRENT_TRANSACTIONS that a transaction begun right after a
commit meets after retry.backoff.ms, 100 ms by default, and that wait is most of a small transaction's
cost), and faust exactly_once with a second, no-op agent consuming the output topic (see below).

Every variant runs in a fresh process (spawned), while this process reads the output topic with a
read_committed confluent consumer: the rate is records / (time the last output became visible to it - time
the loop had its first batch of input records in hand), so group-join time is left out (reported as
`join_s`) and a transactional loop is charged for its commits. The reader also counts duplicates, and the
output topic's end offsets minus the records give the control records (transaction markers) the variant
wrote. The processes share the machine's cores with the broker: on 2 cores the reader competes with both.
B=1 loops are slow by nature, so they process only the first `--records-b1` records (default 500).

Latency: one record at a time (200, after a warm-up) through the B=1 confluent loops (the transactional one
also with retry.backoff.ms=10): input produced here (linger.ms=0) -> its output visible to the
read_committed reader here, p50/p99. The next record is produced only once the previous output is visible.

Correctness checks: which of confluent and aiokafka consumers, read_committed and read_uncommitted, see the
records of an aborted transaction (flushed to the log before the abort) and those of a committed one after
it; and how many offsets a committed transaction of 10 records to one partition occupies (10 + its marker?).

faust notes (faust-streaming 0.15.3 with aiokafka): faust only honours processing_guarantee="exactly_once"
when `app.in_worker` is True, which faust.Worker sets at start; an app run in-process with `app.start()`
would silently run at_least_once. This script sets it (what Worker.on_start does) and reports whether the
app's consumer was really transactional. Even then, faust's TransactionManager puts a `send` in a
transaction only if the output topic's partition is known to the app's *consumer* (and the topic is in its
assignor's topic groups), i.e. only for topics the app itself consumes; the output of a plain agent goes to
the ordinary producer, outside the transactions, with no error. So every transactional row also reports
whether its output topic holds transaction markers (`outputs_in_transactions`), and the extra faust row
consumes the output topic with a no-op agent, which makes its sends transactional. A faust variant that
fails or stalls is stopped after `--faust-timeout` seconds and reported with the warnings and errors faust
logged, not hidden; a child that does not exit once asked to stop is terminated, and its row says how far
its shutdown got and which threads were left.

`--only TAG ...` runs some of the loops (the baseline and the correctness checks always run).

Not a test; run it by hand, on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import confluent_kafka
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.env import cores, sigterm_as_interrupt  # noqa: E402
from infra import services  # noqa: E402
from infra.broker import KAFKA_VERSION  # noqa: E402
from infra.config import Config  # noqa: E402
from infra.credentials import aiokafka_kwargs  # noqa: E402
from infra.process import free_ports  # noqa: E402
from streams.clients import producer_conf  # noqa: E402

PARTITIONS = 8
KEY_BYTES = 8  # f"{i:08d}": every input record's key is distinct, so duplicates can be counted
VALUE_BYTES = 300
BATCHES = (1, 100, 1000)
TUNED_BACKOFF_MS = 10  # the extra transactional rows' retry.backoff.ms (librdkafka's default: 100)
# Group timing of the faust apps: a quick first join (as bench/faust_overhead.py and the tests use).
FAST_GROUP = {"broker_session_timeout": 2.0, "broker_heartbeat_interval": 0.5, "broker_rebalance_timeout": 2.0}
VALUE = bytes(range(256)) * (VALUE_BYTES // 256) + bytes(VALUE_BYTES % 256)
# Clocks: time.monotonic() is CLOCK_MONOTONIC on Linux, one clock for every process of the machine, so a
# child's "first record" and this process's "last output seen" can be subtracted.
now = time.monotonic


def key_of(i: int) -> bytes:
    return f"{i:08d}".encode()


def consumer_conf(cfg: Config, group_id: str, **extra) -> dict:
    conf = {**cfg.kafka_conf(), "group.id": group_id, "enable.auto.commit": False,
            "auto.offset.reset": "earliest", "fetch.wait.max.ms": 100, "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1000, "log_level": 3}
    conf.update(extra)
    return conf


def produce_one(producer, topic: str, key: bytes, value: bytes, **kwargs) -> None:
    while True:
        try:
            producer.produce(topic, key=key, value=value, **kwargs)
            return
        except BufferError:  # local queue full: let deliveries drain
            producer.poll(0.1)


def create_topics(cfg: Config, names: list[str], partitions: int = PARTITIONS) -> None:
    admin = AdminClient({**cfg.kafka_conf(), "log_level": 0})
    for fut in admin.create_topics([NewTopic(n, partitions, 1) for n in names]).values():
        fut.result(30)


def end_offsets(cfg: Config, topic: str, partitions: int = PARTITIONS) -> int:
    """Sum of the high watermarks of `topic`: records plus control records (transaction markers)."""
    c = Consumer(consumer_conf(cfg, "bench-watermarks"))
    try:
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions))
    finally:
        c.close()


# -- baseline ------------------------------------------------------------------------------------------------

def raw_produce(cfg: Config, topic: str, n: int) -> float:
    """Produce the N input records with the project's producer settings; records/s up to the last ack."""
    p = Producer(producer_conf(cfg))
    # Warm-up outside the clock, to another topic: metadata, connection, the idempotent producer id, and the
    # broker's JIT (a JVM started seconds ago is measurably slower on its first tens of thousands of records).
    for i in range(n):
        produce_one(p, f"{topic}.warmup", key_of(i), VALUE)
        if i % 1000 == 0:
            p.poll(0)
    p.flush(120)
    t0 = now()
    for i in range(n):
        produce_one(p, topic, key_of(i), VALUE)
        if i % 1000 == 0:
            p.poll(0)
    left = p.flush(120)
    if left:
        raise RuntimeError(f"raw produce: {left} records unacknowledged after 120 s")
    return n / (now() - t0)


def raw_consume(cfg: Config, topic: str, n: int) -> float:
    """Read the N input records in assign mode, bytes only; records/s from the moment the first records were
    in hand, as the loops are timed (connection and offset look-up are left out)."""
    c = Consumer(consumer_conf(cfg, "bench-raw"))
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    got = 0
    while got == 0:  # the clock starts once the first record is in hand
        got = sum(1 for m in c.consume(1, 1.0) if m.error() is None)
    t0 = now()
    while got < n:
        # consume(n, t) returns when it has n records or at t: never ask for more than are left
        got += sum(1 for m in c.consume(min(10000, n - got), 1.0) if m.error() is None)
    rate = n / (now() - t0)
    c.close()
    return rate


# -- the loops, each run in a fresh process --------------------------------------------------------------------

def ctp_confluent(report, stop, cfg: Config, src: str, dst: str, group: str, batch: int, limit: int | None,  # noqa: C901
                  transactional: bool, producer_extra: dict | None = None) -> None:
    """The confluent consume-transform-produce loop. Stops after `limit` records (None: when told to).
    `producer_extra` is added to the producer's configuration."""
    consumer = Consumer(consumer_conf(cfg, group, **({"isolation.level": "read_committed"} if transactional else {})))
    consumer.subscribe([src], on_assign=lambda _c, parts: report({"kind": "assigned", "t": now(),
                                                                    "partitions": len(parts)}))
    extra = {"transactional.id": f"{group}-tx"} if transactional else {}
    producer = Producer(producer_conf(cfg, **extra, **(producer_extra or {})))
    errors: list[str] = []

    def on_delivery(err, _msg) -> None:
        if err is not None:
            errors.append(err.str())

    if transactional:
        producer.init_transactions(30)
    processed = batches = 0
    t_first = None
    # In latency mode (limit None) a short poll keeps the loop responsive to `stop`.
    poll_s = 0.5 if limit is not None else 0.1
    while not stop.is_set() and (limit is None or processed < limit):
        want = batch if limit is None else min(batch, limit - processed)
        msgs = consumer.consume(want, poll_s)  # up to `want` records: returns when it has them all or at poll_s
        for m in msgs:
            if m.error() is not None:
                raise KafkaException(m.error())
        if not msgs:
            continue
        if t_first is None:
            t_first = now()
            report({"kind": "first", "t": t_first})
        if transactional:
            producer.begin_transaction()
        for m in msgs:
            produce_one(producer, dst, m.key(), m.value(), on_delivery=on_delivery)
        if transactional:
            # The next offsets to read (last read + 1) of every partition read so far, committed with the
            # outputs: atomically visible, or neither.
            offsets = [tp for tp in consumer.position(consumer.assignment()) if tp.offset >= 0]
            producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
            producer.commit_transaction(30)
        else:
            left = producer.flush(30)
            if left or errors:
                raise RuntimeError(f"{left} outputs unacknowledged; delivery errors: {errors[:3]}")
            consumer.commit(asynchronous=False)
        processed += len(msgs)
        batches += 1
    report({"kind": "final", "t": now(), "processed": processed, "batches": batches,
            "loop_rate": processed / max(now() - t_first, 1e-9) if t_first else None})
    consumer.close()


class _KeepLogs(logging.Handler):
    """Keeps the first warnings and errors a faust app logs (its failures are logged, not raised)."""

    def __init__(self, limit: int = 12):
        super().__init__(level=logging.WARNING)
        self.lines: list[str] = []
        self.limit = limit
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        line = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            line += f" [{type(record.exc_info[1]).__name__}: {record.exc_info[1]}]"
        if len(self.lines) < self.limit:
            self.lines.append(line[:400])
        else:
            self.dropped += 1


def ctp_faust(report, stop, cfg: Config, src: str, dst: str, app_id: str, guarantee: str,
              subscribe_output: bool = False) -> None:
    """A faust agent: for each event, `await dst.send(key, value)`. Runs until told to stop.

    With `subscribe_output`, a second, no-op agent reads the output topic. That is what it takes for faust's
    exactly_once to put the outputs in its transactions: TransactionManager.send picks the transactional
    producer from the output partition as the *consumer's* metadata computes it, and from the assignor's
    topic group of the output topic; for a topic the app does not consume, the partition is None and the
    record goes to the ordinary, non-transactional producer, silently."""
    logs = _KeepLogs()
    logging.getLogger().addHandler(logs)
    logging.getLogger().setLevel(logging.WARNING)

    from streams.faustwire import make_app  # noqa: PLC0415 - each variant runs in a spawned interpreter that imports this module: a confluent loop does not load streams.faustwire (~500 ms with faust's app, counted in its join_s)

    async def run() -> None:
        app = make_app(cfg, app_id, processing_guarantee=guarantee, **FAST_GROUP)
        # faust.Worker.on_start does this; app.in_transaction (exactly_once) is False without it.
        app.in_worker = True
        source = app.topic(src, key_serializer="raw", value_serializer="raw", partitions=PARTITIONS)
        sink = app.topic(dst, key_serializer="raw", value_serializer="raw", partitions=PARTITIONS)
        state = {"count": 0}

        @app.agent(source)
        async def transform(stream):
            async for key, value in stream.items():
                if state["count"] == 0:
                    report({"kind": "first", "t": now()})
                await sink.send(key=key, value=value)
                state["count"] += 1

        if subscribe_output:
            @app.agent(sink)
            async def read_output(stream):
                async for _ in stream:
                    pass

        await app.start()
        report({"kind": "assigned", "t": now(), "in_transaction": app.in_transaction,
                "consumer_in_transaction": app.consumer.in_transaction})
        while not stop.is_set():
            await asyncio.sleep(0.05)
        # None: the consumer's metadata does not know the output topic (see the docstring).
        output_partition = app.consumer.key_partition(dst, key_of(0))
        note = None
        try:
            await asyncio.wait_for(app.stop(), 30)
        except asyncio.TimeoutError:
            note = "app.stop() did not return within 30 s"
        report({"kind": "final", "t": now(), "processed": state["count"], "stop_note": note,
                "consumer_knows_output_partition": output_partition is not None,
                "log": logs.lines + ([f"... {logs.dropped} more"] if logs.dropped else [])})

    asyncio.run(run())
    # Past the event loop's own shutdown (its tasks cancelled, its executor joined): what could still keep
    # the process from exiting are other threads.

    report({"kind": "loop_closed", "t": now(),
            "threads": sorted(f"{t.name} ({type(t).__module__}.{type(t).__qualname__}"
                              f"{', daemon' if t.daemon else ''})"
                              for t in threading.enumerate() if t is not threading.current_thread())})


def _child(results, stop, fn, args) -> None:
    try:
        fn(results.put, stop, *args)
    except BaseException as exc:
        results.put({"kind": "error", "t": now(), "error": f"{type(exc).__name__}: {exc}"})
        raise


class Child:
    """One loop in a fresh interpreter (spawned), reporting through a queue; stopped on request, terminated
    if it does not exit."""

    def __init__(self, fn, *args):
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.stop_flag = ctx.Event()
        self.proc = ctx.Process(target=_child, args=(self.results, self.stop_flag, fn, args), daemon=True)
        self.seen: dict[str, dict] = {}
        self.proc.start()

    def drain(self, wait_s: float = 0.0) -> None:
        """Take what the child reported (each kind's latest message)."""
        try:
            msg = self.results.get(timeout=wait_s) if wait_s else self.results.get_nowait()
            while True:
                self.seen[msg["kind"]] = msg
                msg = self.results.get_nowait()
        except queue.Empty:
            pass

    def failed(self) -> str | None:
        if "error" in self.seen:
            return self.seen["error"]["error"]
        if not self.proc.is_alive() and "final" not in self.seen:
            self.drain()
            if "error" in self.seen:
                return self.seen["error"]["error"]
            return f"exited with code {self.proc.exitcode}"
        return None

    def stop(self, final_s: float = 45.0, exit_s: float = 15.0) -> str | None:
        """Ask it to stop; wait for its final report and its exit. Returns a note if it had to be killed."""
        self.stop_flag.set()
        t_asked = now()
        deadline = now() + final_s
        while "final" not in self.seen and "error" not in self.seen and now() < deadline and self.proc.is_alive():
            self.drain(0.2)
        self.proc.join(exit_s)
        self.drain()
        note = None
        if self.proc.is_alive():
            if "final" not in self.seen:
                note = f"no final report within {final_s:.0f} s of being asked to stop"
            else:
                note = f"reported its end {self.seen['final']['t'] - t_asked:.1f} s after being asked to stop"
                if "loop_closed" in self.seen:
                    note += (f", closed its event loop (threads left: {self.seen['loop_closed']['threads']})")
                else:
                    note += ", but its event loop never finished closing (asyncio.run did not return)"
            note += f", then did not exit within {exit_s:.0f} s; terminated"
            self.proc.terminate()
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        return note


class Reader:
    """The downstream reader: a read_committed confluent consumer over every partition of the output topic,
    from its beginning. Counts outputs by key (distinct and total)."""

    def __init__(self, cfg: Config, topic: str):
        self.consumer = Consumer(consumer_conf(cfg, "bench-reader", **{"isolation.level": "read_committed",
                                                                       "fetch.wait.max.ms": 10}))
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        self.keys: set[bytes] = set()
        self.total = 0

    def read(self, timeout_s: float = 0.02) -> None:
        """What has arrived within `timeout_s` (consume returns at its timeout unless 10,000 arrived: the
        time the last output is seen is late by at most that)."""
        for m in self.consumer.consume(10000, timeout_s):
            if m.error() is None:
                self.keys.add(m.key())
                self.total += 1

    def wait_key(self, key: bytes, timeout_s: float) -> float | None:
        """Wait for one output with `key`; the time it arrived (None at the timeout)."""
        deadline = now() + timeout_s
        while now() < deadline:
            m = self.consumer.poll(0.05)  # poll, not consume(n): consume waits for n records or its timeout
            if m is not None and m.error() is None:
                self.total += 1
                self.keys.add(m.key())
                if m.key() == key:
                    return now()
        return None

    def close(self) -> None:
        self.consumer.close()


def run_loop(cfg: Config, name: str, fn, args: tuple, dst: str, expect: int, timeout_s: float) -> dict:  # noqa: C901
    """Run one loop in a child and watch its output topic until `expect` distinct outputs are visible."""
    print(f"  {name} ...", file=sys.stderr, flush=True)
    reader = Reader(cfg, dst)
    t_spawn = now()
    child = Child(fn, *args)
    res: dict = {"name": name, "records": expect}
    t_visible = None
    deadline = now() + timeout_s
    try:
        while now() < deadline:
            reader.read()
            child.drain()
            if len(reader.keys) >= expect:
                t_visible = now()
                break
            if (why := child.failed()) is not None:
                res["error"] = why
                break
        else:
            res["error"] = (f"timeout: {len(reader.keys):,} of {expect:,} outputs visible after {timeout_s:.0f} s")
        note = child.stop()
        reader.read(0.5)  # anything that arrives late (duplicates) still counts
    finally:
        reader.close()
    first = child.seen.get("first", {}).get("t")
    final = child.seen.get("final", {})
    if "error" not in res and "error" in child.seen:
        res["error"] = child.seen["error"]["error"]
    res.update({
        "visible": len(reader.keys), "duplicates": reader.total - len(reader.keys),
        "join_s": round(first - t_spawn, 2) if first else None,
        "secs": round(t_visible - first, 3) if t_visible and first else None,
        "rate": round(expect / (t_visible - first)) if t_visible and first else None,
        "processed": final.get("processed"), "batches": final.get("batches"),
        "loop_rate": round(final["loop_rate"]) if final.get("loop_rate") else None,
    })
    # Control records = end offsets - records, once every record has been read (not after a failure).
    control = None if "error" in res else end_offsets(cfg, dst) - reader.total
    res["control_records"] = control
    if control is not None and final.get("batches"):
        res["control_per_batch"] = round(control / final["batches"], 2)
    for k in ("in_transaction", "consumer_in_transaction"):
        if k in child.seen.get("assigned", {}):
            res[k] = child.seen["assigned"][k]
    if "consumer_knows_output_partition" in final:
        res["consumer_knows_output_partition"] = final["consumer_knows_output_partition"]
    if final.get("log"):
        res["log"] = final["log"]
    notes = [n for n in (note, final.get("stop_note")) if n]
    if notes:
        res["note"] = "; ".join(notes)
    return res


def run_latency(cfg: Config, name: str, prefix: str, transactional: bool, samples: int,
                producer_extra: dict | None = None) -> dict:
    """One record at a time through a B=1 confluent loop: produced here -> output visible here."""
    print(f"  {name} ...", file=sys.stderr, flush=True)
    src, dst = f"{prefix}lat-in", f"{prefix}lat-out"
    create_topics(cfg, [src, dst])
    reader = Reader(cfg, dst)
    producer = Producer(producer_conf(cfg, **{"linger.ms": 0}))
    child = Child(ctp_confluent, cfg, src, dst, f"{prefix}lat", 1, None, transactional, producer_extra)
    res: dict = {"name": name, "samples": samples}
    lat_ms: list[float] = []
    try:
        # Warm-up: the loop joins its group, its producer finds the partitions and (transactional) its
        # coordinator. One record per partition so that every connection is open before measuring.
        for i in range(PARTITIONS * 2):
            key = f"warm-{i}".encode()
            produce_one(producer, src, key, VALUE)
            producer.flush(10)
            if reader.wait_key(key, 60.0) is None:
                child.drain()
                raise RuntimeError(f"warm-up record {i} never came out ({child.failed() or 'no error reported'})")
        for i in range(samples):
            key = key_of(i)
            t0 = now()
            produce_one(producer, src, key, VALUE)
            producer.flush(10)
            t1 = reader.wait_key(key, 10.0)
            if t1 is None:
                child.drain()
                raise RuntimeError(f"record {i} not visible within 10 s ({child.failed() or 'no error reported'})")
            lat_ms.append((t1 - t0) * 1000)
    except Exception as exc:  # noqa: BLE001 - report what was measured and why it stopped
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        note = child.stop()
        reader.close()
    if note:
        res["note"] = note
    if lat_ms:
        lat_ms.sort()
        res.update({"measured": len(lat_ms), "p50_ms": round(pct(lat_ms, 0.50), 2),
                    "p99_ms": round(pct(lat_ms, 0.99), 2), "mean_ms": round(sum(lat_ms) / len(lat_ms), 2),
                    "max_ms": round(lat_ms[-1], 2)})
    return res


def pct(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return sorted_values[max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))]


# -- correctness ------------------------------------------------------------------------------------------------

def read_partition_confluent(cfg: Config, topic: str, isolation: str) -> list[str]:
    """Every record of partition 0 up to its end (read_committed: up to the last stable offset)."""
    c = Consumer(consumer_conf(cfg, "bench-check", **{"isolation.level": isolation,
                                                      "enable.partition.eof": True}))
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    keys: list[str] = []
    deadline = now() + 15
    try:
        while now() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    return keys
                raise RuntimeError(m.error().str())
            keys.append(m.key().decode())
        raise RuntimeError("no end of partition within 15 s")
    finally:
        c.close()


def read_partition_aiokafka(cfg: Config, topic: str, isolation: str) -> list[str]:
    from aiokafka import AIOKafkaConsumer, TopicPartition  # noqa: PLC0415 - each variant runs in a spawned interpreter that imports this module: a confluent loop does not load aiokafka (~100 ms)

    async def run() -> list[str]:
        c = AIOKafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, isolation_level=isolation, **aiokafka_kwargs(cfg),
                             enable_auto_commit=False, auto_offset_reset="earliest")
        await c.start()
        try:
            tp = TopicPartition(topic, 0)
            c.assign([tp])
            await c.seek_to_beginning(tp)
            end = (await c.end_offsets([tp]))[tp]  # read_committed: the last stable offset
            keys: list[str] = []
            deadline = now() + 15
            while now() < deadline:
                for msgs in (await c.getmany(tp, timeout_ms=200)).values():
                    keys.extend(m.key.decode() for m in msgs)
                if await c.position(tp) >= end:
                    return keys
            raise RuntimeError(f"position {await c.position(tp)} never reached end offset {end} within 15 s")
        finally:
            await c.stop()

    return asyncio.run(run())


def check_transactions(cfg: Config, prefix: str) -> dict:
    """(a) aborted records: invisible to read_committed, visible to read_uncommitted, for both clients;
    (b) the offsets one committed transaction of 10 records to one partition occupies."""
    print("  correctness checks ...", file=sys.stderr, flush=True)
    aborted_topic, offsets_topic = f"{prefix}check-abort", f"{prefix}check-offsets"
    create_topics(cfg, [aborted_topic, offsets_topic], partitions=1)
    p = Producer(producer_conf(cfg, **{"transactional.id": f"{prefix}check"}))
    p.init_transactions(30)
    p.begin_transaction()
    for i in range(10):
        produce_one(p, aborted_topic, f"aborted-{i}".encode(), VALUE, partition=0)
    p.flush(30)  # in the log before the abort: librdkafka would otherwise just drop them unsent
    p.abort_transaction(30)
    p.begin_transaction()
    for i in range(5):
        produce_one(p, aborted_topic, f"committed-{i}".encode(), VALUE, partition=0)
    p.commit_transaction(30)

    p.begin_transaction()
    for i in range(10):
        produce_one(p, offsets_topic, f"r{i}".encode(), VALUE, partition=0)
    p.commit_transaction(30)

    w = Consumer(consumer_conf(cfg, "bench-check"))
    hw_abort = w.get_watermark_offsets(TopicPartition(aborted_topic, 0), timeout=10)
    hw_offsets = w.get_watermark_offsets(TopicPartition(offsets_topic, 0), timeout=10)
    w.close()

    readers = {}
    for client, read in (("confluent", read_partition_confluent), ("aiokafka", read_partition_aiokafka)):
        for isolation in ("read_committed", "read_uncommitted"):
            try:
                keys = read(cfg, aborted_topic, isolation)
                readers[f"{client} {isolation}"] = {
                    "aborted_seen": sum(k.startswith("aborted-") for k in keys),
                    "committed_seen": sum(k.startswith("committed-") for k in keys)}
            except Exception as exc:  # noqa: BLE001 - report it, go on with the others
                readers[f"{client} {isolation}"] = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "aborted": {"produced": "10 records in an aborted transaction, then 5 in a committed one, partition 0",
                    "high_watermark": hw_abort[1], "readers": readers},
        "offsets": {"produced": "10 records in one committed transaction, one partition",
                    "low": hw_offsets[0], "high_watermark": hw_offsets[1],
                    "offsets_per_txn": hw_offsets[1] - hw_offsets[0]},
    }


# -- the run ----------------------------------------------------------------------------------------------------

def versions() -> dict:
    import aiokafka  # noqa: PLC0415 - each variant runs in a spawned interpreter that imports this module: a confluent loop does not load aiokafka (~100 ms)
    import faust  # noqa: PLC0415 - each variant runs in a spawned interpreter that imports this module: a confluent loop does not load faust (~15 ms over the other clients)

    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30).stderr
        java = java.splitlines()[0] if java else None
    except (OSError, subprocess.SubprocessError):
        java = None
    return {"kafka_broker": f"Apache Kafka {KAFKA_VERSION} (KRaft, one node)", "java": java,
            "python": platform.python_version(), "confluent_kafka": confluent_kafka.__version__,
            "librdkafka": confluent_kafka.libversion()[0], "aiokafka": aiokafka.__version__,
            "faust_streaming": faust.__version__}


TUNED = {"retry.backoff.ms": TUNED_BACKOFF_MS}
# The loops: (tag, name, transactional, B, producer settings added).
CONFLUENT_LOOPS = (
    [(f"alo-b{b}", f"confluent at-least-once B={b}", False, b, {}) for b in BATCHES]
    + [(f"tx-b{b}", f"confluent transactional B={b}", True, b, {}) for b in BATCHES]
    # Not asked for, but it explains the rows above: a transaction begun right after a commit meets
    # CONCURRENT_TRANSACTIONS at the coordinator (the previous one is still writing its markers), which
    # librdkafka retries after retry.backoff.ms, 100 ms by default.
    + [(f"txr-b{b}", f"confluent transactional B={b}, retry.backoff.ms={TUNED_BACKOFF_MS}", True, b, TUNED)
       for b in BATCHES])
# (tag, name, processing_guarantee, a no-op agent also consumes the output topic)
FAUST_LOOPS = [("faust-alo", "faust at_least_once", "at_least_once", False),
               ("faust-eos", "faust exactly_once", "exactly_once", False),
               ("faust-eos-sub", "faust exactly_once, output topic also consumed", "exactly_once", True)]
# (tag, name, transactional, producer settings added): one record at a time through a B=1 loop
LATENCY_LOOPS = [("lat-alo", "confluent at-least-once B=1", False, {}),
                 ("lat-tx", "confluent transactional B=1", True, {}),
                 ("lat-txr", f"confluent transactional B=1, retry.backoff.ms={TUNED_BACKOFF_MS}", True, TUNED)]
TAGS = [v[0] for v in CONFLUENT_LOOPS + FAUST_LOOPS + LATENCY_LOOPS]


def main(argv: list[str] | None = None) -> int:  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=20_000, help="input records (default 20,000)")
    ap.add_argument("--records-b1", type=int, default=500,
                    help="records the B=1 loops process (default 500; at most --records)")
    ap.add_argument("--latency-samples", type=int, default=200)
    ap.add_argument("--faust-timeout", type=float, default=60.0,
                    help="seconds a faust variant may take to make every output visible")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (broker log)")
    ap.add_argument("--only", nargs="+", choices=TAGS, metavar="TAG",
                    help=f"run only these loops (the baseline and the checks always run): {' '.join(TAGS)}")
    args = ap.parse_args(argv)
    n = args.records
    n_b1 = min(args.records_b1, n)

    run_dir = Path(tempfile.mkdtemp(prefix="ropewalk-txbench-"))
    broker_port, controller_port, redis_port = free_ports(3)
    cfg = Config.from_env({"ROPEWALK_BROKER_PORT": str(broker_port), "ROPEWALK_CONTROLLER_PORT": str(controller_port),
                           "ROPEWALK_REDIS_PORT": str(redis_port), "ROPEWALK_RUN_DIR": str(run_dir),
                           "ROPEWALK_PARTITIONS": str(PARTITIONS)})
    prefix = f"tx{uuid.uuid4().hex[:6]}."
    src = f"{prefix}input"
    doc: dict = {"conditions": {
        "records": n, "records_b1": n_b1, "key_bytes": KEY_BYTES, "value_bytes": VALUE_BYTES,
        "partitions": PARTITIONS, "cores": cores(), "cpu_count": os.cpu_count(), "batches": list(BATCHES),
        "producer": "idempotent, acks=all, linger.ms=5, murmur2_random (streams.clients.producer_conf)",
        "faust_settings": {**FAST_GROUP, "broker_commit_interval": "2.8 (default)",
                           "broker_commit_every": "10000 (default)"},
        "run_dir": str(run_dir), "ports": {"broker": broker_port, "controller": controller_port, "redis": redis_port},
        "versions": versions()}}
    t_run = now()
    try:
        with sigterm_as_interrupt():
            print(f"starting broker and redis in {run_dir} ...", file=sys.stderr, flush=True)
            services.up(cfg)
            create_topics(cfg, [src, f"{src}.warmup"])
            print("  baseline ...", file=sys.stderr, flush=True)
            doc["baseline"] = {"raw_produce_per_s": round(raw_produce(cfg, src, n)),
                               "raw_consume_per_s": round(raw_consume(cfg, src, n))}
            results = doc["loops"] = []
            for tag, name, transactional, b, extra in CONFLUENT_LOOPS:
                if args.only and tag not in args.only:
                    continue
                dst = f"{prefix}out-{tag}"
                create_topics(cfg, [dst])
                expect = n_b1 if b == 1 else n
                res = run_loop(cfg, name, ctp_confluent,
                               (cfg, src, dst, f"{prefix}{tag}", b, expect, transactional, extra), dst, expect,
                               timeout_s=max(120.0, expect / 100))
                res.update({"tag": tag, "client": "confluent", "batch": b, "producer_extra": extra,
                            "guarantee": "transactional" if transactional else "at-least-once"})
                results.append(res)
            for tag, name, guarantee, subscribe_output in FAUST_LOOPS:
                if args.only and tag not in args.only:
                    continue
                dst = f"{prefix}out-{tag}"
                create_topics(cfg, [dst])
                res = run_loop(cfg, name, ctp_faust,
                               (cfg, src, dst, f"{prefix}{tag}", guarantee, subscribe_output), dst, n,
                               timeout_s=args.faust_timeout)
                res.update({"tag": tag, "client": "faust", "guarantee": guarantee, "batch": None,
                            "output_topic_consumed": subscribe_output})
                results.append(res)
            for res in results:
                if res["guarantee"] in ("transactional", "exactly_once") and res["control_records"] is not None:
                    # Each transaction writes one marker to every partition it wrote to: none means the
                    # outputs were written outside any transaction.
                    res["outputs_in_transactions"] = res["control_records"] > 0
            doc["latency"] = []
            for tag, name, transactional, extra in LATENCY_LOOPS:
                if args.only and tag not in args.only:
                    continue
                res = run_latency(cfg, name, f"{prefix}{tag}.", transactional, args.latency_samples, extra)
                res["tag"] = tag
                doc["latency"].append(res)
            doc["correctness"] = check_transactions(cfg, prefix)
    finally:
        try:
            services.down(cfg)
        finally:
            if not args.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
    doc["conditions"]["run_seconds"] = round(now() - t_run, 1)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_report(doc)
    return 0


def print_report(doc: dict) -> None:  # noqa: C901
    c, base = doc["conditions"], doc["baseline"]
    v = c["versions"]
    print(f"conditions: {c['records']:,} input records ({c['key_bytes']}-byte keys, {c['value_bytes']}-byte values), "
          f"{c['partitions']} partitions in and out, B=1 loops on the first {c['records_b1']:,}; "
          f"{c['cores']} cores; run {c['run_seconds']} s")
    print(f"versions: {v['kafka_broker']}, {v['java']}; Python {v['python']}, confluent-kafka {v['confluent_kafka']} "
          f"(librdkafka {v['librdkafka']}), aiokafka {v['aiokafka']}, faust-streaming {v['faust_streaming']}")
    print(f"producer: {c['producer']}; faust: {c['faust_settings']}")
    print(f"baseline (same broker, same run): raw produce {base['raw_produce_per_s']:,} records/s, "
          f"raw consume {base['raw_consume_per_s']:,} records/s")
    print()
    print("consume-transform-produce, end to end (first input read -> last output visible to read_committed);")
    print("loop/s: the loop's own rate up to its last commit; join s: child start -> first input batch;")
    print("markers: control records in the output topic (end offsets - records); mk/batch: markers per batch")
    print(f"{'loop':52} {'records':>7} {'records/s':>10} {'x raw prod':>10} {'loop/s':>8} {'join s':>6} "
          f"{'dups':>5} {'markers':>7} {'mk/batch':>8}")
    for r in doc["loops"]:
        rate = f"{r['rate']:,}" if r.get("rate") else "-"
        ratio = f"{r['rate'] / base['raw_produce_per_s']:.3f}" if r.get("rate") else "-"
        loop = f"{r['loop_rate']:,}" if r.get("loop_rate") else "-"
        print(f"{r['name']:52} {r['records']:>7,} {rate:>10} {ratio:>10} {loop:>8} "
              f"{r['join_s'] if r.get('join_s') is not None else '-':>6} {r['duplicates']:>5} "
              f"{r['control_records'] if r['control_records'] is not None else '-':>7} "
              f"{r.get('control_per_batch', '-'):>8}")
        extra = [f"{k}={r[k]}" for k in ("in_transaction", "consumer_in_transaction",
                                         "consumer_knows_output_partition")
                 if k in r and r["guarantee"] == "exactly_once"]
        if r.get("outputs_in_transactions") is False:
            extra.append("NOT EXACTLY-ONCE: no transaction markers in the output topic, the outputs were written "
                         "outside the transactions (only the input offsets were committed in them)")
        if r.get("processed") is not None and r["processed"] != r["records"]:
            extra.append(f"processed by the loop: {r['processed']:,}")
        if r.get("error"):
            extra.append(f"FAILED: {r['error']} ({r['visible']:,} outputs visible)")
        if r.get("note"):
            extra.append(f"note: {r['note']}")
        for line in extra:
            print(f"    {line}")
        for line in r.get("log", []):  # what faust logged at WARNING and above
            print(f"    log: {line}")
    print()
    print("latency, one record at a time (produced -> output visible to read_committed), ms:")
    for r in doc["latency"]:
        if "p50_ms" in r:
            print(f"  {r['name']:50} p50 {r['p50_ms']:7.2f}  p99 {r['p99_ms']:7.2f}  mean {r['mean_ms']:7.2f}  "
                  f"max {r['max_ms']:7.2f}  (n={r['measured']})")
        if r.get("error"):
            print(f"  {r['name']:50} FAILED: {r['error']}")
        if r.get("note"):
            print(f"    note: {r['note']}")
    print()
    a, o = doc["correctness"]["aborted"], doc["correctness"]["offsets"]
    print(f"aborted transaction: {a['produced']}; partition end offset {a['high_watermark']} "
          f"(10 + abort marker + 5 + commit marker would be 17)")
    for reader, seen in a["readers"].items():
        if "error" in seen:
            print(f"  {reader:30} ERROR {seen['error']}")
        else:
            print(f"  {reader:30} sees {seen['aborted_seen']:2} aborted, {seen['committed_seen']} committed")
    marker = o["offsets_per_txn"] - 10
    print(f"offsets: {o['produced']}: offsets {o['low']}..{o['high_watermark']}, {o['offsets_per_txn']} offsets for "
          f"10 records: the commit marker takes {marker} offset{'' if marker == 1 else 's'}")


if __name__ == "__main__":
    sys.exit(main())
