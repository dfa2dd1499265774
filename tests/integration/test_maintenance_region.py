"""Maintenance never places into itself (issue 11, deliverable 6), on a real region driven through the CLI
(``ropewalk up``: broker, Redis, Resource Broker, the real allocator, a scheduler shard, simulated agents, health)
with the reference ``pacing`` TaskController as a process of its own.

The reproduction: with ``maintenance plan --msb dc1/msb2`` the pacing controller chose MOVE, and the allocator put
the task on a free machine of that same MSB (the scheduler's avoid list named only the machines its entitlement
held there; for the spread, msb2 had become the emptiest bin); ``machine list`` showed nothing of the maintenance.
Now the allocator's fold knows every planned maintenance from the ``unavailability`` topic and filters its machines
(``machine_in_maintenance``) for every placement, and ``state.machines`` carries it.

The job is pinned to dc1, whose two MSBs each get one of its two tasks: the task on msb2 has nowhere to go in dc1
but msb1 (or, before, a free msb2 machine). A job submitted during the maintenance never lands on msb2 either.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.process import die_with_parent
from processes import scrape, value
from processors.allocator.processor import MACHINES_METRIC_S
from regioncli import ROOT, RegionCli

SPEC = ("name: {name}\nentitlement: e1\ntasks: {tasks}\ncommand: [sleep, '3600']\n"
        "resources: {{cpu_millicores: 1000, memory_mib: 1024}}\nrequirements: {{dc: dc1}}\nspread: msb\n{extra}")


def check_metrics(where: dict) -> None:
    """Issue 13: every worker and the API serve Prometheus metrics where `up` said; names in base units; the
    control plane's work shows in them; no machine, task or job id is a label value."""
    targets = where["targets"]
    assert {"resourcebroker", "allocator-0", "scheduler-0", "agents", "agent-local", "health", "api", "rebalancer",
            "sidekick", "jobcontrol", "srm", "loans", "supervisor"} <= set(targets), targets
    assert json.loads(Path(where["file_sd"]).read_text())  # a Prometheus file_sd_configs file
    got = {w: scrape(a) for w, a in targets.items()}
    assert value(got["allocator-0"], "ropewalk_allocation_attempts_total", result="placed") >= 2
    # ropewalk_machines is counted from the fold every MACHINES_METRIC_S: its last count may predate the registration
    deadline = time.monotonic() + 3 * MACHINES_METRIC_S
    while value(got["allocator-0"], "ropewalk_machines", status="UP") < 40 and time.monotonic() < deadline:
        time.sleep(0.5)
        got["allocator-0"] = scrape(targets["allocator-0"])
    assert value(got["allocator-0"], "ropewalk_machines", status="UP") >= 40
    assert "ropewalk_index_staleness_seconds" in got["allocator-0"]
    assert value(got["scheduler-0"], "ropewalk_scheduling_attempt_duration_seconds_count", result="events") >= 1
    assert value(got["scheduler-0"], "ropewalk_submit_to_running_seconds_count") >= 1
    assert value(got["api"], "ropewalk_api_request_duration_seconds_count", route="/v1/jobs/{job}") >= 1
    assert any(value(fam, "ropewalk_consumer_lag_seconds") >= 0 and "ropewalk_consumer_lag_seconds" in fam
               for fam in got.values())
    for worker, fams in got.items():
        for name in fams:
            if name.startswith("ropewalk_"):
                assert not name.endswith(("_ms", "_milliseconds")), name
        labels = {v for samples in fams.values() for s in samples for v in s.labels.values()}
        assert not [v for v in labels if "-msb" in v or "e1.web" in v or v.startswith("local-")], (worker, labels)


def machines(cli) -> dict[str, dict]:
    return {m["id"]: m for m in cli.json("machine", "list")}


