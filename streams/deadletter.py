"""Dead-letter routing: a record that fails to decode or validate is kept, with why and where it came from,
as a DeadLetterRecorded event on the `deadletter` topic, and the consumer goes on.

Routing the same record twice yields the same event id (derived from consumer, origin topic, partition and
offset), so a reader can drop duplicates after an at-least-once redelivery.

`Skipped` is the reader's side of the same rule: every reader of the log (a processor, a CLI command, a state
reader, a replay) counts what it could not decode, by reason, and remembers the first one, so that it can say so
once (``Skipped.report()``: one line); a processor also routes each to `deadletter`. No reader stops on a record
it cannot decode.
"""
from __future__ import annotations

from collections import Counter

from streams.events import derived_event_id, new_event

PROCESSING_FAILED = "processing_failed"  # decoded fine, but the processor's handler raised on it


class DeadLetters:
    def __init__(self, producer, consumer_name: str):
        self.producer = producer  # an EventProducer
        self.consumer_name = consumer_name
        self.routed = 0

    def route(self, *, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
              reason: str, detail: str) -> None:
        entitlement = _text(key) or "unknown"
        event = new_event(
            "DeadLetterRecorded",
            {"origin_topic": topic, "origin_partition": partition, "origin_offset": offset,
             "origin_key": key, "payload": value, "reason": reason, "detail": detail[:2000],
             "consumer": self.consumer_name},
            entitlement=entitlement, entity_id=f"{topic}/{partition}/{offset}", producer=self.consumer_name,
            event_id=derived_event_id("deadletter", self.consumer_name, topic, partition, offset),
        )
        self.producer.send(event)
        self.routed += 1
        from infra.metrics import DEAD_LETTERS  # noqa: PLC0415 - start-up cost: prometheus_client (~20 ms); CLI path

        DEAD_LETTERS.labels(topic=topic, reason=reason).inc()


    def route_failed(self, rec, registry, exc: Exception | str, log=None, reason: str = PROCESSING_FAILED) -> bool:
        """A decoded record (a ``streams.clients.Record``) whose processing raised ``exc`` (or that the processor
        refuses for ``reason``): routed with its event re-encoded. Never raises (the processor goes on either way): a
        failure to route is logged on ``log`` and returns False."""
        try:
            detail = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
            self.route(topic=rec.topic, partition=rec.partition, offset=rec.offset, key=rec.key,
                       value=registry.encode(rec.event.type, rec.event.to_record(), validate=False),
                       reason=reason, detail=detail)
            return True
        except Exception:  # noqa: BLE001 - the broker away: the record is logged where it failed already
            if log is not None:
                log.exception("%s: cannot dead-letter %s[%d]@%d", self.consumer_name, rec.topic, rec.partition,
                              rec.offset)
            return False


class Skipped:
    """The records one reader (or one command, over all its readers) could not decode: counted by reason, the
    first one remembered. ``route(**kw)`` takes what ``DeadLetters.route`` takes."""

    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()
        self.first: str | None = None  # "topic[partition]@offset: reason: detail" of the first record skipped

    @property
    def count(self) -> int:
        return sum(self.by_reason.values())

    def route(self, *, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
              reason: str, detail: str) -> None:
        self.by_reason[reason] += 1
        if self.first is None:
            self.first = f"{topic}[{partition}]@{offset}: {reason}: {detail}"

    def report(self) -> str | None:
        """One line saying what was skipped (None when nothing was), e.g. ``skipped 2 undecodable records
        (malformed 1, no_marker 1); the first: state.jobs[3]@0: no_marker: ...``."""
        n = self.count
        if not n:
            return None
        reasons = ", ".join(f"{r} {c}" for r, c in sorted(self.by_reason.items()))
        return f"skipped {n} undecodable record{'s' if n != 1 else ''} ({reasons}); the first: {self.first}"


def _text(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return key.hex()
