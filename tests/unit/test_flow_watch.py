"""``faustwire.FlowWatch`` on faust's own consumer (a real faust-streaming 0.15.3 Consumer, built by ``make_app``
and not started: its flow-control sets and callbacks are plain Python, no broker needed).

A partition faust took out of its fetch (buffer pressure: ``on_buffer_full``) and never gave back is given back
after ``after_s`` with faust's own ``on_buffer_drop``; one paused by faust's recovery, or back in time, is left
alone; nothing is touched while the flow is stopped (a rebalance)."""
from __future__ import annotations

import pytest
from faust.types import TP

from infra.config import Config
from streams.faustwire import FlowWatch, make_app

A, B = TP("machines", 0), TP("machines", 3)


@pytest.fixture()
def consumer(tmp_path):
    app = make_app(Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)}), "flowwatch")
    c = app.consumer
    c._set_active_tps({A, B})  # what faust does at an assignment
    c.resume_flow()
    return c


# (what happens to B, then checks at these times after it left the fetch) -> B given back at the last check?
CASES = [
    ("buffer full, never drained", "full", (0.0, 29.0), False),
    ("buffer full, never drained", "full", (0.0, 30.0), True),
    ("paused by faust's recovery", "paused", (0.0, 300.0), False),
    ("buffer drained in time", "full-then-drop", (0.0, 10.0, 40.0), False),
    ("flow stopped (a rebalance)", "full-flow-stopped", (0.0, 300.0), False),
]


@pytest.mark.parametrize("why,what,times,given_back", CASES, ids=[c[0] for c in CASES])
def test_a_partition_left_out_of_the_fetch_is_given_back_after_its_time(consumer, why, what, times, given_back):
    watch = FlowWatch(after_s=30.0)
    if what == "paused":
        consumer.pause_partitions([B])
    else:
        consumer.on_buffer_full(B)
    if what == "full-flow-stopped":
        consumer.stop_flow()
    taken = []
    for n, t in enumerate(times):
        if what == "full-then-drop" and n == 2:
            consumer.on_buffer_drop(B)  # faust's callback ran after all, before the time ran out
        taken = watch.check(consumer, [A, B], 1000.0 + t)
    assert (taken == [(B, "buffer full, never drained")]) is given_back
    assert (B in consumer._active_partitions) is (given_back or what == "full-then-drop")
    assert A in consumer._active_partitions
    if given_back:
        assert B not in consumer._buffered_partitions and B not in watch.seen


def test_the_clock_starts_again_when_a_partition_leaves_the_fetch_again(consumer):
    watch = FlowWatch(after_s=30.0)
    consumer.on_buffer_full(B)
    assert watch.check(consumer, [A, B], 0.0) == []
    consumer.on_buffer_drop(B)
    assert watch.check(consumer, [A, B], 20.0) == [] and watch.seen == {}
    consumer.on_buffer_full(B)
    assert watch.check(consumer, [A, B], 40.0) == []  # out since 40, not since 0
    assert watch.check(consumer, [A, B], 70.0) == [(B, "buffer full, never drained")]


def test_describe_says_what_faust_says_of_a_partition(consumer):
    consumer.on_buffer_full(B)
    assert FlowWatch.describe(consumer, A).startswith("in the fetch")
    assert FlowWatch.describe(consumer, B).startswith("out of the fetch, its buffer full")
    consumer.stop_flow()
    assert "flow stopped" in FlowWatch.describe(consumer, A)
