"""A request's targets (a ReBalancer move): placement's ``pin`` stage, and the fold placing a request with targets
(processors/allocator/placement.py, fold.py); and the fold's host-profile state of a machine."""
import pytest

from allocator_log import (
    Log, allocated, assign, e1, ev, m, profile, reg, req, requested,
)
from processors.allocator import placement
from processors.allocator.fold import PROFILE_APPLIED, PROFILE_FAILED, PROFILE_PENDING, RegionFold, profile_state
from processors.allocator.placement import (
    FILTER_AVOIDED, FILTER_CPU, FILTER_MAINTENANCE, FILTER_OTHER_ENTITLEMENT, FILTER_STATUS, QUOTA_EXCEEDED,
    TARGET_REJECTED, UNKNOWN_TARGET,
)

# name: (target machines, request, held machines, expected placements, expected rejections)
PIN_CASES = {
    "on-its-target": ({"m2": m("m2", ent="e1")}, req(1, targets={"j/0": "m2"}), 1, [("j/0", "m2")], {}),
    "a-free-target-joins": ({"m2": m("m2")}, req(1, targets={"j/0": "m2"}), 1, [("j/0", "m2")], {}),
    "quota-full": ({"m2": m("m2")}, req(1, targets={"j/0": "m2"}), 10, [], {QUOTA_EXCEEDED: 1}),
    "target-down": ({"m2": m("m2", ent="e1", status="DOWN")}, req(1, targets={"j/0": "m2"}), 1, [],
                    {FILTER_STATUS: 1}),
    "target-in-maintenance": ({"m2": m("m2", ent="e1", maintenance=("ue1",))}, req(1, targets={"j/0": "m2"}), 1, [],
                              {FILTER_MAINTENANCE: 1}),
    "target-avoided": ({"m2": m("m2", ent="e1")}, req(1, targets={"j/0": "m2"}, avoid_machine_ids={"m2"}), 1, [],
                       {FILTER_AVOIDED: 1}),
    "another-entitlements": ({"m2": m("m2", ent="e2")}, req(1, targets={"j/0": "m2"}), 1, [],
                             {FILTER_OTHER_ENTITLEMENT: 1}),
    "room-for-one-of-two": ({"m2": m("m2", ent="e1", used_cpu=2500)}, req(2, targets={"j/0": "m2", "j/1": "m2"}), 1,
                            [("j/0", "m2")], {FILTER_CPU: 1}),
    "unknown-machine": ({}, req(1, targets={"j/0": "m9"}), 1, [], {UNKNOWN_TARGET: 1}),
    "no-targets": ({}, req(2), 1, [], {}),
}


@pytest.mark.parametrize("targets, request_, held, placements, rejected", PIN_CASES.values(), ids=PIN_CASES)
def test_pin(targets, request_, held, placements, rejected):
    pinned = placement.pin(targets, e1(quota=10), request_, held)
    assert list(pinned.placements) == placements
    assert dict(pinned.rejected) == {TARGET_REJECTED + r: n for r, n in rejected.items()}
    assert list(pinned.added) == [mid for _, mid in placements if targets[mid].entitlement is None][:1]


def region(*events):
    fold, log = RegionFold(), Log()
    for e in events:
        fold.apply(*log.add(e))
    return fold, log


def entitlement_created(name="e1", quota=10, host_profile=None):
    return ev("EntitlementCreated", name, name, {"name": name, "quota_machines": quota, "machine_type": None,
                                                 "dc_pin": None, "host_profile": host_profile})


def targeted_region():
    return region(entitlement_created(), *(reg(f"m{i}", msb=f"msb{i}") for i in range(1, 5)),
                  requested("r0", "e1", ["j/0", "j/1"]),
                  allocated("r0", "e1", [("j/0", "m1"), ("j/1", "m1")], added=["m1"]))[0]


