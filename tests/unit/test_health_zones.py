"""Table-driven tests of the health check's protection against mass failure (processors/health/zones.py and
``on_tick`` with a policy): zone states, rates, the buckets, region-wide disruption and the silence clocks."""
import math

import pytest

from processors.health import decide as hd
from processors.health import zones as z
from processors.health.decide import HealthState, apply_all, on_heartbeats, on_machine_event, on_tick, restart_clocks
from processors.health.zones import DisruptionPolicy, PolicyError, Zone
from processors.resourcebroker.decide import DOWN, REASON_HEALTH_CHECK, UNHEALTHY, UP, BrokerState, register_all
from processors.resourcebroker.region import MachineSpec
from streams.batches import machine_statuses
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
TIMEOUT = 10_000
POLICY = DisruptionPolicy(unhealthy_zone_threshold=0.55, full_rate_per_s=2.0, partial_rate_per_s=1.0,
                          large_zone_size=5, burst=1)
FULL, PARTIAL, NORMAL = z.ZONE_FULL, z.ZONE_PARTIAL, z.ZONE_NORMAL


# -- the zone's state and rate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("machines, silent, state", [
    (0, 0, NORMAL),  # an empty zone
    (10, 0, NORMAL),
    (10, 2, NORMAL),  # fewer than min_silent
    (4, 2, NORMAL),  # half, but only 2 (Kubernetes: more than 2 not ready)
    (10, 5, NORMAL),  # 50% < 55%
    (10, 6, PARTIAL),  # 60%
    (100, 55, PARTIAL),  # exactly the threshold
    (3, 3, FULL),  # nobody heard
    (1, 1, FULL),  # a zone of one, silent
    (2, 2, FULL),
])
def test_zone_state(machines, silent, state):
    assert z.zone_state(machines, silent, POLICY) == state


@pytest.mark.parametrize("state, size, rate", [
    (NORMAL, 1000, None),  # no limit: every silent machine at once
    (FULL, 1, 2.0),
    (FULL, 1000, 2.0),
    (PARTIAL, 6, 1.0),  # more than large_zone_size
    (PARTIAL, 5, 0.0),  # a small zone partly silent: nobody failed
])
def test_rate_of_each_state(state, size, rate):
    assert POLICY.rate(state, size) == rate


@pytest.mark.parametrize("field, value", [
    ("unhealthy_zone_threshold", 0.0), ("unhealthy_zone_threshold", 1.5), ("full_rate_per_s", -1),
    ("partial_rate_per_s", math.nan), ("large_zone_size", -1), ("burst", 1.5), ("min_silent", 0),
    ("full_rate_per_s", True),
])
def test_bad_policy_is_refused_naming_the_field(field, value):
    with pytest.raises(PolicyError, match=field):
        DisruptionPolicy(**{field: value})


@pytest.mark.parametrize("zone, state, rate, now, allowed, tokens", [
    (None, FULL, 2.0, 1_000, 1, 1.0),  # a new state: a new bucket of `burst`
    (Zone(FULL, tokens=0.0, tokens_ms=1_000), FULL, 2.0, 2_000, 2, 2.0),  # filled at the rate since
    (Zone(FULL, tokens=0.5, tokens_ms=1_000), FULL, 2.0, 1_500, 1, 1.5),
    (Zone(FULL, tokens=0.0, tokens_ms=1_000), PARTIAL, 1.0, 60_000, 1, 1.0),  # state changed: new bucket
    (Zone(PARTIAL, tokens=1.0, tokens_ms=0), PARTIAL, 0.0, 60_000, 0, 0.0),  # stopped: nothing, ever
    (Zone(FULL, tokens=0.0, tokens_ms=0), NORMAL, None, 5_000, None, 1.0),  # no limit
])
def test_allowance(zone, state, rate, now, allowed, tokens):
    got, n = z.allowance(zone, state, rate, now, POLICY)
    assert (n, got.state, got.tokens_ms) == (allowed, state, now) and got.tokens == pytest.approx(tokens)


