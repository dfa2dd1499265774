"""Figure 14 at a small size: the rolling update under ReplicaAware never takes a shard below two live
replicas; the MSB failure's toll is exactly what the failure alone causes, recomputed from the placement."""
from collections import Counter

import pytest

from bench.experiments import figure14 as f

SMALL = dict(tasks=100, shards=1500, replicas=3, msbs=10, msb_fail_at_s=120, msb_down_s=295)


@pytest.fixture(scope="module", params=["grouped", "random"])
def small(request):
    c = f.Conditions(**SMALL, placement=request.param)
    return c, f.run(c)


def test_placement_puts_each_shards_replicas_on_distinct_tasks():
    for placement in f.PLACEMENTS:
        hosted = f.place_replicas(30, 200, 3, seed=5, placement=placement)
        per_shard = Counter(s for shards in hosted.values() for s in shards)
        assert set(per_shard.values()) == {3} and len(per_shard) == 200
        assert all(len(set(shards)) == len(shards) for shards in hosted.values()), "3 different tasks"
        assert hosted == f.place_replicas(30, 200, 3, seed=5, placement=placement), "seeded"
    assert f.place_replicas(30, 200, 3, seed=5) != f.place_replicas(30, 200, 3, seed=6)


def test_ropewalk_never_takes_a_shard_below_two_live_replicas(small):
    c, result = small
    totals = result.totals()
    assert totals["shards_lost_second_replica_by_ropewalk"] == 0
    assert totals["peak_concurrent_updates"] >= 2, "the controller lets several tasks update at once"
    assert totals["update_duration_s"] is not None and totals["all_tasks_running_again_s"] is not None
    assert result.rows[-1]["tasks_updated"] == c.tasks and result.rows[-1]["shards_2plus_down"] == 0


def test_failure_toll_is_what_the_failure_alone_causes(small):
    c, result = small
    hosted = f.place_replicas(c.tasks, c.shards, c.replicas, c.seed, c.placement)
    gone = {f.task_id(i) for i in range(c.tasks) if i % c.msbs == c.failed_msb}
    assert len(gone) == c.tasks // c.msbs
    # independently: live replicas just before the failure (every task but those down then), and after it
    before = Counter(s for t, shards in hosted.items() if t not in result.down_before_failure for s in shards)
    after = Counter(s for t, shards in hosted.items() if t not in result.down_before_failure | gone
                    for s in shards)
    expected = {s for s in before if before[s] >= 2 > after[s]}
    assert result.by_failure == expected
    assert result.totals()["shards_lost_second_replica_by_failure"] == len(expected) > 0
    # and the MSB alone, with nothing else down, would hit only shards with two replicas in it
    alone = {s for s in before if sum(t in gone for t in hosted if s in hosted[t]) >= 2}
    assert alone <= expected


def test_the_curves_show_the_story(small):
    c, result = small
    rows = {r["t_s"]: r for r in result.rows}
    assert rows[0]["tasks_waiting"] == c.tasks
    during = rows[c.msb_fail_at_s + 10]
    assert during["failed_msb_tasks_down"] == c.tasks // c.msbs
    assert max(r["shards_2plus_down"] for r in result.rows if r["t_s"] < c.msb_fail_at_s) == 0, \
        "before the failure, no shard has two replicas down"


def test_bad_conditions_are_refused():
    with pytest.raises(ValueError, match="placement"):
        f.Conditions(placement="striped")
    with pytest.raises(ValueError, match="replicas"):
        f.Conditions(tasks=2, replicas=3)


def test_full_size():
    """The issue's size (1,000 tasks, 15,000 shards x 3, an MSB of 50 tasks failing at T120 for 295 s), in-process
    (~5 s): nothing lost through Ropewalk, and the failure's toll is what the failure alone causes. The same size on
    the real pipeline is ``ropewalk experiment figure14 --pipeline`` (minutes; by hand, numbers in the README)."""
    c = f.Conditions()
    assert (c.tasks, c.shards, c.replicas, len(f.failed_tasks(c))) == (1000, 15000, 3, 50)
    result = f.run(c)
    totals = result.totals()
    assert totals["shards_lost_second_replica_by_ropewalk"] == 0
    hosted = f.place_replicas(c.tasks, c.shards, c.replicas, c.seed, c.placement)
    assert result.by_failure == f.failure_alone(c, hosted, result.down_before_failure)
    assert totals["shards_lost_second_replica_by_failure"] > 0 and totals["peak_concurrent_updates"] > 100
    assert result.rows[-1]["tasks_updated"] == c.tasks
