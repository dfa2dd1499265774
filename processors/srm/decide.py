"""The Service Resource Manager's decisions (Twine §2.7, §5.2): load signals in, sizing intents out. Pure.

No Kafka, no clock: time is the load samples' own (``JobLoadReported.at_ms``; a replayed trace may run faster than
the wall), so a day compressed into a minute decides as the day would.

**Inputs.** A person's autoscaling policy for a job (a SizingIntentDeclared from a person with ``autoscale``: min,
max, the load one task serves), the job's reconciled size (JobSpecReconciled.tasks, the Job Control Plane's), the
SRM's own past decisions (its SizingIntentDeclared, read back: facts), a JobStopped, and the job's load samples.
A stopped job keeps only its learned load by time of day (for its next incarnation) for ``Tuning.shape_keep_ms`` (a
week) of log time after its stop; one that never reported load leaves the state at its stop (before, every job ever
stopped stayed: issue #29). As the Job Control Plane's grace (processors/jobcontrol/decide.py), the week is judged by
the log time of the event that names the job (``is_expired``): a shape past it is taken as gone whether or not
``collect`` dropped it yet, so no decision depends on when ``collect`` ran, and a job's events all sit on its
entitlement's partition, so a re-fold decides alike. A new incarnation (its reconciled spec, or a person's policy)
keeps the shape and is live again; a late load sample of the stopped one is learned but does not make it live. A
job no person's policy holds leaves once nothing named it for the same week of log time: a load sample of a job
stopped and collected would otherwise make an entry for ever.

**Forecast** (``forecast``): "historical data and real-time measurements" (§2.7):

    recent      the load smoothed (EWMA, ``alpha``) and projected over the horizon by its smoothed trend (only
                upward: a falling load is sized for where it is, not where it may go)
    historical  the highest load learned for the time of day over the coming horizon (per 15-minute bucket of
                the day, an EWMA over the samples of that bucket, so yesterday's shape tells today's)
    forecast    the higher of the two (and of the latest sample)

    size = clamp(ceil(forecast / load_per_task), min, max)     (a scale-up adds ``up_headroom``: fewer steps)

**The rules, one table (``RULES``), in order; the first that decides wins:**

    no_policy              nobody let the SRM size the job: nothing
    warming_up             fewer than ``min_samples`` samples: nothing
    scale_up               the size is above the current one: up, at once (capacity first)
    hysteresis             the size is within ``down_band`` below the current: hold
    down_cooldown          the last change was less than ``down_cooldown_ms`` ago: hold
    no_reversal_in_hour    the last change was up (or a reversal) less than ``reversal_ms`` ago: hold (so a scale-
                           down never follows a scale-up within the hour, and the forecast's look ahead keeps an
                           up from following a down; at most one reversal an hour)
    scale_down             down to the size: the tasks retired free whole machines when the job runs
                           ``tasks_per_machine`` per machine (``machines_freed``)

Each decision is a SizingIntentDeclared (owner ``srm``, source ``autoscaler``) carrying its inputs and forecast
(``decision``), keyed to the job's entitlement; its id derives from the sample's, so a replay decides alike.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from processors.cowmap import CowMap
from processors.times import expired
from streams.events import Event, derived_event_id, new_event

PRODUCER = "srm"
OWNER = "srm"
UP, DOWN = "up", "down"
BUCKET_MS = 15 * 60_000
BUCKETS = 24 * 3600_000 // BUCKET_MS
CONSUMED = frozenset({"SizingIntentDeclared", "JobSpecReconciled", "JobStopped", "JobLoadReported"})


@dataclass(frozen=True)
class Tuning:
    """How the SRM decides (the same for every job; ``processors/srm/README.md``)."""

    alpha: float = 0.3  # EWMA weight of a new sample
    horizon_ms: int = 3600_000  # how far ahead the forecast looks
    down_band: float = 0.05  # a size less than this far below the current one is held (hysteresis)
    up_headroom: float = 0.05  # a scale-up sizes for this much more than the forecast (fewer, larger steps up)
    down_cooldown_ms: int = 30 * 60_000  # no scale-down sooner than this after a change
    reversal_ms: int = 3600_000  # no scale-down sooner than this after a scale-up (at most one reversal an hour)
    min_samples: int = 3
    tasks_per_machine: int = 1  # tasks of the job a machine holds (whole machines freed per task retired)
    shape_keep_ms: int = 7 * 24 * 3600_000  # a stopped job's learned day is kept this long (log time) for its next
    # incarnation


@dataclass(frozen=True, slots=True)
class Policy:
    min_tasks: int
    max_tasks: int
    load_per_task: float
    event_id: str


@dataclass(frozen=True, slots=True)
class JobScaling:
    job_id: str
    entitlement: str
    policy: Policy | None = None
    current: int | None = None  # the job's size: the latest reconciled one, or the SRM's latest decision
    samples: int = 0
    last_at: int | None = None  # the latest sample's time
    last_load: float = 0.0
    ewma: float = 0.0
    trend: float = 0.0  # load per ms, smoothed
    history: tuple = (None,) * BUCKETS  # learned load per bucket of the day
    changed_at: int | None = None  # the SRM's latest change (sample time) ...
    direction: str | None = None  # ... its direction
    reversal_at: int | None = None  # the latest change against the one before
    decided: str | None = None  # the event id of the SRM's latest decision (SizingIntentDeclared)
    ended_ms: int | None = None  # the log time of its JobStopped, until an incarnation is live again
    heard_ms: int | None = None  # the log time of the latest event that named it (not its JobStopped)


@dataclass(frozen=True)
class SrmState:
    jobs: CowMap[JobScaling] = field(default_factory=CowMap)


# -- the forecast --------------------------------------------------------------------------------------------------

def bucket(at_ms: int) -> int:
    return (at_ms // BUCKET_MS) % BUCKETS


def learn(job: JobScaling, at_ms: int, load: float, tuning: Tuning) -> JobScaling:
    """A sample folded into the job's smoothed load, trend and history."""
    if job.samples == 0 or job.last_at is None:
        ewma, trend = load, 0.0
    else:
        ewma = tuning.alpha * load + (1 - tuning.alpha) * job.ewma
        dt = max(1, at_ms - job.last_at)
        trend = tuning.alpha * (ewma - job.ewma) / dt + (1 - tuning.alpha) * job.trend
    b = bucket(at_ms)
    history = list(job.history)
    history[b] = load if history[b] is None else tuning.alpha * load + (1 - tuning.alpha) * history[b]
    return dataclasses.replace(job, samples=job.samples + 1, last_at=at_ms, last_load=load, ewma=ewma, trend=trend,
                               history=tuple(history))


