"""The retry timer firing while a shard's tables are being recovered, on the real broker: nothing is decided on
them until the recovery is done, and nothing crashes.

Found by a 100,000-machine bench (2026-11-27, issue #25): the group rebalanced, and while the worker read its
changelogs again the retry timer loaded the tables and the worker died of ``MissingChunk`` (a job's header named a
chunk the table did not hold yet). Why a recovery shows such a mix: faust's memory store re-reads, at every
rebalance, a kept partition's changelog from where its previous recovery stopped, i.e. every value the worker wrote
since, in order, one table's topic beside the other's; a job's header goes back through its older versions, each
naming a chunk version the worker had deleted long ago and that comes back only when the chunks' topic is read that
far.

Here: one worker (retry timer every 0.1 s) holds jobs whose tasks the test's allocator always rejects, so the
timer re-asks every round and writes new versions of their headers and chunks; then a second worker joins, the
first re-reads its changelogs, and its timer fires throughout. Each worker's log says when faust read changelogs
("Restoring state from changelog topics" ... "Worker ready") and when the timer decided ("scheduler: retry:
N events"), in the order things happened in that process. Against main's shard (a log line added to its timer)
this scenario showed, in 7 runs: no crash (its recovery here reads each changelog in one batch, so a header is
never half way back), a timer decision inside the recovery in 1 of 3 runs checked for it, and in 2 runs both
workers stuck after the rebalance (a partition sought back just as faust sought it to its committed offset, then
never read again while other partitions kept the shard busy; the starvation rule of offsets.py is for that).

The second test breaks a job on the changelog (its newest chunk deleted) and starts a worker on it: main's worker
dies of ``MissingChunk``, the bench's crash, every time.

The helpers are those of tests/integration/test_scheduler_shard.py.
"""
from __future__ import annotations

import json
import re
import time

import pytest
from confluent_kafka import Producer
import test_scheduler_shard as shard_tests  # the shard tests' helpers (tests/integration is on sys.path)

from processors.scheduler import store as st
from processors.scheduler.reasons import JOB_UNREADABLE
from streams.clients import EventProducer
from streams.partitioner import partition_for

workers = shard_tests.workers  # the fixture, made visible to this module

RETRY_S = "0.1"
JOBS_PER_ENTITLEMENT = 2
TASKS = 3
CHURN = 4  # requests per job (each a new version of its header and chunk) before the second worker joins

RECOVERY_STARTS = "Restoring state from changelog topics"
REBALANCE_STARTS = "Revoking previously assigned partitions"
READY = "Worker ready"
DECIDED = re.compile(r"scheduler: retry: \d+ events")
HELD_BACK = re.compile(r"scheduler: retry round (skipped|cut short)")
BROKEN = re.compile(r"Traceback|MissingChunk|cannot be read|crashed")


def windows(lines: list[str], start: str) -> list[tuple[int, int]]:
    """(first, last) line indices of each stretch from a line containing ``start`` to the next "Worker ready" (or
    the end of the log, if the worker is not ready again yet)."""
    out, begun = [], None
    for i, line in enumerate(lines):
        if start in line and begun is None:
            begun = i
        elif READY in line and begun is not None:
            out.append((begun, i))
            begun = None
    if begun is not None:
        out.append((begun, len(lines) - 1))
    return out


def stored_jobs_broken(cfg) -> dict[str, str]:
    """Job -> what is wrong with it, for every job whose latest header on the ``jobs`` changelog names a chunk the
    ``job-chunks`` changelog does not hold at its latest (what any worker recovering the partition would read).
    Read with no worker left writing."""
    def latest(table: str) -> dict:
        values: dict = {}
        for msg in shard_tests._changelog(cfg, table):
            key = json.loads(msg.key())
            if msg.value() is None:
                values.pop(key, None)
            else:
                values[key] = json.loads(msg.value())
        return values

    headers, chunks = latest("jobs"), latest("job-chunks")
    broken = {}
    for job_id, header in headers.items():
        try:
            st.job_of(header, chunks)
        except st.MissingChunk as exc:
            broken[job_id] = str(exc)
    assert headers, "no job header on the changelog at all"
    return broken


