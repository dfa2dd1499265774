"""PlacementIndex (processors/allocator/fastplace.py) gives placement.run's Plan on the snapshot, field for field."""
import random
from collections import Counter
from dataclasses import replace

import pytest

from processors.allocator import placement
from processors.allocator.fastplace import PlacementIndex
from processors.allocator.placement import (
    FILTER_AVOIDED, FILTER_CPU, FILTER_DC, FILTER_MACHINE_TYPE, FILTER_MAINTENANCE, FILTER_MEMORY, FILTER_STATUS,
    NO_FEASIBLE_MACHINE, QUOTA_EXCEEDED, Entitlement, Request,
)
from allocator_log import e1, m, req


def index_of(machines):
    index = PlacementIndex()
    for x in machines:
        index.upsert(x)
    return index


def narrowing(entitlement, request):
    """The (dc, machine_type) index.allocate narrows the snapshot to."""
    return (request.requirements.get("dc") or entitlement.dc_pin,
            request.requirements.get("machine_type") or entitlement.machine_type)


def in_snapshot(x, entitlement, dc=None, machine_type=None):
    """MachineIndex.snapshot's membership, written out: the reference for PlacementIndex.snapshot."""
    return x.entitlement in (None, entitlement) and dc in (None, x.dc) and machine_type in (None, x.machine_type)


def same_as_reference(index, entitlement, request, held):
    """Run ``index`` narrowed as allocate() does and not narrowed (the "wide" look); each plan must be
    placement.run's on the same snapshot. Returns the narrowed plan."""
    plans = []
    for dc, machine_type in (narrowing(entitlement, request), (None, None)):
        plan = index.run(entitlement, request, held, dc, machine_type)
        expected = placement.run(index.snapshot(entitlement.name, dc, machine_type), entitlement, request, held).plan
        assert plan == expected, (dc, machine_type)
        plans.append(plan)
    return plans[0]


# --- named edge cases -------------------------------------------------------------------------------------

