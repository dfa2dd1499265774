"""The Job Control Plane's decisions: per-dimension intents in, one reconciled spec out. Pure.

No faust, Kafka or Redis; no clock. ``decide(state, event, position) -> (state, events)``: ``position`` is where the
event sits on the log (logical topic, partition, offset), recorded as the provenance of what it contributes.

**What it reads** (all on ``intents``, keyed by entitlement): the job's own spec (JobSubmitted, JobSpecChanged,
JobResized, JobStopped: the *base*), the per-dimension intents (PushIntentDeclared, CanaryIntentDeclared,
SizingIntentDeclared, ResourcesIntentDeclared), and the scheduler's IntentRefused of a submission (an incarnation that
never was). **What it writes**: a JobSpecReconciled whenever a job's reconciled spec changes (generation + 1, with the
provenance of every intent in force and the conflict rules that shaped it), and an IntentRefused for an intent it
cannot take (reason constant, message naming the field). A job nobody declared an intent for is left alone: its
spec is the one its owner submitted.

**One intent per dimension**, the latest (a new one replaces the previous of its dimension; sizing holds two: a
person's and the autoscaler's). **The conflict rules are one table, ``RULES``**, in the order they apply: rules
of kind ``refuse`` are checked when an intent comes (it is refused with the rule's reason), rules of kind
``shape`` when the spec is reconciled (each that changes something is named in the event's ``rules``).

**Version numbers.** Every distinct (command, env, resources) a task may run gets a version number: the job's own
spec keeps its ``spec_version`` (1 at submission), a new code or new resources gets the job's highest number + 1.
So a resources change renumbers every version in use and every task rolls; a percentage or a size change keeps
the numbers (tasks keep running). JobSpecReconciled.spec_version is the highest number the job has had.

**Idempotence.** Each job keeps a ring of the input ids applied to it; output ids derive from the input's id, so a
replay emits the same events. The generation counts on across incarnations of a job id while the previous one is
held (the scheduler refuses an older one of an incarnation), and the reconciliation names the JobSubmitted it was made
for (``submission_id``).

**Stopped jobs leave** (issue #29; the scheduler's rule, processors/scheduler/README.md "Stopped jobs leave"). A job
stopped, or whose submission the scheduler refused, is held for a grace (``gc_ms``: ``ROPEWALK_JOB_GC_S``) from
its end (``JobIntents.ended_ms``, the log time of the JobStopped or the IntentRefused), then it is gone: before, the
Job Control Plane kept every job it ever saw (~3.4 KB each; +30 % of its memory a simulated week in the soak).
``decide`` takes a job whose grace passed, by the time of the event that names it (``is_expired``), for gone whether
``collect`` took it out of the state yet or not, so no decision depends on when ``collect`` ran: a job's events are
all on its entitlement's partition, so a re-fold at a restart decides alike. Gone, an intent naming it is refused
as ``unknown_job``, a JobStopped or JobResized changes nothing, a JobSubmitted is a new job (generation from 0: the
scheduler's new incarnation starts at 0 too, and the reconciliation names its own submission).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from infra.config import DEFAULT_JOB_GC_MS, DEFAULT_MAX_TASKS_PER_JOB
from processors.cowmap import CowMap
from processors import rules
from processors.scheduler.versions import round_half_up
from processors.times import expired
from streams.events import Event, derived_event_id, new_event

PRODUCER = "jobcontrol"
SEEN_LIMIT = 256  # input ids remembered per job

# Dimensions (JobSpecReconciled.provenance[].dimension).
BASE = "base"  # the job's own spec: JobSubmitted, JobSpecChanged, JobResized
PUSH = "push"
CANARY = "canary"
SIZING = "sizing"  # held as SIZING_PERSON and SIZING_AUTOSCALER
SIZING_PERSON = "sizing/person"
SIZING_AUTOSCALER = "sizing/autoscaler"
RESOURCES = "resources"
INTENT_DIMENSION = MappingProxyType({"PushIntentDeclared": PUSH, "CanaryIntentDeclared": CANARY,
                                     "SizingIntentDeclared": SIZING, "ResourcesIntentDeclared": RESOURCES})
BASE_TYPES = frozenset({"JobSubmitted", "JobSpecChanged", "JobResized", "JobStopped"})
CONSUMED = frozenset({*BASE_TYPES, *INTENT_DIMENSION, "IntentRefused"})

# Reasons an intent is refused (IntentRefused.reason).
REASON_UNKNOWN_JOB = "unknown_job"  # no live job of that id (never submitted, or stopped)
REASON_ENTITLEMENT_MISMATCH = "entitlement_mismatch"  # keyed to another entitlement than the job's
REASON_INVALID_INTENT = rules.INVALID_INTENT  # breaks a rule of processors/rules.py
REASON_SIZING_PINNED = "sizing_pinned"  # an autoscaler's size while a person pins the size
REASON_NO_AUTOSCALING = "no_autoscaling_policy"  # an autoscaler's size for a job nobody let it size
REASON_NO_CANARY = "no_canary"  # promote or abort without a canary running

# Canary actions (CanaryIntentDeclared.action).
START, PROMOTE, ABORT = "start", "promote", "abort"


# -- the state ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Held:
    """An intent in force, and where it is on the log."""

    dimension: str
    owner: str
    event_type: str
    event_id: str
    position: tuple[str, int, int]  # (logical topic, partition, offset)
    payload: Mapping[str, Any]

    def provenance(self) -> dict:
        topic, partition, offset = self.position
        return {"dimension": self.dimension.split("/")[0], "owner": self.owner, "intent_type": self.event_type,
                "intent_event_id": self.event_id, "topic": topic, "partition": partition, "offset": offset}


CodeKey = tuple  # (command tuple, env pairs, cpu, mem)


@dataclass(frozen=True, slots=True)
class JobIntents:
    """A job as the Job Control Plane holds it."""

    job_id: str
    entitlement: str
    submission: str = ""  # the JobSubmitted event id of the live incarnation
    live: bool = False  # submitted and not stopped (nor refused)
    base: Mapping[str, Any] = field(default_factory=dict)  # its own spec (JobSubmitted fields) and size
    base_ref: Held | None = None  # where the base came from
    stable: tuple[str, tuple, tuple] = ("", (), ())  # (label, command, env) of the stable code
    intents: Mapping[str, Held] = field(default_factory=dict)  # dimension -> the latest intent
    versions: tuple[tuple[CodeKey, int, str], ...] = ()  # (code key, version number, label), in number order
    top_version: int = 1
    generation: int = 0  # of the latest reconciliation emitted (counts on across incarnations)
    last: Mapping[str, Any] | None = None  # the latest reconciled spec (without generation and provenance)
    seen: tuple[str, ...] = ()
    ended_ms: int | None = None  # when it stopped (or its submission was refused): its grace counts from then


@dataclass(frozen=True)
class JcpState:
    jobs: CowMap[JobIntents] = field(default_factory=CowMap)


# -- the conflict rules: ONE table --------------------------------------------------------------------------------

@dataclass
class Draft:
    """The spec being reconciled (see ``reconcile``)."""

    job: JobIntents
    tasks: int
    resources: dict
    stable: tuple  # (label, command, env)
    push: tuple | None = None  # (label, command, env, percent, steps, Held)
    canary: tuple | None = None  # (label, command, env, count, Held)
    sizing: Held | None = None  # the sizing intent that set ``tasks``
    fired: list = field(default_factory=list)  # (rule, message)


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str  # "refuse": checked when an intent comes; "base": when the job's own spec changes; "shape": when
    #           reconciling
    dimensions: tuple[str, ...]
    says: str  # the rule in words (README and `ropewalk intents rules`)
    apply: Callable[..., Any]


def _refuse_pinned(job: JobIntents, ev: Event) -> tuple[str, str] | None:
    p = ev.payload
    person = job.intents.get(SIZING_PERSON)
    if p.get("source") != "autoscaler":
        return None
    if person is not None and person.payload.get("tasks") is not None:
        return REASON_SIZING_PINNED, f"tasks: {person.owner} pins {ev.payload['job_id']} at {person.payload['tasks']} tasks"
    if person is None or not person.payload.get("autoscale"):
        return REASON_NO_AUTOSCALING, f"tasks: nobody let the autoscaler size {p['job_id']} (ropewalk intents size --auto)"
    return None


def _refuse_no_canary(job: JobIntents, ev: Event) -> tuple[str, str] | None:
    if ev.payload.get("action") in (PROMOTE, ABORT) and CANARY not in job.intents:
        return REASON_NO_CANARY, f"action: no canary runs on {ev.payload['job_id']} to {ev.payload['action']}"
    return None


def _base_ends_code_intents(job: JobIntents, ev: Event) -> JobIntents:
    if ev.type != "JobSpecChanged" or not any(k in job.intents for k in (PUSH, CANARY, RESOURCES)):
        return job
    return dataclasses.replace(job, intents=MappingProxyType({k: v for k, v in job.intents.items()
                                                              if k not in (PUSH, CANARY, RESOURCES)}))


def _shape_resources(d: Draft) -> str | None:
    held = d.job.intents.get(RESOURCES)
    if held is None:
        return None
    d.resources = dict(held.payload["resources"])
    return (f"{d.resources['cpu_millicores']} millicores, {d.resources['memory_mib']} MiB for every version "
            f"(every task rolls to new version numbers)") if d.resources != dict(d.job.base["resources"]) else None


def _shape_person_pins(d: Draft) -> str | None:
    held = d.job.intents.get(SIZING_PERSON)
    if held is None or held.payload.get("tasks") is None:
        return None
    d.tasks, d.sizing = held.payload["tasks"], held
    return f"{held.owner} pins the size at {d.tasks} tasks"


def _shape_autoscaler(d: Draft) -> str | None:
    person, auto = d.job.intents.get(SIZING_PERSON), d.job.intents.get(SIZING_AUTOSCALER)
    if d.sizing is not None or person is None or not person.payload.get("autoscale") or auto is None:
        return None
    lo, hi = person.payload["min_tasks"], person.payload["max_tasks"]
    want = auto.payload["tasks"]
    d.tasks, d.sizing = min(max(want, lo), hi), auto
    return None if d.tasks == want else f"the autoscaler's {want} tasks clamped to {lo}..{hi}: {d.tasks}"


def _shape_push(d: Draft) -> str | None:
    held = d.job.intents.get(PUSH)
    if held is None:
        return None
    p = held.payload
    code = (p.get("label", ""), tuple(p["command"]), tuple(sorted(p.get("env", {}).items())))
    if code[1:] == d.stable[1:] or p["percent"] == 0:
        return f"no push in force ({'0 %' if p['percent'] == 0 else 'its target is the stable version'})"
    d.push = (*code, p["percent"], tuple(p.get("steps", ())), held)
    return None


def _shape_promote(d: Draft) -> str | None:
    """A promoted canary (CanaryIntentDeclared promote) was turned into the push intent when it came (``_intake``):
    named here when the push in force came from it."""
    held = d.job.intents.get(PUSH)
    if held is not None and held.event_type == "CanaryIntentDeclared":
        return f"the canary {held.payload.get('label', '')!r} promoted: the push target at {held.payload['percent']} %"
    return None


def _shape_canary(d: Draft) -> str | None:
    held = d.job.intents.get(CANARY)
    if held is None:
        return None
    p = held.payload
    count = min(p["count"], max(0, d.tasks - 1))
    d.canary = (p.get("label", ""), tuple(p["command"]), tuple(sorted(p.get("env", {}).items())), count, held)
    if count != p["count"]:
        return f"{p['count']} canary tasks capped at {count}: at least one task of a job of {d.tasks} is no canary"
    return None


def _shape_canary_apart(d: Draft) -> str | None:
    if d.canary is None or d.push is None or d.canary[3] == 0:
        return None
    non_canary = d.tasks - d.canary[3]
    return (f"{d.canary[3]} canary tasks are not push targets: the push's {d.push[3]} % is of the {non_canary} "
            f"others ({round_half_up(d.push[3], non_canary)} tasks)")


def _shape_push_done(d: Draft) -> str | None:
    if d.push is None or d.push[3] < 100:
        return None
    d.stable, d.push = d.push[:3], None
    return "the push reached 100 %: its target is the stable version"


def _shape_size_keeps_percent(d: Draft) -> str | None:
    last = d.job.last
    if d.push is None or last is None or last["tasks"] == d.tasks:
        return None
    canaries = d.canary[3] if d.canary else 0
    return (f"sized {last['tasks']} -> {d.tasks} tasks: the push keeps {d.push[3]} % "
            f"({round_half_up(d.push[3], d.tasks - canaries)} of {d.tasks - canaries} non-canary tasks)")


RULES: tuple[Rule, ...] = (
    Rule("spec_by_hand_ends_code_intents", "base", (BASE, PUSH, CANARY, RESOURCES), "a spec changed by hand "
         "(job update) is the new stable version and ends the push, canary and resources intents (sizing stays)",
         _base_ends_code_intents),
    Rule("autoscaler_needs_policy", "refuse", (SIZING,), "an autoscaler's size is refused while a person pins the "
         "size (sizing_pinned) or has not let the autoscaler size the job (no_autoscaling_policy)", _refuse_pinned),
    Rule("canary_must_run", "refuse", (CANARY,), "promote and abort need a canary running (no_canary)",
         _refuse_no_canary),
    Rule("resources_for_every_version", "shape", (RESOURCES,), "a resources intent applies to every version; new "
         "resources are new version numbers, so every task rolls", _shape_resources),
    Rule("person_pins_size", "shape", (SIZING,), "a person's size wins over the autoscaler's and the job's own",
         _shape_person_pins),
    Rule("autoscaler_within_bounds", "shape", (SIZING,), "with a person's autoscaling policy, the autoscaler's latest "
         "size wins over the job's own, clamped to the policy's min..max", _shape_autoscaler),
    Rule("push_target_differs", "shape", (PUSH,), "a push at 0 %, or to the stable code, is no push", _shape_push),
    Rule("promote_makes_push", "shape", (CANARY, PUSH), "promoting a canary makes its version the push target (at "
         "promote_percent) and ends the canary", _shape_promote),
    Rule("canary_capped", "shape", (CANARY, SIZING), "a canary takes at most all tasks but one", _shape_canary),
    Rule("canary_never_a_push_target", "shape", (CANARY, PUSH), "canary tasks never count toward the push: its "
         "percentage is of the non-canary tasks, and the scheduler never picks a push target as a canary",
         _shape_canary_apart),
    Rule("push_done_becomes_stable", "shape", (PUSH,), "a push at 100 % makes its target the stable version",
         _shape_push_done),
    Rule("sizing_keeps_push_percent", "shape", (SIZING, PUSH), "a size change keeps the push percentage, not its "
         "task count", _shape_size_keeps_percent),
)


def rules_table() -> list[dict]:
    """The conflict rules as data (README, `ropewalk intents rules`)."""
    return [{"rule": r.name, "kind": r.kind, "dimensions": list(r.dimensions), "says": r.says} for r in RULES]


# -- reconciling ------------------------------------------------------------------------------------------------

def _code_key(code: tuple, resources: Mapping[str, int]) -> CodeKey:
    return (code[1], code[2], resources["cpu_millicores"], resources["memory_mib"])


def reconcile(job: JobIntents) -> tuple[JobIntents, dict | None]:
    """The job's reconciled spec (a JobSpecReconciled payload without generation) and the job with the version
    numbers it assigned; None when no intent of any dimension is held (the job runs its own spec)."""
    if not job.live or not job.intents:
        return job, None
    d = Draft(job=job, tasks=job.base["tasks"], resources=dict(job.base["resources"]), stable=job.stable)
    for rule in RULES:
        if rule.kind == "shape" and (msg := rule.apply(d)) is not None:
            d.fired.append({"rule": rule.name, "message": msg})
    versions, top = list(job.versions), job.top_version

    def number(code: tuple) -> int:
        nonlocal top
        key = _code_key(code, d.resources)
        for k, v, _ in versions:
            if k == key:
                return v
        top += 1
        versions.append((key, top, code[0]))
        return top

    used = {number(d.stable): d.stable}
    stable = next(iter(used))
    push = canary = None
    if d.push is not None:
        push = {"version": number(d.push), "percent": d.push[3], "steps": list(d.push[4])}
        used[push["version"]] = d.push
    if d.canary is not None and d.canary[3] > 0:
        canary = {"version": number(d.canary), "count": d.canary[3]}
        used[canary["version"]] = d.canary
    base = job.base
    spec = {"job_id": job.job_id, "submission_id": job.submission, "spec_version": top, "tasks": d.tasks,
            "name": base["name"], "resources": d.resources, "requirements": dict(base.get("requirements") or {}),
            "spread": base.get("spread", "msb"), "max_unavailable": base.get("max_unavailable", 1),
            "controller": base.get("controller"),
            "versions": [{"version": v, "label": c[0], "command": list(c[1]), "env": dict(c[2])}
                         for v, c in sorted(used.items())],
            "stable_version": stable, "push": push, "canary": canary}
    held = [job.base_ref, job.intents.get(RESOURCES), d.sizing, d.push[5] if d.push else None,
            d.canary[4] if canary and d.canary is not None else None]
    spec["provenance"] = [h.provenance() for h in held if h is not None]
    spec["rules"] = d.fired
    return dataclasses.replace(job, versions=tuple(versions), top_version=top), spec


def _comparable(spec: Mapping[str, Any]) -> dict:
    return {k: v for k, v in spec.items() if k not in ("provenance", "rules")}


# -- decisions ----------------------------------------------------------------------------------------------------

def _emit(cause: Event, type_: str, job: JobIntents, payload: Mapping[str, Any], disc: str) -> Event:
    return new_event(type_, payload, entitlement=job.entitlement, entity_id=job.job_id, producer=PRODUCER,
                     causation_id=cause.event_id, timestamp_ms=cause.timestamp_ms,
                     event_id=derived_event_id(cause.event_id, PRODUCER, type_, disc))


def _refusal(ev: Event, reason: str, message: str) -> Event:
    job_id = ev.payload.get("job_id")
    return new_event("IntentRefused", {"intent_type": ev.type, "intent_event_id": ev.event_id, "job_id": job_id,
                                       "reason": reason, "message": message},
                     entitlement=ev.entitlement, entity_id=job_id or ev.entity_id, producer=PRODUCER,
                     causation_id=ev.event_id, timestamp_ms=ev.timestamp_ms,
                     event_id=derived_event_id(ev.event_id, PRODUCER, "IntentRefused"))


def _held(ev: Event, dimension: str, position: tuple[str, int, int], payload: Mapping[str, Any] | None = None) -> Held:
    p = payload if payload is not None else ev.payload
    return Held(dimension, p.get("owner") or ev.producer, ev.type, ev.event_id, position, MappingProxyType(dict(p)))


def _base_of(ev: Event) -> dict:
    p = ev.payload
    keep = ("name", "tasks", "resources", "requirements", "spread", "max_unavailable", "controller", "spec_version")
    return {k: p.get(k) for k in keep} | {"command": list(p["command"]), "env": dict(p.get("env") or {})}


def _on_base(job: JobIntents | None, ev: Event, position) -> tuple[JobIntents | None, list[Event]]:
    """The job's own spec: a submission (a new incarnation), a spec by hand (the new stable version), a resize by
    hand (the base size), a stop (its intents end)."""
    p = ev.payload
    if ev.type == "JobSubmitted":
        if job is not None and job.live:
            return job, []  # the scheduler refuses it (or it is the same again): nothing changes here
        base = _base_of(ev)
        return JobIntents(job_id=p["job_id"], entitlement=ev.entitlement, submission=ev.event_id, live=True,
                          base=base, base_ref=_held(ev, BASE, position), stable=_stable_of(base),
                          versions=((_code_key(_stable_of(base), base["resources"]), p["spec_version"], ""),),
                          top_version=p["spec_version"], generation=job.generation if job else 0,
                          seen=job.seen if job else ()), []
    if job is None or not job.live or ev.entitlement != job.entitlement:
        return job, []
    if ev.type == "JobStopped":
        return dataclasses.replace(job, live=False, intents=MappingProxyType({}), last=None,
                                   ended_ms=ev.timestamp_ms), []
    if ev.type == "JobResized":
        return dataclasses.replace(job, base={**job.base, "tasks": p["tasks"]}, base_ref=_held(ev, BASE, position)), []
    if p["spec_version"] <= job.top_version and ev.producer != PRODUCER:  # the scheduler refuses it as stale
        return job, []
    for rule in RULES:
        if rule.kind == "base":
            job = rule.apply(job, ev)
    base = _base_of(ev)
    versions = (*job.versions, (_code_key(_stable_of(base), base["resources"]), p["spec_version"], ""))
    return dataclasses.replace(job, base=base, base_ref=_held(ev, BASE, position), stable=_stable_of(base),
                               versions=versions, top_version=p["spec_version"]), []


def _stable_of(base: Mapping[str, Any]) -> tuple:
    return ("", tuple(base["command"]), tuple(sorted(base["env"].items())))


def _intake(job: JobIntents, ev: Event, position, max_tasks: int) -> tuple[JobIntents, list[Event]]:  # noqa: C901
    """A per-dimension intent: refused (a rule of processors/rules.py, or a ``refuse`` rule of ``RULES``)
    or held as its dimension's latest."""
    found = rules.intent_problems(ev.type, ev.payload, ev.entitlement, max_tasks)
    if found:
        return job, [_refusal(ev, *rules.refusal(found))]
    for rule in RULES:
        if rule.kind == "refuse" and INTENT_DIMENSION[ev.type] in rule.dimensions:
            if (refused := rule.apply(job, ev)) is not None:
                return job, [_refusal(ev, *refused)]
    p = ev.payload
    intents = dict(job.intents)
    dim = INTENT_DIMENSION[ev.type]
    if dim == SIZING:
        key = SIZING_AUTOSCALER if p["source"] == "autoscaler" else SIZING_PERSON
        intents[key] = _held(ev, key, position)
        if key == SIZING_PERSON and not p.get("autoscale"):
            intents.pop(SIZING_AUTOSCALER, None)  # a pin, or no policy: the autoscaler's size is moot
        if key == SIZING_PERSON and p.get("tasks") is None and not p.get("autoscale"):
            intents.pop(SIZING_PERSON)  # neither pin nor policy: the job's own size
    elif dim == CANARY:
        if p["action"] == START:
            intents[CANARY] = _held(ev, CANARY, position)
        elif p["action"] == ABORT:
            intents.pop(CANARY)
        else:  # promote: the canary's code becomes the push target (rule promote_makes_push)
            canary = intents.pop(CANARY).payload
            intents[PUSH] = _held(ev, PUSH, position, {
                "job_id": p["job_id"], "owner": p["owner"], "label": canary.get("label", ""),
                "command": list(canary["command"]), "env": dict(canary.get("env", {})),
                "percent": p.get("promote_percent", 100), "steps": []})
    else:
        intents[dim] = _held(ev, dim, position)
    return dataclasses.replace(job, intents=MappingProxyType(intents)), []


