"""The Job Control Plane's pure decisions (processors/jobcontrol/decide.py): per-dimension intents in, one reconciled
spec out, with provenance; the conflict rules of its one table; refusals as events.

Every input goes through ``Jcp.feed``, which also checks: the same input on the same state gives the same output
(ids included); delivering it again changes nothing and emits nothing (an intent refused for a job the JCP does not
know is refused again under the same id); every emitted event encodes with the real schemas.
"""
import dataclasses

import pytest

from processors.jobcontrol import decide as jd
from processors.jobcontrol import views
from processors.jobcontrol.decide import JcpState, decide
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
ENT = "e1"
JOB = "e1.web"
V1, V2, V3 = ["serve", "--v1"], ["serve", "--v2"], ["serve", "--canary"]


class Jcp:
    def __init__(self, gc_ms=jd.DEFAULT_JOB_GC_MS):
        self.state = JcpState()
        self.offset = 0
        self.gc_ms = gc_ms

    def feed(self, ev):
        self.offset += 1
        pos = ("intents", 0, self.offset)
        new, out = decide(self.state, ev, pos, gc_ms=self.gc_ms)
        assert decide(self.state, ev, pos, gc_ms=self.gc_ms) == (new, out), "same input, same state: same output"
        collected, _ = jd.collect(self.state, ev.timestamp_ms, self.gc_ms)
        assert decide(collected, ev, pos, gc_ms=self.gc_ms)[1] == out, "no decision depends on when collect ran"
        dup_state, dup_out = decide(new, ev, pos, gc_ms=self.gc_ms)
        assert dup_state == new and (dup_out == [] or all(e.type == "IntentRefused" for e in out)), \
            f"{ev.type} twice must change nothing"
        for e in out:
            REG.encode(e.type, e.to_record(schema_version=1))
            assert e.producer == jd.PRODUCER and e.causation_id == ev.event_id
        self.state = new
        return out

    def spec(self, out):
        """The one JobSpecReconciled of ``out``'s payload."""
        specs = [e.payload for e in out if e.type == "JobSpecReconciled"]
        assert len(specs) == 1, [e.type for e in out]
        return specs[0]


_n = iter(range(10**9))


def ev(type_, payload, producer="cli", ent=ENT):
    return new_event(type_, payload, entitlement=ent, entity_id=payload.get("job_id", ent), producer=producer,
                     timestamp_ms=T0, event_id=f"in-{type_}-{next(_n)}")


def submitted(tasks=100, command=V1, cpu=1000):
    return ev("JobSubmitted", {"job_id": JOB, "name": "web", "spec_version": 1, "tasks": tasks, "command": command,
                               "resources": {"cpu_millicores": cpu, "memory_mib": 1024}, "requirements": {},
                               "spread": "msb", "max_unavailable": 5, "env": {}, "controller": None})


def push(percent, command=V2, label="v2", steps=(), owner="conveyor", **kw):
    return ev("PushIntentDeclared", {"job_id": JOB, "owner": owner, "label": label, "command": command, "env": {},
                                     "percent": percent, "steps": list(steps), **kw})


def canary(action, count=0, command=V3, **kw):
    return ev("CanaryIntentDeclared", {"job_id": JOB, "owner": "alice", "action": action, "count": count,
                                       "label": "c1", "command": command if action == "start" else [], "env": {},
                                       "promote_percent": kw.pop("promote_percent", 100), **kw})


def size(tasks=None, *, source="person", owner="bob", autoscale=False, lo=None, hi=None, per=None):
    return ev("SizingIntentDeclared", {"job_id": JOB, "owner": owner, "source": source, "tasks": tasks,
                                       "autoscale": autoscale, "min_tasks": lo, "max_tasks": hi, "load_per_task": per,
                                       "decision": None}, producer="srm" if source == "autoscaler" else "cli")


def auto(tasks):
    return size(tasks, source="autoscaler", owner="srm")


