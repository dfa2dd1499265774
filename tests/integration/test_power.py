"""A DC's power lost and back on a real region driven through the CLI (issue 26, item 2b), and the boomerang: a power
loss of the DC that hosts Ropewalk's own control plane does not take the control plane down.

``ropewalk up`` (broker, Redis, every worker under the supervisor, simulated agents, the process agent of the
``local`` machine with the demo job). ``machine power-loss --dc dc1``: the Resource Broker's UnavailabilityStarted
POWER; the job pinned to dc1 loses every task at once (none can run elsewhere), the simulated agents of dc1 go dark,
and the health check — which knows those machines are away, not silent — judges none of them. ``power-loss --dc
local``: the machine the control plane runs on; the demo task there is stopped (the scheduler's fence) but every
worker keeps running, none restarted, the API answers. ``power-restore`` of both: every task runs again, where it
ran (the job's DC, the local machine)."""
from __future__ import annotations

import json

import pytest

from regioncli import RegionCli

SPEC = ("name: web\nentitlement: e1\ntasks: 8\ncommand: [sleep, '3600']\n"
        "resources: {cpu_millicores: 1000, memory_mib: 1024}\nrequirements: {dc: dc1}\nspread: rack\n")
LOCAL = "local-msb1-r01-m001"


def statuses_of(events, reason=None):
    """(machine, status, reason) of every machine status change in a replay."""
    out = []
    for e in events:
        p = e["payload"]
        if e["type"] == "MachinesStatusChanged":
            out += [(m["machine_id"], p["status"], p["reason"]) for m in p["machines"]]
        elif e["type"] == "MachineStatusChanged":
            out.append((p["machine_id"], p["status"], p["reason"]))
    return [s for s in out if reason is None or s[2] == reason]


def workers(cli) -> dict:
    """Every worker of the supervisor (and redis-server) with its state and restarts."""
    out = cli("status", "--json")
    return json.loads(out.stdout)["programs"]


def dark(cli) -> set[str]:
    """The machines the simulated agents hold dark (their state file, saved every few seconds)."""
    try:
        return set(json.loads((cli.run_dir / "agents" / "simulated.json").read_text()).get("power", {}))
    except (OSError, ValueError):
        return set()


@pytest.mark.timeout(900)
def test_a_dc_loses_its_power_and_gets_it_back_and_the_control_plane_survives_its_own(tmp_path):
    cli = RegionCli(tmp_path / "run")
    up = cli("up", "--machines", "40", "--json", timeout_s=400)
    try:
        assert up.returncode == 0, up.stderr
        cli.ok("entitlement", "create", "e1", "--quota", "20")
        (tmp_path / "web.yaml").write_text(SPEC)
        cli.ok("job", "submit", str(tmp_path / "web.yaml"))
        before = cli.wait_for(lambda: cli.running("e1.web", 8), "e1.web running", 180)
        homes = {t["id"]: t["machine"] for t in before["tasks"]}
        assert {t["dc"] for t in before["tasks"]} == {"dc1"}
        cli.wait_for(lambda: cli.running("demo.hello", 1), "the demo running on the local machine", 120)
        restarts = {n: w["restarts"] for n, w in workers(cli).items()}

        # -- bad input: a clear error, nothing produced
        bad = cli("machine", "power-loss", "--dc", "dc9")
        assert bad.returncode == 1 and "dc: no registered machine in 'dc9'" in bad.stderr, bad.stderr
        bad = cli("machine", "power-loss", "--rack", "dc1")
        assert bad.returncode == 1 and "rack: expected <dc>/<msb>/<rack>, got 'dc1'" in bad.stderr, bad.stderr
        bad = cli("machine", "power-loss")
        assert bad.returncode != 0 and "one of the arguments --dc --msb --rack is required" in bad.stderr

        # -- dc1 loses its power
        lost = cli.json("machine", "power-loss", "--dc", "dc1")
        dc1 = set(lost["machines"])
        assert len(dc1) == 20 and all(m.startswith("dc1-") for m in dc1) and len(lost["unavailability_ids"]) >= 1
        gone = cli.wait_for(lambda: (v := cli.status("e1.web")) and not any(t["state"] == "RUNNING"
                                                                             for t in v["tasks"]) and v,
                            "every task of e1.web gone", 60)
        assert len(gone["tasks"]) == 8
        cli.wait_for(lambda: dark(cli) >= dc1, "the simulated machines of dc1 dark", 60)
        listed = {m["id"]: m for m in cli.json("machine", "list")}
        cli.wait_for(lambda: all(m["status"] == "DOWN" for i, m in {m["id"]: m for m in cli.json("machine", "list")}
                                 .items() if i in dc1), "dc1 DOWN in machine list", 60)
        assert listed  # the API answers through it all

        # -- the boomerang: the DC of the control plane's own machine loses its power
        local = cli.json("machine", "power-loss", "--dc", "local")
        assert local["machines"] == [LOCAL]
        cli.wait_for(lambda: (v := cli.status("demo.hello")) and v["tasks"][0]["state"] != "RUNNING",
                     "the demo task stopped", 60)
        again = cli("machine", "power-loss", "--dc", "dc1", "--json")
        assert again.returncode == 0 and json.loads(again.stdout)["machines"] == []  # announced twice: nothing
        now = workers(cli)
        assert all(w["running"] for w in now.values()), now
        assert {n: w["restarts"] for n, w in now.items()} == restarts, "no worker went down with the power"

        # -- power back: every task restarts where it ran
        back = cli.json("machine", "power-restore", "--dc", "dc1")
        assert set(back["machines"]) == dc1
        cli.ok("machine", "power-restore", "--dc", "local")
        after = cli.wait_for(lambda: cli.running("e1.web", 8), "e1.web running again", 240)
        assert {t["dc"] for t in after["tasks"]} == {"dc1"}
        cli.wait_for(lambda: cli.running("demo.hello", 1), "the demo running again", 240)
        cli.wait_for(lambda: not (dark(cli) & dc1), "dc1's simulated machines on again", 60)
        nothing = cli("machine", "power-restore", "--dc", "dc1")
        assert nothing.returncode == 0 and "nothing to do" in nothing.stdout

        # the health check judged none of the dark machines: their absence was announced, not a silence
        events = cli.replay()
        assert not [s for s in statuses_of(events, "heartbeat_missed") if s[0] in dc1 | {LOCAL}]
        assert not [e for e in events if e["type"] == "ZoneDisruptionChanged"]
        powered = [s for s in statuses_of(events) if s[2] in ("power", "power_restored")]
        assert {m for m, st, _ in powered if st == "DOWN"} == dc1 | {LOCAL}
        assert {m for m, st, _ in powered if st == "UP"} == dc1 | {LOCAL}
        kinds = {e["payload"].get("kind") for e in events if e["type"] == "UnavailabilityStarted"}
        assert "POWER" in kinds
        final = workers(cli)
        assert {n: w["restarts"] for n, w in final.items()} == restarts and all(
            w["running"] for w in final.values()), final
        assert len(homes) == 8
    finally:
        cli("down")
