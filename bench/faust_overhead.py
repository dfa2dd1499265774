"""How much does faust cost over the Kafka clients under it, and which faust settings win some of it back?

Not a test: run it by hand, on its own broker and Redis (bench.env.BenchEnv: free ports, a temporary run dir):

    .venv/bin/python bench/faust_overhead.py [--records 100000] [--partitions 8] [--only NAME ...]

It produces N ~200-byte Ropewalk events (JobStopped, keyed over 1000 entitlements) to one topic with the
confluent EventProducer, then reads the whole topic with each reader, each in a fresh process:

* confluent-kafka `consume()` (raw, then through EventConsumer's decode + placement check);
* raw aiokafka `getmany()`;
* a trivial faust agent, then variations of it: the stream API used (`take`, `noack`, Ropewalk's `decoded`),
  and settings (`stream_buffer_maxsize`, `broker_max_poll_records`, `consumer_max_fetch_size`,
  `stream_wait_empty`, commit frequency, topic acks).

A reader's rate is measured from its first fetch that returned records to its Nth record, so group-join and start-up time (reported
separately as `first_s`, and folded into `rate_from_start`) do not dilute it. Faust apps use a fresh consumer group per run, reading from the
beginning.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import queue
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.env import BenchEnv  # noqa: E402
from infra.config import Config  # noqa: E402
from infra.credentials import aiokafka_kwargs  # noqa: E402
from streams.clients import EventConsumer, EventProducer, consumer_conf  # noqa: E402
from streams.deadletter import DeadLetters  # noqa: E402
from streams.events import new_event  # noqa: E402
from streams.serde import SchemaRegistry  # noqa: E402
from streams.topics import Topics  # noqa: E402

# Group timing for a quick first join (see streams/faustwire.py); equal for every faust variant.
FAST_GROUP = {"broker_session_timeout": 2.0, "broker_heartbeat_interval": 0.5, "broker_rebalance_timeout": 2.0}
RECORD_BYTES = 200


# -- the data ----------------------------------------------------------------------------------------------

def produce(cfg: Config, n: int) -> dict:
    registry = SchemaRegistry.from_dir()
    producer = EventProducer(cfg, registry, "bench")

    def event(i: int, reason: str):
        ent = f"ent-{i % 1000:04d}"
        return new_event("JobStopped", {"job_id": f"job-{i:07d}", "reason": reason}, entitlement=ent,
                         entity_id=f"job-{i:07d}", producer="bench")

    probe = registry.encode("JobStopped", event(0, "").to_record(1))
    pad = "x" * max(0, RECORD_BYTES - len(probe) - 1)
    size = len(registry.encode("JobStopped", event(0, pad).to_record(1)))
    t0 = time.perf_counter()
    for i in range(n):
        producer.send(event(i, pad), validate=False)
    producer.flush(120)
    secs = time.perf_counter() - t0
    return {"name": "produce (confluent EventProducer)", "records": n, "secs": secs, "rate": n / secs,
            "value_bytes": size}


# -- readers, each run in a fresh process -----------------------------------------------------------------

def read_confluent(report, cfg: Config, n: int, decode: bool) -> None:
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("intents")
    t_start = time.perf_counter()
    if decode:
        consumer = EventConsumer(cfg, SchemaRegistry.from_dir(), [topic], name="bench")
        poll, close = (lambda: len(consumer.poll(10000, 1.0))), consumer.close
    else:
        c = Consumer(consumer_conf(cfg, None, **{"enable.partition.eof": False}))
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(cfg.partitions)])
        poll, close = (lambda: sum(1 for m in c.consume(10000, 1.0) if m.error() is None)), c.close
    count, t_first = 0, None
    while count < n:
        t_poll = time.perf_counter()
        got = poll()
        if got and t_first is None:
            t_first = t_poll  # the clock starts with the fetch that brought the first batch
        count += got
    report(_result(t_start, t_first, time.perf_counter(), count))
    close()


def read_aiokafka(report, cfg: Config, n: int) -> None:
    from aiokafka import AIOKafkaConsumer, TopicPartition  # noqa: PLC0415 - each reader runs in a spawned interpreter of its own (isolated) that imports this module: the others do not load aiokafka (~100 ms)

    topic = Topics(cfg.topic_prefix, cfg.partitions).name("intents")

    async def run() -> None:
        c = AIOKafkaConsumer(bootstrap_servers=cfg.bootstrap_servers, enable_auto_commit=False,
                             auto_offset_reset="earliest", **aiokafka_kwargs(cfg))
        await c.start()
        t_start = time.perf_counter()
        c.assign([TopicPartition(topic, p) for p in range(cfg.partitions)])
        await c.seek_to_beginning()
        count, t_first = 0, None
        while count < n:
            t_poll = time.perf_counter()
            batches = await c.getmany(timeout_ms=1000, max_records=10000)
            got = sum(len(v) for v in batches.values())
            if got and t_first is None:
                t_first = t_poll  # the clock starts with the fetch that brought the first batch
            count += got
        report(_result(t_start, t_first, time.perf_counter(), count))
        await c.stop()

    asyncio.run(run())


# The faust agent bodies compared. Each calls tick(k) after k records.
async def body_iterate(stream, tick, ctx):
    async for _ in stream:
        tick(1)


async def body_take(stream, tick, ctx):
    async for batch in stream.take(1000, within=0.05):
        tick(len(batch))


async def body_noack(stream, tick, ctx):
    async for _ in stream.noack():
        tick(1)


async def body_decoded(stream, tick, ctx):
    from streams.faustwire import decoded  # noqa: PLC0415 - each reader runs in a spawned interpreter of its own (isolated) that imports this module: the others do not load streams.faustwire (~500 ms with faust's app)

    async for _record, _event in decoded(stream, ctx["registry"], ctx["dead_letters"], ctx["catalogue"],
                                         cfg=ctx["cfg"]):
        tick(1)


async def body_fetches(stream, tick, ctx):
    """Ropewalk's ``faustwire.FetchBatches``: the consumer's fetch loop hands whole fetches over (no per-record
    delivery through faust's conductor and stream); each message acked as the scheduler shard acks them."""
    app, batches = ctx["app"], ctx["fetch_batches"]
    while True:
        batch = await batches.take(500, 0.001, 0.02)
        ack = app.consumer.ack
        for message in batch:
            ack(message)
        tick(len(batch))


BODIES = {"iterate": body_iterate, "take": body_take, "noack": body_noack, "decoded": body_decoded,
          "fetches": body_fetches}


def read_faust(report, cfg: Config, n: int, body: str, settings: dict, topic_options: dict) -> None:
    logging.basicConfig(level=logging.ERROR)
    from streams.faustwire import make_app, source_topic  # noqa: PLC0415 - each reader runs in a spawned interpreter of its own (isolated) that imports this module: the others do not load streams.faustwire (~500 ms with faust's app)

    registry = SchemaRegistry.from_dir()
    ctx = {"cfg": cfg, "registry": registry, "catalogue": Topics(cfg.topic_prefix, cfg.partitions),
           "dead_letters": DeadLetters(EventProducer(cfg, registry, "bench"), "bench")}

    async def run() -> None:
        from streams.faustwire import FetchBatches  # noqa: PLC0415 - each reader runs in a spawned interpreter of its own (isolated) that imports this module: the others do not load streams.faustwire (~500 ms with faust's app)

        app = make_app(cfg, f"bench-{uuid.uuid4().hex[:8]}", **{**FAST_GROUP, **settings})
        if body == "fetches":
            ctx["app"] = app
            ctx["fetch_batches"] = app.fetch_batches = FetchBatches([ctx["catalogue"].name("intents")])
        done = asyncio.Event()
        state = {"count": 0, "first": None, "end": None}

        def tick(k: int) -> None:
            if state["first"] is None:
                state["first"] = time.perf_counter()
            state["count"] += k
            if state["count"] >= n and state["end"] is None:
                state["end"] = time.perf_counter()
                done.set()

        @app.agent(source_topic(app, cfg, "intents", **topic_options))
        async def reader(stream):
            await BODIES[body](stream, tick, ctx)

        t_start = time.perf_counter()
        await app.start()
        try:
            await asyncio.wait_for(done.wait(), timeout=max(120.0, n / 500))
        except asyncio.TimeoutError:
            state["end"] = time.perf_counter()
        # Report before stopping: a stop that never returns (see the noack variant) must not lose it.
        report(_result(t_start, state["first"], state["end"], state["count"]))
        await app.stop()

    asyncio.run(run())


def _result(t_start: float, t_first: float | None, t_end: float, count: int) -> dict:
    t_first = t_first or t_end
    return {"records": count, "first_s": t_first - t_start, "secs": t_end - t_first,
            "rate": count / max(t_end - t_first, 1e-9), "rate_from_start": count / max(t_end - t_start, 1e-9)}


# -- the runs ----------------------------------------------------------------------------------------------

MB = 1024 * 1024
FAUST_VARIANTS = [
    # name, agent body, app settings (on top of make_app's), topic options
    ("faust: trivial agent (make_app settings)", "iterate", {}, {}),
    ("faust: whole fetches (faustwire.FetchBatches)", "fetches", {}, {}),
    ("faust: stream.take(1000, within=0.05)", "take", {}, {}),
    # noack: faust stops tracking acks, so nothing is committed; and with stream_wait_empty=True (the
    # default) stopping the worker waits forever for those acks. Measured only to price acking.
    ("faust: stream.noack() + stream_wait_empty=False", "noack", {"stream_wait_empty": False}, {}),
    ("faust: stream.noack() (stream_wait_empty=True)", "noack", {}, {}),
    ("faust: topic acks=False", "iterate", {}, {"acks": False}),
    ("faust: stream_buffer_maxsize=65536", "iterate", {"stream_buffer_maxsize": 65536}, {}),
    ("faust: broker_max_poll_records=1000", "iterate", {"broker_max_poll_records": 1000}, {}),
    ("faust: consumer_max_fetch_size=4MiB", "iterate", {"consumer_max_fetch_size": 4 * MB}, {}),
    ("faust: stream_wait_empty=False", "iterate", {"stream_wait_empty": False}, {}),
    ("faust: commit every 10 s / 100k acks", "iterate",
     {"broker_commit_interval": 10.0, "broker_commit_every": 100_000}, {}),
    ("faust: Ropewalk decoded() loop", "decoded", {}, {}),
    ("faust: take + buffer 65536 + commit 10 s", "take",
     {"stream_buffer_maxsize": 65536, "broker_commit_interval": 10.0, "broker_commit_every": 100_000}, {}),
    ("faust: decoded() + buffer 65536 + commit 10 s", "decoded",
     {"stream_buffer_maxsize": 65536, "broker_commit_interval": 10.0, "broker_commit_every": 100_000}, {}),
]


def _child(results, fn, args) -> None:
    try:
        fn(results.put, *args)
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def isolated(fn, *args, timeout_s: float = 300.0, exit_s: float = 30.0) -> dict:
    """Run one reader in a fresh interpreter, so no client's threads or caches affect the next. The reader
    reports its numbers as soon as it has them; a reader that then does not exit within `exit_s` (a
    shutdown that hangs) is terminated, and that is noted in its result."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(results, fn, args), daemon=True)
    proc.start()
    try:
        try:
            result = results.get(timeout=timeout_s)
        except queue.Empty:
            result = {"error": f"no result within {timeout_s:.0f}s"}
        proc.join(exit_s)
        if proc.is_alive():
            result["note"] = f"did not shut down within {exit_s:.0f}s; terminated"
        return result
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--only", nargs="*", help="substrings of run names to run (default: all)")
    args = ap.parse_args(argv)

    results = []
    with BenchEnv(partitions=args.partitions) as env:
        cfg = env.cfg
        results.append(produce(cfg, args.records))
        _print(results[-1])
        runs = [("confluent-kafka consume() (raw)", read_confluent, (cfg, args.records, False)),
                ("confluent-kafka EventConsumer (decode + placement)", read_confluent, (cfg, args.records, True)),
                ("aiokafka getmany() (raw)", read_aiokafka, (cfg, args.records))]
        runs += [(name, read_faust, (cfg, args.records, body, settings, topic))
                 for name, body, settings, topic in FAUST_VARIANTS]
        for name, fn, fn_args in runs:
            if args.only and not any(s in name for s in args.only):
                continue
            try:
                res = {"name": name, **isolated(fn, *fn_args)}
            except Exception as exc:  # noqa: BLE001 - one failed reader should not lose the others' numbers
                res = {"name": name, "error": f"{type(exc).__name__}: {exc}"}
            results.append(res)
            _print(res)
    print(json.dumps({"records": args.records, "partitions": args.partitions, "results": results}))
    return 0


def _print(res: dict) -> None:
    note = f"  [{res['note']}]" if "note" in res else ""
    if "error" in res:
        print(f"{res['name']:<52} ERROR {res['error']}{note}", flush=True)
    else:
        first = f"  first record after {res['first_s']:5.2f}s" if "first_s" in res else ""
        since = f" ({res['rate_from_start']:,.0f}/s from start)" if "rate_from_start" in res else ""
        print(f"{res['name']:<52} {res['rate']:>10,.0f} records/s  ({res['records']:,} in {res['secs']:.2f}s)"
              f"{first}{since}{note}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