def test_spend_keeps_at_most_burst():
    assert z.spend(Zone(FULL, tokens=7.5), 2, POLICY).tokens == 1.0
    assert z.spend(Zone(FULL, tokens=2.5), 2, POLICY).tokens == 0.5
    assert z.spend(Zone(FULL, tokens=1.0), 5, POLICY).tokens == 0.0


# -- on_tick with a policy: timelines on a region of two DCs ---------------------------------------------------

def specs(dc, n):
    return [MachineSpec(f"{dc}-msb1-r01-m{i:03d}", "r1", dc, "msb1", "r01", "skylake", 32000, 131072)
            for i in range(n)]


def region(**sizes):
    """A watched region, registered at t=0, every machine heard at t=1000 (sequence 1)."""
    ms = [m for dc, n in sizes.items() for m in specs(dc, n)]
    state = apply_all(HealthState(), register_all(BrokerState(), ms, 0)[1])
    state, _ = on_heartbeats(state, [hb(m.id, 1, 1_000) for m in ms])
    return state, {dc: [m.id for m in specs(dc, n)] for dc, n in sizes.items()}


def hb(machine_id, seq, ts):
    return new_event("AgentHeartbeat", {"machine_id": machine_id, "running_task_ids": [], "sequence": seq},
                     entitlement="", entity_id=machine_id, producer="agent", timestamp_ms=ts,
                     event_id=f"hb-{machine_id}-{seq}-{ts}")


def beat(state, ids, ts, seq=None):
    state, events = on_heartbeats(state, [hb(m, seq or ts, ts) for m in ids])
    return state


def tick(state, now, policy=POLICY):
    state, events = on_tick(state, now, TIMEOUT, policy=policy)
    for ev in events:
        REG.encode(ev.type, ev.to_record(schema_version=1))  # every event the tick emits fits its schema
    judged = sorted(m["machine_id"] for e in events for m in machine_statuses(e) if m["status"] == UNHEALTHY)
    zones = [(e.payload["dc"], e.payload["previous_state"], e.payload["state"], e.payload["region_disrupted"],
              e.payload["reason"]) for e in events if e.type == hd.ZONE_DISRUPTION_CHANGED]
    return state, judged, zones


def test_a_few_silent_machines_of_a_normal_zone_are_failed_at_once():
    state, ids = region(dc1=10, dc2=10)
    state = beat(state, ids["dc1"][2:] + ids["dc2"], 9_000)
    state, judged, zones = tick(state, 11_001)
    assert judged == ids["dc1"][:2] and zones == []
    assert state.zones["dc1"] == Zone(NORMAL, tokens=1.0, tokens_ms=11_001, machines=10, silent=2, held=0)


def test_a_dc_gone_silent_while_the_other_is_heard_is_failed_at_the_full_rate_and_announced():
    state, ids = region(dc1=10, dc2=10)
    judged_all = []
    state, judged, zones = tick(state, 5_000)  # everyone heard
    assert (judged, zones) == ([], [])
    for now in range(6_000, 60_000, 1_000):  # dc2 beats every second, dc1 never again
        state = beat(state, ids["dc2"], now)
        state, judged, zones = tick(state, now)
        if now == 12_000:  # first tick past the timeout: a new bucket of one token
            assert zones == [("dc1", NORMAL, FULL, False, hd.ZONE_STATE_CHANGED)]
            assert judged == [ids["dc1"][0]] and state.zones["dc1"].held == 9
        else:
            assert zones == []
        judged_all += judged
        assert len(judged_all) <= 1 + 2 * max(0, now - 12_000) // 1000  # burst + rate · elapsed
    assert sorted(judged_all) == ids["dc1"]  # then all of them, two a second
    assert state.zones["dc1"].state == FULL and state.zones["dc1"].held == 0
    assert state.zones["dc1"].silent == 10  # the ones it failed still count as silent: the zone stays disrupted


def test_the_ones_failed_first_are_the_longest_silent():
    state, ids = region(dc1=4, dc2=4)
    state = beat(state, ids["dc1"][2:], 3_000)  # dc1 m000, m001 last heard at 1000; m002, m003 at 3000
    state = beat(state, ids["dc1"][:1], 2_000)  # m000 at 2000
    state = beat(state, ids["dc2"], 13_500)
    state, judged, _ = tick(state, 13_500)  # all four of dc1 silent: FULL, one token
    assert judged == [ids["dc1"][1]]  # heard last at 1000
    state = beat(state, ids["dc2"], 14_000)
    state, judged, _ = tick(state, 14_000)  # one more token (2/s · 0.5 s)
    assert judged == [ids["dc1"][0]]  # heard last at 2000


