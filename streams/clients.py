"""Producer and consumer wrappers over confluent-kafka that speak Ropewalk events.

* `EventProducer`: idempotent, `acks=all`, murmur2 partitioner (co-partitioned with faust/aiokafka and
  Java clients); publishes each writer schema to `_schemas` before the first event that uses it; delivery
  errors are collected and raised by `flush()` (and by the next `send`), never swallowed. Every event it
  sends carries the record headers `producer` = its name (`PRODUCER_HEADER`) and `type` = the event type
  (`TYPE_HEADER`), readable without decoding.
* Identities (streams/auth.py): on the topics agents may write (`auth.AUTHENTICATED`), an `EventProducer` seals
  every record with its signer (by default its principal's, `infra.trust.signer_for`; agents give theirs) and an
  `EventConsumer` checks every record's proof with its verifier (`infra.trust.verifier_for`): one that does not
  verify is refused like a record that does not decode (dead-lettered with the reason), and the events it hands out
  carry the identity it proved (`Event.identity`). A region without keys seals and checks nothing.
* `EventConsumer`: decodes every record with the reader's schemas; a record that fails to decode or
  validate is skipped and counted by reason (`skipped`, a `streams.deadletter.Skipped`, which a command may
  share among its consumers to report once), routed to `deadletter` with its reason and origin when the
  consumer has `dead_letters` (a processor), and the consumer goes on with the next. No reader stops on one.
  Given `types`, a record whose `type` header names another type is passed over undecoded (`passed_over`):
  a reader pays nothing for the events it has no use for (records without the header are decoded).
"""
from __future__ import annotations

import re

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from infra.acls import position_group, reader_group
from infra.config import Config
from infra.trust import signer_for, verifier_for
from streams import auth
from streams import deadletter as dl
from streams import schemalog
from streams.events import Event
from streams.retry import watermark_offsets
from streams.skim import Skimmer
from streams.serde import INVALID_EVENT, UNKNOWN_FINGERPRINT, DecodeError, SchemaRegistry, fingerprint_of
from streams.topics import BY_NAME, CATALOGUE, KEY_ENTITLEMENT, KEY_JOB, KEY_MACHINE, Topics


# The topics an EventProducer's ``route`` places: co-partitioned and keyed by entitlement (the scheduler's shards).
ROUTED = frozenset(t.name for t in CATALOGUE if t.copartitioned and t.key == KEY_ENTITLEMENT and t.name != "handoff")
# Record headers of a record a scheduler shard forwarded to an entitlement's new partition (on `handoff`): where the
# original is ("<logical topic>/<partition>@<offset>") and the entitlement's move count when it was forwarded.
_FROM_CONFIG: Any = object()  # the default signer / verifier: the one of the client's principal (infra/trust.py)
FORWARDED_HEADER = "forwarded_from"
EPOCH_HEADER = "epoch"
PRODUCER_HEADER = "producer"  # record header: the EventProducer's name (the envelope's producer, usually)
TYPE_HEADER = "type"  # record header: the event type (the schema's name), so readers can pass over what they ignore


def header(headers, name: str) -> bytes | None:
    """The value of record header ``name`` in a client's headers (a list of (key, value) pairs, a mapping, or
    None); None if absent."""
    if not headers:
        return None
    if isinstance(headers, Mapping):
        return headers.get(name)
    for k, v in headers:
        if k == name:
            return v
    return None


def passes_type(headers, types: "frozenset[str] | None") -> bool:
    """Whether a record may be of one of ``types`` (None: any), by its ``type`` header alone: True without one."""
    if types is None:
        return True
    t = header(headers, TYPE_HEADER)
    return t is None or t.decode("utf-8", "replace") in types


class DeliveryError(RuntimeError):
    """One or more records were not acknowledged by the broker."""


@dataclass(frozen=True)
class Record:
    """A decoded event and where it sits in the log."""

    event: Event
    topic: str  # physical topic name
    partition: int
    offset: int
    key: bytes | None
    log_timestamp_ms: int


def client_id(name: str) -> str:
    """The Kafka client id of a Ropewalk client named ``name`` (its producer header, e.g. ``agent/simulated``): what
    the broker's request log and metrics show of who sent what. Kafka allows letters, digits, ``._-``."""
    return "ropewalk-" + re.sub(r"[^A-Za-z0-9._-]", "-", name)


