"""Every door holds (issue #11), on regions driven through the CLI as a user drives them.

* A worker that dies is started again by the region's supervisor, which records it; `ropewalk status` lists every
  expected worker with its state and restarts, and exits 1 while one is down. (Before: nothing restarted a dead
  worker, and `status` left it out and exited 0.)
* Redis emptied (FLUSHALL) under a running allocator, then redis-server killed: the allocator notices, projects its
  fold of the log again, and decides on; no answer invites re-creating an entitlement that exists. (Before: the
  requests of new jobs were fenced off silently against the emptied index, the jobs stayed PENDING for good.)
* `down` stops the process agent's tasks and `up` starts them again; `down --keep-tasks` leaves them, and `up` on a
  new log adopts or stops them against that log. (Before: `down` left them running, and the next `up` on a new log
  skipped the new START by its old offsets: demo.hello stayed STARTING.) Its tasks run unprivileged.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import pytest

from infra.config import Config
from infra.process import pid_alive
from processors.agent import isolation as iso
from regioncli import RegionCli

WORKERS = {"resourcebroker", "allocator-0", "scheduler-0", "agents", "agent-local", "health", "api", "rebalancer",
           "sidekick", "jobcontrol", "srm", "loans"}


def job_spec(path, name: str, tasks: int) -> str:
    path.write_text(f"name: {name}\nentitlement: e1\ntasks: {tasks}\ncommand: [sleep, '3600']\n"
                    "resources: {cpu_millicores: 1000, memory_mib: 1024}\n")
    return str(path)


def status(region: RegionCli) -> tuple[int, dict]:
    out = region("status", "--json")
    return out.returncode, json.loads(out.stdout)


@pytest.mark.timeout(300)
def test_dead_workers_are_restarted_and_shown_and_a_lost_redis_is_healed(tmp_path):
    region = RegionCli(tmp_path / "run")
    pids: list[int] = []
    try:
        up = region.json("up", "--machines", "8", "--no-demo")
        assert up and up["ready"], up
        rc, doc = status(region)
        assert rc == 0 and set(doc["control_plane"]) == WORKERS
        assert all(w["state"] == "RUNNING" and w["restarts"] == 0 for w in doc["control_plane"].values())
        assert doc["programs"]["redis"]["state"] == "RUNNING" and doc["supervisor"]["running"]
        pids = [w["pid"] for w in doc["programs"].values()] + [doc["supervisor"]["pid"]]

        # -- a worker dies while nothing can restart it: status shows it down and exits 1 ------------------------
        sup, allocator = doc["supervisor"]["pid"], doc["control_plane"]["allocator-0"]["pid"]
        os.kill(sup, signal.SIGSTOP)
        try:
            os.kill(allocator, signal.SIGKILL)
            region.wait_for(lambda: not pid_alive(allocator), "the allocator gone")
            out = region("status")
            assert out.returncode == 1 and "not running: allocator-0" in out.stderr, (out.stdout, out.stderr)
            assert not re.search(r"^allocator-0 +RUNNING", out.stdout, re.M) and "allocator-0" in out.stdout
        finally:
            os.kill(sup, signal.SIGCONT)
        # ... the supervisor starts it again, and says so
        again = region.wait_for(lambda: (s := status(region))[0] == 0 and s[1], "status 0 again")
        alloc = again["control_plane"]["allocator-0"]
        assert alloc["restarts"] == 1 and alloc["last_exit"]["signal"] == "SIGKILL" and alloc["pid"] != allocator
        restarts = [json.loads(line) for line in (tmp_path / "run" / "supervisor.restarts.jsonl").read_text().splitlines()]
        assert [(r["program"], r["pid"], r["signal"]) for r in restarts] == [("allocator-0", allocator, "SIGKILL")]

        # -- Redis emptied under the running allocator ---------------------------------------------------------
        region.ok("entitlement", "create", "e1", "--quota", "6")
        time.sleep(1)
        region.ok("job", "submit", job_spec(tmp_path / "a.yaml", "a", 3))
        region.wait_for(lambda: region.running("e1.a", 3), "e1.a running")
        r = Config.from_env(region.env).redis_client()  # the operator's Redis user (the default user is off)
        r.flushall()
        region.ok("job", "submit", job_spec(tmp_path / "b.yaml", "b", 3))
        region.wait_for(lambda: region.running("e1.b", 3), "e1.b running after the FLUSHALL")
        region.wait_for(lambda: sum(1 for _ in r.scan_iter(match="m:*")) == 9, "every machine indexed again")
        assert r.hget("entitlement:e1", "quota_machines") == b"6"
        log = region("replay").stdout
        assert "AllocationRejected" not in log and "create it" not in log
        assert "Redis lost the index" in (tmp_path / "run" / "allocator-0.log").read_text()

        # -- redis-server killed: the supervisor starts it again on its append-only file ------------------------
        redis_pid = status(region)[1]["programs"]["redis"]["pid"]
        os.kill(redis_pid, signal.SIGKILL)
        region.ok("job", "submit", job_spec(tmp_path / "c.yaml", "c", 2))
        region.wait_for(lambda: region.running("e1.c", 2), "e1.c running after redis-server was killed")
        rc, doc = status(region)
        assert rc == 0 and doc["programs"]["redis"]["restarts"] == 1 and doc["programs"]["redis"]["pid"] != redis_pid
        assert {t["machine"] for t in region.status("e1.a")["tasks"]} <= {m.decode()[2:] for m in r.scan_iter("m:*")}
        pids += [w["pid"] for w in doc["programs"].values()]
    finally:
        down = region("down")
    assert down.returncode == 0, down.stderr
    assert not any(pid_alive(p) for p in pids if p)
    assert not list((tmp_path / "run").glob("*.pid"))
    assert region("down").returncode == 0  # idempotent


def demo_pid(run_dir) -> int | None:
    doc = json.loads((run_dir / "agents" / "local-msb1-r01-m001" / "agent-state.json").read_text())
    pr = doc["procs"].get("demo.hello/0")
    return pr and pr["pid"]


def commands(region: RegionCli) -> int:
    return sum(1 for e in region.replay() if e["type"] == "TasksCommanded")


def uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line for line in fh if line.startswith("Uid:")).split()[1])


@pytest.mark.timeout(300)
def test_the_process_agent_stops_its_tasks_at_down_or_keeps_them_for_the_next_log(tmp_path):
    run = tmp_path / "run"
    region = RegionCli(run)
    seen: list[int] = []
    try:
        up = region.json("up", "--machines", "2")
        assert up and up["ready"] and up["demo"]["running"], up
        first = demo_pid(run)
        seen.append(first)
        # unprivileged: as root, the task runs as a uid of its own (processors/agent/isolation.py), else as the agent
        if os.geteuid() == 0:
            state = json.loads((run / "agents" / "local-msb1-r01-m001" / "agent-state.json").read_text())
            own = state["uids"]["demo.hello/0"]
            assert own in iso.UidRange.parse(iso.DEFAULT_UIDS) and iso.processes_of(own), state
        else:
            assert uid_of(first) == os.geteuid()
        made = commands(region)

        # -- down stops the task; up starts it again (the agent: no new command on the log) ---------------------
        region.ok("down")
        assert not pid_alive(first)
        again = region.json("up", "--machines", "2")
        assert again and again["ready"] and again["demo"]["running"], again
        second = demo_pid(run)
        seen.append(second)
        assert second != first and pid_alive(second)
        assert commands(region) == made
        log = (run / "agents" / "local-msb1-r01-m001" / "logs" / "demo.hello_0.log").read_text()
        assert log.count("spawn") == 2 and "hello from Ropewalk" in log

        # -- down --keep-tasks leaves it; up adopts it ----------------------------------------------------------
        region.ok("down", "--keep-tasks")
        assert pid_alive(second)
        kept = region.json("up", "--machines", "2")
        assert kept and kept["ready"] and kept["demo"]["running"] and demo_pid(run) == second

        # -- kept across a new log (the broker's data and Redis deleted): that log's START is run, no duplicate --
        region.ok("down", "--keep-tasks")
        assert pid_alive(second)
        for d in ("kafka", "redis"):
            shutil.rmtree(run / d)
        fresh = region.json("up", "--machines", "2")
        assert fresh and fresh["ready"] and fresh["demo"]["running"], fresh  # before: STARTING for good
        now = demo_pid(run)
        seen.append(now)
        assert pid_alive(now) and region.running("demo.hello", 1)
        # the kept process was not commanded by the new log when the agent read it: stopped, one process runs
        region.wait_for(lambda: not pid_alive(second) or second == now, "the old log's process stopped")
        assert "is another topic than the one its offsets belong to" in (run / "agent-local.log").read_text()
    finally:
        region("down")
    assert not any(pid_alive(p) for p in seen if p)
