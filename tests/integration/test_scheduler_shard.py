"""The sharded scheduler on the real broker: workers are ``python -m processors.scheduler.shard`` subprocesses
(so killing one is real), and the test plays the front end, the allocator and the agents by hand.

* a job goes through submit -> AllocationRequested -> TasksAllocated -> START + JobStatePublished -> RUNNING
  reports -> ServiceDiscoveryChanged(enabled) and a "running" job;
* inputs delivered twice produce no duplicate output;
* two workers share the partitions; one is SIGKILLed mid-stream, the survivor takes its partitions over
  (tables recovered from the changelogs) and every job ends with the right tasks, none lost, none duplicated.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from infra.process import die_with_parent
from processors.scheduler.decide import PRODUCER
from processors.scheduler.offsets import PERSIST_AFTER
from processors.scheduler.shard import APP_ID, SOURCES
from streams import batches, groups
from streams.clients import EventConsumer, EventProducer
from streams.deadletter import DeadLetters
from streams.events import new_event
from streams.partitioner import partition_for
from streams.state import job_whole
from streams.topics import Topics

ROOT = Path(__file__).resolve().parents[2]
FAST_ENV = {"ROPEWALK_FAUST_SESSION_TIMEOUT": "2", "ROPEWALK_FAUST_HEARTBEAT_INTERVAL": "0.5",
            "ROPEWALK_FAUST_REBALANCE_TIMEOUT": "2", "ROPEWALK_FAUST_COMMIT_INTERVAL": "0.5",
            "ROPEWALK_SCHEDULER_RETRY_S": "30"}
ASSIGNED = re.compile(r"scheduler shard \d+: assigned partitions \[([\d, ]*)\]")


# -- workers -----------------------------------------------------------------------------------------------------

class Worker:
    def __init__(self, cfg, run_dir: Path, name: str, **env_overrides: str):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = run_dir / f"{name}.log"
        env = {**os.environ, **FAST_ENV, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers,
               "ROPEWALK_REDIS_URL": cfg.redis_url, "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix,
               "ROPEWALK_PARTITIONS": str(cfg.partitions), "ROPEWALK_RUN_DIR": str(run_dir / name), **env_overrides}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "processors.scheduler.shard"], cwd=ROOT, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent)

    def partitions(self) -> set[int] | None:
        """The partitions of the latest assignment this worker logged."""
        found = ASSIGNED.findall(self.log_path.read_text(errors="replace"))
        return {int(p) for p in found[-1].split(",") if p.strip()} if found else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture
def workers(cfg, tmp_path):
    started: list[Worker] = []

    def start(name: str, **env_overrides: str) -> Worker:
        w = Worker(cfg, tmp_path, name, **env_overrides)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


# -- the other components, by hand ------------------------------------------------------------------------------

_ids = itertools.count()


def ev(type_, payload, *, ent, entity, producer):
    return new_event(type_, payload, entitlement=ent, entity_id=entity, producer=producer,
                     event_id=f"test-{type_}-{next(_ids)}-{time.monotonic_ns()}")


def entitlement(ent):
    return ev("EntitlementCreated", {"name": ent, "quota_machines": 100, "machine_type": None, "dc_pin": None,
                                     "host_profile": None}, ent=ent, entity=ent, producer="cli")


def submit(ent, job, n):
    return ev("JobSubmitted", {"job_id": job, "name": job, "spec_version": 1, "tasks": n, "command": ["sleep", "1"],
                               "resources": {"cpu_millicores": 100, "memory_mib": 64}, "requirements": {},
                               "spread": "msb", "max_unavailable": 1, "env": {}},
              ent=ent, entity=job, producer="cli")


def resize(ent, job, n):
    return ev("JobResized", {"job_id": job, "tasks": n}, ent=ent, entity=job, producer="cli")


def machine_down(ent, machine):
    return ev("MachineStatusChanged", {"machine_id": machine, "status": "DOWN", "previous_status": "UP",
                                       "reason": "test"}, ent=ent, entity=machine, producer="resourcebroker")


def allocated(req, placements: dict[str, str]):
    p = req.payload
    return ev("TasksAllocated", {
        "request_id": p["request_id"], "job_id": p["job_id"],
        "placements": [{"task_id": t, "machine_id": m, "dc": "dc1", "msb": f"msb-{m}", "rack": f"rack-{m}"}
                       for t, m in placements.items()],
        "filter_rejections": {}, "fault_domain_bins": {}, "machines_added": [], "cache_hit": False,
        "commit_attempts": 1}, ent=req.entitlement, entity=p["request_id"], producer="allocator")


def report(cmd, state, exit_code=None):
    p = cmd.payload
    return ev("TaskStateChanged", {"task_id": p["task_id"], "job_id": p["job_id"], "machine_id": p["machine_id"],
                                   "state": state, "previous_state": "STARTING", "exit_code": exit_code,
                                   "spec_version": p["spec_version"], "reason": ""},
              ent=cmd.entitlement, entity=p["task_id"], producer="agent")


def singles(e):
    """A batch's items as single-item events (a command's id or a report's id as event id); else ``[e]``."""
    if e.type == "TasksCommanded":
        return batches.command_events(e)
    if e.type == "TaskStatesChanged":
        return [dataclasses.replace(e, type="TaskStateChanged", payload=r, event_id=r["report_id"])
                for r in batches.task_reports(e)]
    if e.type == batches.SERVICE_DISCOVERY_UPDATED:
        return [dataclasses.replace(e, type="ServiceDiscoveryChanged", payload=c, event_id=f"{e.event_id}#{i}")
                for i, c in enumerate(batches.discovery_changes(e))]
    return [e]


