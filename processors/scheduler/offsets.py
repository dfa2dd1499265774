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
seeks the partition back to the next offset and passes the record over, to see it again in order. A batch the
shard decided but could not produce or store is ``rewind``-ed: the in-memory value is dropped, the table's (not yet
moved) applies again, and the shard seeks back to it. Every seek is logged.

**Stalls** (``stall_step``, pure; ``OffsetGuard.stall_seek``). A stall is a gap with no record after it: the
partition's high watermark is past the next offset and nothing of it comes. A timer looks every ``STALL_S``. A
partition is stalled when

* the shard has been *idle* for ``STALL_S``: no record reached it and no decision ended, and none is under way; or
* it is *starved*: the shard kept receiving other partitions' records for ``STARVED_S`` since the last record of
  this one (a seek lost to faust's own seek at the end of a recovery, 2026-11-28: the other partitions kept the
  shard busy, the idle rule never fired, and the partition waited for ever).

"A decision ended" is a batch of the shard's agent (``worked``), not a slice of the retry timer (``TIMER``): records
wait behind the agent's batch (the agent takes no more until it is decided), not behind a timer slice (the agent
goes on taking them and the guard checks them before the agent waits for the lock; one it waits with is a decision
under way, and the batch's end counts). A timer slice counted as work (until 2026-11-28) kept the shard from ever
being idle while its slices ended less than ``STALL_S`` apart (a retry timer of 1 s, or rounds back to back in a
large region): a shard whose fetch stalled was never found stalled.

