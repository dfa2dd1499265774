"""Twine Figure 14 (§5.1) on the real pipeline: the same experiment as ``figure14.py``, run by the processes.

    ropewalk experiment figure14 --pipeline [--time-scale 10] [--json] [--png FILE] [--tasks ... --seed ...]

**What runs.** An embedded broker, a private Redis and a topic prefix of their own (``bench.env.BenchEnv``, so a
running ``ropewalk up`` is left alone), and as separate processes: the Resource Broker (registers a region of one
DC, ``msbs`` MSBs, one machine per task, each machine the size of one task), the allocator, one scheduler shard,
the Health Check Service, and the TaskController — the reference ``ReplicaAware`` run as
``python -m processors.taskcontrol.controllers replica-aware`` with the shard map in a file. The simulated agents
of every machine run in this process (``processors.agent.simulated.SimulatedAgents``: a START becomes RUNNING
after ``start_s`` ± ``jitter``, seeded), so that the MSB failure silences exactly its machines at the instant its
failure events are produced (the Resource Broker's pure ``machine_failed``, as ``ropewalk machine fail`` does).

**The story.** The job ``figure14.cache`` (``tasks`` tasks, ``max_unavailable`` = all: TaskControl alone paces;
the limiter opened wide, as in the simulation) is submitted and runs; its spec changes (a rolling update: every
task gets an UPDATE operation the controller must approve); ``msb_fail_at_s`` later every machine of one MSB dies
(its ``tasks / msbs`` tasks with it: one MachinesStatusChanged DOWN and one UnavailabilityStarted for all of them,
the Resource Broker's ``machines_failed``) and comes back ``msb_down_s`` later (MachinesStatusChanged UP,
UnavailabilityEnded). With no spare machine, the failed MSB's tasks wait for it, as in the paper ("even if the 50
tasks in the failed MSB are still down"). The run ends when every task runs the new version.

**Time.** The paper's seconds divided by ``time_scale`` (default 10: a 220 s start takes 22 s); the scheduler's
timer is scaled the same way (``ROPEWALK_SCHEDULER_RETRY_S`` = 10 s / scale). Curves and totals are reported in
the paper's seconds (wall seconds since the update × scale).

**Counting, from the replayed log alone** (``count`` and ``Ledger``, pure; ``read_log`` replays the
entitlement's events of ``intents``, ``machines``, ``tasks``, ``taskcontrol`` and ``unavailability``, merged by
their envelope timestamps, each partition in offset order). A shard replica is live while its task is RUNNING
(the agent's report, an item of its TaskStatesChanged). A task goes down *through Ropewalk* at the scheduler's STOP
(an item of its TasksCommanded: the decision,
not the agent's later report: the earliest instant), *through the failure* at the UnavailabilityStarted(FAILURE)
of its machine. A shard counts (once per total) when its live replicas fall below ``min_live``:

* ``shards_lost_second_replica_by_ropewalk``: at a Ropewalk STOP, plus shards that an ack approved an operation
  on while the tasks it approves, with those the scheduler holds approved and not yet stopped (the latest
  request's in-flight set), would leave them below ``min_live`` (the simulation's rule);
  ``…_raced_with_failure`` says how many of them fell at a STOP logged after the failure but before the
  scheduler had read it (the decision was made without knowing);
* ``shards_lost_second_replica_by_failure``: at the failure;
* ``tasks_down_otherwise``: tasks that left RUNNING by any other report (none expected).
"""
from __future__ import annotations

import heapq
import json
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.env import BenchEnv, sigterm_as_interrupt
from bench.experiments import figure14 as sim
from bench.experiments.figure14 import CONTROLLER, ENT, JOB, Conditions, Result
from processors import controlplane
from processors.frontend.jobspec import validate_spec
from processors.resourcebroker import decide as broker
from processors.resourcebroker.region import iter_machines, parse_region
from streams import batches
from streams.clients import EventConsumer, EventProducer
from streams.enums import TaskCommand
from streams.events import Event, new_event
from streams.serde import SchemaRegistry
from streams.topics import Topics