def test_a_large_zone_partly_silent_is_failed_at_the_secondary_rate():
    state, ids = region(dc1=10, dc2=10)
    heard = ids["dc1"][6:] + ids["dc2"]
    judged_all = []
    for now in range(2_000, 40_000, 1_000):
        state = beat(state, heard, now)
        state, judged, zones = tick(state, now)
        if now == 12_000:
            assert zones == [("dc1", NORMAL, PARTIAL, False, hd.ZONE_STATE_CHANGED)]
        judged_all += judged
    assert sorted(judged_all) == ids["dc1"][:6]  # 1 now, then one a second: all six after ~6 s
    state, _, zones = tick(state, 40_000)
    assert state.zones["dc1"].state == PARTIAL and state.zones["dc1"].silent == 6


def test_a_small_zone_partly_silent_fails_nobody():
    state, ids = region(dc1=5, dc2=5)
    heard = ids["dc1"][3:] + ids["dc2"]
    for now in range(2_000, 40_000, 1_000):
        state = beat(state, heard, now)
        state, judged, zones = tick(state, now)
        assert judged == []
        if now == 12_000:
            assert zones == [("dc1", NORMAL, PARTIAL, False, hd.ZONE_STATE_CHANGED)]
    assert state.zones["dc1"].held == 3 and state.zones["dc1"].state == PARTIAL


def test_the_whole_region_silent_fails_nobody_and_is_announced_once_then_clocks_restart():
    """A control-plane outage: every agent is silent to the health check. Nobody is failed; when it hears someone
    again every silence counts anew, so the agents that come back a little later are not failed either."""
    state, ids = region(dc1=10, dc2=10, local=1)
    seen = []
    for now in range(12_000, 60_000, 1_000):
        state, judged, zones = tick(state, now)
        assert judged == []
        seen += zones
    assert sorted(seen) == [(dc, NORMAL, FULL, True, hd.REGION_DISRUPTION) for dc in ("dc1", "dc2", "local")]
    assert state.region_disrupted
    state = beat(state, ids["local"], 60_500)  # the control plane's own machine speaks first
    state, judged, zones = tick(state, 61_000)
    assert judged == [] and not state.region_disrupted
    assert state.clocks_from_ms == 61_000 and state.clocks_reason == hd.CLOCKS_REGION_DISRUPTION_ENDED
    assert sorted(zones) == [("dc1", FULL, NORMAL, False, hd.REGION_DISRUPTION_ENDED),
                             ("dc2", FULL, NORMAL, False, hd.REGION_DISRUPTION_ENDED),
                             ("local", FULL, NORMAL, False, hd.REGION_DISRUPTION_ENDED)]
    for now in range(62_000, 71_001, 1_000):  # the others come back within one timeout of that: nobody failed
        if now == 66_000:
            state = beat(state, ids["dc1"] + ids["dc2"], now)
        state = beat(state, ids["local"], now)
        state, judged, zones = tick(state, now)
        assert (judged, zones) == ([], [])


def test_a_machine_still_silent_a_timeout_after_the_region_is_heard_again_is_judged_by_the_zone_rules():
    state, ids = region(dc1=10, dc2=10)
    state, _, _ = tick(state, 12_000)
    assert state.region_disrupted
    state = beat(state, ids["dc1"] + ids["dc2"][1:], 20_000)
    state, judged, _ = tick(state, 20_000)
    assert judged == [] and state.clocks_from_ms == 20_000
    state = beat(state, ids["dc1"] + ids["dc2"][1:], 29_000)
    state, judged, _ = tick(state, 30_000)
    assert judged == [] and state.zones["dc2"].state == NORMAL  # exactly the timeout: not yet
    state, judged, zones = tick(state, 30_001)
    assert judged == [ids["dc2"][0]] and zones == []  # one of ten: a normal zone, at once


