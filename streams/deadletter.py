"""Dead-letter routing: a record that fails to decode or validate is kept, with why and where it came from,
as a DeadLetterRecorded event on the `deadletter` topic, and the consumer goes on.

Routing the same record twice yields the same event id (derived from consumer, origin topic, partition and
offset), so a reader can drop duplicates after an at-least-once redelivery.
"""
from __future__ import annotations

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


def _text(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return key.hex()
