"""streams/batches.py: items cut into records below the broker's limit, and read back from either form."""
import io

import pytest
from fastavro import parse_schema, schemaless_writer

from streams import batches
from streams.batches import MAX_RECORD_BYTES, RecordTooLarge, json_bound, size_of, split
from streams.events import new_event
from streams.serde import SchemaRegistry
from streams.state import job_whole

REG = SchemaRegistry.from_dir()

SPLITS = {  # items (sizes), fixed, max_bytes, max_items -> sizes per part
    "nothing": ([], 0, 100, 10, []),
    "all in one": ([10, 10, 10], 0, 100, 10, [[10, 10, 10]]),
    "bytes bound": ([40, 40, 40], 10, 100, 10, [[40, 40], [40]]),
    "exactly at the bound": ([45, 45, 45], 10, 100, 10, [[45, 45], [45]]),
    "items bound": ([1] * 5, 0, 100, 2, [[1, 1], [1, 1], [1]]),
    "order kept": ([30, 80, 10], 0, 100, 10, [[30], [80, 10]]),
}


@pytest.mark.parametrize("sizes, fixed, max_bytes, max_items, expected", SPLITS.values(), ids=SPLITS)
def test_split(sizes, fixed, max_bytes, max_items, expected):
    assert split(sizes, fixed=fixed, size=lambda n: n, max_bytes=max_bytes, max_items=max_items) == expected


def test_an_item_that_cannot_fit_is_refused_not_sent():
    with pytest.raises(RecordTooLarge):
        split([95], fixed=10, size=lambda n: n, max_bytes=100)


SIZES = {  # value -> its Avro encoding must not exceed size_of
    "ascii": "task-1234", "utf-8": "tâche-ü-€", "int": 2**40, "list": ["a", "bb", "ccc"],
    "map": {"ROLE": "web", "PORT": "80"}, "nested": {"k": [{"a": 1, "b": None, "c": True}]},
}


@pytest.mark.parametrize("value", SIZES.values(), ids=SIZES)
def test_size_of_bounds_the_avro_encoding_from_above(value):
    schema = {"string": "string", "int": "long"}
    kinds = {str: "string", int: "long"}
    if isinstance(value, (str, int)):
        s = kinds[type(value)]
    elif isinstance(value, list):
        s = {"type": "array", "items": "string"}
    elif "ROLE" in value:
        s = {"type": "map", "values": "string"}
    else:
        s = {"type": "map", "values": {"type": "array", "items": {"type": "map", "values": ["null", "long", "boolean"]}}}
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(s), value)
    assert len(buf.getvalue()) <= size_of(value), schema
    assert len(buf.getvalue()) <= json_bound(value), schema  # the bound split's fast path relies on


BOUNDS = {  # the worst cases of JSON text against Avro bytes: short numbers, doubles, long strings, empties
    "digit": (7, "long"), "double": (0.5, "double"), "tiny double": (1e-05, "double"), "empty": ("", "string"),
    "8 KB string": ("x" * 8192, "string"), "null": (None, "null"), "bool": (False, "boolean"),
    "empty list": ([], {"type": "array", "items": "long"}),
    "non-ASCII string": ("é€" * 100, "string"), "most negative long": (-2**63, "long"),
    "record": ({"a": None, "b": 1}, {"type": "record", "name": "R", "fields": [
        {"name": "a", "type": ["null", "string"]}, {"name": "b", "type": "long"}]}),
}


@pytest.mark.parametrize("value, schema", BOUNDS.values(), ids=BOUNDS)
def test_json_bound_bounds_the_avro_encoding_from_above(value, schema):
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(schema), value)
    assert len(buf.getvalue()) <= json_bound(value)


def test_json_bound_takes_what_orjson_refuses():
    """orjson refuses an integer beyond 64 bits; the standard library's text bounds it (and keys that are not
    strings are written as strings, as the standard library does)."""
    assert json_bound([2**70]) == 3 * len("[1180591620717411303424]") + 10
    assert json_bound({1: "a"}) == 3 * len('{"1":"a"}') + 10