def _promote_done_push(job: JobIntents, ev: Event) -> JobIntents:
    """A new push (or a promoted canary) replaces one that had reached 100 %: that one's target is the stable code
    from now on."""
    if INTENT_DIMENSION.get(ev.type) not in (PUSH, CANARY):
        return job
    old = job.intents.get(PUSH)
    if old is None or old.payload["percent"] < 100:
        return job
    return dataclasses.replace(job, stable=(old.payload.get("label", ""), tuple(old.payload["command"]),
                                            tuple(sorted(old.payload.get("env", {}).items()))))


def is_expired(job: JobIntents, now_ms: int, gc_ms: int) -> bool:
    """Whether ``job`` ended (stopped, or its submission refused) ``gc_ms`` or more before ``now_ms``: gone, whether
    ``collect`` took it out of the state yet or not."""
    return not job.live and expired(job.ended_ms, now_ms, gc_ms)


def collect(state: JcpState, now_ms: int, gc_ms: int = DEFAULT_JOB_GC_MS) -> tuple[JcpState, list[str]]:
    """The jobs whose grace passed by ``now_ms`` (``is_expired``) leave the state; returns it and their ids, sorted.
    Nothing of a decision depends on whether or when it ran (``decide`` takes an expired job for gone)."""
    gone = sorted(j for j, job in state.jobs.items() if is_expired(job, now_ms, gc_ms))
    if not gone:
        return state, []
    return JcpState(jobs=state.jobs.without(gone)), gone


