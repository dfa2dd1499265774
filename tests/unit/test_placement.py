"""Table-driven tests of the allocator's pure placement pipeline."""
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from processors.allocator.placement import (
    CONFLICT_CAPACITY, CONFLICT_OWNER, CONFLICT_STATUS, CONFLICT_VERSION, FILTER_AVOIDED, FILTER_CPU, FILTER_DC,
    FILTER_MACHINE_TYPE, FILTER_MEMORY, FILTER_OTHER_ENTITLEMENT, FILTER_STATUS, LIVE, NO_FEASIBLE_MACHINE,
    QUOTA_EXCEEDED, SCORE_CHOICES, SCORES, Policy, commit_check, existing_bins, fault_domain, filter_machines, place,
    plan_of, release, run_policy, select, select_scored,
)
from allocator_log import CPU, MEM, e1, m, req
from processors.allocator.decide import in_decision_order


def six_over_three_msbs(ent=None, used=()):
    """a1 a2 in msb1, b1 b2 in msb2, c1 c2 in msb3; each machine in ``used`` runs one task already."""
    return [m(f"{x}{i}", msb=f"msb{n}", ent=ent, used_cpu=CPU * (f"{x}{i}" in used))
            for n, x in enumerate("abc", 1) for i in (1, 2)]


# (machines, entitlement, request, held_machine_count, expected Plan fields)
CASES = {
    # Figure 7: job D starts in an empty entitlement; M7 joins it and both tasks stack on it.
    "fig7-start-D": (
        [m("M7"), m("M8"), m("M9")], e1(quota=3), req(2, job="D", spread="dc"), 0,
        dict(placements=(("D/0", "M7"), ("D/1", "M7")), machines_added=("M7",), fault_domain_bins={"dc1": 2},
             unplaced=(), reason=None, message=None)),
    # Figure 7: job E stacks one task on M7 (held) and adds M8 from the free pool for the other.
    "fig7-start-E": (
        [m("M7", ent="e1", used_cpu=2000, used_mem=4096), m("M8"), m("M9")], e1(quota=3),
        req(2, job="E", cpu=1500, spread="dc"), 1,
        dict(placements=(("E/0", "M7"), ("E/1", "M8")), machines_added=("M8",), reason=None)),
    "spread-6-tasks-over-3-msbs": (
        six_over_three_msbs(), e1(), req(6), 0,
        dict(placements=(("j/0", "a1"), ("j/1", "b1"), ("j/2", "c1"), ("j/3", "a1"), ("j/4", "b1"),
                         ("j/5", "c1")),
             machines_added=("a1", "b1", "c1"),
             fault_domain_bins={"dc1/msb1": 2, "dc1/msb2": 2, "dc1/msb3": 2})),
    "spread-counts-existing-placements": (
        # j/0 moves away from c2, so only j/8 and j/9 count: msb3 is the emptiest bin.
        six_over_three_msbs("e1", used=("a1", "b1")), e1(), req(3, existing={"j/9": "a1", "j/8": "b1", "j/0": "c2"}),
        6, dict(placements=(("j/0", "c1"), ("j/1", "a1"), ("j/2", "b1")),
                fault_domain_bins={"dc1/msb1": 2, "dc1/msb2": 2, "dc1/msb3": 1})),
    "spread-by-rack": (
        [m("a", rack="r1"), m("b", rack="r2"), m("c", msb="msb2", rack="r1")], e1(), req(3, spread="rack"), 0,
        dict(placements=(("j/0", "a"), ("j/1", "b"), ("j/2", "c")),
             fault_domain_bins={"dc1/msb1/r1": 1, "dc1/msb1/r2": 1, "dc1/msb2/r1": 1})),
    "stack-on-held-before-taking-free": (
        [m("free1"), m("held", ent="e1", used_cpu=1000)], e1(), req(3, spread="dc"), 1,
        dict(placements=(("j/0", "held"), ("j/1", "held"), ("j/2", "held")), machines_added=())),
    "pack-the-fullest-held-machine": (
        [m("roomy", ent="e1"), m("full", ent="e1", used_cpu=2500)], e1(), req(1), 2,
        dict(placements=(("j/0", "full"),))),
    "machine-type-unmet": (
        [m("b1", type="broadwell"), m("b2", type="broadwell"), m("b3", type="broadwell"),
         m("s1", status="DOWN")],
        e1(), req(2, requirements={"machine_type": "skylake"}), 0,
        dict(placements=(), unplaced=("j/0", "j/1"), reason=NO_FEASIBLE_MACHINE,
             filter_rejections={FILTER_STATUS: 1, FILTER_MACHINE_TYPE: 3},
             message="no machine fits a task of 1000m cpu and 2048 MiB, machine_type=skylake "
                     "(2 of 2 tasks of job j unplaced); machines rejected: 1 machine_not_up, "
                     "3 machine_type_mismatch")),
    "entitlement-machine-type": (
        [m("b1", type="broadwell"), m("s1")], e1(machine_type="skylake"), req(1), 0,
        dict(placements=(("j/0", "s1"),), filter_rejections={FILTER_MACHINE_TYPE: 1})),
    "dc-pin": (
        [m("a", dc="dc1"), m("b", dc="dc1"), m("c", dc="dc2")], e1(dc_pin="dc2"), req(2), 0,
        dict(placements=(("j/0", "c"), ("j/1", "c")), filter_rejections={FILTER_DC: 2},
             fault_domain_bins={"dc2/msb1": 2})),
    "dc-requirement": (
        [m("a", dc="dc1"), m("c", dc="dc2")], e1(), req(1, requirements={"dc": "dc1"}), 0,
        dict(placements=(("j/0", "a"),), filter_rejections={FILTER_DC: 1})),
    "quota-lets-one-more-machine-join": (
        [m("h1", ent="e1", cpu=2000), m("f1", cpu=2000), m("f2", cpu=2000)], e1(quota=4),
        req(4, spread="dc"), 3,
        dict(placements=(("j/0", "h1"), ("j/1", "h1"), ("j/2", "f1"), ("j/3", "f1")), machines_added=("f1",),
             unplaced=(), reason=None)),
    "quota-exceeded-unplaced": (
        [m("h1", ent="e1", cpu=2000), m("f1", cpu=2000), m("f2", cpu=2000)], e1(quota=4),
        req(5, spread="dc"), 3,
        dict(placements=(("j/0", "h1"), ("j/1", "h1"), ("j/2", "f1"), ("j/3", "f1")), machines_added=("f1",),
             unplaced=("j/4",), reason=QUOTA_EXCEEDED,
             message="entitlement e1 holds 4 of 4 machines; raise its quota or free capacity "
                     "(1 of 5 tasks of job j unplaced)")),
    "capacity-runs-out": (
        [m("h1", ent="e1", cpu=2000)], e1(), req(3), 1,
        dict(placements=(("j/0", "h1"), ("j/1", "h1")), unplaced=("j/2",), reason=NO_FEASIBLE_MACHINE,
             filter_rejections={}, message="no machine fits a task of 1000m cpu and 2048 MiB "
                                           "(1 of 3 tasks of job j unplaced); the feasible machines are full")),
    "avoided-machine": (
        [m("a1", ent="e1"), m("a2")], e1(), req(1, avoid_machine_ids=frozenset({"a1"})), 1,
        dict(placements=(("j/0", "a2"),), machines_added=("a2",), filter_rejections={FILTER_AVOIDED: 1})),
    "machines-not-up": (
        [m("d", status="DOWN"), m("u", status="UNHEALTHY"), m("x", status="MAINTENANCE"), m("ok")], e1(), req(1),
        0, dict(placements=(("j/0", "ok"),), filter_rejections={FILTER_STATUS: 3})),
    "held-by-other-entitlement": (
        [m("other", ent="e2"), m("free")], e1(), req(1), 0,
        dict(placements=(("j/0", "free"),), filter_rejections={FILTER_OTHER_ENTITLEMENT: 1})),
    "counted-once-under-first-failing-filter": (
        [m("down-small", status="DOWN", cpu=500), m("small-cpu", cpu=500), m("small-mem", mem=1024), m("ok")],
        e1(), req(1), 0,
        dict(placements=(("j/0", "ok"),),
             filter_rejections={FILTER_STATUS: 1, FILTER_CPU: 1, FILTER_MEMORY: 1})),
    "no-tasks": (
        [m("a")], e1(), req(0), 0,
        dict(placements=(), machines_added=(), unplaced=(), reason=None, fault_domain_bins={})),
}


