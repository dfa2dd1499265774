"""The two services of a local region: the embedded broker (Apache Kafka, infra/broker.py: one node, or a cluster
of ``ROPEWALK_BROKERS`` nodes) and a private redis-server, both keeping their data under the run directory.

`up()` starts whichever of them the configuration says Ropewalk runs itself (see infra/config.py),
`down()` stops them, `status()` reports them. Pointing ROPEWALK_BOOTSTRAP_SERVERS / ROPEWALK_REDIS_URL at
real services makes these no-ops for that service; status then only probes the endpoint.

Both run under the region's supervisor (infra/supervisor.py), like the control plane's workers, as its services
(started before the workers, stopped after them). A redis-server that dies is started again on its append-only
file, and the allocator notices an index it lost and writes it again (processors/allocator/README.md). A broker
node that dies is started again on its data directory: on a cluster the others went on meanwhile (they hold every
partition's in-sync replicas), and the node catches up from them and rejoins the in-sync replicas; on one node
the region waits for it (clients retry), as it waited for a broker `up` started again before the broker was
supervised. Why supervised, rather than started once by `up`: the supervisor is the one thing in the region that
restarts what dies, with a backoff and a record of each restart that `ropewalk status` shows; a broker is one
more such program (its configuration and formatted data directory written by `up` first, as the redis-server's
ACL file is). `down()` stops the supervisor: every worker, then the services.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from urllib.parse import urlparse

from infra import broker as embedded_kafka
from infra import credentials, supervisor
from infra.config import BrokerNode, Config
from infra.private import make_dir, secure_run_dir
from infra.process import InfraError, ManagedProcess, pid_alive, port_open, processes_of


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise InfraError(
            "redis-server is missing: `apt-get install redis-server` (as root), or set ROPEWALK_REDIS_URL "
            "to a running Redis"
        )
    return path


def broker_ready(cfg: Config, conf: dict | None = None) -> bool:
    """The broker answers ``cfg``'s principal (or a client of ``conf``), and every partition it holds has a leader
    (a broker restarted on its data elects its partitions' leaders a moment after it answers; clients asking
    meanwhile get NOT_LEADER_FOR_PARTITION)."""
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - start-up cost: confluent_kafka (~40 ms); `ropewalk down` imports this module without using the broker

    try:
        md = AdminClient({**(conf or cfg.kafka_conf()), "log_level": 0}).list_topics(timeout=2)
    except Exception:  # noqa: BLE001 - any failure to list the topics: not ready
        return False
    return all(t.error is None and all(p.leader >= 0 and p.error is None for p in t.partitions.values())
               for t in md.topics.values())


def redis_ready(cfg: Config) -> bool:
    try:
        return bool(cfg.redis_client(socket_timeout=1).ping())
    except Exception:  # noqa: BLE001 - any failure to ping: not ready
        return False


def broker(cfg: Config, node: BrokerNode | None = None) -> ManagedProcess:
    """Node ``node`` of the embedded broker (default: the first) as a process of its own, unsupervised (``up`` runs
    the nodes under the supervisor; a test that stops a broker itself starts it with ``start_broker``)."""
    # Ready once it answers its own user: the principals' SCRAM users may not exist yet (ensure_users makes them).
    return embedded_kafka.broker(cfg, ready=lambda: broker_ready(cfg, embedded_kafka.admin_conf(cfg)), node=node)


def start_broker(cfg: Config) -> dict:
    """Start the embedded broker of one node (unless it runs) as a process of its own, not supervised, and make every
    principal's SCRAM user. Idempotent. (For a test that stops and starts the broker itself; ``up`` supervises.)"""
    st = broker(cfg).start()
    embedded_kafka.ensure_users(cfg)
    return st


