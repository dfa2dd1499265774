"""A scaled-out region loses a part of itself, then the power, and `ropewalk up` brings it back as it was (issue #26's
check, as a user runs it): `ropewalk up --brokers 3 --schedulers 2 --allocators 2 --machines 24 --no-demo`; jobs of
four entitlements submitted while a broker node, a scheduler shard and an allocator are each SIGKILLed (the supervisor
starts each again); every job RUNNING; then every process of the region SIGKILLed at once (``infra.services.power_off``:
the brokers, Redis, the supervisor, the workers, the agents and the process agent's tasks), dark longer than the
health check's timeout, and `ropewalk up` **without flags**: the same region (24 machines, 3 nodes, 2 shards, 2
allocators, no demo job made), every task on the machine it ran on, and the kill storm's checker on the replayed log:
nothing placed, started or running twice, no machine over capacity, no quota broken, no event id with two bodies.

`make test-long` (about 3 minutes): CI has its parts in brief, the bare `up` after a power loss in
tests/integration/test_durable.py, a scaled-out power loss in tests/integration/test_killstorm.py, the workers held at a
cold start in tests/integration/test_supervisor.py. The figures of a run are in RELIABILITY.md.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from bench.killstorm import replay_checks
from infra import supervisor
from infra.config import Config
from infra.services import power_off, power_off_survivors
from processors import controlplane
from regioncli import RegionCli
from streams.serde import SchemaRegistry

pytestmark = pytest.mark.long

ENTITLEMENTS = ("ea", "eb", "ec", "ed")
JOBS = 12
NEVER = ("conflicting_duplicates", "tasks_placed_twice", "tasks_started_twice", "tasks_running_twice",
         "machines_overcommitted", "quota_breaches")  # the storm's checker (bench/killstorm.replay_checks): all 0
VICTIMS = {2: "broker-2", 5: "scheduler-1", 8: "allocator-0"}  # after the job of this index is submitted


def job_spec(path, entitlement: str, n: int, tasks: int) -> str:
    path.write_text(f"name: j{n}\nentitlement: {entitlement}\ntasks: {tasks}\ncommand: [sleep, '3600']\n"
                    "resources: {cpu_millicores: 1000, memory_mib: 1024}\nspread: msb\n")
    return str(path)


@pytest.mark.timeout(900)
def test_a_scaled_out_region_killed_in_parts_then_all_at_once_comes_back_as_it_was(tmp_path):
    region = RegionCli(tmp_path / "run")
    try:
        up = region.json("up", "--machines", "24", "--brokers", "3", "--schedulers", "2", "--allocators", "2",
                         "--no-demo")
        assert up and up["ready"] and (up["schedulers"], up["allocators"]) == (2, 2), up
        for ent in ENTITLEMENTS:
            region.ok("entitlement", "create", ent, "--quota", "6")
        jobs: dict[str, int] = {}
        for i in range(JOBS):
            ent, tasks = ENTITLEMENTS[i % len(ENTITLEMENTS)], 2 + i % 3
            region.ok("job", "submit", job_spec(tmp_path / f"{ent}-{i}.yaml", ent, i, tasks))
            jobs[f"{ent}.j{i}"] = tasks
            if i in VICTIMS:
                os.kill(supervisor.programs_state(region.run_dir)[VICTIMS[i]]["pid"], signal.SIGKILL)
        for job, n in jobs.items():
            region.wait_for(lambda: region.running(job, n), f"{job} running", 240)
        restarts = {n: s["restarts"] for n, s in supervisor.programs_state(region.run_dir).items() if s["restarts"]}
        assert set(VICTIMS.values()) <= set(restarts), restarts  # each victim was started again

        def placements() -> dict[str, list[tuple[str, str]]]:
            return {j: sorted((t["id"], t["machine"]) for t in region.status(j)["tasks"]) for j in jobs}

        before = placements()
        cfg = Config.from_env(region.env)
        pids = power_off(cfg)
        assert not power_off_survivors(pids)
        assert {"supervisor", "program:broker-1", "program:broker-2", "program:broker-3", "program:redis",
                "program:scheduler-1", "program:allocator-1"} <= set(pids), sorted(pids)
        time.sleep(controlplane.HEALTH_TIMEOUT_MS / 1000 + 2)  # dark longer than the health check's timeout

        t_up = time.monotonic()
        back = region.json("up")  # as a user types it after the power is back
        up_s = time.monotonic() - t_up
        assert back and back["ready"], back
        assert (back["machines"], back["schedulers"], back["allocators"], back["demo"]) == (24, 2, 2, None), back
        programs = supervisor.programs_state(region.run_dir)
        assert all(programs[f"broker-{i}"]["running"] for i in (1, 2, 3)), programs  # the cluster the run dir holds
        # the workers waited for the broker and Redis: none failed against a broker still starting
        assert {n: s["restarts"] for n, s in back["control_plane"].items() if s["restarts"]} == {}
        for job, n in jobs.items():
            region.wait_for(lambda: region.running(job, n), f"{job} running again", 240)
        running_s = time.monotonic() - t_up
        assert placements() == before  # every task where it ran: nothing moved because the control plane was away

        checks = replay_checks(cfg, SchemaRegistry.from_dir())
        assert {k: checks[k] for k in NEVER} == dict.fromkeys(NEVER, 0), checks
        assert checks["tasks_placed"] >= sum(jobs.values())
        print(f"\n{len(jobs)} jobs, {sum(jobs.values())} tasks; killed: {restarts}; power off: {len(pids)} processes; "
              f"`up` ready {up_s:.1f} s, every job RUNNING {running_s:.1f} s after it began; moved: 0; "
              f"{checks['records_replayed']} records replayed, {checks['duplicate_records']} records twice (same body)")
    finally:
        region("down")
