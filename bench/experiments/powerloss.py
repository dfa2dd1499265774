"""A DC loses its power and gets it back (issue 26, item 2b): how long until its tasks are stopped, and until every
one runs again, on a region of its own.

    ropewalk experiment powerloss [--machines 1000] [--dark-s 10] [--tasks-per-job 500] [--json]

Everything real: an embedded broker and Redis on free ports, a temporary run directory and topic prefix
(``bench.env.BenchEnv``), the Resource Broker registering a generated region of two DCs, the allocator, a scheduler
shard, the Health Check Service and the simulated agents (one process; per DC above 100,000 machines). The workload:
one task per machine of ``dc1`` (1 core, 1 GiB), in jobs of ``--tasks-per-job`` pinned to ``dc1``, so no task can
run elsewhere while it is dark: every task must restart when the power is back.

1. ``power_lost(dc:dc1)`` as ``ropewalk machine power-loss --dc dc1`` produces it (one MachinesStatusChanged →DOWN
   and one UnavailabilityStarted POWER per owner): measured from those events' time until every task is out of
   service discovery (the scheduler took them down: FAILED, fenced) — **power loss → tasks stopped**; the simulated
   agents of dc1 go dark.
2. ``--dark-s`` later, ``power_restored(dc:dc1)``: measured from its events' time until every task is RUNNING
   again on a dc1 machine (its agent's report) — **power back → every task RUNNING** (p50, p99, all), and the
   restarts per second over that time (peak, by 10 s window): they are paced by the scheduler's shard limiter
   (a restart re-asked by the timer takes a token, as its move did, and a move not yet performed a job token too;
   ``--shard-per-minute``, ``--shard-burst``, ``--job-per-minute``, ``--job-burst``: ``ROPEWALK_LIMIT_*``), so the
   floor is about ``(tasks - burst) / rate`` of the binding bucket (``pacing_floor_s``) plus the timer's period (10 s).
3. Checks: every task RUNNING on dc1 at the end, the health check failed none of the dark machines (their absence
   was announced, not a silence) and announced no zone disruption; the broker's raw produce rate is measured in the
   same run (the baseline every figure of bench/ is printed beside).

Times are log times (the producers' clocks: one machine), as in ``bench/observe.py``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import workloads  # noqa: E402
from bench.env import BenchEnv, cores, sigterm_as_interrupt  # noqa: E402
from bench.observe import LogObserver  # noqa: E402
from bench.workloads import percentile  # noqa: E402
from processors.resourcebroker.region import iter_machines, load_region  # noqa: E402
from processors.taskcontrol.limiter import Limits  # noqa: E402
from streams.batches import machine_statuses  # noqa: E402
from streams.partitionmap import routed_producer  # noqa: E402
from streams.serde import SchemaRegistry  # noqa: E402

DC = "dc1"
ENTITLEMENT = "power-e1"
RESOURCES = {"cpu_millicores": 1000, "memory_mib": 1024}


@dataclass
class Options:
    machines: int = 1000
    dark_s: float = 10.0  # how long the power stays off
    tasks_per_job: int = 500
    partitions: int = 8
    shard_per_minute: int | None = None  # the scheduler's shard limiter (None: its default, limiter.Limits)
    shard_burst: int | None = None
    job_per_minute: int | None = None  # the scheduler's job limiter (None: its default)
    job_burst: int | None = None
    timeout_s: float = 3600.0  # per phase
    keep: bool = False
    notes: list[str] = field(default_factory=list)


def limits(opts: Options):
    return Limits.from_env(scheduler_env(opts))


def scheduler_env(opts: Options) -> dict[str, str]:
    given = {"ROPEWALK_LIMIT_SHARD_PER_MINUTE": opts.shard_per_minute, "ROPEWALK_LIMIT_SHARD_BURST": opts.shard_burst,
             "ROPEWALK_LIMIT_JOB_PER_MINUTE": opts.job_per_minute, "ROPEWALK_LIMIT_JOB_BURST": opts.job_burst}
    return {k: str(v) for k, v in given.items() if v is not None}


def run(opts: Options, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    t0 = time.monotonic()
    with sigterm_as_interrupt(), BenchEnv(opts.partitions, keep=opts.keep) as env:
        registry = SchemaRegistry.from_dir()
        say(f"starting a region of {opts.machines} machines")
        region = env.start_region(opts.machines, timeout_s=max(300.0, opts.machines / 50), env=scheduler_env(opts))
        obs = LogObserver(env.cfg, registry)
        try:
            doc = Experiment(env, registry, obs, opts, say).run()
        finally:
            obs.close()
        doc["conditions"] = {"machines": opts.machines, "dcs": 2, "dark_dc": DC, "dark_s": opts.dark_s,
                             "tasks_per_job": opts.tasks_per_job, "partitions": opts.partitions, "cores": cores(),
                             "region_up_s": round(region["seconds"], 1),
                             "shard_limit": limits(opts).shard.describe(), "job_limit": limits(opts).job.describe()}
        say("measuring the broker's raw rate (the baseline)")

        raw = workloads.raw_rates(env.cfg, 20_000, 300, repeat=1)
        doc["raw_produce_per_s"] = raw["produce_per_s"]
        doc["run_dir"] = str(env.run_dir) if opts.keep else None
    doc["seconds"] = round(time.monotonic() - t0, 1)
    doc["notes"] = opts.notes
    return doc


class Experiment:
    def __init__(self, env, registry, obs, opts: Options, say):
        self.env, self.cfg, self.registry, self.obs, self.opts, self.say = env, env.cfg, registry, obs, opts, say

    def dc_machines(self) -> list[str]:
        return [m.id for m in iter_machines(load_region(self.cfg.run_dir / "region.yaml")) if m.dc == DC]

    def submit(self, n_tasks: int) -> dict[str, int]:
        workloads.create_entitlements(self.cfg, self.registry, [ENTITLEMENT], n_tasks)
        producer = routed_producer(self.cfg, self.registry, workloads.PRODUCER)  # by the partition map
        jobs: dict[str, int] = {}
        left, i = n_tasks, 0
        while left > 0:
            n = min(left, self.opts.tasks_per_job)
            job, _ = workloads.submit(producer, {
                "name": f"pl{i:04d}", "entitlement": ENTITLEMENT, "tasks": n, "command": ["sleep", "3600"],
                "resources": RESOURCES, "requirements": {"dc": DC}, "spread": "msb"})
            self.obs.expect(job, n)
            jobs[job] = n
            left, i = left - n, i + 1
        producer.flush(60)
        return jobs

    def power(self, action: str) -> int:
        """The power event as `ropewalk machine power-loss|power-restore --dc dc1` produces it; its log time."""
        from processors.resourcebroker.processor import power_event  # noqa: PLC0415 - start-up cost: processors.resourcebroker.processor (~16 ms over what `ropewalk bench|experiment` load), only for a run

        events = power_event(self.cfg, action, [f"dc:{DC}"], registry=self.registry)
        if not events:
            raise RuntimeError(f"power {action} of {DC}: nothing to do")
        return min(e.timestamp_ms for e in events)

    def run(self) -> dict[str, Any]:
        obs, opts, say = self.obs, self.opts, self.say
        dc = set(self.dc_machines())
        jobs = self.submit(len(dc))
        tasks = {f"{j}/{i}" for j, n in jobs.items() for i in range(n)}
        say(f"{len(tasks)} tasks in {len(jobs)} jobs pinned to {DC} ({len(dc)} machines); waiting for them to run")
        t = time.monotonic()
        if not obs.wait(lambda: all(obs.discovered.get(x, ("",))[0] in dc for x in tasks), opts.timeout_s):
            raise RuntimeError(f"powerloss: only {sum(x in obs.discovered for x in tasks)} of {len(tasks)} tasks "
                               f"running in {opts.timeout_s:.0f} s")
        deploy_s = time.monotonic() - t

        say(f"power loss of {DC}")
        lost_ts = self.power("loss")
        stopped = obs.wait(lambda: not any(x in obs.discovered for x in tasks), opts.timeout_s)
        stop_ms = (max(obs.undiscovered_ms[x] for x in tasks) - lost_ts) if stopped else None
        dark_until = time.monotonic() + opts.dark_s
        while time.monotonic() < dark_until:
            obs.poll()

        say(f"power back in {DC} after {opts.dark_s:g} s")
        back_ts = self.power("restore")

        def back(x: str) -> bool:
            run = obs.running.get(x)
            return run is not None and run[1] >= back_ts and run[0] in dc

        restarted = obs.wait(lambda: all(back(x) for x in tasks), opts.timeout_s)
        lat = sorted(obs.running[x][1] - back_ts for x in tasks if back(x))
        per_s = Counter(int(ms // 1000) for ms in lat)
        windows = Counter(int(ms // 10_000) for ms in lat)
        floor_s = pacing_floor_s(limits(opts), len(tasks), jobs.values())
        checks = self.checks(dc, lost_ts)
        doc: dict[str, Any] = {
            "tasks": len(tasks), "jobs": len(jobs), "deploy_s": round(deploy_s, 1),
            "loss_to_all_stopped_ms": stop_ms, "all_stopped": stopped,
            "back_to_all_running_ms": lat[-1] if restarted and lat else None, "all_running": restarted,
            "restart_p50_ms": percentile(lat, 50), "restart_p99_ms": percentile(lat, 99),
            "restarted": len(lat), "peak_restarts_per_s": max(per_s.values(), default=0),
            "restarts_by_10s": [windows.get(i, 0) for i in range(max(windows, default=-1) + 1)],
            "pacing_floor_s": round(floor_s, 1), **checks}
        doc["passed"] = bool(stopped and restarted and not checks["dark_machines_judged"]
                             and not checks["zone_disruptions"] and checks["running_outside_dc"] == 0)
        return doc

    def checks(self, dc: set[str], since_ms: int) -> dict[str, Any]:
        """The health check's verdicts on the dark machines since the power loss (there should be none) and where
        the tasks run at the end."""
        from streams.replay import Replay, ReplayFilter  # noqa: PLC0415 - start-up cost: streams.replay (~7 ms over what `ropewalk bench|experiment` load), only for a run

        judged, zones = set(), 0
        for rec in Replay(self.cfg, self.registry, ReplayFilter(topics=("machines",), since_ms=since_ms)):
            ev = rec.event
            if ev.type == "ZoneDisruptionChanged":
                zones += 1
            for m in machine_statuses(ev):
                if m["reason"] == "heartbeat_missed" and m["machine_id"] in dc:
                    judged.add(m["machine_id"])
        outside = sum(1 for m, _ in self.obs.running.values() if m not in dc)
        return {"dark_machines_judged": len(judged), "zone_disruptions": zones, "running_outside_dc": outside}


def pacing_floor_s(lim, tasks: int, job_sizes) -> float:
    """The least time the limiter lets ``tasks`` restart in: a restart re-asked by the scheduler's timer (every
    ``RETRY_S``) takes a shard token, and the bucket holds at most ``burst``, so restarts come at most at
    min(rate, burst / RETRY_S) after the first burst; a move still waiting takes a job token too."""
    from processors.scheduler.shard import RETRY_S  # noqa: PLC0415 - start-up cost: processors.scheduler.shard (~420 ms: faust's app); `ropewalk bench|experiment` import this module for every command

    def floor(rate, n: int) -> float:
        per_s = min(rate.per_minute / 60, rate.burst / RETRY_S)
        return max(0.0, (n - rate.burst) / per_s)

    return max(floor(lim.shard, tasks), max((floor(lim.job, n) for n in job_sizes), default=0.0))


def format_text(doc: dict) -> str:
    c = doc["conditions"]
    ms = lambda v: "-" if v is None else f"{v / 1000:.1f} s"  # noqa: E731
    return "\n".join([
        f"power loss of {c['dark_dc']} for {c['dark_s']:g} s: {c['machines']} machines in {c['dcs']} DCs, "
        f"{doc['tasks']} tasks in {doc['jobs']} jobs pinned to {c['dark_dc']}; {c['partitions']} partitions, "
        f"{c['cores']} cores; shard limiter {c['shard_limit']}, job limiter {c['job_limit']}",
        f"  power loss -> every task stopped     {ms(doc['loss_to_all_stopped_ms'])}",
        f"  power back -> every task RUNNING     {ms(doc['back_to_all_running_ms'])}  (p50 {ms(doc['restart_p50_ms'])}, "
        f"p99 {ms(doc['restart_p99_ms'])}; pacing floor {doc['pacing_floor_s']} s)",
        f"  restarts: peak {doc['peak_restarts_per_s']}/s; per 10 s {doc['restarts_by_10s']}",
        f"  dark machines the health check judged {doc['dark_machines_judged']}, zone disruptions "
        f"{doc['zone_disruptions']}, tasks running outside {c['dark_dc']} {doc['running_outside_dc']}",
        f"  baseline: raw produce {doc['raw_produce_per_s']}/s; region up in {c['region_up_s']} s, deployed in "
        f"{doc['deploy_s']} s",
        f"  passed {doc['passed']}  ({doc['seconds']} s in all)" + (f"; notes: {doc['notes']}" if doc["notes"] else "")])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = Options()
    ap.add_argument("--machines", type=int, default=d.machines, help=f"machines of the region (default {d.machines})")
    ap.add_argument("--dark-s", type=float, default=d.dark_s, help="seconds the power stays off")
    ap.add_argument("--tasks-per-job", type=int, default=d.tasks_per_job)
    ap.add_argument("--shard-per-minute", type=int, help="the scheduler's shard limiter: operations per minute")
    ap.add_argument("--shard-burst", type=int, help="the scheduler's shard limiter: burst")
    ap.add_argument("--job-per-minute", type=int, help="the scheduler's job limiter: operations per minute")
    ap.add_argument("--job-burst", type=int, help="the scheduler's job limiter: burst")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (every process's log)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")


def run_cli(args) -> int:
    if args.machines < 4:
        raise SystemExit("ropewalk experiment powerloss: --machines: at least 4")
    opts = Options(machines=args.machines, dark_s=args.dark_s, tasks_per_job=args.tasks_per_job,
                   shard_per_minute=args.shard_per_minute, shard_burst=args.shard_burst,
                   job_per_minute=args.job_per_minute, job_burst=args.job_burst, keep=args.keep)
    doc = run(opts, say=lambda s: print(f"powerloss: {s}", file=sys.stderr, flush=True))
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else format_text(doc))
    return 0 if doc["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/experiments/powerloss.py", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
