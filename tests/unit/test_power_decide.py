"""A fault domain's power lost and back: the Resource Broker's pure ``power_lost`` / ``power_restored`` and the
simulated machines' reading of the power UEs (processors/agent/power.py). Table-driven."""
import pytest

from processors.agent import power as pw
from processors.resourcebroker.decide import (
    DOWN, KIND_POWER, MAINTENANCE, REASON_OPERATOR, REASON_POWER, REASON_POWER_RESTORED, UNHEALTHY, UP, BadTarget,
    apply_all, power_lost, power_restored,
)
from streams.batches import machine_statuses
from streams.events import new_event
from test_resourcebroker import A1, A2, B1, C1, D1, MACHINES, T0, assigned, registered_state, status_changed, valid

DC1 = sorted(m.id for m in MACHINES if m.dc == "dc1")


def statuses(events):
    return sorted((m["machine_id"], m["previous_status"], m["status"], m["reason"]) for e in events
                  for m in machine_statuses(e))


def test_a_dc_loses_its_power_one_status_and_one_power_ue_per_owner():
    state = apply_all(registered_state(), [assigned(A1, "e1"), assigned(A2, "e1")])
    state2, events = power_lost(state, ["dc:dc1"], T0 + 10)
    valid(events)
    assert statuses(events) == [(m, UP, DOWN, REASON_POWER) for m in DC1]
    ues = [e for e in events if e.type == "UnavailabilityStarted"]
    assert sorted((e.entitlement, tuple(e.payload["machine_ids"])) for e in ues) == [
        ("e1", (A1, A2)), ("free/dc1", tuple(m for m in DC1 if m not in (A1, A2)))]
    assert {e.payload["kind"] for e in ues} == {KIND_POWER} and {e.payload["reason"] for e in ues} == {REASON_POWER}
    assert all(state2.get(m).status == DOWN and state2.get(m).status_reason == REASON_POWER for m in DC1)
    assert state2.get(D1).status == UP  # the other DC keeps its power
    assert apply_all(state, events) == state2  # deciding and replaying agree
    assert power_lost(state2, ["dc:dc1"], T0 + 20) == (state2, [])  # announced twice: nothing more


@pytest.mark.parametrize("before, after", [
    (UP, DOWN), (UNHEALTHY, DOWN), (MAINTENANCE, DOWN),  # power gone during maintenance: down like the rest
    (DOWN, DOWN),  # down already (a failure): left out, keeps its own UE
])
def test_power_loss_of_each_status(before, after):
    state = registered_state(statuses={A1: before} if before != UP else None)
    _, events = power_lost(state, ["rack:dc1/msb1/r01"], T0 + 10)
    got = {m: s for m, _, s, _ in statuses(events)}
    assert got.get(A1, before) == after and got.get(A2) == DOWN
    assert (A1 in got) == (before != DOWN)


def test_power_back_brings_up_only_the_machines_down_for_the_power_loss():
    state = apply_all(registered_state(), [status_changed(B1, DOWN, "free/dc1", t=T0 + 5, reason=REASON_OPERATOR)])
    state, lost = power_lost(state, ["msb:dc1/msb1"], T0 + 10)
    state2, events = power_restored(state, ["msb:dc1/msb1"], T0 + 20)
    valid(events)
    msb1 = [m for m in DC1 if "-msb1-" in m]
    assert statuses(events) == [(m, DOWN, UP, REASON_POWER_RESTORED) for m in msb1 if m != B1]
    assert state2.get(B1).status == DOWN and state2.get(B1).status_reason == REASON_OPERATOR  # still failed
    started = {e.payload["unavailability_id"] for e in lost if e.type == "UnavailabilityStarted"}
    ended = [e for e in events if e.type == "UnavailabilityEnded"]
    assert {e.payload["unavailability_id"] for e in ended} == started  # the POWER UEs end
    assert sorted(m for e in ended for m in e.payload["machine_ids"]) == [m for m in msb1 if m != B1]
    assert power_restored(state2, ["msb:dc1/msb1"], T0 + 30) == (state2, [])  # twice: nothing more
    assert power_restored(registered_state(), ["dc:dc2"], T0) == (registered_state(), [])  # never lost: nothing


@pytest.mark.parametrize("target", ["dc:dc9", "msb:dc1/msb9", "rack:dc1", "nope:x"])
def test_a_target_with_no_machine_is_refused(target):
    with pytest.raises(BadTarget):
        power_lost(registered_state(), [target], T0)
    with pytest.raises(BadTarget):
        power_restored(registered_state(), [target], T0)


