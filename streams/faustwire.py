"""Thin wiring between faust and Ropewalk's log: an app configured for it, source topics that hand the
agent raw bytes, and a decoding loop that never lets a bad record kill an agent.

    app = make_app(cfg, "scheduler")
    intents = source_topic(app, cfg, "intents")

    @app.agent(intents)
    async def schedule(stream):
        async for record, event in decoded(stream, registry, dead_letters, catalogue, cfg=cfg):
            ...  # pure decision code on `event`; `record` says where it sits in the log

Why raw bytes: faust decodes values inside its stream machinery, and a deserialization error there is
logged and the record skipped — out of reach of dead-letter routing. So agents consume `raw` and decode
here, with the same `SchemaRegistry` the confluent tools use. A record that fails to decode (garbage, a
truncated body, a fingerprint unknown even to `_schemas`) or fails `check_placement` (wrong topic, key
differing from the envelope) becomes a `DeadLetterRecorded` on `deadletter` with its reason constant and
origin topic/partition/offset, and the loop goes on with the next record.

Delivery: at-least-once, as the whole system is (BENCHMARKS.md, "Transactions": why not faust's
`exactly_once`).
A dead letter is flushed to the broker before the loop asks faust for the next record, i.e. before the bad
record is acked and its offset can be committed; a crash in between re-routes it with the same derived
event id, which readers de-duplicate.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, AsyncIterator

import faust
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_kafka

from infra import credentials
from infra.config import Config
from infra.private import make_dir
from streams import schemalog
from streams.freeze import FreezeWatch
from streams.clients import Record, check_placement, header, identity_of
from streams.deadletter import DeadLetters
from streams.events import Event
from streams.groups import app_group
from streams.serde import UNKNOWN_FINGERPRINT, DecodeError, SchemaRegistry, fingerprint_of
from streams.topics import Topics, replication_factor

# How long routing one dead letter may wait for the broker's ack before the agent fails loudly.
DEAD_LETTER_FLUSH_S = 15.0


def app_settings(cfg: Config, app_id: str) -> dict[str, Any]:
    """The non-default faust settings Ropewalk runs with, each with its reason (faust-streaming 0.15.3)."""
    servers = [s.strip() for s in cfg.bootstrap_servers.split(",") if s.strip()]
    return {
        # faust wants URLs; several bootstrap servers are a list of them.
        "broker": [f"kafka://{s}" for s in servers],
        # The app's principal on the broker (SASL/SCRAM, infra/credentials.py); None: no authentication.
        "broker_credentials": credentials.faust_credentials_of(
            credentials.kafka_credentials(cfg.secrets, cfg.principal)),
        # The consumer group id is the app id. Prefixed like the topics, so two regions (or two tests) on
        # one cluster never share a group, nor the internal topics faust names after the id.
        "id": app_group(cfg, app_id),
        # Tables live in memory and are rebuilt from their changelog topics at start (the log is the
        # source of truth; docs/architecture.md). Memory is also faust's default; stated because it is a choice.
        "store": "memory://",
        # Keep faust's data directory under the run directory instead of `<id>-data` in the cwd.
        "datadir": str(Path(cfg.run_dir) / "faust" / "{conf.name}-data"),
        # Internal topics faust creates (changelogs, group_by repartitions) are co-partitioned with ours, and
        # replicated as ours (streams/topics.py, "Replication"; faust's default is 1 replica).
        "topic_partitions": cfg.partitions,
        "topic_replication_factor": replication_factor(cfg),
        # The catalogue's topics are created by streams.topics.provision; faust only ever declares
        # *internal* topics (table changelogs, group_by repartition topics, the leader topic). Tables
        # need their changelogs, so declaring stays allowed (True is the default; see make_app).
        "topic_allow_declare": True,
        # The leader-election topic only serves `on_leader=True` timers; Ropewalk has none, and each
        # extra subscribed topic is one more thing a rebalance has to assign.
        "topic_disable_leader": True,
        # Values arrive as bytes; `decoded` turns them into Events (see the module docstring).
        "key_serializer": "raw",
        "value_serializer": "raw",
        # A new group reads its topics from the beginning: the log is the state (also faust's default).
        "consumer_auto_offset_reset": "earliest",
        # Group timing. Faust's 60 s session timeout would let a dead worker hold its entitlements for a
        # minute; 6 s is the lowest a stock Kafka broker accepts (group.min.session.timeout.ms), so the
        # setting is portable (the embedded broker accepts 1 s, which tests use). Heartbeats run on
        # faust's consumer thread, not on the agents' event loop, so a slow handler cannot starve them.
        "broker_session_timeout": 6.0,
        # At most a third of the session timeout (Kafka's rule), so two lost heartbeats do not evict.
        "broker_heartbeat_interval": 2.0,
        # How long the coordinator waits for every member to rejoin once a rebalance starts; a member
        # first finishes its current event (stream_wait_empty) and commits. Faust's 60 s would let one
        # stuck worker stall every shard that long; Ropewalk's handlers take milliseconds.
        "broker_rebalance_timeout": 10.0,
        # A partition's batch may hold what the broker takes in one record (1 MiB), not 16 KiB: a chunk of a
        # job's tasks (~9 KB for 36 tasks, ~120 KB for 500) filled a batch of its own, and aiokafka sends one batch
        # per partition per request, so a batch's changelog writes went out one record per request (~1.8 produce
        # requests per 36-task job, the broker's largest cost in a burst, from its request log).
        "producer_max_batch_size": 1024 * 1024,
        # Who this is in the broker's request log and metrics (confluent clients say so too: clients.client_id).
        "broker_client_id": f"ropewalk-{app_id}",
        # No HTTP server per worker: Ropewalk's front end is its own process; a web port per worker would
        # also collide when several workers run on one machine (and in tests).
        "web_enabled": False,
    }


class IdempotentProducer(faust_kafka.Producer):
    """faust's aiokafka producer, idempotent (as every confluent producer is: ``streams/clients.producer_conf``).
    faust turns idempotence on only inside a transaction (``_settings_extra``); without it a send retried after a
    broker failed over (its leader moved, a request timed out after the leader had written it) could write a record
    twice. ``acks=all`` goes with it (faust's default too)."""

    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


FREEZE_MIN_S = 1.0  # the shortest gap between the freeze watch's ticks counted as a freeze (a loaded machine's jitter is less)


class App(faust.App):
    """A faust app whose producer is ``IdempotentProducer`` and whose consumer is a ``BatchingConsumer`` (which hands
    the topics of ``fetch_batches``, if set before the app starts, over as whole fetches)."""

    fetch_batches: "FetchBatches | None" = None
    freeze_watch: FreezeWatch

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A freeze that may have cost it two heartbeats makes it suspect until its group assigns it again, or for
        # two session timeouts (streams/freeze.py); tables_ready says no meanwhile.
        hb, session = float(self.conf.broker_heartbeat_interval), float(self.conf.broker_session_timeout)
        self.freeze_watch = FreezeWatch(threshold_s=max(FREEZE_MIN_S, 2 * hb), suspect_s=2 * session,
                                        on_freeze=self._frozen)

    def _frozen(self, gap_s: float) -> None:
        self.log.warning("this process was frozen for %.1f s: deciding nothing until its group assigns it its "
                         "partitions again, or for %.0f s (streams/freeze.py)", gap_s, self.freeze_watch.rule.suspect_s)

    async def on_start(self) -> None:
        self.freeze_watch.start()
        await super().on_start()

    async def _on_partitions_assigned(self, assigned: Any, generation_id: int = 0) -> None:
        self.freeze_watch.assigned()  # what the group gives it now is current, whatever froze before
        await super()._on_partitions_assigned(assigned, generation_id)

    def _new_producer(self) -> Any:
        return IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)

    async def _on_partitions_revoked(self, revoked: Any) -> None:
        # Before faust's own steps (no await in between until the partitions are paused): the fetches waiting are of
        # the assignment being revoked (FetchBatches, "Rebalances").
        if self.fetch_batches is not None:
            dropped = self.fetch_batches.revoke()
            if dropped:
                self.log.info("partitions revoked: %d records of fetches not handed out yet dropped", dropped)
        await super()._on_partitions_revoked(revoked)

    def _new_consumer(self) -> Any:
        consumer = BatchingConsumer(self.transport, callback=self.topics.on_message,
                                    on_partitions_revoked=self._on_partitions_revoked,
                                    on_partitions_assigned=self._on_partitions_assigned, beacon=self.beacon,
                                    loop=self.loop)
        consumer.fetch_batches = self.fetch_batches
        return consumer


