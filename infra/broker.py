"""The embedded broker: Apache Kafka (4.x, KRaft, one combined broker/controller node), data on disk.

    proc = broker(cfg)      # a ManagedProcess; services.up/down/status start, stop and probe it

Where things are (``BrokerLayout``)::

    <project>/.kafka/libs/               the broker's jars, copied from Maven Central by infra/bootstrap.sh
                                         (pins in infra/kafka/pom.xml; nothing is downloaded at start)
    <run dir>/kafka/server.properties    written at every start from ``server_properties(cfg)``
    <run dir>/kafka/data/                the log: every topic, consumer-group offsets, faust changelogs,
                                         the KRaft metadata log. It survives ``down``/``up``; delete the
                                         run directory to start a region from nothing
    <run dir>/kafka/ports.json           the listener ports the data directory was formatted for
    <run dir>/broker.log                 the broker's own log (warnings, start, stop)

The first start formats the data directory (``kafka.tools.StorageTool format --standalone``: a new cluster id,
this node the only KRaft voter). A data directory formatted for other ports is refused with the reason: the
KRaft voter set records the controller's endpoint.

Tuning for one node (each setting with its reason in ``server_properties``): replication factor 1 everywhere,
topics created only by provisioning (``auto.create.topics.enable=false``), a new consumer group's first join
not held back, committed offsets that never expire while the region is down, and a log cleaner that looks for
work every few seconds so compacted topics compact soon after a segment rolls.
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from infra.config import PROJECT_ROOT, Config
from infra.process import InfraError, ManagedProcess

KAFKA_VERSION = "4.3.1"  # the pin in infra/kafka/pom.xml; checked against the jars present
POM = PROJECT_ROOT / "infra" / "kafka" / "pom.xml"
LOG4J_CONFIG = PROJECT_ROOT / "infra" / "kafka" / "log4j2.yaml"
LIBS = PROJECT_ROOT / ".kafka" / "libs"
MIN_JAVA = 17
START_TIMEOUT_S = 60.0  # a cold JVM on a loaded 2-core machine; measured ~3 s when idle
NODE_ID = 1
# Committed consumer offsets are kept this long after a group's last member left (Kafka's default is 7 days,
# after which a region that was `down` for a week would replay its whole history). Kafka takes an int.
OFFSETS_RETENTION_MINUTES = 2**31 - 1


@dataclass(frozen=True)
class BrokerLayout:
    root: Path  # <run dir>/kafka

    @classmethod
    def of(cls, cfg: Config) -> "BrokerLayout":
        return cls(Path(cfg.run_dir) / "kafka")

    data = property(lambda self: self.root / "data")
    properties = property(lambda self: self.root / "server.properties")
    ports = property(lambda self: self.root / "ports.json")
    formatted = property(lambda self: (self.root / "data" / "meta.properties").exists())


def server_properties(cfg: Config, layout: BrokerLayout) -> dict[str, str]:
    """The broker's configuration for one local node. Pure."""
    host = "127.0.0.1"
    return {
        "process.roles": "broker,controller",  # one JVM is the whole cluster
        "node.id": str(NODE_ID),
        "controller.quorum.bootstrap.servers": f"{host}:{cfg.controller_port}",
        "listeners": f"PLAINTEXT://{host}:{cfg.broker_port},CONTROLLER://{host}:{cfg.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{host}:{cfg.broker_port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(layout.data),
        # One node: every internal topic with one replica (the defaults, 3, cannot be met).
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "8",  # 50 by default: 50 log directories for one local region
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        # Topics exist because provisioning (streams/topics.py) or faust (its changelogs) created them, with
        # their partition counts and configs; a typo in a topic name is an error, not a new topic.
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
        # A new group's first join is not held back 3 s waiting for more members (Kafka's default suits big
        # clusters; here every worker start and every test would pay it).
        "group.initial.rebalance.delay.ms": "0",
        # Workers may ask for session timeouts down to 1 s (Kafka's floor is 6 s): the tests and the bench
        # lower them so a killed worker's partitions move in about 2 s (streams/faustwire.py keeps 6 s).
        "group.min.session.timeout.ms": "1000",
        "offsets.retention.minutes": str(OFFSETS_RETENTION_MINUTES),
        # The log cleaner wakes every second (default 15 s) so a compacted topic whose segment rolled is
        # compacted soon after; a topic says when its segments roll (segment.ms, streams/topics.py).
        "log.cleaner.backoff.ms": "1000",
        # Messages up to 1 MiB (Kafka's default), stated because Ropewalk's writers are sized against it.
        "message.max.bytes": str(1024 * 1024 + 12 * 1024),
        # Retention: every topic says its own (streams/topics.py); this is only for topics faust creates.
        "log.retention.ms": "-1",
    }