def agent_batch(rows):
    """An agent process's TaskStatesChanged for (command event, state, exit code) rows (one entitlement)."""
    reports = [report(cmd, state, exit_code) for cmd, state, exit_code in rows]
    return batches.batch_reports(reports, producer="agent/test", timestamp_ms=int(time.time() * 1000))


class Log:
    """Everything the scheduler produced, read back (no consumer group: every partition from the start)."""

    def __init__(self, cfg, registry, dead_letters=None):
        t = Topics(cfg.topic_prefix, cfg.partitions)
        self.consumer = EventConsumer(cfg, registry, [t.name("allocations"), t.name("tasks"), t.name("state.jobs"),
                                                      t.name("state.tasks")], name="test-reader",
                                      dead_letters=dead_letters)
        self.records = []  # scheduler outputs in arrival order (redeliveries included)
        self.seen: set[str] = set()

    def poll(self, timeout_s: float = 0.2) -> list:
        """New scheduler events (first copy of each event id only)."""
        new = []
        for rec in self.consumer.poll(2000, timeout_s):
            if rec.event.producer != PRODUCER:
                continue
            self.records.append(rec)
            if rec.event.event_id not in self.seen:
                self.seen.add(rec.event.event_id)
                new.append(rec.event)
        return new

    def of(self, type_, **payload):
        """The scheduler's events of ``type_`` whose payload has these values, each once; TaskCommanded,
        TaskStateChanged and ServiceDiscoveryChanged include the items of its batches (TasksCommanded,
        TaskStatesChanged, ServiceDiscoveryUpdated) as such events."""
        out, ids = [], set()
        for r in self.records:
            for e in singles(r.event):
                if (e.type == type_ and e.event_id not in ids
                        and all(e.payload.get(k) == v for k, v in payload.items())):
                    ids.add(e.event_id)
                    out.append(e)
        return out

    def latest_state(self) -> dict[str, dict]:
        """The latest JobStatePublished per job, with its tasks (from its JobTasksPublished parts if it has any)."""
        heads, parts = {}, defaultdict(dict)
        for r in self.records:
            p = r.event.payload
            if r.event.type == "JobStatePublished":
                heads[p["job_id"]] = r.event
            elif r.event.type == "JobTasksPublished":
                parts[p["job_id"]][p["part"]] = p["tasks"]
        return {job: job_whole(h, parts[job]).payload for job, h in heads.items()}

    def read_to_end(self, timeout_s: float = 20.0) -> None:
        """Read until every partition of its topics is read up to the high watermark it has now."""
        targets = self.consumer.high_watermarks(self.consumer.partitions())
        deadline = time.monotonic() + timeout_s
        while not self.consumer.read_up_to(targets, {}):
            assert time.monotonic() < deadline, "the test's reader did not reach the end of the log"
            self.poll(0.2)

    def drained(self, cfg, timeout_s: float = 30.0) -> None:
        """The marker that nothing else will come: the scheduler's group committed every source partition to its
        end (a batch's output is flushed before its records are acked, and its own echoes are read and committed
        too), then this reader reads the log to its end. Instead of a sleep, which passes when an unwanted event
        is merely slow."""
        t = Topics(cfg.topic_prefix, cfg.partitions)
        sources = [t.name(n) for n in SOURCES]
        deadline = time.monotonic() + timeout_s
        while groups.lag(cfg, cfg.topic_prefix + APP_ID, sources) > 0:
            assert time.monotonic() < deadline, "the scheduler did not commit every source to its end"
            self.poll(0.2)
        self.read_to_end()

    def close(self):
        self.consumer.close()