def make_app(cfg: Config, app_id: str, **settings: Any) -> faust.App:
    """A faust app for Ropewalk's log; `settings` override `app_settings` (tests lower the timeouts).

    Left at faust's defaults on purpose: `producer_partitioner` (aiokafka's murmur2, which is what the
    confluent producers' `murmur2_random` computes, so keyed topics stay co-partitioned across both
    clients), `producer_acks` (-1 = all), `processing_guarantee` (at_least_once). Its producer is idempotent
    (``IdempotentProducer``).
    """
    conf = app_settings(cfg, app_id)
    conf.update(settings)
    app_name = conf.pop("id")
    make_dir(Path(cfg.run_dir, "faust"))  # 0700: its tables are the region's alone (infra/private.py)
    return App(app_name, **conf)


def source_topic(app: faust.App, cfg: Config, logical: str, **options: Any) -> faust.TopicT:
    """The faust topic for a catalogue topic: its physical name, raw keys and values, and its configured
    partition count (faust checks co-partitioning of an agent's topics against it)."""
    catalogue = Topics(cfg.topic_prefix, cfg.partitions)
    options.setdefault("key_serializer", "raw")
    options.setdefault("value_serializer", "raw")
    options.setdefault("partitions", catalogue.partitions_of(logical))
    return app.topic(catalogue.name(logical), **options)