It is not stalled while a decision is under way (the agent's batch, waiting for the lock or deciding; a slice of
the retry timer, holding the lock), nor while it is merely behind on a backlog its records are coming from (they
wait in faust's buffers behind others'; seeking back would only fetch them twice). A stall starts an *episode*:
the first look that finds it seeks back at once; while the next offset stays where the episode began, a seek again waits
``STALL_BACKOFF_S``, doubled each time up to ``STALL_BACKOFF_MAX_S``; the episode ends when the partition moves
past that offset or catches up, and at a rebalance (``forget``). The rule was a seek every ``STALL_S`` once the
shard had been idle for it: in a 100,000-machine bench (2026-11-27) a timer round held the shard's lock for 152 s,
no record reached the guard, and the shard sought back 2,029 times.
"""
from __future__ import annotations

from dataclasses import dataclass, field

APPLY = "apply"
DUPLICATE = "duplicate"
GAP = "gap"
STALL_S = 2.0  # the shard idle this long while a high watermark is past the next offset: a stall; the look's period
STARVED_S = 30.0  # other partitions' records kept coming this long since this one's last: a stall too
STALL_BACKOFF_S = 10.0  # a stall's episode seeks again no sooner than this after its first seek...
STALL_BACKOFF_MAX_S = 120.0  # ...doubling after each seek, up to this
SEEK_AGAIN_S = 1.0  # a seek to the same offset (after a gap) is not repeated sooner (buffered records keep arriving)
BATCH = "batch"  # what ended (``OffsetGuard.worked``): a batch of the agent's records, which records wait behind...
TIMER = "timer"  # ...or a slice of the retry timer, which they do not: it does not end the shard's idle time
PERSIST_AFTER = 10_000  # records applied that changed nothing, beyond the table's offset: write the offset alone


def verdict(next_offset: int, offset: int) -> str:
    """What to do with a record at ``offset`` when ``next_offset`` is the next one to apply."""
    if offset == next_offset:
        return APPLY
    return DUPLICATE if offset < next_offset else GAP


def partition_key(topic: str, partition: int) -> str:
    return f"{topic}/{partition}"


@dataclass(frozen=True)
class Episode:
    """A partition stalled at ``offset`` (its next offset when the stall was found): ``seeks`` made, none before
    ``next_seek_at`` (monotonic seconds)."""

    offset: int
    seeks: int
    next_seek_at: float


def stall_step(episode: Episode | None, next_offset: int, high_watermark: int | None, idle_s: float,
               starved_s: float, busy: bool, now: float) -> tuple[Episode | None, bool]:
    """The stall rule for one partition at one look: (its episode after the look, whether to seek back now).
    ``idle_s``: since a record last reached the shard or a decision last ended; ``starved_s``: how long the shard
    went on receiving other partitions' records after this one's last; ``busy``: a decision under way."""
    if high_watermark is None or high_watermark <= next_offset:
        return None, False  # nothing waits: no stall
    if episode is not None and next_offset > episode.offset:
        episode = None  # it moved on since: that episode is over
    if busy or (idle_s < STALL_S and starved_s < STARVED_S):
        return episode, False  # deciding, or reading (this partition's backlog among others'): not a stall
    if episode is None:
        return Episode(next_offset, 1, now + STALL_BACKOFF_S), True
    if now < episode.next_seek_at:
        return episode, False
    wait = min(STALL_BACKOFF_S * 2 ** episode.seeks, STALL_BACKOFF_MAX_S)
    return Episode(episode.offset, episode.seeks + 1, now + wait), True


@dataclass
class OffsetGuard:
    """Per partition key: the next offset to apply (``persisted`` is the table's data, read-only here)."""

    persisted: dict
    in_memory: dict[str, int] = field(default_factory=dict)
    last_record_at: float = float("-inf")  # when any record last reached the guard, or a batch last ended
    sought: dict[str, tuple[int, float]] = field(default_factory=dict)  # key -> (offset, when) of the last seek
    stalls: dict[str, Episode] = field(default_factory=dict)  # key -> its stall episode (stall_step)
    last_seen: dict[str, float] = field(default_factory=dict)  # key -> when a record of it last reached the guard
    behind_since: dict[str, float] = field(default_factory=dict)  # key -> since when a look found it behind
    received_at: float = float("-inf")  # when any record last reached the guard (decisions aside)

    def next_offset(self, key: str) -> int:
        if key in self.in_memory:
            return self.in_memory[key]
        return int(self.persisted.get(key) or 0)  # nothing applied yet: the partition's first record

    def check(self, key: str, offset: int, now: float) -> str:
        """The verdict for a record; an applied one moves the next offset on (in memory)."""
        v = verdict(self.next_offset(key), offset)
        if v == APPLY:
            self.in_memory[key] = offset + 1
        self.last_record_at = self.received_at = now
        self.last_seen[key] = now
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

    def worked(self, now: float, what: str = BATCH) -> None:
        """A decision ended at ``now``: after a ``BATCH`` of the agent's records (held back while it was decided) the
        idle time of a stall counts from here; after a ``TIMER`` slice it does not (see the module doc)."""
        if what == BATCH:
            self.last_record_at = max(self.last_record_at, now)
        elif what != TIMER:
            raise ValueError(f"a decision is a {BATCH!r} or a {TIMER!r}, not {what!r}")

    def stall_seek(self, key: str, high_watermark: int | None, now: float, busy: bool = False) -> int | None:
        """The offset to seek ``key`` back to now because it is stalled (``stall_step``), or None."""
        nxt = self.next_offset(key)
        if high_watermark is None or high_watermark <= nxt:
            self.behind_since.pop(key, None)
            since = now
        else:  # starved since its last record, or since it fell behind (a quiet partition's new record is not late)
            since = max(self.behind_since.setdefault(key, now), self.last_seen.get(key, float("-inf")))
        episode, seek = stall_step(self.stalls.get(key), nxt, high_watermark, now - self.last_record_at,
                                   self.received_at - since, busy, now)
        if episode is None:
            self.stalls.pop(key, None)
        else:
            self.stalls[key] = episode
        return self.next_offset(key) if seek else None

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
        self.stalls.clear()
        self.last_seen.clear()
        self.behind_since.clear()