def cluster_ready(cfg: Config) -> bool:
    """Every node of the embedded cluster is in the cluster's metadata (registered, not fenced) and every partition
    has a leader, as the broker's own user sees it."""
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - start-up cost: confluent_kafka (~40 ms); `ropewalk down` imports this module without using the broker

    try:
        md = AdminClient({**embedded_kafka.admin_conf(cfg), "log_level": 0}).list_topics(timeout=2)
    except Exception:  # noqa: BLE001 - any failure to list the topics: not ready
        return False
    return (set(md.brokers) == {n.id for n in cfg.broker_nodes}
            and all(t.error is None and all(p.leader >= 0 and p.error is None for p in t.partitions.values())
                    for t in md.topics.values()))


def start_brokers(cfg: Config) -> dict:
    """Have the supervisor run every node of the embedded broker (unless it does), wait until the cluster is ready
    (``cluster_ready``) and make every principal's SCRAM user. Idempotent: nodes that run are left as they are.
    Returns the cluster's status, ``started`` if a node was started."""
    nodes = {n.id: broker(cfg, n) for n in cfg.broker_nodes}
    was = {i: p.pid() for i, p in nodes.items()}
    if any(pid is None for pid in was.values()):
        embedded_kafka.prepare(cfg)  # configurations, data formatted: on disk for the supervisor's restarts too
    supervisor.ensure(cfg.run_dir, embedded_kafka.programs(cfg))
    timeout_s = embedded_kafka.start_timeout_s(cfg)
    deadline = time.monotonic() + timeout_s
    while True:
        up = all(p.pid() is not None and port_open(p.port) for p in nodes.values())
        if up and cluster_ready(cfg):
            break
        if time.monotonic() > deadline:
            down = [p for p in nodes.values() if p.pid() is None or not port_open(p.port)]
            raise InfraError(f"broker: not ready after {timeout_s:.0f}s: "
                             + ("; ".join(f"{p.name}: {p._log_tail()}" for p in down) if down
                                else "a node is not in the cluster, or a partition has no leader"))
        time.sleep(0.1)
    embedded_kafka.ensure_users(cfg)
    started = any(was[i] is None or was[i] != p.pid() for i, p in nodes.items())
    return {**broker_status(cfg), "started": started}


def broker_status(cfg: Config) -> dict:
    """The embedded broker as one service (the first node's process; ``nodes``: each node's)."""
    nodes = {embedded_kafka.node_name(cfg, n.id): _by_pid(embedded_kafka.node_name(cfg, n.id), cfg).status()
             for n in cfg.broker_nodes}
    first = next(iter(nodes.values()))
    return {**first, "name": "broker", "nodes": nodes, "pid": first["pid"] if cfg.brokers == 1 else None,
            "running": all(st["running"] for st in nodes.values())}


def broker_text(cfg: Config, st: dict) -> str:
    """What `ropewalk up` says of the embedded broker it started (``st``: ``start_brokers``)."""
    layout = embedded_kafka.BrokerLayout
    if cfg.brokers == 1:
        return f"embedded Apache Kafka, pid {st.get('pid')}, data in {layout.of(cfg).data}"
    nodes = ", ".join(f"{name} pid {n.get('pid')}" for name, n in st.get("nodes", {}).items())
    return (f"embedded Apache Kafka, a cluster of {cfg.brokers} nodes ({nodes}), data in "
            f"{layout.of(cfg, 1).root.parent}/{embedded_kafka.NAME}-*/data")


