"""The job-level allocation cache (processors/allocator/cache.py), pure: entries, lookups, write-through.

A small in-memory region stands in for the index here (machine versions, held counts and the entitlement's
epoch, counted as index.py counts them); tests/integration/test_machine_index.py runs the cache on Redis."""
import random
from collections import Counter
from dataclasses import replace

import pytest

from processors.allocator import placement
from processors.allocator.cache import (
    AllocationCache, Kept, build_entry, committed, lookup, machines_after, shape_of, without,
)
from processors.allocator.placement import Entitlement, Machine, Request


def m(id, *, dc="dc1", msb="msb1", rack="r1", cpu=4000, mem=8192, used_cpu=0, used_mem=0, ent=None, status="UP",
      version=1, type="skylake"):
    return Machine(id=id, dc=dc, msb=msb, rack=rack, machine_type=type, cpu_free=cpu - used_cpu,
                   mem_free=mem - used_mem, cpu_capacity=cpu, mem_capacity=mem, entitlement=ent, status=status,
                   version=version)


def req(n, *, job="j", cpu=1000, mem=1024, ent="e1", **kw):
    return Request(f"{job}-r", job, ent, tuple(f"{job}/{i}" for i in range(n)), cpu, mem, **kw)


E1 = Entitlement("e1", quota_machines=100)


# --- the shape ---------------------------------------------------------------------------------------------

BASE = req(3)
SHAPES = {
    # (entitlement, request, same shape as (E1, BASE)?)
    "another-job-same-spec": (E1, req(3, job="other"), True),
    "more-tasks": (E1, req(7), True),
    "tasks-already-placed": (E1, req(3, existing={"j/9": "a"}), True),
    "another-quota": (replace(E1, quota_machines=3), BASE, True),
    "cpu": (E1, req(3, cpu=2000), False),
    "memory": (E1, req(3, mem=2048), False),
    "requirement": (E1, req(3, requirements={"dc": "dc1"}), False),
    "spread": (E1, req(3, spread="rack"), False),
    "avoided-machine": (E1, req(3, avoid_machine_ids=frozenset({"a"})), False),
    "entitlement": (replace(E1, name="e2"), req(3, ent="e2"), False),
    "entitlement-type": (replace(E1, machine_type="skylake"), BASE, False),
    "entitlement-dc-pin": (replace(E1, dc_pin="dc1"), BASE, False),
}


@pytest.mark.parametrize("entitlement, request_, same", SHAPES.values(), ids=SHAPES.keys())
def test_shape(entitlement, request_, same):
    assert (shape_of(entitlement, request_) == shape_of(E1, BASE)) is same


# --- building an entry ---------------------------------------------------------------------------------------

def test_an_entry_keeps_the_head_of_each_bin_and_class():
    """Per bin and class, the fullest machines first, until they hold HEADROOM x the tasks (here 2 x 3 = 6
    tasks of 1000m); a class whose machines all fit in that is kept whole (not truncated)."""
    machines = [
        m("a-empty", msb="a"), m("a-half", msb="a", used_cpu=2000), m("a-3q", msb="a", used_cpu=3000),
        m("a-full-ish", msb="a", used_cpu=3000, used_mem=7168), m("a-held", msb="a", ent="e1", used_cpu=1000),
        m("b-1", msb="b"), m("b-2", msb="b"),
    ]
    feasible, rejections = placement.filter_machines(machines, E1, req(3))
    entry = build_entry(feasible, E1, req(3), rejections, held=1, epoch=7, now=0.0, headroom=2)
    # msb a, free: a-3q (1 task) and a-full-ish (1 task: memory) then a-half (2): 4 < 6, a-empty (4): 8 >= 6
    # -> all four kept, nothing left out; msb b: b-1 holds 4 < 6, b-2 -> 8: both kept.
    assert set(entry.machines) == {m_.id for m_ in machines}
    assert entry.truncated == frozenset() and (entry.held, entry.epoch) == (1, 7)
    assert entry.machines["a-held"] == entry.machines["a-held"].__class__(1, "dc1/a", False)
    entry = build_entry(feasible, E1, req(3), rejections, held=1, epoch=7, now=0.0, headroom=1)
    # need 3: msb a free keeps a-full-ish, a-3q (ids order at equal cpu), a-half -> 4 >= 3: a-empty left out
    assert set(entry.machines) == {"a-3q", "a-full-ish", "a-half", "a-held", "b-1"}
    assert entry.truncated == frozenset({("dc1/a", True), ("dc1/b", True)})


