"""The two services of a local region: the embedded broker (Apache Kafka, infra/broker.py) and a private
redis-server, both keeping their data under the run directory.

`up()` starts whichever of them the configuration says Ropewalk runs itself (see infra/config.py),
`down()` stops them, `status()` reports them. Pointing ROPEWALK_BOOTSTRAP_SERVERS / ROPEWALK_REDIS_URL at
real services makes these no-ops for that service; status then only probes the endpoint.

The redis-server runs under the region's supervisor (infra/supervisor.py), like the control plane's workers: one
that dies is started again on its append-only file, and the allocator notices an index it lost and writes it
again (processors/allocator/README.md). `down()` stops the supervisor, and with it every worker and the
redis-server, then the broker.
"""
from __future__ import annotations

import shutil
from urllib.parse import urlparse

import time

from infra import broker as embedded_kafka
from infra import supervisor
from infra.config import Config
from infra.process import InfraError, ManagedProcess, port_open


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
    from confluent_kafka.admin import AdminClient

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


def broker(cfg: Config) -> ManagedProcess:
    # Ready once it answers its own user: the principals' SCRAM users may not exist yet (ensure_users makes them).
    return embedded_kafka.broker(cfg, ready=lambda: broker_ready(cfg, embedded_kafka.admin_conf(cfg)))


def start_broker(cfg: Config) -> dict:
    """Start the embedded broker (unless it runs) and make every principal's SCRAM user (a data directory from before
    SASL gets them now). Idempotent."""
    st = broker(cfg).start()
    embedded_kafka.ensure_users(cfg)
    return st


def redis_server(cfg: Config) -> ManagedProcess:
    from infra import credentials

    data_dir = cfg.run_dir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
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
    # Every embedded service is checked (binary there, port free) before any is started, so a failure
    # leaves nothing half-started behind.
    procs = {name: make(cfg) for name, make, embedded in (("broker", broker, cfg.embedded_broker),
                                                          ("redis", redis_server, cfg.embedded_redis)) if embedded}
    for proc in procs.values():
        proc.check_can_start()
    start = {"broker": lambda p: start_broker(cfg), "redis": lambda p: start_supervised(p, cfg)}
    out = {name: start[name](procs[name]) if name in procs else _external(name, cfg) for name in ("broker", "redis")}
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
    """Stop the supervisor (every control-plane worker, then redis-server) and the broker. Idempotent. Returns
    {name: {"stopped": bool, ...}} for each program of the supervisor, and the embedded services."""
    out = {n: st for n, st in supervisor.stop(cfg.run_dir).items() if n != supervisor.NAME}
    # Stop what we started even if the binary has since gone missing: only the pid file matters.
    if cfg.embedded_broker:
        out["broker"] = _by_pid("broker", cfg).stop()
    if cfg.embedded_redis and not out.get("redis", {}).get("stopped"):
        out["redis"] = _by_pid("redis", cfg).stop()  # one started before the supervisor existed
    return out


def status(cfg: Config) -> dict:
    out = {}
    for name, embedded, ready, endpoint in (
        ("broker", cfg.embedded_broker, lambda: broker_ready(cfg), cfg.bootstrap_servers),
        ("redis", cfg.embedded_redis, lambda: redis_ready(cfg), cfg.redis_url),
    ):
        if embedded:
            st = _by_pid(name, cfg).status()
            st["ready"] = st["accepting"] and ready()
        else:
            st = _external(name, cfg)
        st["endpoint"] = endpoint
        st["embedded"] = embedded
        out[name] = st
    return out


def running(cfg: Config) -> dict[str, dict]:
    """The embedded services' processes: running or not, pid, log file (no protocol probe: cheap)."""
    return {name: _by_pid(name, cfg).status() for name, embedded in (("broker", cfg.embedded_broker),
                                                                    ("redis", cfg.embedded_redis)) if embedded}


def _by_pid(name: str, cfg: Config) -> ManagedProcess:
    port = cfg.broker_port if name == "broker" else cfg.redis_port
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
