"""The control plane of a local region as managed processes: Resource Broker (registers a generated region),
Health Check Service, allocators (``allocator-0..M-1``), scheduler shards (``scheduler-0..N-1``), the ReBalancer and
Sidekick, the Job Control Plane, the SRM
autoscaler and the Resource Broker's lender of elastic loans (``UPPER``: Twine's upper floors, each folding the
region's log as the allocator does), simulated agents for every generated machine, and one
real process agent for the region's ``local`` machine (``LOCAL_MACHINE_ID``, type ``process``, in a DC of its
own): tasks placed there run as OS processes of this computer, logs under ``<run dir>/agents/<machine>/``.

Each is a `python -m ...` worker with its pid and log under the run directory. `ropewalk up` has the region's
supervisor (infra/supervisor.py) run them, after the broker and Redis: a worker that dies is started again
after a backoff, and each restart is recorded; `ropewalk status` shows every expected worker with its state and
restarts; `ropewalk down` stops the supervisor, the workers first. Configuration reaches them through the same
ROPEWALK_* environment variables (infra/config.py).

**Several of each** (``ropewalk up --schedulers N --allocators M``, ``SCALED``): the scheduler shards are one faust
consumer group, which splits the partitions among them (a shard that dies hands its partitions to the others); the
allocators are another, which splits the ``allocations`` partitions (each folds the whole log and decides the
requests of the partitions it owns; processors/allocator/README.md). A later ``up`` with other counts starts the
shards it adds and stops (``supervisor.retire``) those it removes, highest index first; an ``up`` without the flags
keeps the counts that run.
"""
from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from infra import supervisor
from infra.config import Config
from infra.process import ManagedProcess
from processors.resourcebroker.region import RegionSpecError, generate_region, load_region, spec_to_dict
from streams.enums import MachineStatus

HEARTBEAT_INTERVAL_MS = 2000
HEALTH_TIMEOUT_MS = 10000
READY_TIMEOUT_S = 90.0
DEFAULT_MACHINES = 200  # simulated machines of a new local region (`up --machines`)
# Workers run N times, each named ``<kind>-<i>`` (i from 0): kind -> its module. Every other worker runs once.
SCALED = {"allocator": "processors.allocator.processor", "scheduler": "processors.scheduler.shard"}
DEFAULT_COUNTS = {"scheduler": 1, "allocator": 1}
SINGLE = ("resourcebroker", "agents", "agent-local", "health", "api", "rebalancer", "sidekick", "jobcontrol", "srm",
          "loans")
UPPER = ("rebalancer", "sidekick", "jobcontrol", "srm", "loans")  # left out of the bench's regions (bench/env.py)
RENAMED = ("allocator",)  # workers of an older Ropewalk's region, now named otherwise (allocator-0): `up` retires them
LOCAL_DC = "local"
LOCAL_MACHINE_TYPE = "process"
LOCAL_CPU_MILLICORES = 2000
LOCAL_MEMORY_MIB = 2048
LOCAL_MACHINE_ID = "local-msb1-r01-m001"  # what region.iter_machines names the one machine of LOCAL_DC


def scaled_name(kind: str, i: int) -> str:
    return f"{kind}-{i}"


def kind_of(name: str) -> str | None:
    """The ``SCALED`` kind of a worker's name (``scheduler-2`` -> ``scheduler``), or None."""
    kind, _, index = name.rpartition("-")
    return kind if kind in SCALED and index.isdigit() else None


def names(schedulers: int = 1, allocators: int = 1) -> tuple[str, ...]:
    """The workers of a region of these counts, in start order."""
    counts = {"scheduler": schedulers, "allocator": allocators}
    return ("resourcebroker", *(scaled_name("allocator", i) for i in range(counts["allocator"])),
            *(scaled_name("scheduler", i) for i in range(counts["scheduler"])), *SINGLE[1:])


def is_worker(name: str) -> bool:
    return name in SINGLE or kind_of(name) is not None


def check_counts(cfg: Config, schedulers: int, allocators: int) -> None:
    """A shard or an allocator owns partitions: from 1 to the partitions of the region (``ROPEWALK_PARTITIONS``);
    ValueError naming the flag otherwise."""
    for flag, n in (("--schedulers", schedulers), ("--allocators", allocators)):
        if not 1 <= n <= cfg.partitions:
            raise ValueError(f"{flag}: expected from 1 to {cfg.partitions} (the partitions of each entitlement-keyed "
                             f"topic, ROPEWALK_PARTITIONS: each owns at least one), got {n}")


