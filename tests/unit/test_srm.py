"""The autoscaler's pure decisions (processors/srm/decide.py) and the load trace the simulated agents emit
(processors/agent/load.py): the forecast, the rules of its table one by one, and a whole compressed day."""
import dataclasses

import pytest

from processors.agent.load import DailyTrace, LoadSpecError, TraceClock, parse_job_load
from processors.srm import decide as srm
from processors.srm.decide import DOWN, UP, JobScaling, SrmState, Tuning, decide
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
JOB, ENT = "e1.web", "e1"
MIN = 60_000
_n = iter(range(10**9))


def ev(type_, payload, producer="cli"):
    return new_event(type_, {"job_id": JOB, **payload}, entitlement=ENT, entity_id=JOB, producer=producer,
                     timestamp_ms=1_700_000_000_000, event_id=f"in-{type_}-{next(_n)}")


def policy(lo=60, hi=140, per=1.0):
    return ev("SizingIntentDeclared", {"owner": "bob", "source": "person", "tasks": None, "autoscale": True,
                                       "min_tasks": lo, "max_tasks": hi, "load_per_task": per, "decision": None})


def sample(at_ms, load, running=0):
    return ev("JobLoadReported", {"at_ms": at_ms, "load": load, "running_tasks": running, "unit": "load"},
              producer="agent/simulated")


def reconciled(tasks):
    return ev("JobSpecReconciled", {"tasks": tasks}, producer="jobcontrol")


class Srm:
    def __init__(self, tuning=Tuning(), size=100):
        self.state, self.tuning = SrmState(), tuning
        self.decisions = []
        self.feed(policy())
        self.feed(reconciled(size))

    def feed(self, e, live=True):
        new, out = decide(self.state, e, live=live, tuning=self.tuning)
        assert decide(self.state, e, live=live, tuning=self.tuning) == (new, out)
        collected, gone = srm.collect(self.state, e.timestamp_ms, self.tuning)
        if gone:  # no decision depends on when ``collect`` ran
            after, out_after = decide(collected, e, live=live, tuning=self.tuning)
            assert out_after == out and {j: v for j, v in new.jobs.items() if j not in gone or v is not
                                         self.state.jobs.get(j)} == dict(after.jobs.items())
        for o in out:
            REG.encode(o.type, o.to_record(schema_version=1))
            assert o.producer == srm.PRODUCER and o.causation_id == e.event_id
            self.decisions.append(o.payload["decision"] | {"tasks": o.payload["tasks"]})
            new, _ = decide(new, o, tuning=self.tuning)  # read back: a fact
        self.state = new
        return out

    @property
    def job(self):
        return self.state.jobs[JOB]


def test_the_forecast_projects_a_rising_load_and_remembers_the_day():
    s = Srm()
    for k in range(6):
        s.feed(sample(k * 10 * MIN, 100 + 10 * k), live=False)
    f = srm.forecast(s.job, 50 * MIN, s.tuning)
    assert f["recent"] > s.job.ewma > 100  # rising: projected over the hour
    # a day later at the same hour, the history says what comes
    quiet = Srm()
    for k in range(96):
        quiet.feed(sample(k * 15 * MIN, 150 if 40 <= k < 44 else 80), live=False)
    f = srm.forecast(quiet.job, (96 + 36) * 15 * MIN, quiet.tuning)
    assert f["historical"] == pytest.approx(150, rel=0.2) and f["forecast"] >= f["historical"]


RULES = {  # samples (minute, load), then the verdict of the last one: (rule, tasks) or None
    "warming-up": ([(0, 200), (1, 200)], None),
    "scale-up-at-once": ([(0, 150), (1, 150), (2, 150)], ("scale_up", 140)),
    "hysteresis-holds-a-small-drop": ([(0, 97), (1, 97), (2, 97)], None),
    "scale-down": ([(0, 70), (1, 70), (2, 70)], ("scale_down", 70)),
    "clamped-to-min": ([(0, 10), (1, 10), (2, 10)], ("scale_down", 60)),
}


