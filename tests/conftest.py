"""Test fixtures: one real embedded broker and one real redis-server per test session, on their own ports
and run directory (so a developer's `ropewalk up` region is left alone); a fresh topic prefix per test.
"""
from __future__ import annotations

import atexit
import os
import uuid
from concurrent.futures import wait
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from infra import acls, services
from infra.config import Config
from infra.process import free_ports, tie_regions_to_this_process
from streams.serde import SchemaRegistry
from streams.topics import Topics, provision

# Ports of the session's broker, its controller and redis-server; by default free ones picked at random (below
# the ephemeral range: infra.process.SERVICE_PORTS).
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"  # the brokers' JIT in tests (pytest_configure)
TEST_PORTS = {var: os.environ.get(f"ROPEWALK_TEST_{var}") for var in ("BROKER_PORT", "CONTROLLER_PORT", "REDIS_PORT")}


def pytest_configure(config):
    """Every region and process the tests start stops when this test process ends, however it ends (a SIGKILL by a
    CI timeout included): the supervisors watch it, and processes it starts directly get a death signal with it
    (infra/process.py, STOP_WITH_VAR).

    Every broker the tests start runs its JVM with the C1 compiler only (``JDK_JAVA_OPTIONS``, read by the `java`
    launcher, reaches the brokers of regions started with an environment cleared of ``ROPEWALK_*`` too). Measured on
    a `ropewalk up --machines 24`: the broker's CPU from start to ready 11.0 s -> 5.9 s, to a minute later 21.8 s ->
    13.4 s, the region ready 12.7 s -> 11.1 s. A test region lives minutes under small loads, where C2's compiling
    costs more than it ever gives back; a benchmark's broker (`ropewalk bench`, run as a command) keeps the default."""
    tie_regions_to_this_process()
    os.environ.setdefault("JDK_JAVA_OPTIONS", TEST_JVM_OPTIONS)


@pytest.fixture(scope="session")
def infra_cfg(tmp_path_factory) -> Config:
    """A Config whose embedded broker and redis are started for this test session and stopped after."""
    run_dir = tmp_path_factory.mktemp("run")
    picked = iter(free_ports(3))
    ports = {var: given or str(next(picked)) for var, given in TEST_PORTS.items()}
    cfg = Config.from_env({
        **{f"ROPEWALK_{var}": port for var, port in ports.items()},
        "ROPEWALK_RUN_DIR": str(run_dir),
        "ROPEWALK_PARTITIONS": "4",
    })
    try:
        services.up(cfg)
    except BaseException:
        services.down(cfg)  # what it started (the supervisor, a node not yet ready) goes with the failed session
        raise
    # Processes the tests start (processors, the CLI) find the session's credentials here, whatever run directory
    # their environment names (most pass only ROPEWALK_BOOTSTRAP_SERVERS / ROPEWALK_REDIS_URL); and the CLI they
    # run writes to the log itself (there is no API in these regions; RegionCli, which runs `ropewalk up`, uses
    # the API and drops this).
    saved = {k: os.environ.get(k) for k in ("ROPEWALK_SECRETS_DIR", "ROPEWALK_DIRECT")}
    os.environ.update({"ROPEWALK_SECRETS_DIR": str(cfg.secrets), "ROPEWALK_DIRECT": "1"})
    yield cfg
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    services.down(cfg)


@pytest.fixture(autouse=True)
def session_broker_alive(request):
    """After each test that used the session's services: the broker and redis-server still run. A service that
    died (a CI machine's open-files limit once ended the broker near the end of the suite) fails the test that
    saw it die, with the tail of its log, instead of every later test with "Connection refused"."""
    yield
    if "infra_cfg" not in request.fixturenames:
        return
    cfg = request.getfixturevalue("infra_cfg")
    for name, st in services.running(cfg).items():
        if not st["running"]:
            log = Path(st["log"])
            tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else ["(no log)"]
            pytest.fail(f"the session's {name} died during this test; the end of {log}:\n" + "\n".join(tail))


