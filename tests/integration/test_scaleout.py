"""A region scaled out (issue 25): several scheduler shards and allocators, each its own supervised process, and a
shard and an allocator run from another checkout with a run directory of their own, as on another machine. One
region for the module (`ropewalk up --schedulers 2 --allocators 2`), shared by its tests.

What is checked, on the real broker and Redis:

* the shards split the partitions (each owns some), and so do the allocators;
* a shard SIGKILLed while jobs of four entitlements are submitted: every job runs, and the replayed log shows no
  event decided twice (one id, two contents), no task placed, started or running twice, no machine over its
  capacity, no entitlement over its quota (``bench.killstorm.replay_checks``), and Redis equals a rebuild;
* a later `up` with fewer shards and allocators stops the extra ones for good; then a shard and an allocator
  started from a copy of the source, in a run directory of their own, knowing only the region's broker, Redis,
  topic prefix and their principal's credential file, take partitions and decide, and jobs keep running; the
  remote shard SIGKILLed (nothing restarts it there), the region's shard takes its partitions back; an `up` with
  the counts of before starts the shards again.

(Why one local shard beside the remote one: with standby replicas, faust's assignor leaves each member the
partitions it holds while it holds at most ceil(partitions / members): 4 partitions held 2 and 2 give a third
shard nothing. README, "A region on several machines". The allocators, without standbys, would split evenly; the
test scales both alike.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.killstorm import redis_caught_up, replay_checks, settle
from infra import credentials
from infra.config import Config
from infra.process import die_with_parent, pid_alive
from processes import scrape, value
from processors.frontend.jobspec import validate_spec
from regioncli import ROOT, RegionCli, wait_for
from streams import state
from streams.clients import EventProducer
from streams.events import new_event
from streams.partitioner import partition_for
from streams.serde import SchemaRegistry

ENTITLEMENTS = ["so-e0", "so-e5", "so-e1", "so-e2"]  # one on each of the 4 partitions (streams.partitioner)
QUOTA = 4
SPEC = {"command": ["sleep", "3600"], "resources": {"cpu_millicores": 500, "memory_mib": 512}, "spread": "msb"}
ASSIGNED = re.compile(r"scheduler shard \d+: assigned partitions \[([\d, ]*)\]")
OWNS = re.compile(r"allocator: owns allocations partitions \[([\d, ]*)\]")
FAUST = {"ROPEWALK_FAUST_SESSION_TIMEOUT": "2", "ROPEWALK_FAUST_HEARTBEAT_INTERVAL": "0.5",
         "ROPEWALK_FAUST_REBALANCE_TIMEOUT": "2"}


class Region:
    """The module's region: the CLI, its operator's configuration, a producer on its log."""

    def __init__(self, run_dir: Path):
        self.cli = RegionCli(run_dir)
        self.run_dir = run_dir
        self.cfg = Config.from_env(self.cli.env)
        self.registry = SchemaRegistry.from_dir()
        self._producer = None
        self._make_producer = lambda: EventProducer(self.cfg, self.registry, "test-scaleout")
        self.serial = 0
        self.jobs: dict[str, int] = {}  # job -> tasks it should run

    @property
    def producer(self):
        if self._producer is None:
            self._producer = self._make_producer()
        return self._producer

    def send(self, type_: str, payload: dict, entitlement: str, entity: str) -> None:
        self.producer.send(new_event(type_, payload, entitlement=entitlement, entity_id=entity, producer="test"))
        self.producer.flush(30)

    def submit(self, entitlement: str, tasks: int = 2) -> str:
        self.serial += 1
        payload = validate_spec({**SPEC, "name": f"j{self.serial:03d}", "entitlement": entitlement, "tasks": tasks})
        payload.pop("entitlement")
        self.send("JobSubmitted", {**payload, "spec_version": 1}, entitlement, payload["job_id"])
        self.jobs[payload["job_id"]] = tasks
        return payload["job_id"]

    def not_running(self) -> list[str]:
        jobs = state.current(self.cfg, self.registry, "jobs")
        out = []
        for job, n in sorted(self.jobs.items()):
            ev = jobs.get(job)
            states = [t["state"] for t in ev.payload["tasks"]] if ev is not None else []
            if len(states) != n or any(s != "RUNNING" for s in states):
                out.append(f"{job}: {states or 'no state'}")
        return out

    def wait_all_running(self, what: str, timeout_s: float = 120) -> None:
        left: list[str] = []

        def done() -> bool:
            left[:] = self.not_running()
            return not left

        self.cli.wait_for(done, f"{what} (not yet: {left})", timeout_s)

    def checks(self) -> dict:
        """The replayed log's and Redis's checks (bench/killstorm.py), once the allocators are idle."""
        settle(self.cfg, quiet_s=2.0)
        doc = replay_checks(self.cfg, self.registry)
        r = self.cfg.redis_client()
        try:
            doc["redis_differences"] = redis_caught_up(self.cfg, self.registry, r)[0]
        finally:
            r.close()
        return doc

    def scale(self, schedulers: int, allocators: int) -> dict:
        """``ropewalk up`` with these counts (what runs already is left as it is)."""
        out = self.cli("up", "--machines", "16", "--no-demo", "--schedulers", str(schedulers), "--allocators",
                       str(allocators), "--json", timeout_s=240)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["schedulers"], doc["allocators"]) == (schedulers, allocators), doc
        return doc

    def status(self) -> dict:
        out = self.cli("status", "--json")
        return json.loads(out.stdout)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close() if hasattr(self._producer, "close") else None


def assert_nothing_doubled(doc: dict) -> None:
    counts = ("conflicting_duplicates", "tasks_placed_twice", "tasks_started_twice", "tasks_running_twice",
              "machines_overcommitted", "quota_breaches")
    assert {k: doc[k] for k in counts} == dict.fromkeys(counts, 0), {
        k: doc[k] for k in (*counts, "started_twice", "running_twice", "overcommitted")}
    assert doc["redis_differences"] == [], doc["redis_differences"][:5]


def partitions_in(log: Path, pattern: re.Pattern) -> set[int] | None:
    """The partitions the last assignment line of a worker's log names (None: no such line yet)."""
    found = pattern.findall(log.read_text(errors="replace")) if log.exists() else []
    return {int(p) for p in found[-1].split(",") if p.strip()} if found else None


