"""The scheduler's offset guard (processors/scheduler/offsets.py): pure, table-driven."""
import pytest

from processors.scheduler.offsets import (APPLY, BATCH, DUPLICATE, GAP, PERSIST_AFTER, SEEK_AGAIN_S,
                                         STALL_BACKOFF_MAX_S, STALL_BACKOFF_S, STALL_S, STARVED_S, TIMER, Episode,
                                         OffsetGuard, stall_step, verdict)


@pytest.mark.parametrize("next_offset, offset, expected", [
    (0, 0, APPLY), (5, 5, APPLY), (5, 4, DUPLICATE), (5, 0, DUPLICATE), (5, 6, GAP), (0, 3, GAP),
])
def test_verdict(next_offset, offset, expected):
    assert verdict(next_offset, offset) == expected


def test_in_order_records_apply_once_and_a_redelivery_is_a_duplicate():
    g = OffsetGuard({})
    assert [g.check("t/0", o, 1.0) for o in (0, 1, 2)] == [APPLY] * 3
    assert [g.check("t/0", o, 1.0) for o in (1, 2)] == [DUPLICATE] * 2
    assert g.next_offset("t/0") == 3 and g.next_offset("t/1") == 0


def test_a_skipped_record_is_a_gap_until_it_is_seen_again_in_order():
    """faust skipped and acked offset 4; 5 arrives: seek back to 4, then 4 and 5 apply."""
    g = OffsetGuard({"t/0": 4})
    assert g.check("t/0", 5, 1.0) == GAP
    assert g.should_seek("t/0", 1.0) == 4
    assert g.should_seek("t/0", 1.0 + SEEK_AGAIN_S / 2) is None  # buffered records keep arriving: once is enough
    assert g.should_seek("t/0", 1.0 + SEEK_AGAIN_S) == 4
    assert [g.check("t/0", o, 2.0) for o in (4, 5)] == [APPLY, APPLY]


def test_the_table_value_is_the_fallback_and_forget_returns_to_it():
    persisted = {"t/0": 7}
    g = OffsetGuard(persisted)
    assert g.check("t/0", 7, 1.0) == APPLY and g.check("t/0", 8, 1.0) == APPLY
    assert g.next_offset("t/0") == 9
    g.forget()  # a rebalance: the table may be behind (records 7, 8 changed nothing), re-applying is harmless
    assert g.next_offset("t/0") == 7
    persisted["t/0"] = 10  # the successor's table, recovered from the changelog
    assert g.next_offset("t/0") == 10


def test_a_batch_not_stored_is_rewound_to_the_table_value_and_applied_again():
    persisted = {"t/0": 7, "t/1": 3}
    g = OffsetGuard(persisted)
    assert [g.check("t/0", o, 1.0) for o in (7, 8, 9)] == [APPLY, APPLY, APPLY]
    assert g.should_seek("t/0", 1.0) == 10  # (a seek for another reason, remembered)
    assert g.rewind("t/0") == 7  # its tables were not written: from the stored offset again
    assert g.should_seek("t/0", 1.1) == 7  # and the seek is not held back by the earlier one
    assert [g.check("t/0", o, 2.0) for o in (7, 8, 9)] == [APPLY, APPLY, APPLY]
    assert g.next_offset("t/1") == 3 and g.rewind("t/1") == 3  # another partition: untouched


# (episode before, next offset, high watermark, idle s, starved s, busy) -> (episode after, seek?). Now is 1000.0.
E5 = Episode(5, 1, 1000.0 + STALL_BACKOFF_S)  # found stalled at offset 5, sought once, next seek no sooner than that
STALL_RULE = [
    ("no fetch yet: nothing known", None, 5, None, 60.0, 60.0, False, None, False),
    ("caught up", None, 5, 5, 60.0, 60.0, False, None, False),
    ("caught up ends an episode", E5, 5, 5, 60.0, 60.0, False, None, False),
    ("records wait, the shard idle: a stall, seek at once", None, 5, 9, STALL_S, 0.0, False,
     Episode(5, 1, 1000.0 + STALL_BACKOFF_S), True),
    ("records wait, the shard reads this one's and others': a backlog", None, 5, 9, STALL_S / 2, 0.0, False, None,
     False),
    ("records wait, others' keep coming, this one's not for long: a backlog", None, 5, 9, 0.0, STARVED_S / 2, False,
     None, False),
    ("records wait, others' keep coming, this one's never do: starved, a stall", None, 5, 9, 0.0, STARVED_S, False,
     Episode(5, 1, 1000.0 + STALL_BACKOFF_S), True),
    ("records wait, a decision under way: deciding, not stalled", None, 5, 9, 60.0, 60.0, True, None, False),
    ("a decision under way keeps the episode, seeks nothing", E5, 5, 9, 60.0, 60.0, True, E5, False),
    ("still stalled within the backoff: no second seek", E5, 5, 9, 60.0, 0.0, False, E5, False),
    ("moved on since, stalled again: a new episode", E5, 7, 9, 60.0, 0.0, False,
     Episode(7, 1, 1000.0 + STALL_BACKOFF_S), True),
    ("moved on since, reading: the episode is over", E5, 7, 9, 0.0, 0.0, False, None, False),
]