# --- an in-memory region, counted as index.py counts -----------------------------------------------------------

class Region:
    def __init__(self, machines):
        self.machines = {x.id: x for x in machines}
        self.epochs = Counter()

    def held(self, ent):
        return sum(x.entitlement == ent for x in self.machines.values())

    def snapshot(self, ent):
        return {i: x for i, x in self.machines.items() if x.entitlement in (None, ent)}

    def change(self, mid, **fields):
        """Any change but the allocator's: a version bump, counted in the epoch of the entitlement holding it."""
        x = self.machines[mid]
        x = self.machines[mid] = replace(x, version=x.version + 1, **fields)
        if x.entitlement:
            self.epochs[x.entitlement] += 1

    def commit(self, plan, ent, cpu, mem):
        """The commit script's effect: each machine of the plan joins and takes its tasks, one bump."""
        before = self.epochs[ent]
        n = Counter(mid for _, mid in plan.placements)
        versions = {}
        for mid in n.keys() | set(plan.machines_added):
            x = self.machines[mid]
            self.machines[mid] = replace(x, entitlement=ent, cpu_free=x.cpu_free - cpu * n[mid],
                                         mem_free=x.mem_free - mem * n[mid], version=x.version + 1)
            self.epochs[ent] += 1
            versions[mid] = x.version + 1
        return versions, before, self.epochs[ent]


def allocate(region, cache, ent, request_, now=0.0):
    """index.allocate's use of the cache, without Redis: (plan, hit)."""
    shape = shape_of(ent, request_)
    plan = None
    if (entry := cache.get(shape, now)) is not None:
        plan = lookup(entry, region.machines, region.machines, ent, request_, region.held(ent.name),
                      region.epochs[ent.name])
    hit = plan is not None
    if plan is None:
        held, epoch = region.held(ent.name), region.epochs[ent.name]
        out = placement.run(region.snapshot(ent.name), ent, request_, held)
        plan = out.plan
        cache.put(shape, build_entry(out.feasible, ent, request_, plan.filter_rejections, held, epoch, now)
                  if plan.placements else None)
    if plan.placements:
        seen = dict(region.machines)
        versions, before, after = region.commit(plan, ent.name, request_.cpu, request_.mem)
        cache.observe_commit(ent.name, machines_after(seen, plan, ent.name, request_.cpu, request_.mem, versions),
                             len(plan.machines_added), before, after)
    return plan, hit


def decision(plan):
    return plan.placements, plan.machines_added, dict(plan.fault_domain_bins), plan.unplaced, plan.reason


def region_of(n, seed):
    rnd = random.Random(seed)
    return Region([m(f"m{i:03d}", dc=f"dc{i % 2}", msb=f"msb{i % 3}", rack=f"r{i % 5}",
                     cpu=rnd.choice((4000, 8000)), used_cpu=rnd.choice((0, 0, 1000, 3000)), mem=16384,
                     ent=rnd.choice((None, None, "e1", "e2")), status=rnd.choice(("UP",) * 9 + ("DOWN",)),
                     version=rnd.randint(1, 5)) for i in range(n)])


