"""A kill storm (issue #11): the control plane's processes killed with ``kill -9``, one every few seconds, under a
continuous stream of job submissions, resizes, stops and machine failures, with the region's supervisor starting
each again; then the region must converge, and the replayed log and Redis must show nothing lost or doubled.

    ropewalk experiment killstorm [--kills 100] [--interval-s 3] [--machines 40] [--seed 11]
                                  [--schedulers N] [--allocators M] [--json]
    .venv/bin/python bench/killstorm.py --kills 100                     # the same

Everything real: its own embedded broker and Redis on free ports, a temporary run directory and topic prefix
(``bench.env.BenchEnv``), the control plane as ``ropewalk up`` runs it (``processors.controlplane.up``: the supervisor,
the Resource Broker, the allocators, the scheduler shards (``--schedulers``/``--allocators``, default 1 and 1),
the simulated agents, the process agent of the local machine, the health check) and redis-server under the same
supervisor. Victims come in rounds: each round kills every one of ``victims()`` once (every scheduler shard and
allocator among them), in a seeded shuffled order (one waiting for its restart is passed over for the next).

What is checked once every job converged (``check``), from a replay of the log and from Redis:

* **tasks lost**: a job the workload left running that has fewer than its tasks RUNNING (state.jobs), or a job it
  stopped that is not gone;
* **tasks placed twice**: a TasksAllocated that places a task still placed on another machine (the allocations
  topic replayed in order; a move frees first); at the end, a task in two machines' task sets in Redis;
* **tasks started twice**: a START command of a task while its previous START still holds — no STOP command, and no
  report of it STOPPED, FAILED or PENDING, between them on its partition of ``tasks`` — to another machine or at
  another spec version: a decision made twice under two ids (a scheduler that decided an event again on another
  state). The same START again (the same machine and version: the timer commanding a task whose report was lost, or
  a decision made again whose commands differ, under an id of their own) is the same start told again, which the
  agent running it adopts (``already_running``). (Counting STARTs against placements, as it did
  first, took a task stopped by a shrink and started again in place by a grow before it was freed for two: the
  scaled-out storm's first CI run.)
* **tasks running twice**: a task in the latest heartbeat of two machines (at the end, not at any moment: a task
  listed by two machines' last heartbeats); each is told (``running_twice_told``): the machines and the time of
  each one's last heartbeat, where the log places the task, and its last events (placements, commands and who
  wrote them, reports, refusals) with their times;
* **machines over-committed**: a machine whose placed tasks need more cpu or memory than it has, at any point of
  the replay (per entitlement, whose events are in order) or in Redis at the end (free below zero, or free not
  capacity minus its tasks);
* **quota breaches**: an entitlement that held more machines than its quota at any point of the replay
  (MachineAssignedToEntitlement / MachineReleasedToFreePool, in order), or in Redis at the end;
* **conflicting duplicates**: one event id on the log with two contents (a decision made twice, differently);
* **Redis equals the log**: the index a rebuild from the log makes (``processors.allocator.rebuild``, in scratch
  keys, not swapped in) equals the live one key for key.

A figure is printed with its conditions; ``passed`` is true when every count is zero and every job converged.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from confluent_kafka import Consumer, TopicPartition

if __package__ in (None, ""):  # run as a script: bench/killstorm.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.env import FAUST_ENV, BenchEnv, cores, sigterm_as_interrupt  # noqa: E402
from infra import broker as embedded_kafka  # noqa: E402
from infra import services, supervisor  # noqa: E402
from processors import controlplane  # noqa: E402
from processors.allocator import snapshot  # noqa: E402
from processors.controlplane import scaled_name  # noqa: E402
from processors.frontend.jobspec import validate_spec  # noqa: E402
from processors.resourcebroker.decide import IllegalStatusTransition  # noqa: E402
from processors.scheduler.reasons import REASON_COMMAND_REPEATED, REASON_LOST_PLACEMENT  # noqa: E402
from streams import batches, state  # noqa: E402
from streams.clients import DeliveryError, EventProducer  # noqa: E402
from streams.events import new_event  # noqa: E402
from streams.retry import watermark_offsets  # noqa: E402
from streams.serde import SchemaRegistry  # noqa: E402
from streams.topics import Topics  # noqa: E402


VICTIMS = ("allocator-0", "scheduler-0", "health", "resourcebroker", "agents", "agent-local", "redis")  # 1 and 1
PAUSED = ("scheduler", "allocator", "health", "resourcebroker", "broker")  # kinds a pause picks from: stale owners
SEND_WAIT_S = 10.0  # a workload event not on the log by then is sent again (a leader paused: the storm goes on)
POWER_OFF_S = 12.0  # a region-wide power loss: dark this long (longer than the health check's timeout, 10 s)


def victims(schedulers: int = 1, allocators: int = 1, broker_nodes: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What a storm kills: every allocator and scheduler shard of the region, its other workers of ``VICTIMS``, and
    the embedded broker's nodes when it has several (``broker_nodes``: a cluster of 3 survives any one)."""
    return (*(scaled_name("allocator", i) for i in range(allocators)),
            *(scaled_name("scheduler", i) for i in range(schedulers)),
            *(v for v in VICTIMS if not v.startswith(("allocator-", "scheduler-"))), *broker_nodes)
