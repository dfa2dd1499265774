"""`ropewalk produce TOPIC EVENT_TYPE FILE|-`: turn user JSON into complete events.

Input is one JSON object, a JSON array of objects, or JSON Lines. Each object holds the event's own fields;
an optional `envelope` object may set `entitlement`, `entity_id`, `causation_id`, `event_id`,
`timestamp_ms`, `producer`. Whatever is missing is filled: a fresh event id, the current time,
producer "cli", and the entity id from the event's own id field. An intent must also meet the rules the
scheduler applies (``processors/rules.py``: no negative or absurd quantity), refused here naming the field:
`EntitlementCreated.quota_machines: expected an integer from 0 to 1,000,000, got number -5`. Pure: no I/O; the
CLI produces.
"""
from __future__ import annotations

import json
from typing import Any

from infra.config import DEFAULT_MAX_TASKS_PER_JOB
from processors import rules
from streams.events import Event, new_event
from streams.serde import SchemaRegistry
from streams.topics import BY_NAME, TOPIC_OF_EVENT, KEY_ENTITLEMENT
from streams.validate import InvalidEvent, check_datum

# The payload field that names what an event is about, in order of preference.
ENTITY_FIELDS = ("task_id", "job_id", "machine_id", "request_id", "unavailability_id", "name")
ENVELOPE_SETTABLE = ("entitlement", "entity_id", "causation_id", "event_id", "timestamp_ms", "producer")


class ProduceError(ValueError):
    pass


def parse_documents(text: str) -> list[dict]:
    """One object, an array of objects, or JSON Lines."""
    text = text.strip()
    if not text:
        raise ProduceError("input is empty: expected a JSON object, an array of objects, or JSON Lines")
    try:
        doc = json.loads(text)
        docs = doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError as first:
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                docs.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if n == 1:
                    raise ProduceError(f"input is not JSON: {first.msg} at line {first.lineno} column {first.colno}")
                raise ProduceError(f"line {n}: not JSON: {exc.msg}") from None
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            raise ProduceError(f"document {i + 1}: expected a JSON object, got {type(d).__name__}")
    return docs


def build_event(registry: SchemaRegistry, topic: str, event_type: str, doc: dict[str, Any],  # noqa: C901
                default_entitlement: str | None = None, producer: str = "cli", *,
                max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB) -> Event:
    """Validate one user document and return the complete event. Raises ProduceError naming the field.
    ``max_tasks``: the region's most tasks per job (``Config.max_tasks_per_job``)."""
    if topic not in BY_NAME or topic == "_schemas":
        raise ProduceError(f"unknown topic {topic!r}; known: {', '.join(t for t in BY_NAME if t != '_schemas')}")
    if event_type not in registry.event_names:
        raise ProduceError(f"unknown event type {event_type!r}; known: {', '.join(registry.event_names)}")
    if TOPIC_OF_EVENT.get(event_type) != topic:
        raise ProduceError(f"{event_type} belongs on topic {TOPIC_OF_EVENT.get(event_type)}, not {topic}")
    doc = dict(doc)
    env = doc.pop("envelope", {}) or {}
    if not isinstance(env, dict):
        raise ProduceError("envelope: expected an object")
    bad = sorted(set(env) - set(ENVELOPE_SETTABLE) - {"schema_version"})
    if bad:
        raise ProduceError(f"envelope.{bad[0]}: unknown field (settable: {', '.join(ENVELOPE_SETTABLE)})")
    schema = registry.reader(event_type)
    payload_schema = dict(schema.raw, fields=[f for f in schema.raw["fields"] if f["name"] != "envelope"])
    try:
        payload = check_datum(payload_schema, doc)
    except InvalidEvent as exc:
        raise ProduceError(f"{event_type}.{exc.path}: {exc.message}" if exc.path else str(exc)) from None
    entitlement = env.get("entitlement") or default_entitlement
    if entitlement is None:
        if BY_NAME[topic].key == KEY_ENTITLEMENT:
            raise ProduceError(f"envelope.entitlement is required on topic {topic} (it is the partition key); "
                               "pass --entitlement or set it in the envelope")
        entitlement = ""
    if problems := rules.intent_problems(event_type, payload, entitlement, max_tasks):
        raise ProduceError(f"{event_type}.{problems[0]}")
    entity_id = env.get("entity_id") or next((str(payload[f]) for f in ENTITY_FIELDS if payload.get(f)), None)
    if entity_id is None:
        raise ProduceError("envelope.entity_id is required: the event has no id field to take it from")
    event = new_event(event_type, payload, entitlement=entitlement, entity_id=entity_id,
                      producer=env.get("producer") or producer, causation_id=env.get("causation_id"),
                      timestamp_ms=env.get("timestamp_ms"), event_id=env.get("event_id"))
    try:  # the envelope's own types (e.g. timestamp_ms must be an integer)
        registry.encode(event_type, event.to_record(schema.version))
    except InvalidEvent as exc:
        raise ProduceError(f"{event_type}.{exc.path}: {exc.message}") from None
    return event