def resources(cpu, mem=1024):
    return ev("ResourcesIntentDeclared", {"job_id": JOB, "owner": "carol",
                                          "resources": {"cpu_millicores": cpu, "memory_mib": mem}})


def refused(out):
    return [(e.payload["intent_type"], e.payload["reason"]) for e in out if e.type == "IntentRefused"]


def fired(spec):
    return [r["rule"] for r in spec["rules"]]


def running(tasks=100):
    jcp = Jcp()
    assert jcp.feed(submitted(tasks)) == []  # no intent: the job runs its own spec, nothing to reconcile
    return jcp


def test_a_push_is_reconciled_into_a_mix_with_provenance():
    jcp = running()
    intent = push(50, steps=(10, 50, 100))
    spec = jcp.spec(jcp.feed(intent))
    assert spec["generation"] == 1 and spec["tasks"] == 100 and spec["spec_version"] == 2
    assert spec["versions"] == [{"version": 1, "label": "", "command": V1, "env": {}},
                                {"version": 2, "label": "v2", "command": V2, "env": {}}]
    assert spec["stable_version"] == 1 and spec["push"] == {"version": 2, "percent": 50, "steps": [10, 50, 100]}
    assert spec["canary"] is None
    assert [(p["dimension"], p["owner"], p["intent_type"], p["offset"]) for p in spec["provenance"]] == [
        ("base", "cli", "JobSubmitted", 1), ("push", "conveyor", "PushIntentDeclared", 2)]
    assert spec["provenance"][1]["intent_event_id"] == intent.event_id
    assert spec["submission_id"].startswith("in-JobSubmitted")
    # the same push again: nothing new to reconcile
    assert [e.type for e in jcp.feed(push(50, steps=(10, 50, 100)))] == []


def test_sizing_keeps_the_push_percentage_and_a_person_pins_the_size():
    jcp = running()
    jcp.feed(push(50))
    spec = jcp.spec(jcp.feed(size(60)))
    assert spec["tasks"] == 60 and spec["push"]["percent"] == 50 and spec["generation"] == 2
    assert "person_pins_size" in fired(spec) and "sizing_keeps_push_percent" in fired(spec)
    assert [p["dimension"] for p in spec["provenance"]] == ["base", "sizing", "push"]
    # the autoscaler cannot override a pin, nor size a job nobody let it size
    assert refused(jcp.feed(auto(140))) == [("SizingIntentDeclared", jd.REASON_SIZING_PINNED)]
    jcp.feed(size(None))  # the pin released: the job's own size
    assert refused(jcp.feed(auto(140))) == [("SizingIntentDeclared", jd.REASON_NO_AUTOSCALING)]


def test_the_autoscaler_sizes_within_a_persons_bounds():
    jcp = running()
    jcp.feed(push(50))
    jcp.feed(size(autoscale=True, lo=60, hi=140, per=10.0))
    assert jcp.spec(jcp.feed(auto(75)))["tasks"] == 75
    spec = jcp.spec(jcp.feed(auto(200)))
    assert spec["tasks"] == 140 and "autoscaler_within_bounds" in fired(spec)
    assert spec["provenance"][1]["owner"] == "srm" and spec["provenance"][1]["dimension"] == "sizing"
    assert spec["push"]["percent"] == 50
    spec = jcp.spec(jcp.feed(size(90)))  # a person pins: the autoscaler's size is moot
    assert spec["tasks"] == 90


def test_a_canary_is_never_a_push_target_and_is_capped():
    jcp = running(10)
    jcp.feed(push(50))
    spec = jcp.spec(jcp.feed(canary("start", 2)))
    assert spec["canary"] == {"version": 3, "count": 2} and spec["push"] == {"version": 2, "percent": 50, "steps": []}
    assert "canary_never_a_push_target" in fired(spec)
    spec = jcp.spec(jcp.feed(canary("start", 50)))
    assert spec["canary"]["count"] == 9 and "canary_capped" in fired(spec)
    spec = jcp.spec(jcp.feed(canary("abort")))
    assert spec["canary"] is None and [v["version"] for v in spec["versions"]] == [1, 2]
    assert refused(jcp.feed(canary("abort"))) == [("CanaryIntentDeclared", jd.REASON_NO_CANARY)]


