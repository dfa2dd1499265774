"""The scheduler's offset guard (processors/scheduler/offsets.py): pure, table-driven."""
import pytest

from processors.scheduler.offsets import (APPLY, DUPLICATE, GAP, PERSIST_AFTER, SEEK_AGAIN_S, STALL_S, OffsetGuard,
                                         verdict)


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


@pytest.mark.parametrize("high_watermark, idle_s, expected", [
    (None, 10.0, False),           # no fetch yet: nothing known
    (3, 10.0, False),              # everything applied
    (5, 10.0, True),               # records wait and the shard is idle: a stall
    (5, STALL_S / 2, False),       # records wait but the shard is busy: a backlog, not a stall
])
def test_stalled(high_watermark, idle_s, expected):
    g = OffsetGuard({"t/0": 3})
    g.check("t/1", 0, 100.0)  # the last record the shard received, of any partition
    assert g.stalled("t/0", high_watermark, 100.0 + idle_s) is expected


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