MODE = ("real pipeline: broker, Redis, Resource Broker, allocator, scheduler shard, health and the ReplicaAware "
        "TaskController as processes; simulated agents; counted from the replayed log")
MACHINE_TYPE = "cache"
TASK_CPU, TASK_MEM = 1000, 1024  # one task fills one machine
INITIAL_START_MS = 200  # starts of the initial deployment (before the experiment) are quick
LOG_TOPICS = ("intents", "machines", "tasks", "taskcontrol", "unavailability")
STOP = TaskCommand.STOP
OFFENDERS = 20  # operations that lost shards, listed in the details (the first ones)
UPDATE_REASON = "rolling_update"


@dataclass(frozen=True)
class PipelineConditions:
    """The experiment's conditions (``Conditions``, as in the simulation) and the pipeline's own."""

    base: Conditions = Conditions()
    time_scale: float = 10.0
    partitions: int = 4
    heartbeat_interval_ms: int = 2_000
    timeout_s: float = 900.0  # wall seconds the update may take before the run gives up (reported)

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.base.tasks % self.base.msbs:
            raise ValueError(f"tasks ({self.base.tasks}) must be a multiple of msbs ({self.base.msbs}): every MSB "
                             "holds the same number of machines, one task each")


# -- counting from the log (pure) --------------------------------------------------------------------------------