def running_counts(cfg: Config) -> dict[str, int]:
    """How many of each ``SCALED`` kind the supervisor is to run now (its programs file); 0 when none."""
    out = dict.fromkeys(SCALED, 0)
    for name in supervisor.expected(cfg.run_dir):
        kind = kind_of(name)
        if kind is not None:
            out[kind] = max(out[kind], int(name.rpartition("-")[2]) + 1)
    return out


def worker_env(cfg: Config) -> dict[str, str]:
    """A worker process's environment: this one's, with ``cfg`` as ROPEWALK_* variables."""
    env = dict(os.environ)
    env.update({"ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
                "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions),
                "ROPEWALK_RUN_DIR": str(cfg.run_dir), "ROPEWALK_SECRETS_DIR": str(cfg.secrets),
                "ROPEWALK_API_PORT": str(cfg.api_port), "PYTHONUNBUFFERED": "1"})
    if cfg.replication_factor is not None:  # the replicas of the topics a worker creates (faust's changelogs)
        env["ROPEWALK_REPLICATION_FACTOR"] = str(cfg.replication_factor)
    return env


def write_region(cfg: Config, machines: int, *, local: bool = True) -> Path:
    """The generated region as a spec file, so the broker and the simulated agents agree on machine ids."""
    spec = spec_to_dict(generate_region(machines))
    if local:  # the process agent's machine
        spec["dcs"].append(local_dc())
    path = cfg.run_dir / "region.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def held_machines(cfg: Config) -> int | None:
    """The simulated machines of the region the run directory holds (its ``region.yaml`` less the local DC), or None
    when it holds none (or one that cannot be read): what `up` without ``--machines`` runs again, so a region
    started after `down` or a power loss is the one that ran (not one of ``DEFAULT_MACHINES``)."""
    path = cfg.run_dir / "region.yaml"
    if not path.exists():
        return None
    try:
        spec = load_region(path)
    except (OSError, RegionSpecError, yaml.YAMLError):
        return None
    return sum(dc.machines for dc in spec.dcs if dc.name != LOCAL_DC)


def local_dc() -> dict:
    """The region spec's DC of one machine for the process agent."""
    return {"name": LOCAL_DC, "msbs": 1, "racks_per_msb": 1, "machines": 1, "machines_per_rack": 1,
            "machine_types": LOCAL_MACHINE_TYPE,
            "capacity": {LOCAL_MACHINE_TYPE: {"cpu_millicores": LOCAL_CPU_MILLICORES,
                                              "memory_mib": LOCAL_MEMORY_MIB}}}


def processes(cfg: Config, region: Path | None = None, *, local: bool = True, schedulers: int = 1,
              allocators: int = 1) -> list[ManagedProcess]:
    py = sys.executable
    region_args = ["--region", str(region)] if region else []
    specs = {
        "resourcebroker": ["processors.resourcebroker.processor", *region_args],
        "agents": ["processors.agent.simulated", *region_args, "--exclude", LOCAL_MACHINE_ID,
                   "--interval-ms", str(HEARTBEAT_INTERVAL_MS), "--state-file", str(simulated_state_file(cfg))],
        "agent-local": ["processors.agent.process", "--machine-id", LOCAL_MACHINE_ID,
                        "--tick-ms", str(HEARTBEAT_INTERVAL_MS)],
        "health": ["processors.health.processor", "--timeout-ms", str(HEALTH_TIMEOUT_MS), "--tick-ms", "1000"],
        "api": ["processors.api.server", "--port", str(cfg.api_port)],  # the HTTP API (processors/api)
        "rebalancer": ["processors.rebalancer.processor"],
        "sidekick": ["processors.sidekick.processor"],
        "jobcontrol": ["processors.jobcontrol.processor"],  # intents -> reconciled specs (issue 15)
        "srm": ["processors.srm.processor"],  # load -> sizing intents
        "loans": ["processors.resourcebroker.lender"],  # elastic loans of the Resource Broker
    }
    specs.update({scaled_name(kind, i): [module] for kind, module in SCALED.items()
                  for i in range({"scheduler": schedulers, "allocator": allocators}[kind])})
    out = []
    for name in names(schedulers, allocators):
        if name == "agent-local" and not local:
            continue
        api = name == "api"  # the one worker with a port: ready once it answers /healthz
        proc = ManagedProcess(name=name, argv=[py, "-m", *specs[name]], port=cfg.api_port if api else None,
                              run_dir=cfg.run_dir, ready=(lambda: api_ready(cfg)) if api else (lambda: True),
                              start_timeout_s=30.0 if api else 2.0, env=worker_env(cfg))
        out.append(proc)
    return out


