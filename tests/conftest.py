"""Test fixtures: one real embedded broker and one real redis-server per test session, on their own ports
and run directory (so a developer's `ropewalk up` region is left alone); a fresh topic prefix per test.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from infra import services
from infra.config import Config
from infra.process import port_open

TEST_BROKER_PORT = int(os.environ.get("ROPEWALK_TEST_BROKER_PORT", "29092"))
TEST_REDIS_PORT = int(os.environ.get("ROPEWALK_TEST_REDIS_PORT", "26379"))


def _free_port(preferred: int) -> int:
    port = preferred
    while port_open(port):
        port += 1
    return port


@pytest.fixture(scope="session")
def infra_cfg(tmp_path_factory) -> Config:
    """A Config whose embedded broker and redis are started for this test session and stopped after."""
    run_dir = tmp_path_factory.mktemp("run")
    broker_port = _free_port(TEST_BROKER_PORT)
    cfg = Config.from_env({
        "ROPEWALK_BROKER_PORT": str(broker_port),
        "ROPEWALK_CONTROLLER_PORT": str(_free_port(broker_port + 1)),
        "ROPEWALK_REDIS_PORT": str(_free_port(TEST_REDIS_PORT)),
        "ROPEWALK_RUN_DIR": str(run_dir),
        "ROPEWALK_PARTITIONS": "4",
    })
    services.up(cfg)
    yield cfg
    services.down(cfg)


@pytest.fixture
def cfg(infra_cfg: Config) -> Config:
    """The session's infrastructure with a topic prefix of this test's own, topics provisioned."""
    from confluent_kafka.admin import AdminClient

    from streams.topics import Topics, provision

    c = infra_cfg.with_(topic_prefix=f"t{uuid.uuid4().hex[:8]}.")
    provision(AdminClient({"bootstrap.servers": c.bootstrap_servers}), Topics(c.topic_prefix, c.partitions))
    return c


@pytest.fixture(scope="session")
def registry():
    from streams.serde import SchemaRegistry

    return SchemaRegistry.from_dir()


@pytest.fixture
def schemas_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "schemas"


def sample_datum(schema, named=None, ns="", seed=0):
    """A valid datum for any Avro schema (raw JSON), every optional filled, deterministic by seed."""
    named = {} if named is None else named
    if isinstance(schema, list):
        non_null = [b for b in schema if b != "null"]
        return sample_datum(non_null[0], named, ns, seed) if non_null else None
    if isinstance(schema, str):
        full = schema if "." in schema or not ns else f"{ns}.{schema}"
        if schema in named or full in named:
            return sample_datum(named.get(schema) or named[full], named, ns, seed)
        return {"null": None, "boolean": True, "int": 7 + seed, "long": 1_795_000_000_000 + seed,
                "float": 1.5, "double": 2.5, "string": f"s{seed}", "bytes": b"\x00\xffb"}[schema]
    t = schema["type"]
    if t in ("record", "enum", "fixed"):
        full = schema["name"] if "." in schema["name"] else f"{schema.get('namespace', ns)}.{schema['name']}".lstrip(".")
        named[full] = schema
        inner = full.rsplit(".", 1)[0] if "." in full else ""
        if t == "record":
            return {f["name"]: sample_datum(f["type"], named, inner, seed + i) for i, f in enumerate(schema["fields"])}
        if t == "enum":
            return schema["symbols"][seed % len(schema["symbols"])]
        return b"x" * schema["size"]
    if t == "array":
        return [sample_datum(schema["items"], named, ns, seed + k) for k in range(2)]
    if t == "map":
        return {"k1": sample_datum(schema["values"], named, ns, seed)}
    return sample_datum(t, named, ns, seed)


@pytest.fixture(scope="session")
def make_sample():
    return sample_datum