@pytest.mark.parametrize("why, before, next_offset, high, idle_s, starved_s, busy, after, seek", STALL_RULE,
                         ids=[c[0] for c in STALL_RULE])
def test_the_stall_rule(why, before, next_offset, high, idle_s, starved_s, busy, after, seek):
    assert stall_step(before, next_offset, high, idle_s, starved_s, busy, 1000.0) == (after, seek)


def test_a_stall_seeks_back_once_then_with_a_doubling_backoff():
    """An episode that does not end (the seek brings nothing): seeks at 0, then after 10, 20, 40, 80, 120, 120 s
    more; never every STALL_S (the 2026-11-27 bench's 2,029 seeks)."""
    g = OffsetGuard({"t/0": 5})
    seeks = [t for t in range(0, 600, int(STALL_S)) if g.stall_seek("t/0", 9, 100.0 + t) is not None]
    gaps = [b - a for a, b in zip(seeks, seeks[1:])]
    assert seeks[0] == 0 and gaps[:6] == [10, 20, 40, 80, 120, 120]
    assert all(gap <= STALL_BACKOFF_MAX_S for gap in gaps)
    assert len(seeks) == 8 and g.stalls["t/0"] == Episode(5, 8, 100.0 + seeks[-1] + STALL_BACKOFF_MAX_S)  # not 300


def test_a_busy_shard_never_seeks_and_its_idle_time_counts_from_the_end_of_the_decision():
    """A decision holding the shard for minutes (the retry timer's 152 s round): no record reaches the guard, yet
    nothing is stalled; once it ends, the partition is stalled only after STALL_S more of nothing."""
    g = OffsetGuard({"t/0": 5})
    g.check("t/1", 0, 0.0)
    assert all(g.stall_seek("t/0", 9, float(t), busy=True) is None for t in range(2, 200, 2))
    g.worked(200.0)
    assert g.stall_seek("t/0", 9, 200.0 + STALL_S / 2) is None
    assert g.stall_seek("t/0", 9, 200.0 + STALL_S) == 5


def test_a_partition_whose_records_never_come_while_others_do_is_starved():
    """t/0 sought back at the end of a recovery, the seek lost to faust's own: nothing of it comes again, while the
    other partitions keep the shard busy (the idle rule never fires). Found stuck for minutes (2026-11-28)."""
    g = OffsetGuard({"t/0": 72})
    g.check("t/0", 71, 0.0)  # its last record (a duplicate: the next one, 72, never comes)
    seeks = []
    for t in range(0, 121, 1):
        g.check("t/1", t, float(t))  # the other partition's records keep coming
        if t % 2 == 0 and g.stall_seek("t/0", 76, float(t)) is not None:
            seeks.append(t)
    assert seeks == [30, 40, 60, 100]  # starved after STARVED_S of others' records, then the backoff


def test_a_quiet_partition_behind_by_a_new_record_is_not_starved():
    """A partition quiet for ten minutes gets a record; its high watermark moves before the record reaches the
    shard. Starvation counts from when it fell behind, not from its last record: no seek."""
    g = OffsetGuard({"t/0": 5})
    g.check("t/0", 4, 0.0)
    for t in range(1, 602):
        g.check("t/1", t, float(t))  # the others keep the shard reading
        if t >= 598:
            assert g.stall_seek("t/0", 6, float(t)) is None  # behind since 598: not for STARVED_S yet
    assert g.check("t/0", 5, 601.5) == APPLY and g.stall_seek("t/0", 6, 602.0) is None
    assert g.behind_since == {} and g.stalls == {}


