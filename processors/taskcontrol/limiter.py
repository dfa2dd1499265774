"""Token buckets for destructive operations (Twine §4: "rate-limit destructive operations"). Pure.

Every stop, move and restart the scheduler performs takes one token from the job's bucket and one from the
shard's bucket; an operation that finds either empty waits, and the scheduler says so in an
``OperationsThrottled`` event. A bucket holds at most ``burst`` operations and refills at ``per_minute``.

Arithmetic is in integers so that a replay computes exactly the same levels: one operation is ``UNIT``
units and a bucket gains ``per_minute`` units per millisecond (60 000 ms in a minute, so ``per_minute``
operations a minute). Time is the ``now_ms`` the caller passes (the event's or the timer's); a ``now_ms``
older than the bucket's (a reordered timer) refills nothing and never drains. A bucket never seen is full.

    Rate(per_minute=60, burst=10)        Bucket(units, at_ms)      None: full
    take(bucket, rate, now) -> Bucket | None     (None: not enough, nothing taken)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

UNIT = 60_000  # units per operation: a bucket refills ``per_minute`` units per ms

# Why an operation waits (OperationsThrottled.reason).
REASON_RATE_LIMITED_JOB = "rate_limited_job"  # the job's bucket is empty
REASON_RATE_LIMITED_SHARD = "rate_limited_shard"  # the shard's bucket is empty


@dataclass(frozen=True, slots=True)
class Rate:
    per_minute: int
    burst: int

    def __post_init__(self) -> None:
        if self.per_minute < 1 or self.burst < 1:
            raise ValueError(f"a rate needs per_minute >= 1 and burst >= 1, got {self.per_minute}/min "
                             f"burst {self.burst}")

    @property
    def capacity(self) -> int:
        return self.burst * UNIT

    def describe(self) -> str:
        return f"{self.per_minute}/min, burst {self.burst}"


@dataclass(frozen=True, slots=True)
class Bucket:
    units: int
    at_ms: int


def level(bucket: Bucket | None, rate: Rate, now_ms: int) -> Bucket:
    """``bucket`` refilled up to ``now_ms`` (a full bucket at ``now_ms`` if never used)."""
    if bucket is None:
        return Bucket(rate.capacity, now_ms)
    if now_ms <= bucket.at_ms:
        return Bucket(min(bucket.units, rate.capacity), bucket.at_ms)
    return Bucket(min(rate.capacity, bucket.units + (now_ms - bucket.at_ms) * rate.per_minute), now_ms)


def available(bucket: Bucket | None, rate: Rate, now_ms: int) -> int:
    """Whole operations the bucket allows at ``now_ms``."""
    return level(bucket, rate, now_ms).units // UNIT


def take(bucket: Bucket | None, rate: Rate, now_ms: int, n: int = 1) -> Bucket | None:
    """The bucket after ``n`` operations at ``now_ms``, or None if it does not hold ``n`` (nothing taken)."""
    b = level(bucket, rate, now_ms)
    if b.units < n * UNIT:
        return None
    return Bucket(b.units - n * UNIT, b.at_ms)


def next_ms(bucket: Bucket | None, rate: Rate, now_ms: int) -> int:
    """The earliest time one operation is available (``now_ms`` if it is now)."""
    b = level(bucket, rate, now_ms)
    missing = UNIT - b.units
    return max(now_ms, b.at_ms) if missing <= 0 else b.at_ms + -(-missing // rate.per_minute)


@dataclass(frozen=True, slots=True)
class Limits:
    """The configured rates: one bucket per job, one per shard (a partition of the entitlement-keyed topics)."""

    job: Rate = Rate(per_minute=120, burst=50)
    shard: Rate = Rate(per_minute=600, burst=200)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Limits":
        """``ROPEWALK_LIMIT_{JOB,SHARD}_{PER_MINUTE,BURST}``; unset ones keep the defaults."""
        d = cls()

        def rate(scope: str, default: Rate) -> Rate:
            per = env.get(f"ROPEWALK_LIMIT_{scope}_PER_MINUTE")
            burst = env.get(f"ROPEWALK_LIMIT_{scope}_BURST")
            return Rate(int(per) if per else default.per_minute, int(burst) if burst else default.burst)

        return cls(job=rate("JOB", d.job), shard=rate("SHARD", d.shard))


DEFAULT_LIMITS = Limits()


def admit(job: Bucket | None, shard: Bucket | None, limits: Limits, now_ms: int
          ) -> tuple[Bucket, Bucket, str | None]:
    """One operation against both buckets: ``(job, shard, None)`` with a token taken from each, or the
    refilled buckets and the reason it must wait (nothing taken from either)."""
    jl, sl = level(job, limits.job, now_ms), level(shard, limits.shard, now_ms)
    jt, st = take(jl, limits.job, now_ms), take(sl, limits.shard, now_ms)
    if jt is None:
        return jl, sl, REASON_RATE_LIMITED_JOB
    if st is None:
        return jl, sl, REASON_RATE_LIMITED_SHARD
    return jt, st, None


def bucket_record(b: Bucket | None) -> list[int] | None:
    return None if b is None else [b.units, b.at_ms]


def bucket_of(r) -> Bucket | None:
    return None if r is None else Bucket(int(r[0]), int(r[1]))