def java_binary() -> str:
    path = shutil.which("java")
    if path is None:
        raise InfraError(f"embedded broker: java is missing: install Java {MIN_JAVA}+ (`bash infra/bootstrap.sh` "
                         f"does, as root), or set ROPEWALK_BOOTSTRAP_SERVERS to a running Kafka")
    return path


def java_major(version_text: str) -> int | None:
    """The major version in `java -version`'s output ('openjdk version "17.0.15" ...' -> 17). Pure."""
    m = re.search(r'version "(\d+)(?:\.(\d+))?', version_text)
    if m is None:
        return None
    major = int(m.group(1))
    return int(m.group(2)) if major == 1 and m.group(2) else major


def check_libs() -> None:
    jar = LIBS / f"kafka_2.13-{KAFKA_VERSION}.jar"
    if not jar.exists():
        raise InfraError(f"embedded broker: {jar} is missing; run `bash infra/bootstrap.sh` (it copies Kafka "
                         f"{KAFKA_VERSION} from Maven Central)")


def jvm_argv(cfg: Config, main: str, *args: str, heap_mb: int | None = None) -> list[str]:
    heap = heap_mb or cfg.broker_heap_mb
    return [java_binary(), f"-Xmx{heap}m", f"-Xms{min(heap, 128)}m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
            "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", "-cp", f"{LIBS}/*", main, *args]


def write_config(cfg: Config, layout: BrokerLayout) -> None:
    layout.root.mkdir(parents=True, exist_ok=True)
    props = server_properties(cfg, layout)
    layout.properties.write_text("".join(f"{k}={v}\n" for k, v in props.items()))


def prepare(cfg: Config) -> None:
    """Write the configuration and, the first time, format the data directory. Refuses a data directory
    formatted for other ports (the KRaft voter set names the controller endpoint)."""
    check_libs()
    layout = BrokerLayout.of(cfg)
    ports = {"broker_port": cfg.broker_port, "controller_port": cfg.controller_port}
    write_config(cfg, layout)
    if layout.formatted:
        try:
            was = json.loads(layout.ports.read_text())
        except (OSError, ValueError):
            was = ports
        if was != ports:
            raise InfraError(
                f"embedded broker: its data in {layout.data} belongs to ports {was['broker_port']}/"
                f"{was['controller_port']}, not {cfg.broker_port}/{cfg.controller_port}; set "
                f"ROPEWALK_BROKER_PORT/ROPEWALK_CONTROLLER_PORT back, or remove {layout.root} to start from nothing")
        return
    cluster_id = new_cluster_id()
    argv = jvm_argv(cfg, "kafka.tools.StorageTool", "format", "--cluster-id", cluster_id, "--config",
                    str(layout.properties), "--standalone", heap_mb=256)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
        raise InfraError(f"embedded broker: formatting {layout.data} failed: {tail}")
    layout.ports.write_text(json.dumps(ports))


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64. Like Kafka's ``Uuid.randomUuid`` it never starts
    with '-', which the storage tool's argument parser would take for an option."""
    while (cid := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="))[0] == "-":
        pass
    return cid


def broker(cfg: Config, ready) -> ManagedProcess:
    check_libs()
    layout = BrokerLayout.of(cfg)
    return ManagedProcess(
        name="broker",
        argv=jvm_argv(cfg, "kafka.Kafka", str(layout.properties)),
        port=cfg.broker_port,
        extra_ports=((cfg.controller_port, "ROPEWALK_CONTROLLER_PORT"),),
        run_dir=cfg.run_dir,
        ready=ready,
        start_timeout_s=START_TIMEOUT_S,
        prepare=lambda: prepare(cfg),
    )