PRODUCER = "killstorm"
# the region's processes: the faust timings of a bench, and the allocators' snapshots written often (every 50
# records read, at most every 2 s) so that a killed allocator starts from one and the storm tests them
STORM_ENV = {**FAUST_ENV, snapshot.RECORDS_ENV: "50", snapshot.EVERY_ENV: "2"}
SPEC = {"command": ["sleep", "3600"], "resources": {"cpu_millicores": 500, "memory_mib": 512}, "spread": "msb"}


@dataclass
class Options:
    kills: int = 100
    interval_s: float = 3.0  # between two kills
    machines: int = 40
    partitions: int = 4
    seed: int = 11
    entitlements: int = 4
    quota: int = 8  # machines per entitlement
    schedulers: int = 1  # scheduler shards (scheduler-0..N-1)
    allocators: int = 1  # allocators (allocator-0..M-1)
    brokers: int = 1  # nodes of the embedded Kafka (3: each a victim too)
    pause_every: int = 0  # every n-th action a SIGSTOP of pause_s (then SIGCONT) instead of a kill; 0: none
    pause_s: tuple[float, float] = (5.0, 20.0)  # a pause lasts between these (seeded)
    power_loss_after: int = 0  # after this many kills, every process of the region at once, dark, then up; 0: none
    max_live_jobs: int = 24  # beyond, the oldest live jobs are stopped
    max_tasks: int = 5  # a job has 1..max_tasks tasks, and is resized within that
    submit_every_s: float = 1.0
    resize_every_s: float = 2.0
    fail_every_s: float = 9.0  # a machine failure this often (recovered recover_after_s later)
    recover_after_s: float = 7.0
    converge_timeout_s: float = 240.0
    keep: bool = False  # keep the run directory (logs)


@dataclass
class Workload:
    """What the storm asked of the region, and what each job should end as."""

    rng: random.Random
    opts: Options
    entitlements: list[str]
    live: dict[str, tuple[str, int]] = field(default_factory=dict)  # job -> (entitlement, tasks it should have)
    stopped: set[str] = field(default_factory=set)
    failed: dict[str, float] = field(default_factory=dict)  # machine -> when to recover it (monotonic)
    counts: Counter = field(default_factory=Counter)
    serial: int = 0


