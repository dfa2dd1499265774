"""A job running several versions at once (processors/scheduler/versions.py): the push percentage, the canary and
sizing, as tables over the pure targets and as stories through the scheduler's decisions (the scheduler tests'
harness), checking after EVERY decision what the combined test of issue 15 checks on the replayed log: the push
version's share of the live non-canary tasks stays within one task of the percentage through shrinks and grows,
and a canary never takes a push target's task.
"""
import dataclasses
import random
from collections import deque

import pytest

from processors.scheduler import versions as vs
from processors.scheduler.decide import retry_unplaced
from processors.scheduler.reasons import REASON_STALE_GENERATION, REASON_STALE_SUBMISSION
from processors.scheduler.records import job_from_record, job_to_record
from test_scheduler_decide import (  # the scheduler tests' harness (tests/unit is on sys.path)
    Sim, commands, entitlement, ev, of_type, refusals, spec_changed, submit,
)

V1 = ("serve", "--v1")
V2 = ("serve", "--v2")
V3 = ("serve", "--canary")


def reconciled(job="j", tasks=10, *, generation=1, percent=None, canary=0, submission=None, max_unavailable=2,
               spec_version=None, cpu=1000):
    """A JobSpecReconciled as the Job Control Plane writes it: v1 stable, v2 pushed at ``percent``, v3 canary."""
    versions = [{"version": 1, "label": "v1", "command": list(V1), "env": {}}]
    push = canary_ = None
    if percent is not None:
        versions.append({"version": 2, "label": "v2", "command": list(V2), "env": {}})
        push = {"version": 2, "percent": percent, "steps": []}
    if canary:
        versions.append({"version": 3, "label": "c", "command": list(V3), "env": {}})
        canary_ = {"version": 3, "count": canary}
    p = {"job_id": job, "submission_id": submission or "", "generation": generation,
         "spec_version": spec_version or max(v["version"] for v in versions), "tasks": tasks, "name": job,
         "resources": {"cpu_millicores": cpu, "memory_mib": 1024}, "requirements": {}, "spread": "msb",
         "max_unavailable": max_unavailable, "controller": None, "versions": versions, "stable_version": 1,
         "push": push, "canary": canary_, "provenance": [], "rules": []}
    return ev("JobSpecReconciled", p, producer="jobcontrol", entity=job)


# -- the targets, pure ------------------------------------------------------------------------------------------

def test_push_order_interleaves():
    assert sorted(range(8), key=vs.push_key) == [0, 4, 2, 6, 1, 5, 3, 7]


@pytest.mark.parametrize("percent, n, want", [(50, 100, 50), (50, 99, 50), (50, 98, 49), (10, 5, 1), (10, 4, 0),
                                              (0, 9, 0), (100, 9, 9), (33, 3, 1), (25, 2, 1)])
def test_round_half_up(percent, n, want):
    assert vs.round_half_up(percent, n) == want


def mix(percent=50, canary=0, picks=()):
    codes = (vs.Code(1, "v1", V1), vs.Code(2, "v2", V2), vs.Code(3, "c", V3))
    return vs.Mix(1, "", codes, stable=1, push=2 if percent is not None else None, percent=percent or 0,
                  canary=3 if canary else None, canary_count=canary, canary_tasks=tuple(picks))


TARGETS = {  # (percent, canary, desired) -> (push count, canary count)
    "half-of-100": (50, 0, 100, 50, 0),
    "half-of-98-with-2-canaries": (50, 2, 100, 49, 2),
    "all": (100, 0, 7, 7, 0),
    "all-with-canary": (100, 1, 7, 6, 1),
    "none": (0, 2, 7, 0, 2),
    "canary-larger-than-the-job": (50, 9, 4, 0, 4),
    "ten-percent-of-61": (10, 1, 62, 6, 1),
}


@pytest.mark.parametrize("percent, canary, desired, pushed, canaries", TARGETS.values(), ids=TARGETS)
def test_targets_count_the_push_among_the_non_canary_tasks(percent, canary, desired, pushed, canaries):
    m = vs.pick_canaries(mix(percent, canary), desired)
    got = vs.targets(m, desired)
    assert sorted(got) == list(range(desired))
    assert sum(v == 2 for v in got.values()) == pushed and sum(v == 3 for v in got.values()) == canaries