class Hands:
    """The allocator and the agents: answer each AllocationRequested (placing on fresh machines) and each
    TaskCommanded once per event id, as a well-behaved component would."""

    def __init__(self, producer: EventProducer):
        self.producer = producer
        self.machines = itertools.count(1)
        self.placements: dict[str, list[str]] = defaultdict(list)  # task -> machines it was placed on, in order

    def react(self, events) -> None:
        """Allocate; run the commands of each TasksCommanded and report them as an agent process does (one
        TaskStatesChanged for the batch's commands)."""
        for e in events:
            p = e.payload
            if e.type == "AllocationRequested" and p["place_task_ids"]:
                where = {t: f"m{next(self.machines)}" for t in p["place_task_ids"]}
                for t, m in where.items():
                    self.placements[t].append(m)
                self.producer.send(allocated(e, where))
            elif e.type in ("TaskCommanded", "TasksCommanded"):
                rows = []
                for cmd in batches.command_events(e):
                    if cmd.payload["command"] in ("START", "RESTART"):
                        rows += [(cmd, "STARTING", None), (cmd, "RUNNING", None)]
                    else:
                        rows.append((cmd, "STOPPED", 0))
                for b in agent_batch(rows):
                    self.producer.send(b)
        self.producer.flush()


def run_until(log: Log, hands: Hands | None, done, timeout_s: float, what: str, workers=()):
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {w.log_path.name}\n{w.tail()}" for w in workers)
            states = "\n".join(f"{j}: {s['state']} {[(t['task_id'], t['state'], t['machine_id']) for t in s['tasks']]}"
                               for j, s in sorted(log.latest_state().items()))
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{states}\n{tails}")
        new = log.poll()
        if hands is not None:
            hands.react(new)


def first_request(log: Log, producer: EventProducer, worker) -> object:
    """Entitlement e1 and job j1 (2 tasks) submitted: the scheduler's one AllocationRequested for it."""
    producer.send(entitlement("e1"))
    producer.send(submit("e1", "j1", 2))
    producer.flush()
    run_until(log, None, lambda: log.of("AllocationRequested", job_id="j1"), 40, "AllocationRequested", [worker])
    [req] = log.of("AllocationRequested", job_id="j1")
    return req


def all_running(log: Log, jobs: dict[str, int], down: set[str] = frozenset()) -> bool:
    latest = log.latest_state()
    for job, n in jobs.items():
        s = latest.get(job)
        if s is None or s["state"] != "running" or len(s["tasks"]) != n:
            return False
        if any(t["state"] != "RUNNING" or t["machine_id"] in down for t in s["tasks"]):
            return False
    return True


# -- (1) one job through its lifecycle ----------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_a_job_is_allocated_started_and_enabled(cfg, registry, workers):
    w = workers("w1")
    log, producer = Log(cfg, registry), EventProducer(cfg, registry, "test")
    try:
        req = first_request(log, producer, w)
        assert req.payload["place_task_ids"] == ["j1/0", "j1/1"] and req.entitlement == "e1"

        producer.send(allocated(req, {"j1/0": "m1", "j1/1": "m2"}))
        producer.flush()
        run_until(log, None, lambda: len(log.of("TaskCommanded", command="START")) == 2, 20, "two STARTs", [w])
        starts = {e.payload["task_id"]: e.payload["machine_id"] for e in log.of("TaskCommanded", command="START")}
        assert starts == {"j1/0": "m1", "j1/1": "m2"}
        run_until(log, None, lambda: any(t["state"] == "STARTING" for t in log.latest_state().get("j1", {})
                                         .get("tasks", [])), 10, "a JobStatePublished after START", [w])

        for cmd in log.of("TaskCommanded", command="START"):
            producer.send(report(cmd, "STARTING"))
            producer.send(report(cmd, "RUNNING"))
        producer.flush()
        run_until(log, None, lambda: all_running(log, {"j1": 2}), 20, "the job running", [w])
        enabled = log.of("ServiceDiscoveryChanged", enabled=True)
        assert sorted(e.payload["task_id"] for e in enabled) == ["j1/0", "j1/1"]
        assert all(e.entitlement == "e1" for e in log.of("TaskCommanded"))
    finally:
        log.close()


