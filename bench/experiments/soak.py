"""A soak (issue #29): a region run through simulated days of churn, sampled, to show what stays bounded.

    ropewalk experiment soak --days D --time-scale S [--machines 40] [--job-every-s 2] [--json] [--plot FILE]

Everything real, as ``ropewalk up`` runs it (``processors.controlplane.up``: the supervisor and every worker, the
embedded broker and Redis), in a region of its own (``bench.env.BenchEnv``: ports, run directory, topic prefix).
**Simulated time** runs ``S`` times faster than the clock: the workload's intervals are simulated seconds, and so
is every duration the region measures for itself that the soak would otherwise never see pass: a stopped job's
grace (``ROPEWALK_JOB_GC_S``, an hour), the time-bounded topics' retention and segments and the compacted ones'
segments and tombstones (streams/topics.py), a stopped task's log (a day), the allocator's journal in Redis (an
hour; at least 10 s) — each divided by ``S``. Not scaled: the heartbeat interval, the health check's timeout, the
scheduler's timer (they pace work, not memory).

**The churn**, in simulated seconds: a job every ``--job-every-s`` (1 to 3 tasks), the oldest stopped once more than
``--live-jobs`` live; a live job resized every ``--resize-every-s``, updated (a new spec version: a rolling update)
every ``--update-every-s``; a machine failed every ``--fail-every-s`` and recovered ``--recover-after-s`` later; an
MSB under maintenance for an hour once a day. The schedule is kept whatever the region's pace: a soak the region
cannot follow shows it as lag (the scheduler's consumer group, sampled) and as jobs not running.

**Samples**, every ``--sample-every-s`` simulated (and at the end): every process's RSS (the supervised workers, the
broker, Redis), the broker's disk per topic (its data directory; changelogs apart), Redis's memory (used_memory),
the scheduler's lag, the jobs ever submitted and live; once a simulated day, a scheduler shard killed (``kill -9``,
the supervisor starts it again) and **its recovery time**: from the kill until the scheduler answers a new job
(a probe submitted right after the kill: its JobStatePublished), and the latency of ``ropewalk at`` (now, minus a
minute) and of ``replay`` (one job, the last simulated hour).

**Goals** (the issue's): after a warm-up day, every process's RSS and Redis's memory flat (at most 5% growth per
simulated week: a least-squares slope over the samples after the first day, against the first of them); the
broker's disk bounded by the retention set (the kept topics grow with the churn: their rate per simulated day is
reported); a shard's recovery time independent of how many jobs ever ran (its last against its first).
Writes a table (stdout, or ``--json``) and a plot (``--plot``, PNG: matplotlib, the ``plot`` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from confluent_kafka import Consumer, TopicPartition

if __package__ in (None, ""):  # run as a script: bench/experiments/soak.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.env import FAUST_ENV, BenchEnv, cores, sigterm_as_interrupt  # noqa: E402
from bench.killstorm import machine_ids  # noqa: E402
from infra import supervisor  # noqa: E402
from infra.broker import BrokerLayout  # noqa: E402
from infra.config import DEFAULT_JOB_GC_S  # noqa: E402
from processors import controlplane  # noqa: E402
from processors.agent import logs  # noqa: E402
from processors.frontend.jobspec import validate_spec  # noqa: E402
from processors.frontend.service import Frontend, spec_payload  # noqa: E402
from processors.opsplanner import planner as ops  # noqa: E402
from processors.opsplanner.decide import Plan, PlanError  # noqa: E402
from processors.resourcebroker.decide import IllegalStatusTransition  # noqa: E402
from streams.clients import EventProducer  # noqa: E402
from streams.events import new_event  # noqa: E402
from streams.serde import SchemaRegistry  # noqa: E402
from streams.topics import CATALOGUE, CHANGELOG_CONFIG, Topics  # noqa: E402

DAY_S = 86_400
WEEK_S = 7 * DAY_S
PRODUCER = "soak"
SPEC = {"command": ["sleep", "86400"], "resources": {"cpu_millicores": 250, "memory_mib": 256}, "spread": "msb"}
GROWTH_GOAL = 0.05  # per simulated week, after the warm-up day
PROBE_ENT = "soak-probe"
KILLED = "scheduler-0"  # the process each recovery kills


@dataclass
class Options:
    days: float = 1.0
    time_scale: float = 100.0  # simulated seconds per second
    machines: int = 40
    partitions: int = 4
    entitlements: int = 4
    quota: int = 10  # machines per entitlement
    job_every_s: float = 2.0  # simulated
    live_jobs: int = 40  # beyond, the oldest live job is stopped
    max_tasks: int = 3
    resize_every_s: float = 10.0
    update_every_s: float = 30.0
    fail_every_s: float = 3600.0
    recover_after_s: float = 600.0
    maintenance_every_s: float = DAY_S
    maintenance_s: float = 3600.0
    sample_every_s: float = 3 * 3600.0
    recovery_every_s: float = DAY_S  # a shard killed and its recovery timed, this often (and once at the start)
    seed: int = 29
    keep: bool = False
    plot: str | None = None


@dataclass
class Work:
    rng: random.Random
    entitlements: list[str]
    live: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # job -> (entitlement, tasks, version)
    counts: Counter = field(default_factory=Counter)
    failed: dict[str, float] = field(default_factory=dict)  # machine -> simulated time to recover it
    maintenance: list[tuple[str, float]] = field(default_factory=list)  # (unavailability id, simulated end)
    serial: int = 0


MIN_RETRY_S = 1.0  # the scaled retry timer's fastest round


def scaled_env(time_scale: float) -> dict[str, str]:
    """What the region measures in time that the soak must see pass: in simulated time."""
    from processors.allocator.index import DONE_TTL_ENV, DONE_TTL_S  # noqa: PLC0415 - start-up cost: processors.allocator.index loads redis (~180 ms over what `ropewalk bench|experiment` load), only for a run
    from processors.scheduler.shard import RETRY_ENV, RETRY_S  # noqa: PLC0415 - start-up cost: processors.scheduler.shard (~420 ms: faust's app); `ropewalk bench|experiment` import this module for every command

    # The scheduler's timer collects the jobs whose grace passed: at its real 10 s a scaled grace of seconds is
    # collected once a round at best, and a shard killed every few seconds of wall time (the recoveries) ran no
    # round at all between two kills. Scaled too, but no faster than once a second (MIN_RETRY_S).
    return {RETRY_ENV: f"{max(MIN_RETRY_S, RETRY_S / time_scale):.3f}",
            "ROPEWALK_JOB_GC_S": f"{DEFAULT_JOB_GC_S / time_scale:.3f}",
            "ROPEWALK_TASK_LOG_KEEP_S": f"{logs.KEEP_S / time_scale:.3f}",
            DONE_TTL_ENV: str(max(10, int(DONE_TTL_S / time_scale)))}  # its decisions reach the log in seconds


MIN_SEGMENT_MS = 10_000  # a scaled segment rolls no more often than this (the broker's cost per segment)
SCALED_KEYS = ("retention.ms", "segment.ms", "delete.retention.ms")


def scaled(conf: dict[str, str], time_scale: float) -> dict[str, str]:
    """The time settings of a topic's config in simulated time (a kept topic's -1 stays)."""
    return {k: str(max(MIN_SEGMENT_MS, int(int(v) / time_scale))) for k, v in conf.items()
            if k in SCALED_KEYS and int(v) >= 0}


def scaled_topic_configs(time_scale: float) -> dict[str, dict[str, str]]:
    """The catalogue's topics' retention, segments and tombstones' stay in simulated time (logical topic ->
    config; faust's changelogs are scaled once faust made them: ``Soak.scale_changelogs``)."""
    return {spec.name: conf for spec in CATALOGUE if (conf := scaled(dict(spec.config), time_scale))}


