"""Table-driven tests of the Health Check Service's pure decisions: heartbeats, timeouts, resumption."""
import pytest

from processors.health.decide import (
    HB_ACCEPTED, HB_AGENT_RESTARTED, HB_DUPLICATE, HB_STALE, HB_UNKNOWN_MACHINE, HEARTBEAT_MISSED, HEARTBEAT_RESUMED,
    MAX_CLOCK_SKEW_MS, HealthError, HealthState, MachineHealth, apply_all, classify, from_the_future, on_heartbeat,
    on_heartbeats, on_machine_event, on_tick,
)
from processors.resourcebroker.decide import DOWN, MAINTENANCE, UNHEALTHY, UP, BrokerState, register_all
from processors.resourcebroker.region import MachineSpec
from streams.batches import machine_statuses
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
TIMEOUT = 30_000
X, Y = "dc1-msb1-r01-m001", "dc1-msb1-r01-m002"
MACHINES = [MachineSpec(X, "r1", "dc1", "msb1", "r01", "skylake", 32000, 131072),
            MachineSpec(Y, "r1", "dc1", "msb1", "r01", "skylake", 32000, 131072)]
REGISTERED = register_all(BrokerState(), MACHINES, 0)[1]  # at t=0, keyed free/dc1


def watched():
    return apply_all(HealthState(), REGISTERED)


def hb(machine_id, seq, ts, event_id=None):
    return new_event("AgentHeartbeat", {"machine_id": machine_id, "running_task_ids": [], "sequence": seq},
                     entitlement="", entity_id=machine_id, producer="agent", timestamp_ms=ts,
                     event_id=event_id or f"hb-{machine_id}-{seq}-{ts}")


def status_ev(machine_id, status, ts, key="free/dc1", previous=UP, reason="operator"):
    return new_event("MachineStatusChanged", {"machine_id": machine_id, "status": status,
                                              "previous_status": previous, "reason": reason},
                     entitlement=key, entity_id=machine_id, producer="resourcebroker", timestamp_ms=ts)


def owner_ev(kind, machine_id, entitlement, ts):
    return new_event(kind, {"machine_id": machine_id, "dc": "dc1", "reason": ""}, entitlement=entitlement,
                     entity_id=machine_id, producer="allocator", timestamp_ms=ts)


def run(state, steps):
    """Run steps ("hb", machine, seq, ts) | ("tick", now) | ("log", event); returns (state, emitted per step)."""
    emitted = []
    for step in steps:
        if step[0] == "hb":
            state, events = on_heartbeat(state, hb(*step[1:]))
        elif step[0] == "tick":
            state, events = on_tick(state, step[1], TIMEOUT)
        else:
            state, events = on_machine_event(state, step[1]), []
        for ev in events:
            REG.encode(ev.type, ev.to_record(schema_version=1))
        emitted.append([(m["machine_id"], m["previous_status"], m["status"], m["reason"])
                        for e in events for m in machine_statuses(e)])
    return state, emitted


MISSED_X = (X, UP, UNHEALTHY, HEARTBEAT_MISSED)
MISSED_Y = (Y, UP, UNHEALTHY, HEARTBEAT_MISSED)
RESUMED_X = (X, UNHEALTHY, UP, HEARTBEAT_RESUMED)