async def decoded(stream: faust.StreamT, registry: SchemaRegistry, dead_letters: DeadLetters,
                  catalogue: Topics, *, cfg: Config | None = None,
                  gate: Callable[[Any], Awaitable[bool]] | None = None,
                  verifier: Any = None) -> AsyncIterator[tuple[Record, Event]]:
    """Decode a raw faust stream: yields `(record, event)` for every good record (`record.event is event`),
    routes every bad one to `deadletter` and goes on. With `cfg`, a fingerprint this process does not know
    is looked up in `_schemas` (in a thread: it is a blocking read) before the record is given up on.
    With `gate`, every message (good or bad) is first shown to it; one it returns False for is passed over
    without decoding (the scheduler's offset guard: a duplicate, or a record after a gap it seeks back for).
    With `verifier` (streams/auth.py), the records of authenticated topics must prove who wrote them."""
    missed: dict[bytes, float] = {}  # fingerprint -> when _schemas last did not have it
    async for ev in stream.events():
        msg = ev.message
        if gate is not None and not await gate(msg):
            continue
        got = await decode_message(msg, registry, dead_letters, catalogue, cfg=cfg, missed=missed, verifier=verifier)
        if got is not None:
            yield got


async def decode_message(msg: Any, registry: SchemaRegistry, dead_letters: DeadLetters, catalogue: Topics, *,
                         cfg: Config | None = None, missed: dict[bytes, float] | None = None,
                         placement_topic: str | None = None, verifier: Any = None) -> tuple[Record, Event] | None:
    """One faust message as `(record, event)`, or None once a bad one is routed to `deadletter` (see `decoded`;
    `missed` is the caller's memory of fingerprints `_schemas` did not have, kept across its messages;
    `placement_topic`: the physical topic whose rules the record must follow, when it is not the one it is on: a
    record a scheduler shard forwarded, on `handoff`, follows its original topic's; `verifier`: the proofs of records of
    authenticated topics are checked, streams/auth.py)."""
    missed = {} if missed is None else missed
    value = msg.value
    try:
        try:
            type_, data = registry.decode(value)
        except DecodeError as exc:
            fp = fingerprint_of(value)
            if exc.reason != UNKNOWN_FINGERPRINT or cfg is None or fp is None:
                raise
            if time.monotonic() - missed.get(fp, float("-inf")) < schemalog.RELOOKUP_S:
                raise
            await asyncio.get_running_loop().run_in_executor(None, lambda: schemalog.load(cfg, registry, only=fp))
            if registry.writer(fp) is None:
                missed[fp] = time.monotonic()
                raise
            type_, data = registry.decode(value)
        event = Event.from_record(type_, data, identity_of(verifier, catalogue, placement_topic or msg.topic, type_,
                                                           data, value))
        check_placement(catalogue, placement_topic or msg.topic, msg.key, event)
    except DecodeError as exc:
        await route_dead_letter(dead_letters, msg, exc.reason, exc.detail)
        return None
    ts = msg.timestamp
    record = Record(event, msg.topic, msg.partition, msg.offset, msg.key,
                    int(round(ts * 1000)) if ts is not None else 0)
    return record, event


# -- whole fetches, not faust's per-record delivery ------------------------------------------------------------------
class Batch(list):
    """A batch of ``FetchBatches``: its messages, and the ``generation`` of the assignment they were fetched under."""

    def __init__(self, messages: Iterable[Any], generation: int) -> None:
        super().__init__(messages)
        self.generation = generation