@pytest.mark.parametrize("machines, entitlement, request_, held, expected", CASES.values(), ids=CASES.keys())
def test_place(machines, entitlement, request_, held, expected):
    plan = place(machines, entitlement, request_, held)
    assert {k: getattr(plan, k) for k in expected} == expected


@pytest.mark.parametrize("machines, entitlement, request_, held, expected", CASES.values(), ids=CASES.keys())
def test_place_is_deterministic(machines, entitlement, request_, held, expected):
    plan = place(machines, entitlement, request_, held)
    assert place(machines, entitlement, request_, held) == plan
    assert place(reversed(machines), entitlement, request_, held) == plan
    assert place({x.id: x for x in machines}, entitlement, request_, held) == plan


# (snapshot before release, placements freed, cpu per task, remaining tasks of e1 per machine, given back)
RELEASES = {
    "fig7-stop-E-returns-M8": (
        [m("M7", ent="e1", used_cpu=3500, used_mem=3 * MEM), m("M8", ent="e1", used_cpu=1500, used_mem=MEM),
         m("M9")],
        {"E/0": "M7", "E/1": "M8"}, 1500, {"M7": 2, "M8": 0}, ("M8",)),
    "machine-still-running-tasks-is-kept": (
        [m("a", ent="e1", used_cpu=2000)], {"j/0": "a"}, CPU, {"a": 1}, ()),
    "machine-of-another-entitlement-is-not-ours": (
        [m("a", ent="e2", used_cpu=1000)], {"j/0": "a"}, CPU, {}, ()),
    "untracked-usage-keeps-machine": (
        [m("a", ent="e1", used_cpu=3000)], {"j/0": "a"}, CPU, {"a": 0}, ()),
    "machine-missing-from-snapshot-is-kept": (
        [], {"j/0": "a"}, CPU, {}, ()),
    "several-tasks-emptying-two-machines": (
        [m("b", ent="e1", used_cpu=2000, used_mem=4096), m("a", ent="e1", used_cpu=1000, used_mem=2048)],
        {"j/0": "b", "j/1": "b", "j/2": "a"}, CPU, {}, ("a", "b")),
}