def test_promoting_a_canary_makes_it_the_push_and_at_100_percent_the_stable_version():
    jcp = running(10)
    jcp.feed(push(50))
    jcp.feed(canary("start", 2))
    spec = jcp.spec(jcp.feed(canary("promote", promote_percent=30)))
    assert spec["canary"] is None and spec["push"] == {"version": 3, "percent": 30, "steps": []}
    assert "promote_makes_push" in fired(spec)
    spec = jcp.spec(jcp.feed(push(100, command=V3, label="c1")))
    assert spec["push"] is None and spec["stable_version"] == 3 and "push_done_becomes_stable" in fired(spec)
    # the next push starts from the version the last one completed
    spec = jcp.spec(jcp.feed(push(10, command=["serve", "--v4"], label="v4")))
    assert spec["stable_version"] == 3 and spec["push"]["version"] == 4 and spec["spec_version"] == 4


def test_a_push_rolled_back_to_zero_keeps_the_version_counter():
    jcp = running()
    jcp.feed(push(50))
    spec = jcp.spec(jcp.feed(push(0)))
    assert spec["push"] is None and spec["spec_version"] == 2 and spec["versions"][0]["version"] == 1
    assert "push_target_differs" in fired(spec)


def test_resources_renumber_every_version_so_every_task_rolls():
    jcp = running()
    jcp.feed(push(50))
    spec = jcp.spec(jcp.feed(resources(2000)))
    assert spec["resources"] == {"cpu_millicores": 2000, "memory_mib": 1024}
    assert spec["stable_version"] == 3 and spec["push"]["version"] == 4 and spec["spec_version"] == 4
    assert "resources_for_every_version" in fired(spec)


def test_a_spec_by_hand_ends_code_intents_and_keeps_sizing():
    jcp = running()
    jcp.feed(push(50))
    jcp.feed(size(60))
    changed = ev("JobSpecChanged", {**submitted().payload, "spec_version": 3, "command": ["serve", "--hand"]})
    spec = jcp.spec(jcp.feed(changed))
    assert spec["push"] is None and spec["stable_version"] == 3 and spec["tasks"] == 60
    assert spec["provenance"][0]["intent_type"] == "JobSpecChanged"


def test_a_stopped_job_takes_no_intents_and_a_new_incarnation_counts_generations_on():
    jcp = running()
    assert jcp.spec(jcp.feed(push(50)))["generation"] == 1
    assert jcp.feed(ev("JobStopped", {"job_id": JOB, "reason": ""})) == []
    assert refused(jcp.feed(push(60))) == [("PushIntentDeclared", jd.REASON_UNKNOWN_JOB)]
    again = submitted()
    jcp.feed(again)
    spec = jcp.spec(jcp.feed(push(20)))
    assert spec["generation"] == 2 and spec["submission_id"] == again.event_id and spec["spec_version"] == 2


T0 = 1_700_000_000_000  # every input's time (``ev``), unless ``at`` says otherwise
GC = 60_000  # a stopped job's grace in the tests below


def at(event, after_ms):
    """``event`` at ``after_ms`` past T0."""
    return dataclasses.replace(event, timestamp_ms=T0 + after_ms)