# (machines, entitlement, request, held_machine_count, expected fields of the plan narrowed as allocate() does)
CASES = {
    "quota-full-while-a-free-machine-fits": (
        [m("h1", ent="e1", cpu=1000), m("f1")], e1(quota=1), req(2), 1,
        dict(placements=(("j/0", "h1"),), machines_added=(), unplaced=("j/1",), reason=QUOTA_EXCEEDED,
             message="entitlement e1 holds 1 of 1 machines; raise its quota or free capacity "
                     "(1 of 2 tasks of job j unplaced)")),
    "quota-room-zero-and-nothing-held": (
        [m("f1"), m("f2")], e1(quota=0), req(1), 0,
        dict(placements=(), unplaced=("j/0",), reason=QUOTA_EXCEEDED)),
    "held-beyond-quota-still-stacks-on-held": (
        [m("h1", ent="e1"), m("f1")], e1(quota=1), req(2, spread="dc"), 3,
        dict(placements=(("j/0", "h1"), ("j/1", "h1")), machines_added=(), reason=None)),
    "room-for-one-machine": (
        [m("f1", cpu=2000), m("f2", cpu=2000), m("f3", cpu=2000)], e1(quota=1), req(3, spread="dc"), 0,
        dict(placements=(("j/0", "f1"), ("j/1", "f1")), machines_added=("f1",), unplaced=("j/2",),
             reason=QUOTA_EXCEEDED)),
    "only-machines-not-up": (
        [m("d", status="DOWN"), m("x", status="MAINTENANCE", ent="e1"), m("u", status="UNHEALTHY")], e1(), req(1), 1,
        dict(placements=(), unplaced=("j/0",), reason=NO_FEASIBLE_MACHINE, filter_rejections={FILTER_STATUS: 3},
             message="no machine fits a task of 1000m cpu and 2048 MiB (1 of 1 tasks of job j unplaced); "
                     "machines rejected: 3 machine_not_up")),
    "maintenance-never-places-into-itself": (
        # the job's only task left msb2 (a maintenance of msb2 is announced): its bin is empty, its free machines
        # fit and are first by id, yet every machine of the maintenance is filtered, held, free or down alike
        [m("a2", msb="msb2", maintenance=("ue1",)), m("b2", msb="msb2", ent="e1", maintenance=("ue1",)),
         m("c2", msb="msb2", status="DOWN", maintenance=("ue1",)), m("z1", msb="msb1", ent="e1")], e1(),
        req(1, existing={"j/1": "z1"}), 2,
        dict(placements=(("j/0", "z1"),), filter_rejections={FILTER_STATUS: 1, FILTER_MAINTENANCE: 2})),
    "maintenance-before-avoided": (
        [m("a", maintenance=("ue1", "ue2")), m("b")], e1(), req(1, avoid_machine_ids=frozenset({"a", "b"})), 0,
        dict(placements=(), reason=NO_FEASIBLE_MACHINE, filter_rejections={FILTER_MAINTENANCE: 1,
                                                                           FILTER_AVOIDED: 1},
             message="no machine fits a task of 1000m cpu and 2048 MiB (1 of 1 tasks of job j unplaced); "
                     "machines rejected: 1 machine_in_maintenance, 1 avoided")),
    "avoided-counted-once-and-only-in-the-snapshot": (
        # a is down (status comes first), c is too small (avoided comes first), other is not in the snapshot,
        # ghost is not a machine
        [m("a", status="DOWN"), m("b"), m("c", cpu=500), m("other", ent="e2"), m("ok")], e1(),
        req(1, avoid_machine_ids=frozenset({"a", "b", "c", "other", "ghost"})), 0,
        dict(placements=(("j/0", "ok"),), filter_rejections={FILTER_STATUS: 1, FILTER_AVOIDED: 2})),
    "every-fitting-machine-avoided": (
        [m("h", ent="e1"), m("f")], e1(), req(1, avoid_machine_ids=frozenset({"h", "f"})), 1,
        dict(placements=(), reason=NO_FEASIBLE_MACHINE, filter_rejections={FILTER_AVOIDED: 2})),
    "memory-bound-machines": (
        # cpu fits everywhere; "tight" has memory for two tasks, "short" for none
        [m("tight", ent="e1", cpu=8000, mem=4096), m("short", cpu=8000, mem=1024)], e1(), req(3), 1,
        dict(placements=(("j/0", "tight"), ("j/1", "tight")), unplaced=("j/2",), reason=NO_FEASIBLE_MACHINE,
             filter_rejections={FILTER_MEMORY: 1},
             message="no machine fits a task of 1000m cpu and 2048 MiB (1 of 3 tasks of job j unplaced); "
                     "machines rejected: 1 insufficient_memory")),
    "exact-fit": (
        [m("cpu-exact", cpu=1000), m("mem-exact", mem=2048), m("both-one-short", cpu=999, mem=2047)], e1(),
        req(3, spread="dc"), 0,
        dict(placements=(("j/0", "cpu-exact"), ("j/1", "mem-exact")), unplaced=("j/2",),
             reason=NO_FEASIBLE_MACHINE, filter_rejections={FILTER_CPU: 1})),
    "cpu-before-memory": (
        [m("both-short", cpu=500, mem=1024), m("mem-short", mem=1024), m("ok")], e1(), req(1), 0,
        dict(placements=(("j/0", "ok"),), filter_rejections={FILTER_CPU: 1, FILTER_MEMORY: 1})),
    "ties-broken-by-id": (
        [m("b2", msb="msb2"), m("a2", msb="msb2"), m("b1"), m("a1")], e1(), req(3), 0,
        dict(placements=(("j/0", "a1"), ("j/1", "a2"), ("j/2", "a1")), machines_added=("a1", "a2"))),
    "pack-before-id": (
        [m("a", ent="e1"), m("z", ent="e1", used_cpu=1000)], e1(), req(1), 2,
        dict(placements=(("j/0", "z"),))),
    "an-empty-bin-beats-a-held-machine": (
        # then f, having joined, ties with h on spread and is the fuller
        [m("h", ent="e1", msb="msb1"), m("f", msb="msb2")], e1(), req(2, existing={"old/0": "h"}), 1,
        dict(placements=(("j/0", "f"), ("j/1", "f")), machines_added=("f",),
             fault_domain_bins={"dc1/msb1": 1, "dc1/msb2": 2})),
    "existing-tasks-steer-spread": (
        # j/7 on a1 counts (msb1), so j/0 goes to b1 rather than a1; j/8 is on a machine of e2 (not in the
        # snapshot); j/0 is placed again; j/9 counts on a machine that is down; then b1, joined, beats a1
        [m("a1"), m("b1", msb="msb2"), m("x", msb="msb2", ent="e2"), m("c1", msb="msb3", status="DOWN")], e1(),
        req(2, existing={"j/7": "a1", "j/8": "x", "j/0": "b1", "j/9": "c1", "j/6": "gone"}), 0,
        dict(placements=(("j/0", "b1"), ("j/1", "b1")),
             fault_domain_bins={"dc1/msb1": 1, "dc1/msb2": 2, "dc1/msb3": 1})),
    "rack-spread-passes-over-racks-with-tasks": (
        # a is first by id, but its rack has j/9: c (the fuller of the racks without a task), d (the last
        # rack without one), then c again (every rack has one task; c is held now, and the fullest)
        [m("a", rack="r1"), m("b", rack="r1"), m("c", rack="r2", used_cpu=1000), m("d", rack="r3", msb="msb2")],
        e1(), req(3, spread="rack", existing={"j/9": "b"}), 0,
        dict(placements=(("j/0", "c"), ("j/1", "d"), ("j/2", "c")), machines_added=("c", "d"),
             fault_domain_bins={"dc1/msb1/r1": 1, "dc1/msb1/r2": 2, "dc1/msb2/r3": 1})),
    "existing-outside-the-narrowed-snapshot": (
        [m("a", dc="dc1"), m("b", dc="dc2")], e1(), req(1, spread="dc", requirements={"dc": "dc2"},
                                                      existing={"j/5": "a"}), 0,
        dict(placements=(("j/0", "b"),), fault_domain_bins={"dc2": 1})),
    "type-requirement-narrowed": (
        [m("b1", type="broadwell"), m("s1")], e1(), req(1, requirements={"machine_type": "skylake"}), 0,
        dict(placements=(("j/0", "s1"),), filter_rejections={})),
    "conflicting-dc-requirement-and-pin": (
        # allocate() narrows to the request's dc1; the pin to dc2 then rejects every machine there
        [m("a", dc="dc1"), m("b", dc="dc1", status="DOWN"), m("c", dc="dc2")], e1(dc_pin="dc2"),
        req(1, requirements={"dc": "dc1"}), 0,
        dict(placements=(), reason=NO_FEASIBLE_MACHINE, filter_rejections={FILTER_STATUS: 1, FILTER_DC: 1})),
    "nothing-fits-the-task": (
        [m("a", ent="e1"), m("b")], e1(), req(2, cpu=40000), 1,
        dict(placements=(), reason=NO_FEASIBLE_MACHINE, filter_rejections={FILTER_CPU: 2})),
    "free-machine-joins-then-takes-the-next-task": (
        [m("f1", cpu=3000), m("f2", cpu=3000)], e1(), req(4, spread="dc"), 0,
        dict(placements=(("j/0", "f1"), ("j/1", "f1"), ("j/2", "f1"), ("j/3", "f2")), machines_added=("f1", "f2"))),
    "no-tasks": (
        [m("a")], e1(), req(0, existing={"j/0": "a"}), 0,
        dict(placements=(), unplaced=(), reason=None, fault_domain_bins={"dc1/msb1": 1})),
    "empty-index": (
        [], e1(), req(1), 0,
        dict(placements=(), reason=NO_FEASIBLE_MACHINE, filter_rejections={},
             message="no machine fits a task of 1000m cpu and 2048 MiB (1 of 1 tasks of job j unplaced); "
                     "the feasible machines are full")),
}


