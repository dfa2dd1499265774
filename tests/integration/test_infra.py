"""infra start/stop on real processes: idempotent start, clear failures, nothing left behind."""
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from infra import broker, services
from infra.config import Config
from infra.process import (WANTED_OPEN_FILES, InfraError, ManagedProcess, free_port, free_ports, pid_alive,
                           port_open)
from streams.topics import CATALOGUE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def own_cfg(tmp_path):
    broker_port, redis_port, controller_port = free_ports(3)
    cfg = Config.from_env({"ROPEWALK_BROKER_PORT": str(broker_port), "ROPEWALK_REDIS_PORT": str(redis_port),
                           "ROPEWALK_CONTROLLER_PORT": str(controller_port), "ROPEWALK_RUN_DIR": str(tmp_path / "run")})
    yield cfg
    services.down(cfg)


def test_start_is_idempotent_and_stop_leaves_no_process(own_cfg):
    first = services.up(own_cfg)
    assert first["broker"]["started"] and first["redis"]["started"]
    pids = {first["broker"]["pid"], first["redis"]["pid"]}
    second = services.up(own_cfg)
    assert not second["broker"]["started"] and not second["redis"]["started"]
    assert {second["broker"]["pid"], second["redis"]["pid"]} == pids
    st = services.status(own_cfg)
    assert st["broker"]["ready"] and st["redis"]["ready"]
    down = services.down(own_cfg)
    assert down["broker"]["stopped"] and down["redis"]["stopped"]
    assert not any(pid_alive(p) for p in pids)
    assert not port_open(own_cfg.broker_port) and not port_open(own_cfg.redis_port)
    assert not list(own_cfg.run_dir.glob("*.pid"))
    assert services.down(own_cfg) == {"broker": {"name": "broker", "stopped": False},
                                      "redis": {"name": "redis", "stopped": False}}


def _take_port(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


# (case, what breaks the start: (env overrides, service whose port another process holds, attribute of
# infra.broker to point elsewhere), expected message). The message is checked as the whole one line
# `ropewalk up` prints after "ropewalk: ". {java_only} is a directory whose only program is java.
UP_FAILURES = [
    ("broker port taken", ({}, "broker", None), r"broker: port {broker_port} is taken by another process; "
                                                r"stop it or set ROPEWALK_BROKER_PORT to a free port"),
    ("controller port taken", ({}, "controller", None),
     r"broker: port {controller_port} is taken by another process; stop it or set ROPEWALK_CONTROLLER_PORT to "
     r"a free port"),
    ("redis port taken", ({}, "redis", None), r"redis: port {redis_port} is taken by another process; "
                                              r"stop it or set ROPEWALK_REDIS_PORT to a free port"),
    ("java missing", ({"PATH": "{empty_dir}"}, None, None),
     r"embedded broker: java is missing: install Java 17\+ \(`bash infra/bootstrap.sh` does, as root\), or set "
     r"ROPEWALK_BOOTSTRAP_SERVERS to a running Kafka"),
    ("broker jars missing", ({}, None, "LIBS"),
     r"embedded broker: {empty_dir}/kafka_2.13-\d+\.\d+\.\d+\.jar is missing; run `bash infra/bootstrap.sh` "
     r"\(it copies Kafka \d+\.\d+\.\d+ from Maven Central\)"),
    ("redis-server missing", ({"PATH": "{java_only}"}, None, None),
     r"redis-server is missing: `apt-get install redis-server` \(as root\), or set ROPEWALK_REDIS_URL to a "
     r"running Redis"),
]


@pytest.mark.parametrize("case,breakage,message", UP_FAILURES, ids=[c[0] for c in UP_FAILURES])
def test_up_failures_are_one_line_and_start_nothing(own_cfg, tmp_path, monkeypatch, case, breakage, message):
    env, taken, moved = breakage
    empty, java_only = tmp_path / "empty", tmp_path / "java_only"
    empty.mkdir()
    java_only.mkdir()
    (java_only / "java").symlink_to(shutil.which("java"))
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(empty_dir=empty, java_only=java_only))
    if moved:
        monkeypatch.setattr(broker, moved, empty)
    ports = {"broker": own_cfg.broker_port, "controller": own_cfg.controller_port, "redis": own_cfg.redis_port}
    holder = _take_port(ports[taken]) if taken else None
    try:
        with pytest.raises(InfraError) as exc:
            services.up(own_cfg)
    finally:
        if holder is not None:
            holder.close()
    assert re.fullmatch(message.format(broker_port=own_cfg.broker_port, redis_port=own_cfg.redis_port,
                                       controller_port=own_cfg.controller_port, empty_dir=re.escape(str(empty))),
                        str(exc.value)), str(exc.value)
    # Checked before anything started: no process, no pid file, neither port served by us.
    assert not list(own_cfg.run_dir.glob("*.pid"))
    assert not any(port_open(p) for name, p in ports.items() if name != taken)


