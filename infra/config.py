"""Configuration from environment variables, so that pointing Ropewalk at a real Kafka cluster and a
real Redis needs no code change.

| variable                    | default                              | meaning                                   |
|-----------------------------|--------------------------------------|-------------------------------------------|
| ROPEWALK_BOOTSTRAP_SERVERS  | 127.0.0.1:$ROPEWALK_BROKER_PORT       | Kafka bootstrap servers. When set, `up` does not start the embedded broker. |
| ROPEWALK_REDIS_URL          | redis://127.0.0.1:$ROPEWALK_REDIS_PORT/0 | Redis. When set, `up` does not start a private redis-server. `redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`: the primary Redis Sentinel names SERVICE, followed across a failover (``redis_client``) |
| ROPEWALK_BROKER_PORT        | 19092                                | port of the embedded broker (its clients) |
| ROPEWALK_CONTROLLER_PORT    | $ROPEWALK_BROKER_PORT + 1            | port of the embedded broker's KRaft controller |
| ROPEWALK_BROKERS            | the run dir's cluster, else 1        | nodes of the embedded Kafka cluster (1, or 3 and more: `ropewalk up --brokers N`); node i (0-based) listens on $ROPEWALK_BROKER_PORT + 2i and its controller on $ROPEWALK_CONTROLLER_PORT + 2i |
| ROPEWALK_REPLICATION_FACTOR | embedded: 1, or 3 with 3+ nodes; external: the cluster's brokers, at most 3 | replicas of every topic Ropewalk creates (its catalogue, faust's changelogs); `min.insync.replicas` follows (streams/topics.py, ``min_insync_replicas``) |
| ROPEWALK_BROKER_HEAP_MB     | 512                                  | the embedded broker's Java heap (-Xmx), of each node |
| ROPEWALK_BROKER_JMX_PORT    | unset                                | the embedded broker's JMX port on 127.0.0.1 (node i on it + i), unauthenticated: for measurements (the bench reads the broker's request counts there, bench/brokerstats.py); unset, no JMX port |
| ROPEWALK_REDIS_PORT         | 16379                                | port of the private redis-server          |
| ROPEWALK_RUN_DIR            | <project>/.run                       | pids, logs, redis dir, archives           |
| ROPEWALK_PARTITIONS         | 8                                    | partitions of every entitlement-keyed topic |
| ROPEWALK_TOPIC_PREFIX       | ""                                   | prefix of every topic name (isolates tests, or several regions on one cluster) |
| ROPEWALK_MAX_TASKS_PER_JOB  | 25000                                | the most tasks a job may have: `job submit` refuses more, the scheduler rejects more with a reason (Twine's largest jobs have ~15K tasks) |
| ROPEWALK_JOB_GC_S           | 3600                                 | how long a job stopped and gone (or a refused submission) stays in the scheduler's state, `state.jobs` and the Job Control Plane's state before it leaves them (`job status` shows it until then; processors/scheduler/README.md "Stopped jobs leave") |
| ROPEWALK_SECRETS_DIR        | $ROPEWALK_RUN_DIR/secrets            | credentials of the principals (Kafka SASL, Redis users), the API's users file and the admin token (infra/credentials.py) |
| ROPEWALK_API_PORT           | 19080                                | port of the HTTP API `up` starts (processors/api) |
| ROPEWALK_API_URL            | http://127.0.0.1:$ROPEWALK_API_PORT  | where the CLI finds the API |
| ROPEWALK_TOKEN              | the token in $ROPEWALK_SECRETS_DIR/token | the CLI's API token (a user made by `ropewalk user add`) |
| ROPEWALK_DIRECT             | unset                                | `1`: the CLI writes to and reads the log itself as principal `operator`, not through the API (as `--direct`) |
| ROPEWALK_METRICS_ADDR       | 127.0.0.1:0                          | HOST:PORT a worker serves its Prometheus metrics on (infra/metrics.py; a worker on another machine) |

**Endpoints remembered** (like a kubeconfig): `ropewalk up` writes the endpoint variables it was started with to
``$ROPEWALK_RUN_DIR/endpoints.json`` (``remember_endpoints``); a later process whose environment sets none of
``ENDPOINT_VARS`` takes them from there, so a new shell finds the region its last `up` started. When that region
is gone (its external broker no longer answers), `up` says the endpoints were remembered and where; `ropewalk down
--forget` (``forget_endpoints``) removes the file.

Which principal a process authenticates as is ``Config.principal``: ``operator`` unless the process names its own
(``Config.as_principal``: every processor's main does); its credentials come from the secrets directory.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote

from infra import credentials
from infra.credentials import PRINCIPALS

PROJECT_ROOT = Path(__file__).resolve().parents[1]

DEFAULT_BROKER_PORT = 19092
DEFAULT_REDIS_PORT = 16379
DEFAULT_PARTITIONS = 8
DEFAULT_BROKER_HEAP_MB = 512
DEFAULT_API_PORT = 19080
MAX_BROKERS = 9  # nodes of the embedded cluster, each a JVM on this machine
REPLICATED_FROM = 3  # an embedded cluster of this many nodes or more replicates every topic this many times
CLUSTER_FILE = "cluster.json"  # <run dir>/kafka/cluster.json: an embedded cluster's nodes (infra/broker.py)
DEFAULT_PRINCIPAL = "operator"  # the CLI's direct path, `up`, tests (infra/credentials.py)
# Twine (OSDI 2020, §5 "the largest job has ≈15K tasks"): 25,000 serves every job the paper reports, with room.
DEFAULT_MAX_TASKS_PER_JOB = 25_000
# A job stopped and freed (or refused) leaves the scheduler's state this long after (Nomad keeps a dead job until its
# garbage collection: a user still sees a recently stopped job). Far above the producer's delivery timeout and the
# allocator's journal (DONE_TTL_S, an hour): processors/scheduler/README.md, "Stopped jobs leave".
DEFAULT_JOB_GC_S = 3600
DEFAULT_JOB_GC_MS = DEFAULT_JOB_GC_S * 1000  # the same, as the decisions take it (log times in ms)
ENDPOINT_VARS = ("ROPEWALK_BOOTSTRAP_SERVERS", "ROPEWALK_REDIS_URL", "ROPEWALK_BROKER_PORT", "ROPEWALK_REDIS_PORT",
                 "ROPEWALK_CONTROLLER_PORT", "ROPEWALK_BROKERS", "ROPEWALK_REPLICATION_FACTOR", "ROPEWALK_PARTITIONS", "ROPEWALK_TOPIC_PREFIX", "ROPEWALK_SECRETS_DIR",
                 "ROPEWALK_API_PORT", "ROPEWALK_API_URL")
ENDPOINTS_FILE = "endpoints.json"


def _run_dir(env: dict[str, str]) -> Path:
    return Path(env.get("ROPEWALK_RUN_DIR") or PROJECT_ROOT / ".run")


def remember_endpoints(env: dict[str, str] | None = None) -> Path:
    """Write the endpoint variables of ``env`` (default: this process's) to ``<run dir>/endpoints.json``, for the
    processes started later without them (``Config.from_env``)."""
    env = dict(os.environ if env is None else env)
    path = _run_dir(env) / ENDPOINTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({k: env[k] for k in ENDPOINT_VARS if env.get(k)}, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def remembered_endpoints(env: dict[str, str]) -> dict[str, str]:
    """What the last `up` of ``env``'s run dir remembered (empty when nothing, or when ``env`` sets an endpoint
    variable itself: then it names its region and nothing is mixed in)."""
    if any(env.get(k) for k in ENDPOINT_VARS):
        return {}
    try:
        doc = json.loads((_run_dir(env) / ENDPOINTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: str(v) for k, v in doc.items() if k in ENDPOINT_VARS} if isinstance(doc, dict) else {}


def remembered_from(env: dict[str, str]) -> Path | None:
    """The endpoints file a process of ``env`` takes its endpoints from (``remembered_endpoints`` not empty), or
    None: what a failure to reach them says (`ropewalk up`: they came from an earlier `up`, and how to forget)."""
    return _run_dir(env) / ENDPOINTS_FILE if remembered_endpoints(env) else None


def forget_endpoints(env: dict[str, str] | None = None) -> Path | None:
    """Remove ``<run dir>/endpoints.json`` (`ropewalk down --forget`): later processes without endpoint variables
    use the defaults again. The path removed, or None when there was none."""
    path = _run_dir(dict(os.environ if env is None else env)) / ENDPOINTS_FILE
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return path


@dataclass(frozen=True)
class BrokerNode:
    """One node of the embedded Kafka cluster: its KRaft node id (1..N) and its two ports."""

    id: int
    port: int  # clients, and the other nodes' replication
    controller_port: int  # the KRaft controller (the quorum's votes and metadata)


def broker_nodes(brokers: int, broker_port: int, controller_port: int) -> tuple[BrokerNode, ...]:
    """The nodes of an embedded cluster of ``brokers``: node i+1 on ``broker_port + 2i`` and ``controller_port + 2i``
    (the defaults: 19092/19093, 19094/19095, 19096/19097). ValueError when two of their ports coincide. Pure."""
    nodes = tuple(BrokerNode(i + 1, broker_port + 2 * i, controller_port + 2 * i) for i in range(brokers))
    ports = [p for n in nodes for p in (n.port, n.controller_port)]
    if len(set(ports)) != len(ports):
        raise ValueError(f"ROPEWALK_BROKER_PORT={broker_port} and ROPEWALK_CONTROLLER_PORT={controller_port} give "
                         f"the {brokers} broker nodes overlapping ports (node i listens on both + 2i): move one")
    return nodes


def check_brokers(brokers: int) -> int:
    """``brokers`` if an embedded cluster can have that many nodes, else ValueError naming why. Pure."""
    if brokers == 2 or not 1 <= brokers <= MAX_BROKERS:
        raise ValueError(f"brokers must be 1 or 3..{MAX_BROKERS}, got {brokers} (a KRaft quorum of 2 survives the "
                         f"loss of neither node)")
    return brokers


@dataclass(frozen=True)
class Config:
    bootstrap_servers: str
    redis_url: str
    broker_port: int
    redis_port: int
    controller_port: int  # the embedded broker's KRaft controller listener
    broker_heap_mb: int  # the embedded broker's -Xmx
    run_dir: Path
    partitions: int
    topic_prefix: str
    embedded_broker: bool  # True when Ropewalk itself runs the broker (no ROPEWALK_BOOTSTRAP_SERVERS)
    embedded_redis: bool  # True when Ropewalk itself runs redis-server (no ROPEWALK_REDIS_URL)
    brokers: int = 1  # nodes of the embedded cluster (ROPEWALK_BROKERS)
    # Replicas of the topics Ropewalk creates; None: as many as the (external) cluster has brokers, at most
    # REPLICATED_FROM, asked where a topic is created (streams/topics.replication_factor)
    replication_factor: int | None = 1
    max_tasks_per_job: int = DEFAULT_MAX_TASKS_PER_JOB  # job submit and the scheduler refuse bigger jobs
    job_gc_s: float = DEFAULT_JOB_GC_S  # a stopped job's grace in the scheduler's state (and the history's)
    secrets_dir: Path | None = None  # credentials (infra/credentials.py); None: <run_dir>/secrets
    principal: str = DEFAULT_PRINCIPAL  # who this process is on the broker and in Redis
    api_port: int = DEFAULT_API_PORT
    api_url: str = ""  # where the CLI finds the API; "": http://127.0.0.1:<api_port>
    broker_jmx_port: int | None = None  # the embedded broker's JMX port (ROPEWALK_BROKER_JMX_PORT; None: none)
    kafka_log_level: int = 3  # librdkafka's own log lines (syslog levels: 3 errors) of producers and consumers; the
    #                           CLI sets 0: its one error line says what failed (a reader closed mid-handshake logs
    #                           a SASL error that means nothing)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Config":
        if env is None:  # this process's environment, with the endpoints of the last `up` it does not set
            env = dict(os.environ)
            env = {**remembered_endpoints(env), **env}
        env = dict(env)
        broker_port = _int(env, "ROPEWALK_BROKER_PORT", DEFAULT_BROKER_PORT)
        redis_port = _int(env, "ROPEWALK_REDIS_PORT", DEFAULT_REDIS_PORT)
        bootstrap = env.get("ROPEWALK_BOOTSTRAP_SERVERS", "").strip()
        redis_url = env.get("ROPEWALK_REDIS_URL", "").strip()
        partitions = _int(env, "ROPEWALK_PARTITIONS", DEFAULT_PARTITIONS)
        heap = _int(env, "ROPEWALK_BROKER_HEAP_MB", DEFAULT_BROKER_HEAP_MB)
        if heap < 128:
            raise ValueError(f"ROPEWALK_BROKER_HEAP_MB must be >= 128, got {heap}")
        if partitions < 1:
            raise ValueError(f"ROPEWALK_PARTITIONS must be >= 1, got {partitions}")
        max_tasks = _int(env, "ROPEWALK_MAX_TASKS_PER_JOB", DEFAULT_MAX_TASKS_PER_JOB)
        if max_tasks < 1:
            raise ValueError(f"ROPEWALK_MAX_TASKS_PER_JOB must be >= 1, got {max_tasks}")
        job_gc_s = _seconds(env, "ROPEWALK_JOB_GC_S", DEFAULT_JOB_GC_S)
        run_dir = _run_dir(env)
        api_port = _int(env, "ROPEWALK_API_PORT", DEFAULT_API_PORT)
        sentinel_of(redis_url)  # a sentinel URL that cannot be used is refused here, naming what is wrong
        controller_port = _int(env, "ROPEWALK_CONTROLLER_PORT", broker_port + 1)
        try:
            brokers = check_brokers(_int(env, "ROPEWALK_BROKERS", 0) or (1 if bootstrap else held_brokers(run_dir)))
        except ValueError as exc:
            raise ValueError(f"ROPEWALK_BROKERS: {exc}") from None
        nodes = broker_nodes(brokers, broker_port, controller_port) if not bootstrap else ()
        rf = _int(env, "ROPEWALK_REPLICATION_FACTOR", 0) if env.get("ROPEWALK_REPLICATION_FACTOR") else None
        if rf is not None and (rf < 1 or (not bootstrap and rf > brokers)):
            raise ValueError(f"ROPEWALK_REPLICATION_FACTOR must be 1..{brokers if not bootstrap else 'the brokers'}"
                             f", got {rf}")
        return cls(
            bootstrap_servers=bootstrap or ",".join(f"127.0.0.1:{n.port}" for n in nodes),
            redis_url=redis_url or f"redis://127.0.0.1:{redis_port}/0",
            broker_port=broker_port,
            redis_port=redis_port,
            controller_port=controller_port,
            broker_heap_mb=heap,
            run_dir=run_dir,
            partitions=partitions,
            topic_prefix=env.get("ROPEWALK_TOPIC_PREFIX", ""),
            embedded_broker=not bootstrap,
            embedded_redis=not redis_url,
            brokers=brokers,
            replication_factor=rf or (None if bootstrap else embedded_replication_factor(brokers)),
            max_tasks_per_job=max_tasks,
            job_gc_s=job_gc_s,
            secrets_dir=Path(env["ROPEWALK_SECRETS_DIR"]) if env.get("ROPEWALK_SECRETS_DIR") else None,
            api_port=api_port,
            broker_jmx_port=_int(env, "ROPEWALK_BROKER_JMX_PORT", 0) or None,
            api_url=env.get("ROPEWALK_API_URL", "").strip().rstrip("/") or f"http://127.0.0.1:{api_port}",
        )

    def with_(self, **changes) -> "Config":
        return replace(self, **changes)

    @property
    def broker_nodes(self) -> tuple[BrokerNode, ...]:
        """The embedded cluster's nodes (none with an external broker)."""
        return broker_nodes(self.brokers, self.broker_port, self.controller_port) if self.embedded_broker else ()

    def with_brokers(self, brokers: int) -> "Config":
        """This configuration for an embedded cluster of ``brokers`` nodes (its bootstrap servers and replication
        factor follow); unchanged with an external broker."""
        if not self.embedded_broker or brokers == self.brokers:
            return self
        nodes = broker_nodes(check_brokers(brokers), self.broker_port, self.controller_port)
        rf = self.replication_factor
        return replace(self, brokers=brokers, bootstrap_servers=",".join(f"127.0.0.1:{n.port}" for n in nodes),
                       replication_factor=(embedded_replication_factor(brokers)
                                           if rf == embedded_replication_factor(self.brokers) else rf))

    @property
    def secrets(self) -> Path:
        """The secrets directory (infra/credentials.py)."""
        return self.secrets_dir if self.secrets_dir is not None else Path(self.run_dir) / "secrets"

    def as_principal(self, principal: str) -> "Config":
        """This configuration for a process that authenticates as ``principal`` (infra/credentials.PRINCIPALS)."""
        if principal not in PRINCIPALS:
            raise ValueError(f"unknown principal {principal!r}; known: {', '.join(PRINCIPALS)}")
        return replace(self, principal=principal)

    def kafka_conf(self, **extra) -> dict:
        """confluent-kafka settings to reach the broker as this principal: ``bootstrap.servers`` and, with
        credentials in the secrets directory, SASL (infra/credentials.py); ``extra`` on top."""
        return {"bootstrap.servers": self.bootstrap_servers,
                **credentials.librdkafka_conf(credentials.kafka_credentials(self.secrets, self.principal)), **extra}

    def redis_auth(self) -> dict:
        """redis-py ``username``/``password`` of this principal's Redis user (empty: no ACL users)."""
        return credentials.redis_auth(self.secrets, self.principal)

    def redis_client(self, *, read_only: bool = False, **kwargs):
        """A redis-py client of ``redis_url`` as this principal's Redis user (``read_only``: as the read-only user,
        what a reader that must not write uses whoever it runs as). A ``redis+sentinel://`` URL gives a client of
        the primary the sentinels name (``sentinel_of``): after a failover its next connection goes to the new
        primary."""
        import redis  # noqa: PLC0415 - start-up cost: redis (~80 ms over this module) only for the commands that read Redis; every command imports this module

        auth = credentials.redis_auth(self.secrets, self.principal, read_only=read_only)
        sentinel = sentinel_of(self.redis_url)
        if sentinel is None:
            return redis.Redis.from_url(self.redis_url, **auth, **kwargs)
        from redis.sentinel import Sentinel  # noqa: PLC0415 - start-up cost: redis.sentinel, only for a redis+sentinel:// URL

        timeouts = {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")}
        sentinels = Sentinel(sentinel.hosts, sentinel_kwargs={**sentinel.auth, **timeouts})
        return sentinels.master_for(sentinel.service, db=sentinel.db, **auth, **kwargs)


SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelUrl:
    hosts: tuple[tuple[str, int], ...]  # the sentinels
    service: str  # the name they monitor the primary under
    db: int
    auth: dict  # username/password of the sentinels themselves ({}: none)


def sentinel_of(url: str) -> SentinelUrl | None:
    """``redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`` parsed (None: another URL);
    ValueError naming what is wrong. Pure."""
    scheme, sep, rest = url.partition("://")
    if scheme != SENTINEL_SCHEME or not sep:
        return None
    netloc, _, path = rest.partition("/")
    creds, at, hosts = netloc.rpartition("@")
    auth = {}
    if at:
        user, _, password = creds.partition(":")
        auth = {k: unquote(v) for k, v in (("username", user), ("password", password)) if v}
    parsed = []
    for hp in filter(None, hosts.split(",")):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"ROPEWALK_REDIS_URL: sentinel {hp!r} is not HOST:PORT (in {url!r})")
        parsed.append((host, int(port)))
    parts = [x for x in path.split("/") if x]
    if not parsed or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"ROPEWALK_REDIS_URL: expected {SENTINEL_SCHEME}://HOST:PORT[,HOST:PORT...]/SERVICE[/DB], "
                         f"got {url!r}")
    return SentinelUrl(tuple(parsed), parts[0], int(parts[1]) if len(parts) == 2 else 0, auth)


def formatted_brokers(run_dir: Path) -> int | None:
    """How many nodes the embedded cluster of ``run_dir`` was formatted with (None: not formatted yet): one node's data
    is ``<run dir>/kafka/data``, a cluster's nodes are listed in ``<run dir>/kafka/cluster.json`` (infra/broker.py,
    ``BrokerLayout``; here because configuration reads it too)."""
    kafka = Path(run_dir) / "kafka"
    if (kafka / "data" / "meta.properties").exists():
        return 1
    try:
        return len(json.loads((kafka / CLUSTER_FILE).read_text())["nodes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def held_brokers(run_dir: Path) -> int:
    """The nodes of the embedded cluster whose data ``run_dir`` holds (1 when none yet): what a process that is not
    told ROPEWALK_BROKERS takes, so `status` and `down` in any shell see the cluster `up --brokers N` made."""
    return formatted_brokers(run_dir) or 1


def embedded_replication_factor(brokers: int) -> int:
    """Replicas of every topic on an embedded cluster of ``brokers`` nodes: 1 on one node, else REPLICATED_FROM.
    Pure."""
    return 1 if brokers < REPLICATED_FROM else REPLICATED_FROM


def _seconds(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {raw!r}")
    return value


def _int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
