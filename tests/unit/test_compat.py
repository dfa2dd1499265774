"""Tests of streams.compat: Avro schema resolution as a compatibility check, and the git-history check."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import fastavro
import pytest
from fastavro.utils import generate_many

from streams import compat
from streams.compat import (ENUM_SYMBOL_MISSING, FIXED_SIZE_MISMATCH, MISSING_DEFAULT, NAME_MISMATCH,
                            SCHEMA_REMOVED, TYPE_MISMATCH, UNION_BRANCH_MISSING, can_read, check_full, check_history)

ROOT = Path(__file__).resolve().parents[2]


def fld(name, type_, **extra):
    return {"name": name, "type": type_, **extra}


def rec(*fields, name="Thing", **extra):
    return {"type": "record", "name": name, "namespace": "ropewalk.events", "fields": list(fields), **extra}


def enum(*symbols, **extra):
    return {"type": "enum", "name": "Status", "symbols": list(symbols), **extra}


RESOURCES = {"type": "record", "name": "Resources",
             "fields": [fld("cpu_millicores", "int"), fld("memory_mib", "int")]}
RESOURCES_GPU = {"type": "record", "name": "Resources",
                 "fields": [fld("cpu_millicores", "int"), fld("memory_mib", "int"), fld("gpus", "int")]}
PLACEMENT = {"type": "record", "name": "Placement", "fields": [fld("task_id", "string"), fld("rack", "string")]}
PLACEMENT_NO_RACK = {"type": "record", "name": "Placement", "fields": [fld("task_id", "string")]}
NODE = rec(fld("value", "int"), fld("next", ["null", "Node"], default=None), name="Node")

CASES = [
    # (case, reader, writer, expected reasons)
    ("identical records", rec(fld("a", "string"), fld("n", "int")), rec(fld("a", "string"), fld("n", "int")), []),
    ("added field with default, new reads old", rec(fld("a", "string"), fld("b", "int", default=0)),
     rec(fld("a", "string")), []),
    ("added field with default, old reads new", rec(fld("a", "string")),
     rec(fld("a", "string"), fld("b", "int", default=0)), []),
    ("added field without default, new reads old", rec(fld("a", "string"), fld("b", "int")),
     rec(fld("a", "string")), [MISSING_DEFAULT]),
    ("added field without default, old reads new", rec(fld("a", "string")),
     rec(fld("a", "string"), fld("b", "int")), []),
    ("removed field, new reads old", rec(fld("a", "string")), rec(fld("a", "string"), fld("b", "int")), []),
    ("removed field, old without default reads new", rec(fld("a", "string"), fld("b", "int")),
     rec(fld("a", "string")), [MISSING_DEFAULT]),
    ("removed field, old with default reads new", rec(fld("a", "string"), fld("b", "int", default=1)),
     rec(fld("a", "string")), []),
    ("int promotes to long", rec(fld("n", "long")), rec(fld("n", "int")), []),
    ("long does not narrow to int", rec(fld("n", "int")), rec(fld("n", "long")), [TYPE_MISMATCH]),
    ("int promotes to double", "double", "int", []),
    ("long promotes to float", "float", "long", []),
    ("float promotes to double", "double", "float", []),
    ("double does not narrow to float", "float", "double", [TYPE_MISMATCH]),
    ("string reads bytes", rec(fld("s", "string")), rec(fld("s", "bytes")), []),
    ("bytes reads string", rec(fld("s", "bytes")), rec(fld("s", "string")), []),
    ("string does not read int", "string", "int", [TYPE_MISMATCH]),
    ("logical type is ignored", rec(fld("t", "long")),
     rec(fld("t", {"type": "long", "logicalType": "timestamp-millis"})), []),
    ("enum symbol added, reader without default", enum("UP", "DOWN"), enum("UP", "DOWN", "DRAINING"),
     [ENUM_SYMBOL_MISSING]),
    ("enum symbol added, reader with default", enum("UP", "DOWN", "UNKNOWN", default="UNKNOWN"),
     enum("UP", "DOWN", "DRAINING"), []),
    ("enum symbol removed from writer", enum("UP", "DOWN", "DRAINING"), enum("UP", "DOWN"), []),
    ("union widening reads plain string", rec(fld("s", ["null", "string"], default=None)),
     rec(fld("s", "string")), []),
    ("plain string cannot read union with null", rec(fld("s", "string")),
     rec(fld("s", ["null", "string"], default=None)), [UNION_BRANCH_MISSING]),
    ("reader union branch by promotion", ["null", "long"], "int", []),
    ("reader union without a matching branch", ["null", "long"], "string", [UNION_BRANCH_MISSING]),
    ("union reads narrower union", ["null", "string", "long"], ["null", "int"], []),
    ("union misses a writer branch", ["null", "string"], ["null", "string", "int"], [UNION_BRANCH_MISSING]),
    ("nested record field type change", rec(fld("resources", RESOURCES)),
     rec(fld("resources", {**RESOURCES, "fields": [fld("cpu_millicores", "string"), fld("memory_mib", "int")]})),
     [TYPE_MISMATCH]),
    ("array of records item change", rec(fld("placements", {"type": "array", "items": PLACEMENT})),
     rec(fld("placements", {"type": "array", "items": PLACEMENT_NO_RACK})), [MISSING_DEFAULT]),
    ("map values promote", rec(fld("env", {"type": "map", "values": "long"})),
     rec(fld("env", {"type": "map", "values": "int"})), []),
    ("map values do not narrow", rec(fld("env", {"type": "map", "values": "int"})),
     rec(fld("env", {"type": "map", "values": "long"})), [TYPE_MISMATCH]),
    ("array is not a map", {"type": "array", "items": "int"}, {"type": "map", "values": "int"}, [TYPE_MISMATCH]),
    ("named reference resolves with inherited namespace",
     rec(fld("wanted", RESOURCES_GPU), fld("granted", "Resources")),
     rec(fld("wanted", RESOURCES), fld("granted", "ropewalk.events.Resources")),
     [MISSING_DEFAULT, MISSING_DEFAULT]),
    ("named references compatible", rec(fld("status", enum("UP")), fld("previous", "ropewalk.events.Status")),
     rec(fld("status", enum("UP")), fld("previous", "Status")), []),
    ("reference into an explicit inner namespace",
     rec(fld("a", {**RESOURCES, "namespace": "infra"}), fld("b", "infra.Resources")),
     rec(fld("a", {**RESOURCES_GPU, "namespace": "infra"}), fld("b", "infra.Resources")), []),
    ("record name mismatch", rec(fld("a", "int"), name="Other"), rec(fld("a", "int")), [NAME_MISMATCH]),
    ("only the namespace differs", {**rec(fld("a", "int")), "namespace": "elsewhere"}, rec(fld("a", "int")), []),
    ("record renamed with alias", rec(fld("a", "int"), name="Renamed", aliases=["Thing"]), rec(fld("a", "int")), []),
    ("field renamed with alias", rec(fld("b", "int", aliases=["a"])), rec(fld("a", "int")), []),
    ("field renamed without alias", rec(fld("b", "int")), rec(fld("a", "int")), [MISSING_DEFAULT]),
    ("fixed size change", {"type": "fixed", "name": "Id", "size": 16}, {"type": "fixed", "name": "Id", "size": 8},
     [FIXED_SIZE_MISMATCH]),
    ("fixed name change", {"type": "fixed", "name": "Id", "size": 16}, {"type": "fixed", "name": "Uid", "size": 16},
     [NAME_MISMATCH]),
    ("recursive type", NODE, NODE, []),
    ("recursive type with added field", rec(*NODE["fields"], fld("weight", "int"), name="Node"), NODE,
     [MISSING_DEFAULT]),
]


@pytest.mark.parametrize("case, reader, writer, expected", CASES, ids=[c[0] for c in CASES])
def test_can_read(case, reader, writer, expected):
    problems = can_read(reader, writer)
    assert sorted(p.reason for p in problems) == sorted(expected), problems
    assert all(p.detail.endswith(".") and len(p.detail) > 20 for p in problems)


@pytest.mark.parametrize("case, reader, writer, expected", CASES, ids=[c[0] for c in CASES])
def test_can_read_fastavro_parsed(case, reader, writer, expected):
    """Schemas parsed by fastavro (full names, extra keys) resolve the same way as raw JSON."""
    problems = can_read(fastavro.parse_schema(reader), fastavro.parse_schema(writer))
    assert sorted(p.reason for p in problems) == sorted(expected)


@pytest.mark.parametrize("case, reader, writer, expected", [c for c in CASES if not c[3]],
                         ids=[c[0] for c in CASES if not c[3]])
def test_fastavro_reads_what_can_read_accepts(case, reader, writer, expected):
    """Oracle: fastavro itself resolves generated data of every case judged compatible."""
    writer, reader = fastavro.parse_schema(writer), fastavro.parse_schema(reader)
    for datum in generate_many(writer, 20):
        if case == "string reads bytes":  # the spec allows it, but only UTF-8 bytes decode
            datum = {"s": datum["s"].decode("utf-8", "replace").encode()}
        buffer = io.BytesIO()
        fastavro.schemaless_writer(buffer, writer, datum)
        buffer.seek(0)
        fastavro.schemaless_reader(buffer, writer, reader)


PATHS = [
    # (case in CASES, expected sorted paths)
    ("nested record field type change", ["resources.cpu_millicores"]),
    ("array of records item change", ["placements[].rack"]),
    ("map values do not narrow", ["env{}"]),
    ("named reference resolves with inherited namespace", ["granted.gpus", "wanted.gpus"]),
    ("plain string cannot read union with null", ["s"]),
    ("record name mismatch", [""]),
]


@pytest.mark.parametrize("case, expected", PATHS, ids=[p[0] for p in PATHS])
def test_paths(case, expected):
    _, reader, writer, _ = next(c for c in CASES if c[0] == case)
    assert sorted(p.path for p in can_read(reader, writer)) == expected


def test_unknown_reference_is_an_error():
    with pytest.raises(ValueError, match="Missing"):
        can_read(rec(fld("a", "Missing")), rec(fld("a", "int")))


def test_check_full_wording():
    old = rec(fld("a", "string"), fld("b", "int"))
    new = rec(fld("a", "string"), fld("c", "int"))
    problems = check_full(old, new)
    assert [(p.path, p.reason) for p in problems] == [("c", MISSING_DEFAULT), ("b", MISSING_DEFAULT)]
    assert problems[0].detail.startswith("new schema cannot read old data: ")
    assert problems[1].detail.startswith("old schema cannot read new data: ")
    assert check_full(old, rec(fld("a", "string"), fld("b", "int"), fld("c", "int", default=0))) == []


# ---- git history ----

ENVELOPE = {"type": "record", "name": "Envelope", "namespace": "ropewalk",
            "fields": [fld("event_id", "string"), fld("timestamp_ms", "long")]}


def event(*fields):
    return rec(fld("envelope", "ropewalk.Envelope"), fld("job_id", "string"), *fields, name="JobThing")


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", "-c", "user.email=test@ropewalk.invalid", "-c", "user.name=Test",
                           "-c", "commit.gpgsign=false", *args], cwd=repo, env=env,
                          check=True, capture_output=True, text=True).stdout


def write(repo: Path, name: str, schema: dict) -> None:
    (repo / "schemas" / name).write_text(json.dumps(schema, indent=2))


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "schemas").mkdir()
    git(tmp_path, "init", "-q")
    write(tmp_path, "Envelope.avsc", ENVELOPE)
    write(tmp_path, "JobThing.avsc", event())
    first = commit(tmp_path, "v1")
    write(tmp_path, "JobThing.avsc", event(fld("tasks", "int", default=1)))
    second = commit(tmp_path, "v2: compatible")
    return tmp_path, first, second


def test_history_compatible(repo):
    path, _, _ = repo
    assert check_history(path / "schemas") == []


def test_history_incompatible_working_tree(repo):
    path, first, second = repo
    write(path, "JobThing.avsc", event(fld("tasks", "int", default=1), fld("owner", "string")))
    problems = check_history(path / "schemas")
    assert {(name, rev, p.path, p.reason) for name, rev, p in problems} == {
        ("JobThing.avsc", first, "owner", MISSING_DEFAULT), ("JobThing.avsc", second, "owner", MISSING_DEFAULT)}
    assert all(p.detail.startswith("new schema cannot read old data:") for _, _, p in problems)
    assert [rev for _, rev, _ in check_history(path / "schemas", revisions=[second])] == [second]


def test_history_inlines_the_envelope(repo):
    path, _, _ = repo
    write(path, "Envelope.avsc", {**ENVELOPE, "fields": [*ENVELOPE["fields"], fld("producer", "string")]})
    problems = check_history(path / "schemas")
    assert {(p.path, p.reason) for _, _, p in problems} == {("envelope.producer", MISSING_DEFAULT)}
    commit(path, "envelope: producer")
    write(path, "Envelope.avsc", ENVELOPE)  # drop it again: old readers of the last commit need a default
    problems = check_history(path / "schemas")
    assert ("envelope.producer", MISSING_DEFAULT) in {(p.path, p.reason) for _, _, p in problems}


def test_history_removed_file(repo, capsys):
    path, _, second = repo
    (path / "schemas" / "JobThing.avsc").unlink()
    assert check_history(path / "schemas") == []
    problems = check_history(path / "schemas", allow_removal=False)
    assert [(name, rev, p.reason) for name, rev, p in problems] == [("JobThing.avsc", second, SCHEMA_REMOVED)]
    assert compat.main([str(path / "schemas"), "--forbid-removal"]) == 1
    assert capsys.readouterr().out.startswith(f"schemas/JobThing.avsc vs {second[:10]}: : SCHEMA_REMOVED: ")


def test_main_output(repo, capsys):
    path, first, _ = repo
    assert compat.main([str(path / "schemas")]) == 0
    assert capsys.readouterr().out == "schemas: 1 files compatible with their history\n"
    write(path, "JobThing.avsc", event(fld("tasks", "long", default=1)))
    assert compat.main([str(path / "schemas")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1  # long cannot be read as int by the old reader of the second commit
    assert lines[0].startswith("schemas/JobThing.avsc vs ")
    assert ": tasks: TYPE_MISMATCH: old schema cannot read new data: " in lines[0]


def test_history_without_commits(tmp_path):
    (tmp_path / "schemas").mkdir()
    git(tmp_path, "init", "-q")
    write(tmp_path, "Envelope.avsc", ENVELOPE)
    write(tmp_path, "JobThing.avsc", event())
    assert check_history(tmp_path / "schemas") == []
    assert check_history(tmp_path / "schemas", allow_removal=False) == []


def test_history_outside_git(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # do not find a repository above tmp_path
    (tmp_path / "schemas").mkdir()
    write(tmp_path, "JobThing.avsc", event())
    assert check_history(tmp_path / "schemas") == []
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert check_history(tmp_path / "schemas") == []


def test_real_schemas_are_compatible_with_their_history():
    assert check_history(ROOT / "schemas") == []


def test_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "streams.compat", str(ROOT / "schemas")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("schemas: ") and done.stdout.rstrip().endswith("compatible with their history")