# -- (2) an event delivered twice -----------------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_events_delivered_twice_produce_no_duplicate_output(cfg, registry, workers):
    w = workers("w1")
    log, producer = Log(cfg, registry), EventProducer(cfg, registry, "test")
    try:
        ent, sub = entitlement("e1"), submit("e1", "j1", 2)
        for e in (ent, sub, ent, sub):
            producer.send(e)
        producer.flush()
        run_until(log, None, lambda: log.of("AllocationRequested", job_id="j1"), 40, "AllocationRequested", [w])
        [req] = log.of("AllocationRequested", job_id="j1")
        result = allocated(req, {"j1/0": "m1", "j1/1": "m2"})
        producer.send(result)
        producer.send(result)
        producer.flush()
        run_until(log, None, lambda: len(log.of("TaskCommanded", command="START")) == 2, 20, "two STARTs", [w])
        for cmd in log.of("TaskCommanded", command="START"):
            for e in (report(cmd, "STARTING"), report(cmd, "RUNNING")):
                producer.send(e)
                producer.send(e)
        # a marker job behind the duplicates: once it is answered, every duplicate was processed
        producer.send(submit("e1", "marker", 1))
        producer.flush()
        run_until(log, None, lambda: all_running(log, {"j1": 2}) and log.of("AllocationRequested", job_id="marker"),
                  30, "the job running and the marker", [w])
        log.drained(cfg)  # the marker job is on another topic than the duplicate reports: not proof enough

        ids = Counter(r.event.event_id for r in log.records)
        assert not [i for i, n in ids.items() if n > 1], "an output event was produced twice"
        assert len(log.of("AllocationRequested", job_id="j1")) == 1
        assert len(log.of("TaskCommanded", command="START")) == 2
        assert len(log.of("ServiceDiscoveryChanged", enabled=True)) == 2
    finally:
        log.close()


# -- the retry timer ---------------------------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_the_timer_asks_again_for_rejected_tasks(cfg, registry, workers):
    w = workers("w1", ROPEWALK_SCHEDULER_RETRY_S="1")
    log, producer = Log(cfg, registry), EventProducer(cfg, registry, "test")
    try:
        req = first_request(log, producer, w)
        producer.send(ev("AllocationRejected", {
            "request_id": req.payload["request_id"], "job_id": "j1", "reason": "no_feasible_machine",
            "message": "none fits", "unplaced_task_ids": ["j1/0", "j1/1"], "filter_rejections": {}},
            ent="e1", entity=req.payload["request_id"], producer="allocator"))
        producer.flush()
        run_until(log, None, lambda: len(log.of("AllocationRequested", job_id="j1")) == 2, 20, "a retry", [w])
        retry = log.of("AllocationRequested", job_id="j1")[1]
        assert retry.payload["place_task_ids"] == ["j1/0", "j1/1"]
        assert retry.payload["request_id"] != req.payload["request_id"]
        time.sleep(2.5)  # two more ticks of the 1 s timer (a passage of time, what is tested): they do not ask again
        log.drained(cfg)
        assert len(log.of("AllocationRequested", job_id="j1")) == 2
    finally:
        log.close()


# -- (3) two workers, one killed mid-stream ---------------------------------------------------------------------------

def _committed(cfg) -> dict:
    t = Topics(cfg.topic_prefix, cfg.partitions)
    c = Consumer({**cfg.kafka_conf(), "group.id": cfg.topic_prefix + "scheduler"})
    try:
        tps = [TopicPartition(t.name(n), p) for n in ("intents", "machines") for p in range(cfg.partitions)]
        return {f"{tp.topic.rsplit('.', 1)[-1]}[{tp.partition}]": (tp.offset, c.get_watermark_offsets(tp, timeout=5))
                for tp in c.committed(tps, timeout=10)}
    finally:
        c.close()


def _entitlements(partitions: int, per_partition: int) -> list[str]:
    by_p: dict[int, list[str]] = defaultdict(list)
    for i in itertools.count():
        name = f"ent{i}"
        p = partition_for(name, partitions)
        if len(by_p[p]) < per_partition:
            by_p[p].append(name)
        if all(len(by_p[q]) == per_partition for q in range(partitions)):
            return sorted(n for names in by_p.values() for n in names)


# -- (4) own echoes and bad records -----------------------------------------------------------------------------------