class Storm:
    def __init__(self, env, opts: Options, say: Callable[[str], None]):
        self.env, self.cfg, self.opts, self.say = env, env.cfg, opts, say
        self.registry = SchemaRegistry.from_dir()
        self.producer = EventProducer(self.cfg, self.registry, PRODUCER)
        self.rng = random.Random(opts.seed)
        self.work = Workload(random.Random(opts.seed + 1), opts, [f"ks-e{i}" for i in range(opts.entitlements)])
        self.kills: list[dict] = []
        self.pauses: list[dict] = []
        self.paused: dict[int, tuple[float, str]] = {}  # pid -> (when to SIGCONT it, its program)
        self.power_losses: list[dict] = []
        self.order: list[str] = []  # victims left in this round
        self.machine_ids: list[str] = []

        nodes = tuple(embedded_kafka.node_names(self.cfg)) if opts.brokers > 1 else ()
        self.victims = victims(opts.schedulers, opts.allocators, nodes)

    # -- the workload ------------------------------------------------------------------------------------------
    def send(self, type_: str, payload: dict, entitlement: str, entity: str) -> None:
        """Produce one event of the workload, sent again (the same event: readers take it once) while the log does
        not take it (a broker away, a leader moving): a user would retry, and the workload must not be lost."""
        ev = new_event(type_, payload, entitlement=entitlement, entity_id=entity, producer=PRODUCER)
        for attempt in range(10):
            try:
                self.producer.send(ev)
                self.producer.flush(SEND_WAIT_S)
                return
            except DeliveryError as exc:
                self.work.counts["sends_retried"] += 1
                self.say(f"{type_} not taken ({exc}); sending it again")
                time.sleep(min(2.0 * (attempt + 1), 10.0))
        raise RuntimeError(f"killstorm: the log did not take {type_} {ev.event_id} in 10 attempts")

    def create_entitlements(self) -> None:
        for e in self.work.entitlements:
            self.send("EntitlementCreated", {"name": e, "quota_machines": self.opts.quota, "machine_type": None,
                                             "dc_pin": None, "host_profile": None}, e, e)

    def submit(self) -> None:
        w = self.work
        w.serial += 1
        ent = w.rng.choice(w.entitlements)
        tasks = w.rng.randint(1, self.opts.max_tasks)
        payload = validate_spec({**SPEC, "name": f"j{w.serial:04d}", "entitlement": ent, "tasks": tasks})
        payload.pop("entitlement")
        self.send("JobSubmitted", {**payload, "spec_version": 1}, ent, payload["job_id"])
        w.live[payload["job_id"]] = (ent, tasks)
        w.counts["jobs_submitted"] += 1
        while len(w.live) > self.opts.max_live_jobs:
            job = next(iter(w.live))
            self.stop_job(job)

    def stop_job(self, job: str) -> None:
        ent, _ = self.work.live.pop(job)
        self.send("JobStopped", {"job_id": job, "reason": "killstorm"}, ent, job)
        self.work.stopped.add(job)
        self.work.counts["jobs_stopped"] += 1

    def resize(self) -> None:
        w = self.work
        if not w.live:
            return
        job = w.rng.choice(sorted(w.live))
        ent, tasks = w.live[job]
        new = w.rng.choice([n for n in range(1, self.opts.max_tasks + 1) if n != tasks] or [tasks])
        self.send("JobResized", {"job_id": job, "tasks": new}, ent, job)
        w.live[job] = (ent, new)
        w.counts["resizes"] += 1

    def fail_machine(self, now: float) -> None:
        from processors.resourcebroker.processor import fail_machine  # noqa: PLC0415 - start-up cost: processors.resourcebroker.processor (~16 ms over what `ropewalk bench|experiment` load), only for a run

        w = self.work
        up = [m for m in self.machine_ids if m not in w.failed]
        if len(w.failed) >= 2 or not up:
            return
        m = w.rng.choice(up)
        if fail_machine(self.cfg, m, registry=self.registry):
            w.failed[m] = now + self.opts.recover_after_s
            w.counts["machine_failures"] += 1

    def recover_due(self, now: float, *, all_: bool = False) -> None:
        from processors.resourcebroker.processor import recover_machine  # noqa: PLC0415 - start-up cost: processors.resourcebroker.processor (~16 ms over what `ropewalk bench|experiment` load), only for a run

        for m, at in list(self.work.failed.items()):
            if all_ or at <= now:
                try:
                    recover_machine(self.cfg, m, registry=self.registry)
                    self.work.counts["machine_recoveries"] += 1
                except IllegalStatusTransition:  # not DOWN by us any more (the health check's now): left to it
                    self.work.counts["machine_recoveries_refused"] += 1
                del self.work.failed[m]

    # -- the kills ---------------------------------------------------------------------------------------------
    def kill_one(self, t0: float) -> dict | None:
        running = {n: s["pid"] for n, s in supervisor.programs_state(self.cfg.run_dir).items()
                   if n in self.victims and s["running"] and s["pid"] and self.may_hit(n)}
        if not running:
            return None
        if not self.order:  # each round kills every victim once, in a seeded shuffled order
            self.order = list(self.victims)
            self.rng.shuffle(self.order)
        victim = next((v for v in self.order if v in running), None)
        if victim is None:  # every victim left in this round is waiting for its restart
            return None
        self.order.remove(victim)
        try:
            os.kill(running[victim], signal.SIGKILL)
        except ProcessLookupError:
            return None
        kill = {"at_s": round(time.monotonic() - t0, 2), "victim": victim, "pid": running[victim]}
        self.kills.append(kill)
        return kill

    def may_hit(self, victim: str) -> bool:
        """Whether ``victim`` may be killed or paused now: anything but a broker node, and a broker node only while
        every other node runs, none is paused and no partition is short of a replica (a cluster of 3 with
        ``min.insync.replicas`` 2 survives the loss of one node, not of two at once)."""
        nodes = embedded_kafka.node_names(self.cfg) if self.opts.brokers > 1 else []
        if victim not in nodes:
            return True
        programs = supervisor.programs_state(self.cfg.run_dir)
        others = [programs.get(n) or {} for n in nodes if n != victim]
        if any(not st.get("running") or st.get("pid") in self.paused for st in others):
            return False
        cluster = services.cluster_state(self.cfg)
        return cluster["error"] is None and not cluster["under_replicated"] and len(cluster["nodes"]) == len(nodes)

    def pause_one(self, t0: float) -> dict | None:
        """SIGSTOP a control-plane process (a shard, an allocator, the health check, the Resource Broker, a broker
        node) for ``pause_s``: it wakes up stale (its partitions another's, its fence raised, its leadership moved),
        which is what the fences are for. SIGCONT comes from ``wake_due``."""
        running = {n: s["pid"] for n, s in supervisor.programs_state(self.cfg.run_dir).items()
                   if n in self.victims and n.startswith(PAUSED) and s["running"] and s["pid"]
                   and s["pid"] not in self.paused and self.may_hit(n)}
        if not running:
            return None
        victim = self.rng.choice(sorted(running))
        lasts = self.rng.uniform(*self.opts.pause_s)
        try:
            os.kill(running[victim], signal.SIGSTOP)
        except ProcessLookupError:
            return None
        self.paused[running[victim]] = (time.monotonic() + lasts, victim)
        pause = {"at_s": round(time.monotonic() - t0, 2), "victim": victim, "pid": running[victim],
                 "seconds": round(lasts, 1)}
        self.pauses.append(pause)
        return pause

    def wake_due(self, now: float, *, all_: bool = False) -> None:
        for pid, (at, _) in list(self.paused.items()):
            if all_ or at <= now:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # killed while paused (a kill, or the power loss)
                del self.paused[pid]

    def power_loss(self, t0: float) -> dict:
        """Every process of the region SIGKILLed at once — the brokers, Redis, the supervisor, every worker, the
        agents and the process agent's tasks — dark for ``POWER_OFF_S``, then up again as `ropewalk up` brings it up
        (the services, then the control plane with the same counts)."""
        self.wake_due(0.0, all_=True)
        at = time.monotonic()
        pids = services.power_off(self.cfg)  # kills every process and waits until they are gone
        time.sleep(POWER_OFF_S)
        services.up(self.cfg)
        region = controlplane.up(self.cfg, self.opts.machines, ready_timeout_s=300.0, env=dict(STORM_ENV),
                                 schedulers=self.opts.schedulers, allocators=self.opts.allocators)
        event = {"at_s": round(at - t0, 2), "processes": len(pids), "dark_s": POWER_OFF_S,
                 "back_s": round(time.monotonic() - at, 1), "ready": region["ready"]}
        self.power_losses.append(event)
        self.order = []  # a new round after the power is back
        return event

    # -- the run -----------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        opts, say = self.opts, self.say
        t_start = time.monotonic()
        region = controlplane.up(self.cfg, opts.machines, ready_timeout_s=180.0, env=dict(STORM_ENV),
                                 schedulers=opts.schedulers, allocators=opts.allocators)
        if not region["ready"]:
            raise RuntimeError(f"killstorm: the region did not come up: {region}")
        self.machine_ids = sorted(m for m in machine_ids(self.cfg))
        self.create_entitlements()
        say(f"region up ({region['machines_indexed']} machines) in {time.monotonic() - t_start:.0f} s; "
            f"{opts.kills} kills, one every {opts.interval_s} s")
        t0 = time.monotonic()
        due = {"kill": t0 + opts.interval_s, "submit": t0, "resize": t0 + opts.resize_every_s,
               "fail": t0 + opts.fail_every_s}
        while len(self.kills) < opts.kills:
            now = time.monotonic()
            if now >= due["submit"]:
                self.submit()
                due["submit"] = now + opts.submit_every_s
            if now >= due["resize"]:
                self.resize()
                due["resize"] = now + opts.resize_every_s
            if now >= due["fail"]:
                self.fail_machine(now)
                due["fail"] = now + opts.fail_every_s
            self.recover_due(now)
            self.wake_due(now)
            if now >= due["kill"]:
                actions = len(self.kills) + len(self.pauses)
                if opts.power_loss_after and not self.power_losses and len(self.kills) >= opts.power_loss_after:
                    loss = self.power_loss(t0)
                    say(f"power loss of the whole region at {loss['at_s']} s ({loss['processes']} processes): back "
                        f"after {loss['back_s']} s")
                elif opts.pause_every and (actions + 1) % opts.pause_every == 0 and self.pause_one(t0):
                    say(f"paused {self.pauses[-1]['victim']} for {self.pauses[-1]['seconds']} s")
                else:
                    kill = self.kill_one(t0)
                    if kill and len(self.kills) % 10 == 0:
                        say(f"{len(self.kills)} kills ({kill['victim']} at {kill['at_s']} s)")
                due["kill"] = time.monotonic() + opts.interval_s
            time.sleep(0.05)
        storm_s = time.monotonic() - t0
        self.wake_due(0.0, all_=True)
        self.recover_due(0.0, all_=True)
        say(f"storm over after {storm_s:.0f} s; waiting for every job to converge")
        t1 = time.monotonic()
        converged = self.wait_converged(opts.converge_timeout_s)
        converge_s = time.monotonic() - t1
        settle(self.cfg)
        checks = check(self.cfg, self.registry, self.work, self.env.redis())
        restarts = restarts_by_program(self.cfg.run_dir)
        doc = {
            "conditions": {"machines": opts.machines, "partitions": opts.partitions, "cores": cores(),
                           "kills": opts.kills, "interval_s": opts.interval_s, "seed": opts.seed,
                           "entitlements": opts.entitlements, "quota": opts.quota,
                           "submit_every_s": opts.submit_every_s, "resize_every_s": opts.resize_every_s,
                           "fail_every_s": opts.fail_every_s, "max_live_jobs": opts.max_live_jobs,
                           "schedulers": opts.schedulers, "allocators": opts.allocators, "brokers": opts.brokers,
                           "pause_every": opts.pause_every, "pause_s": list(opts.pause_s),
                           "power_loss_after": opts.power_loss_after, "victims": list(self.victims)},
            "storm_s": round(storm_s, 1), "converge_s": round(converge_s, 1), "converged": converged["ok"],
            "kills_by_victim": dict(sorted(Counter(k["victim"] for k in self.kills).items())),
            "pauses": [{k: p[k] for k in ("victim", "seconds")} for p in self.pauses],
            "power_losses": self.power_losses,
            "restarts_by_program": restarts, "allocator_starts": allocator_starts(self.cfg.run_dir),
            "workload": dict(self.work.counts),
            "jobs_live": len(self.work.live), "jobs_stopped": len(self.work.stopped),
            "not_converged": converged["not"][:10], **checks,
        }
        doc["why_not"] = why_not(doc, len(self.kills))
        doc["passed"] = not doc["why_not"]
        return doc

    def wait_converged(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        bad: list[str] = []
        while time.monotonic() < deadline:
            jobs = state.current(self.cfg, self.registry, "jobs")
            bad = not_converged(jobs, self.work)
            programs = supervisor.programs_state(self.cfg.run_dir)
            down = [n for n, s in programs.items() if not s["running"]]
            if not bad and not down:
                return {"ok": True, "not": []}
            time.sleep(2.0)
        return {"ok": False, "not": bad}


STORY_EVENTS = 12  # a task's last events told beside it when it is found running twice

COUNTS = ("tasks_lost", "tasks_placed_twice", "tasks_started_twice", "tasks_running_twice", "machines_overcommitted",
          "quota_breaches", "conflicting_duplicates")


def why_not(doc: dict[str, Any], kills: int) -> list[str]:
    """Every reason a storm did not pass, each naming its figure (empty when it passed)."""
    reasons = [f"{k}={doc[k]}" for k in COUNTS if doc[k] != 0]
    reasons += [f"conflicting duplicate: {c}" for c in doc.get("conflicting_at", [])]
    if not doc["converged"]:
        reasons.append(f"not converged: {doc['not_converged']}")
    if not doc["redis_matches_log"]:
        reasons.append(f"redis does not match a rebuild from the log: {doc['redis_differences']}")
    if sum(doc["restarts_by_program"].values()) < kills:
        reasons.append(f"{sum(doc['restarts_by_program'].values())} restarts recorded for {kills} kills: "
                       f"{doc['restarts_by_program']}")
    reasons += [f"power loss at {p.get('at_s')} s: region not ready after it" for p in doc["power_losses"]
                if not p["ready"]]
    return reasons


def machine_ids(cfg) -> list[str]:
    from processors.allocator.index import MachineIndex  # noqa: PLC0415 - start-up cost: processors.allocator.index loads redis (~180 ms over what `ropewalk bench|experiment` load), only for a run

    r = cfg.redis_client()  # a scan: the operator's (a read-only user may not: infra/credentials.py)
    try:
        return MachineIndex(r, cfg.topic_prefix).machine_ids()
    finally:
        r.close()


def not_converged(jobs: dict, work: Workload) -> list[str]:
    """The workload's jobs not (yet) as it left them: live ones with all their tasks RUNNING, stopped ones gone."""
    out = []
    for job, (_, tasks) in sorted(work.live.items()):
        ev = jobs.get(job)
        states = [t["state"] for t in ev.payload["tasks"]] if ev is not None else []
        if ev is None or len(states) != tasks or any(s != "RUNNING" for s in states):
            out.append(f"{job}: {Counter(states) if ev is not None else 'no state'} (want {tasks} RUNNING)")
    for job in sorted(work.stopped):
        ev = jobs.get(job)
        if ev is not None and not ev.payload.get("deleted"):
            out.append(f"{job}: {ev.payload['state']} (stopped: want it gone)")
    return out


def settle(cfg, quiet_s: float = 3.0, timeout_s: float = 60.0) -> None:
    """Until the allocations topic has not grown for ``quiet_s`` (the allocator is idle), at most ``timeout_s``."""
    topic = Topics(cfg.topic_prefix, cfg.partitions).name("allocations")
    c = Consumer({**cfg.kafka_conf(), "group.id": "killstorm-settle", "log_level": 0})
    try:
        def ends():
            return [watermark_offsets(c, TopicPartition(topic, p), timeout_s=5)[1] for p in range(cfg.partitions)]
        last, since, deadline = ends(), time.monotonic(), time.monotonic() + timeout_s
        while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
            time.sleep(0.5)
            now = ends()
            if now != last:
                last, since = now, time.monotonic()
    finally:
        c.close()


def restarts_by_program(run_dir: Path) -> dict[str, int]:
    try:
        lines = (Path(run_dir) / supervisor.RESTARTS_FILE).read_text().splitlines()
    except OSError:
        return {}
    return dict(sorted(Counter(json.loads(line)["program"] for line in lines).items()))


def allocator_starts(run_dir: Path) -> dict[str, int]:
    """How the allocators' folds of the log began, from their logs: from a snapshot (processors/allocator/snapshot.py)
    or from the log's beginning, and the snapshots set aside (the log no longer held where they ended)."""
    out: Counter = Counter()
    for path in Path(run_dir).glob("allocator*.log"):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if "allocator: folded the log:" in line:
                out["from_log" if "'snapshot': None" in line else "from_snapshot"] += 1
            elif "allocator: snapshot" in line and "set aside" in line:
                out["snapshots_set_aside"] += 1
    return dict(sorted(out.items()))


# -- the checks --------------------------------------------------------------------------------------------------

def check(cfg, registry, work: Workload, r) -> dict[str, Any]:
    """The counts of ``COUNTS`` (and what they were counted from), from a replay of the log and from Redis."""
    jobs = state.current(cfg, registry, "jobs")
    lost = not_converged(jobs, work)
    doc = replay_checks(cfg, registry)
    quota = doc.pop("quota")
    doc.pop("placed")
    diff, waited_s = redis_caught_up(cfg, registry, r)  # before Redis is counted: a projection still under way
    redis_doc = check_redis(cfg, r, quota)
    doc.update({"tasks_lost": len(lost),
                "tasks_placed_twice": doc["tasks_placed_twice"] + redis_doc["tasks_in_two_machines"],
                "machines_overcommitted": doc["machines_overcommitted"] + redis_doc["machines_overcommitted"],
                "quota_breaches": doc["quota_breaches"] + redis_doc["quota_breaches"],
                "redis_differences": diff[:10], "redis_matches_log": not diff, "redis_caught_up_s": waited_s,
                "redis": redis_doc})
    return doc


def replay_checks(cfg, registry) -> dict[str, Any]:  # noqa: C901
    """What a replay of the log says (``intents``, ``machines``, ``allocations``, ``tasks``, ``heartbeats``):
    ``conflicting_duplicates`` (one event id with two contents: an event decided twice, differently),
    ``tasks_placed_twice``, ``tasks_started_twice`` (a START of a task to another machine or version while its
    last START holds: a decision made twice under two ids), ``tasks_running_twice``, ``machines_overcommitted``,
    ``quota_breaches``, and the counts they come from. Shared by the kill storm and the scale-out tests."""
    from streams.replay import Replay, ReplayFilter  # noqa: PLC0415 - start-up cost: streams.replay (~7 ms over what `ropewalk bench|experiment` load), only for a run

    seen: dict[str, str] = {}  # event id -> its payload, as JSON
    conflicting = duplicates = 0
    conflicting_at: list[str] = []
    capacity: dict[str, tuple[int, int]] = {}
    resources: dict[str, tuple[int, int]] = {}  # request id -> per-task (cpu, mem)
    placed: dict[str, tuple[str, int, int]] = {}  # task -> (machine, cpu, mem)
    load: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])  # (entitlement, machine) -> cpu, mem
    held: dict[str, set[str]] = defaultdict(set)
    peak: Counter = Counter()  # the most machines each entitlement held at once
    quota: dict[str, int] = {}
    beats: dict[str, tuple[list[str], int]] = {}  # machine -> (its latest heartbeat's tasks, that beat's time)
    story: dict[str, deque] = defaultdict(lambda: deque(maxlen=STORY_EVENTS))  # task -> its last events, told
    placements: Counter = Counter()  # task -> times a TasksAllocated placed it somewhere new
    live: dict[str, tuple[str, tuple]] = {}  # task -> the START it runs under (id, (machine, version)), until it ends
    started_twice_at: list[str] = []
    repairs: Counter = Counter()  # the scheduler's timer commands repaired (RELIABILITY.md, stop 42), by reason
    twice = over = breaches = 0
    over_at: list[str] = []
    log = []
    for rec in Replay(cfg, registry, ReplayFilter(topics=("intents", "machines", "allocations", "tasks",
                                                          "heartbeats"))):
        ev = rec.event
        body = json.dumps(ev.payload, sort_keys=True, default=str)
        if ev.event_id in seen:
            duplicates += 1
            if seen[ev.event_id] != body:
                conflicting += 1
                if len(conflicting_at) < 5:  # which event, and both contents: what decided it twice, differently
                    conflicting_at.append(f"{ev.type} {ev.event_id} at {rec.topic}/{rec.partition}@{rec.offset}: "
                                          f"{seen[ev.event_id][:300]} then {body[:300]}")
            continue
        seen[ev.event_id] = body
        log.append(ev)
        if ev.type in ("EntitlementCreated", "EntitlementUpdated") and ev.payload.get("quota_machines") is not None:
            quota[ev.entitlement] = ev.payload["quota_machines"]
        else:
            for reg in batches.machine_registrations(ev):
                capacity[reg["machine_id"]] = (reg["capacity"]["cpu_millicores"], reg["capacity"]["memory_mib"])
    # Then in log order per partition (an entitlement's events are in one, in order; topics and partitions are read
    # interleaved, so the capacities and quotas are taken first).
    records = len(log) + duplicates
    for ev in log:
        p = ev.payload
        if ev.type == "MachineAssignedToEntitlement":
            held[ev.entitlement].add(p["machine_id"])
            peak[ev.entitlement] = max(peak[ev.entitlement], len(held[ev.entitlement]))
            if len(held[ev.entitlement]) > quota.get(ev.entitlement, 0):
                breaches += 1
        elif ev.type == "MachineReleasedToFreePool":
            held[ev.entitlement].discard(p["machine_id"])
        elif ev.type == "AllocationRequested":
            resources[p["request_id"]] = (p["resources"]["cpu_millicores"], p["resources"]["memory_mib"])
        elif ev.type == "TasksDeallocated":
            for row in p["placements"]:
                story[row["task_id"]].append(f"{ev.timestamp_ms} freed from {row['machine_id']} ({ev.event_id[:8]})")
                cur = placed.get(row["task_id"])
                if cur is not None and cur[0] == row["machine_id"]:
                    del placed[row["task_id"]]
                    sums = load[(ev.entitlement, cur[0])]
                    sums[0] -= cur[1]
                    sums[1] -= cur[2]
        elif ev.type == "TasksAllocated":
            cpu, mem = resources.get(p["request_id"], (0, 0))
            for row in p["placements"]:
                t, m = row["task_id"], row["machine_id"]
                story[t].append(f"{ev.timestamp_ms} placed on {m} ({ev.event_id[:8]})")
                cur = placed.get(t)
                if cur is not None and cur[0] == m:
                    continue  # placed there already: a no-op
                if cur is not None:
                    twice += 1
                placed[t] = (m, cpu, mem)
                placements[t] += 1
                sums = load[(ev.entitlement, m)]
                sums[0] += cpu
                sums[1] += mem
                cap = capacity.get(m, (0, 0))
                if sums[0] > cap[0] or sums[1] > cap[1]:
                    over += 1
                    over_at.append(f"{m} ({ev.entitlement}: {sums} of {cap})")
        elif ev.type == "TasksCommanded":
            for c in p["commands"]:
                if c.get("reason") in (REASON_COMMAND_REPEATED, REASON_LOST_PLACEMENT):
                    repairs[c["reason"]] += 1
                story[c["task_id"]].append(f"{ev.timestamp_ms} {c['command']} to {c['machine_id']} by {ev.producer} "
                                           f"({ev.event_id[:8]})")
                if c["command"] == "START":
                    this = (c["machine_id"], c.get("spec_version"))
                    was = live.get(c["task_id"])
                    if was is not None and was[1] != this:  # started elsewhere (or another version) while its last
                        # start still holds: decided twice. The same start told again (the timer's command_repeated, a
                        # decision made again) is adopted by the agent that runs it (``already_running``).
                        started_twice_at.append(f"{c['task_id']} on {c['machine_id']} ({was[0]}, then "
                                                f"{ev.event_id[:8]})")
                    live[c["task_id"]] = (ev.event_id[:8], this)
                elif c["command"] == "STOP":
                    live.pop(c["task_id"], None)
        elif ev.type == "TaskStatesChanged":  # a stop, a crash or a move ends the task's start (agent or scheduler)
            for r in p["reports"]:
                story[r["task_id"]].append(f"{ev.timestamp_ms} {r['state']} on {r.get('machine_id')} "
                                           f"({r.get('reason', '')}) by {ev.producer}")
                if r["state"] in ("STOPPED", "FAILED", "PENDING"):
                    live.pop(r["task_id"], None)
        elif ev.type == "TaskCommandRefused":
            story[p["task_id"]].append(f"{ev.timestamp_ms} {p['command']} to {p['machine_id']} refused "
                                       f"({p['reason']})")
        elif ev.type == "AgentHeartbeat":
            beats[p["machine_id"]] = (list(p["running_task_ids"]), ev.timestamp_ms)
    running_on: dict[str, set[str]] = defaultdict(set)
    for m, (tasks, _) in beats.items():
        for t in tasks:
            running_on[t].add(m)
    running_twice = sorted(t for t, ms in running_on.items() if len(ms) > 1)
    # Each task in the latest heartbeat of two machines, told: the machines and when each beat last, where the log
    # places it, and its last events (placements, commands and by whom, reports, refusals) with their times.
    running_twice_told = [{"task": t, "last_beats": {m: beats[m][1] for m in sorted(running_on[t])},
                           "placed_on": placed[t][0] if t in placed else None, "events": list(story[t])}
                          for t in running_twice[:10]]
    started_twice = sorted({t.split(" ", 1)[0] for t in started_twice_at})
    return {"records_replayed": records, "duplicate_records": duplicates, "conflicting_duplicates": conflicting, "conflicting_at": conflicting_at,
            "tasks_placed_twice": twice, "tasks_started_twice": len(started_twice),
            "started_twice": started_twice_at[:10], "repairs": dict(sorted(repairs.items())),
            "tasks_running_twice": len(running_twice),
            "running_twice": running_twice[:10], "running_twice_told": running_twice_told,
            "machines_overcommitted": over, "overcommitted": over_at[:10],
            "quota_breaches": breaches, "tasks_placed": len(placed), "placed": {t: m for t, (m, _, _) in placed.items()},
            "peak_machines_held": dict(sorted(peak.items())), "quota": quota}