@pytest.mark.parametrize("machines, entitlement, request_, held, expected", CASES.values(), ids=CASES.keys())
def test_edge_case(machines, entitlement, request_, held, expected):
    plan = same_as_reference(index_of(machines), entitlement, request_, held)
    assert {k: getattr(plan, k) for k in expected} == expected


# (machines, entitlement, request, held, filter_rejections of the un-narrowed plan)
WIDE = {
    "type-requirement": (
        [m("b1", type="broadwell"), m("b2", type="broadwell", ent="e1"), m("s1", type="skylake", cpu=500)], e1(),
        req(1, requirements={"machine_type": "skylake"}), 1, {FILTER_MACHINE_TYPE: 2, FILTER_CPU: 1}),
    "entitlement-type-and-pin": (
        [m("b1", type="broadwell"), m("s1", dc="dc2"), m("s2"), m("d", status="DOWN", type="broadwell")],
        e1(machine_type="skylake", dc_pin="dc1"), req(1), 0, {FILTER_STATUS: 1, FILTER_MACHINE_TYPE: 1, FILTER_DC: 1}),
    "conflicting-types-reject-all": (
        [m("b1", type="broadwell"), m("s1")], e1(machine_type="broadwell"),
        req(1, requirements={"machine_type": "skylake"}), 0, {FILTER_MACHINE_TYPE: 2}),
    "avoided-before-type": (
        [m("b1", type="broadwell"), m("s1")], e1(), req(1, requirements={"machine_type": "skylake"},
                                                     avoid_machine_ids=frozenset({"b1", "s1"})), 0,
        {FILTER_AVOIDED: 2}),
}


