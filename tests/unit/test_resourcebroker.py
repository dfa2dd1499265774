"""Table-driven tests of the Resource Broker's pure decisions and of folding its state from the log."""
import pytest

from processors.resourcebroker.decide import (
    DOWN, KIND_FAILURE, KIND_MAINTENANCE, MAINTENANCE, REASON_HEALTH_CHECK, REASON_MAINTENANCE,
    REASON_MAINTENANCE_ENDED, REASON_OPERATOR, UNHEALTHY, UP, BadMaintenance, BadTarget, BrokerError, BrokerState,
    CowMap, IllegalStatusTransition, RegistrationConflict, Target, UnknownMachine, apply, apply_all,
    failure_unavailability_id, machine_failed, machine_recovered, maintenance_ended, maintenance_started,
    parse_target, plan_maintenance, register, register_all, resolve_targets,
)
from processors.cowmap import MACHINE_SHARDS
from processors.resourcebroker.region import MachineSpec, machines, parse_region
from streams import batches
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
T0 = 1_700_000_000_000

# dc1: msb1 and msb2, racks r01 r02 each, 2 machines a rack (8); dc2: one rack of 2.
REGION = parse_region({
    "region": "r1",
    "defaults": {"machines_per_rack": 2, "machine_types": "skylake",
                 "capacity": {"skylake": {"cpu_millicores": 32000, "memory_mib": 131072}}},
    "dcs": [{"name": "dc1", "msbs": 2, "racks_per_msb": 2}, {"name": "dc2", "msbs": 1, "racks_per_msb": 1}],
})
MACHINES = machines(REGION)
M = {m.id: m for m in MACHINES}
A1, A2 = "dc1-msb1-r01-m001", "dc1-msb1-r01-m002"  # rack dc1/msb1/r01
B1, B2 = "dc1-msb1-r02-m001", "dc1-msb1-r02-m002"  # rack dc1/msb1/r02
C1 = "dc1-msb2-r01-m001"
D1 = "dc2-msb1-r01-m001"


def valid(events):
    """Every event encodes with its schema: the payload field names are the contract."""
    for ev in events:
        REG.encode(ev.type, ev.to_record(schema_version=1))
    return events


def assigned(machine_id, entitlement, t=T0 + 1):
    return new_event("MachineAssignedToEntitlement", {"machine_id": machine_id, "dc": M[machine_id].dc,
                                                      "reason": "req-1"},
                     entitlement=entitlement, entity_id=machine_id, producer="allocator", timestamp_ms=t)


def released(machine_id, entitlement, t=T0 + 2):
    return new_event("MachineReleasedToFreePool", {"machine_id": machine_id, "dc": M[machine_id].dc,
                                                   "reason": "entitlement_empty"},
                     entitlement=entitlement, entity_id=machine_id, producer="allocator", timestamp_ms=t)


def status_changed(machine_id, status, key, t=T0 + 3, previous=UP, reason="x"):
    return new_event("MachineStatusChanged", {"machine_id": machine_id, "status": status,
                                              "previous_status": previous, "reason": reason},
                     entitlement=key, entity_id=machine_id, producer="test", timestamp_ms=t)


def registered_state(owners=None, statuses=None):
    """Every machine of REGION registered; ``owners`` maps machine → entitlement, ``statuses`` machine → status."""
    state, _ = register_all(BrokerState(), MACHINES, T0)
    for mid, ent in (owners or {}).items():
        state = apply(state, assigned(mid, ent))
    for mid, status in (statuses or {}).items():
        state = apply(state, status_changed(mid, status, state.get(mid).owner_key))
    return state


def summary(events):
    """(type, key, machine or UE machines, status or kind) per event."""
    out = []
    for ev in events:
        p = ev.payload
        what = p.get("status") or p.get("kind") or ""
        if ev.type in ("MachinesStatusChanged", "MachinesRegistered"):
            machines = tuple(m["machine_id"] for m in p["machines"])
        else:
            machines = p["machine_id"] if "machine_id" in p else tuple(p["machine_ids"])
        out.append((ev.type, ev.entitlement, machines, what))
    return out


