"""Avro single-object encoding of Ropewalk events, with schema resolution.

Wire format (Avro specification, "Single-object encoding"):

    C3 01 | 8-byte CRC-64-AVRO fingerprint of the writer schema (little-endian) | Avro binary body

Any reader holding `schemas/` can decode any record without a registry server. A record written with a
schema this reader does not have (a newer or older version) is resolved against the reader's schema of the
same event name, once the writer schema is known: producers publish every schema they write with to the
`_schemas` topic (see streams/schemalog.py), and readers learn from it.

Decode failures raise `DecodeError` with a reason constant; the consumer routes such records to the
dead-letter topic with that reason.
"""
from __future__ import annotations

import copy
import io
import json
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

from fastavro import schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint as _fingerprint
from fastavro.schema import parse_schema, to_parsing_canonical_form
from fastavro.validation import validate as _fast_validate

from streams.validate import InvalidEvent, check_datum

SCHEMAS_DIR = Path(__file__).resolve().parents[1] / "schemas"
MARKER = b"\xc3\x01"
HEADER_LEN = 10
ENVELOPE_NAME = "ropewalk.Envelope"
EVENT_NAMESPACE = "ropewalk.events"

# Reasons a record cannot be decoded. They travel in DeadLetterRecorded.reason.
NO_MARKER = "no_marker"  # not single-object encoded (wrong or missing C3 01 marker, or too short)
UNKNOWN_FINGERPRINT = "unknown_fingerprint"  # writer schema never seen in schemas/ or the _schemas topic
MALFORMED = "malformed"  # body does not decode with the writer schema (truncated, bad varint, trailing bytes)
INCOMPATIBLE_SCHEMA = "incompatible_schema"  # writer schema cannot be resolved to the reader's
UNKNOWN_EVENT = "unknown_event"  # writer's record name has no reader schema here
INVALID_EVENT = "invalid_event"  # decoded, but violates the event's rules (e.g. envelope/key mismatch)


class DecodeError(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class EventSchema:
    """One version of one event's schema."""

    name: str  # short name, e.g. "JobSubmitted"
    fullname: str  # "ropewalk.events.JobSubmitted"
    topic: str | None  # logical topic the event belongs on ("intents", ...)
    version: int  # the schema's "ropewalk.version"
    raw: Mapping[str, Any] = field(repr=False)  # JSON with the envelope inlined
    parsed: Mapping[str, Any] = field(repr=False)  # fastavro-parsed
    fingerprint: bytes = b""  # 8 bytes, little-endian CRC-64-AVRO of the parsing canonical form

    @cached_property
    def field_names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.raw["fields"])

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    def to_json(self) -> str:
        return json.dumps(self.raw, sort_keys=True)


def build_schema(raw: Mapping[str, Any], envelope: Mapping[str, Any] | None) -> EventSchema:
    """Parse an event schema (envelope reference inlined) and compute its fingerprint."""
    raw = copy.deepcopy(dict(raw))
    if envelope is not None:
        for fld in raw.get("fields", []):
            if fld.get("type") == ENVELOPE_NAME:
                fld["type"] = copy.deepcopy(dict(envelope))
    parsed = parse_schema(raw)  # keep fastavro's parse hint: without it every encode/decode re-parses
    fp = bytes.fromhex(_fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))
    ns = raw.get("namespace", "")
    name = raw["name"].rsplit(".", 1)[-1]
    fullname = raw["name"] if "." in raw["name"] else (f"{ns}.{name}" if ns else name)
    return EventSchema(
        name=name,
        fullname=fullname,
        topic=raw.get("ropewalk.topic"),
        version=int(raw.get("ropewalk.version", 1)),
        raw=raw,
        parsed=parsed,
        fingerprint=fp,
    )


def load_schema_dir(path: Path = SCHEMAS_DIR) -> dict[str, EventSchema]:
    """Every event schema in `path`, by short name. Envelope.avsc is inlined into each."""
    envelope = json.loads((path / "Envelope.avsc").read_text())
    out: dict[str, EventSchema] = {}
    for file in sorted(path.glob("*.avsc")):
        if file.name == "Envelope.avsc":
            continue
        try:
            schema = build_schema(json.loads(file.read_text()), envelope)
        except Exception as exc:  # a broken schema file is a start-up error, with its file named
            raise ValueError(f"schemas/{file.name}: {exc}") from exc
        if schema.name != file.stem:
            raise ValueError(f"schemas/{file.name}: record name {schema.name!r} differs from the file name")
        out[schema.name] = schema
    return out


