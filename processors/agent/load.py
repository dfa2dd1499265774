"""A load signal per job for the simulated region: a daily trace, compressed in time. Pure.

    trace = DailyTrace.parse("0:100,4:60,16:140,24:100", noise=0.02, seed=1)   # hour:load knots
    clock = TraceClock(wall_start_ms, trace_start_ms, speed=2880)              # 1 wall second = 48 trace minutes
    trace.load(clock.trace_ms(now_ms))

The load between two knots follows half a cosine (smooth: no corner for the autoscaler to chase), the day repeats,
and ``noise`` adds a deterministic jitter of up to that fraction (a hash of the seed and the sample's time: the same
sample is the same load in every run). The simulated agents (``simulated.py --load JOB=SPEC``) emit one
``JobLoadReported`` per job every interval, with the trace's time as ``at_ms`` and the tasks of the job they run.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from streams.events import Event, derived_event_id, new_event

HOUR_MS = 3600_000
DAY_MS = 24 * HOUR_MS
DEFAULT_KNOTS = "0:100,4:60,16:140,24:100"


class LoadSpecError(ValueError):
    pass


@dataclass(frozen=True)
class DailyTrace:
    knots: tuple[tuple[float, float], ...]  # (hour of the day, load), hours ascending from 0 to 24
    noise: float = 0.0
    seed: int = 0

    @classmethod
    def parse(cls, text: str, noise: float = 0.0, seed: int = 0) -> "DailyTrace":
        try:
            knots = tuple((float(h), float(v)) for h, v in (k.split(":") for k in text.split(",")))
        except ValueError:
            raise LoadSpecError(f"load trace {text!r}: expected hour:load pairs, e.g. {DEFAULT_KNOTS}") from None
        hours = [h for h, _ in knots]
        if len(knots) < 2 or hours != sorted(set(hours)) or hours[0] != 0 or hours[-1] != 24:
            raise LoadSpecError(f"load trace {text!r}: hours must ascend from 0 to 24")
        if any(v < 0 for _, v in knots) or not 0 <= noise < 1:
            raise LoadSpecError(f"load trace {text!r}: loads must be >= 0 and noise in [0, 1)")
        return cls(knots, noise, seed)

    def load(self, at_ms: int) -> float:
        hour = (at_ms % DAY_MS) / HOUR_MS
        for (h0, v0), (h1, v1) in zip(self.knots, self.knots[1:]):
            if h0 <= hour <= h1:
                x = (hour - h0) / (h1 - h0)
                base = v0 + (v1 - v0) * (1 - math.cos(math.pi * x)) / 2
                break
        if not self.noise:
            return base
        jitter = zlib.crc32(f"{self.seed}/{at_ms // 60_000}".encode()) / 0xFFFFFFFF * 2 - 1
        return base * (1 + self.noise * jitter)


@dataclass(frozen=True)
class TraceClock:
    """Wall time -> trace time: the trace starts at ``trace_start_ms`` when the wall is at ``wall_start_ms`` and runs
    ``speed`` times faster."""

    wall_start_ms: int
    trace_start_ms: int
    speed: float = 1.0

    def trace_ms(self, wall_ms: int) -> int:
        return self.trace_start_ms + int((wall_ms - self.wall_start_ms) * self.speed)


@dataclass(frozen=True)
class JobLoad:
    """One job's signal: which job, its trace, the clock (``simulated.py --load JOB=SPEC``)."""

    job_id: str
    trace: DailyTrace
    clock: TraceClock

    @property
    def entitlement(self) -> str:
        return self.job_id.split(".", 1)[0]  # job ids are <entitlement>.<name>

    def sample(self, wall_ms: int, running_tasks: int, producer: str) -> Event:
        at = self.clock.trace_ms(wall_ms)
        return new_event("JobLoadReported", {"job_id": self.job_id, "at_ms": at, "load": self.trace.load(at),
                                             "running_tasks": running_tasks, "unit": "load"},
                         entitlement=self.entitlement, entity_id=self.job_id, producer=producer,
                         timestamp_ms=wall_ms, event_id=derived_event_id(producer, "load", self.job_id, at))


def parse_job_load(spec: str, wall_start_ms: int) -> JobLoad:
    """``JOB=knots=H:L,...;speed=S;start_hour=H;noise=F;seed=N`` (every part but the job optional):
    e.g. ``e1.web=speed=2880;noise=0.02``."""
    job, sep, rest = spec.partition("=")
    if not sep or "." not in job:
        raise LoadSpecError(f"--load {spec!r}: expected JOB=OPTIONS (a job id <entitlement>.<name>)")
    opts = {"knots": DEFAULT_KNOTS, "speed": "1", "start_hour": "0", "noise": "0", "seed": "0"}
    for part in filter(None, rest.split(";")):
        k, sep, v = part.partition("=")
        if not sep or k not in opts:
            raise LoadSpecError(f"--load {spec!r}: unknown option {part!r} (knots, speed, start_hour, noise, seed)")
        opts[k] = v
    try:
        trace = DailyTrace.parse(opts["knots"], float(opts["noise"]), int(opts["seed"]))
        clock = TraceClock(wall_start_ms, int(float(opts["start_hour"]) * HOUR_MS), float(opts["speed"]))
    except ValueError as exc:
        raise LoadSpecError(f"--load {spec!r}: {exc}") from None
    if clock.speed <= 0:
        raise LoadSpecError(f"--load {spec!r}: speed must be positive")
    return JobLoad(job, trace, clock)