def test_a_stopped_job_leaves_after_its_grace_and_its_id_starts_anew():
    """Within the grace a stopped job is held (an intent is refused naming it stopped; a new incarnation counts its
    generations on); once its grace passed, by the time of the event naming it, it is gone whether collected or not:
    an intent is refused as for a job never seen, a submission is a new job (generation 1). ``Jcp.feed`` checks that
    deciding after ``collect`` gives the same events at every step."""
    jcp = Jcp(gc_ms=GC)
    jcp.feed(submitted())
    jcp.spec(jcp.feed(push(50)))
    jcp.feed(at(ev("JobStopped", {"job_id": JOB, "reason": ""}), 1_000))
    held = jcp.feed(at(push(60), 1_000 + GC - 1))
    assert refused(held) == [("PushIntentDeclared", jd.REASON_UNKNOWN_JOB)] and "(stopped)" in held[0].payload["message"]
    assert jd.collect(jcp.state, T0 + 1_000 + GC - 1, GC)[1] == []  # not yet
    gone = jcp.feed(at(push(60), 1_000 + GC))
    assert refused(gone) == [("PushIntentDeclared", jd.REASON_UNKNOWN_JOB)] and "(stopped)" not in gone[0].payload["message"]
    state, ids = jd.collect(jcp.state, T0 + 1_000 + GC, GC)
    assert ids == [JOB] and JOB not in state.jobs
    assert jd.collect(state, T0 + 10 * GC, GC) == (state, [])
    jcp.feed(at(submitted(), 2 * GC))
    spec = jcp.spec(jcp.feed(at(push(20), 2 * GC)))
    assert spec["generation"] == 1 and spec["spec_version"] == 2  # a new job: its own count


@pytest.mark.parametrize("live, ended_after_ms, now_after_ms, gone", [
    (True, None, 10 * GC, False),  # running: never
    (False, 0, GC - 1, False),  # stopped, within its grace
    (False, 0, GC, True),  # its grace passed
    (False, None, 10 * GC, False),  # not live, no end: a refused incarnation the JCP never took (kept as it was)
])
def test_which_jobs_collect_takes(live, ended_after_ms, now_after_ms, gone):
    job = jd.JobIntents(job_id=JOB, entitlement=ENT, live=live,
                        ended_ms=None if ended_after_ms is None else T0 + ended_after_ms)
    state = JcpState(jobs=JcpState().jobs.updated({JOB: job}))
    assert jd.is_expired(job, T0 + now_after_ms, GC) is gone
    assert jd.collect(state, T0 + now_after_ms, GC)[1] == ([JOB] if gone else [])


def test_a_refused_submission_ends_its_job_for_the_grace():
    jcp = Jcp(gc_ms=GC)
    sub = submitted()
    jcp.feed(sub)
    jcp.feed(at(ev("IntentRefused", {"intent_type": "JobSubmitted", "intent_event_id": sub.event_id, "job_id": JOB,
                                     "reason": "unknown_entitlement", "message": ""}, producer="scheduler"), 500))
    assert jcp.state.jobs[JOB].ended_ms == T0 + 500 and not jcp.state.jobs[JOB].live
    assert jd.collect(jcp.state, T0 + 500 + GC, GC)[1] == [JOB]


def test_a_submission_the_scheduler_refused_is_no_incarnation():
    jcp = Jcp()
    sub = submitted()
    jcp.feed(sub)
    jcp.feed(ev("IntentRefused", {"intent_type": "JobSubmitted", "intent_event_id": sub.event_id, "job_id": JOB,
                                  "reason": "unknown_entitlement", "message": ""}, producer="scheduler"))
    assert refused(jcp.feed(push(50))) == [("PushIntentDeclared", jd.REASON_UNKNOWN_JOB)]