def growth_per_week(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of (simulated s, value) per simulated week, against the first value; None with
    fewer than two points or a first value of 0. Pure."""
    if len(points) < 2 or not points[0][1]:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / var
    return slope * WEEK_S / points[0][1]


def dir_sizes(data_dir: Path) -> dict[str, int]:
    """Bytes on disk per topic of a broker's data directory (``<topic>-<partition>`` directories): blocks used, not
    the files' lengths (a segment's index files are preallocated sparse, 10 MiB each)."""
    out: Counter = Counter()
    if not data_dir.is_dir():
        return {}
    for d in data_dir.iterdir():
        if not d.is_dir() or "-" not in d.name:
            continue
        topic = d.name.rsplit("-", 1)[0]
        for f in d.iterdir():
            try:
                out[topic] += f.stat().st_blocks * 512
            except FileNotFoundError:
                continue
    return dict(out)


def rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    return None


class Soak:
    def __init__(self, env, opts: Options, say: Callable[[str], None]):
        self.env, self.cfg, self.opts, self.say = env, env.cfg, opts, say
        self.registry = SchemaRegistry.from_dir()
        self.producer = EventProducer(self.cfg, self.registry, PRODUCER)
        self.work = Work(random.Random(opts.seed), [f"soak-e{i}" for i in range(opts.entitlements)])
        self.machines: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.t0 = 0.0
        self.probes = 0
        self._held: dict[bytes, bool] = {}  # the scheduler's jobs table as its changelog says: key -> held
        self._changelog = None

    # -- clocks ----------------------------------------------------------------------------------------------
    def sim(self) -> float:
        """Simulated seconds since the churn began."""
        return (time.monotonic() - self.t0) * self.opts.time_scale

    # -- the workload ----------------------------------------------------------------------------------------
    def send(self, type_: str, payload: dict, entitlement: str, entity: str) -> None:
        self.producer.send(new_event(type_, payload, entitlement=entitlement, entity_id=entity, producer=PRODUCER))

    def spec(self, name: str, ent: str, tasks: int, version: int) -> dict:
        payload = validate_spec({**SPEC, "env": {"VERSION": str(version)}, "name": name, "entitlement": ent,
                                 "tasks": tasks})
        payload.pop("entitlement")
        return {**payload, "spec_version": version}

    def submit(self) -> None:
        w = self.work
        w.serial += 1
        ent = w.rng.choice(w.entitlements)
        tasks = w.rng.randint(1, self.opts.max_tasks)
        payload = self.spec(f"j{w.serial:07d}", ent, tasks, 1)
        self.send("JobSubmitted", payload, ent, payload["job_id"])
        w.live[payload["job_id"]] = (ent, tasks, 1)
        w.counts["submitted"] += 1
        while len(w.live) > self.opts.live_jobs:
            job = next(iter(w.live))
            ent, _, _ = w.live.pop(job)
            self.send("JobStopped", {"job_id": job, "reason": "soak"}, ent, job)
            w.counts["stopped"] += 1

    def resize(self) -> None:
        w = self.work
        if not w.live:
            return
        job = w.rng.choice(sorted(w.live))
        ent, tasks, version = w.live[job]
        new = w.rng.choice([n for n in range(1, self.opts.max_tasks + 1) if n != tasks] or [tasks])
        self.send("JobResized", {"job_id": job, "tasks": new}, ent, job)
        w.live[job] = (ent, new, version)
        w.counts["resized"] += 1

    def update(self) -> None:
        w = self.work
        if not w.live:
            return
        job = w.rng.choice(sorted(w.live))
        ent, tasks, version = w.live[job]
        payload = self.spec(job.split(".", 1)[1], ent, tasks, version + 1)
        self.send("JobSpecChanged", payload, ent, job)
        w.live[job] = (ent, tasks, version + 1)
        w.counts["updated"] += 1

    def fail_machine(self, now: float) -> None:
        from processors.resourcebroker.processor import fail_machine  # noqa: PLC0415 - start-up cost: processors.resourcebroker.processor (~16 ms over what `ropewalk bench|experiment` load), only for a run

        w = self.work
        up = [m for m in self.machines if m not in w.failed]
        if len(w.failed) >= 2 or not up:
            return
        m = w.rng.choice(up)
        if fail_machine(self.cfg, m, registry=self.registry):
            w.failed[m] = now + self.opts.recover_after_s
            w.counts["machines_failed"] += 1

    def recover_due(self, now: float, *, all_: bool = False) -> None:
        from processors.resourcebroker.processor import recover_machine  # noqa: PLC0415 - start-up cost: processors.resourcebroker.processor (~16 ms over what `ropewalk bench|experiment` load), only for a run

        for m, at in list(self.work.failed.items()):
            if all_ or at <= now:
                try:
                    recover_machine(self.cfg, m, registry=self.registry)
                    self.work.counts["machines_recovered"] += 1
                except IllegalStatusTransition:  # the health check's now: left to it
                    self.work.counts["recoveries_refused"] += 1
                del self.work.failed[m]

    def maintain(self, now: float) -> None:
        """An MSB under maintenance for ``maintenance_s`` (simulated), starting now."""
        msbs = sorted({"/".join(m.split("-")[:2]) for m in self.machines})
        if not msbs:
            return
        msb = self.work.rng.choice(msbs)
        wall = int(time.time() * 1000)
        duration_ms = max(1000, int(self.opts.maintenance_s / self.opts.time_scale * 1000))
        try:
            events = ops.plan_maintenance(self.cfg, self.registry, Plan(start_ms=wall, duration_ms=duration_ms,
                                                                        msb=msb, reason="soak"), wall)
        except PlanError as exc:
            self.say(f"maintenance of {msb} not planned: {exc}")
            return
        self.work.maintenance.append((events[0].payload["unavailability_id"], now + self.opts.maintenance_s))
        self.work.counts["maintenances"] += 1

    def end_maintenance_due(self, now: float, *, all_: bool = False) -> None:
        left = []
        for ue, end in self.work.maintenance:
            if all_ or end <= now:
                try:
                    ops.end_maintenance(self.cfg, self.registry, ue, int(time.time() * 1000))
                except PlanError:  # ended already (its window passed)
                    pass
            else:
                left.append((ue, end))
        self.work.maintenance = left

    # -- what is measured ------------------------------------------------------------------------------------
    def processes(self) -> dict[str, int | None]:
        pids = {n: s["pid"] for n, s in supervisor.programs_state(self.cfg.run_dir).items()}
        pids["broker"] = self.env.pids.get("broker")
        return pids

    def sample(self) -> dict[str, Any]:
        from processors.scheduler.shard import APP_ID as SCHEDULER_APP  # noqa: PLC0415 - start-up cost: processors.scheduler.shard (~420 ms: faust's app); `ropewalk bench|experiment` import this module for every command
        from processors.scheduler.shard import SOURCES as SCHEDULER_SOURCES  # noqa: PLC0415 - start-up cost: processors.scheduler.shard (~420 ms: faust's app); `ropewalk bench|experiment` import this module for every command
        from streams import groups  # noqa: PLC0415 - start-up cost: streams.groups (~7 ms over what `ropewalk bench|experiment` load), only for a run

        t = Topics(self.cfg.topic_prefix, self.cfg.partitions)
        sizes = dir_sizes(BrokerLayout.of(self.cfg).data)
        prefix = self.cfg.topic_prefix
        topics = {k[len(prefix):]: v for k, v in sizes.items() if k.startswith(prefix)}
        r = self.env.redis()
        try:
            redis_bytes = int(r.info("memory")["used_memory"])
        finally:
            r.close()
        try:
            lag = groups.lag(self.cfg, prefix + SCHEDULER_APP, [t.name(n) for n in SCHEDULER_SOURCES])
        except Exception:  # noqa: BLE001 - a rebalance under way: not this sample's
            lag = None
        return {"sim_s": round(self.sim()), "day": round(self.sim() / DAY_S, 3),
                "wall_s": round(time.monotonic() - self.t0, 1),
                "rss_kib": {n: rss_kib(pid) for n, pid in sorted(self.processes().items())},
                "redis_bytes": redis_bytes, "disk_bytes": sum(sizes.values()),
                "topics_bytes": dict(sorted(topics.items())),
                "changelog_bytes": sum(v for k, v in topics.items() if k.endswith("-changelog")),
                "scheduler_lag": lag, "submitted": self.work.counts["submitted"], "live": len(self.work.live),
                "jobs_held": self.jobs_held()}

    def jobs_held(self) -> int | None:
        """The jobs the scheduler's table holds now (its changelog read on: the latest record per key not a
        tombstone): what a shard's recovery reads."""
        from processors.scheduler.shard import APP_ID  # noqa: PLC0415 - start-up cost: processors.scheduler.shard (~420 ms: faust's app); `ropewalk bench|experiment` import this module for every command

        if self._changelog is None:
            topic = f"{self.cfg.topic_prefix}{APP_ID}-scheduler-jobs-changelog"
            self._changelog = Consumer({**self.cfg.kafka_conf(), "group.id": f"{PRODUCER}-changelog",
                                        "enable.auto.commit": False, "log_level": 0})
            self._changelog.assign([TopicPartition(topic, p, 0) for p in range(self.cfg.partitions)])
        idle = 0
        while idle < 2:
            msgs = self._changelog.consume(5000, 0.3)
            idle = 0 if msgs else idle + 1
            for m in msgs:
                if m.error() is None:
                    self._held[m.key()] = m.value() is not None
        return sum(self._held.values())

    def probe(self, wait_s: float = 300.0) -> float | None:
        """Seconds until the scheduler answers a new job (its JobStatePublished), or None."""
        self.probes += 1
        t = time.monotonic()
        spec = spec_payload({**SPEC, "name": f"probe{self.probes:04d}", "entitlement": PROBE_ENT, "tasks": 1}, None,
                            self.cfg.max_tasks_per_job)
        doc = Frontend(self.cfg, self.registry).job_submit(spec, wait_s=wait_s)
        took = time.monotonic() - t
        self.send("JobStopped", {"job_id": f"{PROBE_ENT}.probe{self.probes:04d}", "reason": "probe"}, PROBE_ENT,
                  f"{PROBE_ENT}.probe{self.probes:04d}")
        return round(took, 2) if doc.get("verdict") not in (None, "pending") else None

    def recovery(self) -> dict[str, Any]:
        """kill -9 the scheduler shard (the supervisor starts it again); how long until it answers a new job; and
        the latencies of ``at`` and ``replay``."""
        out: dict[str, Any] = {"sim_s": round(self.sim()), "day": round(self.sim() / DAY_S, 3),
                               "jobs_ever": self.work.counts["submitted"]}
        pid = supervisor.programs_state(self.cfg.run_dir).get(KILLED, {}).get("pid")
        if pid:
            os.kill(pid, signal.SIGKILL)
            out["recovery_s"] = self.probe()
        out.update(self.look_latencies())
        return out

    def recovery_logged(self) -> None:
        rec = self.recovery()
        self.recoveries.append(rec)
        self.say(f"day {rec['day']:.2f}: shard recovered in {rec.get('recovery_s')} s; at {rec['at_s']} s, "
                 f"replay {rec['replay_s']} s")

    def look_latencies(self) -> dict[str, Any]:
        from processors.history import moments  # noqa: PLC0415 - start-up cost: processors.history.moments (~390 ms over what `ropewalk bench|experiment` load), only for a run
        from streams import replay as rp  # noqa: PLC0415 - start-up cost: streams.replay (~7 ms over what `ropewalk bench|experiment` load), only for a run

        now = int(time.time() * 1000)
        t = time.monotonic()
        try:
            moments.region_at(self.cfg, self.registry, now - 60_000)
            at_s: float | None = round(time.monotonic() - t, 2)
        except Exception as exc:  # noqa: BLE001 - reported, the soak goes on
            self.say(f"at: {type(exc).__name__}: {exc}")
            at_s = None
        job = next(iter(list(self.work.live)), None)
        t = time.monotonic()
        since = now - int(3600 / self.opts.time_scale * 1000)
        n = sum(1 for _ in rp.replay(self.cfg, self.registry, rp.ReplayFilter(job=job, since_ms=since)))
        return {"at_s": at_s, "replay_s": round(time.monotonic() - t, 2), "replay_matched": n}

    # -- the run ---------------------------------------------------------------------------------------------
    def alter(self, configs: dict[str, dict[str, str]]) -> None:
        """Set these configs (physical topic -> config) on the broker."""
        from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource  # noqa: PLC0415 - start-up cost: confluent_kafka.admin (~6 ms over what `ropewalk bench|experiment` load), only for a run

        if not configs:
            return
        admin = AdminClient({**self.cfg.kafka_conf(), "log_level": 0})
        resources = [ConfigResource(ConfigResource.Type.TOPIC, name, incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in conf.items()])
            for name, conf in configs.items()]
        for fut in admin.incremental_alter_configs(resources).values():
            fut.result(timeout=30)

    def scale_topics(self) -> None:
        t = Topics(self.cfg.topic_prefix, self.cfg.partitions)
        self.alter({t.name(n): conf for n, conf in scaled_topic_configs(self.opts.time_scale).items()})

    def scale_changelogs(self) -> None:
        """faust's changelogs (made by the scheduler at its start, streams/topics.py CHANGELOG_CONFIG) in simulated
        time: segments and tombstones."""
        from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - start-up cost: confluent_kafka.admin (~6 ms over what `ropewalk bench|experiment` load), only for a run

        admin = AdminClient({**self.cfg.kafka_conf(), "log_level": 0})
        names = [n for n in admin.list_topics(timeout=30).topics
                 if n.startswith(self.cfg.topic_prefix) and n.endswith("-changelog")]
        conf = scaled(dict(CHANGELOG_CONFIG), self.opts.time_scale)
        self.alter({n: conf for n in names})

    def run(self) -> dict[str, Any]:  # noqa: C901

        opts, say, w = self.opts, self.say, self.work
        t_start = time.monotonic()
        self.scale_topics()
        region = controlplane.up(self.cfg, opts.machines, ready_timeout_s=300.0,
                                 env={**FAUST_ENV, **scaled_env(opts.time_scale)})
        if not region["ready"]:
            raise RuntimeError(f"soak: the region did not come up: {region}")
        self.machines = sorted(machine_ids(self.cfg))
        self.scale_changelogs()
        for ent, quota in [*((e, opts.quota) for e in w.entitlements), (PROBE_ENT, 2)]:
            self.send("EntitlementCreated", {"name": ent, "quota_machines": quota, "machine_type": None,
                                             "dc_pin": None, "host_profile": None}, ent, ent)
        self.producer.flush(30)
        say(f"region up ({region['machines_indexed']} machines) in {time.monotonic() - t_start:.0f} s; "
            f"{opts.days} simulated days at {opts.time_scale:g}x ({opts.days * DAY_S / opts.time_scale:.0f} s)")
        end = opts.days * DAY_S
        self.t0 = time.monotonic()
        due = {"submit": 0.0, "resize": opts.resize_every_s, "update": opts.update_every_s,
               "fail": opts.fail_every_s, "maintain": opts.maintenance_every_s / 2, "sample": 0.0,
               "recovery": 0.0}
        behind = 0.0
        looking: threading.Thread | None = None
        while (now := self.sim()) < end:
            for kind, every, act in (("submit", opts.job_every_s, self.submit),
                                     ("resize", opts.resize_every_s, self.resize),
                                     ("update", opts.update_every_s, self.update)):
                while due[kind] <= now:
                    act()
                    due[kind] += every
            self.producer.flush(30)
            if due["fail"] <= now:
                self.fail_machine(now)
                due["fail"] += opts.fail_every_s
            self.recover_due(now)
            if due["maintain"] <= now:
                self.maintain(now)
                due["maintain"] += opts.maintenance_every_s
            self.end_maintenance_due(now)
            if due["recovery"] <= now and (looking is None or not looking.is_alive()):
                # beside the churn, which goes on meanwhile (a recovery of seconds is an hour simulated)
                looking = threading.Thread(target=self.recovery_logged, name="soak-recovery", daemon=True)
                looking.start()
                due["recovery"] = max(due["recovery"] + opts.recovery_every_s, now)
            if due["sample"] <= now:
                s = self.sample()
                self.samples.append(s)
                say(f"day {s['day']:.2f}: disk {s['disk_bytes'] / 2**20:.1f} MiB, redis "
                    f"{s['redis_bytes'] / 2**20:.1f} MiB, lag {s['scheduler_lag']}, {s['submitted']} jobs")
                due["sample"] += opts.sample_every_s
            behind = max(behind, self.sim() - now)
            time.sleep(0.02)
        wall = time.monotonic() - self.t0
        if looking is not None:
            looking.join()
        self.recover_due(0.0, all_=True)
        self.end_maintenance_due(0.0, all_=True)
        self.producer.flush(30)
        self.samples.append(self.sample())
        self.recoveries.append(self.recovery())
        self.producer.close()
        if self._changelog is not None:
            self._changelog.close()
        doc = {"conditions": {**{k: v for k, v in asdict(opts).items() if k not in ("keep", "plot")},
                              "cores": cores(), "scaled_env": scaled_env(opts.time_scale),
                              "scaled_topics": scaled_topic_configs(opts.time_scale),
                              "scaled_changelogs": scaled(dict(CHANGELOG_CONFIG), opts.time_scale)},
               "wall_s": round(wall, 1), "simulated_days": round(self.sim() / DAY_S, 3),
               "loop_behind_sim_s": round(behind),  # the longest turn of the churn's loop, simulated
               "workload": dict(w.counts), "jobs_per_sim_day": round(w.counts["submitted"] / max(opts.days, 1e-9)),
               "samples": self.samples, "recoveries": self.recoveries}
        doc["goals"] = goals(doc)
        return doc


