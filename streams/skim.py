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
from types import MappingProxyType
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
    if isinstance(schema, str) and schema in named:
        schema = named[schema]
    if isinstance(schema, list):  # a union
        return _union(schema, path, wanted, named)
    t = schema["type"] if isinstance(schema, dict) else schema
    if isinstance(t, (dict, list)):  # {"type": {...}}
        return _compile(t, path, wanted, named)
    build = _BUILDERS.get(t)
    if build is None:
        raise ValueError(f"{path or 'the record'}: type {t!r} is not known to the skimmer")
    return build(_Site(schema, t, path, wanted.get(path), wanted, named))


class _Site:
    """Where a step is compiled: the schema, its type name, its path, its slot in the values (None: not asked), and
    the compilation's wanted paths and named types."""

    __slots__ = ("schema", "t", "path", "slot", "wanted", "named")

    def __init__(self, schema: Any, t: str, path: str, slot: int | None, wanted: Mapping[str, int],
                 named: dict[str, Any]):
        self.schema, self.t, self.path, self.slot, self.wanted, self.named = schema, t, path, slot, wanted, named

    def name(self) -> None:
        """A named type (record, enum, fixed) is known by its name (and full name) for later references."""
        self.named[self.schema["name"]] = self.schema
        if "namespace" in self.schema:
            self.named[f"{self.schema['namespace']}.{self.schema['name']}"] = self.schema

    def leaf_only(self) -> None:
        if self.slot is not None:
            raise ValueError(f"{self.path}: a {self.t} cannot be skimmed (only stepped over)")


def _union(schema: list, path: str, wanted: Mapping[str, int], named: dict[str, Any]) -> Step:
    branches = [_compile(s, path, wanted, named) for s in schema]
    nb = len(branches)

    def union(b: bytes, pos: int, out: list) -> int:
        i, pos = _long(b, pos)
        if not 0 <= i < nb:
            raise SkimError(f"union branch {i} of {nb}")
        return branches[i](b, pos, out)
    return union


def _null(site: _Site) -> Step:
    slot = site.slot

    def null(b: bytes, pos: int, out: list) -> int:
        if slot is not None:
            out[slot] = None
        return pos
    return null


def _number(site: _Site) -> Step:
    slot, t = site.slot, site.t
    lo, hi = (-(2**31), 2**31 - 1) if t == "int" else (-(2**63), 2**63 - 1)

    def number(b: bytes, pos: int, out: list) -> int:
        v, pos = _long(b, pos)
        if not lo <= v <= hi:
            raise SkimError(f"{v} out of range of an {t}")
        if slot is not None:
            out[slot] = v
        return pos
    return number


def _blob(site: _Site) -> Step:
    slot, text = site.slot, site.t == "string"

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


def _boolean(site: _Site) -> Step:
    slot = site.slot

    def boolean(b: bytes, pos: int, out: list) -> int:
        if slot is not None:
            out[slot] = b[pos] != 0
        return pos + 1
    return boolean


def _fixed(site: _Site) -> Step:
    site.leaf_only()
    size = {"float": 4, "double": 8}.get(site.t) or int(site.schema["size"])
    if site.t == "fixed":
        site.name()

    def fixed(b: bytes, pos: int, out: list) -> int:
        if pos + size > len(b):
            raise SkimError("past the end")
        return pos + size
    return fixed


def _enum(site: _Site) -> Step:
    slot, symbols = site.slot, list(site.schema["symbols"])
    site.name()

    def enum(b: bytes, pos: int, out: list) -> int:
        i, pos = _long(b, pos)
        if not 0 <= i < len(symbols):
            raise SkimError(f"enum index {i}")
        if slot is not None:
            out[slot] = symbols[i]
        return pos
    return enum


def _blocks(site: _Site) -> Step:
    site.leaf_only()
    keyed = site.t == "map"
    item = _compile(site.schema["values" if keyed else "items"], f"{site.path}[]", {}, site.named)
    key = _compile("string", "", {}, site.named)

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


def _record(site: _Site) -> Step:
    site.name()
    if site.slot is not None:
        raise ValueError(f"{site.path}: a record cannot be skimmed (name its fields)")
    path = site.path
    steps = [_compile(f["type"], f"{path}.{f['name']}" if path else f["name"], site.wanted, site.named)
             for f in site.schema["fields"]]

    def record(b: bytes, pos: int, out: list) -> int:
        for step in steps:
            pos = step(b, pos, out)
        return pos
    return record


# Each Avro type's step builder.
_BUILDERS: Mapping[str, Callable[[_Site], Step]] = MappingProxyType({
    "null": _null, "int": _number, "long": _number, "string": _blob, "bytes": _blob, "boolean": _boolean,
    "float": _fixed, "double": _fixed, "fixed": _fixed, "enum": _enum, "array": _blocks, "map": _blocks,
    "record": _record, "error": _record})


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