def cluster_state(cfg: Config) -> dict:
    """The embedded cluster as its metadata shows it (the broker's own user): the nodes in it, partitions without a
    leader, ``under_replicated`` ("topic[partition]" whose in-sync replicas are fewer than its replicas) and, per
    node, the partitions it holds a replica of that it is not in sync for (``out_of_sync``); the quorum's leader
    (``controller``, ``broker.quorum_leader``). ``error`` when the cluster does not answer."""
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - start-up cost: confluent_kafka (~40 ms); `ropewalk down` imports this module without using the broker

    out: dict = {"controller": embedded_kafka.quorum_leader(cfg), "nodes": [], "partitions": 0, "leaderless": [],
                 "under_replicated": [], "out_of_sync": {n.id: [] for n in cfg.broker_nodes}, "error": None}
    try:
        md = AdminClient({**embedded_kafka.admin_conf(cfg), "log_level": 0}).list_topics(timeout=5)
    except Exception as exc:  # noqa: BLE001 - no answer: said so
        out["error"] = str(exc)
        return out
    out["nodes"] = sorted(md.brokers)
    for name, t in sorted(md.topics.items()):
        for p in t.partitions.values():
            out["partitions"] += 1
            where = f"{name}[{p.id}]"
            if p.leader < 0:
                out["leaderless"].append(where)
            if len(p.isrs) < len(p.replicas):
                out["under_replicated"].append(where)
                for r in set(p.replicas) - set(p.isrs):
                    out["out_of_sync"].setdefault(r, []).append(where)
    return out


def redis_server(cfg: Config) -> ManagedProcess:
    data_dir = make_dir(cfg.run_dir / "redis")  # 0700: its append-only file is the region's alone (infra/private.py)
    # ACL users per component (infra/credentials.py: REDIS_RULES; redis.json and the ACL file made from it before
    # each start); the default user is off, so a client without a user and password can run nothing (no FLUSHALL).
    # Persistent like the log beside it: `down` then `up` finds the index as the allocator left it. An
    # append-only file, written at every event loop turn and fsynced every second (a killed redis-server
    # loses nothing the OS got; a machine crash loses at most a second, which `up` notices and repairs with a
    # rebuild from the log: processors/controlplane.py). No RDB snapshots: the AOF is the whole persistence.
    return ManagedProcess(
        name="redis",
        argv=[redis_binary(), "--port", str(cfg.redis_port), "--bind", "127.0.0.1", "--dir", str(data_dir),
              "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--daemonize", "no",
              "--protected-mode", "yes", "--aclfile", str(cfg.secrets / credentials.REDIS_ACL_FILE)],
        port=cfg.redis_port,
        run_dir=cfg.run_dir,
        ready=lambda: redis_ready(cfg.with_(principal=credentials.OPERATOR)),
        prepare=lambda: credentials.ensure(cfg.secrets, kafka=False, redis=True),
    )


def up(cfg: Config) -> dict:
    # The run directory readable by its owner alone (infra/private.py), before anything writes to it.
    secure_run_dir(cfg.run_dir)
    # Every embedded service is checked (binary there, ports free, the run directory's cluster the one asked for)
    # before any is started, so a failure leaves nothing half-started behind.
    if cfg.embedded_broker:
        embedded_kafka.check_held(cfg)
    procs = ([broker(cfg, n) for n in cfg.broker_nodes] if cfg.embedded_broker else []) + \
        ([redis_server(cfg)] if cfg.embedded_redis else [])
    for proc in procs:
        proc.check_can_start()
    out = {"broker": start_brokers(cfg) if cfg.embedded_broker else _external("broker", cfg),
           "redis": start_supervised(procs[-1], cfg) if cfg.embedded_redis else _external("redis", cfg)}
    for name, st in out.items():
        if not st.get("ready", True):
            raise InfraError(f"{name}: {st['endpoint']} does not answer")
    return out


def start_supervised(proc: ManagedProcess, cfg: Config) -> dict:
    """Run ``proc`` (a service: started before the workers, stopped after them) under the region's supervisor and
    wait until it is ready. Idempotent: a service the supervisor runs already is left as it is."""
    was = proc.pid()
    if was is None and proc.prepare is not None:
        proc.prepare()  # what it reads at start (the ACL file), kept on disk for the supervisor's restarts
    supervisor.ensure(cfg.run_dir, [supervisor.Program(proc.name, tuple(proc.argv), service=True)])
    deadline = time.monotonic() + proc.start_timeout_s
    while time.monotonic() < deadline:
        if proc.pid() is not None and (proc.port is None or port_open(proc.port)) and proc.ready():
            return {**proc.status(), "started": was is None or was != proc.pid()}
        time.sleep(0.1)
    raise InfraError(f"{proc.name}: not ready after {proc.start_timeout_s:.0f}s: {proc._log_tail()}")


