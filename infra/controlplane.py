"""The control plane of a local region as managed processes: Resource Broker (registers a generated region),
Health Check Service, allocator, one scheduler shard, the ReBalancer and Sidekick (``UPPER``: each folds the
region's log as the allocator does), simulated agents for every generated machine, and one
real process agent for the region's ``local`` machine (``LOCAL_MACHINE_ID``, type ``process``, in a DC of its
own): tasks placed there run as OS processes of this computer, logs under ``<run dir>/agents/<machine>/``.

Each is a `python -m ...` worker with its pid and log under the run directory; `ropewalk up` starts them
after the broker and Redis, `ropewalk down` stops them first. Configuration reaches them through the same
ROPEWALK_* environment variables (infra/config.py).
"""
from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from infra.config import Config
from infra.process import ManagedProcess

HEARTBEAT_INTERVAL_MS = 2000
HEALTH_TIMEOUT_MS = 10000
READY_TIMEOUT_S = 90.0
NAMES = ("resourcebroker", "allocator", "scheduler-0", "agents", "agent-local", "health", "rebalancer", "sidekick")
UPPER = ("rebalancer", "sidekick")  # Twine's upper floors: left out of the benchmark's regions (bench/env.py)
LOCAL_DC = "local"
LOCAL_MACHINE_TYPE = "process"
LOCAL_CPU_MILLICORES = 2000
LOCAL_MEMORY_MIB = 2048
LOCAL_MACHINE_ID = "local-msb1-r01-m001"  # what region.iter_machines names the one machine of LOCAL_DC


def worker_env(cfg: Config) -> dict[str, str]:
    """A worker process's environment: this one's, with ``cfg`` as ROPEWALK_* variables."""
    env = dict(os.environ)
    env.update({"ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
                "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions),
                "ROPEWALK_RUN_DIR": str(cfg.run_dir), "PYTHONUNBUFFERED": "1"})
    return env


def write_region(cfg: Config, machines: int, *, local: bool = True) -> Path:
    """The generated region as a spec file, so the broker and the simulated agents agree on machine ids."""
    from processors.resourcebroker.region import generate_region, spec_to_dict

    spec = spec_to_dict(generate_region(machines))
    if local:  # the process agent's machine
        spec["dcs"].append(local_dc())
    path = cfg.run_dir / "region.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def local_dc() -> dict:
    """The region spec's DC of one machine for the process agent."""
    return {"name": LOCAL_DC, "msbs": 1, "racks_per_msb": 1, "machines": 1, "machines_per_rack": 1,
            "machine_types": LOCAL_MACHINE_TYPE,
            "capacity": {LOCAL_MACHINE_TYPE: {"cpu_millicores": LOCAL_CPU_MILLICORES,
                                              "memory_mib": LOCAL_MEMORY_MIB}}}


def processes(cfg: Config, region: Path | None = None, *, local: bool = True) -> list[ManagedProcess]:
    py = sys.executable
    region_args = ["--region", str(region)] if region else []
    specs = {
        "resourcebroker": ["processors.resourcebroker.processor", *region_args],
        "allocator": ["processors.allocator.processor"],
        "scheduler-0": ["processors.scheduler.shard"],
        "agents": ["processors.agent.simulated", *region_args, "--exclude", LOCAL_MACHINE_ID,
                   "--interval-ms", str(HEARTBEAT_INTERVAL_MS), "--state-file", str(simulated_state_file(cfg))],
        "agent-local": ["processors.agent.process", "--machine-id", LOCAL_MACHINE_ID,
                        "--tick-ms", str(HEARTBEAT_INTERVAL_MS)],
        "health": ["processors.health.processor", "--timeout-ms", str(HEALTH_TIMEOUT_MS), "--tick-ms", "1000"],
        "rebalancer": ["processors.rebalancer.processor"],
        "sidekick": ["processors.sidekick.processor"],
    }
    out = []
    for name in NAMES:
        if name == "agent-local" and not local:
            continue
        proc = ManagedProcess(name=name, argv=[py, "-m", *specs[name]], port=None, run_dir=cfg.run_dir,
                              ready=lambda: True, start_timeout_s=2.0, env=worker_env(cfg))
        out.append(proc)
    return out


def simulated_state_file(cfg: Config) -> Path:
    """Where the simulated machines keep their state across `down`/`up` (processors/agent/simulated.py)."""
    return Path(cfg.run_dir) / "agents" / "simulated.json"


def machines_indexed(cfg: Config) -> dict[str, int]:
    """How many machines the allocator's Redis index holds, by status (UP, DOWN, ...)."""
    import redis

    from processors.allocator.index import MachineIndex

    client = redis.Redis.from_url(cfg.redis_url)
    try:
        index = MachineIndex(client, cfg.topic_prefix)
        return dict(Counter(m.status for m in index.machines(index.machine_ids()).values()))
    finally:
        client.close()


def up(cfg: Config, machines: int, ready_timeout_s: float = READY_TIMEOUT_S) -> dict:
    """Start the workers, then wait until the allocator's index holds all ``machines`` (+ the local one), whatever
    their status: a job submitted after ``up`` returns sees the whole region (not just the partitions indexed
    first). ``ready`` in the result says whether that happened within ``ready_timeout_s``; ``machines_indexed``
    how many were seen, ``machines_up`` how many of them are UP. (A Redis that lost the index is written again
    by the allocator itself: it folds the log at start and projects the fold into a Redis that lags it.)"""
    from processors.allocator.placement import MACHINE_UP

    region = write_region(cfg, machines)
    out = {}
    for proc in processes(cfg, region):
        out[proc.name] = proc.start()
        if proc.name == "resourcebroker":
            time.sleep(1.0)  # let registrations reach the log before the agents and the health check start
    deadline = time.monotonic() + ready_timeout_s
    seen: dict[str, int] = {}
    while time.monotonic() < deadline:
        if any(proc.pid() is None for proc in processes(cfg)):
            break
        seen = machines_indexed(cfg)
        if sum(seen.values()) >= machines + 1:
            break
        time.sleep(0.25)
    for proc in processes(cfg):
        if proc.pid() is None:  # died right after start: say why
            out[proc.name]["running"] = False
    indexed = sum(seen.values())
    return {"workers": out, "machines_indexed": indexed, "machines_up": seen.get(MACHINE_UP, 0),
            "machines_by_status": seen, "ready": indexed >= machines + 1}


def down(cfg: Config) -> dict:
    return {p.name: p.stop() for p in reversed(processes(cfg))}


def status(cfg: Config) -> dict:
    return {p.name: p.status() for p in processes(cfg)}