class FetchBatches:
    """The records of some topics as whole fetches: lists of faust ``Message``s, in fetch order, handed over by the
    consumer's fetch loop (``BatchingConsumer``) in one queue operation per fetch instead of faust's delivery to a
    stream, which costs several asyncio tasks and event-loop turns per record (``bench/faust_overhead.py``: ~90 µs a
    record for a trivial agent, against ~3 µs for aiokafka's ``getmany`` under it).

    The reader acks each message it is done with (``consumer.ack``: what faust's commits go by, as a stream's acks
    are). At most ``max_fetches`` fetches wait here: beyond, the fetch loop waits (faust's flow control still ends the
    wait at a rebalance, and the fetch is then dropped, as faust drops a record it was delivering: the consumer seeks
    to the committed offsets after the rebalance).

    **Rebalances.** Every fetch is tagged with the ``generation`` of the assignment it was fetched under (read before
    the fetch). A revocation (``revoke``, called by ``App`` as faust's revocation begins, before the partitions are
    handed to anyone else) starts a new generation and drops the fetches waiting; a fetch of an older generation that
    still comes (one the fetch loop was putting) is dropped by ``take``. A batch already handed out is the reader's
    to check: ``current(batch)`` is False once a revocation came after it was fetched, and then nothing may be decided
    of it (its partitions may be another worker's now) nor acked; faust seeks every partition it is assigned to its
    committed offset, so a partition kept reads those records again."""

    def __init__(self, topics: Iterable[str], max_fetches: int = 64) -> None:
        self.topics = frozenset(topics)
        self.generation = 0  # revocations so far
        self.dropped = 0  # records of fetches dropped at revocations (or as they came, of an older generation)
        self.queue: asyncio.Queue[Batch] = asyncio.Queue(maxsize=max_fetches)

    def revoke(self) -> int:
        """A rebalance revokes the assignment: a new generation, and the fetches waiting are dropped. Returns how many
        records were dropped."""
        self.generation += 1
        n = 0
        while True:
            try:
                n += len(self.queue.get_nowait())
            except asyncio.QueueEmpty:
                break
        self.dropped += n
        return n

    def current(self, batch: Batch) -> bool:
        """Whether no revocation came since ``batch`` was fetched (the reader may still decide and ack it)."""
        return batch.generation == self.generation

    async def _get(self, timeout: float | None = None) -> Batch:
        """The next fetch of the current generation (older ones are dropped)."""
        while True:
            fetch = await (self.queue.get() if timeout is None else asyncio.wait_for(self.queue.get(), timeout))
            if fetch.generation == self.generation:
                return fetch
            self.dropped += len(fetch)

    async def take(self, max_records: int, gap_s: float, max_wait_s: float) -> Batch:
        """The next batch: every fetch waiting, then what comes until no fetch came for ``gap_s`` (or the batch holds
        ``max_records``, or its first record waited ``max_wait_s``). An idle reader decides a lone record ``gap_s`` after it
        came, a busy one everything that queued while it was busy in one batch; faust's ``take_events(max, within)``
        waits a fixed window instead, which either makes every lone record wait or cuts a burst into many small
        batches (at 2 ms, ~15 records per batch of the scheduler in a 400-job burst, each batch some six produce
        requests of output and changelog). Only fetches of the current generation."""
        batch = await self._get()
        deadline = time.monotonic() + max_wait_s
        while len(batch) < max_records:
            try:
                fetch = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    fetch = await self._get(min(gap_s, left))
                except asyncio.TimeoutError:
                    break
            if fetch.generation != self.generation:
                self.dropped += len(fetch)
            elif batch.generation != self.generation:  # a revocation came while this batch waited: start anew
                self.dropped += len(batch)
                batch = fetch
            else:
                batch += fetch
        return batch