@pytest.mark.parametrize("n", [0, 1, 36, 5_000, 5_001, 40_000])
def test_the_fast_path_cuts_as_the_item_by_item_walk_would_where_it_applies(n):
    """Small lists are one part at once; lists that may not fit are cut by size_of, item by item."""
    items = [{"task_id": f"e1.job/{i}", "machine_id": f"dc1-msb{i % 70:02d}-r001-m{i % 50:03d}", "command": "START",
              "spec_version": 1, "reason": ""} for i in range(n)]
    walked = split(items, size=lambda item: size_of(item))  # not the default size: never the fast path
    assert split(items) == walked
    assert all(len(p) <= batches.MAX_ITEMS for p in walked) and sum(map(len, walked)) == n


def test_commands_reports_and_statuses_read_from_either_form():
    single = new_event("TaskCommanded", {"task_id": "j/0", "job_id": "j", "machine_id": "m1", "command": "STOP",
                                         "argv": [], "env": {}, "spec_version": 2, "reason": "r"},
                       entitlement="e1", entity_id="j/0", producer="scheduler", event_id="c1")
    batch = new_event("TasksCommanded", {"job_id": "j", "argv": ["x"], "env": {"A": "1"}, "part": 0, "parts": 1,
                                         "commands": [{"task_id": "j/0", "machine_id": "m1", "command": "STOP",
                                                       "spec_version": 2, "reason": "r"}]},
                      entitlement="e1", entity_id="j", producer="scheduler", event_id="b1")
    (a,), (b,) = batches.task_commands(single), batches.task_commands(batch)
    assert a == {**b, "command_id": "c1"}  # the same fields (a STOP carries no argv/env either way)
    assert b["command_id"] == batches.command_id("b1", 0)
    status = new_event("MachinesStatusChanged", {"status": "DOWN", "reason": "operator", "machines": [
        {"machine_id": "m1", "previous_status": "UP"}, {"machine_id": "m2", "previous_status": "UNHEALTHY"}]},
        entitlement="e1", entity_id="e1", producer="resourcebroker")
    assert batches.machine_statuses(status) == [
        {"machine_id": "m1", "status": "DOWN", "previous_status": "UP", "reason": "operator"},
        {"machine_id": "m2", "status": "DOWN", "previous_status": "UNHEALTHY", "reason": "operator"}]
    assert batches.machine_ids(status) == ["m1", "m2"]
    for ev in (single, batch, status):
        REG.encode(ev.type, ev.to_record(1))
    assert batches.task_reports(batch) == [] and batches.task_commands(status) == []


def test_the_bound_is_below_the_brokers_default_limit():
    assert MAX_RECORD_BYTES <= 900_000 < 1_048_576


# -- a job published in parts, read back whole (streams/state.py) ---------------------------------------------------

def test_a_job_published_in_parts_is_read_back_whole():
    def head(parts, tasks=()):
        return new_event("JobStatePublished", {"job_id": "j", "name": "j", "state": "pending", "spec_version": 1,
                                               "desired_tasks": 1200, "tasks": list(tasks), "last_reason": "",
                                               "deleted": False, "task_parts": parts, "task_count": 1200},
                         entitlement="e1", entity_id="j", producer="scheduler")
    rows = lambda lo, hi: [{"task_id": f"j/{i}"} for i in range(lo, hi)]  # noqa: E731
    parts = {0: rows(0, 500), 2: rows(1000, 1200), 1: rows(500, 1000), 3: rows(1200, 1300)}
    whole = job_whole(head(3), parts)
    assert [t["task_id"] for t in whole.payload["tasks"]] == [f"j/{i}" for i in range(1200)]  # parts 0..2 only
    small = head(0, rows(0, 3))
    assert job_whole(small, parts) is small  # tasks inside: as published
    assert [t["task_id"] for t in job_whole(head(3), {0: rows(0, 500)}).payload["tasks"]] == [
        f"j/{i}" for i in range(500)]  # a part not read yet: what there is (the topics are not ordered)
