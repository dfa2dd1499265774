"""The embedded broker: Apache Kafka (4.x, KRaft), data on disk; one node by default, or a cluster of N nodes
(``ROPEWALK_BROKERS``, `ropewalk up --brokers 3`), one JVM per node, each a broker and a KRaft controller.

    programs(cfg)            # the nodes as the supervisor's programs; services.up runs them (supervised)
    broker(cfg, ready, node) # one node as a ManagedProcess (started alone: tests that stop it themselves)

Where things are (``BrokerLayout``)::

    <project>/.kafka/libs/               the broker's jars, copied from Maven Central by infra/bootstrap.sh
                                         (pins in infra/kafka/pom.xml; nothing is downloaded at start)
    <run dir>/kafka/                     one node: its root (below); N nodes: the cluster's, with
        cluster.json                     N nodes: the cluster id, each node's id, ports and KRaft directory id
        broker-<i>/                      N nodes: node i's root
    <root>/server.properties             written at every start from ``server_properties(cfg, node)``
    <root>/data/                         the log: every topic, consumer-group offsets, faust changelogs,
                                         the KRaft metadata log. It survives ``down``/``up``; delete the
                                         run directory to start a region from nothing
    <root>/ports.json                    one node: the listener ports the data directory was formatted for
    <run dir>/broker.log, broker-<i>.log the node's own log (warnings, start, stop, quorum elections)

The first start formats the data directories (``kafka.tools.StorageTool format``): one node with
``--standalone`` (a new cluster id, this node the only KRaft voter); N nodes with ``--initial-controllers`` (one
cluster id, every node a voter of the quorum, which survives the loss of a minority: one node of 3). Data
formatted for other ports, or for another number of nodes, is refused with the reason: the KRaft voter set
records the controllers' endpoints (growing a cluster is adding voters and reassigning partitions: not done here).

**Replication** (``server_properties``): one node keeps one replica of everything. N nodes (3 or more) replicate
every topic 3 times with ``min.insync.replicas=2`` (``streams/topics.py``: ``min_insync_replicas``): the broker's
defaults, which the internal topics (``__consumer_offsets``, ``__transaction_state``) and the topics faust creates
follow, and what provisioning asks for the catalogue's topics. With every producer ``acks=all`` and idempotent
(``streams/clients.py``, ``streams/faustwire.py``), a write acknowledged is on two nodes at least, and the loss of
any one node — the quorum's leader (the active controller) or a partition's leader — loses nothing acknowledged:
the controller fences the dead node and elects new leaders from the in-sync replicas (never an out-of-sync one:
``unclean.leader.election.enable=false``), and the node, started again by the region's supervisor
(``infra/supervisor.py``, ``services.up``), catches up from the leaders and rejoins the in-sync replicas.

**Authentication and authorization** (issue 12; ``security_properties``): the client listener is SASL_PLAINTEXT
with SCRAM-SHA-256, one Kafka user per principal of ``infra/credentials.py``; the ACLs of ``infra/acls.py`` are
enforced by Kafka's ``StandardAuthorizer`` (what no ACL allows is refused). The broker's own user ``broker`` (a
super user, with ``operator``) authenticates with PLAIN from the broker's JAAS configuration, on the KRaft controller
listener (SASL_PLAINTEXT too: nobody reaches the controller without it) and on the client listener, which is also
the nodes' replication listener; it is the only PLAIN user with ``operator``: Debian's kcat links librdkafka 2.0.2,
whose SCRAM client Kafka 4 refuses (a nonce bug fixed in librdkafka 2.6.1, confluentinc/librdkafka#4895), so
``<secrets>/kcat.conf`` logs the operator in with PLAIN (on the loopback interface only). ``ensure_users`` (run by
``services.up`` once the cluster answers) creates or refreshes every principal's SCRAM credential as ``broker``
(the credentials live in the KRaft metadata log: one write serves every node), and waits until every node
authenticates them, so a data directory formatted before SASL existed gets its users too (measured: a region of
the previous version resumes under SASL, jobs running). The passwords are in ``<secrets>/kafka.json`` (0600);
``server.properties`` (which holds the broker's) is 0600.

Tuning (each setting with its reason in ``server_properties``): topics created only by provisioning
(``auto.create.topics.enable=false``), a new consumer group's first join not held back, committed offsets that
never expire while the region is down, and a log cleaner that looks for work every few seconds so compacted topics
compact soon after a segment rolls.
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from infra import credentials
from infra.config import CLUSTER_FILE, PROJECT_ROOT, BrokerNode, Config, formatted_brokers
from infra.private import PRIVATE_UMASK, make_dir
from infra.process import InfraError, ManagedProcess
from infra.supervisor import Program
from streams.topics import min_insync_replicas

KAFKA_VERSION = "4.3.1"  # the pin in infra/kafka/pom.xml; checked against the jars present
POM = PROJECT_ROOT / "infra" / "kafka" / "pom.xml"
LOG4J_CONFIG = PROJECT_ROOT / "infra" / "kafka" / "log4j2.yaml"
LIBS = PROJECT_ROOT / ".kafka" / "libs"
MIN_JAVA = 17
# A cold JVM on a loaded 2-core machine; measured ~3 s when idle, more than 60 s twice at load 60-70 (three test
# runs beside each other): a deadline, not a wait, so a generous one costs nothing when the node is quick.
START_TIMEOUT_S = 180.0
# A cluster's nodes start together and elect their quorum: three cold JVMs on a loaded 2-core machine took more than
# 60 s to be ready after a whole region's power loss (the kill storm, load average 13), ~30 s each to reach Kafka's
# start alone.
CLUSTER_START_TIMEOUT_S = 180.0


def start_timeout_s(cfg: Config) -> float:
    """How long the embedded broker may take to be ready: one node, or a cluster (``CLUSTER_START_TIMEOUT_S``)."""
    return START_TIMEOUT_S if cfg.brokers == 1 else CLUSTER_START_TIMEOUT_S
NODE_ID = 1  # the one node's id (a cluster's nodes are 1..N)
NAME = "broker"  # the one node's process name (pid file, log); node i of a cluster is "broker-<i>"
# Committed consumer offsets are kept this long after a group's last member left (Kafka's default is 7 days,
# after which a region that was `down` for a week would replay its whole history). Kafka takes an int.
OFFSETS_RETENTION_MINUTES = 2**31 - 1


@dataclass(frozen=True)
class BrokerLayout:
    root: Path  # <run dir>/kafka (one node), <run dir>/kafka/broker-<i> (node i of a cluster)

    @classmethod
    def of(cls, cfg: Config, node: int = NODE_ID) -> "BrokerLayout":
        base = Path(cfg.run_dir) / "kafka"
        return cls(base if cfg.brokers == 1 else base / f"{NAME}-{node}")

    data = property(lambda self: self.root / "data")
    properties = property(lambda self: self.root / "server.properties")
    ports = property(lambda self: self.root / "ports.json")
    formatted = property(lambda self: (self.root / "data" / "meta.properties").exists())


def node_name(cfg: Config, node: int) -> str:
    """The process name of node ``node`` (its pid file, its log, its program in the supervisor)."""
    return NAME if cfg.brokers == 1 else f"{NAME}-{node}"


def node_names(cfg: Config) -> list[str]:
    return [node_name(cfg, n.id) for n in cfg.broker_nodes]


LISTENER = "SASL_PLAINTEXT"  # the clients' listener, also the nodes' replication listener
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


def server_properties(cfg: Config, layout: BrokerLayout, security: dict[str, str] | None = None,
                      node: BrokerNode | None = None) -> dict[str, str]:
    """The configuration of node ``node`` (default: the first) of ``cfg``'s embedded cluster, with ``security``
    (``security_properties``). Pure."""
    host = "127.0.0.1"
    nodes = cfg.broker_nodes
    me = node or nodes[0]
    rf = cfg.replication_factor or 1  # embedded: always set (infra/config.py)
    isr = min_insync_replicas(rf)
    # A cluster fences a node that stopped heartbeating after 4 s (Kafka's default 9 s), and only then elects new
    # leaders for its partitions: until then writes to them wait. The agents beat every 2 s and the health check
    # judges a machine silent after 10 s (processors/controlplane.py): with 9 s, the beats of the machines whose
    # heartbeats partition a killed node led arrived 11 s apart, and the health check failed those machines. A node
    # starved of CPU for 4 s is fenced too: it rejoins at its next heartbeat (its partitions' leaders moved meanwhile).
    failover = {"broker.session.timeout.ms": "4000", "broker.heartbeat.interval.ms": "1000"} if len(nodes) > 1 else {}
    return {
        "process.roles": "broker,controller",  # each JVM is a broker and a KRaft voter (combined mode)
        "node.id": str(me.id),
        "controller.quorum.bootstrap.servers": ",".join(f"{host}:{n.controller_port}" for n in nodes),
        "listeners": f"{LISTENER}://{host}:{me.port},CONTROLLER://{host}:{me.controller_port}",
        "advertised.listeners": f"{LISTENER}://{host}:{me.port}",
        "controller.listener.names": "CONTROLLER",
        **(security or {}),
        "log.dirs": str(layout.data),
        # Replication (the module docstring): one node, one replica of everything (Kafka's defaults, 3, cannot be
        # met); a cluster, 3 replicas and 2 in sync for a write (acks=all), internal topics included.
        "offsets.topic.replication.factor": str(rf),
        "offsets.topic.num.partitions": "8",  # 50 by default: 50 log directories for one local region
        "transaction.state.log.replication.factor": str(rf),
        "transaction.state.log.min.isr": str(isr),
        "transaction.state.log.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": str(rf),
        "share.coordinator.state.topic.min.isr": str(isr),
        "default.replication.factor": str(rf),
        "min.insync.replicas": str(isr),
        # A partition whose in-sync replicas are all gone waits for one of them rather than taking an out-of-sync
        # one as leader (which would drop what only the lost ones had). Kafka's default, stated: it is the rule
        # that makes "nothing acknowledged is lost" hold.
        "unclean.leader.election.enable": "false",
        **failover,
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


def jvm_argv(cfg: Config, main: str, *args: str, heap_mb: int | None = None, jmx_port: int | None = None) -> list[str]:
    heap = heap_mb or cfg.broker_heap_mb
    return [java_binary(), f"-Xmx{heap}m", f"-Xms{min(heap, 128)}m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
            "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true", *jmx_flags(jmx_port),
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", "-cp", f"{LIBS}/*", main, *args]


def jmx_flags(port: int | None) -> list[str]:
    """The JVM flags of a JMX port on 127.0.0.1 (``ROPEWALK_BROKER_JMX_PORT``: measurements read the broker's own
    request counts there, bench/brokerstats.py); none without a port. Unauthenticated and unencrypted: anyone on
    this machine who can reach the port can read and call the broker's MBeans, so it is opt-in, for a benchmark's
    own broker. Pure."""
    if port is None:
        return []
    return [f"-Dcom.sun.management.jmxremote.port={port}", f"-Dcom.sun.management.jmxremote.rmi.port={port}",
            "-Dcom.sun.management.jmxremote.host=127.0.0.1", "-Djava.rmi.server.hostname=127.0.0.1",
            "-Dcom.sun.management.jmxremote.authenticate=false", "-Dcom.sun.management.jmxremote.ssl=false"]


def jmx_port_of(cfg: Config, node_id: int) -> int | None:
    """Node ``node_id``'s JMX port (``ROPEWALK_BROKER_JMX_PORT`` + its index), None without one. Pure."""
    return None if cfg.broker_jmx_port is None else cfg.broker_jmx_port + node_id - 1


