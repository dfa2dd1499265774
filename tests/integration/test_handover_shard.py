"""An entitlement's hand-over between partitions inside the scheduler shard's wiring, on the real broker (the
protocol: processors/scheduler/README.md, "Moving an entitlement"; its pure parts: tests/unit/test_handover.py).
Workers are ``python -m processors.scheduler.shard`` subprocesses; the allocator and the agents are played by hand.

* Records of the entitlement that reach its old partition after the move are forwarded and decided on the new one
  (held there until the hand-over is in), once; a worker restarted afterwards recovers the entitlement on its new
  partition from the changelogs, the old partition's tombstones notwithstanding.
* A shard killed between the steps of a move (after the freeze, after sending the state, after adopting it) finishes
  the move when it comes back: nothing lost, nothing decided twice.
"""
import re

import pytest

from processors.scheduler.handover import MOVE_REQUESTED
from processors.scheduler.shard import FAILPOINT_ENV
from streams.clients import EventProducer
from streams.partitionmap import MapFollower
from streams.partitioner import partition_for
from test_scheduler_shard import (  # noqa: F401 - workers is a fixture
    Hands, Log, all_running, entitlement, ev, resize, run_until, submit, workers,
)

ENT = "e7"


def move(to: int):
    return ev(MOVE_REQUESTED, {"to_partition": to, "reason": "test"}, ent=ENT, entity=ENT, producer="cli")


def moved_to(follower: MapFollower, target: int) -> bool:
    e = follower.entry(ENT)
    return e is not None and e.partition == target and e.moving_to is None and e.epoch >= 1


def start_job(cfg, registry, w, n=3):
    log, producer = Log(cfg, registry), EventProducer(cfg, registry, "test")
    hands = Hands(producer)
    producer.send(entitlement(ENT))
    producer.send(submit(ENT, f"{ENT}.j", n))
    producer.flush()
    run_until(log, hands, lambda: all_running(log, {f"{ENT}.j": n}), 60, "the job running", [w])
    return log, producer, hands


def decided_once(log: Log) -> None:
    """No scheduler output twice with different contents (a decision taken on both partitions, or on two states,
    would emit the same derived ids with other contents), and no request id asked twice with other tasks."""
    seen = {}
    for r in log.records:
        e = r.event
        if e.event_id in seen:
            assert seen[e.event_id] == e.payload, f"{e.type} {e.event_id} emitted twice, differently"
        seen[e.event_id] = e.payload
    asked: dict[str, tuple] = {}
    for r in log.records:
        if r.event.type == "AllocationRequested":
            p = r.event.payload
            tasks = (tuple(p["place_task_ids"]), tuple(p["free_task_ids"]))
            assert asked.setdefault(p["request_id"], tasks) == tasks, f"request {p['request_id']} asked twice"


@pytest.mark.timeout(180)
def test_records_after_the_move_are_forwarded_held_and_decided_once(cfg, registry, workers):
    home = partition_for(ENT, cfg.partitions)
    target = (home + 1) % cfg.partitions
    w = workers("w1")
    follower = MapFollower.start(cfg, registry)
    log, producer, hands = start_job(cfg, registry, w)
    try:
        # the move, and right behind it on the old partition (the producer routes by hash): a resize to 5, in the
        # same flush, so the shard sees them in one batch: the resize is forwarded, and held on the target until the
        # parts are in
        producer.send(move(target))
        producer.send(resize(ENT, f"{ENT}.j", 5))
        producer.flush()
        run_until(log, hands, lambda: moved_to(follower, target) and all_running(log, {f"{ENT}.j": 5}), 60,
                  "moved, and the resize decided there", [w])
        text = w.log_path.read_text()
        assert f"entitlement {ENT} frozen on partition {home}, moving to {target}" in text
        assert f"entitlement {ENT} adopted on partition {target}" in text
        assert re.search(r"forwarded \d+ records", text)
        new_requests = [r for r in log.records if r.event.type == "AllocationRequested"
                        and r.event.payload["place_task_ids"] == [f"{ENT}.j/3", f"{ENT}.j/4"]]
        assert {r.partition for r in new_requests} == {target}  # decided on the new partition, once
        assert len({r.event.event_id for r in new_requests}) == 1
        # a worker started afresh recovers it on the new partition (its keys there are qualified: the old
        # partition's tombstones do not touch them), and decides on
        w.kill()
        w2 = workers("w2")
        producer.send(resize(ENT, f"{ENT}.j", 6))  # routed by hash: the old partition, which forwards it
        producer.flush()
        run_until(log, hands, lambda: all_running(log, {f"{ENT}.j": 6}), 90, "the resize after a restart", [w2])
        decided_once(log)
        states = [t["machine_id"] for t in log.latest_state()[f"{ENT}.j"]["tasks"]]
        assert len(states) == len(set(states)) == 6  # no task placed twice
    finally:
        follower.close()
        log.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("point", ["after_freeze", "after_handover", "after_adopt"])
def test_a_shard_killed_between_the_steps_of_a_move_finishes_it_when_it_comes_back(cfg, registry, workers, point):
    home = partition_for(ENT, cfg.partitions)
    target = (home + 2) % cfg.partitions
    w = workers("w1", **{FAILPOINT_ENV: point})
    follower = MapFollower.start(cfg, registry)
    log, producer, hands = start_job(cfg, registry, w)
    try:
        producer.send(move(target))
        producer.flush()
        run_until(log, hands, lambda: w.proc.poll() is not None, 60, f"the shard to exit at {point}", [w])
        assert w.proc.returncode == 70
        w2 = workers("w2", ROPEWALK_SCHEDULER_RETRY_S="1")  # the timer finishes a move a crash cut short
        run_until(log, hands, lambda: moved_to(follower, target), 90, "the move finished", [w2])
        if point in ("after_freeze", "after_handover"):  # the state sent (again), the jobs dropped from the old one
            run_until(log, hands, lambda: f"entitlement {ENT} handed over" in w2.log_path.read_text(), 60,
                      "the hand-over finished by the timer", [w2])
        producer.send(resize(ENT, f"{ENT}.j", 4))
        producer.flush()
        run_until(log, hands, lambda: all_running(log, {f"{ENT}.j": 4}), 60, "a resize decided after it", [w2])
        decided_once(log)
        grown = {r.partition for r in log.records if r.event.type == "AllocationRequested"
                 and r.event.payload["place_task_ids"] == [f"{ENT}.j/3"]}
        assert grown == {target}
    finally:
        follower.close()
        log.close()
