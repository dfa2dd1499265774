"""The scheduler's offset guard: every source record is applied once, in order, whatever faust does.

Why it exists (a faust-streaming 0.15.3 bug, found with tests/integration/test_scheduler_failover.py): a
message that reaches a stream while flow control is suspended or while its consumer generation is stale (both
happen around every rebalance) is *skipped and acked* (``faust/streams.py``: "We want to ack the filtered out
message"). Its offset can then be committed, and after the rebalance the consumer seeks to that committed
offset, past the skipped record: a shard that took over a partition silently lost one intent or machine event
in about 1 run of 4.

The guard keeps, per source partition, the next offset the shard has to apply:

* in the ``scheduler-offsets`` table (changelog-backed, so a worker that takes the partition over recovers it),
  written together with the state an event changed: the persisted value never runs ahead of the applied state;
* in memory for the records in between that changed nothing (forgotten at every rebalance, when the table's
  value, which may be a little behind, is taken again: re-applying those records changes nothing). "A little":
  once the in-memory value runs ``PERSIST_AFTER`` records ahead of the table's, the shard writes the offset alone
  (``persist_due``), also for a batch of only records passed over undecoded (its own echoes, types ``decide``
  ignores). Without that, a region's registration (a million MachineRegistered, passed over by their type header)
  stayed at offset 0 in the table, and a rebalance made the shard read it all again (at a million machines it
  then sought back to 0 of a 450,000-record partition over and over, 2026-11-26).

For each record, ``verdict`` (pure) says: ``APPLY`` it (its offset is the next one), it is a ``DUPLICATE``
(below the next one: applied already), or there is a ``GAP`` before it (records were skipped): the shard then
seeks the partition back to the next offset and passes the record over, to see it again in order. A stall (the
partition's high watermark is past the next offset while the shard has received no record at all for
``STALL_S``) is a gap with no record after it: a timer finds it and seeks back too. "No record at all", not
"none of this partition": under a backlog, a partition's records wait in faust's buffers behind others', and
seeking back then would only fetch them twice. Every seek is logged. A batch the shard decided but could not
produce or store is ``rewind``-ed: the in-memory value is dropped, the table's (not yet moved) applies again, and
the shard seeks back to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

APPLY = "apply"
DUPLICATE = "duplicate"
GAP = "gap"
STALL_S = 2.0  # the shard idle this long while a high watermark is past the next offset: seek back
SEEK_AGAIN_S = 1.0  # a seek to the same offset is not repeated sooner (buffered records keep arriving)
PERSIST_AFTER = 10_000  # records applied that changed nothing, beyond the table's offset: write the offset alone


def verdict(next_offset: int, offset: int) -> str:
    """What to do with a record at ``offset`` when ``next_offset`` is the next one to apply."""
    if offset == next_offset:
        return APPLY
    return DUPLICATE if offset < next_offset else GAP


def partition_key(topic: str, partition: int) -> str:
    return f"{topic}/{partition}"


@dataclass
class OffsetGuard:
    """Per partition key: the next offset to apply (``persisted`` is the table's data, read-only here)."""

    persisted: dict
    in_memory: dict[str, int] = field(default_factory=dict)
    last_record_at: float = float("-inf")  # when any record last reached the guard
    sought: dict[str, tuple[int, float]] = field(default_factory=dict)  # key -> (offset, when) of the last seek

    def next_offset(self, key: str) -> int:
        if key in self.in_memory:
            return self.in_memory[key]
        return int(self.persisted.get(key) or 0)  # nothing applied yet: the partition's first record

    def check(self, key: str, offset: int, now: float) -> str:
        """The verdict for a record; an applied one moves the next offset on (in memory)."""
        v = verdict(self.next_offset(key), offset)
        if v == APPLY:
            self.in_memory[key] = offset + 1
        self.last_record_at = now
        return v

    def should_seek(self, key: str, now: float) -> int | None:
        """The offset to seek ``key`` back to, unless a seek there happened less than SEEK_AGAIN_S ago."""
        target = self.next_offset(key)
        last = self.sought.get(key)
        if last is not None and last[0] == target and now - last[1] < SEEK_AGAIN_S:
            return None
        self.sought[key] = (target, now)
        return target

    def persist_due(self, applied: dict[str, tuple[int, int]]) -> bool:
        """Whether a batch that changed no state should still write its offsets (``applied``: key -> (changelog
        partition, next offset)): one of them is ``PERSIST_AFTER`` records or more beyond the table's value."""
        return any(nxt - int(self.persisted.get(key) or 0) >= PERSIST_AFTER for key, (_, nxt) in applied.items())

    def stalled(self, key: str, high_watermark: int | None, now: float) -> bool:
        """Whether records below ``high_watermark`` wait while no record reached the shard for STALL_S."""
        if high_watermark is None or high_watermark <= self.next_offset(key):
            return False
        return now - self.last_record_at >= STALL_S

    def rewind(self, key: str) -> int:
        """A batch of ``key``'s records was not applied after all (its output or its tables could not be written):
        the next offset is the table's again; returns it (the shard seeks back there)."""
        self.in_memory.pop(key, None)
        self.sought.pop(key, None)
        return self.next_offset(key)

    def forget(self) -> None:
        """At a rebalance: take the table's values again (they may be a little behind; see the module doc)."""
        self.in_memory.clear()
        self.sought.clear()