def check_redis(cfg, r, quota: dict[str, int]) -> dict[str, Any]:
    from processors.allocator.index import MachineIndex, text  # noqa: PLC0415 - start-up cost: processors.allocator.index loads redis (~180 ms over what `ropewalk bench|experiment` load), only for a run

    index = MachineIndex(r, cfg.topic_prefix)
    machines = index.machines(index.machine_ids())
    placements = index.placements()
    sets: dict[str, int] = Counter()
    over = 0
    held: Counter = Counter()
    for m in machines.values():
        tasks = {text(k) for k in r.smembers(f"{cfg.topic_prefix}tasks:{m.id}")}
        for t in tasks:
            sets[t] += 1
        res = [tuple(map(int, text(v).split()))
               for v in r.hmget(f"{cfg.topic_prefix}taskres", list(tasks)) if v is not None] if tasks else []
        used = (sum(c for c, _ in res), sum(mm for _, mm in res))
        if (m.cpu_free < 0 or m.mem_free < 0 or m.cpu_free != m.cpu_capacity - used[0]
                or m.mem_free != m.mem_capacity - used[1]):
            over += 1
        if m.entitlement:
            held[m.entitlement] += 1
    return {"machines": len(machines), "placements": len(placements),
            "tasks_in_two_machines": sum(1 for n in sets.values() if n > 1),
            "machines_overcommitted": over,
            "quota_breaches": sum(1 for e, n in held.items() if n > quota.get(e, 0)),
            "machines_held": dict(sorted(held.items()))}