def test_a_tick_long_after_the_last_one_restarts_the_clocks_instead_of_judging():
    """The service was paused (SIGSTOP) or its loop held: it did not read what was said meanwhile."""
    state, ids = region(dc1=10, dc2=10)
    state, _, _ = tick(state, 2_000)
    state, judged, zones = tick(state, 2_000 + TIMEOUT + 1)
    assert (judged, zones) == ([], []) and state.clocks_from_ms == 2_000 + TIMEOUT + 1
    assert state.clocks_reason == hd.CLOCKS_TICK_GAP
    state, judged, _ = tick(state, 2_000 + 2 * TIMEOUT)
    assert judged == []
    state = beat(state, ids["dc1"][1:] + ids["dc2"], 2_000 + 2 * TIMEOUT)
    state, judged, _ = tick(state, 2_000 + 2 * TIMEOUT + 2)
    assert judged == [ids["dc1"][0]]  # a timeout after the restart, the one still silent


def test_restart_clocks_counts_every_silence_from_then():
    state, ids = region(dc1=3)
    state = restart_clocks(state, 50_000, hd.CLOCKS_STARTED)
    assert restart_clocks(state, 40_000, hd.CLOCKS_READING_BEHIND).clocks_from_ms == 50_000  # never backwards
    state, judged, _ = tick(state, 60_000)
    assert judged == []
    state = beat(state, ids["dc1"][1:], 59_000)
    state, judged, _ = tick(state, 60_001)
    assert judged == [ids["dc1"][0]]
    bare, events = on_tick(restart_clocks(region(dc1=3)[0], 50_000, hd.CLOCKS_STARTED), 60_000, TIMEOUT)
    assert events == []  # without a policy too


def status(machine_id, status_, ts, reason, key="free/dc1"):
    return new_event("MachineStatusChanged", {"machine_id": machine_id, "status": status_, "previous_status": UP,
                                              "reason": reason}, entitlement=key, entity_id=machine_id,
                     producer="resourcebroker", timestamp_ms=ts)


def test_machines_down_for_a_power_loss_are_not_silent_ones():
    """A DC whose power loss was announced (DOWN, reason power) is not a disrupted zone: its machines are known to
    be away; the other DC's failures are judged as usual."""
    state, ids = region(dc1=10, dc2=10)
    for m in ids["dc1"]:
        state = on_machine_event(state, status(m, DOWN, 2_000, "power"))
    state = beat(state, ids["dc2"][1:], 11_000)
    state, judged, zones = tick(state, 11_001)
    assert judged == [ids["dc2"][0]] and zones == [] and "dc1" not in state.zones


def test_machines_the_health_check_failed_still_count_as_silent():
    """Without this a disrupted zone would turn normal as its machines are failed (they leave UP) and the rest
    would go all at once."""
    state, ids = region(dc1=10, dc2=10)
    for m in ids["dc1"][:5]:
        state = on_machine_event(state, status(m, DOWN, 2_000, REASON_HEALTH_CHECK))
    state = beat(state, ids["dc1"][7:] + ids["dc2"], 11_000)
    state, judged, zones = tick(state, 11_001)  # 5 failed + 2 silent of 10: 70%, partial
    assert zones == [("dc1", NORMAL, PARTIAL, False, hd.ZONE_STATE_CHANGED)] and judged == [ids["dc1"][5]]


def test_a_zone_whose_machines_all_leave_is_announced_normal_again():
    state, ids = region(dc1=3, dc2=3)
    state = beat(state, ids["dc2"], 11_000)
    state, judged, zones = tick(state, 11_001)
    assert zones == [("dc1", NORMAL, FULL, False, hd.ZONE_STATE_CHANGED)]
    for m in ids["dc1"]:  # then announced powered off: known to be away
        state = on_machine_event(state, status(m, DOWN, 11_500, "power"))
    state = beat(state, ids["dc2"], 12_000)
    state, judged, zones = tick(state, 12_000)
    assert zones == [("dc1", FULL, NORMAL, False, hd.ZONE_STATE_CHANGED)] and "dc1" not in state.zones