@dataclass
class Ledger:
    """Shard liveness folded from the log, event by event in time order (see the module docstring)."""

    hosted: Mapping[str, list[str]]
    min_live: int
    job: str = JOB
    live: Counter = field(default_factory=Counter)  # shard -> replicas on RUNNING tasks
    total: Counter = field(default_factory=Counter)  # shard -> replicas
    running: dict[str, int] = field(default_factory=dict)  # task -> the spec version it runs
    machine_of: dict[str, str] = field(default_factory=dict)  # task -> machine of its latest command or RUNNING
    version: int = 0  # the job's newest spec version
    updating: set[str] = field(default_factory=set)  # stopped for the update, not yet running the new version
    approved: set[str] = field(default_factory=set)  # approved by the controller, not yet stopped
    failed_tasks: set[str] = field(default_factory=set)  # tasks on a machine when it failed
    failure_ids: set[str] = field(default_factory=set)  # event ids of the failure events
    failure_ms: int | None = None
    scheduler_saw_failure_ms: int | None = None
    by_ropewalk: set[str] = field(default_factory=set)
    by_ropewalk_at_ack: set[str] = field(default_factory=set)
    raced: set[str] = field(default_factory=set)
    by_failure: set[str] = field(default_factory=set)
    down_otherwise: set[str] = field(default_factory=set)
    offenders: list[dict[str, Any]] = field(default_factory=list)  # the first Ropewalk operations that lost shards
    peak_updating: int = 0
    acks: int = 0
    scheduler_events: int = 0

    def __post_init__(self) -> None:
        for shards in self.hosted.values():
            self.total.update(shards)
            for s in shards:
                self.live.setdefault(s, 0)

    # -- liveness --------------------------------------------------------------------------------------------
    def _up(self, task: str, version: int) -> None:
        if task not in self.running:
            for s in self.hosted.get(task, ()):
                self.live[s] += 1
        self.running[task] = version

    def _down(self, task: str, lost: set[str], now: int, *, raced: bool = False, why: str = "") -> None:
        if self.running.pop(task, None) is None:
            return
        fell = 0
        for s in self.hosted.get(task, ()):
            self.live[s] -= 1
            if self.live[s] == self.min_live - 1:
                lost.add(s)
                fell += 1
                if raced:
                    self.raced.add(s)
        if fell and lost is self.by_ropewalk and len(self.offenders) < OFFENDERS:
            self.offenders.append({"at_ms": now, "task": task, "stop": why, "shards": fell, "raced": raced})

    def _raced(self, now: int) -> bool:
        return self.failure_ms is not None and now >= self.failure_ms and (
            self.scheduler_saw_failure_ms is None or now < self.scheduler_saw_failure_ms)

    # -- events ----------------------------------------------------------------------------------------------
    def apply(self, ev: Event) -> None:  # noqa: C901
        p, now = ev.payload, ev.timestamp_ms
        if ev.producer == "scheduler":
            self.scheduler_events += 1
            if ev.causation_id in self.failure_ids and self.scheduler_saw_failure_ms is None:
                self.scheduler_saw_failure_ms = now
        if ev.type in ("JobSubmitted", "JobSpecChanged") and p["job_id"] == self.job:
            self.version = max(self.version, p["spec_version"])
        elif ev.type in ("TaskCommanded", "TasksCommanded") and p["job_id"] == self.job:
            for c in batches.task_commands(ev):
                task = c["task_id"]
                self.machine_of[task] = c["machine_id"]
                if c["command"] == STOP:
                    self.approved.discard(task)
                    if c["reason"] == UPDATE_REASON:
                        self.updating.add(task)
                    self._down(task, self.by_ropewalk, now, raced=self._raced(now), why=c["reason"])
        elif ev.type in ("TaskStateChanged", "TaskStatesChanged"):
            for r in batches.task_reports(ev):
                if r["job_id"] != self.job:
                    continue
                task = r["task_id"]
                if r["state"] == "RUNNING":
                    self.machine_of[task] = r["machine_id"] or self.machine_of.get(task, "")
                    self._up(task, r["spec_version"])
                    if r["spec_version"] >= self.version:
                        self.updating.discard(task)
                elif r["state"] in ("FAILED", "STOPPED", "LOST") and task in self.running:
                    self.down_otherwise.add(task)
                    self._down(task, set(), now)
        elif ev.type == "UnavailabilityStarted" and p["kind"] == "FAILURE":
            self.failure_ids.add(ev.event_id)
            self.failure_ms = now if self.failure_ms is None else min(self.failure_ms, now)
            gone = set(p["machine_ids"])
            for task in [t for t in self.running if self.machine_of.get(t) in gone]:
                self.failed_tasks.add(task)
                self._down(task, self.by_failure, now)
        elif ev.type in ("MachineStatusChanged", "MachinesStatusChanged") and p["status"] == "DOWN":
            self.failure_ids.add(ev.event_id)
        elif ev.type == "TaskControlRequested" and p["job_id"] == self.job:
            if p.get("in_flight_operation_ids") is not None:  # what the scheduler holds approved: exactly that
                self.approved = {op.split(":")[0] for op in p["in_flight_operation_ids"]}
            else:  # asked again: an approval the scheduler did not take (stale under a re-ask) is not in flight
                self.approved -= {op["task_id"] for op in p["pending_operations"]}
        elif ev.type == "TaskControlAcked" and p["job_id"] == self.job:
            self.acks += 1
            self._check_ack({op.split(":")[0] for op in p["approved_operation_ids"]}, p["sequence"], now)
        self.peak_updating = max(self.peak_updating, len(self.updating))

    def _check_ack(self, approved: set[str], sequence: int, now: int) -> None:
        """Would the tasks this ack approves, with those approved before and not yet stopped, leave a shard below
        ``min_live``? Such shards count against Ropewalk (the simulation's ``_check_ack``)."""
        new = approved & set(self.running)
        going = (self.approved | approved) & set(self.running)
        self.approved |= approved
        if not new:
            return
        taken = Counter(s for t in going for s in self.hosted.get(t, ()))
        for t in new:
            short = [s for s in self.hosted.get(t, ()) if self.live[s] - taken[s] < self.min_live]
            self.by_ropewalk_at_ack.update(short)
            if short and len(self.offenders) < OFFENDERS:
                self.offenders.append({"at_ms": now, "task": t, "ack_sequence": sequence, "shards": len(short)})

    # -- rows --------------------------------------------------------------------------------------------------
    def updated(self) -> int:
        """Tasks running the job's newest spec version."""
        return sum(1 for v in self.running.values() if v >= self.version)

    def row(self, t_s: float, tasks: int) -> dict[str, Any]:
        updated = self.updated()
        updating = len(self.updating)
        down = Counter(self.total[s] - n for s, n in self.live.items())
        return {"t_s": round(t_s), "tasks_updating": updating, "tasks_updated": updated,
                "tasks_waiting": tasks - updated - updating,
                "failed_msb_tasks_down": sum(1 for t in self.failed_tasks if t not in self.running),
                "shards_1_down": down[1], "shards_2plus_down": sum(k for d, k in down.items() if d >= 2)}