@pytest.mark.parametrize("snapshot, freed, cpu, remaining, expected", RELEASES.values(), ids=RELEASES.keys())
def test_release(snapshot, freed, cpu, remaining, expected):
    assert release(snapshot, "e1", freed, cpu, MEM, remaining) == expected


def test_figure7_sequence_end_to_end():
    """D starts (M7 joins), E starts (stacks on M7, M8 joins), E stops (M8 goes back to the free pool)."""
    snapshot = {x.id: x for x in (m("M7"), m("M8"), m("M9"))}
    ent, held, on = e1(quota=3), set(), {}

    def commit(plan, cpu, mem):
        for task_id, mid in plan.placements:
            x = snapshot[mid]
            snapshot[mid] = m(mid, ent="e1", used_cpu=x.cpu_capacity - x.cpu_free + cpu,
                              used_mem=x.mem_capacity - x.mem_free + mem)
            on[task_id] = mid
        held.update(plan.machines_added)

    commit(place(snapshot, ent, req(2, job="D", spread="dc"), len(held)), CPU, MEM)
    assert held == {"M7"}
    commit(place(snapshot, ent, req(2, job="E", cpu=1500, spread="dc"), len(held)), 1500, MEM)
    assert held == {"M7", "M8"} and on["E/0"] == "M7" and on["E/1"] == "M8"
    freed = {t: on.pop(t) for t in ("E/0", "E/1")}
    remaining = {mid: sum(1 for x in on.values() if x == mid) for mid in held}
    assert release(snapshot, "e1", freed, 1500, MEM, remaining) == ("M8",)