def test_the_fold_places_a_targeted_task_on_its_target_and_the_rest_as_usual():
    fold = targeted_region()
    ent = fold.entitlement("e1")
    request = placement.Request("r1", "j", "e1", ("j/2", "j/3", "j/4"), 1000, 1024, spread="msb",
                                existing=fold.existing("j"), targets={"j/3": "m4"})
    plan = fold.place(ent, request)
    where = dict(plan.placements)
    assert where["j/3"] == "m4" and "m4" in plan.machines_added
    assert [t for t, _ in plan.placements] == ["j/2", "j/3", "j/4"]
    assert plan.fault_domain_bins["dc1/msb4"] == 1  # the pinned task counts in the spread
    assert "m4" not in {where["j/2"], where["j/4"]}  # ... and on m4's capacity: spread over the others
    # placing with targets leaves the index as it was: the next plan equals a fresh fold's
    plain = placement.Request("r2", "j", "e1", ("j/5", "j/6"), 1000, 1024, existing=fold.existing("j"))
    assert fold.place(ent, plain) == targeted_region().place(ent, plain)


def test_a_target_that_no_longer_fits_is_counted_and_the_task_placed_elsewhere():
    fold, _ = region(entitlement_created(), reg("m1"), reg("m2"), requested("r0", "e1", ["k/0"], cpu=4000, job="k"),
                     allocated("r0", "e1", [("k/0", "m2")], added=["m2"], job="k"))
    request = placement.Request("r1", "j", "e1", ("j/0",), 1000, 1024, targets={"j/0": "m2"})
    plan = fold.place(fold.entitlement("e1"), request)
    assert dict(plan.placements) == {"j/0": "m1"}
    assert plan.filter_rejections[TARGET_REJECTED + FILTER_CPU] == 1


def failed(mid, p, ent="e1"):
    return ev("HostProfileFailed", ent, mid, {"machine_id": mid, "host_profile": p, "request_id": "x",
                                              "reason": "test"})


PROFILE_CASES = {
    "free-machine": ([reg("m1", profile="web")], (None, PROFILE_APPLIED)),
    "assigned-default-wanted": ([entitlement_created(), reg("m1"), assign("m1", "e1")], ("", PROFILE_APPLIED)),
    "assigned-switch-pending": ([entitlement_created(host_profile="web"), reg("m1"), assign("m1", "e1")],
                                ("web", PROFILE_PENDING)),
    "applied": ([entitlement_created(host_profile="web"), reg("m1"), assign("m1", "e1"), profile("m1", "web")],
                ("web", PROFILE_APPLIED)),
    "failed": ([entitlement_created(host_profile="web"), reg("m1"), assign("m1", "e1"), failed("m1", "web")],
               ("web", PROFILE_FAILED)),
    "failed-then-applied": ([entitlement_created(host_profile="web"), reg("m1"), assign("m1", "e1"),
                             failed("m1", "web"), profile("m1", "web")], ("web", PROFILE_APPLIED)),
}


@pytest.mark.parametrize("events, expected", PROFILE_CASES.values(), ids=PROFILE_CASES)
def test_profile_state(events, expected):
    fold, _ = region(*events)
    st = profile_state(fold, fold.machines["m1"])
    assert (st["host_profile_wanted"], st["host_profile_state"]) == expected


def test_a_new_profile_of_an_entitlement_changes_its_machines_versions():
    fold, _ = region(entitlement_created(), reg("m1"), assign("m1", "e1"), reg("m2"))
    v1, v2 = fold.machines["m1"].version, fold.machines["m2"].version
    fold.drain_changes()
    fold.apply(ev("EntitlementUpdated", "e1", "e1", {"quota_machines": None, "machine_type": None, "dc_pin": None,
                                                     "host_profile": "web"}), None)
    assert fold.machines["m1"].version == v1 + 1 and fold.machines["m2"].version == v2
    assert set(fold.drain_changes()) == {"m1"}
    assert profile_state(fold, fold.machines["m1"])["host_profile_state"] == PROFILE_PENDING
