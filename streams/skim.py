"""Read a few fields of an Avro single-object record without decoding it into dicts: a reader's hot path.

    skim = Skimmer(registry, "AgentHeartbeat", ("envelope.event_id", "envelope.timestamp_ms", "machine_id",
                                                "sequence"))
    values = skim(value)     # a tuple in that order, or None: decode this record the ordinary way

A reader that needs three fields of a record it reads thousands of times a second (the health check and the
heartbeats: issue 28) pays for every dict, every nested record and the ``Event`` of a full decode. A skimmer walks
the record's bytes with a plan compiled once per writer schema (from the registry, by the record's fingerprint), keeps
the fields asked for and steps over the rest.

**It accepts exactly what the full decode would, or hands the record back.** Every byte is walked as the writer's
schema says (every string decoded as UTF-8, every union branch and enum symbol checked, no trailing byte); anything
else — a fingerprint it has no plan for (an unknown or a resolved writer schema: the reader's own version only), a
record of another type, a truncated or malformed body — returns None, and the caller decodes the record the ordinary
way, which refuses it with its reason (dead-lettered). So the skimmer never decides that a record is bad; it only
declines to read it. Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from streams.serde import HEADER_LEN, MARKER, SchemaRegistry

Step = Callable[[bytes, int, list], int]  # (record bytes, position, out values) -> position after the value


class SkimError(ValueError):
    """The bytes are not what the writer's schema says (the caller decodes the record the ordinary way)."""


def _long(b: bytes, pos: int) -> tuple[int, int]:
    """Avro's zig-zag varint at ``pos``: (value, position after it)."""
    shift = 0
    n = 0
    while True:
        byte = b[pos]
        pos += 1
        n |= (byte & 0x7F) << shift
        if byte < 0x80:
            if n >> 64:  # past 64 bits: what the full decode makes of it is its own affair (it wraps)
                raise SkimError("varint past 64 bits")
            return (n >> 1) ^ -(n & 1), pos
        shift += 7
        if shift > 63:
            raise SkimError("varint longer than 10 bytes")