# (machine at commit, expected version, tasks to add, entitlement, result)
COMMITS = {
    "unchanged": (m("a"), 1, 2, "e1", None),
    "version-bumped-but-still-fits": (m("a", version=2), 1, 2, "e1", CONFLICT_VERSION),
    "cpu-taken": (m("a", used_cpu=3000, version=2), 1, 2, "e1", CONFLICT_CAPACITY),
    "memory-taken": (m("a", used_mem=7000, version=2), 1, 1, "e1", CONFLICT_CAPACITY),
    "exactly-fits": (m("a", used_cpu=2000, used_mem=4096), 1, 2, "e1", None),
    "taken-by-other-entitlement": (m("a", ent="e2", version=2), 1, 1, "e1", CONFLICT_OWNER),
    "held-by-us": (m("a", ent="e1"), 1, 1, "e1", None),
    "owner-not-checked-without-entitlement": (m("a", ent="e2"), 1, 1, None, None),
    "went-down": (m("a", status="DOWN", version=2), 1, 1, "e1", CONFLICT_STATUS),
}


@pytest.mark.parametrize("machine, version, n, ent, expected", COMMITS.values(), ids=COMMITS.keys())
def test_commit_check(machine, version, n, ent, expected):
    assert commit_check(machine, version, CPU, MEM, n, entitlement=ent) == expected


@pytest.mark.parametrize("kw", [{"spread": "region"}, {"requirements": {"rack": "r1"}}])
def test_request_rejects_what_placement_cannot_honour(kw):
    with pytest.raises(ValueError):
        req(1, **kw)


# --- the fast select() against a straightforward reference --------------------------------------------------

def reference_place(snapshot, entitlement, request, held):
    """place() as first written: every filter on every machine, then per task min() over SCORES of every
    candidate. O(tasks x machines); the decisions place() must keep."""
    def meets(value, *wanted):
        return all(w in (None, value) for w in wanted)

    filters = (
        (FILTER_STATUS, lambda x: x.status == "UP"),
        (FILTER_AVOIDED, lambda x: x.id not in request.avoid_machine_ids),
        (FILTER_OTHER_ENTITLEMENT, lambda x: x.entitlement in (None, entitlement.name)),
        (FILTER_MACHINE_TYPE, lambda x: meets(x.machine_type, request.requirements.get("machine_type"),
                                              entitlement.machine_type)),
        (FILTER_DC, lambda x: meets(x.dc, request.requirements.get("dc"), entitlement.dc_pin)),
        (FILTER_CPU, lambda x: x.cpu_free >= request.cpu),
        (FILTER_MEMORY, lambda x: x.mem_free >= request.mem),
    )
    machines = {x.id: x for x in snapshot}
    feasible, rejected = [], Counter()
    for x in sorted(machines.values(), key=lambda x: x.id):
        reason = next((r for r, ok in filters if not ok(x)), None)
        if reason is None:
            feasible.append(x)
        else:
            rejected[reason] += 1
    placing = set(request.task_ids)
    w = SimpleNamespace(request=request, cpu_free={x.id: x.cpu_free for x in feasible},
                        mem_free={x.id: x.mem_free for x in feasible},
                        members={x.id for x in feasible if x.entitlement == entitlement.name},
                        bins=Counter(fault_domain(machines[mid], request.spread)
                                     for tid, mid in request.existing.items() if tid not in placing and mid in machines))
    room = entitlement.quota_machines - held
    placements, added, unplaced, quota_hit = [], [], (), False
    for i, task_id in enumerate(request.task_ids):
        fitting = [x for x in feasible if w.cpu_free[x.id] >= request.cpu and w.mem_free[x.id] >= request.mem]
        candidates = [x for x in fitting if x.id in w.members or len(added) < room]
        if not candidates:
            unplaced, quota_hit = request.task_ids[i:], len(fitting) > 0
            break
        best = min(candidates, key=lambda x: tuple(score(x, w) for _, score in SCORES))
        if best.id not in w.members:
            w.members.add(best.id)
            added.append(best.id)
        w.cpu_free[best.id] -= request.cpu
        w.mem_free[best.id] -= request.mem
        w.bins[fault_domain(best, request.spread)] += 1
        placements.append((task_id, best.id))
    return (tuple(placements), tuple(added), dict(sorted(w.bins.items())),
            {r: rejected[r] for r, _ in filters if rejected[r]}, unplaced,
            (QUOTA_EXCEEDED if quota_hit else NO_FEASIBLE_MACHINE) if unplaced else None)