def request_counts(log) -> dict[str, int]:
    """Job -> the AllocationRequested the scheduler sent for it so far."""
    counts: dict[str, int] = {}
    for e in log.of("AllocationRequested"):
        counts[e.payload["job_id"]] = counts.get(e.payload["job_id"], 0) + 1
    return counts


class Rejecter:
    """The allocator, refusing every placement (the tasks stay parked, the timer asks again every round)."""

    def __init__(self, producer):
        self.producer = producer

    def react(self, events) -> None:
        for e in events:
            p = e.payload
            if e.type == "AllocationRequested" and p["place_task_ids"]:
                self.producer.send(shard_tests.ev("AllocationRejected", {
                    "request_id": p["request_id"], "job_id": p["job_id"], "reason": "no_feasible_machine",
                    "message": "the test's allocator places nothing", "unplaced_task_ids": p["place_task_ids"],
                    "filter_rejections": {}}, ent=e.entitlement, entity=p["request_id"], producer="allocator"))
        self.producer.flush()


@pytest.mark.timeout(300)
def test_the_retry_timer_decides_nothing_on_tables_being_recovered(cfg, registry, workers):
    m = shard_tests
    w1 = workers("w1", ROPEWALK_SCHEDULER_RETRY_S=RETRY_S)
    log, producer = m.Log(cfg, registry), EventProducer(cfg, registry, "test")
    rejecter = Rejecter(producer)
    ents = m._entitlements(cfg.partitions, 1)  # one per partition
    jobs = [f"{ent}-job{i}" for ent in ents for i in range(JOBS_PER_ENTITLEMENT)]
    everyone = [w1]
    try:
        for ent in ents:
            producer.send(m.entitlement(ent))
        for job in jobs:
            producer.send(m.submit(job.rsplit("-job", 1)[0], job, TASKS))
        producer.flush()
        # the timer asks again and again; every ask a new version of the job in the changelogs
        m.run_until(log, rejecter, lambda: len(request_counts(log)) == len(jobs)
                    and min(request_counts(log).values()) >= CHURN, 120,
                    f"every job asked for {CHURN} times", everyone)
        mark = len(w1.log_path.read_text(errors="replace").splitlines())

        w2 = workers("w2", ROPEWALK_SCHEDULER_RETRY_S=RETRY_S)
        everyone.append(w2)

        def settled() -> bool:
            p1, p2 = w1.partitions() or set(), w2.partitions() or set()
            if not (p1 and p2 and p1 | p2 == set(range(cfg.partitions)) and not p1 & p2):
                return False
            lines1 = w1.log_path.read_text(errors="replace").splitlines()[mark:]
            lines2 = w2.log_path.read_text(errors="replace").splitlines()
            recovered = windows(lines1, RECOVERY_STARTS)
            return (bool(recovered) and READY in lines1[recovered[-1][1]]
                    and any(READY in line for line in lines2))

        m.run_until(log, rejecter, settled, 120, "the second worker in, both recovered and ready", everyone)
        # each job asked for again after both are ready: the timer decides again once the tables are whole
        after = request_counts(log)
        m.run_until(log, rejecter, lambda: all(request_counts(log)[j] >= after[j] + 2 for j in jobs), 60,
                    "every job asked for twice more by its new owner", everyone)

        for w in everyone:
            assert w.proc.poll() is None, f"{w.log_path.name} stopped:\n{w.tail(80)}"
            text = w.log_path.read_text(errors="replace")
            assert not BROKEN.search(text), f"{w.log_path.name}: {BROKEN.search(text).group(0)}\n{w.tail(80)}"
            lines = text.splitlines()
            for first, last in windows(lines, RECOVERY_STARTS):
                decided = [line for line in lines[first:last + 1] if DECIDED.search(line)]
                assert not decided, f"{w.log_path.name} decided while reading its changelogs:\n" + "\n".join(
                    lines[first:last + 1][:60])
        lines1 = w1.log_path.read_text(errors="replace").splitlines()
        held = [line for first, last in windows(lines1[mark:], REBALANCE_STARTS)
                for line in lines1[mark:][first:last + 1] if HELD_BACK.search(line)]
        recoveries = windows(lines1[mark:], RECOVERY_STARTS)
        print(f"\nw1 owns {sorted(w1.partitions())}, w2 {sorted(w2.partitions())}; w1 read its changelogs again "
              f"{len(recoveries)} time(s) (lines {recoveries}); its timer held back {len(held)} time(s) meanwhile")
        assert held, "the timer never fired during the rebalance: the test did not test what it is for"
        owners = {p: ("w1" if p in w1.partitions() else "w2") for p in range(cfg.partitions)}
        assert {owners[partition_for(ent, cfg.partitions)] for ent in ents} == {"w1", "w2"}
        # what a worker recovering any partition would read is whole: no job's header names a chunk that is gone
        # (a timer deleting "orphan" chunks on tables half recovered could delete a job's newest chunk on the log)
        w1.kill()
        w2.kill()
        assert stored_jobs_broken(cfg) == {}
    finally:
        log.close()