@pytest.mark.parametrize("seed", range(12))
def test_a_hit_decides_as_a_full_placement(seed):
    """Jobs of a few shapes in two entitlements arrive; now and then a machine an entitlement holds changes
    outside the allocator. Every hit must equal place() over the whole region at that moment."""
    rnd = random.Random(seed)
    region, cache = region_of(rnd.choice((150, 300)), seed), AllocationCache()
    ents = {"e1": Entitlement("e1", 60), "e2": Entitlement("e2", 60)}
    shapes = [dict(cpu=1000, mem=1024), dict(cpu=1000, mem=1024, spread="rack"), dict(cpu=500, mem=4096),
              dict(cpu=1000, mem=1024, requirements={"dc": "dc1"})]
    hits = misses = 0
    for i in range(120):
        if rnd.random() < 0.1:
            mid = rnd.choice([x.id for x in region.machines.values() if x.entitlement])
            region.change(mid, status=rnd.choice(("UP", "UP", "DOWN")))
        ent = ents[rnd.choice(sorted(ents))]
        job = f"{ent.name}-j{i}"
        existing = {}
        if rnd.random() < 0.3:  # the job grows: its placed tasks count in the spread
            placed = [mid for mid, x in region.machines.items() if x.entitlement == ent.name]
            existing = {f"{job}/{k + 100}": rnd.choice(placed) for k in range(3)} if placed else {}
        request_ = req(rnd.randint(1, 12), job=job, ent=ent.name, existing=existing, **rnd.choice(shapes))
        full = placement.place(region.snapshot(ent.name), ent, request_, region.held(ent.name))
        plan, hit = allocate(region, cache, ent, request_)
        if hit:
            hits += 1
            assert plan.cache_hit and decision(plan) == decision(full), (seed, i)
        else:
            misses += 1
            assert not plan.cache_hit and plan == full
    assert hits >= 30 and misses >= 10, (hits, misses)


# --- misses ----------------------------------------------------------------------------------------------------

def _warm(n_tasks=2):
    """Three MSBs of two free machines; one allocation of a shape fills the cache, written through."""
    region = Region([m(f"{s}{i}", msb=s) for s in "abc" for i in (1, 2)])
    cache = AllocationCache()
    plan, hit = allocate(region, cache, E1, req(n_tasks, job="first"))
    assert not hit and plan.placements
    return region, cache


def test_the_same_shape_again_hits():
    region, cache = _warm()
    plan, hit = allocate(region, cache, E1, req(2, job="second"))
    assert hit and plan.cache_hit and plan.placements == (("second/0", "a1"), ("second/1", "b1"))


MISSES = {
    "kept-machine-changed": lambda r: r.change("c1", status="DOWN"),
    "held-machine-changed": lambda r: r.change("a1", status="UP"),  # epoch and version
    "entitlement-changed-elsewhere": lambda r: (r.machines.update(z=m("z", ent="e1")), r.epochs.update(["e1"])),
    "kept-machine-gone": lambda r: r.machines.pop("c2"),
    "taken-by-another-entitlement": lambda r: r.change("c1", entitlement="e2"),
}


@pytest.mark.parametrize("change", MISSES.values(), ids=MISSES.keys())
def test_a_change_to_what_the_entry_vouches_for_is_a_miss(change):
    region, cache = _warm()
    change(region)
    plan, hit = allocate(region, cache, E1, req(2, job="second"))
    assert not hit and not plan.cache_hit
    # the miss stored a fresh entry: the next one hits again
    assert allocate(region, cache, E1, req(2, job="third"))[1]


def test_a_hit_never_answers_unplaced():
    region, cache = _warm()
    plan, hit = allocate(region, cache, E1, req(100, job="huge"))  # more than the region holds
    assert not hit and plan.unplaced and plan.reason == placement.NO_FEASIBLE_MACHINE


def test_an_entry_whose_kept_machines_run_out_misses():
    """HEADROOM x 1 task keeps, per MSB, the fullest machines for 4 tasks: after enough hits they fill up and a
    left-out machine of the same MSB could win; the lookup sees it and misses."""
    region = Region([m(f"{s}{i}", msb=s, cpu=2000 if i == 1 else 8000) for s in "ab" for i in (1, 2, 3)])
    cache = AllocationCache()
    outcomes = [allocate(region, cache, E1, req(1, job=f"j{k}", cpu=1000, spread="msb"))[1] for k in range(8)]
    assert outcomes[0] is False and True in outcomes
    entry = cache.get(shape_of(E1, req(1)), 0.0)
    assert entry is not None and entry.truncated  # the 8000m machines were left out at first


