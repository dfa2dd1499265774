"""The control plane of a local region as managed processes: Resource Broker (registers a generated region),
Health Check Service, allocator, one scheduler shard, and simulated agents for every machine.

Each is a `python -m ...` worker with its pid and log under the run directory; `ropewalk up` starts them
after the broker and Redis, `ropewalk down` stops them first. Configuration reaches them through the same
ROPEWALK_* environment variables (infra/config.py).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import yaml

from infra.config import Config
from infra.process import ManagedProcess

HEARTBEAT_INTERVAL_MS = 2000
HEALTH_TIMEOUT_MS = 10000
READY_TIMEOUT_S = 90.0
NAMES = ("resourcebroker", "allocator", "scheduler-0", "agents", "health")


def _env(cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
                "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions),
                "ROPEWALK_RUN_DIR": str(cfg.run_dir), "PYTHONUNBUFFERED": "1"})
    return env


def write_region(cfg: Config, machines: int) -> Path:
    """The generated region as a spec file, so the broker and the simulated agents agree on machine ids."""
    from processors.resourcebroker.region import generate_region, spec_to_dict

    path = cfg.run_dir / "region.yaml"
    path.write_text(yaml.safe_dump(spec_to_dict(generate_region(machines)), sort_keys=False))
    return path


def processes(cfg: Config, region: Path | None = None) -> list[ManagedProcess]:
    py = sys.executable
    region_args = ["--region", str(region)] if region else []
    specs = {
        "resourcebroker": ["processors.resourcebroker.processor", *region_args],
        "allocator": ["processors.allocator.processor"],
        "scheduler-0": ["processors.scheduler.shard"],
        "agents": ["processors.agent.simulated", *region_args, "--interval-ms", str(HEARTBEAT_INTERVAL_MS)],
        "health": ["processors.health.processor", "--timeout-ms", str(HEALTH_TIMEOUT_MS), "--tick-ms", "1000"],
    }
    out = []
    for name in NAMES:
        proc = ManagedProcess(name=name, argv=[py, "-m", *specs[name]], port=None, run_dir=cfg.run_dir,
                              ready=lambda: True, start_timeout_s=2.0, env=_env(cfg))
        out.append(proc)
    return out


def machines_up(cfg: Config) -> int:
    """How many machines the allocator's Redis index holds in the free pool or an entitlement, status UP."""
    import redis

    from processors.allocator.index import MachineIndex
    from processors.allocator.placement import MACHINE_UP

    client = redis.Redis.from_url(cfg.redis_url)
    try:
        index = MachineIndex(client, cfg.topic_prefix)
        start = len(index.key("m:"))
        ids = [key.decode()[start:] for key in client.scan_iter(index.key("m:*"), count=1000)]
        return sum(m.status == MACHINE_UP for m in index.machines(ids).values())
    finally:
        client.close()


def up(cfg: Config, machines: int, ready_timeout_s: float = READY_TIMEOUT_S) -> dict:
    """Start the workers, then wait until the allocator's index holds all ``machines`` UP: a job submitted
    after ``up`` returns sees the whole region (not just the partitions indexed first). ``ready`` in the
    result says whether that happened within ``ready_timeout_s``; ``machines_up`` how many were seen."""
    region = write_region(cfg, machines)
    out = {}
    for proc in processes(cfg, region):
        out[proc.name] = proc.start()
        if proc.name == "resourcebroker":
            time.sleep(1.0)  # let registrations reach the log before the agents and the health check start
    deadline = time.monotonic() + ready_timeout_s
    seen = 0
    while time.monotonic() < deadline:
        if any(proc.pid() is None for proc in processes(cfg)):
            break
        seen = machines_up(cfg)
        if seen >= machines:
            break
        time.sleep(0.25)
    for proc in processes(cfg):
        if proc.pid() is None:  # died right after start: say why
            out[proc.name]["running"] = False
    return {"workers": out, "machines_up": seen, "ready": seen >= machines}


def down(cfg: Config) -> dict:
    return {p.name: p.stop() for p in reversed(processes(cfg))}


def status(cfg: Config) -> dict:
    return {p.name: p.status() for p in processes(cfg)}