def curves(ledger: Ledger, events: Iterable[Event], *, start_ms: int, time_scale: float, step_s: float,
           tasks: int) -> tuple[list[dict[str, Any]], float | None]:
    """Fold ``events`` (time order) into ``ledger``; a row every ``step_s`` paper seconds from ``start_ms`` (the
    update's JobSpecChanged), and when every task ran the new version (paper seconds; None: never). That is also
    when every task ran again: unlike the simulation's, which ends the update when the scheduler says so, both
    are read from the agents' reports here."""
    step_ms = step_s * 1000 / time_scale
    rows: list[dict[str, Any]] = []
    next_row = start_ms
    done_s = None

    def paper_s(ms: float) -> float:
        return (ms - start_ms) * time_scale / 1000

    for ev in events:
        while ev.timestamp_ms > next_row >= start_ms:  # a row holds every event up to its time
            rows.append(ledger.row(paper_s(next_row), tasks))
            next_row += step_ms
        ledger.apply(ev)
        if done_s is None and ev.timestamp_ms >= start_ms and ledger.version > 1 and ledger.updated() == tasks:
            done_s = round(paper_s(ev.timestamp_ms), 1)
    rows.append(ledger.row(paper_s(next_row), tasks))
    return rows, done_s


def merged(streams: Iterable[Iterable[Event]]) -> Iterable[Event]:
    """Events of several partitions in envelope-timestamp order, each partition's in its own (offset) order."""
    return heapq.merge(*streams, key=lambda e: e.timestamp_ms)


# -- the region and the job --------------------------------------------------------------------------------------