def goals(doc: dict) -> dict[str, Any]:
    """The issue's goals, judged on the samples (see the module doc)."""
    samples = [s for s in doc["samples"] if s["day"] >= 1.0] or doc["samples"][-2:]
    warm = bool(samples) and samples[0]["day"] >= 1.0
    rss: dict[str, float | None] = {}
    names = sorted({n for s in samples for n in s["rss_kib"]})
    kills = [r["sim_s"] for r in doc["recoveries"]]  # when each recovery began (simulated)
    for n in names:
        points = [(s["sim_s"], s["rss_kib"][n]) for s in samples if s["rss_kib"].get(n)]
        if n == KILLED:  # started again at every recovery: its peak of each stretch between two kills
            stretches: dict[int, tuple[float, float]] = {}
            for x, y in points:
                k = sum(1 for at in kills if at <= x)
                stretches[k] = max(stretches.get(k, (x, y)), (x, y), key=lambda p: p[1])
            points = sorted(stretches.values())
        g = growth_per_week(points)
        rss[n] = None if g is None else round(g, 4)
    redis = growth_per_week([(s["sim_s"], s["redis_bytes"]) for s in samples])
    kept = {}
    first, last = samples[0], doc["samples"][-1]  # after the warm-up day: a time-bounded topic is full by then
    days = max(last["sim_s"] - first["sim_s"], 1) / DAY_S
    for topic in sorted(set(last["topics_bytes"]) | set(first["topics_bytes"])):
        grew = last["topics_bytes"].get(topic, 0) - first["topics_bytes"].get(topic, 0)
        kept[topic] = round(grew / days)
    recs = [r for r in doc["recoveries"] if r.get("recovery_s") is not None]
    flat = [n for n, g in rss.items() if g is not None and g > GROWTH_GOAL]
    return {"after_warm_up_day": warm, "rss_growth_per_week": rss,
            "redis_growth_per_week": None if redis is None else round(redis, 4),
            "rss_flat": not flat, "rss_growing": flat,
            "redis_flat": redis is not None and redis <= GROWTH_GOAL,
            "topic_growth_bytes_per_sim_day": kept,
            "recovery_first_last_s": [recs[0]["recovery_s"], recs[-1]["recovery_s"]] if recs else None,
            "recovery_jobs_ever_first_last": [recs[0]["jobs_ever"], recs[-1]["jobs_ever"]] if recs else None}


