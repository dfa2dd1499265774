"""The whole core loop through the CLI, as a user drives it: `ropewalk up --machines N` starts the broker,
Redis and the control plane (Resource Broker, allocator, scheduler shard, simulated agents, health check);
an entitlement and a job are created; its tasks run spread over MSBs; a machine fails and its tasks move;
`ropewalk down` leaves no process behind."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.process import pid_alive

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_up_submit_fail_move_down(tmp_path):
    env = {**os.environ, "ROPEWALK_BROKER_PORT": str(free_port()), "ROPEWALK_REDIS_PORT": str(free_port()),
           "ROPEWALK_RUN_DIR": str(tmp_path / "run"), "ROPEWALK_PARTITIONS": "4",
           "ROPEWALK_FAUST_SESSION_TIMEOUT": "2", "ROPEWALK_FAUST_HEARTBEAT_INTERVAL": "0.5",
           "ROPEWALK_FAUST_REBALANCE_TIMEOUT": "2"}
    for k in ("ROPEWALK_BOOTSTRAP_SERVERS", "ROPEWALK_REDIS_URL", "ROPEWALK_TOPIC_PREFIX"):
        env.pop(k, None)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "processors.frontend.cli", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    def status(job):
        out = cli("job", "status", job, "--json")
        return json.loads(out.stdout) if out.returncode == 0 else None

    def wait_for(pred, what, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            time.sleep(0.5)
        logs = {p.name: p.read_text()[-1500:] for p in (tmp_path / "run").glob("*.log")}
        raise AssertionError(f"timed out waiting for {what}; logs: {json.dumps(logs, indent=1)}")

    up = cli("up", "--machines", "40", "--json")
    try:
        assert up.returncode == 0, up.stderr
        doc = json.loads(up.stdout)
        pids = [s["pid"] for s in doc["control_plane"].values()]
        assert len(pids) == 6
        assert doc["ready"] and doc["machines_up"] == 41  # up returns once the whole region is indexed
        # the demo job runs as a real OS process under the process agent, and says so in its log
        assert doc["demo"]["running"], doc["demo"]
        demo = status("demo.hello")
        assert [t["machine"] for t in demo["tasks"]] == ["local-msb1-r01-m001"]
        wait_for(lambda: Path(doc["demo"]["logs"]).exists() and "hello from Ropewalk" in Path(doc["demo"]["logs"]).read_text(),
                 "the demo task's output")
        assert cli("entitlement", "create", "e1", "--quota", "6").returncode == 0
        spec = tmp_path / "web.yaml"
        spec.write_text("name: web\nentitlement: e1\ntasks: 6\ncommand: [sleep, '3600']\n"
                        "resources: {cpu_millicores: 1000, memory_mib: 1024}\nspread: msb\n")
        time.sleep(1)
        assert cli("job", "submit", str(spec)).stdout.strip() == "e1.web"

        running = lambda: (lambda v: v if v and sum(t["state"] == "RUNNING" for t in v["tasks"]) == 6 else None)(
            status("e1.web"))
        view = wait_for(running, "6 RUNNING tasks")
        msbs = {(t["dc"], t["msb"]) for t in view["tasks"]}
        assert len(msbs) >= 3, f"tasks not spread over MSBs: {msbs}"

        victim = view["tasks"][0]["machine"]
        moved = [t["id"] for t in view["tasks"] if t["machine"] == victim]
        assert cli("machine", "fail", victim).returncode == 0

        def replaced():
            v = running()
            return v if v and all(t["machine"] != victim for t in v["tasks"]) else None
        after = wait_for(replaced, "the failed machine's tasks running elsewhere")
        assert {t["id"] for t in after["tasks"]} == {t["id"] for t in view["tasks"]}  # none lost, none added
        assert all(t["machine"] == u["machine"] for t, u in zip(view["tasks"], after["tasks"]) if t["id"] not in moved)
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not any(pid_alive(p) for p in pids)
    assert not list((tmp_path / "run").glob("*.pid"))