REFUSED = {
    "unknown-job": (lambda: push(50), jd.REASON_UNKNOWN_JOB, False),
    "percent-over-100": (lambda: push(120), jd.REASON_INVALID_INTENT, True),
    "percent-off-plan": (lambda: push(30, steps=(10, 50)), jd.REASON_INVALID_INTENT, True),
    "empty-command": (lambda: push(30, command=[]), jd.REASON_INVALID_INTENT, True),
    "canary-of-none": (lambda: canary("start", 0), jd.REASON_INVALID_INTENT, True),
    "bad-action": (lambda: canary("restart", 1), jd.REASON_INVALID_INTENT, True),
    "negative-size": (lambda: size(-1), jd.REASON_INVALID_INTENT, True),
    "bounds-upside-down": (lambda: size(autoscale=True, lo=9, hi=3, per=1.0), jd.REASON_INVALID_INTENT, True),
    "no-load-per-task": (lambda: size(autoscale=True, lo=1, hi=3), jd.REASON_INVALID_INTENT, True),
    "zero-cpu": (lambda: resources(0), jd.REASON_INVALID_INTENT, True),
    "other-entitlement": (lambda: ev("PushIntentDeclared", {**push(50).payload}, ent="e2"),
                          jd.REASON_ENTITLEMENT_MISMATCH, True),
}


@pytest.mark.parametrize("make, reason, submit", REFUSED.values(), ids=REFUSED)
def test_refusals_are_events_naming_the_reason(make, reason, submit):
    jcp = running() if submit else Jcp()
    out = jcp.feed(make())
    assert [(e.type, e.payload["reason"]) for e in out] == [("IntentRefused", reason)]
    assert out[0].payload["message"]
    assert views.refused_field(out[0].payload["message"]), f"names no field: {out[0].payload['message']}"


def test_the_rules_table_names_every_rule_once():
    names = [r["rule"] for r in jd.rules_table()]
    assert len(names) == len(set(names)) and {r["kind"] for r in jd.rules_table()} == {"refuse", "base", "shape"}


def test_a_replayed_log_gives_the_same_outputs():
    inputs = [submitted(), push(50), size(60), canary("start", 2), size(autoscale=True, lo=60, hi=140, per=1.0),
              auto(140), canary("promote", promote_percent=50), resources(1500)]
    first = Jcp()
    outs = [e for i in inputs for e in first.feed(i)]
    state, again = jd.decide_all(JcpState(), [(e, ("intents", 0, n + 1)) for n, e in enumerate(inputs)])
    assert again == outs and state == first.state
    gens = [e.payload["generation"] for e in outs if e.type == "JobSpecReconciled"]
    assert gens == list(range(1, len(gens) + 1))


def test_the_ledger_says_what_became_of_each_intent_declared():
    """``views.ledger_rows`` over the log as the Job Control Plane left it: inputs and its outputs in log order."""
    jcp, log = running(), []
    for intent in (push(50, label="<b>v2</b>", owner="<i>eve</i>"), canary("promote"), size(80), push(50),
                   resources(0)):
        log.append(intent)
        log += jcp.feed(intent)
    log.append(push(60))  # on the log, not reconciled yet
    rows = views.ledger_rows(enumerate(log))
    assert [(r["dimension"], r["outcome"], r["generation"], r["reason"], r["field"]) for r in rows] == [
        ("push", views.APPLIED, 1, None, None),
        ("canary", views.REFUSED, None, jd.REASON_NO_CANARY, "action"),
        ("sizing", views.APPLIED, 2, None, None),
        ("push", views.APPLIED, 3, None, None),
        ("resources", views.REFUSED, None, jd.REASON_INVALID_INTENT, "resources.cpu_millicores"),
        ("push", views.DECLARED, None, None, None),
    ]
    assert rows[0]["wants"] == "50% on <b>v2</b>" and rows[0]["owner"] == "<i>eve</i>"  # as declared: the UI escapes
    assert rows[2]["wants"] == "80 tasks"


@pytest.mark.parametrize("message, field", [
    ("tasks: bob pins e1.web at 80 tasks", "tasks"),
    ("PushIntentDeclared: percent: at most 100 (a percentage), got 120", "percent"),
    ("resources.cpu_millicores: expected a positive integer", "resources.cpu_millicores"),
    ("command[0]: expected a string", "command[0]"),
    ("no job e1.x in entitlement e1", None),
    ("", None),
])
def test_the_field_a_refusal_names(message, field):
    assert views.refused_field(message) == field