# Status transitions (the machines' one table, the health check's too): tests/unit/test_machine_status.py


# -- registration ----------------------------------------------------------------------------------------------

def test_register_new_machine_in_its_free_pool():
    state, events = register(BrokerState(), M[A1], T0)
    assert summary(valid(events)) == [("MachinesRegistered", "free/dc1", (A1,), "")]
    ev = events[0]
    assert ev.payload == {"machines": [{
        "machine_id": A1, "topology": {"region": "r1", "dc": "dc1", "msb": "msb1", "rack": "r01"},
        "machine_type": "skylake", "capacity": {"cpu_millicores": 32000, "memory_mib": 131072}, "host_profile": None}]}
    assert (ev.entity_id, ev.timestamp_ms, ev.producer) == ("free/dc1", T0, "resourcebroker")
    rec = state.get(A1)
    assert (rec.status, rec.owner, rec.owner_key, rec.fault_domain("rack")) == (UP, None, "free/dc1", "dc1/msb1/r01")


# (state before, machine registered, expected (type, key, machine, "") per event)
REGISTRATIONS = {
    "identical-again": (registered_state(), M[A1], []),
    "capacity-changed": (registered_state(), M[A1]._replace(cpu_millicores=64000),
                         [("MachinesRegistered", "free/dc1", (A1,), "")]),
    "type-changed-owned-machine": (registered_state({A1: "e1"}), M[A1]._replace(machine_type="broadwell"),
                                   [("MachinesRegistered", "e1", (A1,), "")]),
    "new-machine-next-to-known": (registered_state(), MachineSpec("dc2-msb1-r01-m003", "r1", "dc2", "msb1", "r01",
                                                                  "skylake", 1000, 1024),
                                  [("MachinesRegistered", "free/dc2", ("dc2-msb1-r01-m003",), "")]),
}


@pytest.mark.parametrize("state, machine, expected", REGISTRATIONS.values(), ids=REGISTRATIONS.keys())
def test_register(state, machine, expected):
    new_state, events = register(state, machine, T0 + 10)
    assert summary(valid(events)) == expected
    rec = new_state.get(machine.id)
    assert (rec.machine_type, rec.cpu_millicores, rec.memory_mib) == machine[5:]
    assert rec.owner == (state.get(machine.id).owner if state.get(machine.id) else None)  # owner and status stay


def test_register_is_idempotent():
    state, events = register_all(BrokerState(), MACHINES, T0)
    assert len(valid(events)) == 2 and len(MACHINES) == len(state) == 10  # one record per DC's free pool
    assert [r["machine_id"] for e in events for r in batches.machine_registrations(e)] == [m.id for m in MACHINES]
    again, more = register_all(state, MACHINES, T0 + 5)
    assert (again, more) == (state, [])
    assert again is state


def test_register_replay_emits_the_same_ids():
    _, first = register_all(BrokerState(), MACHINES, T0)
    _, second = register_all(BrokerState(), MACHINES, T0)
    assert [e.event_id for e in first] == [e.event_id for e in second]
    assert len({e.event_id for e in first}) == len(first)


def test_registration_at_another_place_conflicts():
    moved = M[A1]._replace(rack="r02")
    with pytest.raises(RegistrationConflict, match=r"machine dc1-msb1-r01-m001 is registered at r1/dc1/msb1/r01, "
                                                   r"not r1/dc1/msb1/r02"):
        register(registered_state(), moved, T0)


# -- failure and recovery --------------------------------------------------------------------------------------