class BatchingConsumer(faust_kafka.Consumer):
    """faust's aiokafka consumer whose fetch loop hands the records of the topics of ``fetch_batches`` over as whole
    fetches (``FetchBatches``); every other topic's records (the tables' changelogs in a recovery, other agents'
    topics) go through faust's delivery as before.

    ``_drain_messages`` is faust-streaming 0.15.3's (pinned), with the records of batched topics set aside per fetch
    (their read offsets and gaps kept as faust keeps them) and put on their queue once the fetch is gone through."""

    fetch_batches: "FetchBatches | None" = None

    async def _drain_messages(self, fetcher: Any) -> None:  # noqa: C901  # pragma: no cover - faust's fetch loop
        batches = self.fetch_batches or getattr(self.app, "fetch_batches", None)
        if batches is None:
            await super()._drain_messages(fetcher)
            return
        batched = batches.topics
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        set_flag = self.diag.set_flag
        unset_flag = self.diag.unset_flag
        commit_every = self._commit_every
        acks_enabled_for = self.app.topics.acks_enabled_for
        queue = batches.queue
        yield_every = 100
        num_since_yield = 0
        sleep = asyncio.sleep
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag(CONSUMER_FETCHING)
                generation = batches.generation  # read before the fetch: a revocation after it makes the fetch stale
                ait = getmany(timeout=1.0)
                await self.sleep(0)
                if not self.should_stop:
                    held: list = []
                    async for tp, message in ait:
                        num_since_yield += 1
                        if num_since_yield > yield_every:
                            await sleep(0)
                            num_since_yield = 0
                        offset = message.offset
                        r_offset = get_read_offset(tp)
                        if r_offset is None or offset >= r_offset:
                            gap = offset - (r_offset or 0)
                            if gap > 1 and r_offset and acks_enabled_for(message.topic):
                                await self._add_gap(tp, r_offset + 1, offset)
                            if message.topic in batched:
                                held.append(message)
                            else:
                                if commit_every is not None and self._n_acked >= commit_every:
                                    self._n_acked = 0
                                    await self.commit()
                                await self.wait_first(callback(message), self.suspend_flow.wait())
                            set_read_offset(tp, offset)
                    if held:
                        if commit_every is not None and self._n_acked >= commit_every:
                            self._n_acked = 0
                            await self.commit()
                        fetch = Batch(held, generation)
                        if not queue.full():
                            queue.put_nowait(fetch)
                        else:
                            await self.wait_first(queue.put(fetch), self.suspend_flow.wait())
                    unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            unset_flag(CONSUMER_FETCHING)


def header_of(msg: Any, name: str) -> bytes | None:
    """The value of record header ``name`` of a faust message (None if absent): read without decoding."""
    return header(getattr(msg, "headers", None), name)


async def route_dead_letter(dead_letters: DeadLetters, message: Any, reason: str, detail: str) -> None:
    """Route a faust `Message` (or anything with topic/partition/offset/key/value) to `deadletter` and
    wait for the broker's ack. Runs in a thread: the first dead letter of a producer also publishes its
    schema and flushes synchronously, and waiting for the ack must not stall the event loop that every
    agent of the worker (and faust's producer) shares."""

    def route() -> None:
        dead_letters.route(topic=message.topic, partition=message.partition, offset=message.offset,
                           key=message.key, value=message.value, reason=reason, detail=detail)
        dead_letters.producer.flush(DEAD_LETTER_FLUSH_S)

    await asyncio.get_running_loop().run_in_executor(None, route)




# -- whether the tables may be read ---------------------------------------------------------------------------------

def tables_ready(app: Any) -> bool:
    """Whether ``app``'s tables hold every partition it actively owns whole: no rebalance under way and faust's
    recovery of the active partitions' changelogs done. Read it before deciding on the tables, and again after
    every ``await`` that a rebalance may have come through.

    How faust (faust-streaming 0.15.3, pinned) says so: a rebalance starts with ``App.on_rebalance_start`` (called
    by the consumer's rebalance listener as the partitions are revoked, before any of the new assignment's work),
    which sets ``app.rebalancing`` and clears ``app.tables.actives_ready``; the recovery that follows the
    assignment (``tables/recovery.py``) reads the changelogs of the active partitions into the tables, one table's
    topic after another, then sets ``actives_ready`` (``on_actives_ready``) and clears ``rebalancing``
    (``on_rebalance_end``). In between the tables are a mix: a job's header may be back before the chunk it names
    (the 2026-11-27 crash: ``MissingChunk`` in the scheduler's retry timer). ``app.in_recovery`` is not enough: it
    is set only once the recovery starts reading (after ``stream_recovery_delay``), not from the rebalance's start;
    ``Recovery.completed`` is set once and never cleared. Timers start only after the first recovery
    (``App.on_started``), but keep running through later ones; agents get no records of a partition while it is
    paused for its recovery, but a batch in hand is not taken back. And the process not suspect of a freeze
    (``App.freeze_watch``, streams/freeze.py): one woken from a SIGSTOP longer than its session may own nothing
    of what it is about to decide, and its consumer does not know it yet."""
    watch = getattr(app, "freeze_watch", None)  # a process frozen past its heartbeats may own nothing any more
    return bool(app.tables.actives_ready) and not app.rebalancing and not (watch is not None and watch.suspect())


