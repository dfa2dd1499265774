"""`ropewalk bench` refuses a bad count before it starts anything, naming the flag (table-driven)."""
import pytest

from bench.harness import options_for, run

REFUSED = [
    (dict(machines=1), "--machines"),
    (dict(schedulers=0), "--schedulers"),
    (dict(allocators=9), "--allocators"),  # more than the 8 partitions
    (dict(brokers=2), "--brokers"),  # a KRaft quorum of 2 survives the loss of neither node
    (dict(brokers=0), "--brokers"),
]


@pytest.mark.parametrize("overrides,flag", REFUSED, ids=[f for _, f in REFUSED])
def test_a_bad_count_is_refused_by_its_flag(overrides, flag):
    started = []
    with pytest.raises(ValueError, match=flag):
        run(options_for(quick=True, **overrides), progress=started.append)
    assert started == []  # refused before anything was said, so before anything was started