# -- the idle rule and the retry timer ----------------------------------------------------------------------------
# What reaches the guard of one shard whose partition t/0 waits at offset 5 below its high watermark, second by
# second: "record" (t/0's next record), BATCH (the agent's batch of it decided: ``worked``), TIMER (a slice of the
# retry timer ended), "look" / "look busy" (find_stalls, a decision under way or not). Expected: when it seeks back.
# A timer slice ending used to count as work: with slices ending every second, a stalled fetch was never found.
ORDER = {"record": 0, BATCH: 1, TIMER: 2, "look": 3, "look busy": 3}


def every(what, start, stop, step=1):
    return [(float(t), what) for t in range(start, stop + 1, step)]


IDLE_RULE = {
    "fetch stalled, a timer slice ending every second: stalled all the same": (
        100, [(0.0, "record"), (0.0, BATCH)] + every(TIMER, 1, 40) + every("look", 2, 40, 2), [2, 12, 32]),
    "fetch stalled, no timer: the same": (
        100, [(0.0, "record"), (0.0, BATCH)] + every("look", 2, 40, 2), [2, 12, 32]),
    "records keep coming (a backlog), timer slices too: never stalled": (
        100, every("record", 0, 40) + every(BATCH, 0, 40) + every(TIMER, 0, 40) + every("look", 2, 40, 2), []),
    "a batch waits for the lock behind timer slices for 30 s: busy; stalled STALL_S after it is decided": (
        100, [(0.0, "record")] + every("look busy", 2, 30, 2) + [(30.0, BATCH)] + every(TIMER, 31, 40)
        + every("look", 32, 40, 2), [32]),
    "caught up, timer slices ending: nothing waits, no stall": (
        5, [(0.0, BATCH)] + every(TIMER, 1, 40) + every("look", 2, 40, 2), []),
}


@pytest.mark.parametrize("name", list(IDLE_RULE))
def test_the_idle_rule_counts_the_agents_batches_not_the_timers_slices(name):
    high, events, expected = IDLE_RULE[name]
    g = OffsetGuard({"t/0": 5})
    g.check("t/0", 4, -1.0)  # t/0 applied up to 5
    seeks = []
    for t, what in sorted(events, key=lambda e: (e[0], ORDER[e[1]])):
        if what == "record":
            assert g.check("t/0", g.next_offset("t/0"), t) == APPLY
        elif what in (BATCH, TIMER):
            g.worked(t, what)
        elif g.stall_seek("t/0", high, t, busy=what == "look busy") is not None:
            seeks.append(int(t))
    assert seeks == expected
    with pytest.raises(ValueError, match="a decision is a 'batch' or a 'timer'"):
        g.worked(50.0, "slice")


def test_progress_ends_an_episode_and_a_rebalance_forgets_it():
    g = OffsetGuard({"t/0": 5})
    assert g.stall_seek("t/0", 9, 0.0) == 5
    assert g.stall_seek("t/0", 9, STALL_S) is None  # within the backoff
    assert [g.check("t/0", o, 3.0) for o in (5, 6)] == [APPLY, APPLY]
    assert g.stall_seek("t/0", 9, 3.0 + STALL_S) == 7  # stalled again further on: a new episode, sought at once
    g.forget()
    assert g.stalls == {} and g.stall_seek("t/0", 9, 3.0 + 2 * STALL_S) == 5  # the table's value, afresh


@pytest.mark.parametrize("persisted, applied, due", [
    ({}, {"t/0": (0, PERSIST_AFTER - 1)}, False),  # never written, not far yet
    ({}, {"t/0": (0, PERSIST_AFTER)}, True),  # never written (a registration's records): write it
    ({"t/0": 500}, {"t/0": (0, 500 + PERSIST_AFTER)}, True),
    ({"t/0": 500}, {"t/0": (0, 499 + PERSIST_AFTER)}, False),
    ({"t/0": 0, "t/1": 0}, {"t/0": (0, 3), "t/1": (1, PERSIST_AFTER + 3)}, True),  # any partition far enough
    ({"t/0": 7}, {}, False),
])
def test_offsets_of_records_that_changed_nothing_are_written_once_far_enough(persisted, applied, due):
    """A batch that changed no state writes its offsets alone once they run PERSIST_AFTER ahead of the table's:
    after a rebalance the shard reads at most that many records again (not a million-machine registration)."""
    assert OffsetGuard(persisted).persist_due(applied) is due