# name: [(step, events it emits)]
TIMELINES = {
    "silent-since-registration": [
        (("tick", TIMEOUT), []),  # exactly the timeout: not yet
        (("tick", TIMEOUT + 1), [MISSED_X, MISSED_Y]),
        (("tick", TIMEOUT + 60_000), []),  # reported once
    ],
    "heartbeats-keep-it-up": [
        (("hb", X, 1, 10_000), []), (("hb", Y, 1, 10_000), []),
        (("hb", X, 2, 35_000), []), (("hb", Y, 2, 35_000), []),
        (("tick", 60_000), []),
        (("tick", 65_001), [MISSED_X, MISSED_Y]),
    ],
    "only-the-silent-one": [
        (("hb", X, 1, 20_000), []),
        (("tick", 40_000), [MISSED_Y]),
        (("tick", 50_001), [MISSED_X]),
    ],
    "missed-then-resumed-then-missed-again": [
        (("hb", Y, 1, 100_000), []),
        (("tick", 40_000), [MISSED_X]),
        (("tick", 45_000), []),
        (("hb", X, 1, 50_000), [RESUMED_X]),
        (("hb", X, 2, 55_000), []),  # resumed once
        (("tick", 85_001), [MISSED_X]),  # a new silence is a new report
    ],
    "duplicates-do-not-keep-it-alive": [
        (("hb", Y, 1, 100_000), []),
        (("hb", X, 5, 10_000), []),
        (("tick", 40_001), [MISSED_X]),
        (("hb", X, 5, 10_000), []),  # redelivered: not a sign of life
        (("tick", 50_000), []),
    ],
    "out-of-order-is-stale": [
        (("hb", Y, 1, 100_000), []),
        (("hb", X, 7, 20_000), []),
        (("hb", X, 6, 15_000), []),  # late: changes nothing, last seen stays 20s
        (("tick", 50_001), [MISSED_X]),
        (("hb", X, 6, 15_000), []),  # an old one cannot resume it either
    ],
    "agent-restart-resets-sequence": [
        (("hb", Y, 1, 100_000), []),
        (("hb", X, 40, 10_000), []),
        (("tick", 40_001), [MISSED_X]),
        (("hb", X, 0, 45_000), [RESUMED_X]),  # lower sequence, newer time: the agent started over
        (("hb", X, 1, 50_000), []),
        (("tick", 80_000), []),
    ],
    "heartbeat-older-than-the-verdict-does-not-resume": [
        (("hb", Y, 1, 100_000), []),
        (("tick", 40_000), [MISSED_X]),
        (("hb", X, 1, 39_000), []),  # sent before the verdict, delivered after it
        (("hb", X, 2, 41_000), [RESUMED_X]),
    ],
    "maintenance-is-not-judged": [
        (("hb", X, 1, 10_000), []), (("hb", Y, 1, 10_000), []),
        (("log", status_ev(X, MAINTENANCE, 12_000)), []),
        (("tick", 100_000), [MISSED_Y]),
        (("log", status_ev(X, UP, 200_000, previous=MAINTENANCE)), []),  # back: its silence counts from now
        (("tick", 230_000), []),
        (("tick", 230_001), [MISSED_X]),
    ],
    "down-is-not-judged-nor-resumed": [
        (("hb", Y, 1, 1_000_000), []),
        (("log", status_ev(X, DOWN, 1_000)), []),
        (("tick", 99_000), []),
        (("hb", X, 1, 99_500), []),  # recorded, but the broker decides when a DOWN machine is back
        (("log", status_ev(X, UP, 100_000, previous=DOWN)), []),
        (("tick", 130_000), []),  # silence counts from the later of its last heartbeat and its return
        (("tick", 130_001), [MISSED_X]),
    ],
    "own-verdict-echoed-after-resuming-is-ignored": [
        (("hb", Y, 1, 100_000), []),
        (("tick", 40_000), [MISSED_X]),
        (("hb", X, 1, 41_000), [RESUMED_X]),
        (("log", status_ev(X, UNHEALTHY, 40_000, reason=HEARTBEAT_MISSED)), []),  # our own, back from the log
        (("hb", X, 2, 42_000), []),  # still UP: no second resumption
        (("log", status_ev(X, UP, 41_000, previous=UNHEALTHY, reason=HEARTBEAT_RESUMED)), []),
        (("tick", 71_000), []),
    ],
    "unknown-machine-ignored": [
        (("hb", "ghost", 1, 1_000), []),
        (("tick", 20_000), []),
    ],
}


@pytest.mark.parametrize("timeline", TIMELINES.values(), ids=TIMELINES.keys())
def test_timeline(timeline):
    _, emitted = run(watched(), [step for step, _ in timeline])
    assert emitted == [expected for _, expected in timeline]


# (machine's last sequence, last seen, heartbeat sequence, heartbeat time, verdict)
VERDICTS = [
    (-1, 0, 0, 5, HB_ACCEPTED),  # the first heartbeat, sequence 0
    (3, 100, 4, 110, HB_ACCEPTED),
    (3, 100, 9, 90, HB_ACCEPTED),  # a higher sequence counts even if its clock is behind
    (3, 100, 3, 100, HB_DUPLICATE),
    (3, 100, 2, 90, HB_STALE),
    (3, 100, 2, 100, HB_STALE),
    (3, 100, 0, 101, HB_AGENT_RESTARTED),
    (3, 100, 3, 101, HB_AGENT_RESTARTED),
]


@pytest.mark.parametrize("last_seq, last_seen, seq, ts, verdict", VERDICTS)
def test_classify(last_seq, last_seen, seq, ts, verdict):
    state = HealthState(watched().machines.updated({X: MachineHealth(X, "free/dc1", last_seen_ms=last_seen,
                                                                     last_sequence=last_seq)}))
    assert classify(state, hb(X, seq, ts)) == verdict
    new_state, _ = on_heartbeat(state, hb(X, seq, ts))
    rec = new_state.machines[X]
    if verdict in (HB_DUPLICATE, HB_STALE):
        assert new_state is state
    else:
        assert (rec.last_sequence, rec.last_seen_ms) == (seq, max(last_seen, ts))