def test_a_higher_percentage_only_adds_push_targets():
    rng = random.Random(15)
    for _ in range(200):
        n, a = rng.randint(1, 300), rng.randint(0, 100)
        b = rng.randint(a, 100)
        low = {i for i, v in vs.targets(mix(a), n).items() if v == 2}
        high = {i for i, v in vs.targets(mix(b), n).items() if v == 2}
        assert low <= high, (n, a, b)


def test_at_half_any_prefix_keeps_half_within_one_task():
    """A shrink keeps a prefix of indices: the targets of a job of n restricted to [0, k) are within one task of
    the targets a job of k has, so a shrink moves at most a task or so to another version."""
    for n in range(1, 200):
        targets = vs.targets(mix(50), n)
        for k in range(1, n + 1):
            pushed = sum(targets[i] == 2 for i in range(k))
            assert abs(pushed - k / 2) <= 1, (n, k)


def test_canary_picks_are_never_push_targets_and_stick_through_sizing():
    rng = random.Random(7)
    m = mix(50, 2)
    n = 100
    for _ in range(300):
        n = max(3, n + rng.randint(-30, 30))
        before = m.canary_tasks
        m = vs.pick_canaries(m, n)
        assert len(m.canary_tasks) == 2 and all(i < n for i in m.canary_tasks)
        assert set(before) & set(range(n)) <= set(m.canary_tasks)  # a live canary stays one
        no_canary = vs.targets(vs.replace(m, canary=None, canary_count=0, canary_tasks=()), n)
        pushed_without = sum(v == 2 for v in no_canary.values())
        targets = vs.targets(m, n)
        assert all(targets[i] == 3 for i in m.canary_tasks)
        assert sum(v == 2 for v in targets.values()) == vs.round_half_up(50, n - 2)
        # the picks are where the push would go last: never among the targets of the push without canaries
        # beyond the one or two the smaller non-canary count gives up
        assert pushed_without - sum(v == 2 for v in targets.values()) <= 1


def test_the_mix_survives_a_table_round_trip():
    sim = settle_job(20)
    sim.feed(reconciled(tasks=20, percent=50, canary=2, submission=sim.submission))
    job = sim.state.jobs["j"]
    assert job.mix is not None and len(job.mix.canary_tasks) == 2
    assert job_from_record(job_to_record(job)) == job


# -- stories through the scheduler -------------------------------------------------------------------------------

class Region:
    """Plays the allocator (a machine per task, from an endless pool) and the agents (every START runs, every
    STOP stops), feeding each answer back and checking ``check`` after every decision."""

    def __init__(self, sim, check=lambda sim: None):
        self.sim = sim
        self.check = check
        self.next_machine = 1
        self.decisions = 0

    def placement(self, task):
        m = self.next_machine
        self.next_machine += 1
        return {"task_id": task, "machine_id": f"m{m}", "dc": "dc1", "msb": f"msb{m % 3}", "rack": f"r{m % 7}"}

    def reactions(self, out):
        for e in out:
            p = e.payload
            if e.type == "AllocationRequested" and p["place_task_ids"]:
                yield ev("TasksAllocated", {"request_id": p["request_id"], "job_id": p["job_id"],
                                            "placements": [self.placement(t) for t in p["place_task_ids"]]},
                         producer="allocator", entity=p["request_id"])
        rows = []
        for c in commands(out):
            if c["command"] in ("START", "RESTART"):
                rows += [dict(c, state="STARTING"), dict(c, state="RUNNING")]
            else:
                rows.append(dict(c, state="STOPPED"))
        if rows:
            yield ev("TaskStatesChanged", {"reports": [
                {"report_id": f"r-{next_id()}", "task_id": r["task_id"], "job_id": r["task_id"].rsplit("/", 1)[0],
                 "machine_id": r["machine_id"], "state": r["state"], "previous_state": "STARTING",
                 "exit_code": 0 if r["state"] == "STOPPED" else None, "spec_version": r["spec_version"],
                 "reason": "", "cause_id": None} for r in rows]}, producer="agent/simulated", entity=rows[0]["task_id"])

    def run(self, out):
        queue = deque(self.reactions(out))
        while True:
            while queue:
                out = self.sim.feed(queue.popleft())
                self.decisions += 1
                self.check(self.sim)
                queue.extend(self.reactions(out))
            self.sim.now += 1000  # the timer: throttled operations, parked tasks
            self.sim.state, out = retry_unplaced(self.sim.state, self.sim.now)
            self.check(self.sim)
            queue.extend(self.reactions(out))
            if not queue:
                return