# (owners, statuses, machine failed, expected summary, previous status)
FAILURES = {
    "free-machine": ({}, {}, A1, [("MachineStatusChanged", "free/dc1", A1, DOWN),
                                  ("UnavailabilityStarted", "free/dc1", (A1,), KIND_FAILURE)], UP),
    "owned-machine": ({A1: "e1"}, {}, A1, [("MachineStatusChanged", "e1", A1, DOWN),
                                           ("UnavailabilityStarted", "e1", (A1,), KIND_FAILURE)], UP),
    "unhealthy-machine": ({D1: "e2"}, {D1: UNHEALTHY}, D1, [("MachineStatusChanged", "e2", D1, DOWN),
                                                           ("UnavailabilityStarted", "e2", (D1,), KIND_FAILURE)],
                          UNHEALTHY),
    "in-maintenance": ({}, {C1: MAINTENANCE}, C1, [("MachineStatusChanged", "free/dc1", C1, DOWN),
                                                   ("UnavailabilityStarted", "free/dc1", (C1,), KIND_FAILURE)],
                       MAINTENANCE),
    "already-down": ({A1: "e1"}, {A1: DOWN}, A1, [], None),
}


@pytest.mark.parametrize("owners, statuses, machine_id, expected, previous", FAILURES.values(), ids=FAILURES.keys())
def test_machine_failed(owners, statuses, machine_id, expected, previous):
    state = registered_state(owners, statuses)
    new_state, events = machine_failed(state, machine_id, REASON_OPERATOR, T0 + 100, causation_id="cmd-1")
    assert summary(valid(events)) == expected
    if not events:
        assert new_state is state
        return
    status, ue = events
    assert status.payload["previous_status"] == previous and status.payload["reason"] == REASON_OPERATOR
    assert ue.payload["unavailability_id"] == ue.entity_id == failure_unavailability_id(status.event_id)
    assert (ue.payload["start_ms"], ue.payload["deadline_ms"], ue.payload["reason"]) == (T0 + 100, None, "operator")
    assert {status.causation_id, ue.causation_id} == {"cmd-1"}
    assert new_state.get(machine_id).status == DOWN
    assert new_state.get(machine_id).status_event_id == status.event_id
    assert machine_failed(state, machine_id, REASON_OPERATOR, T0 + 100, causation_id="cmd-1") == (new_state, events)


def test_failure_then_recovery_is_a_pair_of_events():
    state = registered_state({A1: "e1"})
    state, failed = machine_failed(state, A1, REASON_HEALTH_CHECK, T0 + 100)
    state, recovered = machine_recovered(state, A1, REASON_OPERATOR, T0 + 200)
    assert summary(valid(recovered)) == [("MachineStatusChanged", "e1", A1, UP),
                                         ("UnavailabilityEnded", "e1", (A1,), "")]
    assert recovered[0].payload["previous_status"] == DOWN
    assert recovered[1].payload["unavailability_id"] == failed[1].payload["unavailability_id"]
    assert state.get(A1).status == UP
    assert machine_recovered(state, A1, REASON_OPERATOR, T0 + 300) == (state, [])  # UP already: nothing


def test_recovery_is_keyed_to_the_owner_now():
    state = registered_state({A1: "e1"})
    state, failed = machine_failed(state, A1, REASON_OPERATOR, T0 + 100)
    state = apply(state, released(A1, "e1", T0 + 150))  # the allocator gave the failed machine back
    state, recovered = machine_recovered(state, A1, REASON_OPERATOR, T0 + 200)
    assert [e.entitlement for e in recovered] == ["free/dc1", "free/dc1"]
    assert recovered[1].payload["unavailability_id"] == failed[1].payload["unavailability_id"]


def test_two_failures_of_one_machine_get_different_ids():
    state = registered_state()
    state, first = machine_failed(state, A1, REASON_OPERATOR, T0 + 100)
    state, _ = machine_recovered(state, A1, REASON_OPERATOR, T0 + 200)
    state, second = machine_failed(state, A1, REASON_OPERATOR, T0 + 300)
    assert not {e.event_id for e in first} & {e.event_id for e in second}
    assert first[1].payload["unavailability_id"] != second[1].payload["unavailability_id"]