def write_config(cfg: Config, layout: BrokerLayout, node: BrokerNode | None = None) -> None:
    """server.properties of ``node`` (0600: it holds the broker's password), with the credentials of the secrets
    directory (made if missing)."""
    make_dir(Path(cfg.run_dir) / "kafka")  # 0700: the segments are the region's alone (infra/private.py)
    layout.root.mkdir(parents=True, exist_ok=True)
    credentials.ensure(cfg.secrets, kafka=True, redis=False)
    me = credentials.kafka_credentials(cfg.secrets, credentials.BROKER_USER)
    operator = credentials.kafka_credentials(cfg.secrets, credentials.OPERATOR)
    props = server_properties(cfg, layout, security_properties(
        me.username, me.password, (me.username, operator.username), {operator.username: operator.password}), node)
    credentials.write_private(layout.properties, "".join(f"{k}={v}\n" for k, v in props.items()))


def admin_conf(cfg: Config, node: BrokerNode | None = None) -> dict[str, str]:
    """confluent-kafka settings of the broker's own user (PLAIN): what ``ensure_users`` connects with; to ``node``
    alone if given."""
    me = credentials.kafka_credentials(cfg.secrets, credentials.BROKER_USER)
    servers = f"127.0.0.1:{node.port}" if node is not None else cfg.bootstrap_servers
    return {"bootstrap.servers": servers, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": BROKER_MECHANISM, "sasl.username": me.username, "sasl.password": me.password}


def ensure_users(cfg: Config, timeout_s: float = 30.0) -> list[str]:
    """Create (or refresh) the SCRAM credential of every principal of ``<secrets>/kafka.json``, as the broker's own
    user, and wait until the cluster knows them all: on one node, until it describes them; on several, until every
    node authenticates each of them. Idempotent; returns the users."""
    from confluent_kafka.admin import (AdminClient, ScramCredentialInfo, ScramMechanism,  # noqa: PLC0415 - start-up cost: confluent_kafka (~40 ms); `ropewalk down` imports this module (through infra.services) without using the broker
                                       UserScramCredentialUpsertion)

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
                break
        except Exception:  # noqa: BLE001 - a user not there yet is an error of the describe: ask again
            pass
        if time.monotonic() > deadline:
            raise InfraError(f"embedded broker: SCRAM users {', '.join(users)} not known {timeout_s:.0f}s after "
                             f"they were created")
        time.sleep(0.1)
    if cfg.brokers > 1:  # every node applies the metadata log on its own: each must authenticate every user

        pending = [(node, u) for node in cfg.broker_nodes for u in users]
        with ThreadPoolExecutor(8) as pool:
            while pending:
                ok = list(pool.map(lambda nu: authenticates(nu[0], nu[1], passwords[nu[1]]), pending))
                pending = [nu for nu, good in zip(pending, ok) if not good]
                if pending and time.monotonic() > deadline:
                    raise InfraError("embedded broker: SCRAM users not authenticated "
                                     f"{timeout_s:.0f}s after they were created: "
                                     + ", ".join(f"{u} on {node_name(cfg, n.id)}" for n, u in pending))
                if pending:
                    time.sleep(0.2)
    return users


def authenticates(node: BrokerNode, username: str, password: str, timeout_s: float = 5.0) -> bool:
    """Whether ``node`` lets ``username`` in with SCRAM (a metadata request on a connection to it alone)."""
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - start-up cost: confluent_kafka (~40 ms); `ropewalk down` imports this module (through infra.services) without using the broker

    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{node.port}", "security.protocol": "SASL_PLAINTEXT",
                         "sasl.mechanism": CLIENT_MECHANISM, "sasl.username": username, "sasl.password": password,
                         "log_level": 0})
    try:
        admin.list_topics(timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - refused (not known yet) or not answering: not authenticated
        return False


def prepare(cfg: Config) -> None:
    """Write every node's configuration and, the first time, format the data directories. Refuses data formatted
    for another number of nodes or other ports (the KRaft voter set names the controllers' endpoints)."""
    check_libs()
    check_held(cfg)
    if cfg.brokers == 1:
        prepare_node(cfg)
    else:
        prepare_cluster(cfg)


def check_held(cfg: Config) -> None:
    """InfraError when the run directory holds a cluster of another number of nodes than ``cfg`` asks for."""
    was = formatted_brokers(cfg.run_dir)
    if was is not None and was != cfg.brokers:
        kafka = Path(cfg.run_dir) / "kafka"
        raise InfraError(f"embedded broker: the data in {kafka} is a cluster of {was} node{'s' if was > 1 else ''}, "
                         f"not {cfg.brokers}: `ropewalk up --brokers {was}` (ROPEWALK_BROKERS={was}) resumes it; "
                         f"remove {kafka} to start from nothing")


def prepare_node(cfg: Config) -> None:
    """One node: its configuration; formatted as a standalone KRaft quorum the first time."""
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
    format_storage(cfg, [(layout, ("--standalone",))])
    layout.ports.write_text(json.dumps(ports))


def prepare_cluster(cfg: Config) -> None:
    """N nodes: ``cluster.json`` (written before any node is formatted, so a format cut short is finished with the
    same ids), each node's configuration, and the nodes not formatted yet formatted with every node a voter."""
    kafka = make_dir(Path(cfg.run_dir) / "kafka")
    want = [{"id": n.id, "port": n.port, "controller_port": n.controller_port} for n in cfg.broker_nodes]
    path = kafka / CLUSTER_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = None
    if doc is None:
        doc = {"cluster_id": new_cluster_id(), "nodes": [{**w, "directory_id": new_cluster_id()} for w in want]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(path)
    was = [{k: n[k] for k in ("id", "port", "controller_port")} for n in doc["nodes"]]
    if was != want:
        ports = lambda nodes: ", ".join(f"{n['port']}/{n['controller_port']}" for n in nodes)  # noqa: E731
        raise InfraError(f"embedded broker: the cluster in {kafka} belongs to ports {ports(was)}, not {ports(want)}; "
                         f"set ROPEWALK_BROKER_PORT/ROPEWALK_CONTROLLER_PORT back, or remove {kafka} to start from "
                         f"nothing")
    voters = ",".join(f"{n['id']}@127.0.0.1:{n['controller_port']}:{n['directory_id']}" for n in doc["nodes"])
    todo = []
    for node in cfg.broker_nodes:
        layout = BrokerLayout.of(cfg, node.id)
        write_config(cfg, layout, node)
        if not layout.formatted:
            todo.append((layout, ("--initial-controllers", voters)))
    format_storage(cfg, todo, doc["cluster_id"])


def format_storage(cfg: Config, nodes: list[tuple[BrokerLayout, tuple[str, ...]]], cluster_id: str | None = None
                   ) -> None:
    """Format the data directories of ``nodes`` ((layout, the storage tool's quorum arguments)) for the cluster
    ``cluster_id`` (None: a new one), the tools run side by side."""
    cluster_id = cluster_id or new_cluster_id()
    runs = [(layout, subprocess.Popen(
        jvm_argv(cfg, "kafka.tools.StorageTool", "format", "--cluster-id", cluster_id, "--config",
                 str(layout.properties), *quorum, heap_mb=256),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, umask=PRIVATE_UMASK)) for layout, quorum in nodes]
    failed = []
    for layout, run in runs:
        try:
            out, _ = run.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            run.kill()
            out, _ = run.communicate()
        if run.returncode != 0:
            failed.append(f"formatting {layout.data} failed: " + " | ".join(out.strip().splitlines()[-3:]))
    if failed:
        raise InfraError("embedded broker: " + "; ".join(failed))


def new_cluster_id() -> str:
    """A KRaft cluster id (or directory id): 16 random bytes, URL-safe base64. Like Kafka's ``Uuid.randomUuid`` it
    never starts with '-', which the storage tool's argument parser would take for an option."""
    while (cid := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="))[0] == "-":
        pass
    return cid


def broker(cfg: Config, ready, node: BrokerNode | None = None) -> ManagedProcess:
    """Node ``node`` (default: the first) as a ManagedProcess; its ``prepare`` prepares the whole cluster."""
    check_libs()
    node = node or cfg.broker_nodes[0]
    layout = BrokerLayout.of(cfg, node.id)
    port_var = "ROPEWALK_BROKER_PORT" + (f" (node {node.id} listens on it + {2 * (node.id - 1)})"
                                         if node.id > 1 else "")
    controller_var = "ROPEWALK_CONTROLLER_PORT" + (f" (node {node.id}'s controller listens on it + "
                                                   f"{2 * (node.id - 1)})" if node.id > 1 else "")
    return ManagedProcess(
        name=node_name(cfg, node.id),
        argv=jvm_argv(cfg, "kafka.Kafka", str(layout.properties), jmx_port=jmx_port_of(cfg, node.id)),
        port=node.port,
        port_var=port_var,
        extra_ports=((node.controller_port, controller_var),),
        run_dir=cfg.run_dir,
        ready=ready,
        start_timeout_s=START_TIMEOUT_S,
        prepare=lambda: prepare(cfg),
    )


def programs(cfg: Config) -> list:
    """The nodes as the region supervisor's programs (services: started before the workers, stopped after them)."""
    check_libs()
    return [Program(node_name(cfg, n.id), tuple(jvm_argv(cfg, "kafka.Kafka", str(BrokerLayout.of(cfg, n.id).properties),
                                                         jmx_port=jmx_port_of(cfg, n.id))),
                    service=True) for n in cfg.broker_nodes]


def quorum_leader(cfg: Config) -> int | None:
    """The KRaft quorum's leader (the active controller) as the nodes' own ``quorum-state`` files say: the leader
    of the highest epoch any node recorded (None: no node knows one). Files only: cheap, no request."""
    best: tuple[int, int] | None = None  # (epoch, leader)
    for node in cfg.broker_nodes:
        path = BrokerLayout.of(cfg, node.id).data / "__cluster_metadata-0" / "quorum-state"
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        leader, epoch = doc.get("leaderId", -1), doc.get("leaderEpoch", -1)
        if leader is not None and leader >= 0 and (best is None or epoch > best[0]):
            best = (epoch, leader)
    return best[1] if best else None
