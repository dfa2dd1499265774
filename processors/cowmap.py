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
_NO_ENTRIES: Mapping[str, Any] = MappingProxyType({})


def _shard_of(key: str) -> int:
    return zlib.crc32(key.encode()) & (_SHARDS - 1)


class CowMap(Mapping[str, V], Generic[V]):
    """An immutable str-keyed map whose ``updated()`` copies only the shards it touches.

    A decision on a region of a million machines changes a few of them; copying a whole dict per decision
    would cost ~20 ms. The keys are spread over 256 shards (CRC-32 of the key, so the layout and the
    iteration order are the same in every process); an update copies the touched shards (~1/256 of the
    entries each) and shares the rest. Iteration order is shard by shard: sort where order matters.
    """

    __slots__ = ("_shards", "_len")

    def __init__(self, items: Mapping[str, V] | Iterable[tuple[str, V]] = ()):
        shards: list[Any] = [_NO_ENTRIES] * _SHARDS
        for key, value in (items.items() if isinstance(items, Mapping) else items):
            i = _shard_of(key)
            if shards[i] is _NO_ENTRIES:
                shards[i] = {}
            shards[i][key] = value
        self._shards: tuple[Mapping[str, V], ...] = tuple(shards)
        self._len = sum(map(len, shards))

    def __getitem__(self, key: str) -> V:
        return self._shards[_shard_of(key)][key]

    @overload
    def get(self, key: str, /) -> V | None: ...

    @overload
    def get(self, key: str, /, default: V | T) -> V | T: ...

    def get(self, key: str, /, default: Any = None) -> Any:
        return self._shards[_shard_of(key)].get(key, default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._shards[_shard_of(key)]

    def __iter__(self) -> Iterator[str]:
        for shard in self._shards:
            yield from shard

    def __len__(self) -> int:
        return self._len

    def values(self):  # faster than Mapping's view for a scan over every entry
        return [v for shard in self._shards for v in shard.values()]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CowMap):
            return self._len == other._len and all(a is b or a == b for a, b in zip(self._shards, other._shards))
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def updated(self, changes: Mapping[str, V]) -> "CowMap[V]":
        """A new map with ``changes`` set (added or replaced); this one is unchanged."""
        if not changes:
            return self
        by_shard: dict[int, list[str]] = {}
        for key in changes:
            by_shard.setdefault(_shard_of(key), []).append(key)
        shards = list(self._shards)
        size = self._len
        for i, keys in by_shard.items():
            shard = dict(shards[i])
            size -= len(shard)
            for key in keys:
                shard[key] = changes[key]
            size += len(shard)
            shards[i] = shard
        new = CowMap.__new__(CowMap)
        new._shards, new._len = tuple(shards), size
        return new

    def without(self, keys: Iterable[str]) -> "CowMap[V]":
        """A new map without ``keys`` (those it holds); this one is unchanged."""
        by_shard: dict[int, list[str]] = {}
        for key in keys:
            if key in self:
                by_shard.setdefault(_shard_of(key), []).append(key)
        if not by_shard:
            return self
        shards = list(self._shards)
        size = self._len
        for i, gone in by_shard.items():
            shard = {k: v for k, v in shards[i].items() if k not in gone}
            size -= len(shards[i]) - len(shard)
            shards[i] = shard if shard else _NO_ENTRIES
        new = CowMap.__new__(CowMap)
        new._shards, new._len = tuple(shards), size
        return new

    def __repr__(self) -> str:
        return f"CowMap({len(self)} entries)"