def test_classify_unknown_machine():
    assert classify(watched(), hb("ghost", 1, 1)) == HB_UNKNOWN_MACHINE
    assert on_heartbeat(watched(), hb("ghost", 1, 1)) == (watched(), [])


# (machine events folded after registration, expected key of X's events)
OWNER_KEYS = {
    "free-pool": ([], "free/dc1"),
    "assigned": ([owner_ev("MachineAssignedToEntitlement", X, "e1", 5)], "e1"),
    "assigned-then-released": ([owner_ev("MachineAssignedToEntitlement", X, "e1", 5),
                                owner_ev("MachineReleasedToFreePool", X, "e1", 6)], "free/dc1"),
    "released-by-non-holder-ignored": ([owner_ev("MachineAssignedToEntitlement", X, "e1", 5),
                                        owner_ev("MachineReleasedToFreePool", X, "e2", 6)], "e1"),
    "status-event-carries-the-key": ([status_ev(X, UP, 5, key="e3")], "e3"),
    # A machine's events change partitions with its owner: a restarted health check may read an old owner's
    # events after a newer owner's (the kill storm found its verdicts keyed to the old owner). Newest wins.
    "old-owner-assignment-new-owner-assignment-old-owner-release": (  # read in that order, as in the storm
        [owner_ev("MachineAssignedToEntitlement", X, "e3", 10), owner_ev("MachineAssignedToEntitlement", X, "e0", 30),
         owner_ev("MachineReleasedToFreePool", X, "e3", 20)], "e0"),
    "older-status-event-does-not-move-the-key-back": (
        [owner_ev("MachineAssignedToEntitlement", X, "e0", 30), status_ev(X, UP, 25, key="e3")], "e0"),
    "release-and-assignment-of-one-millisecond-in-either-order": (
        [owner_ev("MachineAssignedToEntitlement", X, "e1", 5), owner_ev("MachineAssignedToEntitlement", X, "e2", 9),
         owner_ev("MachineReleasedToFreePool", X, "e1", 9)], "e2"),
}


@pytest.mark.parametrize("events, key", OWNER_KEYS.values(), ids=OWNER_KEYS.keys())
def test_events_are_keyed_to_the_owner(events, key):
    state = apply_all(watched(), events)
    state, missed = on_tick(state, 100_000, TIMEOUT)
    state, resumed = on_heartbeat(state, hb(X, 1, 100_001))
    assert [e.entitlement for e in missed if X in [m["machine_id"] for m in e.payload["machines"]]] == [key]
    assert [e.entitlement for e in resumed] == [key]


def test_state_marks_and_events():
    state, events = on_tick(watched(), 50_000, TIMEOUT)
    assert state.unhealthy == {X, Y}
    (ev,) = events  # both machines, one owner: one event
    assert (ev.type, ev.entitlement, ev.producer, ev.timestamp_ms, ev.causation_id) == (
        "MachinesStatusChanged", "free/dc1", "health", 50_000, None)
    assert ev.payload["machines"] == [{"machine_id": X, "previous_status": UP}, {"machine_id": Y, "previous_status": UP}]
    state, resumed = on_heartbeat(state, hb(X, 1, 60_000, event_id="hb-1"))
    assert state.unhealthy == {Y}
    assert (resumed[0].causation_id, resumed[0].timestamp_ms) == ("hb-1", 60_000)


def test_decisions_replay_with_the_same_ids():
    _, first = on_tick(watched(), 50_000, TIMEOUT)
    _, later = on_tick(watched(), 70_000, TIMEOUT)  # the same silence, judged at another tick
    assert [e.event_id for e in first] == [e.event_id for e in later]
    assert len(first) == 1
    _, other = on_tick(on_heartbeat(watched(), hb(X, 1, 1_000))[0], 50_000, TIMEOUT)  # another silence, another id
    assert other[0].event_id != first[0].event_id
    state, _ = on_tick(watched(), 50_000, TIMEOUT)
    assert on_heartbeat(state, hb(X, 1, 60_000))[1] == on_heartbeat(state, hb(X, 1, 60_000))[1]


