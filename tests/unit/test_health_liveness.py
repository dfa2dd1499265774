"""The health check's liveness (processors/health/liveness.py): chunked vectors, and the silence index checked against
a scan of every machine on seeded random histories (heartbeats out of order, machines going away and back, ticks
going forward and, once in a while, back)."""
import random

import pytest

from processors.health import decide as hd
from processors.health.liveness import BUCKET_MS, CHUNK, Liveness, Names, Vec
from processors.resourcebroker.decide import DOWN, MAINTENANCE, UNHEALTHY, UP, BrokerState, register_all
from processors.resourcebroker.region import MachineSpec
from streams.events import new_event


def test_vec_copies_only_the_chunks_it_changes():
    v = Vec().extended(range(3 * CHUNK + 5))
    assert (len(v), v[0], v[CHUNK], v[3 * CHUNK + 4]) == (3 * CHUNK + 5, 0, CHUNK, 3 * CHUNK + 4)
    w = v.set_many({1: -1, CHUNK + 2: -2})
    assert (w[1], w[CHUNK + 2], v[1], v[CHUNK + 2]) == (-1, -2, 1, CHUNK + 2)  # the original is unchanged
    assert [a is b for a, b in zip(v.chunks, w.chunks)] == [False, False, True, True]
    assert list(w.extended([7, 8]))[-3:] == [3 * CHUNK + 4, 7, 8] and v.set_many({}) is v


def test_names_append_in_chunks():
    n = Names().extended(f"m{i}" for i in range(CHUNK - 1))
    m = n.extended(["a", "b", "c"])
    assert (len(n), len(m), m[CHUNK - 1], m[CHUNK + 1], list(m)[-1]) == (CHUNK - 1, CHUNK + 2, "a", "c", "c")
    assert len(n.chunks[-1]) == CHUNK - 1  # the original's last chunk was copied, not grown


# (what was heard: machine -> last heard ms, cut, silent machines)
SWEEPS = {
    "heard-before-the-cut": ({"a": 1_000, "b": 5_000}, 2_000, {"a"}),
    "exactly-at-the-cut-is-not-silent": ({"a": 2_000}, 2_000, set()),
    "one-ms-before-the-cut-in-the-same-bucket": ({"a": 2_998}, 2_999, {"a"}),
    "nobody-yet": ({"a": 10_000}, 500, set()),
}


@pytest.mark.parametrize("seen, cut, silent", SWEEPS.values(), ids=SWEEPS.keys())
def test_sweep(seen, cut, silent):
    live = Liveness().watched(seen).sweep(cut)
    assert set(live.silent_ids()) == silent
    assert live.sweep(cut).silent == live.silent  # a second sweep at the same cut changes nothing


def test_a_silent_machine_heard_again_is_silent_no_more_and_filed_again():
    live = Liveness().watched({"a": 0, "b": 0}).sweep(5 * BUCKET_MS)
    assert set(live.silent_ids()) == {"a", "b"}
    live = live.heard({live.slot("a"): 9 * BUCKET_MS}, {live.slot("a"): 1})
    live = live.sweep(6 * BUCKET_MS)
    assert live.silent_ids() == ["b"]
    assert set(live.sweep(10 * BUCKET_MS).silent_ids()) == {"a", "b"}  # and silent again a timeout later
    assert live.sweep(0).silent == frozenset()  # a cut that went back: nobody is silent before it
    assert set(live.sweep(0).sweep(10 * BUCKET_MS).silent_ids()) == {"a", "b"}  # and they are found again


def _brute(state: hd.HealthState, now: int, timeout: int) -> set[str]:
    """The silent UP machines by a scan of every machine (what ``on_tick`` did before the index)."""
    return {mid for mid, h in state.machines.items()
            if h.status == UP and now - state.silent_since_ms(mid) > timeout}


@pytest.mark.parametrize("seed", range(12))
def test_the_index_finds_what_a_scan_of_every_machine_finds(seed):
    rng = random.Random(seed)
    ids = [f"dc{1 + i % 2}-msb1-r01-m{i:03d}" for i in range(40)]
    specs = [MachineSpec(m, "r1", m.split("-")[0], "msb1", "r01", "skylake", 32000, 131072) for m in ids]
    state = hd.apply_all(hd.HealthState(), register_all(BrokerState(), specs, 0)[1])
    timeout = rng.choice([1_500, 4_000, 9_000])
    now, seq = 0, 0
    for step in range(300):
        now += rng.randint(0, 900)
        roll = rng.random()
        if roll < 0.55:
            seq += 1
            beats = [hd.Beat(m, now - rng.randint(0, 3_000), seq if rng.random() < 0.9 else seq - 5, f"hb{step}-{k}")
                     for k, m in enumerate(rng.sample(ids, rng.randint(1, 12)))]
            state, _ = hd.on_beats(state, beats)
        elif roll < 0.65:
            m = rng.choice(ids)
            status = rng.choice([UP, DOWN, MAINTENANCE, UNHEALTHY])
            ev = new_event("MachineStatusChanged", {"machine_id": m, "status": status, "previous_status": UP,
                                                    "reason": "operator"}, entitlement=f"free/{m[:3]}", entity_id=m,
                           producer="resourcebroker", timestamp_ms=now)
            state = hd.on_machine_event(state, ev)
        elif roll < 0.7:
            state = hd.restart_clocks(state, now - rng.randint(0, 2_000), hd.CLOCKS_STARTED)
        else:
            at = now - (rng.randint(0, 5_000) if rng.random() < 0.1 else 0)  # now and then a tick from the past
            want = _brute(state, at, timeout)
            state, got = hd._silent(state, at, timeout)
            assert {h.machine_id for h in got} == want, (seed, step)
