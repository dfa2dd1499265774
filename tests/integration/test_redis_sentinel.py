"""The Redis a region on several machines uses (README, "A region on several machines"): a primary, a replica and
Redis Sentinel, named by ``ROPEWALK_REDIS_URL=redis+sentinel://HOST:PORT/SERVICE/DB``. Real redis-servers: the
allocator's index is written through the sentinel's primary, the primary is SIGKILLed, Sentinel promotes the
replica, and the same client commits on the new primary once its connection fails over."""
from __future__ import annotations

import signal
import subprocess

import pytest
import redis

from allocator_log import reg
from infra.config import Config
from infra.process import free_ports
from regioncli import wait_for
from infra.services import redis_binary
from processors.allocator.fold import RegionFold
from processors.allocator.index import Decision, MachineIndex


def _start(argv: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.timeout(120)
def test_a_sentinel_url_follows_the_primary_across_a_failover(tmp_path):
    primary, replica, sentinel = free_ports(3)
    server = redis_binary()
    log = open(tmp_path / "redis.log", "w")
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {sentinel}\nbind 127.0.0.1\nsentinel monitor rw 127.0.0.1 {primary} 1\n"
                    "sentinel down-after-milliseconds rw 1000\nsentinel failover-timeout rw 4000\n")
    procs = {"primary": _start([server, "--port", str(primary), "--bind", "127.0.0.1", "--save", "",
                                "--dir", str(tmp_path)], log)}
    procs["replica"] = _start([server, "--port", str(replica), "--bind", "127.0.0.1", "--save", "", "--dir",
                               str(tmp_path / "."), "--dbfilename", "replica.rdb", "--replicaof", "127.0.0.1",
                               str(primary)], log)
    procs["sentinel"] = _start([server, str(conf), "--sentinel"], log)
    try:
        secrets = tmp_path / "secrets"  # no redis.json: these servers have no ACL users
        secrets.mkdir()
        cfg = Config.from_env({"ROPEWALK_REDIS_URL": f"redis+sentinel://127.0.0.1:{sentinel}/rw/0",
                               "ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_SECRETS_DIR": str(secrets)})
        direct = redis.Redis(port=replica)
        wait_for(lambda: _ping(direct) and direct.info("replication").get("master_link_status") == "up",
                 "the replica in sync", 30, 0.2)
        r = wait_for(lambda: _ping(c := cfg.redis_client(socket_timeout=2)) and c, "the primary through Sentinel", 30,
                     0.2)
        index = MachineIndex(r, "")
        fold = RegionFold()
        for i, mid in enumerate(("m1", "m2")):
            fold.apply(reg(mid), ("machines", 0, i))
        index.project_all(fold)
        assert r.wait(1, 5000) == 1  # the replica has it
        watcher = redis.Redis(port=sentinel)  # the sentinel knows the replica (from the primary's INFO, every 10 s)
        wait_for(lambda: any(s["port"] == replica and not s["is_disconnected"] and "s_down" not in s["flags"]
                             for s in _replicas(watcher)), "the sentinel knowing the replica", 60, 0.2)

        procs["primary"].send_signal(signal.SIGKILL)
        procs["primary"].wait(10)
        promoted = wait_for(lambda: _role(direct) == "master", "Sentinel promoting the replica", 60, 0.2,
                            lambda: "; " + (tmp_path / "redis.log").read_text()[-3000:])
        assert promoted

        def commit():  # the allocator's next commit: its first may meet the dead connection (a TRANSIENT error)
            try:
                return index.commit([Decision("req-1", 0, None, "e1", 1000, 1024, (), (), (("m1", 1, True, ("j/0",)),),
                                              '["e"]', quota=1)])
            except (redis.ConnectionError, redis.TimeoutError):
                return None

        [done] = wait_for(commit, "a commit on the new primary", 30, 0.2)
        assert done.outcome == "ok"
        assert direct.hget("placement", "j/0") == b"m1" and direct.smembers("held:e1") == {b"m1"}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        log.close()


def _ping(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:  # noqa: BLE001 - not answering yet
        return False


def _replicas(sentinel) -> list[dict]:
    try:
        return sentinel.sentinel_slaves("rw")
    except Exception:  # noqa: BLE001 - not answering yet
        return []


def _role(client) -> str | None:
    try:
        return client.info("replication").get("role")
    except Exception:  # noqa: BLE001
        return None