def random_region(rnd, n):
    """``n`` machines over 2 DCs x 3 MSBs x 3 racks, some held by e1 or e2, partly used, a few not UP, two
    types, a few sizes: enough ties and near-full machines to exercise every score and filter."""
    out = []
    for i in range(n):
        cpu, mem = rnd.choice(((4000, 8192), (8000, 16384), (2000, 8192)))
        used = rnd.choice((0, 0, 1000, 2000, 3000, cpu))
        out.append(m(f"m{i:03d}", dc=rnd.choice(("dc1", "dc2")), msb=rnd.choice(("a", "b", "c")),
                     rack=rnd.choice(("r1", "r2", "r3")), type=rnd.choice(("skylake", "skylake", "broadwell")),
                     cpu=cpu, mem=mem, used_cpu=min(used, cpu), used_mem=min(used * 2, mem),
                     ent=rnd.choice((None, None, None, "e1", "e2")),
                     status=rnd.choice(("UP",) * 9 + ("DOWN",)), version=rnd.randint(1, 9)))
    return out


def random_request(rnd, machines):
    job = f"j{rnd.randint(0, 3)}"
    kw = {"spread": rnd.choice(("dc", "msb", "rack"))}
    if rnd.random() < 0.3:
        kw["requirements"] = {"machine_type": "skylake"} if rnd.random() < 0.5 else {"dc": rnd.choice(("dc1", "dc2"))}
    if rnd.random() < 0.3:
        kw["avoid_machine_ids"] = frozenset(rnd.sample([x.id for x in machines], 3))
    if rnd.random() < 0.5:
        kw["existing"] = {f"{job}/{i}": rnd.choice(machines).id for i in rnd.sample(range(40), 6)}
    return req(rnd.randint(0, 30), job=job, cpu=rnd.choice((500, 1000, 1500)), mem=rnd.choice((512, 2048)), **kw)


def random_cases(seed: int):
    """Ten (machines, entitlement, request, held) cases on one random region of ``seed``."""
    rnd = random.Random(seed)
    machines = random_region(rnd, rnd.choice((5, 30, 120)))
    for _ in range(10):
        ent = e1(quota=rnd.randint(0, 12), machine_type=rnd.choice((None, None, "skylake")),
                 dc_pin=rnd.choice((None, None, None, "dc2")))
        request_ = random_request(rnd, machines)
        yield machines, ent, request_, sum(x.entitlement == "e1" for x in machines) + rnd.randint(0, 2)


@pytest.mark.parametrize("seed", range(40))
def test_place_decides_as_the_reference_on_random_regions(seed):
    for machines, ent, request_, held in random_cases(seed):
        plan = place(machines, ent, request_, held)
        got = (plan.placements, plan.machines_added, dict(plan.fault_domain_bins), dict(plan.filter_rejections),
               plan.unplaced, plan.reason)
        assert got == reference_place(machines, ent, request_, held)