_counter = iter(range(10**9))


def next_id():
    return next(_counter)


def settle_job(n, max_unavailable=2):
    sim = Sim()
    sim.feed(entitlement())
    sub = submit("j", n, command=V1, max_unavailable=max_unavailable)
    out = sim.feed(sub)
    sim.submission = sub.event_id
    Region(sim).run(out)
    assert all(t["state"] == "RUNNING" and t["spec_version"] == 1 for t in sim.view()["tasks"])
    return sim


def live_versions(sim):
    view = sim.view()
    return {int(t["id"].rsplit("/", 1)[1]): t["spec_version"] for t in view["tasks"]}, view["desired_tasks"]


class Share:
    """The combined test's check, after every decision once the push has converged: among the live tasks (index <
    desired) not on the canary version, those on the push version are within one task of the percentage; at most
    ``canary`` tasks on the canary version, and never a task going from the push version to the canary's."""

    def __init__(self, percent, canary):
        self.percent, self.canary = percent, canary
        self.armed = False
        self.seen: dict[int, int] = {}
        self.checked = 0
        self.sizes = set()

    def __call__(self, sim):
        versions, desired = live_versions(sim)
        for i, v in versions.items():
            assert not (self.seen.get(i) == 2 and v == 3), f"task {i} went from the push to the canary"
            self.seen[i] = v
        live = {i: v for i, v in versions.items() if i < desired}
        non_canary = [v for v in live.values() if v != 3]
        pushed = sum(v == 2 for v in non_canary)
        within = abs(pushed - self.percent * len(non_canary) / 100) <= 1
        if not self.armed:
            self.armed = within and sum(v == 3 for v in live.values()) == self.canary
            return
        assert within, f"{pushed} of {len(non_canary)} non-canary tasks on the push version"
        assert sum(v == 3 for v in live.values()) <= self.canary
        self.checked += 1
        self.sizes.add(desired)


def test_a_50_percent_push_holds_within_one_task_while_the_job_is_sized_100_60_140_with_a_2_task_canary():
    sim = settle_job(100, max_unavailable=10)
    share = Share(50, 0)
    region = Region(sim, share)
    gen = iter(range(1, 100))
    region.run(sim.feed(reconciled(tasks=100, percent=50, generation=next(gen), submission=sim.submission,
                                   max_unavailable=10)))
    versions, _ = live_versions(sim)
    assert sum(v == 2 for v in versions.values()) == 50 and share.armed
    share.canary = 2
    share.armed = False
    region.run(sim.feed(reconciled(tasks=100, percent=50, canary=2, generation=next(gen), submission=sim.submission,
                                   max_unavailable=10)))
    assert share.armed
    for size in (90, 75, 60, 60, 80, 100, 120, 140, 133, 140):
        region.run(sim.feed(reconciled(tasks=size, percent=50, canary=2, generation=next(gen),
                                       submission=sim.submission, max_unavailable=10)))
        versions, desired = live_versions(sim)
        assert desired == size and len(versions) == size
        assert sum(v == 3 for v in versions.values()) == 2
        assert sum(v == 2 for v in versions.values()) == vs.round_half_up(50, size - 2)
    assert share.checked > 50 and {60, 140} <= share.sizes
    view = sim.view()
    assert view["mix"]["push"] == {"version": 2, "percent": 50, "steps": []}
    assert all(t["state"] == "RUNNING" for t in view["tasks"])