@pytest.mark.parametrize("samples, want", RULES.values(), ids=RULES)
def test_rules(samples, want):
    s = Srm()
    out = []
    for minute, load in samples:
        out = s.feed(sample(minute * MIN, load))
    got = (out[0].payload["decision"]["rule"], out[0].payload["tasks"]) if out else None
    assert got == want


def test_no_scale_down_within_the_hour_of_a_scale_up_nor_within_the_cooldown():
    s = Srm(size=100)
    for m in range(3):
        s.feed(sample(m * MIN, 130))
    assert [d["direction"] for d in s.decisions] == [UP]
    for m in range(3, 50):
        assert s.feed(sample(m * MIN, 70)) == []  # < 1 h after the scale-up
    s.feed(sample(63 * MIN, 70))
    assert [d["direction"] for d in s.decisions] == [UP, DOWN] and s.decisions[-1]["rule"] == "scale_down"
    assert s.decisions[-1]["machines_freed"] == s.decisions[-1]["current_tasks"] - s.decisions[-1]["tasks"] > 50
    for m in range(64, 90):
        assert s.feed(sample(m * MIN, 30)) == []  # 30 min cooldown after a change (and it was a reversal)


def test_no_policy_no_decision_and_a_stopped_job_starts_over():
    s = Srm()
    s.feed(ev("SizingIntentDeclared", {"owner": "bob", "source": "person", "tasks": 80, "autoscale": False,
                                       "min_tasks": None, "max_tasks": None, "load_per_task": None,
                                       "decision": None}))
    for m in range(5):
        assert s.feed(sample(m * MIN, 300)) == []
    s.feed(ev("JobStopped", {"reason": ""}))
    assert s.job.policy is None and s.job.samples == 0
    assert any(h is not None for h in s.job.history)  # its day's shape kept, for its next incarnation


def test_a_stopped_job_that_learned_nothing_leaves_the_state():
    """Issue #29: the SRM kept every job it ever saw stop. One that never reported load leaves at its stop; its next
    incarnation starts as a job never seen would (the same decisions: nothing of it was kept either way)."""
    s = Srm()
    s.feed(ev("JobStopped", {"reason": ""}))
    assert JOB not in s.state.jobs
    s.feed(policy())
    s.feed(reconciled(100))
    fresh = Srm()
    same = lambda job: dataclasses.replace(job, policy=dataclasses.replace(job.policy, event_id=""))  # noqa: E731
    assert same(s.job) == same(fresh.job) and list(s.state.jobs) == [JOB]


def test_a_compressed_day_goes_100_to_60_to_140_with_at_most_one_reversal_an_hour():
    """What the combined test replays: a trace of 100 at midnight, 50 at 4h, 150 at 16h, a sample every 12 trace
    minutes with 2 % noise, sized within 60..140; the job follows the autoscaler's decisions."""
    trace = DailyTrace.parse("0:100,4:50,16:150,24:100", noise=0.02, seed=3)
    s = Srm(size=100)
    for k in range(0, 24 * 5 + 1):
        at = k * 12 * MIN
        s.feed(sample(at, trace.load(at)))
    sizes = [d["tasks"] for d in s.decisions]
    assert min(sizes) == 60 and max(sizes) == 140
    assert sizes.index(60) < sizes.index(140)
    flips = srm.reversals(s.decisions)
    assert 1 <= len(flips) and srm.most_in_window(flips, 60 * MIN) <= 1
    assert all(d["forecast"] >= d["load"] for d in s.decisions)


