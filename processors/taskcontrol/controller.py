"""A library for writing a TaskController: one function ``decide(request, view) -> approved operation ids`` (or a
``protocol.Answer(approved, choices)``, with per-task MOVE / STOP / KEEP choices under advance notices).

    from processors.taskcontrol.controller import TaskControllerProcess
    TaskControllerProcess(cfg, "zk", LeaderLast({"e1.zk": "e1.zk/0"})).run()

The process reads the ``taskcontrol`` topic (every partition, from the beginning: no consumer group, so one
process per controller name) and answers each job's latest ``TaskControlRequested`` naming this controller with
a ``TaskControlAcked`` echoing its sequence. The bookkeeping is the library's, and rebuilt from the log on start:

* a request older than one already answered is never answered (redelivery, replay);
* of several unanswered requests of a job only the latest is answered (the older are superseded);
* the controller's own acks read back mark their requests answered and their operations in flight, and a later
  request's ``completed_operation_ids`` takes them out again, as does a later request listing them as pending
  (that ack went stale under a re-ask): ``view.in_flight`` is what this controller approved that the scheduler
  has not finished;
* nothing is answered before the log is read to its end (a restarted controller does not answer what it
  answered before it stopped);
* a record it cannot decode is dead-lettered with its reason (``deadletter``) and passed over: one bad record
  never stops a controller;
* ``decide`` may return any ids: only operations pending in the request are acked, in the request's order; only
  choices for tasks the request's notices name are sent (``protocol.valid_choices``).

The folding (``absorb``, ``due``, ``answer``) is pure; ``TaskControllerProcess`` is the thin Kafka wiring.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from infra import metrics
from infra.config import Config
from processors.taskcontrol import protocol as tc
from processors.taskcontrol.protocol import JobBook, Request, View
from streams.deadletter import DeadLetters
from streams.events import Event, derived_event_id, new_event
from streams.partitionmap import routed_producer
from streams.serde import SchemaRegistry
from streams.topics import Topics

log = logging.getLogger(__name__)

Decide = Callable[[Request, View], "tc.Answer | Iterable[str]"]


def producer_name(name: str) -> str:
    return f"taskcontroller/{name}"


@dataclass(frozen=True)
class Books:
    """A controller's knowledge of its jobs: per job the bookkeeping and the latest request seen."""

    jobs: Mapping[str, JobBook] = field(default_factory=lambda: MappingProxyType({}))
    latest: Mapping[str, Request] = field(default_factory=lambda: MappingProxyType({}))


def absorb(books: Books, event: Event, name: str) -> Books:
    """Fold one event of the ``taskcontrol`` topic in (others, and other controllers' traffic, change nothing)."""
    p = event.payload
    if event.type == "TaskControlRequested" and p.get("controller") == name:
        req = tc.request_of(p, event.entitlement, event.event_id)
        book = tc.observe(books.jobs.get(req.job_id, JobBook()), req)
        if again := {o.operation_id for o in req.pending} & set(book.in_flight):
            # asked again: the scheduler never took the approval (its ack went stale under a re-ask), so it is
            # not in flight; a replay, reading this request before that ack, never counts it either
            book = JobBook(book.answered, {k: v for k, v in book.in_flight.items() if k not in again})
        latest = books.latest.get(req.job_id)
        newest = req if latest is None or req.sequence > latest.sequence else latest
        return Books(MappingProxyType({**books.jobs, req.job_id: book}),
                     MappingProxyType({**books.latest, req.job_id: newest}))
    if event.type == "TaskControlAcked" and event.producer == producer_name(name):
        job = p["job_id"]
        book, req = books.jobs.get(job, JobBook()), books.latest.get(job)
        if req is not None and req.sequence == p["sequence"]:
            book = tc.record_ack(book, req, p["approved_operation_ids"])
        else:
            book = JobBook(max(book.answered, p["sequence"]), book.in_flight)
        return Books(MappingProxyType({**books.jobs, job: book}), books.latest)
    return books


def due(books: Books) -> list[Request]:
    """The requests to answer: each job's latest, if newer than what was answered."""
    return [r for job, r in sorted(books.latest.items()) if r.sequence > books.jobs.get(job, JobBook()).answered]


def answer(books: Books, request: Request, decide: Decide, name: str, now_ms: int) -> tuple[Books, Event]:
    """Ask ``decide``; the ack event (id derived from the request's) and the books with it recorded."""
    book = books.jobs.get(request.job_id, JobBook())
    result = tc.answer_of(decide(request, View(request.job_id, book.in_flight)))
    approved = tc.valid_approval(request, result.approved)
    choices = tc.valid_choices(request, result.choices)
    ack = new_event("TaskControlAcked", tc.ack_payload(request.job_id, request.sequence, approved, name, choices),
                    entitlement=request.entitlement, entity_id=request.job_id, producer=producer_name(name),
                    causation_id=request.event_id or None, timestamp_ms=now_ms,
                    event_id=derived_event_id(request.event_id, "TaskControlAcked", name))
    return absorb(books, ack, name), ack


class TaskControllerProcess:
    """A TaskController on the real log: consume ``taskcontrol``, ``decide``, produce acks."""

    def __init__(self, cfg: Config, name: str, decide: Decide, *, registry=None):
        from streams.clients import EventConsumer  # noqa: PLC0415 - start-up: confluent-kafka (~55 ms), process only

        self.name, self.decide = name, decide
        self.prefix = cfg.topic_prefix
        registry = registry or SchemaRegistry.from_dir()
        topic = Topics(cfg.topic_prefix, cfg.partitions).name("taskcontrol")
        self.producer = routed_producer(cfg, registry, producer_name(name))
        # a record it cannot decode is dead-lettered (its id derives from the record's place: reading the topic
        # again after a restart routes it again under the same id) and the controller goes on
        self.consumer = EventConsumer(cfg, registry, [topic], name=producer_name(name),
                                      dead_letters=DeadLetters(self.producer, producer_name(name)), follows=True)
        self.partitions = set(self.consumer.partitions())
        self.books = Books()
        self.caught_up = False
        self.answered = 0

    def step(self, timeout_s: float = 0.2) -> int:
        """Read what is there, answer what is due; returns the number of acks sent."""
        for rec in self.consumer.poll(1000, timeout_s):
            self.books = absorb(self.books, rec.event, self.name)
        if not self.caught_up:
            self.caught_up = self.partitions <= self.consumer.eof
            if not self.caught_up:
                return 0
        sent = 0
        for req in due(self.books):
            self.books, ack = answer(self.books, req, self.decide, self.name, int(time.time() * 1000))
            self.producer.send(ack)
            sent += 1
            log.info("taskcontroller %s: %s request %d: approved %s, chose %s", self.name, req.job_id,
                     req.sequence, ack.payload["approved_operation_ids"],
                     [(c["task_id"], c["choice"]) for c in ack.payload.get("maintenance_choices", ())])
        if sent:
            self.producer.flush()
        self.answered += sent
        # how far it has read and acted (acks flushed): a reader without a group has no committed offset to show
        metrics.observe_position(producer_name(self.name),
                                 {tp: off + 1 for tp, off in self.consumer.last_offsets.items()}, self.prefix)
        return sent

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        try:
            while not until():
                self.step()
        finally:
            self.producer.flush()
            self.producer.stop_following()
            self.consumer.close()
