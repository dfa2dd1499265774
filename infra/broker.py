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

**Authentication and authorization** (issue 12; ``security_properties``): the client listener is SASL_PLAINTEXT
with SCRAM-SHA-256, one Kafka user per principal of ``infra/credentials.py``; the ACLs of ``infra/acls.py`` are
enforced by Kafka's ``StandardAuthorizer`` (what no ACL allows is refused). The broker's own user ``broker`` (a
super user, with ``operator``) authenticates with PLAIN from the broker's JAAS configuration, on the KRaft controller
listener (SASL_PLAINTEXT too: nobody reaches the controller without it) and on the client listener, where it is
the only PLAIN user with ``operator``: Debian's kcat links librdkafka 2.0.2, whose SCRAM client Kafka 4 refuses
(a nonce bug fixed in librdkafka 2.6.1, confluentinc/librdkafka#4895), so ``<secrets>/kcat.conf`` logs the operator
in with PLAIN (on the loopback interface only). ``ensure_users`` (run by ``services.up`` once the broker answers)
creates or refreshes every principal's SCRAM credential as ``broker``, so a data directory formatted before SASL
existed gets its users too (measured: a region of the previous version resumes under SASL, jobs running). The
passwords are in ``<secrets>/kafka.json`` (0600); ``server.properties`` (which holds the broker's) is 0600.

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


LISTENER = "SASL_PLAINTEXT"  # the clients' listener (also the inter-broker one, unused with one node)
CLIENT_MECHANISM = "SCRAM-SHA-256"  # every principal (infra/credentials.py)
BROKER_MECHANISM = "PLAIN"  # the broker's own user, from its JAAS configuration
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


def security_properties(broker_user: str, broker_password: str, super_users: tuple[str, ...],
                        plain_users: dict[str, str] | None = None) -> dict[str, str]:
    """SASL on both listeners and the ACL authorizer (see the module docstring). ``plain_users`` (user -> password)
    may also log in with PLAIN on the client listener (the operator, for tools whose librdkafka cannot do SCRAM with
    Kafka 4). Pure."""
    plain_ok = {broker_user: broker_password, **(plain_users or {})}
    accounts = " ".join(f'user_{u}="{pw}"' for u, pw in plain_ok.items())
    plain = (f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{broker_user}" '
             f'password="{broker_password}" {accounts};')
    controller = (f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{broker_user}" '
                  f'password="{broker_password}" user_{broker_user}="{broker_password}";')
    return {
        "listener.security.protocol.map": f"{LISTENER}:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
        "inter.broker.listener.name": LISTENER,
        "sasl.enabled.mechanisms": f"{CLIENT_MECHANISM},{BROKER_MECHANISM}",
        "sasl.mechanism.inter.broker.protocol": BROKER_MECHANISM,
        f"listener.name.{LISTENER.lower()}.plain.sasl.jaas.config": plain,
        f"listener.name.{LISTENER.lower()}.scram-sha-256.sasl.jaas.config":
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        "listener.name.controller.sasl.enabled.mechanisms": BROKER_MECHANISM,
        "sasl.mechanism.controller.protocol": BROKER_MECHANISM,
        "listener.name.controller.plain.sasl.jaas.config": controller,
        "authorizer.class.name": AUTHORIZER,
        "super.users": ";".join(f"User:{u}" for u in super_users),
        "allow.everyone.if.no.acl.found": "false",
    }


def server_properties(cfg: Config, layout: BrokerLayout, security: dict[str, str] | None = None) -> dict[str, str]:
    """The broker's configuration for one local node, with ``security`` (``security_properties``). Pure."""
    host = "127.0.0.1"
    return {
        "process.roles": "broker,controller",  # one JVM is the whole cluster
        "node.id": str(NODE_ID),
        "controller.quorum.bootstrap.servers": f"{host}:{cfg.controller_port}",
        "listeners": f"{LISTENER}://{host}:{cfg.broker_port},CONTROLLER://{host}:{cfg.controller_port}",
        "advertised.listeners": f"{LISTENER}://{host}:{cfg.broker_port}",
        "controller.listener.names": "CONTROLLER",
        **(security or {}),
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
        # How often the broker deletes what a time-bounded topic no longer keeps (Kafka's default 5 min): a
        # retention is met within a minute (and a soak's compressed days see it: bench/experiments/soak.py).
        "log.retention.check.interval.ms": "60000",
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
    """server.properties (0600: it holds the broker's password), with the credentials of the secrets directory
    (made if missing)."""
    from infra import credentials

    layout.root.mkdir(parents=True, exist_ok=True)
    credentials.ensure(cfg.secrets, kafka=True, redis=False)
    me = credentials.kafka_credentials(cfg.secrets, credentials.BROKER_USER)
    operator = credentials.kafka_credentials(cfg.secrets, credentials.OPERATOR)
    props = server_properties(cfg, layout, security_properties(
        me.username, me.password, (me.username, operator.username), {operator.username: operator.password}))
    credentials.write_private(layout.properties, "".join(f"{k}={v}\n" for k, v in props.items()))


def admin_conf(cfg: Config) -> dict[str, str]:
    """confluent-kafka settings of the broker's own user (PLAIN): what ``ensure_users`` connects with."""
    from infra import credentials

    me = credentials.kafka_credentials(cfg.secrets, credentials.BROKER_USER)
    return {"bootstrap.servers": cfg.bootstrap_servers, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": BROKER_MECHANISM, "sasl.username": me.username, "sasl.password": me.password}


def ensure_users(cfg: Config, timeout_s: float = 30.0) -> list[str]:
    """Create (or refresh) the SCRAM credential of every principal of ``<secrets>/kafka.json``, as the broker's own
    user, and wait until the broker knows them all. Idempotent; returns the users."""
    import time

    from confluent_kafka.admin import (AdminClient, ScramCredentialInfo, ScramMechanism,
                                       UserScramCredentialUpsertion)

    from infra import credentials

    users = sorted(set(credentials.kafka_usernames(cfg.secrets).values()))
    admin = AdminClient({**admin_conf(cfg), "log_level": 0})
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, credentials.SCRAM_ITERATIONS)
    doc = credentials.read_json(cfg.secrets / credentials.KAFKA_FILE) or {}
    passwords = {v["username"]: v["password"] for v in (doc.get("principals") or {}).values()}
    upserts = [UserScramCredentialUpsertion(u, info, passwords[u].encode()) for u in users]
    for fut in admin.alter_user_scram_credentials(upserts, request_timeout=timeout_s).values():
        fut.result()
    deadline = time.monotonic() + timeout_s
    while True:  # the controller committed them; wait until the broker serving clients has them too
        try:
            known = admin.describe_user_scram_credentials(users, request_timeout=timeout_s)  # user -> future
            if all(known[u].result().scram_credential_infos for u in users):
                return users
        except Exception:  # noqa: BLE001 - a user not there yet is an error of the describe: ask again
            pass
        if time.monotonic() > deadline:
            raise InfraError(f"embedded broker: SCRAM users {', '.join(users)} not known {timeout_s:.0f}s after "
                             f"they were created")
        time.sleep(0.1)


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