@pytest.mark.parametrize("decide, machine_id, statuses, error", [
    (machine_failed, "nope", {}, UnknownMachine),
    (machine_recovered, "nope", {}, UnknownMachine),
    (machine_recovered, A1, {A1: UNHEALTHY}, IllegalStatusTransition),
    (machine_recovered, A1, {A1: MAINTENANCE}, IllegalStatusTransition),
])
def test_failure_and_recovery_reject(decide, machine_id, statuses, error):
    with pytest.raises(error):
        decide(registered_state(statuses=statuses), machine_id, REASON_OPERATOR, T0)


def test_a_reason_is_required():
    with pytest.raises(BrokerError, match="a reason is required"):
        machine_failed(registered_state(), A1, "", T0)


# -- planned maintenance ---------------------------------------------------------------------------------------

OWNERS = {A1: "e1", B1: "e1", B2: "e2", C1: "e2"}  # A2 and the rest are free


# (targets, expected (key, machines) per UnavailabilityStarted)
PLANS = {
    "one-rack-two-owners": (["rack:dc1/msb1/r01"], [("e1", (A1,)), ("free/dc1", (A2,))]),
    "msb-three-owners": (["msb:dc1/msb1"], [("e1", (A1, B1)), ("e2", (B2,)), ("free/dc1", (A2,))]),
    "bare-rack-path": (["dc1/msb1/r02"], [("e1", (B1,)), ("e2", (B2,))]),
    "two-dcs": (["dc:dc2", "machine:" + C1], [("e2", (C1,)), ("free/dc2", (D1, "dc2-msb1-r01-m002"))]),
    "overlapping-targets-once": ([A1, "rack:dc1/msb1/r01", Target("machine", A2)],
                                 [("e1", (A1,)), ("free/dc1", (A2,))]),
    "whole-dc": (["dc:dc1"], [("e1", (A1, B1)), ("e2", (B2, C1)),
                              ("free/dc1", (A2, "dc1-msb2-r01-m002", "dc1-msb2-r02-m001", "dc1-msb2-r02-m002"))]),
}


@pytest.mark.parametrize("targets, expected", PLANS.values(), ids=PLANS.keys())
def test_plan_maintenance_groups_per_entitlement(targets, expected):
    state = registered_state(OWNERS)
    start, deadline, now = T0 + 3_600_000, T0 + 3_000_000, T0
    new_state, events = plan_maintenance(state, targets, start, 600_000, deadline, now, reason="rack switch")
    valid(events)
    assert new_state == state  # statuses change only when the window opens
    assert [(e.entitlement, tuple(e.payload["machine_ids"])) for e in events] == expected
    assert {e.type for e in events} == {"UnavailabilityStarted"}
    ue_ids = {e.payload["unavailability_id"] for e in events}
    assert len(ue_ids) == 1 and {e.entity_id for e in events} == ue_ids
    for e in events:
        assert (e.payload["kind"], e.payload["start_ms"], e.payload["deadline_ms"], e.payload["expected_duration_ms"],
                e.payload["reason"], e.timestamp_ms) == (KIND_MAINTENANCE, start, deadline, 600_000, "rack switch", now)
    assert len({e.event_id for e in events}) == len(events)
    assert plan_maintenance(state, targets, start, 600_000, deadline, now, reason="rack switch")[1] == events


def test_plan_maintenance_defaults():
    _, events = plan_maintenance(registered_state(), [A1], T0 + 10, 5, None, T0)
    assert events[0].payload["deadline_ms"] == T0 + 10 and events[0].payload["reason"] == REASON_MAINTENANCE
    _, named = plan_maintenance(registered_state(), [A1], T0 + 10, 5, None, T0, unavailability_id="ue-7")
    assert named[0].payload["unavailability_id"] == "ue-7"