class Janitor(list):
    """Requests the session does not wait for test by test (deleting each test region's ACLs: 0.15 s each), on an
    admin client that outlives them; waited for when the session ends."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.admin = AdminClient({**cfg.kafka_conf(), "log_level": 0})

    def finish(self, timeout_s: float = 60.0) -> None:
        """Wait for them all, ``timeout_s`` in all (not each: CI once waited 30 s for each of many requests a
        broker never answered, past the teardown's 300 s)."""
        wait([fut for futures in self for fut in futures], timeout=timeout_s)


@pytest.fixture(scope="session")
def janitor(infra_cfg):
    j = Janitor(infra_cfg)
    yield j
    j.finish()


def drop_topics(cfg: Config, janitor: Janitor | None = None) -> None:
    """Delete every topic of ``cfg``'s prefix (the catalogue's and faust's changelogs): the session's broker holds
    one open file per partition, and a suite that kept every test's topics reached ~5,000 of them."""
    admin = AdminClient({**cfg.kafka_conf()})
    names = [t for t in admin.list_topics(timeout=15).topics if t.startswith(cfg.topic_prefix)]
    for fut in admin.delete_topics(names, operation_timeout=15).values() if names else ():
        try:
            fut.result()
        except Exception:  # noqa: BLE001 - already gone; the next test has a prefix of its own anyway
            pass
    if janitor is not None:  # the region's ACLs go too, without waiting (the janitor waits at the end)
        janitor.append(acls.drop_region(cfg, janitor.admin, wait=False))


@pytest.fixture
def cfg(infra_cfg: Config, janitor: Janitor) -> Config:
    """The session's infrastructure with a topic prefix of this test's own, topics provisioned."""
    c = infra_cfg.with_(topic_prefix=f"t{uuid.uuid4().hex[:8]}.")
    admin = AdminClient({**c.kafka_conf()})
    provision(admin, Topics(c.topic_prefix, c.partitions))
    acls.provision_region(c, admin)  # what each principal may do in this test's region (infra/acls.py)
    yield c
    drop_topics(c, janitor)


def pytest_unconfigure(config):
    """After the summary: librdkafka clients a test left open keep printing "Connection refused" once the
    session's broker is stopped, until the process ends; they would bury the summary at the end of CI's log.
    (At exit: pytest restores its own stderr after this hook.)"""
    def quiet() -> None:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        except OSError:
            pass

    atexit.register(quiet)


@pytest.fixture(scope="session")
def registry():
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


INTEGRATION = Path(__file__).resolve().parent / "integration"


# The longest files (45-240 s each under `make test`), longest first: `make test` hands files to its workers in
# collection order (``--dist loadfile --no-loadscope-reorder``: pytest-xdist's default reorders files by their
# number of tests, which put these one-test files last, three of them side by side at the very end), and one of
# these started last would leave the other workers idle for its length. Measured in a fresh-clone run (3 workers,
# 2026-11-28); the rest follow in their usual order.
LONG_FIRST = ("test_durable.py", "test_history_region.py", "test_killstorm.py", "test_trust.py", "test_ui_browser.py",
              "test_supervised_region.py", "test_bad_records.py", "test_operator_view.py", "test_readme_examples.py",
              "test_health_processor.py", "test_history_bench.py", "test_archive.py", "test_bench_smoke.py",
              "test_soak.py", "test_figure14_pipeline_cli.py", "test_scaleout.py", "test_rebalance_region.py",
              "test_agent_process.py", "test_scheduler_shard.py", "test_power.py", "test_powerloss_experiment.py",
              "test_shadow_bench.py", "test_scheduler_recovery.py", "test_supervisor.py")


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    """Every test under tests/integration is marked ``integration`` here, in one place (``-m "not integration"``
    runs the pure tests alone); a module does not mark itself. (Not in a tests/integration/conftest.py: the tests
    import ``conftest`` by name for its helpers, and a second one would shadow this one.) The ``LONG_FIRST`` files
    go first, in that order."""
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: the rest keep their order