def decide(state: JcpState, ev: Event, position: tuple[str, int, int], *,
           max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB, gc_ms: int = DEFAULT_JOB_GC_MS) -> tuple[JcpState, list[Event]]:
    """Apply one event of ``intents`` (at ``position``): the new state and the events to produce. A job the event
    names whose grace (``gc_ms``) passed by the event's time is gone (``is_expired``)."""
    if ev.type not in CONSUMED or ev.producer == PRODUCER:
        return state, []
    if ev.type == "IntentRefused":
        return _on_refused(state, ev, gc_ms)
    job_id = ev.payload["job_id"]
    job = state.jobs.get(job_id)
    if job is not None and is_expired(job, ev.timestamp_ms, gc_ms):
        job = None
    if job is not None and ev.event_id in job.seen:
        return state, []
    out: list[Event] = []
    if ev.type in BASE_TYPES:
        new, out = _on_base(job, ev, position)
    elif job is None or not job.live:
        return state, [_refusal(ev, REASON_UNKNOWN_JOB, f"job_id: no job {job_id} in entitlement {ev.entitlement}"
                                f"{' (stopped)' if job is not None else ''}")]
    elif ev.entitlement != job.entitlement:
        return state, [_refusal(ev, REASON_ENTITLEMENT_MISMATCH, f"envelope.entitlement: {ev.type} {ev.event_id} is keyed to "
                                f"{ev.entitlement}, the job belongs to {job.entitlement}")]
    else:
        new, out = _intake(_promote_done_push(job, ev), ev, position, max_tasks)
    if new is None:
        return state, out
    new, spec = reconcile(new)
    if spec is not None and (new.last is None or _comparable(spec) != new.last):
        gen = new.generation + 1
        out.append(_emit(ev, "JobSpecReconciled", new, {**spec, "generation": gen}, "reconciled"))
        new = dataclasses.replace(new, generation=gen, last=MappingProxyType(_comparable(spec)))
    new = dataclasses.replace(new, seen=(*new.seen, ev.event_id)[-SEEN_LIMIT:])
    return JcpState(jobs=state.jobs.updated({job_id: new})), out