def down(cfg: Config) -> dict:
    """Stop the supervisor (every control-plane worker, then redis-server and the broker's nodes). Idempotent.
    Returns {name: {"stopped": bool, ...}} for each program of the supervisor, and the embedded services."""
    out = {n: st for n, st in supervisor.stop(cfg.run_dir).items() if n != supervisor.NAME}
    # One started before the supervisor ran it (or alone: start_broker): by its pid file, even if the binary has
    # since gone missing.
    names = (embedded_kafka.node_names(cfg) if cfg.embedded_broker else []) + (["redis"] if cfg.embedded_redis else [])
    for name in names:
        if not out.get(name, {}).get("stopped"):
            out[name] = _by_pid(name, cfg).stop()
    return out


def status(cfg: Config) -> dict:
    """Each embedded service or the external endpoint: running, ready, endpoint. A cluster of several nodes is the
    service ``broker`` (ready: every node in the cluster, every partition led, and this principal answered) and one
    entry per node (ready: its process runs and it is in the cluster), with a ``detail`` line each."""
    out = {}
    if cfg.embedded_broker and cfg.brokers > 1:
        out.update(_cluster_status(cfg))
    for name, embedded, ready, endpoint in (
        ("broker", cfg.embedded_broker and cfg.brokers == 1, lambda: broker_ready(cfg), cfg.bootstrap_servers),
        ("redis", cfg.embedded_redis, lambda: redis_ready(cfg), cfg.redis_url),
    ):
        if name in out:
            continue
        if embedded:
            st = _by_pid(name, cfg).status()
            st["ready"] = st["accepting"] and ready()
        else:
            st = _external(name, cfg)
        st["endpoint"] = endpoint
        st["embedded"] = embedded
        out[name] = st
    return {"broker": out.pop("broker"), **out}


def _cluster_status(cfg: Config) -> dict:
    nodes = broker_status(cfg)["nodes"]
    state = cluster_state(cfg) if any(st["running"] for st in nodes.values()) else None
    in_cluster = set(state["nodes"]) if state else set()
    ok = bool(state) and not state["error"] and not state["leaderless"] and in_cluster == {
        n.id for n in cfg.broker_nodes}
    leader = state["controller"] if state else None
    cluster = {"name": "broker", "embedded": True, "endpoint": cfg.bootstrap_servers, "brokers": cfg.brokers,
               "running": all(st["running"] for st in nodes.values()), "ready": ok and broker_ready(cfg),
               "cluster": state,
               "detail": (f"{len(in_cluster)} of {cfg.brokers} nodes in the cluster, controller "
                          f"{embedded_kafka.node_name(cfg, leader) if leader else 'unknown'}, "
                          f"{len(state['under_replicated'])} of {state['partitions']} partitions under-replicated"
                          + (f", {len(state['leaderless'])} without a leader" if state['leaderless'] else "")
                          if state and not state["error"] else "the cluster does not answer")}
    out = {"broker": cluster}
    for node in cfg.broker_nodes:
        name = embedded_kafka.node_name(cfg, node.id)
        st = nodes[name]
        behind = state["out_of_sync"].get(node.id, []) if state else []
        st.update(embedded=True, endpoint=f"127.0.0.1:{node.port}",
                  ready=st["running"] and st["accepting"] and node.id in in_cluster,
                  controller=leader == node.id, out_of_sync=behind,
                  detail=", ".join(x for x in ("controller" if leader == node.id else "",
                                               f"{len(behind)} replicas out of sync" if behind else "") if x))
        out[name] = st
    return out