@pytest.fixture(scope="module")
def region(tmp_path_factory):
    run = tmp_path_factory.mktemp("scaleout") / "run"
    reg = Region(run)
    try:
        up = reg.cli("up", "--machines", "16", "--no-demo", "--schedulers", "2", "--allocators", "2", "--json",
                     timeout_s=240)
        assert up.returncode == 0, up.stderr
        doc = json.loads(up.stdout)
        assert doc["ready"] and (doc["schedulers"], doc["allocators"]) == (2, 2), doc
        for ent in ENTITLEMENTS:
            reg.send("EntitlementCreated", {"name": ent, "quota_machines": QUOTA, "machine_type": None,
                                            "dc_pin": None, "host_profile": None}, ent, ent)
        yield reg
    finally:
        reg.close()
        down = reg.cli("down")
        assert down.returncode == 0, down.stderr


@pytest.mark.timeout(300)
def test_shards_and_allocators_split_the_partitions_and_a_killed_shard_loses_and_doubles_nothing(region):
    region.scale(2, 2)
    workers = region.status()["control_plane"]
    assert {"scheduler-0", "scheduler-1", "allocator-0", "allocator-1"} <= set(workers), sorted(workers)
    assert "allocator" not in workers and all(w["state"] == "RUNNING" for w in workers.values())
    everyone = set(range(region.cfg.partitions))
    shards = {n: region.run_dir / f"{n}.log" for n in ("scheduler-0", "scheduler-1")}
    allocators = {n: region.run_dir / f"{n}.log" for n in ("allocator-0", "allocator-1")}

    def split(logs: dict, pattern) -> dict | None:
        owned = {n: partitions_in(p, pattern) for n, p in logs.items()}
        ok = all(owned.values()) and set().union(*owned.values()) == everyone and \
            sum(map(len, owned.values())) == len(everyone)
        return owned if ok else None

    print("\nshards", region.cli.wait_for(lambda: split(shards, ASSIGNED), "the shards splitting the partitions"),
          "allocators", region.cli.wait_for(lambda: split(allocators, OWNS), "the allocators splitting them"))

    # jobs of four entitlements submitted, one shard SIGKILLed among them (the supervisor starts it again)
    victim = workers["scheduler-1"]["pid"]
    for i in range(12):
        region.submit(ENTITLEMENTS[i % len(ENTITLEMENTS)])
        if i == 4:
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
        time.sleep(0.3)
    region.wait_all_running("every job running after the SIGKILL")
    print(f"every job running {time.monotonic() - killed_at:.1f} s after the SIGKILL")
    after = region.status()["control_plane"]["scheduler-1"]
    assert after["restarts"] >= 1 and after["last_exit"]["signal"] == "SIGKILL" and after["pid"] != victim
    doc = region.checks()
    assert_nothing_doubled(doc)
    assert doc["tasks_placed"] >= sum(region.jobs.values())


