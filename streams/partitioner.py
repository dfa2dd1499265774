"""Kafka's default key partitioner, in pure Python: which partition a keyed record lands on.

Our producers use librdkafka's `murmur2_random` partitioner, which is the Java client's default (and
aiokafka's/faust's): `(murmur2(key) & 0x7fffffff) % partitions`, random for a null key. Knowing it lets a
reader go straight to the one partition that holds an entitlement's events on every co-partitioned topic
(`ropewalk replay --entitlement E` reads 1/N of the log instead of all of it).

`murmur2` is a line-by-line port of `org.apache.kafka.common.utils.Utils.murmur2`: 32-bit signed Java
arithmetic emulated with masks, `>>>` (unsigned shift) done on the masked value.
"""
from __future__ import annotations

_MASK32 = 0xFFFFFFFF
_SEED = 0x9747B28C
_M = 0x5BD1E995
_R = 24


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash of `data`, as the signed 32-bit int Java returns."""
    length = len(data)
    h = (_SEED ^ length) & _MASK32
    n4 = length & ~3
    for i in range(0, n4, 4):
        k = data[i] | (data[i + 1] << 8) | (data[i + 2] << 16) | (data[i + 3] << 24)  # little-endian
        k = (k * _M) & _MASK32
        k ^= k >> _R
        k = (k * _M) & _MASK32
        h = (h * _M) & _MASK32
        h ^= k
    rest = length & 3  # the Java switch falls through: 3 -> 2 -> 1
    if rest == 3:
        h ^= data[n4 + 2] << 16
    if rest >= 2:
        h ^= data[n4 + 1] << 8
    if rest >= 1:
        h ^= data[n4]
        h = (h * _M) & _MASK32
    h ^= h >> 13
    h = (h * _M) & _MASK32
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes | str, partitions: int) -> int:
    """The partition a record with this (non-null) key lands on among `partitions`."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    if isinstance(key, str):
        key = key.encode("utf-8")
    return (murmur2(key) & 0x7FFFFFFF) % partitions


__all__ = ["murmur2", "partition_for"]