@pytest.mark.timeout(240)
def test_a_job_whose_chunk_is_gone_is_dead_lettered_and_the_shard_goes_on(cfg, registry, workers):
    """A job's newest chunk deleted on the changelog behind the shard's back (a store broken outside the delivery
    argument: what a timer deleting "orphans" during a recovery could do). The next worker recovers a header naming
    a chunk that is not there. It must not die (the 2026-11-27 bench's did, in the retry timer): the job is logged
    once and left alone, its timer work skipped, an intent naming it dead-lettered with reason ``job_unreadable``,
    and another job of the same entitlement, submitted after, runs."""
    m = shard_tests
    w1 = workers("w1", ROPEWALK_SCHEDULER_RETRY_S="0.5")
    log, producer = m.Log(cfg, registry), EventProducer(cfg, registry, "test")
    try:
        producer.send(m.entitlement("e1"))
        producer.send(m.submit("e1", "broken", 2))
        producer.flush()
        m.run_until(log, Rejecter(producer), lambda: len(log.of("AllocationRequested", job_id="broken")) >= 2, 60,
                    "the job's tasks parked and asked for again", [w1])
        w1.kill()
        header = [json.loads(msg.value()) for msg in m._changelog(cfg, "jobs")
                  if json.loads(msg.key()) == "broken" and msg.value() is not None][-1]
        named = st.named_keys(header)
        latest = [msg for msg in m._changelog(cfg, "job-chunks") if json.loads(msg.key()) in named][-1]
        assert latest.value() is not None
        # the tombstone, as the worker itself writes one, with the scheduler's own credentials
        p = Producer(cfg.as_principal("scheduler").kafka_conf())
        p.produce(latest.topic(), key=latest.key(), value=None, partition=latest.partition())
        assert p.flush(30) == 0
        assert stored_jobs_broken(cfg) == {"broken": stored_jobs_broken(cfg)["broken"]}

        w2 = workers("w2", ROPEWALK_SCHEDULER_RETRY_S="0.5")
        producer.send(m.resize("e1", "broken", 3))
        producer.send(m.submit("e1", "ok", 2))
        producer.flush()
        m.run_until(log, m.Hands(producer), lambda: m.all_running(log, {"ok": 2}), 90,
                    "the other job running", [w2])
        deadline = time.monotonic() + 60
        while not (dl := [d for d in m.dead_letters(cfg, registry, 1.0) if d.payload["consumer"] == "scheduler"]):
            assert time.monotonic() < deadline, "no dead letter for the intent naming the unreadable job"
        # the resize, and any answer to the job's last request the first worker had not applied yet
        assert {d.payload["reason"] for d in dl} == {JOB_UNREADABLE}
        assert all(" names jobs the shard cannot read: broken: MissingChunk" in d.payload["detail"] for d in dl)
        assert [d.payload["detail"].split(" ")[0] for d in dl if d.payload["origin_topic"].endswith(".intents")] == [
            "JobResized"]
        text = w2.log_path.read_text(errors="replace")
        assert text.count("job broken cannot be read") == 1, w2.tail(60)  # once per stored header, not per round
        assert w2.proc.poll() is None and "Traceback" not in text, w2.tail(80)
    finally:
        log.close()