@pytest.mark.timeout(420)
def test_a_maintenance_never_places_into_itself_and_machine_list_shows_it(tmp_path):
    cli = RegionCli(tmp_path / "run")
    up = cli("up", "--machines", "40", "--no-demo", "--json")
    controller = None
    try:
        assert up.returncode == 0, up.stderr
        cli.ok("entitlement", "create", "e1", "--quota", "4")
        (tmp_path / "load").write_text("0.2")
        with open(tmp_path / "controller.log", "wb") as log:
            controller = subprocess.Popen(
                [sys.executable, "-m", "processors.taskcontrol.controllers", "pacing", "--name", "web", "--load-file",
                 str(tmp_path / "load"), "--keep-below-s", "60"], cwd=ROOT, env=cli.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        (tmp_path / "web.yaml").write_text(SPEC.format(name="web", tasks=2, extra="controller: web\n"))
        time.sleep(1)
        assert cli.ok("job", "submit", str(tmp_path / "web.yaml")).strip() == "e1.web"
        view = cli.wait_for(lambda: cli.running("e1.web", 2), "e1.web running", 120)
        assert sorted(t["msb"] for t in view["tasks"]) == ["msb1", "msb2"]
        check_metrics(json.loads(up.stdout)["metrics"])
        moving = next(t for t in view["tasks"] if t["msb"] == "msb2")

        plan = cli.json("maintenance", "plan", "--msb", "dc1/msb2", "--start", "+10m", "--duration", "30m",
                        "--deadline", "+5m")
        ue, planned = plan["unavailability_id"], set(plan["machines"])
        assert len(planned) == 10 and moving["machine"] in planned

        # the controller chose MOVE (a long maintenance): the task runs again, elsewhere, outside the maintenance
        def moved():
            v = cli.running("e1.web", 2)
            t = v and next(t for t in v["tasks"] if t["id"] == moving["id"])
            return v if t and t["machine"] != moving["machine"] else None
        after = cli.wait_for(moved, "the msb2 task moved by its controller", 120)
        landed = {t["id"]: t["machine"] for t in after["tasks"]}
        assert not planned & set(landed.values()), f"placed into the maintenance {ue}: {landed}"

        # a job submitted while the maintenance is planned never lands on its machines either
        (tmp_path / "batch.yaml").write_text(SPEC.format(name="batch", tasks=4, extra=""))
        cli.ok("job", "submit", str(tmp_path / "batch.yaml"))
        batch = cli.wait_for(lambda: cli.running("e1.batch", 4), "e1.batch running", 120)
        assert not planned & {t["machine"] for t in batch["tasks"]}

        # the machines' state shows the maintenance (state.machines, machine list), and stops showing it at its end
        shown = cli.wait_for(lambda: (ms := machines(cli)) and all(ms[m]["maintenance"] == [ue] for m in planned)
                             and ms, "machine list showing the maintenance")
        assert all(not m["maintenance"] for mid, m in shown.items() if mid not in planned)
        listed = cli.ok("machine", "list")
        assert listed.split()[:2] == ["MACHINE", "STATUS"] and ue in listed
        mlist = cli.ok("maintenance", "list")  # issue 13: a list verb for every noun, with a header row
        assert mlist.split()[0] == "MAINTENANCE" and ue in mlist and "10" in mlist.splitlines()[1].split()
        assert [m["unavailability_id"] for m in cli.json("maintenance", "list")] == [ue]
        wide = cli.ok("maintenance", "list", "-o", "wide").splitlines()  # when, from the log, through the API
        assert wide[0].split()[:6] == ["MAINTENANCE", "MACHINES", "STATUSES", "START", "DEADLINE", "DURATION"]
        assert any(f"(in {m}m)" in wide[1] for m in range(5, 11)), wide  # start +10m ...
        assert any(f"(in {m}m)" in wide[1] for m in range(0, 6)) or "s)" in wide[1], wide  # ... deadline +5m
        assert " 30m " in wide[1] and all(m in wide[1] for m in planned)
        jobs = cli.ok("job", "list", "-o", "wide").splitlines()
        assert jobs[0].split() == ["JOB", "STATE", "RUNNING", "TASKS", "ENTITLEMENT", "SPEC", "MACHINES", "DCS",
                                   "UPDATED", "LAST-REASON"]
        # issue 13: a new shell without the port variables finds the region its last `up` started (endpoints.json)
        bare = {k: v for k, v in cli.env.items() if k not in ("ROPEWALK_BROKER_PORT", "ROPEWALK_REDIS_PORT",
                                                                "ROPEWALK_CONTROLLER_PORT", "ROPEWALK_API_PORT",
                                                                "ROPEWALK_PARTITIONS")}
        st = cli.run_with(bare, "status")
        assert st.returncode == 0 and "DOWN" not in st.stdout, st.stdout + st.stderr
        assert "e1.web" in cli.run_with(bare, "job", "list").stdout
        cli.ok("maintenance", "end", ue)
        cli.wait_for(lambda: (ms := machines(cli)) and not any(m["maintenance"] for m in ms.values()),
                     "machine list without the maintenance")
        # issue 13: the README's maintenance example runs as written; a deadline after the start is one line
        readme = (ROOT / "README.md").read_text()
        example = "--msb dc1/msb2 --start +15m --duration 30m\n--deadline +10m"
        assert example in readme
        planned_again = cli("maintenance", "plan", *example.split())
        assert planned_again.returncode == 0 and "deadline" in planned_again.stdout, planned_again.stderr
        cli.ok("maintenance", "end", planned_again.stdout.split()[1])
        late = cli("maintenance", "plan", "--msb", "dc1/msb2", "--start", "+10m", "--duration", "30m",
                   "--deadline", "+15m")
        assert late.returncode == 1 and len(late.stderr.strip().splitlines()) == 1 and "deadline" in late.stderr
    finally:
        if controller is not None:
            controller.kill()
            controller.wait(10)
        down = cli("down")
    assert down.returncode == 0, down.stderr
