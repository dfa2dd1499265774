"""The log is the source of truth in fact (issue #9): a region survives `ropewalk down` / `up` with nothing
executed twice; it loses power everywhere at once and comes back as it was (issue #26, item 2a: every process of
it — the broker, Redis, the supervisor, every worker, the agents and the tasks the process agent runs — SIGKILLed in
one go, left dark for longer than the health check's timeout, then `ropewalk up`: the same tasks on the same
machines, nothing moved or judged because the control plane itself was away: the health check restarts its silence
clocks when it starts, processors/health/README.md); and a disaster (the broker's data and Redis gone) is recovered
from an archive with `ropewalk restore` without re-executing history.

The region holds each kind of history that went wrong before: a running job, a stopped job, a job whose task
moved off a failed machine, and that machine still DOWN. After each restart the region must read exactly as
before (job states, tasks and where they run, machines and their owners), `up` must be ready although a machine
is DOWN, and no TasksCommanded, AllocationRequested or TasksAllocated may be added: the scheduler's retry timer
(lowered to 1 s) runs several times meanwhile, so a re-executed history would show.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from processes import timer_ticks
from regioncli import RegionCli

from infra.config import Config
from infra.process import processes_of
from infra.services import power_off, power_off_survivors
from processors import controlplane

from processors.scheduler.shard import APP_ID

# Every kind of decision record: commands (TasksCommanded since decisions are batched per job; TaskCommanded in older
# logs), allocation requests, and the allocator's answers.
DECISIONS = ("TaskCommanded", "TasksCommanded", "AllocationRequested", "TasksAllocated", "AllocationRejected",
             "TasksDeallocated")
QUIET_ROUNDS = 3  # rounds of the scheduler's retry timer the restarted region runs before it is compared


def job_spec(path, name: str, tasks: int) -> str:
    path.write_text(f"name: {name}\nentitlement: e1\ntasks: {tasks}\ncommand: [sleep, '3600']\n"
                    "resources: {cpu_millicores: 1000, memory_mib: 1024}\nspread: msb\n")
    return str(path)


def snapshot(region: RegionCli) -> dict:
    """What a user sees of the region: jobs (state, tasks, machines), machines (status, owner)."""
    jobs = {}
    for job in ("e1.run", "e1.gone", "e1.moved"):
        view = region.status(job)  # a stopped job once gone: its last state, deleted (issue 30)
        jobs[job] = None if view is None or view["deleted"] else {"state": view["state"],
                              "tasks": sorted((t["id"], t["state"], t["machine"]) for t in view["tasks"])}
    machines = sorted((m["id"], m["status"], m["entitlement"]) for m in region.json("machine", "list"))
    return {"jobs": jobs, "machines": machines}


def decisions(region: RegionCli) -> dict[str, list[str]]:
    """The decision records of the test's jobs on the log, per type: their event ids in log order. Records, not
    distinct ids: a decision produced again (same derived id, which readers would dedupe) counts as executed twice.
    (The demo's task runs on the process agent, whose tasks end with `down`: starting it again is a new decision.)"""
    out: dict[str, list[str]] = {t: [] for t in DECISIONS}
    for e in region.replay():
        if e["type"] in out and e["payload"]["job_id"].startswith("e1."):
            out[e["type"]].append(e["event_id"])
    return {t: sorted(ids) for t, ids in out.items()}


def quiet(region: RegionCli, rounds: int = QUIET_ROUNDS) -> None:
    """Wait until the scheduler's retry timer (the one that decides again what is unplaced or overdue) has run
    ``rounds`` more rounds, counted by its metric: however slow the machine, the region had its chances to
    re-execute something."""
    def ticks() -> float | None:
        return timer_ticks(region.run_dir, "scheduler-0", APP_ID)

    region.wait_for(lambda: ticks() is not None, "the scheduler serves its metrics")
    first = ticks()
    region.wait_for(lambda: (ticks() or 0) >= first + rounds, f"{rounds} rounds of the scheduler's retry timer")


def health_ticks(region: RegionCli) -> float:
    return timer_ticks(region.run_dir, "health", "health") or 0.0


def power_loss(region: RegionCli) -> int:
    """Every process of the region SIGKILLed at once (and whatever a task's uid forks meanwhile), left dark for longer
    than the health check's timeout; the time it went dark (ms)."""
    cfg = Config.from_env(region.env)
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
    time.sleep(controlplane.HEALTH_TIMEOUT_MS / 1000 + 2)  # dark: every silence it could count is past the timeout
    return killed_ms


@pytest.mark.timeout(900)
def test_down_up_power_loss_and_disaster_restore_re_execute_nothing(tmp_path):
    region = RegionCli(tmp_path / "run", ROPEWALK_SCHEDULER_RETRY_S="1")
    try:
        up = region.json("up", "--machines", "24")
        assert up and up["ready"], up
        region.ok("entitlement", "create", "e1", "--quota", "8")
        time.sleep(1)
        for name, n in (("run", 3), ("gone", 2), ("moved", 3)):
            region.ok("job", "submit", job_spec(tmp_path / f"{name}.yaml", name, n))
        for name, n in (("run", 3), ("gone", 2), ("moved", 3)):
            region.wait_for(lambda: region.running(f"e1.{name}", n), f"e1.{name} running")
        region.ok("job", "stop", "e1.gone")
        region.wait_for(lambda: (region.status("e1.gone") or {}).get("deleted"), "e1.gone stopped and gone")
        moved = region.status("e1.moved")
        victim = moved["tasks"][0]["machine"]
        region.ok("machine", "fail", victim)
        region.wait_for(lambda: (v := region.running("e1.moved", 3)) and victim not in {t["machine"] for t in v["tasks"]},
                        "e1.moved's task moved off the failed machine")
        demo = region.wait_for(lambda: region.running("demo.hello", 1), "the demo running")["tasks"][0]["machine"]
        quiet(region)
        before, made = snapshot(region), decisions(region)
        assert made["TasksCommanded"] and made["TasksAllocated"], made  # the test sees the decisions it compares
        assert before["jobs"]["e1.gone"] is None and before["jobs"]["e1.run"]["state"] == "running"
        assert [m[1] for m in before["machines"] if m[0] == victim] == ["DOWN"]

        # -- down, then up: the same region, nothing executed twice ------------------------------------------
        region.ok("down")
        again = region.json("up")  # as a user types it: the region that ran (24 machines), not a new one of 200
        assert again and again["ready"], again  # ready although a machine is DOWN
        assert again["machines"] == 24 and again["machines_indexed"] == 25 and again["machines_up"] == 24
        quiet(region)
        assert snapshot(region) == before
        assert decisions(region) == made

        # -- a power loss of the whole region, then `ropewalk up`: the same region, nothing moved or judged ----
        region.wait_for(lambda: region.running("demo.hello", 1), "the demo running again")
        killed_ms = power_loss(region)
        back = region.json("up")
        assert back and back["ready"] and back["machines"] == 24, back
        # the cold start: the workers waited for the broker and Redis (none failed against a broker starting)
        assert {n: s["restarts"] for n, s in back["control_plane"].items() if s["restarts"]} == {}
        assert "held until `up` lists them again" in (region.run_dir / "supervisor.log").read_text()
        assert region.wait_for(lambda: region.running("demo.hello", 1), "the demo again")["tasks"][0]["machine"] == demo
        start = health_ticks(region)  # the health check judged for well over a timeout since it started again
        region.wait_for(lambda: health_ticks(region) >= start + 2 * controlplane.HEALTH_TIMEOUT_MS / 1000,
                        "two timeouts of health ticks")
        quiet(region)
        assert snapshot(region) == before, "a task moved, or a machine changed"
        assert decisions(region) == made
        events = [e for e in region.replay() if e["timestamp_ms"] >= killed_ms]
        judged = [e for e in events if e["type"] in ("MachinesStatusChanged", "MachineStatusChanged")
                  and e["payload"]["status"] in ("UNHEALTHY", "DOWN")]
        assert judged == [], judged[:3]
        assert not [e for e in events if e["type"] in ("UnavailabilityStarted", "TasksAllocated")]
        assert not [e for e in events if e["type"] == "AllocationRequested" and e["payload"]["place_task_ids"]]
        assert "every silence counts anew from now (started)" in (region.run_dir / "health.log").read_text()

        # -- a disaster: the broker's data and Redis are gone; restore from an archive ----------------------
        archived = region.json("archive", str(tmp_path / "arc"))
        assert archived["records"] > 0 and archived["complete"]
        region.ok("down")
        for d in ("kafka", "redis"):
            assert (tmp_path / "run" / d).is_dir()
            __import__("shutil").rmtree(tmp_path / "run" / d)
        restored = region.json("restore", str(tmp_path / "arc"))
        assert restored is not None and restored["records"] == archived["records"]
        # the faust groups, and the groups the workers report their positions to (issue 30: Kafka's lag tools)
        assert {"allocator", "scheduler"} <= set(restored["groups"])
        assert {g for g in restored["groups"] if g not in ("allocator", "scheduler")} == {
            g for g in restored["groups"] if g.startswith("ropewalk-position-")}
        assert restored["offsets_moved"] == [p for p in restored["offsets_moved"] if "changelog" in p or "state." in p
                                             or "_schemas" in p], "a data topic's offsets moved"
        assert restored["index"]["machines"] == 25
        # status after the restore (issue 13): the records each topic holds are the archived ones, and it says
        # which archive the log came from (the control plane is down: exit 1, the document all the same)
        st = json.loads(region("status", "--json").stdout)
        assert st["restored"]["archive"] == str((tmp_path / "arc").resolve())
        assert st["restored"]["offsets_moved"] == sorted(restored["offsets_moved"])
        assert st["topics"] == {t: archived["per_topic"].get(t, 0) for t in st["topics"]}
        restored_up = region.json("up", "--machines", "24")
        assert restored_up and restored_up["ready"], restored_up
        quiet(region)
        assert snapshot(region) == before
        assert decisions(region) == made
    finally:
        region("down")