def frozen_since(app: Any, since: float) -> bool:
    """Whether ``app``'s process was frozen since ``since`` (monotonic; ``App.freeze_watch``): a decision begun then
    writes nothing more."""
    watch = getattr(app, "freeze_watch", None)
    return watch is not None and watch.frozen_since(since)


# -- partitions faust stopped fetching ---------------------------------------------------------------------------
UNFETCHED_AFTER_S = 30.0  # a partition out of the fetch this long, without a pause of ours: taken back (FlowWatch)


class FlowWatch:
    """Partitions faust's consumer left out of its fetch for ``UNFETCHED_AFTER_S``, and taking them back.

    Faust (0.15.3, pinned) takes a partition out of what it asks aiokafka for when a stream's buffer is under
    pressure (``Consumer.on_buffer_full``) and puts it back when the buffer drains (``on_buffer_drop``, a callback
    the buffer queue runs when read below its low mark). aiokafka then keeps that partition's last fetched records
    and fetches nothing more for it until asked. If the callback never runs, the partition is never read again
    while its high watermark moves on. That fits what a shard of a 1,000,000-machine region showed when it read a
    machine failure 173 s late after the registration backlog (2026-11-26, aiokafka "Stream stopped processing ...
    TP(machines/3)": high watermark past the position while fetches go on); the path where the callback does not
    run was not found, and the stall did not recur, so this is a guard and a witness, not a proven fix. The
    scheduler's stall timer calls ``check``: a partition out of the fetch this long (no buffer stays under pressure
    for 30 s while its stream is reading) is logged with faust's view of it and given back with faust's own
    ``on_buffer_drop``. ``seen`` is when each partition was first found out (monotonic)."""

    def __init__(self, after_s: float = UNFETCHED_AFTER_S) -> None:
        self.after_s = after_s
        self.seen: dict[Any, float] = {}

    def check(self, consumer: Any, assigned: Any, now: float) -> list[tuple[Any, str]]:
        """The partitions of ``assigned`` (faust TPs) out of ``consumer``'s fetch for ``after_s`` or more, each
        given back, with what faust said of it; ``[]`` if none (or if this faust keeps no such sets)."""
        active = getattr(consumer, "_active_partitions", None)
        if active is None or not consumer.flow_active:  # not built yet, or a rebalance under way: faust's own time
            self.seen.clear()
            return []
        paused = getattr(consumer, "_paused_partitions", set())  # recovery's pauses: faust resumes those itself
        buffered = getattr(consumer, "_buffered_partitions", set())
        out = [tp for tp in assigned if tp not in active and tp not in paused]
        self.seen = {tp: self.seen.get(tp, now) for tp in out}
        taken: list[tuple[Any, str]] = []
        for tp in out:
            if now - self.seen[tp] < self.after_s:
                continue
            why = "buffer full, never drained" if tp in buffered else "left out of the fetch"
            if tp in buffered:
                consumer.on_buffer_drop(tp)
            else:
                active.add(tp)
            del self.seen[tp]
            taken.append((tp, why))
        return taken

    @staticmethod
    def describe(consumer: Any, tp: Any) -> str:
        """What faust and aiokafka say of ``tp`` (a line for a log: a partition behind its high watermark)."""
        active = getattr(consumer, "_active_partitions", None) or set()
        said = ["in the fetch" if tp in active else "out of the fetch"]
        if tp in getattr(consumer, "_buffered_partitions", ()):
            said.append("its buffer full")
        if tp in getattr(consumer, "_paused_partitions", ()):
            said.append("paused")
        if not getattr(consumer, "flow_active", True):
            said.append("flow stopped")
        try:  # aiokafka's fetcher (faust's consumer thread owns it; read only)
            records = consumer._thread._consumer._fetcher._records
            said.append("aiokafka holds fetched records for it" if any(
                (k.topic, k.partition) == (tp.topic, tp.partition) for k in list(records)) else "aiokafka holds none")
        except Exception:  # noqa: BLE001 - another faust/aiokafka, or not started: say less
            pass
        return ", ".join(said)


__all__ = ["make_app", "app_settings", "source_topic", "decoded", "decode_message", "header_of", "route_dead_letter",
           "tables_ready", "frozen_since", "FlowWatch", "FetchBatches", "Batch", "BatchingConsumer"]
