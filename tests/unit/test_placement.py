"""Table-driven tests of the allocator's pure placement pipeline."""
import pytest

from processors.allocator.placement import (
    CONFLICT_CAPACITY, CONFLICT_OWNER, CONFLICT_STATUS, CONFLICT_VERSION, FILTER_AVOIDED, FILTER_CPU, FILTER_DC,
    FILTER_MACHINE_TYPE, FILTER_MEMORY, FILTER_OTHER_ENTITLEMENT, FILTER_STATUS, NO_FEASIBLE_MACHINE,
    QUOTA_EXCEEDED, Entitlement, Machine, Request, commit_check, place, release,
)

CPU, MEM = 1000, 2048  # one default task


def m(id, *, dc="dc1", msb="msb1", rack="r1", type="skylake", cpu=4000, mem=8192, used_cpu=0, used_mem=0,
      ent=None, status="UP", version=1):
    return Machine(id=id, dc=dc, msb=msb, rack=rack, machine_type=type, cpu_free=cpu - used_cpu,
                   mem_free=mem - used_mem, cpu_capacity=cpu, mem_capacity=mem, entitlement=ent, status=status,
                   version=version)


def req(n, *, job="j", cpu=CPU, mem=MEM, **kw):
    return Request(request_id="r1", job_id=job, entitlement="e1", task_ids=tuple(f"{job}/{i}" for i in range(n)),
                   cpu=cpu, mem=mem, **kw)


def e1(quota=10, **kw):
    return Entitlement(name="e1", quota_machines=quota, **kw)


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
