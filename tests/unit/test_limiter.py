"""The token bucket (processors/taskcontrol/limiter.py), as tables of cases. Pure: time is passed in."""
import pytest

from processors.taskcontrol.limiter import (
    REASON_RATE_LIMITED_JOB, REASON_RATE_LIMITED_SHARD, UNIT, Bucket, Limits, Rate, admit, available, level, next_ms,
    take,
)

T0 = 1_700_000_000_000
R = Rate(per_minute=60, burst=5)  # one operation a second, five at once

LEVELS = {  # bucket, now → whole operations available
    "never-used-is-full": (None, T0, 5),
    "empty-now": (Bucket(0, T0), T0, 0),
    "one-second-refills-one": (Bucket(0, T0), T0 + 1000, 1),
    "almost-a-second-is-not-one": (Bucket(0, T0), T0 + 999, 0),
    "refill-caps-at-burst": (Bucket(0, T0), T0 + 3_600_000, 5),
    "time-going-back-refills-nothing": (Bucket(2 * UNIT, T0), T0 - 60_000, 2),
    "partial-units-carry": (Bucket(UNIT // 2, T0), T0 + 500, 1),
}


@pytest.mark.parametrize("bucket, now, ops", LEVELS.values(), ids=LEVELS)
def test_available(bucket, now, ops):
    assert available(bucket, R, now) == ops


TAKES = {  # bucket, now, n → units left (None: refused)
    "take-one-of-full": (None, T0, 1, 4 * UNIT),
    "take-all": (None, T0, 5, 0),
    "take-more-than-burst": (None, T0, 6, None),
    "take-from-empty": (Bucket(0, T0), T0, 1, None),
    "take-after-refill": (Bucket(0, T0), T0 + 2000, 2, 0),
}


@pytest.mark.parametrize("bucket, now, n, left", TAKES.values(), ids=TAKES)
def test_take(bucket, now, n, left):
    got = take(bucket, R, now, n)
    assert (got.units if got is not None else None) == left


NEXT = {  # bucket, now → when one operation is available
    "now-if-any": (None, T0, T0),
    "empty-waits-a-second": (Bucket(0, T0), T0, T0 + 1000),
    "half-waits-half": (Bucket(UNIT // 2, T0), T0, T0 + 500),
    "rounds-up": (Bucket(UNIT - 1, T0), T0, T0 + 1),
}


@pytest.mark.parametrize("bucket, now, at", NEXT.values(), ids=NEXT)
def test_next_ms(bucket, now, at):
    assert next_ms(bucket, R, now) == at
    assert available(bucket, R, at) >= 1 and (at == now or available(bucket, R, at - 1) == 0)


def test_a_runaway_never_exceeds_burst_plus_rate():
    """Ten thousand operations asked at once, retried every 100 ms for ten minutes: never more than the burst
    plus what the rate refilled since the start, in any window."""
    b, done, times = None, 0, []
    for step in range(6001):
        now = T0 + step * 100
        while done < 10_000 and (nb := take(b, R, now)) is not None:
            b, done = nb, done + 1
            times.append(now)
    assert done == R.burst + 600  # ten minutes at 60/min
    for i, start in enumerate(times):  # any window [start, start + w]: at most burst + w·rate
        for w_ms in (0, 1000, 10_000, 60_000):
            n = sum(1 for t in times[i:] if t <= start + w_ms)
            assert n <= R.burst + w_ms * R.per_minute // 60_000


ADMIT = {  # job bucket, shard bucket → refusal
    "both-full": (None, None, None),
    "job-empty": (Bucket(0, T0), None, REASON_RATE_LIMITED_JOB),
    "shard-empty": (None, Bucket(0, T0), REASON_RATE_LIMITED_SHARD),
    "both-empty-names-the-job": (Bucket(0, T0), Bucket(0, T0), REASON_RATE_LIMITED_JOB),
}


@pytest.mark.parametrize("job, shard, refusal", ADMIT.values(), ids=ADMIT)
def test_admit_takes_from_both_or_neither(job, shard, refusal):
    limits = Limits(job=R, shard=Rate(600, 50))
    j, s, why = admit(job, shard, limits, T0)
    assert why == refusal
    if refusal is None:
        assert (j.units, s.units) == (level(job, R, T0).units - UNIT, level(shard, limits.shard, T0).units - UNIT)
    else:
        assert (j, s) == (level(job, R, T0), level(shard, limits.shard, T0))


ENVS = {
    "defaults": ({}, Limits()),
    "job-rate": ({"ROPEWALK_LIMIT_JOB_PER_MINUTE": "6", "ROPEWALK_LIMIT_JOB_BURST": "2"},
                 Limits(job=Rate(6, 2), shard=Limits().shard)),
    "shard-burst-only": ({"ROPEWALK_LIMIT_SHARD_BURST": "9"},
                         Limits(job=Limits().job, shard=Rate(Limits().shard.per_minute, 9))),
}


@pytest.mark.parametrize("env, limits", ENVS.values(), ids=ENVS)
def test_limits_from_env(env, limits):
    assert Limits.from_env(env) == limits


@pytest.mark.parametrize("per, burst", [(0, 1), (1, 0), (-5, 3)])
def test_a_rate_must_allow_something(per, burst):
    with pytest.raises(ValueError):
        Rate(per, burst)
