"""The whole core loop through the CLI, as a user drives it: `ropewalk up --machines N` starts the broker,
Redis and the control plane (Resource Broker, allocator, scheduler shard, simulated agents, health check);
an entitlement and a job are created; its tasks run spread over MSBs; a machine fails and its tasks move;
`ropewalk down` leaves no process behind."""
import json
import time
from pathlib import Path

import pytest

from infra.process import pid_alive
from regioncli import RegionCli

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_up_submit_fail_move_down(tmp_path):
    cli = RegionCli(tmp_path / "run")
    status, wait_for = cli.status, cli.wait_for

    up = cli("up", "--machines", "40", "--json")
    try:
        assert up.returncode == 0, up.stderr
        doc = json.loads(up.stdout)
        pids = [s["pid"] for s in doc["control_plane"].values()]
        assert len(pids) == 6
        assert doc["ready"] and doc["machines_indexed"] == 41  # up returns once the whole region is indexed
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

        running = lambda: cli.running("e1.web", 6)
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