def programs(cfg: Config, region: Path | None = None, *, local: bool = True, env: dict[str, str] | None = None,
             schedulers: int = 1, allocators: int = 1) -> list[supervisor.Program]:
    """The workers as the supervisor's programs: the argv of ``processes``, the ROPEWALK_* configuration (and
    ``env``) as their environment, on top of the supervisor's."""
    env = {**{k: v for k, v in worker_env(cfg).items() if k.startswith("ROPEWALK_") or k == "PYTHONUNBUFFERED"},
           **(env or {})}
    # ROPEWALK_WORKER_NAME: the name a worker serves its metrics under (infra/metrics.serve_worker)
    return [supervisor.Program(p.name, tuple(p.argv), {**env, "ROPEWALK_WORKER_NAME": p.name})
            for p in processes(cfg, region, local=local, schedulers=schedulers, allocators=allocators)]


def api_ready(cfg: Config) -> bool:
    import urllib.request  # noqa: PLC0415 - start-up: urllib.request, ssl (~12 ms); `up` only

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{cfg.api_port}/healthz", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def local_machine_key(cfg: Config) -> Path | None:
    """The process agent's own key (``LOCAL_MACHINE_ID``'s, infra/trust.py), written by the operator's ``up`` like any
    machine's (``ropewalk keys machine``); None in a region without keys."""
    from infra import trust  # noqa: PLC0415 - start-up: the key ring (~8 ms); `up` only

    if trust.trust_doc(cfg.secrets) is None:
        return None
    return trust.write_machine_key(cfg.secrets, LOCAL_MACHINE_ID)


def simulated_state_file(cfg: Config) -> Path:
    """Where the simulated machines keep their state across `down`/`up` (processors/agent/simulated.py)."""
    return Path(cfg.run_dir) / "agents" / "simulated.json"


def machines_indexed(cfg: Config) -> dict[str, int]:
    """How many machines the allocator's Redis index holds, by status (UP, DOWN, ...), read as the read-only user;
    none while Redis does not answer (a redis-server being started again by the supervisor)."""
    import redis  # noqa: PLC0415 - start-up: redis (~70 ms); up and status only

    from processors.allocator.index import FunctionsMissing, MachineIndex  # noqa: PLC0415 - start-up: redis, as above

    client = cfg.redis_client(read_only=True)
    try:
        index = MachineIndex(client, cfg.topic_prefix)
        summary = index.summary()  # one small read; an index written before the summary existed is counted
        if summary is not None:
            return summary
        operator = cfg.redis_client()  # a scan: the operator's (a read-only user may not)
        try:
            ids = MachineIndex(operator, cfg.topic_prefix).machine_ids()
        finally:
            operator.close()
        return dict(Counter(m.status for m in index.machines(ids).values()))
    except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, FunctionsMissing):
        return {}  # (the read functions missing: no allocator has loaded them yet)
    finally:
        client.close()