def forecast(job: JobScaling, at_ms: int, tuning: Tuning) -> dict[str, float]:
    recent = max(job.ewma, job.ewma + job.trend * tuning.horizon_ms)
    ahead = [job.history[bucket(at_ms + k * BUCKET_MS)] for k in range(tuning.horizon_ms // BUCKET_MS + 1)]
    historical = max((v for v in ahead if v is not None), default=0.0)
    return {"recent": recent, "historical": historical, "forecast": max(recent, historical, job.last_load)}


# -- the rules -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    job: JobScaling
    at_ms: int
    want: int
    tuning: Tuning

    @property
    def current(self) -> int:
        """The job's current size, for the rules after ``unknown_size`` (which holds while it is not known)."""
        if self.job.current is None:
            raise AssertionError("unknown_size decides a job of unknown size")
        return self.job.current


@dataclass(frozen=True)
class Rule:
    name: str
    says: str
    decide: Callable[[Case], str | None]  # UP, DOWN, or "hold"; None: not this rule's case


HOLD = "hold"


def _since(at: int | None, now: int) -> float:
    return math.inf if at is None else now - at


RULES: tuple[Rule, ...] = (
    Rule("no_policy", "nobody let the SRM size the job", lambda c: HOLD if c.job.policy is None else None),
    Rule("warming_up", "too few samples to forecast", lambda c: HOLD if c.job.samples < c.tuning.min_samples
         else None),
    Rule("unknown_size", "the job's size is not known yet", lambda c: HOLD if c.job.current is None else None),
    Rule("scale_up", "the size is above the current one: up at once",
         lambda c: UP if c.want > c.current else None),
    Rule("hold_same", "the size is the current one", lambda c: HOLD if c.want == c.current else None),
    Rule("hysteresis", "within down_band below the current size: hold",
         lambda c: HOLD if c.want >= c.current * (1 - c.tuning.down_band) else None),
    Rule("down_cooldown", "the last change was less than down_cooldown_ms ago: hold",
         lambda c: HOLD if _since(c.job.changed_at, c.at_ms) < c.tuning.down_cooldown_ms else None),
    Rule("no_reversal_in_hour", "a scale-up or a reversal less than reversal_ms ago: hold",
         lambda c: HOLD if (c.job.direction == UP and _since(c.job.changed_at, c.at_ms) < c.tuning.reversal_ms)
         or _since(c.job.reversal_at, c.at_ms) < c.tuning.reversal_ms else None),
    Rule("scale_down", "down to the size", lambda c: DOWN),
)


SAYS = {r.name: r.says for r in RULES}


def rules_table() -> list[dict]:
    return [{"rule": r.name, "says": r.says} for r in RULES]


def _rule(case: Case) -> tuple[str, str]:
    for r in RULES:
        if (verdict := r.decide(case)) is not None:
            return r.name, verdict
    raise AssertionError("scale_down always decides")


# -- decisions -----------------------------------------------------------------------------------------------------

def _changed(job: JobScaling, at: int, tasks: int, direction: str, decided: str) -> JobScaling:
    reversal = job.direction is not None and direction != job.direction
    return dataclasses.replace(job, current=tasks, changed_at=at, direction=direction,
                               reversal_at=at if reversal else job.reversal_at, decided=decided)


def _stale_echo(job: JobScaling, p: Mapping[str, Any]) -> bool:
    """A reconciled spec sized by an earlier decision of the SRM than its latest (the Job Control Plane answers
    after the SRM decided again): its size is not the job's any more."""
    srm = [x for x in p.get("provenance") or () if x.get("dimension") == "sizing" and x.get("owner") == OWNER]
    return job.decided is not None and bool(srm) and srm[0].get("intent_event_id") != job.decided


def _on_stopped(state: SrmState, job: JobScaling | None, ev: Event) -> SrmState:
    """A stopped job keeps only its learned load by time of day, for its next incarnation; one that learned nothing
    leaves (its next incarnation starts as a new job would, either way)."""
    if job is None or all(h is None for h in job.history):
        return SrmState(jobs=state.jobs.without([ev.payload["job_id"]]))
    ended = job.ended_ms if job.ended_ms is not None else ev.timestamp_ms  # (a JobStopped read twice: the first)
    return SrmState(jobs=state.jobs.updated({job.job_id: JobScaling(job.job_id, ev.entitlement, history=job.history,
                                                                    ended_ms=ended)}))


def _on_intent(job: JobScaling, ev: Event) -> JobScaling:
    """A reconciled size, a person's policy, or the SRM's own decision read back."""
    p = ev.payload
    if ev.type == "JobSpecReconciled":
        if not _stale_echo(job, p):
            job = dataclasses.replace(job, current=p["tasks"], ended_ms=None)  # (an incarnation: live again)
    elif p.get("source") == "autoscaler" and ev.producer == PRODUCER:  # its own decision, read back
        d = p.get("decision") or {}
        job = _changed(job, d.get("at_ms", 0), p["tasks"], d.get("direction", UP), ev.event_id)
    elif p.get("source") == "person":
        policy = (Policy(p["min_tasks"], p["max_tasks"], p["load_per_task"], ev.event_id)
                  if p.get("autoscale") else None)
        job = dataclasses.replace(job, policy=policy, ended_ms=None)
    return job


def is_expired(job: JobScaling, now_ms: int, tuning: Tuning) -> bool:
    """Whether ``job`` is gone at ``now_ms``, whether or not ``collect`` ran: it stopped ``shape_keep_ms`` or more
    before, or no person's policy holds it and nothing named it for as long (a load sample of a job stopped and
    collected, or stopped before it learned anything, made a new entry that nothing else would ever end: the SRM
    cannot tell it from a job whose reconciled spec is still to come, as ``metrics`` and ``intents`` are not
    ordered)."""
    return (expired(job.ended_ms, now_ms, tuning.shape_keep_ms)
            or (job.policy is None and expired(job.heard_ms, now_ms, tuning.shape_keep_ms)))


def collect(state: SrmState, now_ms: int, tuning: Tuning = Tuning()) -> tuple[SrmState, list[str]]:
    """The state without the stopped jobs whose shape is kept no longer (``is_expired``), and their ids."""
    gone = sorted(j for j, job in state.jobs.items() if is_expired(job, now_ms, tuning))
    return (SrmState(jobs=state.jobs.without(gone)) if gone else state), gone


def decide(state: SrmState, ev: Event, *, live: bool = True, tuning: Tuning = Tuning()
           ) -> tuple[SrmState, list[Event]]:
    """Fold one event; with ``live``, decide on a load sample (a catching-up worker folds without deciding)."""
    if ev.type not in CONSUMED:
        return state, []
    p = ev.payload
    job = state.jobs.get(p["job_id"])
    if job is not None and is_expired(job, ev.timestamp_ms, tuning):
        job = None  # its shape's week is over: as if ``collect`` had dropped it
    if ev.type == "JobStopped":
        return _on_stopped(state, job, ev), []
    job = job or JobScaling(p["job_id"], ev.entitlement)
    out: list[Event] = []
    if ev.type != "JobLoadReported":
        job = _on_intent(job, ev)
    else:
        job = learn(job, p["at_ms"], p["load"], tuning)
        if job.current is None and p.get("running_tasks"):
            job = dataclasses.replace(job, current=p["running_tasks"])
        if live:
            job, out = _size(job, ev, tuning)
    if job.heard_ms is None or ev.timestamp_ms > job.heard_ms:
        job = dataclasses.replace(job, heard_ms=ev.timestamp_ms)
    return SrmState(jobs=state.jobs.updated({job.job_id: job})), out


def plan(job: JobScaling, at: int, tuning: Tuning = Tuning()) -> dict[str, Any]:
    """What the SRM decides for ``job`` at ``at`` (its samples' clock): the forecast, the size it wants, the rule
    that decides (``RULES``, with what it says) and its verdict (``up``, ``down`` or ``hold``), ``tasks`` the size
    it would declare. ``_size`` declares it; ``dry_run`` only says it."""
    f = forecast(job, at, tuning)
    pol = job.policy
    raw = math.ceil(f["forecast"] / pol.load_per_task - 1e-9) if pol is not None else 0
    want = min(max(raw, pol.min_tasks), pol.max_tasks) if pol is not None else 0
    rule, verdict = _rule(Case(job, at, want, tuning))
    if verdict == UP and pol is not None:  # with headroom: the next step up waits until the load grew that much
        #                                     (UP has a policy: ``no_policy`` holds without one)
        want = min(max(math.ceil(f["forecast"] * (1 + tuning.up_headroom) / pol.load_per_task - 1e-9), want),
                   pol.max_tasks)
    freed = (job.current - want) // tuning.tasks_per_machine if verdict == DOWN and job.current is not None else 0
    return {"at_ms": at, "load": job.last_load, "recent": f["recent"], "historical": f["historical"],
            "forecast": f["forecast"], "load_per_task": pol.load_per_task if pol is not None else None,
            "raw_tasks": raw, "current_tasks": job.current, "direction": verdict, "rule": rule,
            "samples": job.samples, "horizon_ms": tuning.horizon_ms, "machines_freed": freed,
            "tasks": want if verdict != HOLD else job.current, "says": SAYS[rule]}


def dry_run(job: JobScaling, tuning: Tuning = Tuning()) -> dict[str, Any]:
    """What the SRM would decide for ``job`` now, declaring nothing (``ropewalk srm plan JOB``): ``plan`` at its
    latest sample's time (the SRM's only clock), with the job's state as the log has it. A job without a sample
    yet: the first rule that holds without one (``no_policy`` or ``warming_up``)."""
    if job.last_at is None:
        rule = "no_policy" if job.policy is None else "warming_up"
        return {"job": job.job_id, "entitlement": job.entitlement, "at_ms": None, "direction": HOLD, "rule": rule,
                "says": SAYS[rule], "tasks": job.current, "current_tasks": job.current, "samples": 0,
                "forecast": None, "dry_run": True}
    return {"job": job.job_id, "entitlement": job.entitlement, **plan(job, job.last_at, tuning), "dry_run": True}


def _size(job: JobScaling, ev: Event, tuning: Tuning) -> tuple[JobScaling, list[Event]]:
    at = ev.payload["at_ms"]
    p = plan(job, at, tuning)
    verdict, want = p["direction"], p["tasks"]
    if verdict == HOLD:
        return job, []
    decision = {k: v for k, v in p.items() if k not in ("tasks", "says")}
    intent = new_event("SizingIntentDeclared", {
        "job_id": job.job_id, "owner": OWNER, "source": "autoscaler", "tasks": want, "autoscale": False,
        "min_tasks": None, "max_tasks": None, "load_per_task": None, "decision": decision},
        entitlement=job.entitlement, entity_id=job.job_id, producer=PRODUCER, causation_id=ev.event_id,
        timestamp_ms=ev.timestamp_ms, event_id=derived_event_id(ev.event_id, PRODUCER, "sizing"))
    return _changed(job, at, want, verdict, intent.event_id), [intent]


def scaling_view(job: JobScaling, tuning: Tuning = Tuning()) -> dict[str, Any]:
    """The SRM's picture of a job's scaling (`ropewalk srm show`): policy, load, forecast, size, last change. (Not
    `frontend/service.job_view`, a job's published state.)"""
    f = forecast(job, job.last_at, tuning) if job.last_at is not None else None
    return {"job": job.job_id, "entitlement": job.entitlement,
            "policy": None if job.policy is None else {"min_tasks": job.policy.min_tasks,
                                                       "max_tasks": job.policy.max_tasks,
                                                       "load_per_task": job.policy.load_per_task},
            "current_tasks": job.current, "samples": job.samples, "last_sample_at_ms": job.last_at,
            "load": job.last_load, "forecast": f, "last_change": None if job.changed_at is None else {
                "at_ms": job.changed_at, "direction": job.direction, "reversal_at_ms": job.reversal_at}}


def reversals(decisions: Sequence[Mapping[str, Any]]) -> list[int]:
    """The sample times at which a list of decisions (SizingIntentDeclared.decision, in order) changed direction:
    what 'at most one reversal an hour' counts."""
    out, last = [], None
    for d in decisions:
        if last is not None and d["direction"] != last:
            out.append(d["at_ms"])
        last = d["direction"]
    return out


def most_in_window(times: list[int], window_ms: int) -> int:
    """The most of ``times`` (sorted) in any window of ``window_ms``."""
    best, i = 0, 0
    for j, t in enumerate(times):
        while t - times[i] >= window_ms:
            i += 1
        best = max(best, j - i + 1)
    return best

