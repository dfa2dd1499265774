"""A stopped job leaves a real scheduler shard once its grace passed (processors/scheduler/README.md, "Stopped jobs
leave"): its header leaves the shard's table (a tombstone on the changelog), a tombstone goes to ``state.jobs``, a
reader of the state forgets it, and the job id can be submitted again, afresh (incarnation 1, requests of its own),
also on a worker that recovered the tables from the changelogs."""
from __future__ import annotations

import time

import pytest

import test_scheduler_shard as shard_tests  # the shard tests' helpers (tests/integration is on sys.path)
from processors.scheduler import model as sm
from streams.clients import EventConsumer, EventProducer
from streams.state import StateReader
from streams.topics import Topics
from test_scheduler_shard import workers  # noqa: F401 - a fixture

GC_S = "2"  # the grace here: the job leaves the state this long after its stop was freed


def _stop_and_free(log, hands, producer, job: str, w) -> None:
    """Stop ``job``: its tasks report STOPPED (``hands``), and its final free request is answered."""
    producer.send(shard_tests.ev("JobStopped", {"job_id": job, "reason": "test"}, ent="e1", entity=job,
                                 producer="cli"))
    producer.flush()
    answered: set[str] = set()

    def freed() -> bool:
        for req in log.of("AllocationRequested", job_id=job):
            p = req.payload
            if p["free_task_ids"] and not p["place_task_ids"] and p["request_id"] not in answered:
                answered.add(p["request_id"])
                producer.send(shard_tests.ev("TasksDeallocated", {
                    "request_id": p["request_id"], "job_id": job, "placements": [], "machines_released": []},
                    ent="e1", entity=p["request_id"], producer="allocator"))
                producer.flush()
        s = log.latest_state().get(job)
        return s is not None and s["deleted"]

    shard_tests.run_until(log, hands, freed, 60, f"{job} stopped and deleted", [w])


@pytest.mark.timeout(240)
def test_a_stopped_job_leaves_the_shard_after_its_grace_and_its_id_starts_afresh(cfg, registry, workers):
    w1 = workers("w1", ROPEWALK_JOB_GC_S=GC_S, ROPEWALK_SCHEDULER_RETRY_S="0.5")
    log, producer = shard_tests.Log(cfg, registry), EventProducer(cfg, registry, "test")
    hands = shard_tests.Hands(producer)
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    gone: list[tuple[str, bytes]] = []
    tombs = EventConsumer(cfg, registry, [topics.name("state.jobs")], name="test-tombstones",
                          on_tombstone=lambda topic, key: gone.append((topic, key)))
    reader = StateReader(cfg, registry, "jobs")
    try:
        producer.send(shard_tests.entitlement("e1"))
        producer.send(shard_tests.submit("e1", "j1", 2))
        producer.send(shard_tests.submit("e1", "keep", 1))
        producer.flush()
        shard_tests.run_until(log, hands, lambda: shard_tests.all_running(log, {"j1": 2, "keep": 1}), 90,
                              "j1 and keep running", [w1])
        first = log.of("AllocationRequested", job_id="j1")[0].payload["request_id"]
        _stop_and_free(log, hands, producer, "j1", w1)
        reader.catch_up()

        deadline = time.monotonic() + 60
        while (topics.name("state.jobs"), b"j1") not in gone:  # the timer, its grace passed
            assert time.monotonic() < deadline, f"no tombstone for j1 on state.jobs\n{w1.tail()}"
            tombs.poll(100, 0.5)
        headers = {m.key(): m.value() for m in shard_tests._changelog(cfg, "jobs")}  # the last record per key
        assert headers.get(b'"j1"', b"") is None, "j1's header deleted (a tombstone on the table's changelog)"
        assert headers.get(b'"keep"'), "keep's header kept"
        assert "gone (their grace" in w1.log_path.read_text(errors="replace")
        reader.poll(1.0)
        assert "j1" not in reader.latest and "keep" in reader.catch_up()

        # a worker that recovers the tables from the changelogs holds no j1; the id is submitted afresh
        w1.kill()
        w2 = workers("w2", ROPEWALK_JOB_GC_S=GC_S, ROPEWALK_SCHEDULER_RETRY_S="0.5")
        again = shard_tests.submit("e1", "j1", 1)
        producer.send(again)
        producer.flush()

        def rerun() -> bool:
            s = log.latest_state().get("j1")
            return s is not None and not s["deleted"] and s["state"] == "running"

        shard_tests.run_until(log, hands, rerun, 120, "j1 running again", [w2])
        assert log.latest_state()["j1"]["incarnation"] == 1  # the old one is gone: nothing to count on from
        second = [r.payload["request_id"] for r in log.of("AllocationRequested", job_id="j1")
                  if r.payload["request_id"] != first and r.payload["place_task_ids"]]
        assert second and second[-1] == sm.request_id("j1", 1, 1, sm.incarnation_tag(again.event_id))
        assert shard_tests.all_running(log, {"keep": 1})
    finally:
        tombs.close()
        reader.close()
        log.close()