def test_a_resize_by_hand_keeps_the_push_percentage():
    sim = settle_job(20)
    region = Region(sim)
    region.run(sim.feed(reconciled(tasks=20, percent=50, submission=sim.submission)))
    share = Share(50, 0)
    region.check = share
    share(sim)
    assert share.armed
    region.run(sim.feed(ev("JobResized", {"job_id": "j", "tasks": 9}, producer="cli", entity="j")))
    region.run(sim.feed(ev("JobResized", {"job_id": "j", "tasks": 31}, producer="cli", entity="j")))
    versions, desired = live_versions(sim)
    assert desired == 31 and sum(v == 2 for v in versions.values()) == 16


def test_commands_carry_each_versions_argv():
    sim = settle_job(4)
    out = sim.feed(reconciled(tasks=6, percent=50, submission=sim.submission))
    placed = next(e for e in out if e.type == "AllocationRequested")
    out = sim.feed(ev("TasksAllocated", {"request_id": placed.payload["request_id"], "job_id": "j", "placements": [
        {"task_id": t, "machine_id": f"n{t[-1]}", "dc": "dc1", "msb": "msb1", "rack": "r1"}
        for t in placed.payload["place_task_ids"]]}, producer="allocator", entity="x"))
    batches = of_type(out, "TasksCommanded")
    by_version = {c["spec_version"]: b.payload["argv"] for b in batches for c in b.payload["commands"]}
    # 3 of 6 on v2: the first in push order, 0, 4, 2; the new tasks j/4 (a target) and j/5 (not) start their own
    assert by_version == {1: list(V1), 2: list(V2)}
    assert {c["task_id"]: c["spec_version"] for c in commands(out)} == {"j/4": 2, "j/5": 1}


def test_a_spec_change_by_hand_ends_the_mix_and_rolls_everything_to_it():
    sim = settle_job(4)
    region = Region(sim)
    region.run(sim.feed(reconciled(tasks=4, percent=50, submission=sim.submission)))
    region.run(sim.feed(spec_changed("j", 4, version=5, command=("serve", "--v5"))))
    assert sim.view()["mix"] is None
    assert {t["spec_version"] for t in sim.view()["tasks"]} == {5}


def test_stale_reconciliations_are_refused():
    sim = settle_job(4)
    sim.feed(reconciled(tasks=4, percent=50, generation=3, submission=sim.submission))
    assert refusals(sim.feed(reconciled(tasks=4, percent=100, generation=2, submission=sim.submission))) == [
        ("JobSpecReconciled", REASON_STALE_GENERATION)]
    assert refusals(sim.feed(reconciled(tasks=4, percent=100, generation=4, submission="another"))) == [
        ("JobSpecReconciled", REASON_STALE_SUBMISSION)]
    assert refusals(sim.feed(reconciled(tasks=4, percent=120, generation=5, submission=sim.submission))) == [
        ("JobSpecReconciled", "invalid_spec")]


UNLISTED = {  # a JobSpecReconciled naming a version its versions do not list -> the field the refusal names
    "stable": (lambda p: {**p, "stable_version": 9}, "stable_version"),
    "push": (lambda p: {**p, "push": {**p["push"], "version": 9}}, "push.version"),
    "canary": (lambda p: {**p, "canary": {**p["canary"], "version": 9}}, "canary.version"),
}


@pytest.mark.parametrize("unlist, field", UNLISTED.values(), ids=UNLISTED)
def test_a_reconciliation_naming_a_version_it_does_not_list_is_refused(unlist, field):
    """The scheduler takes the job's spec from the code of the push's version (else the stable one's): a version
    the payload does not list has no code, so the rules (processors/rules.py) refuse it before, naming the field,
    and the job keeps what it runs."""
    sim = settle_job(4)
    good = reconciled(tasks=4, percent=50, canary=1, submission=sim.submission)
    before = sim.state.jobs["j"]
    out = sim.feed(dataclasses.replace(good, payload=unlist(good.payload)))
    assert refusals(out) == [("JobSpecReconciled", "invalid_spec")]
    assert f"{field}: no such version in versions ([1, 2, 3])" in of_type(out, "IntentRefused")[0].payload["message"]
    assert sim.state.jobs["j"].mix is None and sim.state.jobs["j"].spec == before.spec
    assert not commands(out)