def dead_letters(cfg, registry, timeout_s=5.0) -> list:
    c = EventConsumer(cfg, registry, [Topics(cfg.topic_prefix, cfg.partitions).name("deadletter")], name="test-dl")
    try:
        out, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out += [r.event for r in c.poll(100, 0.2)]
        return out
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_own_echoes_are_passed_over_undecoded_and_bad_records_dead_lettered(cfg, registry, workers):
    """Bytes that are no event at all, on ``intents`` and on ``tasks``: with the record header producer=scheduler
    the shard passes over them without decoding (no dead letter); without it they are decoded, fail, and are
    dead-lettered with their reason; the shard goes on either way."""
    w = workers("w1")
    producer = EventProducer(cfg, registry, "test")
    log = Log(cfg, registry, DeadLetters(producer, "test-reader"))  # the garbage is the test reader's too
    t = Topics(cfg.topic_prefix, cfg.partitions)
    try:
        producer.send(entitlement("e1"))
        producer.send_raw(t.name("intents"), b"e1", b"not an event: own", headers=[("producer", b"scheduler")])
        producer.send_raw(t.name("tasks"), b"e1", b"not an event: own", headers=[("producer", b"scheduler")])
        producer.send_raw(t.name("tasks"), b"e1", b"not an event: an agent's broken batch",
                          headers=[("producer", b"agent/simulated")])
        producer.send(submit("e1", "j1", 2))
        producer.flush()
        hands = Hands(producer)
        run_until(log, hands, lambda: all_running(log, {"j1": 2}), 60, "the job running after the bad records", [w])
        dl = [d for d in dead_letters(cfg, registry) if d.payload["consumer"] == PRODUCER]  # the shard's
        assert [(d.payload["origin_topic"], d.payload["reason"]) for d in dl] == [(t.name("tasks"), "no_marker")]
        # the scheduler's own real events were passed over by their header too: none of them was decided on
        assert "failed" not in w.tail(200)
    finally:
        log.close()


# -- (5) a job stored in chunks survives its worker ---------------------------------------------------------------------

def _changelog(cfg, table: str, idle_polls: int = 5) -> list:
    """Every record of the shard's changelog of ``table`` (faust: <app id>-<table name>-changelog), from the start,
    until ``idle_polls`` polls of 0.5 s bring nothing."""
    topic = f"{cfg.topic_prefix}scheduler-scheduler-{table}-changelog"
    c = Consumer({**cfg.kafka_conf(), "group.id": f"test-{table}", "enable.auto.commit": False})
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(cfg.partitions)])
        out, idle = [], 0
        while idle < idle_polls:
            msgs = c.consume(1000, 0.5)
            idle = 0 if msgs else idle + 1
            out += [m for m in msgs if m.error() is None]
        return out
    finally:
        c.close()


def _changelog_sizes(cfg, table: str) -> list[int]:
    return [len(m.value() or b"") for m in _changelog(cfg, table)]


@pytest.mark.timeout(240)
def test_a_big_job_in_chunks_is_recovered_whole_by_the_next_worker(cfg, registry, workers):
    n = 1_200
    w1 = workers("w1")
    log, producer = Log(cfg, registry), EventProducer(cfg, registry, "test")
    hands = Hands(producer)
    try:
        producer.send(entitlement("e1"))
        producer.send(submit("e1", "big", n))
        producer.flush()
        run_until(log, hands, lambda: all_running(log, {"big": n}), 120, f"{n} tasks running", [w1])
        machines = {t["task_id"]: t["machine_id"] for t in log.latest_state()["big"]["tasks"]}
        jobs = _changelog_sizes(cfg, "jobs")
        chunks = _changelog_sizes(cfg, "job-chunks")
        assert jobs and chunks and max(chunks) < 200_000 and max(jobs) < 200_000  # whole: ~580 KB, per event
        w1.kill()
        w2 = workers("w2")
        producer.send(resize("e1", "big", n + 100))
        producer.flush()
        run_until(log, hands, lambda: all_running(log, {"big": n + 100}), 120, f"{n + 100} tasks running", [w2])
        after = {t["task_id"]: t["machine_id"] for t in log.latest_state()["big"]["tasks"]}
        assert {k: after[k] for k in machines} == machines  # every task the first worker ran, where it ran
        assert len(log.of("AllocationRequested", job_id="big")) == 2  # the submit's and the resize's, no other
    finally:
        log.close()


# -- (6) an output the broker refuses for ever does not stop the shard ---------------------------------------------