def redis_caught_up(cfg, registry, r, timeout_s: float = 90.0) -> tuple[list[str], float]:
    """Until Redis equals a rebuild from the log, at most ``timeout_s``: the differences left (none when it caught
    up) and the seconds waited. An allocator restarted late in a storm projects its fold after its catch-up; its
    ``applied:`` marks trail the log until then and show as differences, which a projection that is wrong keeps."""
    t0 = time.monotonic()
    while (diff := redis_differences(cfg, registry, r)) and time.monotonic() - t0 < timeout_s:
        time.sleep(1.0)
    return diff, round(time.monotonic() - t0, 1)


def redis_differences(cfg, registry, r) -> list[str]:
    """The keys where the live index and a rebuild of it from the log (scratch keys, not swapped in) differ: none
    when Redis holds exactly the projection of the log."""
    from processors.allocator.index import MachineIndex  # noqa: PLC0415 - start-up cost: processors.allocator.index loads redis (~180 ms over what `ropewalk bench|experiment` load), only for a run
    from processors.allocator.rebuild import Rebuild, index_state  # noqa: PLC0415 - start-up cost: processors.allocator.rebuild (~480 ms over what `ropewalk bench|experiment` load), only for a run

    rb = Rebuild(cfg, registry, r, from_snapshot=False)  # the log alone: the allocators' snapshots are under test
    try:
        rb.apply(rb.read())
        rb.write()
        rebuilt = index_state(MachineIndex(r, rb.scratch).dump())
        live = index_state(MachineIndex(r, cfg.topic_prefix).dump())
    finally:
        rb.discard()
    return [f"{k}: live {live.get(k)!r}, log {rebuilt.get(k)!r}" for k in sorted(set(live) | set(rebuilt))
            if live.get(k) != rebuilt.get(k)]