def test_the_trace_and_its_spec():
    trace = DailyTrace.parse("0:100,4:60,16:140,24:100")
    assert trace.load(0) == 100 and trace.load(4 * 60 * MIN) == 60 and trace.load(16 * 60 * MIN) == 140
    assert trace.load(24 * 60 * MIN) == 100 and 60 < trace.load(2 * 60 * MIN) < 100
    noisy = DailyTrace.parse("0:100,24:100", noise=0.1, seed=1)
    assert all(90 <= noisy.load(m * MIN) <= 110 for m in range(0, 1440, 7))
    assert noisy.load(5 * MIN) == DailyTrace.parse("0:100,24:100", noise=0.1, seed=1).load(5 * MIN)
    clock = TraceClock(1000, 0, speed=60)
    assert clock.trace_ms(2000) == 60_000
    load = parse_job_load("e1.web=speed=2880;noise=0.02;start_hour=1", 0)
    assert load.entitlement == "e1" and load.clock.trace_start_ms == 60 * MIN
    e = load.sample(1000, 7, "agent/simulated")
    REG.encode(e.type, e.to_record(schema_version=1))
    assert e.payload["at_ms"] == 60 * MIN + 2880 * 1000 and e.payload["running_tasks"] == 7
    for bad in ("web=speed=2", "e1.web=fast=2", "e1.web=knots=1:5,24:5", "e1.web=speed=-1", "e1.web=noise=x"):
        with pytest.raises(LoadSpecError):
            parse_job_load(bad, 0)


@pytest.mark.parametrize("name, samples, want", [
    # the dry run says what the next sample's decision would be, without declaring it
    ("warming up", [(0, 100.0)], ("hold", "warming_up", 100)),
    ("a peak coming", [(k * MIN, 100.0 + 40 * k) for k in range(3)], (UP, "scale_up", 140)),
    ("held after its own scale-up", [(k * MIN, 100.0 + 40 * k) for k in range(4)], ("hold", "hold_same", 140)),
    ("off-peak within the band", [(k * MIN, 97.0) for k in range(4)], ("hold", "hysteresis", 100)),
])
def test_a_dry_run_says_what_the_srm_would_decide_now_and_declares_nothing(name, samples, want):
    s = Srm()
    for at, load in samples[:-1]:
        s.feed(sample(at, load))
    last = samples[-1]
    dry_state = s.state
    s.state, _ = decide(s.state, sample(*last), live=False)  # folded as a catching-up worker: no decision
    got = srm.dry_run(s.job)
    assert (got["direction"], got["rule"], got["tasks"]) == want, name
    assert got["says"] == srm.SAYS[got["rule"]] and got["dry_run"] and got["at_ms"] == last[0]
    live = decide(dry_state, sample(*last))[1]  # the same sample, live: the decision the dry run foretold
    assert [(o.payload["tasks"], o.payload["decision"]["rule"]) for o in live] == (
        [] if want[0] == "hold" else [(want[2], want[1])])


def test_a_dry_run_of_a_job_without_samples_names_the_first_rule_that_holds():
    assert srm.dry_run(srm.JobScaling(JOB, ENT))["rule"] == "no_policy"
    s = Srm()
    assert (srm.dry_run(s.job)["rule"], srm.dry_run(s.job)["tasks"]) == ("warming_up", 100)


DAY = 24 * 3600_000


def at(e, ms):
    return dataclasses.replace(e, timestamp_ms=ms)