@pytest.mark.parametrize("argv,message", [
    (["/nonexistent/program"], "binary /nonexistent/program is missing"),
    ([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], "exited with code 3 at start: boom"),
])
def test_start_failures_are_one_line_reasons(tmp_path, argv, message):
    proc = ManagedProcess("thing", argv, free_port(), tmp_path, ready=lambda: True, start_timeout_s=5)
    with pytest.raises(InfraError, match=message):
        proc.start()
    assert not proc.pid_file.exists()


def test_a_process_that_never_listens_times_out_and_is_reported(tmp_path):
    proc = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], free_port(), tmp_path,
                          ready=lambda: True, start_timeout_s=1)
    with pytest.raises(InfraError, match="not ready on port"):
        proc.start()
    pid = int(proc.pid_file.read_text())
    proc.stop()
    assert not pid_alive(pid)


def test_a_started_process_gets_the_hard_open_files_limit(tmp_path):
    """A broker holds a file per partition: a soft limit of 1,024 inherited from a CI shell must not reach it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what the child would inherit
    proc = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], None, tmp_path,
                          ready=lambda: True)
    try:
        proc.start()
        limits = Path(f"/proc/{proc.pid()}/limits").read_text()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        proc.stop()
    child_soft = re.search(r"Max open files\s+(\S+)", limits).group(1)
    assert child_soft == str(WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES))


def test_cli_up_status_down(own_cfg):
    env = {**os.environ, "ROPEWALK_BROKER_PORT": str(own_cfg.broker_port),
           "ROPEWALK_REDIS_PORT": str(own_cfg.redis_port), "ROPEWALK_RUN_DIR": str(own_cfg.run_dir)}
    exe = [sys.executable, "-m", "processors.frontend.cli"]

    def run(*args):
        return subprocess.run(exe + list(args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)

    assert run("status").returncode == 1  # nothing running yet
    up = run("up", "--machines", "0", "--json")
    assert up.returncode == 0, up.stderr
    doc = json.loads(up.stdout)
    assert len(doc["topics"]) == len(CATALOGUE) == 17 and all(n for n in doc["topics"].values())
    st = run("status", "--json")
    assert st.returncode == 0 and json.loads(st.stdout)["components"]["broker"]["ready"]
    bad = run("produce", "intents", "JobResized", "-", "--entitlement", "e1")
    assert bad.returncode == 1 and bad.stderr.startswith("ropewalk: input is empty")
    assert run("down").returncode == 0
    assert not port_open(own_cfg.broker_port)


def test_external_services_are_not_started(tmp_path):
    broker_port, redis_port = free_ports(2)
    cfg = Config.from_env({"ROPEWALK_BOOTSTRAP_SERVERS": f"127.0.0.1:{broker_port}",
                           "ROPEWALK_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
                           "ROPEWALK_RUN_DIR": str(tmp_path)})
    assert not cfg.embedded_broker and not cfg.embedded_redis
    with pytest.raises(InfraError, match="does not answer"):
        services.up(cfg)
    assert services.down(cfg) == {}