def running(cfg: Config) -> dict[str, dict]:
    """The embedded services' processes (each broker node): running or not, pid, log file (no protocol probe)."""
    names = (embedded_kafka.node_names(cfg) if cfg.embedded_broker else []) + (["redis"] if cfg.embedded_redis else [])
    return {name: _by_pid(name, cfg).status() for name in names}


def region_pids(cfg: Config) -> dict[str, int]:
    """Every process of a local region, by what it is: ``supervisor``, ``program:<name>`` (redis-server, the broker's
    nodes and every worker under the supervisor), ``service:<name>`` (an embedded service run on its own), and
    ``task:<task>`` (the process agents' tasks, from their state files: in a sandbox, its monitor, root's) and
    ``task:<task>:<pid>`` (every process running as a task's own uid: a sandboxed task's processes outlive its
    monitor; processors/agent/isolation.py): what a power loss of the whole region kills (``power_off``)."""
    pids = {f"program:{n}": s["pid"] for n, s in supervisor.programs_state(cfg.run_dir).items() if s.get("pid")}
    pids.update({f"service:{n}": s["pid"] for n, s in running(cfg).items() if s.get("pid")
                 and s["pid"] not in pids.values()})
    sup = supervisor.process(cfg.run_dir).pid()
    if sup:
        pids["supervisor"] = sup
    for state in (Path(cfg.run_dir) / "agents").glob("*/agent-state.json"):
        try:
            doc = json.loads(state.read_text())
        except (OSError, ValueError):
            continue
        for task, proc in doc.get("procs", {}).items():
            if proc.get("pid"):
                pids[f"task:{task}"] = proc["pid"]
        for task, uid in doc.get("uids", {}).items():  # isolation.OWNER_UIDS_KEY: the tasks' own uids
            pids.update({f"task:{task}:{pid}": pid for pid in processes_of(uid)})
    return pids


def power_off(cfg: Config, timeout_s: float = 30.0) -> dict[str, int]:
    """A power loss of the whole local region: every process of ``region_pids`` SIGKILLed at once, then every process
    still running as a task's own uid, again until none is left (a task's shell forks between the listing and the
    kill; a power loss spares none); then waits, up to ``timeout_s`` in all, until every process listed is gone.
    Returns the processes listed (name -> pid); those still alive after the wait are ``power_off_survivors``. The one
    power loss of ``bench/killstorm.py`` and ``tests/integration/test_durable.py``."""
    pids = region_pids(cfg)
    uids = set()
    for state in (Path(cfg.run_dir) / "agents").glob("*/agent-state.json"):
        try:
            uids |= set(json.loads(state.read_text()).get("uids", {}).values())
        except (OSError, ValueError):
            continue
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while (left := [pid for uid in uids for pid in processes_of(uid)]) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    while any(pid_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def power_off_survivors(pids: dict[str, int]) -> dict[str, int]:
    """The processes of a ``power_off`` still alive (none, when the power loss did its work)."""
    return {name: pid for name, pid in pids.items() if pid_alive(pid)}


def _by_pid(name: str, cfg: Config) -> ManagedProcess:
    ports = {embedded_kafka.node_name(cfg, n.id): n.port for n in cfg.broker_nodes}
    port = ports.get(name, cfg.broker_port) if name.startswith(embedded_kafka.NAME) else cfg.redis_port
    return ManagedProcess(name=name, argv=[name], port=port, run_dir=cfg.run_dir, ready=lambda: True)


def _external(name: str, cfg: Config) -> dict:
    if name == "broker":
        endpoint, ready = cfg.bootstrap_servers, broker_ready(cfg)
    else:
        endpoint, ready = cfg.redis_url, redis_ready(cfg)
    return {"name": name, "embedded": False, "endpoint": endpoint, "ready": ready}


def redis_port_from_url(url: str) -> int | None:
    return urlparse(url).port


__all__ = ["up", "down", "status", "broker", "redis_server", "InfraError", "port_open"]