def format_text(doc: dict) -> str:
    c, g = doc["conditions"], doc["goals"]
    lines = [f"soak: {doc['simulated_days']} simulated days at {c['time_scale']:g}x in {doc['wall_s']} s; "
             f"{c['machines']} machines, {c['partitions']} partitions, {c['cores']} cores; a job every "
             f"{c['job_every_s']:g} s simulated ({doc['jobs_per_sim_day']} a simulated day), {c['live_jobs']} live",
             f"  workload {doc['workload']}",
             "   day  wall_s   disk MiB  changelogs MiB  redis MiB  sched lag   jobs   held  " + "  ".join(
                 f"{n[:10]:>10}" for n in sorted(doc["samples"][0]["rss_kib"])) + "   (RSS MiB)"]
    for s in doc["samples"]:
        lines.append(f"{s['day']:6.2f} {s['wall_s']:7.0f} {s['disk_bytes'] / 2**20:10.1f} "
                     f"{s['changelog_bytes'] / 2**20:15.2f} {s['redis_bytes'] / 2**20:10.2f} "
                     f"{s['scheduler_lag'] if s['scheduler_lag'] is not None else '-':>10} {s['submitted']:6d} "
                     f"{s['jobs_held'] if s['jobs_held'] is not None else '-':>6}  "
                     + "  ".join(f"{(v or 0) / 1024:10.1f}" for _, v in sorted(s["rss_kib"].items())))
    lines.append("   day  jobs ever  shard recovery s   at s  replay s")
    for r in doc["recoveries"]:
        lines.append(f"{r['day']:6.2f} {r['jobs_ever']:10d} {r.get('recovery_s')!s:>17} {r['at_s']!s:>6} "
                     f"{r['replay_s']:9.2f}")
    lines += [f"  RSS growth per simulated week after day 1: {g['rss_growth_per_week']} "
              f"(flat: {g['rss_flat']}{'; growing: ' + ', '.join(g['rss_growing']) if g['rss_growing'] else ''})",
              f"  Redis growth per simulated week: {g['redis_growth_per_week']} (flat: {g['redis_flat']})",
              f"  topics' growth per simulated day (bytes): {g['topic_growth_bytes_per_sim_day']}",
              f"  shard recovery first/last: {g['recovery_first_last_s']} s at "
              f"{g['recovery_jobs_ever_first_last']} jobs ever; warmed up: {g['after_warm_up_day']}"]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - optional dependency: matplotlib (the plot extra) only for the PNG; the rest works without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional dependency: matplotlib (the plot extra) only for the PNG; the rest works without it

    s = doc["samples"]
    days = [x["day"] for x in s]
    fig, ax = plt.subplots(2, 2, figsize=(13, 8))
    for n in sorted(s[0]["rss_kib"]):
        ax[0][0].plot(days, [(x["rss_kib"].get(n) or float("nan")) / 1024 for x in s], label=n)  # gap: restarting
    ax[0][0].set_title("RSS per process (MiB)")
    ax[0][0].legend(fontsize=7, ncol=2)
    ax[0][1].plot(days, [x["disk_bytes"] / 2**20 for x in s], label="broker disk")
    ax[0][1].plot(days, [x["changelog_bytes"] / 2**20 for x in s], label="changelogs")
    ax[0][1].plot(days, [x["redis_bytes"] / 2**20 for x in s], label="Redis used_memory")
    ax[0][1].set_title("disk and Redis (MiB)")
    ax[0][1].legend(fontsize=8)
    tops = sorted(s[-1]["topics_bytes"], key=lambda k: -s[-1]["topics_bytes"][k])[:8]
    for k in tops:
        ax[1][0].plot(days, [x["topics_bytes"].get(k, 0) / 2**20 for x in s], label=k)
    ax[1][0].set_title("the largest topics on disk (MiB)")
    ax[1][0].legend(fontsize=7)
    r = doc["recoveries"]
    rd = [x["day"] for x in r]
    ax[1][1].plot(rd, [x.get("recovery_s") or 0 for x in r], "o-", label="shard recovery (s)")
    ax[1][1].plot(rd, [x["at_s"] or 0 for x in r], "s-", label="ropewalk at (s)")
    ax[1][1].plot(rd, [x["replay_s"] for x in r], "^-", label="replay, one job, last hour (s)")
    ax[1][1].set_title("recovery and look latencies; jobs (right axis)")
    ax[1][1].legend(fontsize=8, loc="upper left")
    jobs = ax[1][1].twinx()
    jobs.plot(days, [x["submitted"] for x in s], ":", color="gray", label="jobs ever submitted")
    jobs.plot(days, [x.get("jobs_held") or 0 for x in s], "--", color="black", label="jobs the scheduler holds")
    jobs.legend(fontsize=8, loc="lower right")
    for a in ax.flat:
        a.set_xlabel("simulated day")
    c = doc["conditions"]
    fig.suptitle(f"soak: {doc['simulated_days']} simulated days at {c['time_scale']:g}x, {c['machines']} machines, "
                 f"a job every {c['job_every_s']:g} s simulated")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(opts: Options, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    t0 = time.monotonic()
    with sigterm_as_interrupt(), BenchEnv(opts.partitions, keep=opts.keep) as env:
        doc = Soak(env, opts, say).run()
        doc["run_dir"] = str(env.run_dir) if opts.keep else None
    doc["seconds"] = round(time.monotonic() - t0, 1)
    if opts.plot:
        plot(doc, Path(opts.plot))
        doc["plot"] = opts.plot
    return doc


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = Options()
    ap.add_argument("--days", type=float, default=d.days, help=f"simulated days (default {d.days:g})")
    ap.add_argument("--time-scale", type=float, default=d.time_scale,
                    help=f"simulated seconds per second (default {d.time_scale:g})")
    ap.add_argument("--machines", type=int, default=d.machines)
    ap.add_argument("--job-every-s", type=float, default=d.job_every_s, help="a job every so many simulated seconds")
    ap.add_argument("--live-jobs", type=int, default=d.live_jobs, help="live jobs at most (the oldest is stopped)")
    ap.add_argument("--resize-every-s", type=float, default=d.resize_every_s)
    ap.add_argument("--update-every-s", type=float, default=d.update_every_s)
    ap.add_argument("--sample-every-s", type=float, default=d.sample_every_s, help="simulated seconds")
    ap.add_argument("--recovery-every-s", type=float, default=d.recovery_every_s, help="simulated seconds")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--plot", metavar="FILE.png", help="write the plot there")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (every process's log)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")


def run_cli(args) -> int:
    if args.days <= 0 or args.time_scale <= 0 or args.job_every_s <= 0:
        raise SystemExit("soak: --days, --time-scale and --job-every-s must be > 0")
    opts = Options(days=args.days, time_scale=args.time_scale, machines=args.machines, job_every_s=args.job_every_s,
                   live_jobs=args.live_jobs, resize_every_s=args.resize_every_s, update_every_s=args.update_every_s,
                   sample_every_s=args.sample_every_s, recovery_every_s=args.recovery_every_s, seed=args.seed,
                   keep=args.keep, plot=args.plot)
    doc = run(opts, say=lambda s: print(f"soak: {s}", file=sys.stderr, flush=True))
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else format_text(doc))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/experiments/soak.py", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
