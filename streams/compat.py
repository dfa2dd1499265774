"""Avro schema compatibility checks for Ropewalk events.

Ropewalk's state is the Kafka log itself: every service rebuilds its view by replaying
events, and the log is replayed for audits forever.  Every version of an event schema
therefore stays live at once.  New readers must read old events (backward compatibility)
and old readers, still deployed during a rollout or replaying an archive, must read new
events (forward compatibility).  This module checks that *full* compatibility with the
schema-resolution rules of the Avro specification
(https://avro.apache.org/docs/1.11.1/specification/#schema-resolution):

* primitives match, or the writer's type promotes to the reader's (int -> long/float/double,
  long -> float/double, float -> double, string <-> bytes); logical types are ignored;
* records, enums and fixed types keep their unqualified name (or the reader lists the
  writer's name in its aliases); fixed types keep their size;
* a reader field missing from the writer (by name or alias) needs a default; writer fields
  the reader lacks are skipped;
* a writer enum symbol the reader lacks needs a reader enum ``default``;
* every branch of a writer union must be readable; a reader union must have a branch that
  reads the writer's type.

It works on raw ``.avsc`` JSON (named types defined once and then referenced by name, with
namespaces inherited from the enclosing type) as well as on fastavro-parsed schemas.
``check_history`` compares each file of ``schemas/`` against its committed versions in git.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from types import MappingProxyType

TYPE_MISMATCH = "TYPE_MISMATCH"
MISSING_DEFAULT = "MISSING_DEFAULT"
ENUM_SYMBOL_MISSING = "ENUM_SYMBOL_MISSING"
NAME_MISMATCH = "NAME_MISMATCH"
FIXED_SIZE_MISMATCH = "FIXED_SIZE_MISMATCH"
UNION_BRANCH_MISSING = "UNION_BRANCH_MISSING"
SCHEMA_REMOVED = "SCHEMA_REMOVED"
REASONS = (TYPE_MISMATCH, MISSING_DEFAULT, ENUM_SYMBOL_MISSING, NAME_MISMATCH,
           FIXED_SIZE_MISMATCH, UNION_BRANCH_MISSING, SCHEMA_REMOVED)

ENVELOPE_FILE = "Envelope.avsc"
ENVELOPE_NAME = "ropewalk.Envelope"
PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
NAMED = frozenset({"record", "enum", "fixed"})
# writer type -> reader types it may be read as
PROMOTIONS = MappingProxyType({"int": frozenset({"long", "float", "double"}),
                               "long": frozenset({"float", "double"}),
                               "float": frozenset({"double"}),
                               "string": frozenset({"bytes"}), "bytes": frozenset({"string"})})


@dataclass(frozen=True)
class Incompatibility:
    path: str  # dotted field path, e.g. "placements[].rack"; "" for the root
    reason: str  # one of REASONS
    detail: str  # one sentence a person can act on


# ---- normalisation: raw JSON -> tree with full names, references as name strings ----

def _normalize(schema, ns: str, names: dict):  # noqa: C901
    """Return `schema` with logical types dropped, named definitions registered in `names`
    under their full name, and every named type (definition or reference) as its full name."""
    if isinstance(schema, list):
        return [_normalize(branch, ns, names) for branch in schema]
    if isinstance(schema, str):
        if schema in PRIMITIVES:
            return schema
        for full in ([schema] if "." in schema else [f"{ns}.{schema}"] if ns else []) + [schema]:
            if full in names:
                return full
        raise ValueError(f"unknown Avro type {schema!r}")
    kind = schema["type"]
    if kind == "error":
        kind = "record"
    if kind not in NAMED | {"array", "map"}:  # {"type": "long", "logicalType": ...} etc.
        return _normalize(kind, ns, names)
    if kind == "array":
        return {"type": "array", "items": _normalize(schema["items"], ns, names)}
    if kind == "map":
        return {"type": "map", "values": _normalize(schema["values"], ns, names)}
    name = schema["name"]
    full = name if "." in name else f"{schema.get('namespace', ns)}.{name}".lstrip(".")
    if full in names:
        raise ValueError(f"Avro type {full!r} is defined twice")
    node = {"type": kind, "name": full, "aliases": [a.rsplit(".", 1)[-1] for a in schema.get("aliases", ())]}
    names[full] = node  # registered before the fields so recursive types resolve
    inner_ns = full.rpartition(".")[0]
    if kind == "record":
        node["fields"] = [{"name": f["name"], "aliases": list(f.get("aliases", ())),
                           "type": _normalize(f["type"], inner_ns, names),
                           **({"default": f["default"]} if "default" in f else {})}
                          for f in schema["fields"]]
    elif kind == "enum":
        node["symbols"] = list(schema["symbols"])
        node.update({"default": schema["default"]} if "default" in schema else {})
    else:
        node["size"] = schema["size"]
    return full


def _kind(schema) -> str:
    return "union" if isinstance(schema, list) else schema if isinstance(schema, str) else schema["type"]


def _describe(schema) -> str:
    if isinstance(schema, list):
        return "[" + ", ".join(map(_describe, schema)) + "]"
    if isinstance(schema, str):
        return schema
    if schema["type"] in NAMED:
        return f"{schema['type']} {schema['name']}"
    return f"{schema['type']}<{_describe(schema.get('items', schema.get('values')))}>"


# ---- resolution ----

class _Resolver:
    """State of one can_read call: the named types of both sides and the named pairs in progress."""

    def __init__(self, reader_names: dict, writer_names: dict):
        self.reader_names, self.writer_names = reader_names, writer_names
        self.in_progress: set[tuple[str, str]] = set()
        self.problems: list[Incompatibility] = []

    def add(self, path: str, reason: str, detail: str) -> None:
        self.problems.append(Incompatibility(path, reason, detail))

    @staticmethod
    def deref(schema, names: dict):
        if isinstance(schema, list):
            return [names.get(b, b) if isinstance(b, str) else b for b in schema]
        return names.get(schema, schema) if isinstance(schema, str) else schema

    def check(self, reader, writer, path: str) -> None:  # noqa: C901
        reader, writer = self.deref(reader, self.reader_names), self.deref(writer, self.writer_names)
        if isinstance(writer, list):
            for branch in writer:
                if isinstance(reader, list) or self.mismatch(reader, branch) is None:
                    self.check(reader, branch, path)
                else:
                    self.add(path, UNION_BRANCH_MISSING,
                             f"the writer's union branch {_describe(branch)} cannot be read as "
                             f"{_describe(reader)}; make the reader a union that includes it.")
            return
        if isinstance(reader, list):
            matches = [b for b in reader if self.mismatch(b, writer) is None]
            exact = [b for b in matches if _kind(b) == _kind(writer)]
            if matches:
                self.check((exact or matches)[0], writer, path)
            else:
                self.add(path, UNION_BRANCH_MISSING,
                         f"no branch of the reader union {_describe(reader)} can read the writer's "
                         f"{_describe(writer)}; add it to the union.")
            return
        problem = self.mismatch(reader, writer)
        if problem:
            self.add(path, *problem)
            return
        kind = _kind(reader)
        if kind == "array":
            self.check(reader["items"], writer["items"], path + "[]")
        elif kind == "map":
            self.check(reader["values"], writer["values"], path + "{}")
        elif kind in NAMED:
            key = (reader["name"], writer["name"])
            if key not in self.in_progress:  # a recursive type is already being checked higher up
                self.in_progress.add(key)
                try:
                    self.check_named(reader, writer, path)
                finally:
                    self.in_progress.discard(key)

    def check_named(self, reader: dict, writer: dict, path: str) -> None:
        if reader["type"] == "enum":
            missing = [s for s in writer["symbols"] if s not in reader["symbols"]]
            if missing and "default" not in reader:
                self.add(path, ENUM_SYMBOL_MISSING,
                         f"writer symbols {', '.join(missing)} are not in the reader enum {reader['name']}; "
                         f"add them to the reader or give the reader enum a default symbol.")
        elif reader["type"] == "record":
            written = {f["name"]: f for f in writer["fields"]}
            for field in reader["fields"]:
                field_path = f"{path}.{field['name']}" if path else field["name"]
                source = next((written[n] for n in [field["name"], *field["aliases"]] if n in written), None)
                if source is not None:
                    self.check(field["type"], source["type"], field_path)
                elif "default" not in field:
                    self.add(field_path, MISSING_DEFAULT,
                             f"reader field {field['name']!r} of {reader['name']} is not in the writer's "
                             f"schema and has no default; give it a default.")

    @staticmethod
    def mismatch(reader, writer) -> tuple[str, str] | None:
        """The reason `writer` cannot be read as `reader`, ignoring what lies below them."""
        rkind, wkind = _kind(reader), _kind(writer)
        if rkind != wkind:
            if rkind in PROMOTIONS.get(wkind, ()):
                return None
            return (TYPE_MISMATCH, f"the writer's {_describe(writer)} cannot be read as {_describe(reader)}; "
                                   f"keep the old type or add a new field with a default instead.")
        if rkind in NAMED:
            short = writer["name"].rsplit(".", 1)[-1]
            if reader["name"].rsplit(".", 1)[-1] != short and short not in reader["aliases"]:
                return (NAME_MISMATCH, f"the reader's {rkind} {reader['name']} does not match the writer's "
                                       f"{writer['name']}; keep the name or add {short!r} to the reader's aliases.")
            if rkind == "fixed" and reader["size"] != writer["size"]:
                return (FIXED_SIZE_MISMATCH, f"fixed {reader['name']} has size {reader['size']} in the reader "
                                             f"but {writer['size']} in the writer; keep the size.")
        return None


def can_read(reader: dict | str | list, writer: dict | str | list) -> list[Incompatibility]:
    """Problems reading data written with `writer` using `reader`; [] when it can be read."""
    reader_names: dict = {}
    writer_names: dict = {}
    reader_root, writer_root = _normalize(reader, "", reader_names), _normalize(writer, "", writer_names)
    resolver = _Resolver(reader_names, writer_names)
    resolver.check(reader_root, writer_root, "")
    return resolver.problems


def check_full(old: dict, new: dict) -> list[Incompatibility]:
    """Backward (new reads old data) plus forward (old reads new data) compatibility problems."""
    return ([replace(p, detail=f"new schema cannot read old data: {p.detail}") for p in can_read(new, old)]
            + [replace(p, detail=f"old schema cannot read new data: {p.detail}") for p in can_read(old, new)])


# ---- git history ----

def _git(repo: Path, *args: str) -> str | None:
    """stdout of a git command, or None when git is missing or the command fails."""
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def _load(text: str, envelope: dict | None) -> dict:
    """Parse an event schema, inline the envelope and check that its types resolve."""
    try:
        schema = json.loads(text)
        for field in schema.get("fields", ()):
            if field.get("type") == ENVELOPE_NAME and envelope is not None:
                field["type"] = envelope
                break
        _normalize(schema, "", {})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"invalid Avro schema: {e!r}") from e
    return schema


def check_history(schemas_dir: Path, revisions: list[str] | None = None, repo: Path | None = None,
                  allow_removal: bool = True) -> list[tuple[str, str, Incompatibility]]:
    """(file name, revision, problem) for each event schema not fully compatible with a committed
    version of itself (every commit touching it or Envelope.avsc, or only `revisions`).
    Outside a git repository, or without commits, there is no history and the result is [].
    A current file that is not a valid schema raises ValueError."""
    schemas_dir = Path(schemas_dir).resolve()
    top = _git(Path(repo) if repo else schemas_dir, "rev-parse", "--show-toplevel")
    if top is None:
        return []
    repo = Path(top.strip()).resolve()
    try:
        rel = PurePosixPath(schemas_dir.relative_to(repo).as_posix())
    except ValueError:
        return []
    envelope_path = schemas_dir / ENVELOPE_FILE
    envelope_text = envelope_path.read_text() if envelope_path.exists() else None
    envelope = json.loads(envelope_text) if envelope_text else None
    old_envelopes: dict[str, str | None] = {}  # revision -> Envelope.avsc text then
    results = []
    for path in sorted(p for p in schemas_dir.glob("*.avsc") if p.name != ENVELOPE_FILE):
        try:
            new = _load(path.read_text(), envelope)
        except ValueError as e:
            raise ValueError(f"{rel / path.name}: {e}") from e
        revs = revisions if revisions is not None else (
            _git(repo, "log", "--format=%H", "--", str(rel / path.name), str(rel / ENVELOPE_FILE)) or "").split()
        checked = set()
        for rev in revs:
            if rev not in old_envelopes:
                old_envelopes[rev] = _git(repo, "show", f"{rev}:{rel / ENVELOPE_FILE}") or envelope_text
            text, env_text = _git(repo, "show", f"{rev}:{rel / path.name}"), old_envelopes[rev]
            if text is None or (text, env_text) in checked:
                continue  # the file did not exist then, or this pair of versions is already checked
            checked.add((text, env_text))
            try:
                old = _load(text, json.loads(env_text) if env_text else None)
            except ValueError:
                continue  # a committed version that is not a valid schema never wrote an event
            results += [(path.name, rev, p) for p in check_full(old, new)]
    if not allow_removal:
        results += _removed(repo, rel, schemas_dir, revisions)
    return results


def _removed(repo: Path, rel: PurePosixPath, schemas_dir: Path,
             revisions: list[str] | None) -> list[tuple[str, str, Incompatibility]]:
    """Schema files that existed in a committed revision but are gone from schemas_dir."""
    revs = revisions if revisions is not None else (_git(repo, "log", "--format=%H", "--", str(rel)) or "").split()
    last_seen: dict[str, str] = {}
    for rev in revs:  # newest first, so the first revision holding a file is its last one
        for line in (_git(repo, "ls-tree", "--name-only", rev, "--", f"{rel}/") or "").splitlines():
            name = PurePosixPath(line).name
            if name.endswith(".avsc") and not (schemas_dir / name).exists():
                last_seen.setdefault(name, rev)
    return [(name, rev, Incompatibility("", SCHEMA_REMOVED,
                                        f"{rel / name} was removed but events written with it stay in the log; "
                                        f"restore the file."))
            for name, rev in sorted(last_seen.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ropewalk schemas check",
                                     description="Check event schemas against their git history.")
    parser.add_argument("schemas_dir", nargs="?", type=Path,
                        default=Path(__file__).resolve().parents[1] / "schemas")
    parser.add_argument("--forbid-removal", action="store_true", help="a deleted schema file is an error")
    args = parser.parse_args(argv)
    try:
        problems = check_history(args.schemas_dir, allow_removal=not args.forbid_removal)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    label = args.schemas_dir.resolve().name
    for name, rev, p in problems:
        print(f"{label}/{name} vs {rev[:10]}: {p.path}: {p.reason}: {p.detail}")
    if problems:
        return 1
    count = sum(1 for p in args.schemas_dir.glob("*.avsc") if p.name != ENVELOPE_FILE)
    print(f"{label}: {count} files compatible with their history")
    return 0


if __name__ == "__main__":
    sys.exit(main())
