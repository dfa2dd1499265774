"""Validate a JSON-like datum against an Avro schema, naming the field that is wrong.

fastavro's writer silently drops unknown fields and reports type errors without a path; users who feed
Ropewalk with `ropewalk produce` need "resources.cpu_millicores: expected int, got string 'lots'". This
walks the schema (raw JSON with named-type references) and returns a copy of the datum with defaults
filled in, or raises InvalidEvent(path, message).
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

_INT_RANGE = (-(2**31), 2**31 - 1)
_LONG_RANGE = (-(2**63), 2**63 - 1)


class InvalidEvent(ValueError):
    def __init__(self, path: str, message: str):
        super().__init__(f"{path or '<event>'}: {message}")
        self.path = path
        self.message = message


def check_datum(schema: Any, datum: Any) -> Any:
    return _check(schema, datum, "", {}, "")


def describe_value(value: Any, *, none: str = "null", mapping: str = "object", sequence: str = "array") -> str:
    """A short description of a user-supplied value for error messages ("string 'lots'", "number 0").
    The words for null/mapping/sequence follow the input's language (JSON here; YAML words for spec files)."""
    if value is None:
        return none
    if isinstance(value, bool):
        return f"boolean {value}"
    if isinstance(value, (int, float)):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value[:40]!r}"
    if isinstance(value, (bytes, bytearray)):
        return f"bytes ({len(value)})"
    if isinstance(value, Mapping):
        return mapping
    if isinstance(value, (list, tuple)):
        return sequence
    return type(value).__name__


_describe = describe_value


def _fullname(name: str, namespace: str) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


def _check(schema: Any, value: Any, path: str, named: dict, ns: str) -> Any:  # noqa: C901
    if isinstance(schema, list):
        return _check_union(schema, value, path, named, ns)
    if isinstance(schema, str):
        if schema in named:
            return _check(named[schema], value, path, named, ns)
        if _fullname(schema, ns) in named:
            return _check(named[_fullname(schema, ns)], value, path, named, ns)
        return _check_primitive(schema, value, path)
    t = schema["type"]
    if t in ("record", "enum", "fixed"):
        full = _fullname(schema["name"], schema.get("namespace", ns))
        named.setdefault(full, schema)
        inner_ns = full.rsplit(".", 1)[0] if "." in full else ""
        if t == "record":
            return _check_record(schema, value, path, named, inner_ns)
        if t == "enum":
            if not isinstance(value, str) or value not in schema["symbols"]:
                raise InvalidEvent(path, f"expected one of {schema['symbols']}, got {_describe(value)}")
            return value
        if not isinstance(value, (bytes, bytearray)) or len(value) != schema["size"]:
            raise InvalidEvent(path, f"expected {schema['size']} bytes, got {_describe(value)}")
        return bytes(value)
    if t == "array":
        if not isinstance(value, (list, tuple)):
            raise InvalidEvent(path, f"expected an array, got {_describe(value)}")
        return [_check(schema["items"], v, f"{path}[{i}]", named, ns) for i, v in enumerate(value)]
    if t == "map":
        if not isinstance(value, Mapping):
            raise InvalidEvent(path, f"expected an object (map), got {_describe(value)}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidEvent(path, f"map keys must be strings, got {_describe(k)}")
            out[k] = _check(schema["values"], v, _join(path, k), named, ns)
        return out
    return _check_primitive(t, value, path)  # {"type": "long", "logicalType": ...}


def _check_record(schema: Mapping, value: Any, path: str, named: dict, ns: str) -> dict:
    if not isinstance(value, Mapping):
        raise InvalidEvent(path, f"expected an object ({schema['name']}), got {_describe(value)}")
    fields = schema["fields"]
    known = {f["name"] for f in fields}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidEvent(_join(path, unknown[0]), f"unknown field (known: {', '.join(sorted(known))})")
    out = {}
    for f in fields:
        fpath = _join(path, f["name"])
        if f["name"] in value:
            out[f["name"]] = _check(f["type"], value[f["name"]], fpath, named, ns)
        elif "default" in f:
            out[f["name"]] = _check(f["type"], _default(f["type"], f["default"]), fpath, named, ns)
        else:
            raise InvalidEvent(fpath, "missing required field")
    return out


def _default(schema: Any, default: Any) -> Any:
    # Avro: a union's default belongs to its first branch; JSON defaults of records/maps are copied.
    if isinstance(default, (dict, list)):
        return copy.deepcopy(default)
    return default


def _check_union(branches: list, value: Any, path: str, named: dict, ns: str) -> Any:
    errors = []
    for b in branches:
        try:
            return _check(b, value, path, named, ns)
        except InvalidEvent as exc:
            errors.append(exc.message)
    names = [b if isinstance(b, str) else b.get("name", b.get("type")) for b in branches]
    raise InvalidEvent(path, f"matches none of {names}, got {_describe(value)}")


def _check_primitive(t: str, value: Any, path: str) -> Any:
    ok: bool
    if t == "null":
        ok = value is None
    elif t == "boolean":
        ok = isinstance(value, bool)
    elif t in ("int", "long"):
        lo, hi = _INT_RANGE if t == "int" else _LONG_RANGE
        ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
    elif t in ("float", "double"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif t == "string":
        ok = isinstance(value, str)
    elif t == "bytes":
        ok = isinstance(value, (bytes, bytearray))
    else:
        raise InvalidEvent(path, f"schema uses unknown type {t!r}")
    if not ok:
        raise InvalidEvent(path, f"expected {t}, got {_describe(value)}")
    return value
