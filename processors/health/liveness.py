"""When each machine was last heard, and which have been silent: the part of the health check's state that every
heartbeat changes, kept so that a heartbeat costs a few microseconds and a tick what changed since the last one —
not a copy or a scan of a million machines (issue 28: at 1,000,000 machines the state was copied ~1/256 per
heartbeat poll and scanned whole every tick). Pure and persistent (immutable; every change returns a new
``Liveness`` sharing what did not change), like the rest of ``HealthState``.

* **Slots.** A machine gets a slot when it is first watched (``watch``); its last heartbeat's time and sequence
  (``seen``, ``seq``) live in chunked integer arrays (``Vec``): a poll's heartbeats copy the few touched chunks of
  256 slots (memcpy), not dicts.
* **The silence index.** Each slot is *filed* once in the bucket of the time it was last heard
  (``seen // BUCKET_MS``). A tick asks ``sweep(cut)`` for the slots not heard since ``cut`` (now minus the timeout):
  the buckets wholly before ``cut`` are taken out — a slot heard since is filed again in its new bucket, one that was
  not is *silent* — and the bucket ``cut`` falls in is read without taking it out. A slot heard again while silent is
  filed again at once. So a slot moves about once per timeout, a tick reads what went silent since the last one, and
  ``silent`` holds the slots silent at the last sweep (whatever their status: the caller judges only UP machines).
"""
from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

from processors.cowmap import MACHINE_SHARDS, CowMap

BUCKET_MS = 1_000  # width of a bucket of the silence index
CHUNK = 256  # slots per chunk of a Vec (a power of two): a poll's heartbeats copy ~2 KB per slot touched
_SHIFT = CHUNK.bit_length() - 1
_MASK = CHUNK - 1
_NO_BUCKETS: Mapping[int, tuple[int, ...]] = MappingProxyType({})


class Vec:
    """An immutable vector of 64-bit integers in chunks: ``set_many`` copies only the chunks it touches."""

    __slots__ = ("chunks", "size")

    def __init__(self, chunks: tuple[array, ...] = (), size: int = 0):
        self.chunks = chunks
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        return self.chunks[i >> _SHIFT][i & _MASK]

    def __iter__(self) -> Iterator[int]:
        n = self.size
        for c in self.chunks:
            yield from c[:n]
            n -= len(c)

    def extended(self, values: Iterable[int]) -> "Vec":
        """This vector with ``values`` appended."""
        vals = array("q", values)
        if not vals:
            return self
        chunks = list(self.chunks)
        last = array("q", chunks.pop()) if chunks and len(chunks[-1]) < CHUNK else array("q")
        i = 0
        while i < len(vals):
            room = CHUNK - len(last)
            last.extend(vals[i:i + room])
            i += room
            if len(last) == CHUNK:
                chunks.append(last)
                last = array("q")
        if last:
            chunks.append(last)
        return Vec(tuple(chunks), self.size + len(vals))

    def set_many(self, changes: Mapping[int, int]) -> "Vec":
        """This vector with ``changes`` (index -> value) set."""
        if not changes:
            return self
        chunks = list(self.chunks)
        copied: set[int] = set()
        for i, v in changes.items():
            c = i >> _SHIFT
            if c not in copied:
                chunks[c] = array("q", chunks[c])
                copied.add(c)
            chunks[c][i & _MASK] = v
        return Vec(tuple(chunks), self.size)


class Names:
    """An immutable, append-only sequence of strings in chunks of ``CHUNK``: appending copies the last chunk only."""

    __slots__ = ("chunks", "size")

    def __init__(self, chunks: tuple[tuple[str, ...], ...] = (), size: int = 0):
        self.chunks = chunks
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> str:
        return self.chunks[i >> _SHIFT][i & _MASK]

    def __iter__(self) -> Iterator[str]:
        for c in self.chunks:
            yield from c

    def extended(self, values: Iterable[str]) -> "Names":
        vals = tuple(values)
        if not vals:
            return self
        chunks = list(self.chunks)
        last = chunks.pop() if chunks and len(chunks[-1]) < CHUNK else ()
        rest = last + vals
        for i in range(0, len(rest), CHUNK):
            chunks.append(rest[i:i + CHUNK])
        return Names(tuple(chunks), self.size + len(vals))