@pytest.mark.parametrize("targets, message", [
    ([], "no maintenance targets given"),
    (["rack:dc1/msb1"], "maintenance target rack:dc1/msb1: expected machine:<id>"),
    (["msb:dc1/msb1/r01"], "expected machine:<id>"),
    (["pdu:dc1/p1"], "expected machine:<id>"),
    (["dc1/msb1/r01/x"], "expected machine:<id>"),
    (["msb:dc1/"], "expected machine:<id>"),
    (["machine:"], "expected machine:<id>"),
    (["nope"], "maintenance target machine:nope matches no registered machine"),
    (["rack:dc1/msb9/r01"], "maintenance target rack:dc1/msb9/r01 matches no registered machine"),
    (["dc:dc3"], "maintenance target dc:dc3 matches no registered machine"),
])
def test_bad_targets(targets, message):
    with pytest.raises(BadTarget, match=message.replace("(", r"\(")):
        plan_maintenance(registered_state(), targets, T0 + 10, 5, None, T0)


@pytest.mark.parametrize("start, duration, deadline, now, message", [
    (T0 + 10, 0, None, T0, "duration_ms must be a positive number of ms, got 0"),
    (T0 + 10, 5, T0 + 20, T0, "deadline"),  # the deadline after the start
    (T0 + 10, 5, T0 - 1, T0, "deadline"),  # the deadline already passed
    (T0 - 10, 5, None, T0, "deadline"),  # the window in the past
])
def test_bad_maintenance_times(start, duration, deadline, now, message):
    with pytest.raises(BadMaintenance, match=message):
        plan_maintenance(registered_state(), [A1], start, duration, deadline, now)


def test_parse_target():
    assert parse_target("dc1/msb1") == Target("msb", "dc1/msb1")
    assert parse_target("rack:dc1/msb1/r01") == Target("rack", "dc1/msb1/r01")
    assert parse_target(A1) == Target("machine", A1)
    assert str(parse_target("dc:dc2")) == "dc:dc2"
    assert resolve_targets(registered_state(), ["msb:dc1/msb2"]) == tuple(sorted(m for m in M if "msb2" in m and
                                                                                m.startswith("dc1")))


def test_maintenance_window_opens_and_closes():
    state = registered_state(OWNERS, {B1: DOWN, B2: UNHEALTHY})
    state, plan = plan_maintenance(state, ["msb:dc1/msb1"], T0 + 100, 50, None, T0)
    ue = plan[0].payload["unavailability_id"]
    ids = sorted({m for e in plan for m in e.payload["machine_ids"]})
    assert ids == [A1, A2, B1, B2]

    state, opened = maintenance_started(state, ue, ids, T0 + 100)
    assert summary(valid(opened)) == [("MachinesStatusChanged", "e1", (A1,), MAINTENANCE),  # one per owner
                                      ("MachinesStatusChanged", "e2", (B2,), MAINTENANCE),  # B1 is DOWN: stays DOWN
                                      ("MachinesStatusChanged", "free/dc1", (A2,), MAINTENANCE)]
    assert {e.payload["reason"] for e in opened} == {REASON_MAINTENANCE}
    assert [m["previous_status"] for e in opened for m in e.payload["machines"]] == [UP, UNHEALTHY, UP]
    assert maintenance_started(state, ue, ids, T0 + 101) == (state, [])  # repeated: nothing

    state, _ = machine_failed(state, A2, REASON_OPERATOR, T0 + 120)  # broke during the window

    state, closed = maintenance_ended(state, ue, ids, T0 + 150)
    assert summary(valid(closed)) == [("MachinesStatusChanged", "e1", (A1,), UP),
                                      ("MachinesStatusChanged", "e2", (B2,), UP),
                                      ("UnavailabilityEnded", "e1", (A1, B1), ""),
                                      ("UnavailabilityEnded", "e2", (B2,), ""),
                                      ("UnavailabilityEnded", "free/dc1", (A2,), "")]
    assert {e.payload["reason"] for e in closed[:2]} == {REASON_MAINTENANCE_ENDED}
    assert {e.payload["unavailability_id"] for e in closed[2:]} == {ue}
    assert {m: state.get(m).status for m in ids} == {A1: UP, A2: DOWN, B1: DOWN, B2: UP}
    again_state, again = maintenance_ended(state, ue, ids, T0 + 160)
    assert again_state is state and [e.event_id for e in again] == [e.event_id for e in closed[2:]]