def remote_checkout(dest: Path) -> Path:
    """A copy of this checkout's tracked files (its working tree, as it is): what another machine would have."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for f in filter(None, files):
        src = ROOT / f.decode()
        if src.is_file():
            (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f.decode())
    return dest


def remote_worker(region: Region, checkout: Path, home: Path, principal: str, module: str,
                  name: str) -> subprocess.Popen:
    """``python -m module`` from ``checkout``, with a run directory of its own (``home``) whose secrets directory
    holds only ``principal``'s credential file, and an environment naming only the region's broker, Redis, topic
    prefix and partitions: nothing of the region's run directory."""
    secrets = home / "secrets"
    secrets.mkdir(parents=True, mode=0o700)
    shutil.copy2(credentials.principal_file(region.cfg.secrets, principal), secrets)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPEWALK_")}
    env.update({"ROPEWALK_BOOTSTRAP_SERVERS": region.cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": region.cfg.redis_url,
                "ROPEWALK_TOPIC_PREFIX": region.cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(region.cfg.partitions),
                "ROPEWALK_RUN_DIR": str(home), "ROPEWALK_SECRETS_DIR": str(secrets), "ROPEWALK_WORKER_NAME": name,
                "PYTHONUNBUFFERED": "1", **FAUST})
    log = open(home / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", module], cwd=checkout, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
    proc.log_path = home / f"{name}.log"
    return proc


@pytest.mark.timeout(420)
def test_fewer_shards_then_a_shard_and_an_allocator_on_another_machine_keep_the_region_running(region, tmp_path):
    # -- a later `up` with fewer: the extra shard and allocator stop for good; one shard owns every partition -----
    region.scale(2, 2)
    before = region.status()["control_plane"]
    gone = {n: before[n]["pid"] for n in ("scheduler-1", "allocator-1")}
    doc = region.scale(1, 1)
    assert doc["retired"] == ["allocator-1", "scheduler-1"], doc["retired"]
    workers = region.status()["control_plane"]
    assert "scheduler-1" not in workers and "allocator-1" not in workers and workers["scheduler-0"]["running"]
    assert not any(pid_alive(p) for p in gone.values())
    everyone = set(range(region.cfg.partitions))
    region.cli.wait_for(lambda: partitions_in(region.run_dir / "scheduler-0.log", ASSIGNED) == everyone,
                        "scheduler-0 owning every partition")
    # an `up` without the flags keeps the counts that run and the machines the region holds, and makes no demo in
    # a region in use that has none (started with --no-demo; its jobs: the first test's, or this one, run alone);
    # a bad count is refused before anything starts
    if not region.jobs:
        job = region.submit(ENTITLEMENTS[0])
        region.cli.wait_for(lambda: region.cli.status(job), f"{job} in the log's state")
    again = region.cli.json("up")
    assert again and (again["schedulers"], again["allocators"]) == (1, 1) and again["retired"] == []
    assert again["machines"] == 16 and again["machines_indexed"] == 17 and again["demo"] is None, again
    refused = region.cli("up", "--machines", "16", "--schedulers", "0")
    assert refused.returncode == 1 and "--schedulers: expected from 1 to 4" in refused.stderr, refused.stderr
    refused = region.cli("up", "--machines", "-1")
    assert refused.returncode == 1 and "--machines: expected 0 or more, got -1" in refused.stderr, refused.stderr

    # -- a shard and an allocator from another checkout and run directory join ------------------------------------
    checkout = remote_checkout(tmp_path / "checkout")
    remote = tmp_path / "host2"
    where = subprocess.run([sys.executable, "-c", "import processors, streams; print(processors.__file__)"],
                           cwd=checkout, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert where.stdout.strip().startswith(str(checkout)), where  # the copy's code, not this checkout's
    shard = remote_worker(region, checkout, remote / "scheduler", credentials.SCHEDULER, "processors.scheduler.shard",
                          "scheduler-remote")
    allocator = remote_worker(region, checkout, remote / "allocator", credentials.ALLOCATOR,
                              "processors.allocator.processor", "allocator-remote")
    procs = [shard, allocator]
    try:
        assert sorted(p.name for p in (remote / "scheduler" / "secrets").iterdir()) == ["scheduler.json"]

        def tails() -> str:
            return "".join(f"\n--- {p.log_path}:\n" + "\n".join(p.log_path.read_text(errors="replace").splitlines()[-30:])
                           for p in procs)

        mine = wait_for(lambda: partitions_in(shard.log_path, ASSIGNED), "the remote shard's partitions", 120, 0.5,
                        tails)
        owned = wait_for(lambda: partitions_in(allocator.log_path, OWNS), "the remote allocator's partitions", 120,
                         0.5, tails)
        local = {n: partitions_in(region.run_dir / f"{n}.log", ASSIGNED) for n in ("scheduler-0", "scheduler-1")}
        print(f"\nremote shard owns {sorted(mine)}, remote allocator {sorted(owned)}; region's shards {local}")
        assert shard.poll() is None and allocator.poll() is None
        # jobs of every entitlement: some hash to the remote shard's partitions, some to the allocator's
        jobs = [region.submit(ENTITLEMENTS[i % len(ENTITLEMENTS)]) for i in range(8)]
        region.wait_all_running("every job running with the remote workers in the region")
        assert {partition_for(e, region.cfg.partitions) for e in ENTITLEMENTS} == everyone  # some on each of them
        sched_metrics = scrape(f"127.0.0.1:{(remote / 'scheduler' / 'metrics' / 'scheduler-remote.port').read_text().strip()}")
        alloc_metrics = scrape(f"127.0.0.1:{(remote / 'allocator' / 'metrics' / 'allocator-remote.port').read_text().strip()}")
        decided = value(sched_metrics, "ropewalk_scheduling_attempt_duration_seconds_count", result="events")
        placed = value(alloc_metrics, "ropewalk_allocation_attempts_total", result="placed")
        print(f"the remote shard decided {decided:.0f} events, the remote allocator placed {placed:.0f} tasks")
        assert decided >= 1 and placed >= 1
        # nothing of the region's run directory was written or needed there
        assert not (remote / "scheduler" / "secrets" / credentials.KAFKA_FILE).exists()
        assert not list((remote / "scheduler").glob("region.yaml"))

        # the remote shard SIGKILLed while jobs are submitted: nothing restarts it; the region's shards take over
        for i in range(8):
            jobs.append(region.submit(ENTITLEMENTS[i % len(ENTITLEMENTS)]))
            if i == 3:
                os.killpg(shard.pid, signal.SIGKILL)
                shard.wait(10)
                killed_at = time.monotonic()
            time.sleep(0.3)
        region.cli.wait_for(lambda: partitions_in(region.run_dir / "scheduler-0.log", ASSIGNED) == everyone,
                            "the region's shard owning every partition again", 120)
        print(f"scheduler-0 owns every partition again {time.monotonic() - killed_at:.1f} s after the SIGKILL")
        region.wait_all_running("every job running after the remote shard was killed")
        assert_nothing_doubled(region.checks())
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(5)
    # -- an `up` with the counts of before starts the shard and the allocator again: each joins its group ----------
    def joined() -> dict[str, int]:
        return {n: len(pattern.findall(log.read_text(errors="replace"))) if log.exists() else 0
                for n, pattern in (("scheduler-1", ASSIGNED), ("allocator-1", OWNS))
                for log in [region.run_dir / f"{n}.log"]}

    before = joined()
    region.scale(2, 2)
    assert {"scheduler-1", "allocator-1"} <= set(region.status()["control_plane"])
    region.cli.wait_for(lambda: all(n > before[k] for k, n in joined().items()),
                        "scheduler-1 and allocator-1 assigned partitions again", 120)