# -- the command -------------------------------------------------------------------------------------------------

def run(opts: Options, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    t0 = time.monotonic()
    with sigterm_as_interrupt(), BenchEnv(opts.partitions, keep=opts.keep, brokers=opts.brokers) as env:
        doc = Storm(env, opts, say).run()
        doc["run_dir"] = str(env.run_dir) if opts.keep else None
    doc["seconds"] = round(time.monotonic() - t0, 1)
    return doc


def format_text(doc: dict) -> str:
    c = doc["conditions"]
    lines = [f"kill storm: {c['kills']} kills (kill -9), one every {c['interval_s']} s, of {', '.join(c['victims'])}; "
             f"{c['machines']} machines, {c['partitions']} partitions, {c['cores']} cores, seed {c['seed']}",
             f"  storm {doc['storm_s']} s; converged {'yes' if doc['converged'] else 'NO'} {doc['converge_s']} s after",
             f"  kills      {doc['kills_by_victim']}",
             f"  pauses     {[(p['victim'], p['seconds']) for p in doc['pauses']]} (SIGSTOP, then SIGCONT)",
             f"  power      {doc['power_losses']} (every process at once, then up)",
             f"  restarts   {doc['restarts_by_program']} (recorded by the supervisor); allocators' folds began "
             f"{doc.get('allocator_starts') or {}}",
             f"  workload   {doc['workload']}; {doc['jobs_live']} jobs left running, {doc['jobs_stopped']} stopped",
             f"  log        {doc['records_replayed']} records replayed, {doc['duplicate_records']} duplicate records "
             f"(same id and content: readers drop them), {doc['tasks_placed']} tasks placed at the end",
             f"  repairs    {doc.get('repairs') or 'none'} (commands the scheduler's timer sent again: a lost report or answer)"]
    lines += [f"  {k:24} {doc[k]}" for k in COUNTS]
    lines += [f"  {'redis_matches_log':24} {doc['redis_matches_log']}"
              + (f"  ({len(doc['redis_differences'])}+ keys differ: {doc['redis_differences'][:3]})"
                 if doc["redis_differences"] else ""),
              f"  {'passed':24} {doc['passed']}  ({doc['seconds']} s in all)"]
    if doc["not_converged"]:
        lines.append(f"  not converged: {doc['not_converged']}")
    for told in doc.get("running_twice_told", ()):
        lines.append(f"  running twice: {told['task']} in the latest heartbeats of {told['last_beats']} (ms), "
                     f"placed on {told['placed_on']}; its last events:")
        lines += [f"    {line}" for line in told["events"]]
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = Options()
    ap.add_argument("--kills", type=int, default=d.kills, help=f"processes killed in all (default {d.kills})")
    ap.add_argument("--interval-s", type=float, default=d.interval_s, help="seconds between two kills")
    ap.add_argument("--machines", type=int, default=d.machines)
    ap.add_argument("--schedulers", type=int, default=d.schedulers, help="scheduler shards (each one a victim)")
    ap.add_argument("--allocators", type=int, default=d.allocators, help="allocators (each one a victim)")
    ap.add_argument("--brokers", type=int, default=d.brokers, help="nodes of the embedded Kafka (3: each a victim)")
    ap.add_argument("--pause-every", type=int, default=d.pause_every, metavar="N",
                    help="every N-th action SIGSTOPs a shard, allocator, health check, Resource Broker or broker for "
                         "5-20 s instead of a kill (default: none)")
    ap.add_argument("--power-loss-after", type=int, default=d.power_loss_after, metavar="K",
                    help="after K kills, every process of the region SIGKILLed at once, dark 12 s, then up "
                         "(default: none)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--keep", action="store_true", help="keep the run directory (every process's log)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")


def run_cli(args) -> int:
    opts = Options(kills=args.kills, interval_s=args.interval_s, machines=args.machines, seed=args.seed,
                   schedulers=args.schedulers, allocators=args.allocators, brokers=args.brokers,
                   pause_every=args.pause_every, power_loss_after=args.power_loss_after, keep=args.keep)
    doc = run(opts, say=lambda s: print(f"killstorm: {s}", file=sys.stderr, flush=True))
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else format_text(doc))
    return 0 if doc["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/killstorm.py", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