@pytest.mark.timeout(180)
def test_an_output_the_broker_refuses_is_dead_lettered_and_the_shard_goes_on(cfg, registry, workers):
    """``allocations`` accepts records of at most 20,000 bytes here: a 5,000-task job's AllocationRequested is
    refused by the broker (MSG_SIZE_TOO_LARGE), every time. The shard decides the batch's records again one at a
    time and dead-letters the JobSubmitted whose output is refused twice; another entitlement's job, submitted right
    after it (in the same batch or the next), runs, and the shard goes on deciding."""
    t = Topics(cfg.topic_prefix, cfg.partitions)
    admin = AdminClient({**cfg.kafka_conf()})
    res = ConfigResource("topic", t.name("allocations"), incremental_configs=[
        ConfigEntry("max.message.bytes", "20000", incremental_operation=AlterConfigOpType.SET)])
    for fut in admin.incremental_alter_configs([res]).values():
        fut.result(30)
    w = workers("w1")
    producer = EventProducer(cfg, registry, "test")
    log, hands = Log(cfg, registry), Hands(producer)
    try:
        ents = _entitlements(cfg.partitions, 1)
        big_ent, small_ent = ents[0], ents[1]  # on two partitions: the small one is not in the big one's batches
        producer.send(entitlement(big_ent))
        producer.send(entitlement(small_ent))
        big = submit(big_ent, "big", 5_000)
        producer.send(big)
        producer.flush()
        time.sleep(1.0)
        producer.send(submit(small_ent, "small", 2))
        producer.flush()
        run_until(log, hands, lambda: all_running(log, {"small": 2}), 90, "the other job running", [w])
        deadline = time.monotonic() + 60
        while True:
            dl = [d for d in dead_letters(cfg, registry, 1.0) if d.payload["consumer"] == PRODUCER]
            if dl or time.monotonic() > deadline:
                break
        assert [(d.payload["origin_topic"], d.payload["reason"]) for d in dl] == [(t.name("intents"), "processing_failed")]
        assert dl[0].payload["detail"].startswith("JobSubmitted: output not taken by the broker")
        assert "Message size too large" in dl[0].payload["detail"]
        assert w.proc.poll() is None, "the shard must not have stopped"
        producer.send(resize(small_ent, "small", 3))  # and it still decides
        producer.flush()
        run_until(log, hands, lambda: all_running(log, {"small": 3}), 60, "the resize", [w])
    finally:
        log.close()


# -- (7) a registration passed over is remembered: a rebalance does not read it again ------------------------------

def _stored_offsets(cfg) -> dict[str, int]:
    """The shard's offsets table as its changelog holds it: "<topic>/<partition>" -> the next offset to apply."""
    return {json.loads(m.key()): json.loads(m.value()) for m in _changelog(cfg, "offsets", idle_polls=3)
            if m.value() is not None}


@pytest.mark.timeout(180)
def test_a_registration_passed_over_stores_its_offsets(cfg, registry, workers):
    """MachineRegistered records are passed over undecoded (``decide`` ignores them), so no batch of them changes
    state; the shard still stores their offsets every PERSIST_AFTER records. At a million machines it did not, and
    a rebalance sent the shard back to offset 0 of a 450,000-record partition (the 2026-11-26 bench run)."""
    n = PERSIST_AFTER + 500
    w1 = workers("w1")
    producer = EventProducer(cfg, registry, "test")
    for i in range(n):
        producer.send(new_event("MachineRegistered", {
            "machine_id": f"m{i}", "topology": {"region": "reg1", "dc": "dc1", "msb": "msb1", "rack": "msb1-r1"},
            "machine_type": "skylake", "capacity": {"cpu_millicores": 32_000, "memory_mib": 65_536},
            "host_profile": None}, entitlement="free/dc1", entity_id=f"m{i}", producer="test"))
    # Registrations only: a record that changes state, sent after them on another topic, may be fetched while the
    # shard is still reading them (records of all partitions come in one fetch, FetchBatches), and its decision then
    # stores the offsets reached so far, after which fewer than PERSIST_AFTER are left to pass over: the offsets are
    # then stored as the rule says (never PERSIST_AFTER behind), but this test would no longer see a batch of only
    # passed-over records store them.
    producer.flush()
    key = f"{Topics(cfg.topic_prefix, cfg.partitions).name('machines')}/{partition_for('free/dc1', cfg.partitions)}"
    deadline = time.monotonic() + 90
    while (stored := _stored_offsets(cfg).get(key, 0)) < PERSIST_AFTER and time.monotonic() < deadline:
        assert w1.proc.poll() is None, w1.tail()
        time.sleep(1)
    assert PERSIST_AFTER <= stored <= n, f"{key}: stored {stored}"