def _compile(schema: Any, path: str, wanted: Mapping[str, int], named: dict[str, Any]) -> Step:
    """The step reading one value of ``schema`` at ``path`` ("" the top), storing it at ``wanted[path]`` if asked."""
    slot = wanted.get(path)
    if isinstance(schema, str) and schema in named:
        schema = named[schema]
    if isinstance(schema, list):  # a union
        branches = [_compile(s, path, wanted, named) for s in schema]
        nb = len(branches)

        def union(b: bytes, pos: int, out: list) -> int:
            i, pos = _long(b, pos)
            if not 0 <= i < nb:
                raise SkimError(f"union branch {i} of {nb}")
            return branches[i](b, pos, out)
        return union
    t = schema["type"] if isinstance(schema, dict) else schema
    if isinstance(t, (dict, list)):  # {"type": {...}}
        return _compile(t, path, wanted, named)
    if t == "null":
        def null(b: bytes, pos: int, out: list) -> int:
            if slot is not None:
                out[slot] = None
            return pos
        return null
    if t in ("int", "long"):
        lo, hi = (-(2**31), 2**31 - 1) if t == "int" else (-(2**63), 2**63 - 1)

        def number(b: bytes, pos: int, out: list) -> int:
            v, pos = _long(b, pos)
            if not lo <= v <= hi:
                raise SkimError(f"{v} out of range of an {t}")
            if slot is not None:
                out[slot] = v
            return pos
        return number
    if t in ("string", "bytes"):
        text = t == "string"

        def blob(b: bytes, pos: int, out: list) -> int:
            n, pos = _long(b, pos)
            end = pos + n
            if n < 0 or end > len(b):
                raise SkimError("length past the end")
            raw = b[pos:end]
            v = raw.decode() if text else raw  # a string that is no UTF-8 is refused, as the full decode does
            if slot is not None:
                out[slot] = v
            return end
        return blob
    if t == "boolean":
        def boolean(b: bytes, pos: int, out: list) -> int:
            if slot is not None:
                out[slot] = b[pos] != 0
            return pos + 1
        return boolean
    if t in ("float", "double", "fixed"):
        size = {"float": 4, "double": 8}.get(t) or int(schema["size"])
        if slot is not None:
            raise ValueError(f"{path}: a {t} cannot be skimmed (only stepped over)")

        def fixed(b: bytes, pos: int, out: list) -> int:
            if pos + size > len(b):
                raise SkimError("past the end")
            return pos + size
        if t == "fixed":
            named[schema["name"]] = schema
        return fixed
    if t == "enum":
        symbols = list(schema["symbols"])
        named[schema["name"]] = schema

        def enum(b: bytes, pos: int, out: list) -> int:
            i, pos = _long(b, pos)
            if not 0 <= i < len(symbols):
                raise SkimError(f"enum index {i}")
            if slot is not None:
                out[slot] = symbols[i]
            return pos
        return enum
    if t in ("array", "map"):
        if slot is not None:
            raise ValueError(f"{path}: an {t} cannot be skimmed (only stepped over)")
        item = _compile(schema["items" if t == "array" else "values"], f"{path}[]", {}, named)
        keyed = t == "map"
        key = _compile("string", "", {}, named)

        def blocks(b: bytes, pos: int, out: list) -> int:
            while True:
                n, pos = _long(b, pos)
                if n == 0:
                    return pos
                if n < 0:
                    n = -n
                    _, pos = _long(b, pos)  # the block's size in bytes
                for _ in range(n):
                    if keyed:
                        pos = key(b, pos, out)
                    pos = item(b, pos, out)
        return blocks
    if t in ("record", "error"):
        named[schema["name"]] = schema
        if "namespace" in schema:
            named[f"{schema['namespace']}.{schema['name']}"] = schema
        if slot is not None:
            raise ValueError(f"{path}: a record cannot be skimmed (name its fields)")
        steps = [_compile(f["type"], f"{path}.{f['name']}" if path else f["name"], wanted, named)
                 for f in schema["fields"]]

        def record(b: bytes, pos: int, out: list) -> int:
            for step in steps:
                pos = step(b, pos, out)
            return pos
        return record
    raise ValueError(f"{path or 'the record'}: type {t!r} is not known to the skimmer")


class Skimmer:
    """Reads ``fields`` (dotted paths of primitive fields, e.g. ``envelope.timestamp_ms``; a union's value, or None
    for its null branch) of records of ``event_type`` written with the reader's own schema (the version this code
    was built with): ``skim(value)`` returns them as a tuple, or None when the record is of another writer schema or
    does not read as its schema says."""

    def __init__(self, registry: SchemaRegistry, event_type: str, fields: Sequence[str]):
        schema = registry.reader(event_type)
        self.event_type = event_type
        self.fields = tuple(fields)
        self.fingerprint = schema.fingerprint
        self._head = MARKER + schema.fingerprint
        wanted = {f: i for i, f in enumerate(self.fields)}
        names = _field_paths(schema.raw, "")
        missing = [f for f in self.fields if f not in names]
        if missing:
            raise ValueError(f"{event_type} has no field {', '.join(missing)}")
        self._step = _compile(schema.raw, "", wanted, {})
        self._blank = [None] * len(self.fields)

    def __call__(self, value: bytes | None) -> tuple | None:
        if value is None or value[:HEADER_LEN] != self._head:
            return None
        out = list(self._blank)
        try:
            end = self._step(value, HEADER_LEN, out)
        except (SkimError, IndexError, UnicodeDecodeError):
            return None
        return tuple(out) if end == len(value) else None


def _field_paths(schema: Any, path: str) -> set[str]:
    """Every dotted path of ``schema``'s fields (records nested in fields and in unions)."""
    out: set[str] = set()
    if isinstance(schema, list):
        for s in schema:
            out |= _field_paths(s, path)
        return out
    if isinstance(schema, dict):
        t = schema.get("type")
        if t in ("record", "error"):
            for f in schema["fields"]:
                p = f"{path}.{f['name']}" if path else f["name"]
                out.add(p)
                out |= _field_paths(f["type"], p)
        elif isinstance(t, (dict, list)):
            out |= _field_paths(t, path)
    return out