def test_folding_machine_events_twice_changes_nothing():
    events = list(REGISTERED) + [owner_ev("MachineAssignedToEntitlement", X, "e1", 5), status_ev(X, DOWN, 6, "e1"),
                                 status_ev(X, UP, 9, "e1", previous=DOWN),
                                 owner_ev("MachineReleasedToFreePool", X, "e1", 10)]
    state = HealthState()
    for ev in events:
        once = on_machine_event(state, ev)
        assert on_machine_event(once, ev) == once, ev.type
        state = once
    assert apply_all(HealthState(), events + events) == state
    assert state.machines[X] == MachineHealth(X, "free/dc1", status=UP, status_ms=9, last_seen_ms=9, owner_ms=10,
                                              dc="dc1", status_reason="operator")


def test_other_events_are_ignored():
    state = watched()
    other = new_event("HostProfileApplied", {"machine_id": X}, entitlement="e1", entity_id=X, producer="sidekick")
    assert on_machine_event(state, other) is state


@pytest.mark.parametrize("timeout", [0, -5, 1.5, True])
def test_bad_timeout(timeout):
    with pytest.raises(HealthError, match="timeout_ms must be a positive number"):
        on_tick(watched(), 1, timeout)


def test_only_heartbeats_are_heartbeats():
    with pytest.raises(HealthError, match="expected an AgentHeartbeat, got MachineStatusChanged"):
        on_heartbeat(watched(), status_ev(X, UP, 1))


# -- batches: one event per owner per tick, and per poll step of heartbeats ---------------------------------------

def region(n_free, n_owned, owner="e1"):
    """``n_free`` machines in the free pool and ``n_owned`` assigned to ``owner``, watched since t=0."""
    specs = [MachineSpec(f"dc1-msb1-r01-m{i:03d}", "r1", "dc1", "msb1", "r01", "skylake", 32000, 131072)
             for i in range(n_free + n_owned)]
    state = apply_all(HealthState(), register_all(BrokerState(), specs, 0)[1])
    owned = [owner_ev("MachineAssignedToEntitlement", s.id, owner, 1) for s in specs[n_free:]]
    return apply_all(state, owned), [s.id for s in specs]


def test_a_tick_announces_every_silent_machine_of_an_owner_in_one_event():
    state, ids = region(300, 200)
    state, events = on_tick(state, 100_000, TIMEOUT)
    assert [(e.type, e.entitlement, len(e.payload["machines"])) for e in events] == [
        ("MachinesStatusChanged", "e1", 200), ("MachinesStatusChanged", "free/dc1", 300)]
    assert state.unhealthy == set(ids)
    for e in events:
        REG.encode(e.type, e.to_record(1))
        assert e.payload["status"] == UNHEALTHY and e.payload["reason"] == HEARTBEAT_MISSED
    again, events = on_tick(state, 200_000, TIMEOUT)
    assert events == [] and again.machines == state.machines  # once per silence


def test_heartbeats_of_a_step_resume_their_machines_in_one_event_per_owner():
    state, ids = region(3, 2)
    state, _ = on_tick(state, 40_000, TIMEOUT)
    beats = [hb(m, 1, 50_000 + i) for i, m in enumerate(ids)] + [hb(ids[0], 1, 50_000)]  # and one duplicate
    new, events = on_heartbeats(state, beats)
    assert [(e.entitlement, [m["machine_id"] for m in e.payload["machines"]]) for e in events] == [
        ("e1", ids[3:]), ("free/dc1", ids[:3])]
    assert {m["previous_status"] for e in events for m in e.payload["machines"]} == {UNHEALTHY}
    assert all(e.timestamp_ms == 50_004 and e.causation_id == beats[0].event_id for e in events)
    assert new.unhealthy == set()
    assert on_heartbeats(state, beats)[1] == events  # the same heartbeats again: the same ids
    assert on_heartbeats(new, beats)[1] == []  # already up
    # folding the service's own batch (its echo) changes nothing more
    assert apply_all(new, events).machines == new.machines


@pytest.mark.parametrize("ahead_ms,refused", [(-60_000, False), (0, False), (MAX_CLOCK_SKEW_MS, False),
                                              (MAX_CLOCK_SKEW_MS + 1, True), (24 * 3600 * 1000, True)])
def test_a_heartbeat_dated_beyond_the_skew_is_from_the_future(ahead_ms, refused):
    """Issue 27: a heartbeat dated a day ahead blinded the health check to its machine (silence is judged on the
    heartbeat's own time); one dated more than MAX_CLOCK_SKEW_MS ahead is refused (the wiring dead-letters it)."""
    now = 1_800_000_000_000
    assert from_the_future(hb(X, 1, now + ahead_ms), now) is refused