def test_maintenance_of_unknown_machine_raises():
    with pytest.raises(UnknownMachine):
        maintenance_started(registered_state(), "ue", [A1, "nope"], T0)


# -- folding the log -------------------------------------------------------------------------------------------

def scenario():
    """A run of decisions and allocator events; returns (state after each step, every event in log order)."""
    log = []
    state, evs = register_all(BrokerState(), MACHINES, T0)
    log += evs
    for ev in (assigned(A1, "e1"), assigned(B2, "e2"), assigned(C1, "e1")):
        state = apply(state, ev)
        log.append(ev)
    state, evs = machine_failed(state, A1, REASON_OPERATOR, T0 + 10)
    log += evs
    state, evs = plan_maintenance(state, ["rack:dc1/msb1/r02"], T0 + 100, 10, None, T0 + 20)
    log += evs
    ue = evs[0].payload["unavailability_id"]
    state, evs = maintenance_started(state, ue, [B1, B2], T0 + 100)
    log += evs
    ev = released(C1, "e1", T0 + 105)
    state = apply(state, ev)
    log.append(ev)
    state, evs = machine_recovered(state, A1, REASON_OPERATOR, T0 + 110)
    log += evs
    return state, log


def test_state_rebuilds_from_the_log():
    state, log = scenario()
    assert apply_all(BrokerState(), log) == state
    one_by_one = BrokerState()
    for ev in log:
        one_by_one = apply(one_by_one, ev)
    assert one_by_one == state
    assert (state.get(A1).status, state.get(B1).status, state.get(C1).owner, state.get(B2).owner_key) == (
        UP, MAINTENANCE, None, "e2")


def test_applying_every_event_twice_gives_the_same_state():
    state, log = scenario()
    rebuilt = BrokerState()
    for ev in log:
        once = apply(rebuilt, ev)
        assert apply(once, ev) == once, ev.type
        rebuilt = once
    assert apply_all(BrokerState(), [e for ev in log for e in (ev, ev)]) == state


# (state, events folded, machine, expected (status, owner))
FOLDS = {
    "assign-free-machine": (registered_state(), [assigned(A1, "e1")], A1, (UP, "e1")),
    "older-assignment-to-another-ignored": (registered_state({A1: "e1"}), [assigned(A1, "e2", T0)], A1, (UP, "e1")),
    # A machine's events change partitions with its owner, so a reader of several partitions may read them out of
    # order (the kill storm's restarted readers did): the newest owner and status win, whatever the read order.
    "newer-assignment-wins-over-a-release-read-later": (
        registered_state({A1: "e1"}), [assigned(A1, "e2", T0 + 9), released(A1, "e1", T0 + 5)], A1, (UP, "e2")),
    "old-owner-assignment-new-owner-assignment-old-owner-release": (  # read in that order, as in the storm
        registered_state(), [assigned(A1, "e3", T0 + 10), assigned(A1, "e0", T0 + 30), released(A1, "e3", T0 + 20)],
        A1, (UP, "e0")),
    "release-and-assignment-of-one-millisecond-in-either-order": (
        registered_state({A1: "e1"}), [assigned(A1, "e2", T0 + 9), released(A1, "e1", T0 + 9)], A1, (UP, "e2")),
    "newer-status-read-before-an-older-one": (
        registered_state(), [status_changed(A1, UP, "e1", T0 + 20, previous=UNHEALTHY),
                             status_changed(A1, UNHEALTHY, "free/dc1", T0 + 10)], A1, (UP, None)),
    "release-by-holder": (registered_state({A1: "e1"}), [released(A1, "e1")], A1, (UP, None)),
    "release-by-other-ignored": (registered_state({A1: "e1"}), [released(A1, "e2")], A1, (UP, "e1")),
    "status-set": (registered_state(), [status_changed(A1, UNHEALTHY, "free/dc1")], A1, (UNHEALTHY, None)),
    "reregistration-keeps-status-and-owner": (
        registered_state({A1: "e1"}, {A1: DOWN}), register(registered_state({A1: "e1"}, {A1: DOWN}),
                                                            M[A1]._replace(memory_mib=1), T0 + 9)[1], A1, (DOWN, "e1")),
    "other-events-ignored": (registered_state(), [new_event("HostProfileApplied", {"machine_id": A1},
                                                            entitlement="e1", entity_id=A1, producer="x")],
                             A1, (UP, None)),
}