def _on_refused(state: JcpState, ev: Event, gc_ms: int) -> tuple[JcpState, list[Event]]:
    """The scheduler refused a submission the Job Control Plane took as a new incarnation: there is none."""
    p = ev.payload
    job = state.jobs.get(p.get("job_id") or "")
    if (p.get("intent_type") != "JobSubmitted" or job is None or job.submission != p.get("intent_event_id")
            or is_expired(job, ev.timestamp_ms, gc_ms)):
        return state, []
    if p.get("reason") in ("duplicate_job_id", "job_not_active"):
        return state, []  # the previous incarnation lives on (the JCP did not take this one: it was live)
    return JcpState(jobs=state.jobs.updated({job.job_id: dataclasses.replace(
        job, live=False, last=None, ended_ms=job.ended_ms if not job.live else ev.timestamp_ms)})), []


def decide_all(state: JcpState, records, *, max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB,
               gc_ms: int = DEFAULT_JOB_GC_MS) -> tuple[JcpState, list[Event]]:
    """``decide`` over ``(event, position)`` pairs in order."""
    out: list[Event] = []
    for ev, pos in records:
        state, emitted = decide(state, ev, pos, max_tasks=max_tasks, gc_ms=gc_ms)
        out.extend(emitted)
    return state, out


# -- views (CLI) -------------------------------------------------------------------------------------------------

def job_intents_view(job: JobIntents) -> dict:
    """Who wants what of a job, and what the reconciled spec is (`ropewalk intents show JOB --json`)."""
    return {"job": job.job_id, "entitlement": job.entitlement, "live": job.live, "generation": job.generation,
            "submission_id": job.submission,
            "intents": {dim: {"owner": h.owner, "type": h.event_type, "event_id": h.event_id,
                              "at": {"topic": h.position[0], "partition": h.position[1], "offset": h.position[2]},
                              "payload": dict(h.payload)} for dim, h in sorted(job.intents.items())},
            "reconciled": dict(job.last) if job.last is not None else None}
