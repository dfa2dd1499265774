"""Avro single-object serde: every schema round-trips; bad records fail with the right reason."""
import copy
import io
import re

import pytest
from fastavro import schemaless_writer
from fastavro.schema import fingerprint

from streams.serde import (INCOMPATIBLE_SCHEMA, MALFORMED, MARKER, NO_MARKER, UNKNOWN_EVENT, UNKNOWN_FINGERPRINT,
                           SCHEMAS_DIR, DecodeError, SchemaRegistry, build_schema, load_schema_dir)
from streams.topics import TOPIC_OF_EVENT
from streams.validate import InvalidEvent

REG = SchemaRegistry.from_dir()


@pytest.mark.parametrize("name", REG.event_names)
def test_every_schema_round_trips(name, make_sample):
    schema = REG.reader(name)
    record = make_sample(copy.deepcopy(dict(schema.raw)))
    data = REG.encode(name, record)
    assert data[:2] == MARKER and data[2:10] == schema.fingerprint
    assert REG.decode(data) == (name, record)
    assert REG.encode(name, record, validate=False) == data


@pytest.mark.parametrize("name", REG.event_names)
def test_every_schema_is_documented_and_on_its_topic(name):
    raw = REG.reader(name).raw
    assert raw.get("doc"), f"{name} has no doc"
    assert all(f.get("doc") for f in raw["fields"]), f"{name} has an undocumented field"
    assert TOPIC_OF_EVENT[name] == raw["ropewalk.topic"]
    words = re.findall(r"[A-Z][a-z]+", name)
    assert any(w.endswith("ed") for w in words) or name == "AgentHeartbeat", "events are named in the past tense"


# Units live in the field name and its doc: cpu in millicores, memory in MiB, times (and durations) in ms.
UNIT_SUFFIXES = {"_millicores": "millicores", "_mib": "MiB", "_ms": "ms"}  # name suffix -> word the doc must use
NEEDS_UNIT = re.compile(r"cpu|mem|time|duration|deadline|start|timeout|interval|delay|_at$")  # a quantity name
NUMBERS = {"int", "long", "float", "double"}


def numeric_fields(schema, path=""):
    """(dotted path, doc) of every record field anywhere in `schema` whose type is (or may be) a number."""
    if isinstance(schema, list):
        for branch in schema:
            yield from numeric_fields(branch, path)
    elif isinstance(schema, dict):
        if schema["type"] == "record":
            for f in schema["fields"]:
                types = f["type"] if isinstance(f["type"], list) else [f["type"]]
                if NUMBERS & {t if isinstance(t, str) else t.get("type") for t in types}:
                    yield f"{path}{f['name']}", f.get("doc", "")
                yield from numeric_fields(f["type"], f"{path}{f['name']}.")
        elif schema["type"] in ("array", "map"):
            yield from numeric_fields(schema.get("items", schema.get("values")), path)


@pytest.mark.parametrize("name", REG.event_names)
def test_every_quantity_states_its_unit(name):
    fields = list(numeric_fields(REG.reader(name).raw))
    assert any(p == "envelope.timestamp_ms" for p, _ in fields)  # the walk reaches nested records
    for path, doc in fields:
        leaf = path.rsplit(".", 1)[-1]
        suffix = next((s for s in UNIT_SUFFIXES if leaf.endswith(s)), None)
        if suffix is None:
            assert not NEEDS_UNIT.search(leaf), f"{name}.{path}: a quantity without a unit suffix {list(UNIT_SUFFIXES)}"
        else:
            assert re.search(rf"\b{UNIT_SUFFIXES[suffix]}\b", doc), f"{name}.{path}: doc does not say {UNIT_SUFFIXES[suffix]}"


def test_fingerprint_is_the_avro_spec_crc64_little_endian():
    # Avro specification test vector: CRC-64-AVRO of the canonical form of "int" is 0x7275d51a3f395c8f.
    assert build_schema({"type": "record", "name": "X", "fields": []}, None).fingerprint != b""
    assert bytes.fromhex(fingerprint('"int"', "CRC-64-AVRO")) == (0x7275D51A3F395C8F).to_bytes(8, "little")


def _job(**over):
    rec = {"envelope": {"event_id": "e", "entitlement": "e1", "entity_id": "j1", "timestamp_ms": 1,
                        "producer": "t", "schema_version": 1},
           "job_id": "j1", "name": "web", "tasks": 6, "command": ["sleep", "1"],
           "resources": {"cpu_millicores": 1000, "memory_mib": 2048}}
    rec.update(over)
    return rec