def test_a_stopped_jobs_learned_day_is_kept_a_week_then_gone_whether_or_not_collected():
    """Issue #29: a stopped job that reported load kept its day's shape for ever (a job id each). Now for
    ``shape_keep_ms`` of log time after its stop, judged by the time of the event that names it: an incarnation within
    the week finds its shape; one after it starts as a job never seen would, and ``collect`` running before it or not
    changes nothing."""
    t0 = 1_700_000_000_000
    s = Srm()
    for m in range(5):
        s.feed(at(sample(m * MIN, 300), t0))
    s.feed(at(ev("JobStopped", {"reason": ""}), t0 + MIN))
    shape = s.job.history
    assert s.job.ended_ms == t0 + MIN and any(h is not None for h in shape)
    s.feed(at(ev("JobStopped", {"reason": ""}), t0 + 2 * MIN))  # read twice: the week counts from the first
    assert s.job.ended_ms == t0 + MIN
    s.feed(at(sample(6 * MIN, 300), t0 + 3 * MIN))  # a late sample of the stopped job: learned, still stopped
    assert s.job.ended_ms == t0 + MIN
    week = s.tuning.shape_keep_ms
    assert srm.collect(s.state, t0 + MIN + week - 1, s.tuning)[1] == []
    expired = t0 + MIN + week
    collected, gone = srm.collect(s.state, expired, s.tuning)
    assert gone == [JOB] and JOB not in collected.jobs
    for state in (s.state, collected):  # the next incarnation, after the week: as a job never seen
        new, _ = decide(state, at(reconciled(100), expired), tuning=s.tuning)
        assert new.jobs[JOB] == JobScaling(JOB, ENT, current=100, heard_ms=expired)
    s.feed(at(reconciled(100), expired))  # through the harness: collected first or not, the same
    assert s.job == JobScaling(JOB, ENT, current=100, heard_ms=expired)
    s = Srm()
    for m in range(5):
        s.feed(at(sample(m * MIN, 300), t0))
    s.feed(at(ev("JobStopped", {"reason": ""}), t0 + MIN))
    within, _ = decide(s.state, at(reconciled(100), expired - 1), tuning=s.tuning)  # within it: the shape, live
    assert within.jobs[JOB].history == s.job.history and within.jobs[JOB].ended_ms is None
    held, _ = decide(within, at(policy(), expired), tuning=s.tuning)
    assert srm.collect(held, expired + 10 * week, s.tuning)[1] == []  # a job a policy holds is never collected


def test_a_sample_of_a_job_gone_makes_an_entry_that_leaves_after_a_week_of_silence():
    """Issue #29's last SRM door: a load sample of a job the SRM no longer holds (stopped and collected, or stopped
    before it learned anything) made a live entry that never ended, one per such job. No person's policy holds it,
    so it leaves once nothing named it for ``shape_keep_ms`` of log time (collected or not: the same), as does any
    job no policy holds; each new event that names it counts the week again."""
    t0 = 1_700_000_000_000
    week = Tuning().shape_keep_ms
    s = Srm()
    s.feed(at(ev("JobStopped", {"reason": ""}), t0))  # it learned nothing: it leaves at its stop
    assert JOB not in s.state.jobs
    s.feed(at(sample(MIN, 300, running=3), t0 + MIN))  # late: a new entry, no policy, no stop
    assert s.job.policy is None and s.job.ended_ms is None and s.job.heard_ms == t0 + MIN
    s.feed(at(sample(2 * MIN, 300, running=3), t0 + MIN + week - 1))  # heard within the week: kept, counted anew
    assert srm.collect(s.state, t0 + MIN + week, s.tuning)[1] == []
    last = t0 + MIN + week - 1
    collected, gone = srm.collect(s.state, last + week, s.tuning)
    assert gone == [JOB] and JOB not in collected.jobs
    s.feed(at(reconciled(50), last + week))  # through the harness: decided as a job never seen, collected or not
    assert s.job == JobScaling(JOB, ENT, current=50, heard_ms=last + week)


@pytest.mark.parametrize("held, heard, ended, gone", [
    (True, None, None, False),  # a policy, nothing heard yet
    (True, -10 * DAY, None, False),  # a policy holds it however long it is silent
    (False, -7 * DAY + 1, None, False),  # no policy, heard within the week
    (False, -7 * DAY, None, True),  # no policy, a week of silence
    (False, None, None, False),  # never named (a state from before this rule): kept
    (True, 0, -7 * DAY, True),  # stopped a week ago: gone, policy or not (a stop drops the policy anyway)
    (False, 0, -7 * DAY + 1, False),  # stopped within the week, heard since
])
def test_when_an_entry_of_the_srm_is_gone(held, heard, ended, gone):
    now = 1_700_000_000_000
    job = JobScaling(JOB, ENT, policy=srm.Policy(1, 2, 1.0, "p") if held else None,
                     heard_ms=None if heard is None else now + heard, ended_ms=None if ended is None else now + ended)
    assert srm.is_expired(job, now, Tuning()) is gone