def up(cfg: Config, machines: int, ready_timeout_s: float = READY_TIMEOUT_S, *,
       env: dict[str, str] | None = None, schedulers: int | None = None, allocators: int | None = None) -> dict:
    """Have the supervisor run the workers, then wait until the allocator's index holds all ``machines`` (+ the local
    one), whatever their status: a job submitted after ``up`` returns sees the whole region (not just the partitions
    indexed first). ``ready`` in the result says whether that happened within ``ready_timeout_s``; ``machines_indexed``
    how many were seen, ``machines_up`` how many of them are UP; a worker that exited meanwhile (the supervisor
    starts it again) is ``running: False`` with its ``last_exit``. (A Redis that lost the index is written again
    by the allocator itself: it folds the log at start and projects the fold into a Redis that lags it, and it
    notices a Redis emptied while it runs.)

    ``schedulers`` / ``allocators``: how many scheduler shards and allocators (None: as many as run now, else 1);
    the shards and allocators beyond them that run are stopped for good (``retired`` in the result)."""
    from infra import metrics  # noqa: PLC0415 - start-up: prometheus_client (~20 ms); `up` only
    now = running_counts(cfg)
    counts = {kind: given if given is not None else (now[kind] or DEFAULT_COUNTS[kind])
              for kind, given in (("scheduler", schedulers), ("allocator", allocators))}
    check_counts(cfg, counts["scheduler"], counts["allocator"])
    extra = [scaled_name(kind, i) for kind in SCALED for i in reversed(range(counts[kind], now[kind]))]
    extra += [n for n in supervisor.expected(cfg.run_dir) if n in RENAMED]
    retired = supervisor.retire(cfg.run_dir, extra) if extra else {}
    for name in retired:
        metrics.forget(cfg.run_dir, name)
    region = write_region(cfg, machines)
    local_machine_key(cfg)
    progs = programs(cfg, region, env=env, schedulers=counts["scheduler"], allocators=counts["allocator"])
    before = {n: s.get("restarts", 0) for n, s in supervisor.programs_state(cfg.run_dir).items()}
    first = [p for p in progs if p.name == "resourcebroker"]
    supervisor.ensure(cfg.run_dir, first)
    if first and "resourcebroker" not in before:
        time.sleep(1.0)  # let registrations reach the log before the agents and the health check start
    supervisor.ensure(cfg.run_dir, progs)
    deadline = time.monotonic() + ready_timeout_s
    seen: dict[str, int] = {}
    exited: set[str] = set()
    while time.monotonic() < deadline:
        exited = {n for n, s in status(cfg).items() if s["restarts"] > before.get(n, 0)}
        if exited:
            break
        seen = machines_indexed(cfg)
        api = api_ready(cfg)  # the CLI talks to it: up is ready once it answers too
        if sum(seen.values()) >= machines + 1 and api:
            break
        time.sleep(0.25)
    out = status(cfg)
    for name in exited:  # died after its start: say why (the supervisor starts it again)
        out[name]["running"] = False
    indexed = sum(seen.values())
    return {"workers": out, "machines_indexed": indexed, "machines_up": seen.get(MachineStatus.UP, 0),
            "machines_by_status": seen, "api_ready": api_ready(cfg), "schedulers": counts["scheduler"],
            "allocators": counts["allocator"], "retired": retired,
            "ready": indexed >= machines + 1 and not exited and api_ready(cfg)}


def status(cfg: Config) -> dict:
    """Every worker the supervisor is to run (``up`` said so), with its state (RUNNING, BACKOFF: exited and
    waiting for its restart, STOPPED), pid, restarts and last exit: ``supervisor.programs_state``."""
    return {n: st for n, st in supervisor.programs_state(cfg.run_dir).items() if is_worker(n)}


def worker_pid(cfg: Config, name: str) -> int | None:
    """The pid of a running worker by its pid file (under the supervisor or started alone, as the bench does)."""
    return ManagedProcess(name=name, argv=[name], port=None, run_dir=cfg.run_dir, ready=lambda: True).pid()


def known_workers(cfg: Config) -> list[str]:
    """The workers of this run directory that may run: those of a region of one of each, those the supervisor is to
    run, and any other with a pid file (started by the bench, or left by a supervisor that died)."""
    files = {f.stem for f in Path(cfg.run_dir).glob("*.pid") if is_worker(f.stem)}
    return sorted({*names(), *(n for n in supervisor.expected(cfg.run_dir) if is_worker(n)), *files})


def allocator_names(cfg: Config) -> list[str]:
    """The allocators of ``known_workers``."""
    return [n for n in known_workers(cfg) if kind_of(n) == "allocator"]


def keep_tasks(cfg: Config) -> bool:
    """Tell the process agent to leave its tasks running when it is stopped (`ropewalk down --keep-tasks`); True
    if it runs and was told."""
    from processors.agent.process import KEEP_TASKS_SIGNAL  # noqa: PLC0415 - start-up: the agent (~110 ms) for a signal

    pid = worker_pid(cfg, "agent-local")
    if pid is None:
        return False
    os.kill(pid, KEEP_TASKS_SIGNAL)
    return True