@pytest.mark.parametrize("record,path,message", [
    (_job(tasks="six"), "tasks", "expected int, got string 'six'"),
    (_job(resources={"cpu_millicores": 1.5, "memory_mib": 1}), "resources.cpu_millicores", "expected int"),
    (_job(resources={"memory_mib": 1}), "resources.cpu_millicores", "missing required field"),
    (_job(command="sleep 1"), "command", "expected an array"),
    (_job(command=["sleep", 1]), "command[1]", "expected string, got number 1"),
    (_job(requirements={"machine_type": 5}), "requirements.machine_type", "expected string"),
    (_job(colour="red"), "colour", "unknown field"),
    (_job(tasks=2**31), "tasks", "expected int"),
    (_job(tasks=True), "tasks", "expected int, got boolean"),
    ({k: v for k, v in _job().items() if k != "name"}, "name", "missing required field"),
    (_job(envelope={"event_id": "e"}), "envelope.entitlement", "missing required field"),
])
def test_invalid_records_name_the_field(record, path, message):
    with pytest.raises(InvalidEvent) as exc:
        REG.encode("JobSubmitted", record)
    assert exc.value.path == path
    assert message in exc.value.message


def test_defaults_are_filled():
    name, rec = REG.decode(REG.encode("JobSubmitted", _job()))
    assert (rec["spread"], rec["max_unavailable"], rec["requirements"], rec["envelope"]["causation_id"]) == \
        ("msb", 1, {}, None)


GOOD = REG.encode("JobSubmitted", _job())


@pytest.mark.parametrize("data,reason", [
    (None, NO_MARKER),
    (b"", NO_MARKER),
    (b"\xc3\x01abc", NO_MARKER),
    (b'{"job_id": "j1"}', NO_MARKER),
    (MARKER + b"\x00" * 8 + GOOD[10:], UNKNOWN_FINGERPRINT),
    (GOOD[:-4], MALFORMED),
    (GOOD + b"\x00", MALFORMED),
    (GOOD[:10] + b"\xff" * 12, MALFORMED),  # a varint that never ends
])
def test_decode_errors_have_reasons(data, reason):
    with pytest.raises(DecodeError) as exc:
        REG.decode(data)
    assert exc.value.reason == reason


def _evolved(name, mutate):
    raw = copy.deepcopy(dict(REG.reader(name).raw))
    mutate(raw)
    return build_schema(raw, None)


def test_newer_writer_read_by_older_reader_and_back():
    v2 = _evolved("JobStopped", lambda r: (r["fields"].append(
        {"name": "stopped_by", "type": "string", "default": "cli", "doc": "who"}), r.update({"ropewalk.version": 2})))
    new_reader = SchemaRegistry({**{n: REG.reader(n) for n in REG.event_names}, "JobStopped": v2})
    old_reader = SchemaRegistry.from_dir()
    rec_v2 = {"envelope": {"auth": None, **_job()["envelope"], "causation_id": None, "principal": None}, "job_id": "j1",
              "reason": "done", "stopped_by": "ops"}
    data_v2 = new_reader.encode("JobStopped", rec_v2)
    with pytest.raises(DecodeError) as exc:  # the old reader has not seen v2 yet
        old_reader.decode(data_v2)
    assert exc.value.reason == UNKNOWN_FINGERPRINT
    old_reader.learn(v2.to_json())  # what the consumer does from the _schemas topic
    assert old_reader.decode(data_v2) == ("JobStopped", {k: v for k, v in rec_v2.items() if k != "stopped_by"})
    new_reader.learn(REG.reader("JobStopped").to_json())  # likewise, v1 was published by its writer
    data_v1 = old_reader.encode("JobStopped", {k: v for k, v in rec_v2.items() if k != "stopped_by"})
    assert new_reader.decode(data_v1) == ("JobStopped", {**rec_v2, "stopped_by": "cli"})  # default filled


def test_incompatible_writer_is_reported():
    # A writer whose `job_id` is an int cannot be resolved to the reader's string.
    bad = _evolved("JobStopped", lambda r: r["fields"][1].update({"type": "int"}))
    reg = SchemaRegistry.from_dir()
    reg.learn(bad.to_json())
    with pytest.raises(DecodeError) as exc:
        reg.decode(MARKER + bad.fingerprint + _body(bad, {"envelope": _job()["envelope"], "job_id": 5, "reason": ""}))
    assert exc.value.reason == INCOMPATIBLE_SCHEMA


def test_unknown_event_name_is_reported():
    other = build_schema({"type": "record", "name": "ropewalk.events.SomethingNew", "fields": [
        {"name": "x", "type": "int"}]}, None)
    reg = SchemaRegistry.from_dir()
    reg.learn(other.to_json())
    with pytest.raises(DecodeError) as exc:
        reg.decode(MARKER + other.fingerprint + _body(other, {"x": 1}))
    assert exc.value.reason == UNKNOWN_EVENT


def _body(schema, record):
    buf = io.BytesIO()
    schemaless_writer(buf, schema.parsed, record)
    return buf.getvalue()


def test_schema_dir_names_match_files():
    schemas = load_schema_dir()
    files = [f for f in SCHEMAS_DIR.glob("*.avsc") if f.name != "Envelope.avsc"]
    assert len(schemas) == len(files) >= 31 and all(s.fullname == f"ropewalk.events.{n}" for n, s in schemas.items())