def producer_conf(cfg: Config, **extra) -> dict:
    conf = {
        **cfg.kafka_conf(),
        "enable.idempotence": True,
        "acks": "all",
        "partitioner": "murmur2_random",  # the Java/aiokafka default: keeps topics co-partitioned
        "linger.ms": 5,
        "batch.num.messages": 10000,
        "queue.buffering.max.messages": 500000,
        "log_level": cfg.kafka_log_level,
    }
    conf.update(extra)
    return conf


def key_of(topic_logical: str, event: Event) -> str:
    kind = BY_NAME[topic_logical].key
    if kind == KEY_ENTITLEMENT:
        return event.entitlement
    if kind == KEY_MACHINE:
        return event.payload["machine_id"]
    if kind == KEY_JOB:
        return event.payload["job_id"]
    return event.entity_id


class EventProducer:
    """Produces Ropewalk events (see the module docstring). ``route``: where an entitlement's records go on the
    co-partitioned entitlement-keyed topics (``streams/partitionmap.MapFollower``, or any entitlement -> partition
    callable); None: the key's hash partition (a record sent to the wrong partition is forwarded by the scheduler
    shard that finds it there, so a producer without the map is slower across a move, never wrong)."""

    def __init__(self, cfg: Config, registry: SchemaRegistry, name: str, *,
                 route: "Callable[[str], int] | None" = None, owns_route: bool = False,
                 signer: "auth.Signer | None" = _FROM_CONFIG, **conf):
        """``owns_route``: ``route`` is this producer's own (``partitionmap.routed_producer``'s follower), closed with
        it. ``signer``: what seals the records on the authenticated topics (default: the principal's; None: none)."""
        self.cfg = cfg
        if signer is _FROM_CONFIG:
            signer = signer_for(cfg)
        self.signer = signer
        self.route = route
        self._owned_route = route if owns_route else None
        self.registry = registry
        self.topics = Topics(cfg.topic_prefix, cfg.partitions)
        self.name = name
        self._producer = Producer(producer_conf(cfg, **{"client.id": client_id(name), **conf}))
        self._schemas_published: set[bytes] = set()
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self.sent = 0
        # Every event this producer encodes carries who produced it as a record header (PRODUCER_HEADER), so a
        # reader can pass over records by producer without decoding them (the scheduler skips its own echoes).
        self._headers: dict[str, list[tuple[str, bytes]]] = {}  # event type -> the headers of its records

    def headers_for(self, event_type: str) -> list[tuple[str, bytes]]:
        """The record headers of an event of ``event_type``: who produced it and what it is."""
        h = self._headers.get(event_type)
        if h is None:
            h = self._headers[event_type] = [(PRODUCER_HEADER, self.name.encode()), (TYPE_HEADER, event_type.encode())]
        return h

    # -- events ----------------------------------------------------------------------------------
    def prepare(self, *event_types: str, timeout_s: float = 10.0) -> None:
        """Publish these events' schemas now and wait for the broker (which also connects the producer and
        learns the metadata), so the first ``send`` of each costs what any later one does."""
        for event_type in event_types:
            self._publish_schema(self.registry.reader(event_type))
        self._flush_or_raise(timeout_s)

    def _publish_schema(self, schema) -> bool:
        if schema.fingerprint in self._schemas_published:
            return False
        schemalog.publish(self._producer, self.topics, schema)
        self._schemas_published.add(schema.fingerprint)
        return True

    def send(self, event: Event, *, topic: str | None = None, validate: bool = True,
             log_timestamp_ms: int | None = None, partition: int | None = None) -> None:
        """Encode and produce asynchronously to the event's topic, keyed per the catalogue (to ``partition`` if
        given, else where ``route`` or the key's hash says). The record's log timestamp is the time of sending
        unless ``log_timestamp_ms`` says otherwise (an import, a test)."""
        self._raise_errors()
        physical, key, value, headers, routed = self._encoded(event, topic, validate)
        partition = routed if partition is None else partition
        self.send_raw(physical, key, value, partition=partition, timestamp_ms=log_timestamp_ms, headers=headers)

    def send_all(self, events: Iterable[Event], *, validate: bool = True) -> None:
        """``send`` each, in order, but every event encoded before the first is produced: the records reach
        librdkafka within a moment, so its batches are not sent piecemeal while later events are still being
        encoded (a scheduler batch's JobStatePublished records went out ~one produce request each when the
        5 ms linger expired in the middle of encoding them)."""
        self._raise_errors()
        for topic, key, value, headers, partition in [self._encoded(e, None, validate) for e in events]:
            self.send_raw(topic, key, value, partition=partition, headers=headers)

    def _encoded(self, event: Event, topic: str | None, validate: bool
                 ) -> tuple[str, bytes, bytes, list, int | None]:
        """(physical topic, key, value, headers, partition) of an event (partition None: the key's hash partition);
        its schema published first if it was not yet."""
        logical = topic or self.topics.logical(self.topics.for_event(event.type))
        schema = self.registry.reader(event.type)
        if self._publish_schema(schema):
            self._flush_or_raise(10.0)  # the schema is on the log before any record that uses it
        if self.signer is not None and logical in auth.SEALED:
            value = self.signer.seal(self.registry, event.type, event.to_record(schema.version), validate)
        else:
            value = self.registry.encode(event.type, event.to_record(schema.version), validate=validate)
        key = key_of(logical, event)
        partition = None
        if self.route is not None and logical in ROUTED:
            partition = self.route(key)
        return self.topics.name(logical), key.encode(), value, self.headers_for(event.type), partition

    def send_raw(self, topic: str, key: bytes | None, value: bytes | None, *, partition: int | None = None,
                 timestamp_ms: int | None = None, headers: list | None = None) -> None:
        kwargs = {"key": key, "value": value, "on_delivery": self._on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        if timestamp_ms is not None:
            kwargs["timestamp"] = timestamp_ms
        if headers:
            kwargs["headers"] = headers
        while True:
            try:
                self._producer.produce(topic, **kwargs)
                break
            except BufferError:  # local queue full: let deliveries drain
                self._producer.poll(0.1)
        self.sent += 1
        if self.sent % 1000 == 0:
            self._producer.poll(0)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Serve delivery reports (a failed one is raised by the next ``send`` or ``flush``) without waiting for
        the records in flight, as ``flush`` does."""
        self._producer.poll(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> None:
        self._flush_or_raise(timeout_s)

    def delivered(self, timeout_s: float) -> bool:
        """Whether every record sent so far is on the log, waiting ``timeout_s`` at most: what a process writes
        down as done (a state file) only once what it told of it is delivered. A failed delivery is raised."""
        remaining = self._producer.flush(timeout_s)
        self._raise_errors()
        return remaining == 0

    def _flush_or_raise(self, timeout_s: float) -> None:
        remaining = self._producer.flush(timeout_s)
        if remaining:
            with self._lock:
                self._errors.append(f"{remaining} records still undelivered after {timeout_s:.0f}s")
        self._raise_errors()

    def _on_delivery(self, err, msg) -> None:
        if err is not None:
            with self._lock:
                self._errors.append(f"{msg.topic()}: {err.str()}")

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
            raise DeliveryError(f"{len(errors)} records not delivered: {'; '.join(errors[:3])}{more}")

    def close(self) -> None:
        self.flush()
        self.stop_following()

    def stop_following(self) -> None:
        """Close the route this producer owns (a map follower), if any; it routes by hash from then on."""
        owned, self._owned_route = self._owned_route, None
        if owned is not None:
            self.route = None
            owned.close()


def consumer_conf(cfg: Config, group_id: str | None, **extra) -> dict:
    conf = {
        **cfg.kafka_conf(),
        "group.id": group_id or reader_group(cfg),  # required by librdkafka even when assigning
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": True,
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 1000,
        "fetch.wait.max.ms": 100,
        "log_level": cfg.kafka_log_level,
    }
    conf.update(extra)
    return conf


# A reader that follows the log without anybody waiting on it record by record (the health check's heartbeats,
# the Resource Broker's fold of machines): its fetches wait to fill. A fetch of a consumer with the defaults above
# returns as soon as one record arrives, so a reader of busy topics fetched once per produce request of every
# writer (~3 fetch requests per job in a burst, the broker's second largest cost).
BACKGROUND_READER = {"fetch.wait.max.ms": 500, "fetch.min.bytes": 64 * 1024}
POSITION_COMMIT_S = 1.0  # how often a follower reports its position to its group (EventConsumer)
# At most this many bytes of record values handed out by one poll (at least one record): a poll's records are decoded
# at once, and a record may hold a thousand machines (a MachinesRegistered: ~52 KB, ~1 MB decoded), so a poll of
# 10,000 records of them would be a million machines in memory at once (the Resource Broker's peak RSS went from
# 0.4 to 1.5 GB at a million machines). 10,000 heartbeats are ~2 MiB.
POLL_BYTES = 2 * 1024 * 1024


class OffsetQueries:
    """A client of its own, never assigned, for ListOffsets (the watermarks of partitions): made at the first
    question, closed by ``close``; safe to ask from several threads. A broker answers one connection's requests in
    order, and an assigned consumer always has a fetch in flight that waits up to ``fetch.wait.max.ms``: on it, each
    ListOffsets waited for a fetch (100 ms: 4 s for a worker's catch-up over 40 partitions, 20 s for a background
    reader's 500 ms fetches, 2026-11-28); on this one it takes a millisecond. And librdkafka's consumer blocks one
    call while another thread consumes with it. The one place EventConsumer and the partition map ask."""

    def __init__(self, cfg: Config, name: str):
        self.cfg, self.name = cfg, name
        self._client: Consumer | None = None
        self._lock = threading.Lock()

    def watermarks(self, topic: str, partition: int, timeout_s: float = 10.0) -> tuple[int, int]:
        """(low, high) of ``topic``'s ``partition`` as the broker lists them now (``retry.watermark_offsets``)."""
        with self._lock:
            if self._client is None:
                self._client = Consumer(consumer_conf(self.cfg, None, **{"client.id": client_id(self.name)}))
            return watermark_offsets(self._client, TopicPartition(topic, partition), timeout_s)

    def high_watermark(self, topic: str, partition: int, timeout_s: float = 10.0) -> int:
        return self.watermarks(topic, partition, timeout_s)[1]

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


class EventConsumer:
    """Reads topics and yields decoded `Record`s; a bad record is skipped, counted in `skipped` and, with
    `dead_letters`, routed to the dead-letter topic.

    With `group_id` it joins the consumer group (partitions are shared among members); without, it
    assigns every partition of `topics` itself, starting at `start_offsets` or the beginning. A record without a
    value on a compacted topic (a tombstone: a key deleted) is no event and no bad record: it is counted in
    `tombstones` and told to `on_tombstone(topic, key)`; on any other topic it is a bad record.

    `follows`: this consumer follows the log for a worker (a processor's reader, not a one-shot read such as an API
    request's). Then, and only then, it exports ``ropewalk_consumer_lag_seconds`` (infra/metrics.py), and an
    assigning reader reports its position where Kafka's own tools see it: the offsets of the records its previous
    poll handed out (the worker has handled them when it polls again) are committed, at most every
    ``POSITION_COMMIT_S``, to the group ``<prefix>ropewalk-position-<name>`` (``infra.acls.position_group``), which
    no member ever joins: ``kafka-consumer-groups --describe`` shows its lag, so does Burrow or kafka-lag-exporter.
    The worker does not start from those offsets (it folds the log from where its own state says); they are a
    report.
    """

    def __init__(self, cfg: Config, registry: SchemaRegistry, topics: Iterable[str], *, name: str,
                 group_id: str | None = None, dead_letters: "dl.DeadLetters | None" = None,
                 skipped: "dl.Skipped | None" = None,
                 start_offsets: Mapping[tuple[str, int], int] | None = None,
                 types: Iterable[str] | None = None, follows: bool = False, verify: bool = True,
                 verifier: "auth.Verifier | None" = _FROM_CONFIG, keep_refused: bool = False,
                 on_tombstone: "Callable[[str, bytes | None], None] | None" = None, **conf):
        """``verify``: check the proofs of the records of authenticated topics with ``verifier`` (default: the
        principal's); ``keep_refused``: keep the events refused for their proof in ``refused`` instead of
        dead-lettering them (an agent answers and dead-letters those addressed to its machines: gate.Judge)."""
        self.cfg = cfg
        if not verify:
            verifier = None
        elif verifier is _FROM_CONFIG:
            verifier = verifier_for(cfg, registry)
        self.verifier = verifier
        self.keep_refused = keep_refused
        # (event, reason, detail, where) refused for their proof, not dead-lettered (``keep_refused``): ``where`` is what
        # ``DeadLetters.route`` takes besides the reason and detail
        self.refused: list[tuple[Event, str, str, dict]] = []
        self.registry = registry
        self.catalogue = Topics(cfg.topic_prefix, cfg.partitions)
        self.name = name
        self.group_id = group_id
        self.physical_topics = list(topics)
        self.dead_letters = dead_letters
        self.skipped = skipped if skipped is not None else dl.Skipped()  # maybe shared with other readers
        self.follows = follows
        # an assigning follower's positions go to a group of its own (never joined); any other reader's group id
        # is only what librdkafka needs to run
        self.position_group = position_group(cfg, name) if follows and not group_id else None
        self._handed: dict[tuple[str, int], int] = {}  # the next offset per partition after the last poll's records
        self._at_end: dict[tuple[str, int], int] = {}  # partitions read to their end: the end offset then
        self._committed_at = 0.0
        self._offsets = OffsetQueries(cfg, f"{name}-offsets")  # ListOffsets, not on the assigned consumer
        self._consumer = Consumer(consumer_conf(cfg, group_id or self.position_group,
                                                **{"client.id": client_id(name), **conf}))
        self.eof: set[tuple[str, int]] = set()
        self.eof_offsets: dict[tuple[str, int], int] = {}  # per partition, the offset of its last end reached
        self.dead_lettered = 0  # records this consumer skipped (and dead-lettered, with dead_letters)
        self._missed: dict[bytes, float] = {}  # fingerprint -> when _schemas last did not have it
        self.types = None if types is None else frozenset(types)  # None: every type is decoded
        self.passed_over = 0  # records whose type header named a type not in ``types`` (not decoded)
        self.tombstones = 0  # records without a value: a key deleted from a compacted topic (not an event)
        self.on_tombstone = on_tombstone  # told (physical topic, key) of each
        self.last_offsets: dict[tuple[str, int], int] = {}  # per partition, the last offset read (any record)
        self._held: list = []  # what the client gave past a poll's POLL_BYTES, in its order: the next poll's first
        if group_id:
            self._consumer.subscribe(self.physical_topics)
        else:
            self.assign(start_offsets or {})

    def partitions(self) -> list[tuple[str, int]]:
        md = self._consumer.list_topics(timeout=10)
        out = []
        for t in self.physical_topics:
            tmd = md.topics.get(t)
            if tmd is None or tmd.error is not None:
                raise RuntimeError(f"topic {t} does not exist; run `ropewalk up` (it provisions topics)")
            out.extend((t, p) for p in sorted(tmd.partitions))
        return out

    def assign(self, start_offsets: Mapping[tuple[str, int], int],
               only: Iterable[tuple[str, int]] | None = None) -> None:
        """Assign `only` these partitions (default: all of `partitions()`), from `start_offsets` or the start."""
        chosen = self.partitions() if only is None else list(only)
        self._held = []  # read under the assignment this one replaces
        self._consumer.assign([TopicPartition(t, p, start_offsets.get((t, p), OFFSET_BEGINNING)) for t, p in chosen])

    def pause(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Stop fetching these partitions (e.g. a bounded read that reached its end)."""
        self._consumer.pause([TopicPartition(t, p) for t, p in partitions])

    def resume(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Fetch these paused partitions again (e.g. a merged read whose slower partitions caught up)."""
        self._consumer.resume([TopicPartition(t, p) for t, p in partitions])

    def fetched_high_watermark(self, tp: tuple[str, int]) -> int | None:
        """The high watermark reported by the latest fetch response of `tp` (None before the first one)."""
        _, high = self._consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
        return high if high >= 0 else None  # librdkafka answers OFFSET_INVALID (-1001) before a fetch

    def high_watermarks(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The broker's high watermark of each partition now (ListOffsets)."""
        return {(t, p): self._offsets.high_watermark(t, p) for t, p in partitions}

    def read_up_to(self, targets: Mapping[tuple[str, int], int], start: Mapping[tuple[str, int], int]) -> bool:
        """Whether this consumer has read every partition of ``targets`` up to (below) its offset: its last record
        read (any record, also one passed over) is at ``offset - 1`` or later, or it started there (``start``)."""
        return all(max(self.last_offsets.get(tp, -1) + 1, start.get(tp, 0)) >= off for tp, off in targets.items())

    def watermarks(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(low, high) per partition as the broker lists them (ListOffsets)."""
        return {(t, p): self._offsets.watermarks(t, p) for t, p in self.partitions()}

    def poll(self, max_records: int = 1000, timeout_s: float = 1.0, *, linger_s: float | None = None) -> list[Record]:
        """Up to ``max_records`` decoded records. ``linger_s`` None: wait until ``max_records`` are there or
        ``timeout_s`` passed (few large batches: a bulk read). Else wait ``timeout_s`` for the first record only,
        then ``linger_s`` at most for the rest (a follower: a lone record is handed over at once, not after the
        timeout)."""
        out: list[Record] = []
        for msg in self.poll_raw(max_records, timeout_s, linger_s=linger_s):
            rec = self.decode(msg)
            if rec is not None:
                out.append(rec)
        self.observe_lag(out)
        return out

    def observe_lag(self, records: list) -> None:
        """A follower's ``ropewalk_consumer_lag_seconds`` from one poll's records (anything with ``topic`` and
        ``log_timestamp_ms``): ``poll`` calls it; a reader of ``poll_raw`` calls it with what it read."""
        if self.follows:
            from infra.metrics import observe_lag  # noqa: PLC0415 - start-up: prometheus_client ~20 ms; followers

            # the consumer group, or for an assigned reader its name's kind (``agent/<machine>`` → ``agent``): never
            # an id
            observe_lag(self.group_id or self.name.split("/", 1)[0], records, self.cfg.topic_prefix)

    def poll_raw(self, max_records: int = 1000, timeout_s: float = 1.0, *, linger_s: float | None = None) -> list:
        """``poll`` without decoding: the records as the broker gave them (end-of-partition and the positions
        accounted for); ``decode`` each when it is needed (a reader that may stop before it needs them all)."""
        if self.position_group is not None:
            self.report_position()
        if self._held:
            msgs, self._held = self._held[:max_records], self._held[max_records:]
        elif linger_s is None or max_records <= 1:
            msgs = self._consumer.consume(max_records, timeout_s)
        else:
            msgs = self._consumer.consume(1, timeout_s)
            if msgs:
                msgs += self._consumer.consume(max_records - 1, linger_s)
        size = 0
        for i, msg in enumerate(msgs):  # hand out POLL_BYTES of values at most: the rest, in order, next time
            size += len(msg.value() or b"")
            if size > POLL_BYTES and i:
                self._held[:0] = msgs[i:]
                msgs = msgs[:i]
                break
        out = []
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    self.eof.add((msg.topic(), msg.partition()))
                    self._at_end[(msg.topic(), msg.partition())] = msg.offset()  # the next offset: the end
                    self.eof_offsets[(msg.topic(), msg.partition())] = msg.offset()
                    continue
                raise RuntimeError(f"consumer {self.name}: {err.str()}")
            self.eof.discard((msg.topic(), msg.partition()))
            self.last_offsets[(msg.topic(), msg.partition())] = msg.offset()
            out.append(msg)
        return out

    def report_position(self, force: bool = False) -> None:
        """Commit (asynchronously) the positions after the records the previous poll handed out to the follower's
        position group (the class's docstring), at most every POSITION_COMMIT_S unless ``force``; then remember
        where this poll starts. A commit the broker refuses is logged by librdkafka and tried again next time."""
        now = time.monotonic()
        if self._handed and (force or now - self._committed_at >= POSITION_COMMIT_S):
            try:
                self._consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in self._handed.items()],
                                      asynchronous=True)
                self._committed_at = now
                self._handed = {}
            except KafkaException:  # e.g. the coordinator moving: the next poll commits again
                pass
        self._handed.update(self._at_end)  # a partition read to its end (maybe empty, never a record read)
        self._handed.update({tp: off + 1 for tp, off in self.last_offsets.items() if tp not in self._at_end})
        self._at_end = {}

    def decode(self, msg) -> Record | None:
        """One record of ``poll_raw`` decoded; None if its type is not wanted or it cannot be decoded (counted in
        ``skipped``, dead-lettered with ``dead_letters``)."""
        return self._decode(msg)

    def _decode(self, msg) -> Record | None:
        if msg.value() is None and self.catalogue.compacted(msg.topic()):  # a tombstone (state.jobs of a job gone:
            # decide.collect), no bad record; a record without a value on any other topic is one (decoded below)
            self.tombstones += 1
            if self.on_tombstone is not None:
                self.on_tombstone(msg.topic(), msg.key())
            return None
        if self.types is not None and not passes_type(msg.headers(), self.types):
            self.passed_over += 1
            return None
        value = msg.value()
        data = None
        try:
            try:
                type_, data = self.registry.decode(value)
            except DecodeError as exc:
                fp = fingerprint_of(value)
                if (exc.reason != UNKNOWN_FINGERPRINT or fp is None
                        or time.monotonic() - self._missed.get(fp, float("-inf")) < schemalog.RELOOKUP_S):
                    raise
                # A writer newer (or older) than this code: learn its schema from the log, then retry.
                schemalog.load(self.cfg, self.registry, only=fp)
                if self.registry.writer(fp) is None:
                    self._missed[fp] = time.monotonic()
                    raise
                type_, data = self.registry.decode(value)
            if self.types is not None and type_ not in self.types and belongs(self.catalogue, msg.topic(), type_):
                self.passed_over += 1  # a record without its type header, of a type this reader does not want
                return None
            event = proven_event(self.verifier, self.catalogue, msg.topic(), msg.key(), type_, data, value)
        except DecodeError as exc:
            if self.keep_refused and isinstance(exc, auth.AuthError) and data is not None:
                # the caller answers (and dead-letters) the ones that concern it: one forged record is not
                # dead-lettered by every agent of the region
                self._dead_letter(msg, exc.reason, exc.detail, route=False)
                self.refused.append((Event.from_record(type_, data), exc.reason, exc.detail, self._where(msg)))
            else:
                self._dead_letter(msg, exc.reason, exc.detail)
            return None
        ts_type, ts = msg.timestamp()
        return Record(event, msg.topic(), msg.partition(), msg.offset(), msg.key(), ts)

    @staticmethod
    def _where(msg) -> dict:
        return {"topic": msg.topic(), "partition": msg.partition(), "offset": msg.offset(), "key": msg.key(),
                "value": msg.value()}

    def _dead_letter(self, msg, reason: str, detail: str, *, route: bool = True) -> None:
        self.dead_lettered += 1
        where = {**self._where(msg), "reason": reason, "detail": detail}
        self.skipped.route(**where)
        if route and self.dead_letters is not None:
            self.dead_letters.route(**where)

    def commit(self) -> None:
        self._consumer.commit(asynchronous=False)

    def close(self) -> None:
        if self.position_group is not None:
            self.report_position(force=True)
        self._consumer.close()
        self._offsets.close()


def belongs(catalogue: Topics, physical_topic: str, type_: str) -> bool:
    """Whether events of ``type_`` belong on the topic (one of the catalogue's: else nothing is said here)."""
    logical = catalogue.logical(physical_topic)
    return logical is None or logical == "_schemas" or type_ in BY_NAME[logical].events


def identity_of(verifier: "auth.Verifier | None", catalogue: Topics, physical_topic: str, type_: str,
                record: Mapping[str, Any], value: bytes) -> str | None:
    """Who wrote a record of an authenticated topic, proven by ``verifier`` (AuthError if not); None elsewhere, or
    without a verifier (a region without keys). An event that does not belong on the topic is refused for that first
    (INVALID_EVENT, as ``check_placement`` says)."""
    logical = catalogue.logical(physical_topic)
    if verifier is None or logical not in auth.AUTHENTICATED:
        return None
    if type_ not in BY_NAME[logical].events:
        raise DecodeError(INVALID_EVENT, f"{type_} does not belong on topic {logical}")
    return verifier.check(type_, record, value)


def proven_event(verifier: "auth.Verifier | None", catalogue: Topics, physical_topic: str, key: bytes | None,
                 type_: str, record: Mapping[str, Any], value: bytes) -> Event:
    """The event of a record decoded from ``value``, its writer proven (``identity_of``) and its placement checked
    (``check_placement``); DecodeError (AuthError) if refused."""
    identity = identity_of(verifier, catalogue, physical_topic, type_, record, value)
    event = Event.from_record(type_, record, identity)
    check_placement(catalogue, physical_topic, key, event)
    return event


def check_placement(catalogue: Topics, physical_topic: str, key: bytes | None, event: Event) -> None:
    """An event must be on its own topic, keyed as the catalogue says (sharding depends on it)."""
    check_placed(catalogue, physical_topic, key, event.type, lambda logical: key_of(logical, event))


def check_placed(catalogue: Topics, physical_topic: str, key: bytes | None, type_: str,
                 want: Callable[[str], str | None]) -> None:
    """``check_placement`` of a record of ``type_`` whose key, as its topic's key kind names it, is ``want(logical
    topic)`` (a decoded event's ``key_of``, or the field a skimmer read: ``KEY_FIELD``)."""
    logical = catalogue.logical(physical_topic)
    if logical is None or logical == "_schemas":
        return
    spec = BY_NAME[logical]
    if type_ not in spec.events:
        raise DecodeError(INVALID_EVENT, f"{type_} does not belong on topic {logical}")
    if spec.key in (KEY_ENTITLEMENT, KEY_MACHINE, KEY_JOB):
        wanted = want(logical)
        got = key.decode("utf-8", "replace") if key is not None else None
        if got != wanted:
            raise DecodeError(INVALID_EVENT, f"record key {got!r} differs from the event's {spec.key} {wanted!r}")


# The record field that ``key_of`` reads of a decoded event, per key kind a topic is checked on (``check_placed``).
KEY_FIELD: Mapping[str, str] = {KEY_ENTITLEMENT: "envelope.entitlement", KEY_MACHINE: "machine_id",
                                KEY_JOB: "job_id"}


class SkimReader:
    """Reads ``fields`` of records of ``event_type`` on ``topic`` (logical) without decoding them (``streams.skim``),
    each proven and placed as ``EventConsumer.decode`` proves and places a record: the same ``identity_of`` (the
    consumer's verifier) over the same bytes, with the fields it checks skimmed beside those asked
    (``auth.checked_fields``), and the record's key checked by the same ``check_placed``. ``read(msg)`` returns the
    values of ``fields`` in order, or None: the record is to be decoded the ordinary way, which refuses a bad one with
    its reason and dead-letters it (a skim never decides that a record is bad; it only declines to read it)."""

    def __init__(self, consumer: "EventConsumer", topic: str, event_type: str, fields: Iterable[str]):
        self.fields = tuple(fields)
        self.event_type = event_type
        self.verifier, self.catalogue = consumer.verifier, consumer.catalogue  # the consumer's: it decodes the rest
        spec = BY_NAME[topic]
        if event_type not in spec.events:
            raise ValueError(f"{event_type} does not belong on topic {topic}")
        checked = auth.checked_fields(event_type) if topic in auth.AUTHENTICATED else ()
        key_field = KEY_FIELD.get(spec.key)
        every = list(self.fields)
        for f in (*checked, *((key_field,) if key_field else ())):
            if f not in every:
                every.append(f)
        self.skimmer = Skimmer(consumer.registry, event_type, every)
        self._n = len(self.fields)
        self._checked = [every.index(f) for f in checked]
        self._key = every.index(key_field) if key_field else None
        self.declined = 0  # records handed back to the ordinary decode

    def read(self, msg) -> tuple | None:
        value = msg.value()
        v = self.skimmer(value)
        if v is not None:
            try:
                if self._checked:
                    identity_of(self.verifier, self.catalogue, msg.topic(), self.event_type,
                                auth.checked_record(self.event_type, [v[i] for i in self._checked]), value)
                key = self._key
                check_placed(self.catalogue, msg.topic(), msg.key(), self.event_type,
                             lambda logical: None if key is None else v[key])
                return v[:self._n]
            except DecodeError:
                pass
        self.declined += 1
        return None