# -- the simulated machines' physics (processors/agent/power.py) ------------------------------------------------

MINE = {A1, A2, C1}.__contains__


def ue(type_, ue_id, machines, kind="POWER"):
    payload = {"unavailability_id": ue_id, "machine_ids": list(machines)}
    if type_ == "UnavailabilityStarted":
        payload.update(kind=kind, start_ms=T0, deadline_ms=None, expected_duration_ms=None, reason="power")
    return new_event(type_, payload, entitlement="free/dc1", entity_id=ue_id, producer="resourcebroker",
                     timestamp_ms=T0)


# name: [(event, machines off after it, change (off, on))]
POWER_TIMELINES = {
    "off-then-on": [
        (ue("UnavailabilityStarted", "p1", [A1, A2, D1]), {A1: "p1", A2: "p1"}, ((A1, A2), ())),  # D1: not mine
        (ue("UnavailabilityStarted", "p1", [A1, A2, D1]), {A1: "p1", A2: "p1"}, ((), ())),  # read twice
        (ue("UnavailabilityEnded", "p1", [A1, A2, D1]), {}, ((), (A1, A2))),
        (ue("UnavailabilityEnded", "p1", [A1, A2]), {}, ((), ())),  # twice
    ],
    "other-kinds-change-nothing": [
        (ue("UnavailabilityStarted", "f1", [A1], kind="FAILURE"), {}, ((), ())),
        (ue("UnavailabilityStarted", "m1", [A1], kind="MAINTENANCE"), {}, ((), ())),
        (ue("UnavailabilityEnded", "f1", [A1]), {}, ((), ())),
    ],
    "another-ue-does-not-end-it": [
        (ue("UnavailabilityStarted", "p1", [A1]), {A1: "p1"}, ((A1,), ())),
        (ue("UnavailabilityStarted", "p2", [A1, C1]), {A1: "p1", C1: "p2"}, ((C1,), ())),  # A1 dark already
        (ue("UnavailabilityEnded", "p2", [A1, C1]), {A1: "p1"}, ((), (C1,))),  # A1 stays dark: its UE goes on
        (ue("UnavailabilityEnded", "p1", [A1]), {}, ((), (A1,))),
    ],
}


@pytest.mark.parametrize("name", sorted(POWER_TIMELINES))
def test_power_timeline(name):
    state = pw.PowerState()
    for event, off, (went_off, came_on) in POWER_TIMELINES[name]:
        state, change = pw.on_unavailability(state, event, MINE)
        assert (dict(state.off), change.off, change.on) == (off, went_off, came_on), event.payload


def test_power_state_round_trips_through_the_state_file():
    state, _ = pw.on_unavailability(pw.PowerState(), ue("UnavailabilityStarted", "p1", [A1, C1]), MINE)
    assert pw.from_json(pw.to_json(state), MINE) == state
    assert dict(pw.from_json(pw.to_json(state), {A1}.__contains__).off) == {A1: "p1"}  # machines it no longer runs
    assert pw.from_json(None, MINE) == pw.PowerState()


def test_a_fold_that_reads_the_power_back_before_the_power_loss_keeps_the_newest():
    """The machines' owner changed meanwhile (their entitlement released them): the loss is keyed to the old owner,
    the return to the free pool, on another partition; a fold that reads that partition first must still end UP
    (before, a MachinesStatusChanged applied whatever its time, and `power-restore` found them down again)."""
    state = apply_all(registered_state(), [assigned(A1, "e1")])
    lost_state, lost = power_lost(state, ["rack:dc1/msb1/r01"], T0 + 10)
    released = new_event("MachineReleasedToFreePool", {"machine_id": A1, "dc": "dc1", "reason": "entitlement_empty"},
                         entitlement="e1", entity_id=A1, producer="allocator", timestamp_ms=T0 + 15)
    lost_state = apply_all(lost_state, [released])
    _, back = power_restored(lost_state, ["rack:dc1/msb1/r01"], T0 + 20)
    assert {e.entitlement for e in back if e.type == "MachinesStatusChanged"} == {"free/dc1"}
    for order in ([*lost, released, *back], [*back, released, *lost], [released, *back, *lost]):
        folded = apply_all(state, order)
        assert folded.get(A1).status == UP and folded.get(A2).status == UP, [e.type for e in order]