class SchemaRegistry:
    """Reader schemas (the ones this code was built with) plus every writer schema learned so far.

    Learning is append-only and idempotent (a schema is keyed by its fingerprint), and guarded by a lock
    because a faust worker may decode from several threads. This is a cache of immutable facts, not
    processing state: two registries that learned the same schemas decode identically.
    """

    def __init__(self, readers: Mapping[str, EventSchema]):
        self._readers = dict(readers)
        self._writers: dict[bytes, EventSchema] = {s.fingerprint: s for s in readers.values()}
        self._lock = threading.Lock()

    @classmethod
    def from_dir(cls, path: Path = SCHEMAS_DIR) -> "SchemaRegistry":
        return cls(load_schema_dir(path))

    # -- lookups ---------------------------------------------------------------------------------
    @property
    def event_names(self) -> list[str]:
        return sorted(self._readers)

    def reader(self, name: str) -> EventSchema:
        try:
            return self._readers[name]
        except KeyError:
            raise KeyError(f"unknown event type {name!r}; known: {', '.join(self.event_names)}") from None

    def writer(self, fp: bytes) -> EventSchema | None:
        return self._writers.get(fp)

    def writers(self) -> list[EventSchema]:
        return list(self._writers.values())

    def learn(self, schema_json: str | Mapping[str, Any]) -> EventSchema:
        """Add a writer schema (full JSON, envelope inlined) seen on the log."""
        raw = json.loads(schema_json) if isinstance(schema_json, (str, bytes)) else schema_json
        schema = build_schema(raw, None)
        with self._lock:
            return self._writers.setdefault(schema.fingerprint, schema)

    # -- encode / decode -------------------------------------------------------------------------
    def encode(self, name: str, record: Mapping[str, Any], validate: bool = True) -> bytes:
        """Encode `record` single-object. With validate (the default) a wrong field raises InvalidEvent
        naming it; processors that build records from already-decoded events may skip it for speed
        (fastavro still refuses a record it cannot encode)."""
        schema = self.reader(name)
        datum = record
        if validate:
            # fastavro's validator is fast but says only "invalid" and ignores unknown fields; ours names the
            # field. Run ours when fastavro refuses, or when the record has fields the schema lacks.
            if not _fast_validate(record, schema.parsed, raise_errors=False) or not record.keys() <= schema.field_names:
                datum = check_datum(schema.raw, record)
        buf = io.BytesIO()
        buf.write(MARKER)
        buf.write(schema.fingerprint)
        schemaless_writer(buf, schema.parsed, datum)
        return buf.getvalue()

    def decode(self, data: bytes | None) -> tuple[str, dict]:
        """(event name, record) read with this reader's schema. Raises DecodeError."""
        if data is None or len(data) < HEADER_LEN or data[:2] != MARKER:
            raise DecodeError(NO_MARKER, "value is not Avro single-object encoded (missing C3 01 marker)"
                              if data and len(data) >= 2 else "value is empty or shorter than the 10-byte header")
        fp = bytes(data[2:HEADER_LEN])
        writer = self._writers.get(fp)
        if writer is None:
            raise DecodeError(UNKNOWN_FINGERPRINT, f"no schema with fingerprint {fp.hex()} in schemas/ or _schemas")
        reader = self._readers.get(writer.name)
        if reader is None:
            raise DecodeError(UNKNOWN_EVENT, f"event {writer.fullname} has no reader schema in this version")
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        try:
            if reader.fingerprint == writer.fingerprint:
                record = schemaless_reader(buf, writer.parsed, None)
            else:
                record = schemaless_reader(buf, writer.parsed, reader.parsed)
        except Exception as exc:  # noqa: BLE001 - any decoding failure becomes the reason below
            kind = type(exc).__name__
            if kind == "SchemaResolutionError":
                raise DecodeError(INCOMPATIBLE_SCHEMA, f"{writer.fullname}: {exc}") from None
            raise DecodeError(MALFORMED, f"{writer.fullname} body does not decode: {kind}: {exc}") from None
        if buf.tell() != len(data):
            raise DecodeError(MALFORMED, f"{writer.fullname}: {len(data) - buf.tell()} trailing bytes after the body")
        return writer.name, record


def fingerprint_of(data: bytes) -> bytes | None:
    """The writer fingerprint of a single-object encoded value, or None."""
    if data and len(data) >= HEADER_LEN and data[:2] == MARKER:
        return bytes(data[2:HEADER_LEN])
    return None


__all__ = [
    "SchemaRegistry", "EventSchema", "DecodeError", "InvalidEvent", "load_schema_dir", "build_schema",
    "fingerprint_of", "MARKER", "SCHEMAS_DIR", "NO_MARKER", "UNKNOWN_FINGERPRINT", "MALFORMED",
    "INCOMPATIBLE_SCHEMA", "UNKNOWN_EVENT", "INVALID_EVENT",
]


