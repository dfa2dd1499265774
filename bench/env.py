"""The benchmark's own region: an embedded broker, a private Redis and the control-plane workers, on free ports,
a temporary run directory and a topic prefix of its own, so a running ``ropewalk up`` is never disturbed.

``BenchEnv`` is a context manager: entering starts the broker and Redis and provisions the topics (the single-purpose
scripts beside the harness use just that: ``with BenchEnv(partitions) as env: ... env.cfg``); ``start_region``
starts the workers (``processors.controlplane.processes``, with the benchmark's heartbeat settings) and waits until the
allocator's index holds every machine UP; leaving stops every process it started (also on an error or Ctrl-C) and
removes the run directory unless asked to keep it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from infra import acls, services
from infra.acls import position_group
from infra.config import Config
from infra.process import ManagedProcess, free_port_block, free_ports, pid_alive, tie_regions_to_this_process
from processors import controlplane
from processors.resourcebroker.region import load_region
from streams.topics import Topics, provision

# Heartbeats of the simulated agents and the health check's silence timeout. `ropewalk up` beats every 2 s;
# at 10,000+ machines on 2 cores that is 5,000+ records/s of background load that would starve the pipeline being
# measured (and a starved agent would be judged dead), so the benchmark beats every 10 s and waits 60 s.
HEARTBEAT_INTERVAL_MS = 10_000
REGION_FILE = "bench-region.json"  # in a run directory: its ports and topic prefix (BenchEnv)
HEALTH_TIMEOUT_MS = 60_000
HEALTH_TICK_MS = 2_000
# Beyond 100,000 machines (10,000 heartbeats/s at 10 s) the simulated agents run one process per DC
# (AGENTS_PER_DC_ABOVE) and the interval grows so the region's heartbeats stay at HEARTBEATS_PER_S: at 1,000,000
# machines one every 200 s, judged silent after 1,200 s. At 10,000/s, one every 100 s, a 1,000,000-machine run
# (2026-11-26) had its one agents process produce ~3,000/s during registration (py-spy: all of it encoding and
# producing heartbeats) and the health check judged 720,000 machines silent at its first timeout.
AGENTS_PER_DC_ABOVE = 100_000
HEARTBEATS_PER_S = 5_000
CATCH_UP_TIMEOUT_S = 600.0  # at most this long for the scheduler to commit the registration (BenchEnv)


def heartbeat_interval_ms(machines: int) -> int:
    if machines <= AGENTS_PER_DC_ABOVE:
        return HEARTBEAT_INTERVAL_MS
    return max(HEARTBEAT_INTERVAL_MS, machines * 1000 // HEARTBEATS_PER_S)


def region_dcs(region: Path) -> list[str]:
    return [dc.name for dc in load_region(region).dcs]


def health_timeout_ms(machines: int) -> int:
    return HEALTH_TIMEOUT_MS * heartbeat_interval_ms(machines) // HEARTBEAT_INTERVAL_MS
# Group timing of the faust workers (the scheduler and the allocator): a quick first join (see tests), and the
# production session timeout (6 s): with 2 s, a worker whose consumer thread was starved that long on a loaded
# 2-core machine (a full collection of a million-machine fold, say) was evicted and its partitions moved.
FAUST_ENV = MappingProxyType({"ROPEWALK_FAUST_SESSION_TIMEOUT": "6", "ROPEWALK_FAUST_HEARTBEAT_INTERVAL": "0.5",
                              "ROPEWALK_FAUST_REBALANCE_TIMEOUT": "2"})


def peak_rss_kib(pid: int) -> int | None:
    """VmHWM (peak resident set) of a live process, KiB; None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process so far, s; None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class BenchEnv:
    def __init__(self, partitions: int = 8, keep: bool = False, run_dir: Path | None = None, brokers: int = 1):
        """A new region in a temporary directory (removed at the end unless ``keep``), or in ``run_dir``: there, the
        region of an earlier run again if it left one (its broker's log, under the same ports and topic prefix,
        which ``REGION_FILE`` keeps), else a new one. ``brokers``: the nodes of its embedded Kafka cluster (3: every
        topic replicated 3 times, infra/broker.py)."""
        self.own_run_dir = run_dir is None
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="ropewalk-bench-"))
        self.keep = keep
        earlier = self.run_dir / REGION_FILE
        if earlier.is_file():
            env = json.loads(earlier.read_text())
        else:
            broker = free_port_block(2 * brokers)  # node i on broker + 2i, its controller on broker + 2i + 1
            jmx = free_port_block(brokers)  # node i's JMX port: jmx + i (bench/brokerstats.py reads it)
            redis_port, api_port = free_ports(2)
            env = {"ROPEWALK_BROKER_PORT": str(broker), "ROPEWALK_CONTROLLER_PORT": str(broker + 1),
                   "ROPEWALK_BROKERS": str(brokers), "ROPEWALK_BROKER_JMX_PORT": str(jmx),
                   "ROPEWALK_REDIS_PORT": str(redis_port), "ROPEWALK_API_PORT": str(api_port),  # a region of its own
                   "ROPEWALK_RUN_DIR": str(self.run_dir), "ROPEWALK_PARTITIONS": str(partitions),
                   "ROPEWALK_TOPIC_PREFIX": f"bench{uuid.uuid4().hex[:6]}."}
            self.run_dir.mkdir(parents=True, exist_ok=True)
            earlier.write_text(json.dumps(env, indent=2))
        self.cfg = Config.from_env(env)
        self.workers: list[ManagedProcess] = []
        self.pids: dict[str, int] = {}  # every process started, by name (also after it stopped)
        self.stopped_rss: dict[str, int | None] = {}

    # -- infrastructure ------------------------------------------------------------------------------------
    def __enter__(self) -> "BenchEnv":
        tie_regions_to_this_process()  # the region stops when this process ends, even by SIGKILL (infra/supervisor.py)
        try:
            st = services.up(self.cfg)
            for name in ("broker", "redis"):
                if st[name].get("pid"):
                    self.pids[name] = st[name]["pid"]
            for name, node in st["broker"].get("nodes", {}).items():  # a cluster: each node
                if node.get("pid") and name not in self.pids:
                    self.pids[name] = node["pid"]
            from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - start-up cost: confluent_kafka.admin (~6 ms over what `ropewalk bench|experiment` load), only for a run

            admin = AdminClient({**self.cfg.kafka_conf(), "log_level": 0})
            provision(admin, Topics(self.cfg.topic_prefix, self.cfg.partitions),
                      replication=self.cfg.replication_factor, conf=self.cfg.kafka_conf())
            acls.provision_region(self.cfg, admin)  # the workers run as their own principals
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def redis(self):
        return self.cfg.redis_client()

    # -- the control plane ---------------------------------------------------------------------------------
    def worker_processes(self, region: Path, *, without: tuple[str, ...] = controlplane.UPPER,
                         env: Mapping[str, str] | None = None, machines: int = 0, schedulers: int = 1,
                         allocators: int = 1) -> list[ManagedProcess]:
        """``processors.controlplane.processes`` with the benchmark's heartbeat interval and health timeout (for a
        region of ``machines``), and quick faust group timing; ``without`` names workers not to run (by default
        the upper floors, ``controlplane.UPPER``, which the benchmark does not measure), ``env`` is added to every
        worker's; ``schedulers`` / ``allocators``: how many scheduler shards and allocators (``scheduler-0..``,
        ``allocator-0..``)."""
        out = []
        for proc in controlplane.processes(self.cfg, region, local=False,  # simulated machines only
                                           schedulers=schedulers, allocators=allocators):
            if proc.name in without or proc.name == "api":  # the bench drives the log, not the HTTP API
                continue
            argv = list(proc.argv)
            if proc.name == "agents":
                argv[argv.index("--interval-ms") + 1] = str(heartbeat_interval_ms(machines))
                i = argv.index("--state-file")  # nothing restarts the bench's agents: no state file to write
                del argv[i:i + 2]
                if machines > AGENTS_PER_DC_ABOVE:  # one process per DC of the region
                    env_all = {**(proc.env or {}), **FAUST_ENV, **(env or {})}
                    out += [dataclasses.replace(proc, name=f"agents-{dc}", argv=[*argv, "--dc", dc], env=env_all)
                            for dc in region_dcs(region)]
                    continue
            elif proc.name == "health":
                argv[argv.index("--timeout-ms") + 1] = str(health_timeout_ms(machines))
                argv[argv.index("--tick-ms") + 1] = str(HEALTH_TICK_MS)
            out.append(dataclasses.replace(proc, argv=argv, env={**(proc.env or {}), **FAUST_ENV, **(env or {})}))
        return out

    def start_region(self, machines: int, timeout_s: float = 300.0, *, region: Path | None = None,
                     without: tuple[str, ...] = controlplane.UPPER, env: Mapping[str, str] | None = None,
                     schedulers: int = 1, allocators: int = 1) -> dict:
        """Write the generated region (or use the ``region`` file given, of ``machines`` machines), start the
        workers (``without``, ``env``, ``schedulers`` and ``allocators``: see ``worker_processes``), wait until the
        allocators indexed every machine UP."""
        region = region or controlplane.write_region(self.cfg, machines, local=False)
        self.workers = self.worker_processes(region, without=without, env=env, machines=machines,
                                             schedulers=schedulers, allocators=allocators)
        t0 = time.monotonic()
        for proc in self.workers:
            st = proc.start()
            if st.get("pid"):
                self.pids[proc.name] = st["pid"]
            if proc.name == "resourcebroker":
                time.sleep(1.0)  # registrations reach the log before the agents and the health check start
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            dead = [p.name for p in self.workers if p.pid() is None]
            if dead:
                raise RuntimeError(f"bench: {', '.join(dead)} exited at start; see {self.run_dir}/<name>.log: "
                                   + " | ".join(p._log_tail(3) for p in self.workers if p.name in dead))
            seen = controlplane.machines_indexed(self.cfg).get("UP", 0)
            if seen >= machines:
                break
            time.sleep(0.5)  # one small read of the index summary (processors/allocator/index.py)
        if seen < machines:
            raise RuntimeError(f"bench: only {seen} of {machines} machines reached the allocator's index in "
                               f"{timeout_s:.0f} s; see {self.run_dir}/allocator-0.log")
        indexed_s = time.monotonic() - t0
        caught_up = self.wait_caught_up(min(deadline, time.monotonic() + CATCH_UP_TIMEOUT_S))
        return {"seconds": time.monotonic() - t0, "indexed_s": indexed_s, "machines_up": seen,
                "caught_up": caught_up}

    def wait_caught_up(self, deadline: float) -> bool:
        """Wait until the scheduler shards committed every machine and unavailability record on the log (the
        registration's backlog): a job measured right after registration must not queue behind it. (The allocator
        folds the log without committing offsets; its index holding every machine is its catch-up.) False if
        ``deadline`` (monotonic) came first."""
        from processors.scheduler.shard import APP_ID as SCHEDULER_APP  # noqa: PLC0415 - start-up cost: processors.scheduler.shard (~420 ms: faust's app); `ropewalk bench|experiment` import this module for every command
        from streams import groups  # noqa: PLC0415 - start-up cost: streams.groups (~7 ms over what `ropewalk bench|experiment` load), only for a run

        catalogue = Topics(self.cfg.topic_prefix, self.cfg.partitions)
        topics = [catalogue.name(t) for t in ("machines", "unavailability")]
        while time.monotonic() < deadline:
            if groups.lag(self.cfg, self.cfg.topic_prefix + SCHEDULER_APP, topics) == 0:
                return True
            time.sleep(0.5)
        return False

    def wait_health_caught_up(self, deadline: float) -> bool:
        """Wait until the health check has read the ``machines`` topic to its end (the registration's backlog, which
        it folds after the allocator and the scheduler are ready: ~40 s of a core at 1,000,000 machines); its reader
        reports its position every ``POSITION_COMMIT_S``. False if ``deadline`` (monotonic) came first."""
        from processors.health.decide import PRODUCER as HEALTH  # noqa: PLC0415 - start-up cost: processors.health.decide (~13 ms over what `ropewalk bench|experiment` load), only for a run
        from streams import groups  # noqa: PLC0415 - start-up cost: streams.groups (~7 ms over what `ropewalk bench|experiment` load), only for a run

        topic = Topics(self.cfg.topic_prefix, self.cfg.partitions).name("machines")
        while time.monotonic() < deadline:
            if groups.lag(self.cfg, position_group(self.cfg, HEALTH), [topic]) == 0:
                return True
            time.sleep(0.5)
        return False

    def start_worker(self, name: str, *module_args: str) -> ManagedProcess:
        """One more worker, ``python -m MODULE ARGS`` with this environment's configuration (e.g. a
        TaskController); stopped with the others."""
        proc = ManagedProcess(name=name, argv=[sys.executable, "-m", *module_args], port=None, run_dir=self.run_dir,
                              ready=lambda: True, start_timeout_s=2.0, env=controlplane.worker_env(self.cfg))
        st = proc.start()
        if st.get("pid"):
            self.pids[name] = st["pid"]
        self.workers.append(proc)
        return proc

    def peak_rss(self) -> dict[str, int | None]:
        """Peak RSS (KiB) of every process started: live ones from /proc, stopped ones as last read."""
        out = dict(self.stopped_rss)
        for name, pid in self.pids.items():
            if pid_alive(pid):
                out[name] = peak_rss_kib(pid)

        out["harness"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time so far (user + system, s) of every live process this environment started, and of this one:
        the difference over a phase says which process the phase's work cost, whatever else the machine did."""
        out = {name: t for name, pid in self.pids.items() if (t := cpu_seconds(pid)) is not None}
        out["harness"] = sum(os.times()[:2])
        return out

    def stop_workers(self) -> None:
        for proc in reversed(self.workers):
            pid = self.pids.get(proc.name)
            if pid is not None and pid_alive(pid):
                self.stopped_rss[proc.name] = peak_rss_kib(pid)
            try:
                proc.stop()
            except Exception as exc:  # noqa: BLE001 - go on stopping the others
                print(f"bench: stopping {proc.name}: {exc}", file=sys.stderr)

    def dead_workers(self) -> dict[str, str]:
        """Workers that exited since they started, with the tail of their log."""
        return {p.name: p._log_tail(3) for p in self.workers if p.pid() is None}

    def log_tails(self, lines: int = 5) -> dict[str, str]:
        return {p.name: p._log_tail(lines) for p in self.workers}

    def close(self) -> None:
        """Stop everything this environment started; remove its run directory (unless ``keep``)."""
        self.stop_workers()
        for name in [n for n in self.pids if n.startswith("broker")] + ["redis"]:
            pid = self.pids.get(name)
            if pid is not None and pid_alive(pid):
                self.stopped_rss[name] = peak_rss_kib(pid)
        try:
            services.down(self.cfg)
        except Exception as exc:  # noqa: BLE001
            print(f"bench: stopping the broker/Redis: {exc}", file=sys.stderr)
        if self.own_run_dir and not self.keep:
            shutil.rmtree(self.run_dir, ignore_errors=True)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within: `kill` (SIGTERM) stops like Ctrl-C, so context managers (a BenchEnv) stop what they started.

    Where Python cannot raise (a ``__del__``, a gc or weakref callback: a redis-py ConnectionPool's finalizer, say),
    it hands the interrupt to ``sys.unraisablehook`` and drops it, which once left a killed bench's whole region
    running. The hook installed here catches exactly that and delivers the signal again a moment later, until it
    lands where it can be raised."""
    def on_term(signum, frame):
        raise SigtermInterrupt

    def on_unraisable(unraisable):
        if isinstance(unraisable.exc_value, SigtermInterrupt):
            again = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
            again.daemon = True
            again.start()
            return
        old_hook(unraisable)

    old_hook = sys.unraisablehook
    old = signal.signal(signal.SIGTERM, on_term)
    sys.unraisablehook = on_unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        sys.unraisablehook = old_hook


class SigtermInterrupt(KeyboardInterrupt):
    """The interrupt a SIGTERM raises within `sigterm_as_interrupt` (a KeyboardInterrupt: stops like Ctrl-C)."""


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