class Liveness:
    """machine -> (last heard, last sequence), and the silence index (module docstring). Immutable."""

    __slots__ = ("slots", "ids", "seen", "seq", "filed", "buckets", "silent")

    def __init__(self) -> None:
        self.slots: CowMap[int] = CowMap(shards=MACHINE_SHARDS)  # machine id -> slot
        self.ids = Names()  # slot -> machine id
        self.seen = Vec()  # slot -> last heartbeat time (or since when watched, or back UP), ms
        self.seq = Vec()  # slot -> last counted sequence (-1: none yet)
        self.filed = Vec()  # slot -> 1 while the slot is in a bucket of the index
        self.buckets: Mapping[int, tuple[int, ...]] = _NO_BUCKETS  # bucket -> slots filed in it
        self.silent: frozenset[int] = frozenset()  # slots not heard since the cut of the last sweep

    def _copy(self, **changes) -> "Liveness":
        new = Liveness.__new__(Liveness)
        for name in Liveness.__slots__:
            setattr(new, name, changes.get(name, getattr(self, name)))
        return new

    # -- reading ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ids)

    def slot(self, machine_id: str) -> int | None:
        return self.slots.get(machine_id)

    def get(self, machine_id: str) -> tuple[int, int] | None:
        """(last heard ms, last sequence) of a watched machine, else None."""
        i = self.slots.get(machine_id)
        return None if i is None else (self.seen[i], self.seq[i])

    def items(self) -> Iterator[tuple[str, tuple[int, int]]]:
        for mid, seen, seq in zip(self.ids, self.seen, self.seq):
            yield mid, (seen, seq)

    def __eq__(self, other: object) -> bool:  # what is known, not how it is filed
        if not isinstance(other, Liveness):
            return NotImplemented
        return len(self) == len(other) and dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Liveness({len(self)} machines, {len(self.silent)} silent)"

    # -- changes ---------------------------------------------------------------------------------------------
    def watched(self, machines: Mapping[str, int]) -> "Liveness":
        """These machines (id -> since when, ms) are watched from now on (those watched already are left as they
        are), filed in the silence index."""
        new = [(mid, ms) for mid, ms in machines.items() if mid not in self.slots]
        if not new:
            return self
        first = len(self.ids)
        slots = self.slots.updated({mid: first + k for k, (mid, _) in enumerate(new)})
        out = self._copy(slots=slots, ids=self.ids.extended(mid for mid, _ in new),
                         seen=self.seen.extended(ms for _, ms in new), seq=self.seq.extended([-1] * len(new)),
                         filed=self.filed.extended([0] * len(new)))
        return out._filed_again(range(first, first + len(new)))

    def heard(self, seen: Mapping[int, int], seq: Mapping[int, int]) -> "Liveness":
        """Slots heard (slot -> new last heard; slot -> new last sequence); a slot out of the index is filed again."""
        if not seen and not seq:
            return self
        out = self._copy(seen=self.seen.set_many(seen), seq=self.seq.set_many(seq))
        return out._filed_again(i for i in seen if not self.filed[i])

    def _filed_again(self, slots: Iterable[int]) -> "Liveness":
        add: dict[int, list[int]] = {}
        seen = self.seen
        for i in slots:
            add.setdefault(seen[i] // BUCKET_MS, []).append(i)
        if not add:
            return self
        buckets = dict(self.buckets)
        for b, more in add.items():
            buckets[b] = buckets.get(b, ()) + tuple(more)
        return self._copy(buckets=MappingProxyType(buckets),
                          filed=self.filed.set_many({i: 1 for more in add.values() for i in more}))

    def sweep(self, cut_ms: int) -> "Liveness":
        """The index as of ``cut_ms``: ``silent`` the slots last heard before it (module docstring)."""
        gone = sorted(b for b in self.buckets if (b + 1) * BUCKET_MS <= cut_ms)
        seen = self.seen
        silent = {i for i in self.silent if seen[i] < cut_ms}
        back = [i for i in self.silent if seen[i] >= cut_ms]  # heard since (or the cut went back): in the index
        unfiled: dict[int, int] = {}
        for b in gone:
            for i in self.buckets[b]:
                unfiled[i] = 0
                if seen[i] < cut_ms:
                    silent.add(i)
                else:
                    back.append(i)
        edge = self.buckets.get(cut_ms // BUCKET_MS, ())
        silent.update(i for i in edge if seen[i] < cut_ms)
        if not gone and frozenset(silent) == self.silent and not back:
            return self
        buckets = dict(self.buckets)
        for b in gone:
            del buckets[b]
        out = self._copy(buckets=MappingProxyType(buckets), filed=self.filed.set_many(unfiled),
                         silent=frozenset(silent))
        return out._filed_again(i for i in dict.fromkeys(back) if not out.filed[i])

    def silent_ids(self) -> list[str]:
        ids = self.ids
        return [ids[i] for i in self.silent]