def region_spec(c: Conditions) -> dict[str, Any]:
    """One DC of ``msbs`` MSBs, ``tasks / msbs`` machines each (one rack per 10), each machine one task's size."""
    per_msb = c.tasks // c.msbs
    racks = max(1, -(-per_msb // 10))
    return {"region": "figure14", "dcs": [{
        "name": "dc1", "msbs": c.msbs, "racks_per_msb": racks, "machines_per_rack": -(-per_msb // racks),
        "machines": c.tasks, "machine_types": MACHINE_TYPE,
        "capacity": {MACHINE_TYPE: {"cpu_millicores": TASK_CPU, "memory_mib": TASK_MEM}}}]}


def job_spec(c: Conditions, release: int) -> dict[str, Any]:
    return {"name": JOB.split(".", 1)[1], "entitlement": ENT, "tasks": c.tasks,
            "command": ["cache", f"--release={release}"],
            "resources": {"cpu_millicores": TASK_CPU, "memory_mib": TASK_MEM}, "spread": "msb",
            "max_unavailable": c.tasks, "controller": CONTROLLER}


def failed_msb_machines(machine_ids: Iterable[str], c: Conditions) -> list[str]:
    name = f"-msb{c.failed_msb + 1}-"
    return sorted(m for m in machine_ids if name in m)


# -- the run -----------------------------------------------------------------------------------------------------

class _Follower:
    """Which version each task of the job runs, from the agents' reports on ``tasks`` (to know when to stop), and
    which tasks the scheduler has read running (its ServiceDiscoveryChanged enabling them)."""

    def __init__(self, cfg, registry):
        self.consumer = EventConsumer(cfg, registry, [Topics(cfg.topic_prefix, cfg.partitions).name("tasks")],
                                      name="figure14-follower")
        self.running: dict[str, int] = {}
        self.enabled: set[str] = set()

    def poll(self) -> None:
        for rec in self.consumer.poll(10_000, 0.0):
            for r in batches.task_reports(rec.event):
                if r["job_id"] != JOB:
                    continue
                if r["state"] == "RUNNING":
                    self.running[r["task_id"]] = r["spec_version"]
                else:
                    self.running.pop(r["task_id"], None)
            for c in batches.discovery_changes(rec.event):
                if c["job_id"] == JOB:
                    (self.enabled.add if c["enabled"] else self.enabled.discard)(c["task_id"])

    def at_version(self, version: int) -> int:
        return sum(1 for v in self.running.values() if v >= version)

    def close(self) -> None:
        self.consumer.close()


def run(pc: PipelineConditions, progress=lambda msg: None, events_out: Path | None = None  # noqa: C901
        ) -> tuple[Result, dict[str, Any]]:
    """Run the experiment on a region of its own; the Result (curves, totals) and details of the run. With
    ``events_out``, the replayed events the counting read are written there, one JSON line each, in the order
    counted (so the curves can be recomputed, and audited, after the embedded broker is gone)."""
    from processors.agent.simulated import SimulatedAgents  # noqa: PLC0415 - start-up cost: processors.agent.simulated (~27 ms over what `ropewalk bench|experiment` load), only for --pipeline
    from processors.resourcebroker.processor import fold_machines  # noqa: PLC0415 - start-up cost: processors.resourcebroker.processor (~16 ms over what `ropewalk bench|experiment` load), only for a run

    c = pc.base
    registry = SchemaRegistry.from_dir()
    hosted = sim.place_replicas(c.tasks, c.shards, c.replicas, c.seed, c.placement)
    details: dict[str, Any] = {"time_scale": pc.time_scale, "partitions": pc.partitions}
    with BenchEnv(partitions=pc.partitions) as env:
        cfg = env.cfg
        spec = region_spec(c)
        region_path = cfg.run_dir / "region.yaml"
        region_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        machine_ids = [m.id for m in iter_machines(parse_region(spec))]
        shards_path = cfg.run_dir / "shards.json"
        shards_path.write_text(json.dumps(hosted))
        progress(f"infrastructure on {cfg.bootstrap_servers}; registering {len(machine_ids)} machines")
        t0 = time.monotonic()
        worker_env = {"ROPEWALK_SCHEDULER_RETRY_S": f"{sim.Conditions.timer_s / pc.time_scale:g}",
                      "ROPEWALK_LIMIT_JOB_PER_MINUTE": "1000000", "ROPEWALK_LIMIT_JOB_BURST": "1000000",
                      "ROPEWALK_LIMIT_SHARD_PER_MINUTE": "1000000", "ROPEWALK_LIMIT_SHARD_BURST": "1000000"}
        env.start_region(len(machine_ids), timeout_s=300.0, region=region_path,
                         without=("agents", *controlplane.UPPER), env=worker_env)
        env.start_worker("taskcontroller", "processors.taskcontrol.controllers", "replica-aware", "--name", CONTROLLER,
                         "--shards", str(shards_path), "--min-live", str(c.min_live))
        details["region_ready_s"] = round(time.monotonic() - t0, 1)

        agents = SimulatedAgents(cfg, machine_ids, registry=registry, interval_ms=pc.heartbeat_interval_ms,
                                 start_delay_ms=INITIAL_START_MS, seed=c.seed + 1)
        agents.connect()
        follower = _Follower(cfg, registry)
        producer = EventProducer(cfg, registry, "figure14")

        def pump(until, timeout_s: float, what: str) -> None:
            deadline = time.monotonic() + timeout_s
            while not until():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"figure14 --pipeline: {what} not done within {timeout_s:.0f} s; "
                                       f"worker logs: {env.log_tails(3)}")
                if dead := env.dead_workers():
                    raise RuntimeError(f"figure14 --pipeline: worker(s) exited: {dead}")
                agents.step(0.02)
                follower.poll()

        # the job, deployed before the experiment starts
        producer.send(new_event("EntitlementCreated", {"name": ENT, "quota_machines": c.tasks, "machine_type": None,
                                                       "dc_pin": None, "host_profile": None},
                                entitlement=ENT, entity_id=ENT, producer="figure14"))
        payload = validate_spec(job_spec(c, 1))
        payload.pop("entitlement")
        producer.send(new_event("JobSubmitted", {**payload, "spec_version": 1}, entitlement=ENT, entity_id=JOB,
                                producer="figure14"))
        producer.flush(30)
        t1 = time.monotonic()
        # every task running, and read so by the scheduler: the update starts on a quiet pipeline
        pump(lambda: follower.at_version(1) >= c.tasks and len(follower.enabled) >= c.tasks, 300.0,
             f"deploying {c.tasks} tasks")
        details["deploy_s"] = round(time.monotonic() - t1, 1)
        progress(f"{c.tasks} tasks running; the rolling update starts (time scale 1/{pc.time_scale:g})")

        # the experiment
        state = fold_machines(cfg, registry)
        victims = failed_msb_machines(machine_ids, c)
        agents.start_delay_ms = int(c.start_s * 1000 / pc.time_scale)
        agents.start_jitter = c.jitter
        payload = validate_spec(job_spec(c, 2))
        payload.pop("entitlement")
        update = new_event("JobSpecChanged", {**payload, "spec_version": 2}, entitlement=ENT, entity_id=JOB,
                           producer="figure14")
        producer.send(update)
        producer.flush(30)
        start_wall = update.timestamp_ms / 1000
        fail_at = start_wall + c.msb_fail_at_s / pc.time_scale
        recover_at = fail_at + c.msb_down_s / pc.time_scale
        phase = ["fail"]

        def msb(decision, agent_action) -> None:
            """Every machine of the failed MSB: its agent first (all silent before any event leaves), then the
            Resource Broker's pure decision for all of them (one MachinesStatusChanged and one
            UnavailabilityStarted/Ended for the owner); the events produced together."""
            nonlocal state
            for m in victims:
                agent_action(m)
            state, events = decision(state, victims, broker.REASON_OPERATOR, int(time.time() * 1000))
            for ev in events:
                producer.send(ev)
            producer.flush(30)

        def timeline() -> bool:
            now = time.time()
            if phase[0] == "fail" and now >= fail_at:
                msb(broker.machines_failed, agents.fail)
                phase[0] = "recover"
                progress(f"MSB {c.failed_msb + 1}: {len(victims)} machines failed")
            elif phase[0] == "recover" and now >= recover_at:
                msb(broker.machines_recovered, agents.recover)
                phase[0] = "done"
                progress(f"MSB {c.failed_msb + 1}: back up")
            return phase[0] == "done" and follower.at_version(2) >= c.tasks

        t2 = time.monotonic()
        timed_out = False
        try:
            pump(timeline, pc.timeout_s, "the rolling update")
        except RuntimeError as exc:
            if "not done within" not in str(exc):
                raise
            timed_out = True
            details["timeout"] = str(exc).split(";")[0]
        details["update_wall_s"] = round(time.monotonic() - t2, 1)
        time.sleep(0.5)
        agents.step(0.02)
        agents.close()
        follower.close()
        producer.flush(30)
        progress("replaying the log")

        # the counting, from the log alone
        events = read_log(cfg, registry)
        env.stop_workers()
    if events_out is not None:
        with open(events_out, "w") as fh:
            for e in events:
                fh.write(json.dumps(e.to_json(), sort_keys=True) + "\n")
    result, counted = count(events, pc, update.timestamp_ms)
    details.update({"timed_out": timed_out, "log_events": len(events), **counted})
    return result, details


def read_log(cfg, registry) -> list[Event]:
    """The experiment's events of ``LOG_TOPICS`` replayed from the log, merged in time order."""
    from streams.replay import ReplayFilter, replay  # noqa: PLC0415 - start-up cost: streams.replay (~7 ms over what `ropewalk bench|experiment` load), only for a run

    by_partition: dict[tuple[str, int], list[Event]] = {}
    for rec in replay(cfg, registry, ReplayFilter(entitlement=ENT, topics=LOG_TOPICS)):
        by_partition.setdefault((rec.topic, rec.partition), []).append(rec.event)
    return list(merged(by_partition.values()))


def count(events: Iterable[Event], pc: PipelineConditions, start_ms: int) -> tuple[Result, dict[str, Any]]:
    """Pure: the curves and totals of ``events`` (time order) for an update that started at ``start_ms``, and what
    else the counting saw. ``scheduler_decisions`` here counts the events the scheduler emitted (the simulation
    counts its ``decide`` calls)."""
    c = pc.base
    ledger = Ledger(sim.place_replicas(c.tasks, c.shards, c.replicas, c.seed, c.placement), c.min_live)
    rows, done_s = curves(ledger, events, start_ms=start_ms, time_scale=pc.time_scale, step_s=c.step_s,
                          tasks=c.tasks)
    result = Result(c, rows=rows, by_ropewalk=ledger.by_ropewalk, by_ropewalk_at_ack=ledger.by_ropewalk_at_ack,
                    by_failure=ledger.by_failure, peak_updating=ledger.peak_updating, update_done_s=done_s,
                    all_running_s=done_s, decisions=ledger.scheduler_events, acks=ledger.acks, mode=MODE)
    saw = ledger.scheduler_saw_failure_ms
    return result, {
        "shards_lost_second_replica_by_ropewalk_raced_with_failure": len(ledger.raced),
        "tasks_down_otherwise": len(ledger.down_otherwise),
        "first_operations_that_lost_shards": ledger.offenders,
        "failed_msb_tasks": len(ledger.failed_tasks),
        "scheduler_read_failure_after_ms": None if ledger.failure_ms is None or saw is None
        else saw - ledger.failure_ms,
    }


def add_arguments(ap) -> None:
    """``--pipeline`` and its own flags, after ``figure14.add_arguments``'s."""
    ap.add_argument("--pipeline", action="store_true",
                    help="run it on the real pipeline (broker, Redis, processes, a TaskController process)")
    ap.add_argument("--time-scale", type=float, default=10.0,
                    help="--pipeline: the paper's seconds are divided by this (default 10: a 220 s start takes 22 s)")
    ap.add_argument("--events-out", metavar="FILE",
                    help="--pipeline: write the replayed events the curves were counted from (JSON lines)")


def main(args, c: Conditions) -> int:
    """``ropewalk experiment figure14 --pipeline``: the experiment under ``c`` on the pipeline, printed."""
    pc = PipelineConditions(base=c, time_scale=args.time_scale)
    say = (lambda msg: print(f"figure14: {msg}", file=sys.stderr, flush=True)) if not args.json else (lambda m: None)

    t0 = time.monotonic()
    with sigterm_as_interrupt():  # `kill` stops the region's processes too
        result, details = run(pc, say, Path(args.events_out) if args.events_out else None)
    wall = time.monotonic() - t0
    if args.png:
        sim.write_png(result, args.png)
    if args.json:
        doc = result.document()
        doc["pipeline"] = details
        doc["wall_time_s"] = round(wall, 1)
        doc["png"] = args.png
        print(json.dumps(doc, sort_keys=True))
    else:
        for line in sim.table(result):
            print(line)
        for k, v in details.items():
            print(f"{k}: {v}")
        print(f"wall time: {wall:.1f} s" + (f"; plot written to {args.png}" if args.png else ""))
    sys.stdout.flush()
    return 0 if not details.get("timed_out") else 1