@pytest.mark.parametrize("machines, entitlement, request_, held, expected", WIDE.values(), ids=WIDE.keys())
def test_wide_look_counts_type_and_dc_filters(machines, entitlement, request_, held, expected):
    index = index_of(machines)
    same_as_reference(index, entitlement, request_, held)
    assert dict(index.run(entitlement, request_, held).filter_rejections) == expected


def test_upsert_and_remove_keep_the_index_whole():
    index = index_of([m("a"), m("b", ent="e1"), m("c", ent="e1", status="DOWN"), m("d", ent="e2")])
    assert len(index) == 4 and index.held_count("e1") == 2 and index.held_count("e2") == 1
    index.upsert(replace(index.get("a"), entitlement="e1", cpu_free=1000, version=2))
    index.upsert(replace(index.get("c"), status="UP", entitlement=None))
    index.remove("d")
    index.remove("not-there")
    assert len(index) == 3 and index.held_count("e1") == 2 and index.held_count("e2") == 0
    assert index.get("d") is None and index.get("a").cpu_free == 1000
    assert list(index.snapshot("e1")) == ["a", "b", "c"]
    plan = index.run(e1(), req(2, spread="dc"), 2)
    assert plan.placements == (("j/0", "a"), ("j/1", "b")) and plan.machines_added == ()


# --- property: random regions and sequences of decisions --------------------------------------------------

TYPES = {"skylake": (32000, 131072), "broadwell": (24000, 65536), "bigmem": (16000, 262144)}
SHAPES = ((1000, 2048), (2000, 4096), (500, 1024), (4000, 60000), (200, 100000), (40000, 1024), (8000, 4096))
ENTITLEMENTS = ("e1", "e2", "e3", "e4")
NOT_UP = ("DOWN", "MAINTENANCE", "UNHEALTHY")
MAINTENANCES = (("ue1",), ("ue2",), ("ue1", "ue2"))  # planned maintenances a machine may be under
SEEDS = range(12)
DECISIONS_PER_SEED = 40


def random_region(rnd):
    """50-3000 machines over 2-3 DCs, a few MSBs and racks each, 2-3 machine types (one per rack), ids in no
    topological order; some not UP, some held by e1-e4 and partly used, some full, a few free ones used."""
    n = rnd.choice((50, 150, 400, 1000, 3000))
    dcs = [f"dc{i}" for i in range(1, rnd.randint(2, 3) + 1)]
    types = rnd.sample(sorted(TYPES), rnd.randint(2, 3))
    racks = [(dc, f"msb{s}", f"r{r}", rnd.choice(types))
             for dc in dcs for s in range(rnd.randint(1, 6)) for r in range(rnd.randint(1, 5))]
    ids = rnd.sample(range(10 * n), n)
    return [random_machine(rnd, f"m{i:05d}", *rnd.choice(racks)) for i in ids]


