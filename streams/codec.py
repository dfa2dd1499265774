"""A faust codec that speaks Ropewalk's wire format: Avro single-object encoding through the same
`SchemaRegistry` the confluent-kafka tools use, so processors and tools write byte-identical records.

    register_codec(registry, cfg=cfg)               # once per process, before building topics
    app.topic(name, value_serializer="ropewalk")    # values are `Event`s in, `Event`s out

`dumps(Event)` writes the event with its reader schema (the envelope's `schema_version` is the schema's
`ropewalk.version`, whatever the `Event` carried); `loads(bytes)` returns an `Event`. A record written with
a schema this process does not know is retried once after learning the writer schemas from `_schemas`
(when the codec has a `Config`). Every decode failure raises the serde's `DecodeError` with its reason.

Processors should not consume through this codec: a faust deserialization error is logged and the record
skipped inside the stream machinery, out of reach of dead-letter routing. They consume raw bytes and
decode with `streams.faustwire.decoded`, which routes failures to `deadletter`. The codec is for
producing (`topic.send(value=event)`) and for tools that want faust to hand them `Event`s.

faust keeps one process-wide codec registry (`faust.serializers.codecs.codecs`); that mapping is faust's,
and `register_codec` only puts an entry in it, idempotently.
"""
from __future__ import annotations

from typing import Any

from faust.serializers import codecs as faust_codecs

from infra.config import Config
from streams import schemalog
from streams.events import Event
from streams.serde import UNKNOWN_FINGERPRINT, DecodeError, SchemaRegistry, fingerprint_of

DEFAULT_NAME = "ropewalk"


class EventCodec(faust_codecs.Codec):
    """`Event` <-> single-object Avro bytes. Construct with `registry=` and optionally `cfg=` and
    `validate=` (keyword arguments, so faust's `clone()` and codec chaining `a | b` keep them)."""

    def __init__(self, children: tuple | None = None, *, registry: SchemaRegistry,
                 cfg: Config | None = None, validate: bool = True, **kwargs: Any) -> None:
        super().__init__(children, registry=registry, cfg=cfg, validate=validate, **kwargs)
        self.registry = registry
        self.cfg = cfg
        self.validate = validate

    def _dumps(self, obj: Any) -> bytes:
        if not isinstance(obj, Event):
            raise TypeError(f"the {DEFAULT_NAME} codec encodes streams.events.Event, not {type(obj).__name__}")
        schema = self.registry.reader(obj.type)
        return self.registry.encode(obj.type, obj.to_record(schema.version), validate=self.validate)

    def _loads(self, s: bytes) -> Event:
        try:
            type_, record = self.registry.decode(s)
        except DecodeError as exc:
            if exc.reason != UNKNOWN_FINGERPRINT or self.cfg is None:
                raise
            # Written with a schema this process was not built with: learn it from the log, retry once.
            schemalog.load(self.cfg, self.registry, only=fingerprint_of(s))
            type_, record = self.registry.decode(s)
        return Event.from_record(type_, record)

    def __repr__(self) -> str:  # faust's repr prints every kwarg; the registry's repr is noise
        return " | ".join(f"{type(n).__name__}()" for n in self.nodes)


def register_codec(registry: SchemaRegistry, name: str = DEFAULT_NAME, *, cfg: Config | None = None,
                   validate: bool = True) -> None:
    """Register an `EventCodec` under `name` in faust's codec registry. Idempotent: registering the same
    registry and config again is a no-op; a different registry or config replaces our own entry. A name
    already taken by a codec that is not ours (e.g. "json") is refused rather than silently replaced."""
    existing = faust_codecs.codecs.get(name)
    if existing is not None:
        if not isinstance(existing, EventCodec):
            raise ValueError(f"faust codec name {name!r} is taken by {existing!r}; choose another name")
        if (existing.registry is registry and existing.cfg == cfg and existing.validate == validate
                and not existing.children):
            return
    faust_codecs.register(name, EventCodec(registry=registry, cfg=cfg, validate=validate))


__all__ = ["EventCodec", "register_codec", "DEFAULT_NAME", "DecodeError"]