def test_the_random_regions_exercise_what_they_should():
    """The comparison above is only worth something if its cases place, spread, add, hit the quota and filter."""
    seen = set()
    for seed in range(40):
        for machines, ent, request_, held in random_cases(seed):
            plan = place(machines, ent, request_, held)
            seen |= {plan.reason} | set(plan.filter_rejections)
            seen |= {"placed"} if plan.placements else set()
            seen |= {"added"} if plan.machines_added else set()
            seen |= {"several-bins"} if len(plan.fault_domain_bins) > 1 else set()
    assert seen >= {None, QUOTA_EXCEEDED, NO_FEASIBLE_MACHINE, FILTER_STATUS, FILTER_AVOIDED, FILTER_CPU,
                    FILTER_OTHER_ENTITLEMENT, FILTER_MACHINE_TYPE, FILTER_DC, "placed", "added", "several-bins"}


# --- the policy seam (placement.Policy): what a shadow replay changes ---------------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_select_scored_with_the_live_scores_decides_as_select(seed):
    """``run_policy`` places any table of scores by min() per task; with SCORES' own table it must decide exactly as
    the live select() (so a shadow run under a policy that changes only, say, the spread level is comparable)."""
    rnd = random.Random(seed)
    machines = random_region(rnd, rnd.choice((5, 30, 120)))
    for _ in range(8):
        ent = e1(quota=rnd.randint(0, 12), machine_type=rnd.choice((None, "skylake")))
        request_ = random_request(rnd, machines)
        held = sum(x.entitlement == "e1" for x in machines)
        by_id = {x.id: x for x in machines}
        feasible, counted = filter_machines(machines, ent, request_)
        bins = existing_bins(by_id, request_)
        fast = plan_of(select(feasible, bins, ent, request_, held), ent, request_, held, counted)
        scored = plan_of(select_scored(feasible, bins, ent, request_, held, SCORES), ent, request_, held, counted)
        assert scored == fast


def test_a_policy_ranks_by_its_own_scores_and_spread():
    machines = [m(f"m{i}", msb="a" if i < 2 else "b", rack=f"r{i}") for i in range(4)]
    request_ = req(2)
    packed = run_policy(machines, e1(), request_, 0, LIVE)
    assert packed == place(machines, e1(), request_, 0)
    least = Policy("least", scores=(("spread", SCORE_CHOICES["spread"]), ("least_loaded", SCORE_CHOICES["least_loaded"])))
    assert least.scores[-1][0] == "machine_id" and not least.live
    assert run_policy(machines, e1(), req(4), 0, least).placements != run_policy(machines, e1(), req(4), 0, LIVE).placements
    by_rack = Policy("rack", spread="rack")
    assert by_rack.live_scores and not by_rack.live
    assert set(run_policy(machines, e1(), req(4), 0, by_rack).fault_domain_bins) == {"dc1/a/r0", "dc1/a/r1", "dc1/b/r2",
                                                                                       "dc1/b/r3"}
    with pytest.raises(ValueError, match="spread"):
        Policy("bad", spread="zone")


@pytest.mark.parametrize("when_ms, expected", [
    (0, ["a0", "b0", "c1", "d3"]),  # partition 0 first
    (1, ["c1", "d3", "a0", "b0"]),  # from partition 1: 1, 3, then 0 (its requests in log order)
    (3, ["d3", "a0", "b0", "c1"]),
    (4 + 2, ["d3", "a0", "b0", "c1"]),  # modulo the partitions: from 2, the first there is 3
])
def test_a_batch_is_decided_by_partition_from_the_one_its_time_names(when_ms, expected):
    arrived = [("d3", 3), ("a0", 0), ("c1", 1), ("b0", 0)]
    assert [r for r, _ in in_decision_order(arrived, lambda x: x[1], when_ms, 4)] == expected