def random_machine(rnd, id, dc, msb, rack, type):
    cpu, mem = TYPES[type]
    ent = rnd.choice((None,) * 6 + ENTITLEMENTS)
    used = rnd.choice((0.0, 0.25, 0.5, 0.9, 1.0)) if ent else rnd.choice((0.0,) * 12 + (0.5,))
    task_cpu, task_mem = rnd.choice(SHAPES[:3])
    n_tasks = int(used * min(cpu // task_cpu, mem // task_mem))
    return m(id, dc=dc, msb=msb, rack=rack, type=type, cpu=cpu, mem=mem, used_cpu=n_tasks * task_cpu,
             used_mem=n_tasks * task_mem, ent=ent, status=rnd.choice(("UP",) * 12 + NOT_UP),
             version=rnd.randint(1, 5), maintenance=rnd.choice(((),) * 10 + MAINTENANCES))


def random_decision(rnd, index, machines, placed):
    """An entitlement, a request and the held count, as varied as allocate() sees them."""
    x = rnd.choice(machines)
    name = rnd.choice(ENTITLEMENTS)
    held = index.held_count(name)
    entitlement = Entitlement(name=name, quota_machines=max(0, held + rnd.choice((0, 1, 2, 5, 1000, -1))),
                              machine_type=rnd.choice((None,) * 4 + (x.machine_type, "bigmem")),
                              dc_pin=rnd.choice((None,) * 4 + (x.dc, "dc2")))
    requirements = rnd.choice(({}, {}, {"dc": x.dc}, {"machine_type": x.machine_type},
                               {"dc": x.dc, "machine_type": x.machine_type}, {"dc": "dc1"},
                               {"machine_type": "skylake"}))
    job = f"job{rnd.randint(0, 5)}"
    kw = {"spread": rnd.choice(("dc", "msb", "rack")), "requirements": requirements}
    avoid = rnd.random()
    if avoid < 0.2:  # a few machines anywhere, and one that does not exist
        kw["avoid_machine_ids"] = frozenset(y.id for y in rnd.sample(machines, min(len(machines), 8))) | {"ghost"}
    elif avoid < 0.3:  # a bad rack, or a whole DC: every feasible machine may be avoided
        place = (lambda y: (y.dc, y.msb, y.rack)) if avoid < 0.25 else (lambda y: y.dc)
        kw["avoid_machine_ids"] = frozenset(y.id for y in machines if place(y) == place(x))
    if rnd.random() < 0.6:
        existing = {t: mid for t, mid in placed.items() if t.startswith(job + "/")}
        existing |= {f"{job}/x{i}": rnd.choice(machines).id for i in range(rnd.randint(0, 5))}
        existing[f"{job}/ghost"] = "no-such-machine"
        kw["existing"] = existing
    first = rnd.randint(0, 40)
    cpu, mem = rnd.choice(SHAPES)
    request = Request(request_id=f"r{rnd.random()}", job_id=job, entitlement=name,
                      task_ids=tuple(f"{job}/{i}" for i in range(first, first + rnd.choice((0, 1, 3, 12, 36, 80)))),
                      cpu=cpu, mem=mem, **kw)
    return entitlement, request, held + rnd.choice((0, 0, 0, 1, -1))


def commit(index, plan, entitlement, request):
    """Apply a plan as index.commit does: each task takes its share, added machines join, versions move."""
    for task_id, mid in plan.placements:
        x = index.get(mid)
        index.upsert(replace(x, cpu_free=x.cpu_free - request.cpu, mem_free=x.mem_free - request.mem,
                             entitlement=entitlement.name, version=x.version + 1))


def churn(rnd, index, machines):
    """What else happens between decisions: status changes, releases, removals, registrations."""
    for _ in range(rnd.randint(0, 6)):
        x = index.get(rnd.choice(machines).id)
        if x is None:
            continue
        what = rnd.random()
        if what < 0.22:
            x = replace(x, status=rnd.choice(("UP",) + NOT_UP))
        elif what < 0.3:  # a planned maintenance announced on it, or ended
            x = replace(x, maintenance=rnd.choice(((),) * 2 + MAINTENANCES))
        elif what < 0.55:  # released back to the free pool, empty
            x = replace(x, entitlement=None, cpu_free=x.cpu_capacity, mem_free=x.mem_capacity)
        elif what < 0.7:  # taken by another entitlement
            x = replace(x, entitlement=rnd.choice(ENTITLEMENTS))
        elif what < 0.78:  # tasks stopped or started outside the allocator
            x = replace(x, cpu_free=rnd.randint(0, x.cpu_capacity), mem_free=rnd.randint(0, x.mem_capacity))
        elif what < 0.85:  # room for exactly one task of a shape: the filters' and select()'s edge
            cpu, mem = rnd.choice(SHAPES)
            x = replace(x, cpu_free=cpu * rnd.choice((1, 2)), mem_free=mem * rnd.choice((1, 2)))
        elif what < 0.93:
            index.remove(x.id)
            continue
        else:  # a new machine in the same rack
            x = replace(x, id=f"new{rnd.randrange(10**9)}", entitlement=None, cpu_free=x.cpu_capacity,
                        mem_free=x.mem_capacity, status="UP")
            machines.append(x)
        index.upsert(replace(x, version=x.version + 1))


def play(seed, decide):
    """A seeded region and DECISIONS_PER_SEED decisions on it: ``decide(index, machines, entitlement, request,
    held)`` returns the plan, which is committed; machines churn between decisions."""
    rnd = random.Random(seed)
    machines = random_region(rnd)
    index = index_of(machines)
    placed: dict[str, str] = {}
    for _ in range(DECISIONS_PER_SEED):
        churn(rnd, index, machines)
        entitlement, request, held = random_decision(rnd, index, machines, placed)
        plan = decide(index, machines, entitlement, request, held)
        commit(index, plan, entitlement, request)
        placed.update(plan.placements)


def check_index(index, machines, entitlement):
    """The index against a plain scan: its snapshot, held count and size."""
    alive = {x.id: x for mid in {y.id for y in machines} if (x := index.get(mid)) is not None}
    assert len(index) == len(alive)
    assert index.held_count(entitlement.name) == sum(x.entitlement == entitlement.name for x in alive.values())
    for dc, machine_type in ((None, None), ("dc1", None), (None, "skylake"), ("dc2", "broadwell")):
        assert index.snapshot(entitlement.name, dc, machine_type) == {
            mid: x for mid, x in sorted(alive.items()) if in_snapshot(x, entitlement.name, dc, machine_type)}


@pytest.mark.parametrize("seed", SEEDS)
def test_run_equals_placement_run_on_random_regions_and_sequences(seed):
    def decide(index, machines, entitlement, request, held):
        check_index(index, machines, entitlement)  # the reference input is the snapshot MachineIndex would read
        plan = same_as_reference(index, entitlement, request, held)
        assert index.run(entitlement, request, held, *narrowing(entitlement, request)) == plan  # run reads only
        return plan

    play(seed, decide)


def index_state(index):
    """What an index holds, to compare two of them: machines, held counts, and every group's members, shapes and
    sorted lists."""
    return (index._machines, +index._held,
            {k: (g.ids, g.down, g.maint, +g.shapes,
                 {lv: {d: lst for d, lst in by.items() if lst} for lv, by in g.lists.items()})
             for k, g in index._groups.items()})


@pytest.mark.parametrize("seed", range(4))
def test_an_index_built_in_bulk_equals_one_built_machine_by_machine(seed):
    machines = random_region(random.Random(seed))
    assert index_state(PlacementIndex.of(machines)) == index_state(index_of(machines))


def test_the_random_sequences_exercise_what_they_should():
    """The comparison above is only worth something if its cases place, spread, add, hit the quota, filter for
    every reason, and see both narrowed and wide snapshots."""
    seen = Counter()

    def decide(index, machines, entitlement, request, held):
        for dc, machine_type in (narrowing(entitlement, request), (None, None)):
            plan = index.run(entitlement, request, held, dc, machine_type)
            seen.update({plan.reason} | set(plan.filter_rejections))
        plan = index.run(entitlement, request, held, *narrowing(entitlement, request))
        seen.update({"placed"} if plan.placements else set())
        seen.update({"added"} if plan.machines_added else set())
        seen.update({"partly-placed"} if plan.placements and plan.unplaced else set())
        seen.update({"several-bins"} if len(plan.fault_domain_bins) > 1 else set())
        seen.update({"existing-counted"} if sum(plan.fault_domain_bins.values()) > len(plan.placements) else set())
        seen.update({f"spread-{request.spread}"} if len(plan.placements) > 1 else set())
        seen.update({"narrowed"} if narrowing(entitlement, request) != (None, None) else set())
        seen.update({"decision"})
        return plan

    for seed in SEEDS:
        play(seed, decide)
    assert seen["decision"] == len(SEEDS) * DECISIONS_PER_SEED
    assert set(seen) >= {None, QUOTA_EXCEEDED, NO_FEASIBLE_MACHINE, FILTER_STATUS, FILTER_MAINTENANCE, FILTER_AVOIDED,
                         FILTER_CPU, FILTER_MEMORY, FILTER_MACHINE_TYPE, FILTER_DC, "placed", "added", "partly-placed",
                         "several-bins", "existing-counted", "spread-dc", "spread-msb", "spread-rack",
                         "narrowed"}, seen