def test_once_another_entitlement_took_the_kept_free_machines_of_a_bin_the_lookup_misses():
    """Machines of one task each, six per MSB; the entry keeps 4 per MSB. e1's first job fills a1; then e2's
    jobs take a2..a4 (written through: they leave e1's entry). A full placement of e1's next job would use a5,
    which the entry left out: nothing kept in MSB a proves it cannot win, so the lookup misses."""
    region = Region([m(f"{s}{i}", msb=s, cpu=1000) for s in "ab" for i in range(1, 7)])
    cache, e2 = AllocationCache(), Entitlement("e2", 100)
    assert allocate(region, cache, E1, req(1, job="first"))[0].placements == (("first/0", "a1"),)
    for k in range(3):
        allocate(region, cache, e2, req(1, job=f"other{k}", ent="e2"))
    assert {x.id for x in region.machines.values() if x.entitlement == "e2"} == {"a2", "a3", "a4"}
    full = placement.place(region.snapshot("e1"), E1, req(2, job="second"), 1)
    assert full.placements == (("second/0", "a5"), ("second/1", "b1"))
    plan, hit = allocate(region, cache, E1, req(2, job="second"))
    assert not hit and plan.placements == full.placements


def test_a_free_machine_registered_after_the_entry_was_built_is_not_considered_by_a_hit():
    """Staleness, as documented: the free pool outside an entry is not watched. Machines of one task each: the
    first job fills a1; then a0 registers. A full placement would take a0 (same free cpu, lower id); the hit
    takes a2, which is as good -- and still committed through the optimistic check."""
    region = Region([m(f"{s}{i}", msb=s, cpu=1000) for s in "abc" for i in (1, 2)])
    cache = AllocationCache()
    assert allocate(region, cache, E1, req(1, job="first"))[0].placements == (("first/0", "a1"),)
    region.machines["a0"] = m("a0", msb="a", cpu=1000)
    assert placement.place(region.snapshot("e1"), E1, req(1, job="second"), 1).placements == (("second/0", "a0"),)
    plan, hit = allocate(region, cache, E1, req(1, job="second"))
    assert hit and plan.placements == (("second/0", "a2"),)


# --- write-through and the cache's bookkeeping ----------------------------------------------------------------

def test_write_through_keeps_only_what_the_entry_can_vouch_for():
    machines = {x.id: x for x in (m("a", msb="a"), m("b", msb="b"), m("c", msb="c", type="broadwell"))}
    request_ = req(1, requirements={"machine_type": "skylake"})
    feasible, rej = placement.filter_machines(machines.values(), E1, request_)
    entry = build_entry([x for x in feasible if x.id == "a"], E1, request_, rej, held=0, epoch=3, now=0.0)
    plan = placement.place([machines["a"], machines["b"]], E1, req(1), 0)
    assert plan.placements == (("j/0", "a"),)
    after = committed(entry, machines_after(machines, plan, "e1", 1000, 1024, {"a": 2}), 1, 3, 5)
    assert after.machines == {"a": Kept(2, "dc1/a", True)} and (after.held, after.epoch) == (1, 5)
    # another shape's commit filled b (not kept, passes the filters): kept now, but proves nothing;
    # c fails the entry's filters (type): not its business
    other = placement.Plan((("k/0", "b"), ("k/1", "c")), ("b", "c"), {}, {}, (), None, None)
    later = committed(after, machines_after(machines, other, "e1", 1000, 1024, {"b": 2, "c": 2}), 2, 5, 7)
    assert later.machines == {"a": Kept(2, "dc1/a", True), "b": Kept(2, "dc1/b", False, blocker=False)}
    assert (later.held, later.epoch) == (3, 7)
    assert committed(after, {}, 0, 6, 7) is None  # something else changed the entitlement meanwhile
    assert without(after, ["a", "zz"]).machines == {} and without(after, ["zz"]) is after


def test_the_cache_expires_and_evicts_least_recently_used():
    cache = AllocationCache(max_entries=2, max_age_s=10.0)
    entry = build_entry([m("a")], E1, req(1), {}, held=0, epoch=0, now=100.0)
    for k in "xyz":
        cache.put(k, entry)
        if k == "y":
            assert cache.get("x", 105.0) is entry  # x used: y is now the oldest
    assert len(cache) == 2 and cache.get("y", 105.0) is None and cache.get("x", 105.0) is entry
    assert cache.get("z", 110.5) is None and len(cache) == 1  # older than max_age_s: gone
    cache.put("x", None)
    assert len(cache) == 0
