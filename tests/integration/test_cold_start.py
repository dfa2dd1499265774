"""A region that loses power everywhere at once (issue 26, item 2a): every process of it — the broker, Redis, the
supervisor, every worker, the agents and the tasks the process agent runs — SIGKILLed in one go, left dead for longer
than the health check's timeout, then `ropewalk up`: the region comes back as it was, the same tasks on the same
machines, and nothing was moved because the control plane itself was away (the health check restarts its silence
clocks when it starts: it does not judge the whole fleet silent; processors/health/README.md)."""
from __future__ import annotations

import json
import os
import time

import pytest

from infra.config import Config
from infra.services import power_off, power_off_survivors
from infra.process import processes_of
from processes import value, worker_metrics
from processors import controlplane
from regioncli import RegionCli

SPEC = ("name: web\nentitlement: e1\ntasks: 8\ncommand: [sleep, '3600']\n"
        "resources: {cpu_millicores: 1000, memory_mib: 1024}\nspread: rack\n")


def saved_tasks(cli) -> set[str]:
    """The tasks the simulated machines' state file holds (it is written every few seconds)."""
    try:
        doc = json.loads((cli.run_dir / "agents" / "simulated.json").read_text())
    except (OSError, ValueError):
        return set()
    return {t["task_id"] for st in doc["states"].values() for t in st["tasks"]}


def health_ticks(cli) -> float:
    return value(worker_metrics(cli.run_dir, "health"), "ropewalk_timer_ticks_total", worker="health")


@pytest.mark.timeout(900)
def test_every_process_killed_at_once_then_up_brings_the_region_back_as_it_was(tmp_path):
    cli = RegionCli(tmp_path / "run")
    up = cli("up", "--machines", "40", "--json", timeout_s=400)
    try:
        assert up.returncode == 0, up.stderr
        cfg = Config.from_env(cli.env)
        cli.ok("entitlement", "create", "e1", "--quota", "8")
        (tmp_path / "web.yaml").write_text(SPEC)
        cli.ok("job", "submit", str(tmp_path / "web.yaml"))
        before = cli.wait_for(lambda: cli.running("e1.web", 8), "e1.web running", 180)
        where = {t["id"]: t["machine"] for t in before["tasks"]}
        demo = cli.wait_for(lambda: cli.running("demo.hello", 1), "the demo running", 120)["tasks"][0]["machine"]
        # the simulated machines are running the tasks (their state is what a real machine's memory would be)
        cli.wait_for(lambda: set(where) <= saved_tasks(cli), "the simulated machines' state saved", 60)

        # -- power off: every process at once (and whatever a task's uid forks meanwhile)
        task_uids = {uid for state in (cfg.run_dir / "agents").glob("*/agent-state.json")
                     for uid in json.loads(state.read_text()).get("uids", {}).values()}
        killed_ms = int(time.time() * 1000)
        pids = power_off(cfg)
        assert {"program:broker", "supervisor", "program:redis", "program:health", "program:scheduler-0",
                "program:allocator-0", "program:agents", "program:agent-local"} <= set(pids), pids
        assert any(k.startswith("task:") for k in pids), pids  # the demo's process
        if os.geteuid() == 0:  # the demo runs as a uid of its own (in a sandbox if bwrap is here): its processes too
            assert task_uids and any(k.startswith("task:") and k.count(":") == 2 for k in pids), pids
        assert not power_off_survivors(pids)  # power_off waited until every process it killed was gone
        assert not {uid: processes_of(uid) for uid in task_uids if processes_of(uid)}  # nothing of a task outlived
        # dark for longer than the health check's timeout: every silence it could count is past it
        time.sleep(controlplane.HEALTH_TIMEOUT_MS / 1000 + 2)

        # -- power back: `ropewalk up`
        again = cli("up", "--machines", "40", "--json", timeout_s=400)
        assert again.returncode == 0, again.stderr
        after = cli.wait_for(lambda: cli.running("e1.web", 8), "e1.web running again", 240)
        assert {t["id"]: t["machine"] for t in after["tasks"]} == where, "a task moved"
        assert cli.wait_for(lambda: cli.running("demo.hello", 1), "the demo again", 240)["tasks"][0]["machine"] == demo
        # the health check has judged for well over a timeout since it started again (its ticks, not a sleep)
        start = health_ticks(cli)
        cli.wait_for(lambda: health_ticks(cli) >= start + 2 * controlplane.HEALTH_TIMEOUT_MS / 1000,
                     "two timeouts of health ticks", 120)
        events = [e for e in cli.replay() if e["timestamp_ms"] >= killed_ms]
        judged = [e for e in events if e["type"] in ("MachinesStatusChanged", "MachineStatusChanged")
                  and e["payload"]["status"] in ("UNHEALTHY", "DOWN")]
        assert judged == [], judged[:3]
        assert not [e for e in events if e["type"] in ("UnavailabilityStarted", "TasksAllocated")]
        assert not [e for e in events if e["type"] == "AllocationRequested" and e["payload"]["place_task_ids"]]
        st = cli("status", "--json")
        assert st.returncode == 0, st.stdout + st.stderr
        health_log = (cli.run_dir / "health.log").read_text()
        assert "every silence counts anew from now (started)" in health_log
    finally:
        cli("down")
