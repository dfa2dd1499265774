"""A persistent (copy-on-write) map for the state of pure decision functions over large regions.

Decisions are `(state, input) -> (new_state, events)` with immutable state; at a million machines copying a
dict per decision would dominate. Shared by the Resource Broker and the Health Check Service.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar, overload

V = TypeVar("V")
T = TypeVar("T")
_SHARDS = 256  # a power of two
MACHINE_SHARDS = 65_536  # the shards a map of a region's machines grows to (a million: ~15 machines a shard)
_PER_SHARD = 16  # a map that may grow (``shards`` above _SHARDS) grows once it holds more than this a shard
_NO_ENTRIES: Mapping[str, Any] = MappingProxyType({})


def _shard_of(key: str, mask: int = _SHARDS - 1) -> int:
    return zlib.crc32(key.encode()) & mask


def _layout_for(size: int, most: int) -> int:
    """The shards of a map of ``size`` keys that may have ``most``: _SHARDS, times 16 while it holds more than
    _PER_SHARD keys a shard."""
    n = min(_SHARDS, most)
    while n < most and size > n * _PER_SHARD:
        n *= 16
    return min(n, most)


def _laid_out(pairs: Iterable[tuple[str, Any]], mask: int) -> tuple[tuple, int]:
    layout: list[Any] = [_NO_ENTRIES] * (mask + 1)
    for key, value in pairs:
        i = _shard_of(key, mask)
        if layout[i] is _NO_ENTRIES:
            layout[i] = {}
        layout[i][key] = value
    return tuple(layout), sum(map(len, layout))


class CowMap(Mapping[str, V], Generic[V]):
    """An immutable str-keyed map whose ``updated()`` copies only the shards it touches.

    A decision on a region of a million machines changes a few of them; copying a whole dict per decision
    would cost ~20 ms. The keys are spread over ``shards`` shards (256 by default; CRC-32 of the key, so the
    layout and the iteration order are the same in every process); an update copies the touched shards and
    shares the rest. Iteration order is shard by shard: sort where order matters.

    A map of a region's machines takes updates of thousands of keys at once (a registration, a poll of machine
    events): with 256 shards, an update of more than ~256 keys copied nearly every shard, the whole map
    (registering a million machines in batches copied the map a thousand times: 69 s of the health check's CPU).
    So ``shards`` is the most a map may have: one made with more than 256 starts with 256 and, once it holds more
    than 16 keys a shard, is laid out again over 16 times as many (at most ``shards``; ``MACHINE_SHARDS`` for a
    region's machines: an update then copies the touched shards of ~15 machines each, and the tuple of shards,
    ~0.2 ms). The layout follows from the updates the map was made by: two processes folding the same log agree on
    it.
    """

    __slots__ = ("_shards", "_len", "_mask", "_max")

    def __init__(self, items: Mapping[str, V] | Iterable[tuple[str, V]] = (), *, shards: int = _SHARDS):
        if shards <= 0 or shards & (shards - 1):
            raise ValueError(f"shards must be a power of two, got {shards}")
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        self._max = shards
        self._mask = _layout_for(len(pairs), shards) - 1
        self._shards, self._len = _laid_out(pairs, self._mask)

    def _new(self, shards: tuple, size: int) -> "CowMap[V]":
        new = CowMap.__new__(CowMap)
        new._shards, new._len, new._mask, new._max = shards, size, self._mask, self._max
        if _layout_for(size, self._max) > self._mask + 1:  # grown: laid out over more shards (once per 16x)
            new._mask = _layout_for(size, self._max) - 1
            new._shards, new._len = _laid_out([(k, v) for shard in shards for k, v in shard.items()], new._mask)
        return new

    def __getitem__(self, key: str) -> V:
        return self._shards[_shard_of(key, self._mask)][key]

    @overload
    def get(self, key: str, /) -> V | None: ...

    @overload
    def get(self, key: str, /, default: V | T) -> V | T: ...

    def get(self, key: str, /, default: Any = None) -> Any:
        return self._shards[zlib.crc32(key.encode()) & self._mask].get(key, default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._shards[_shard_of(key, self._mask)]

    def __iter__(self) -> Iterator[str]:
        for shard in self._shards:
            yield from shard

    def __len__(self) -> int:
        return self._len

    def values(self):  # faster than Mapping's view for a scan over every entry
        return [v for shard in self._shards for v in shard.values()]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CowMap) and other._mask == self._mask:
            return self._len == other._len and all(a is b or a == b for a, b in zip(self._shards, other._shards))
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def updated(self, changes: Mapping[str, V]) -> "CowMap[V]":
        """A new map with ``changes`` set (added or replaced); this one is unchanged."""
        if not changes:
            return self
        by_shard: dict[int, dict[str, V]] = {}
        mask, crc32, group = self._mask, zlib.crc32, by_shard.setdefault  # a hot loop (a region's registration)
        for key, value in changes.items():
            group(crc32(key.encode()) & mask, {})[key] = value  # _shard_of, inlined
        shards = list(self._shards)
        size = self._len
        for i, part in by_shard.items():
            shard = dict(shards[i])
            size -= len(shard)
            shard.update(part)
            size += len(shard)
            shards[i] = shard
        return self._new(tuple(shards), size)

    def without(self, keys: Iterable[str]) -> "CowMap[V]":
        """A new map without ``keys`` (those it holds); this one is unchanged."""
        by_shard: dict[int, list[str]] = {}
        for key in keys:
            if key in self:
                by_shard.setdefault(_shard_of(key, self._mask), []).append(key)
        if not by_shard:
            return self
        shards = list(self._shards)
        size = self._len
        for i, gone in by_shard.items():
            shard = {k: v for k, v in shards[i].items() if k not in gone}
            size -= len(shards[i]) - len(shard)
            shards[i] = shard if shard else _NO_ENTRIES
        return self._new(tuple(shards), size)

    def __repr__(self) -> str:
        return f"CowMap({len(self)} entries)"