@pytest.mark.parametrize("state, events, machine_id, expected", FOLDS.values(), ids=FOLDS.keys())
def test_fold(state, events, machine_id, expected):
    new = apply_all(state, events)
    rec = new.get(machine_id)
    assert (rec.status, rec.owner) == expected
    assert apply_all(new, events) == new


def test_events_before_the_registration_are_kept():
    """An owner or status seen before the registration (another partition) survives it."""
    reg = register(BrokerState(), M[A1], T0)[1]
    early = [assigned(A1, "e1"), status_changed(A1, DOWN, "e1")]
    state = apply_all(BrokerState(), early)
    assert state.get(A1) is None  # not registered yet: decisions treat it as unknown
    with pytest.raises(UnknownMachine):
        machine_failed(state, A1, REASON_OPERATOR, T0)
    state = apply_all(state, reg)
    rec = state.get(A1)
    assert (rec.status, rec.owner, rec.rack, rec.registered) == (DOWN, "e1", "r01", True)


# -- the copy-on-write map -------------------------------------------------------------------------------------

def test_cowmap():
    base = CowMap({f"k{i}": i for i in range(1000)})
    changed = base.updated({"k1": -1, "new": 7})
    assert (len(base), base["k1"], "new" in base) == (1000, 1, False)  # the original is unchanged
    assert (len(changed), changed["k1"], changed["new"]) == (1001, -1, 7)
    assert changed == {**{f"k{i}": i for i in range(1000)}, "k1": -1, "new": 7}
    assert base.updated({}) is base
    assert base.updated({"k1": 1}) == base and base != changed
    assert sorted(changed) == sorted(changed.keys()) and len(list(changed)) == 1001
    assert changed.get("missing", "d") == "d"
    shared = sum(a is b for a, b in zip(base._shards, changed._shards))
    assert shared >= 254  # only the touched shards were copied
    with pytest.raises(TypeError):
        hash(base)


def test_a_cowmap_of_machines_grows_its_shards_so_a_big_update_copies_little():
    small = CowMap({f"m{i}": i for i in range(100)}, shards=MACHINE_SHARDS)
    assert len(small._shards) == 256
    grown = small.updated({f"m{i}": i for i in range(100, 5000)})  # past 16 a shard: laid out over 4,096
    assert len(grown._shards) == 4096 and grown == {f"m{i}": i for i in range(5000)} and len(small) == 100
    again = grown.updated({f"m{i}": -i for i in range(0, 5000, 50)})  # 100 keys: ~100 small shards copied
    assert sum(a is not b for a, b in zip(grown._shards, again._shards)) <= 100
    assert again["m50"] == -50 and grown["m50"] == 50
    assert len(CowMap({}, shards=MACHINE_SHARDS).updated({f"m{i}": i for i in range(70_000)})._shards) == 65_536
    with pytest.raises(ValueError, match="power of two"):
        CowMap(shards=100)
