"""The agents on the real broker: the process agent runs, restarts, stops and re-adopts real processes and
keeps its tasks running while the broker is away; the simulated agents stand for 10,000 machines."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from infra import acls, services
from infra.config import PROJECT_ROOT, Config
from infra.process import FAILPOINT_EXIT, die_with_parent, free_ports, pid_alive, port_open
from infra.trust import write_machine_key
from processors.agent import decide as d
from processors.agent import isolation as iso
from processors.agent.decide import REASON_NOT_PLACED
from processors.agent.hostprofile import REASON_WAITING_FOR_PROFILE
from processors.agent.process import FAILPOINT_ENV, ProcessAgent, task_dir
from processors.agent.simulated import SimulatedAgents
from processors.sidekick.catalogue import PROFILES
from streams import batches
from streams.clients import EventConsumer, EventProducer
from streams.events import new_event
from streams.topics import Topics, provision

PY = sys.executable


# -- helpers -------------------------------------------------------------------------------------------------------

def command(task_id, cmd, machine, argv=(), job="j1", spec=1, entitlement="e1"):
    return new_event("TaskCommanded", {"task_id": task_id, "job_id": job, "machine_id": machine, "command": cmd,
                                       "argv": list(argv), "env": {"ROPEWALK_TEST": "1"}, "spec_version": spec,
                                       "reason": "test"},
                     entitlement=entitlement, entity_id=task_id, producer="scheduler")


def allocated(job, placements, entitlement="e1"):
    """The allocator's TasksAllocated placing ``placements`` ({task: machine}) of ``job``: an agent starts only tasks
    the allocations log placed on its machine (processors/agent/gate.py)."""
    return new_event("TasksAllocated", {
        "request_id": f"{job}:r1", "job_id": job, "filter_rejections": {}, "fault_domain_bins": {},
        "machines_added": [], "cache_hit": False, "commit_attempts": 1,
        "placements": [{"task_id": t, "machine_id": m, "dc": "dc1", "msb": "msb1", "rack": "r1"}
                       for t, m in placements.items()]}, entitlement=entitlement, entity_id=job, producer="allocator")


def send(cfg, registry, *events):
    p = EventProducer(cfg, registry, "test")
    for ev in events:
        p.send(ev)
    p.flush()


def singles(e):
    """An agent's TaskStatesChanged as its reports, each a TaskStateChanged (its report id as event id)."""
    if e.type != "TaskStatesChanged":
        return [e]
    return [dataclasses.replace(e, type="TaskStateChanged", payload=r, event_id=r["report_id"])
            for r in batches.task_reports(e)]


class Reader:
    """Follows a topic from the beginning and keeps every event (a batch of reports as its reports); ``types``
    counts the records as they are on the log."""

    def __init__(self, cfg, registry, logical):
        self.consumer = EventConsumer(cfg, registry, [Topics(cfg.topic_prefix, cfg.partitions).name(logical)],
                                      name="test-reader")
        self.events = []
        self.types = Counter()
        self.at: dict[str, tuple[str, int, int]] = {}  # event id -> (topic, partition, offset) of its record

    def poll(self, n, timeout_s):
        recs = self.consumer.poll(n, timeout_s)
        self.types.update(r.event.type for r in recs)
        self.at.update((r.event.event_id, (r.topic, r.partition, r.offset)) for r in recs)
        return [x for r in recs for x in singles(r.event)]

    def until(self, pred, timeout_s, what):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.events += self.poll(5000, 0.2)
            if pred(self.events):
                return self.events
        seen = [(e.type, e.payload.get("task_id"), e.payload.get("state"), e.payload.get("exit_code"),
                 e.payload.get("reason")) for e in self.events]
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; saw {seen[-20:]}")

    def close(self):
        self.consumer.close()


def reports(events, task_id):
    return [(e.payload["state"], e.payload["exit_code"]) for e in events
            if e.type == "TaskStateChanged" and e.payload["task_id"] == task_id]


def env_of(cfg: Config) -> dict:
    return {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix,
            "ROPEWALK_PARTITIONS": str(cfg.partitions), "ROPEWALK_RUN_DIR": str(cfg.run_dir),
            "ROPEWALK_SECRETS_DIR": str(cfg.secrets), "PYTHONPATH": str(PROJECT_ROOT)}


class Agents:
    """Process agents started by a test, and the task processes they ran: all killed at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.procs: list[subprocess.Popen] = []
        self.work_dirs: set[Path] = set()

    def start(self, cfg, machine, work_dir=None, *extra, env=None):
        write_machine_key(cfg.secrets, machine)  # the machine's own key, as the operator gives it (infra/trust.py)
        work = Path(work_dir or self.tmp / machine)
        self.work_dirs.add(work)
        work.mkdir(parents=True, exist_ok=True)
        out = open(work / "agent.out", "ab")
        p = subprocess.Popen([PY, "-m", "processors.agent.process", "--machine-id", machine, "--work-dir", str(work),
                              "--tick-ms", "200", "--backoff-ms", "100", "--max-restarts", "2",
                              "--stop-grace-ms", "2000", *extra], env={**env_of(cfg), **(env or {})},
                             cwd=PROJECT_ROOT,
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=die_with_parent)
        self.procs.append(p)
        return p

    def start_running(self, cfg, registry, tasks: "Reader", machine: str, task_id: str, env=None):
        """An agent for ``machine`` running ``task_id`` (``sleep 600``), RUNNING as ``tasks`` reads it: (agent, pid)."""
        agent = self.start(cfg, machine, env=env)
        send(cfg, registry, allocated(task_id.split("/")[0], {task_id: machine}),
             command(task_id, "START", machine, ["sleep", "600"]))
        tasks.until(lambda evs: ("RUNNING", None) in reports(evs, task_id), 30, "RUNNING")
        pid = self.task_pid(self.tmp / machine, task_id)
        assert pid and pid_alive(pid)
        return agent, pid

    @staticmethod
    def task_pid(work_dir: Path, task_id: str) -> int | None:
        try:
            doc = json.loads((work_dir / "agent-state.json").read_text())
        except (OSError, ValueError):
            return None
        pr = doc.get("procs", {}).get(task_id)
        return pr and pr["pid"]

    def cleanup(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(5)
        for work in self.work_dirs:
            try:
                doc = json.loads((work / "agent-state.json").read_text())
            except (OSError, ValueError):
                continue
            for pr in doc.get("procs", {}).values():
                try:
                    os.killpg(pr["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            release_uids(doc)


def release_uids(doc: dict) -> None:
    """The uids a (killed) agent's state holds, handed back as the agent would: their processes killed, their
    host-wide leases removed (processors/agent/isolation.py)."""
    leases = Path(os.environ.get(iso.LEASES_ENV) or iso.DEFAULT_LEASES)
    for uid in (doc.get(iso.OWNER_UIDS_KEY) or {}).values():
        iso.kill_uid(uid)
        (leases / str(uid)).unlink(missing_ok=True)


@pytest.fixture
def agents(tmp_path):
    a = Agents(tmp_path)
    yield a
    a.cleanup()


def wait_for(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def agent_state(work_dir: Path) -> dict:
    """The process agent's state file (written atomically: never half a document)."""
    return json.loads((work_dir / "agent-state.json").read_text())


def agent_settled(cfg, registry, tasks: Reader, work_dir: Path, ticks: int = 2, timeout_s: float = 30) -> None:
    """The marker that the process agent of ``work_dir`` has acted on everything sent before, instead of a sleep
    (which passes when the unwanted act is merely slow): a command for a machine that is not its own is sent now;
    the agent's saved offsets pass it (offsets are saved with the state their records made: spawns and kills
    done, reports handed over), then it ticks ``ticks`` times more (a restart whose backoff elapsed is spawned
    at a tick)."""
    marker = command("j1/marker", "STOP", "m-nobody")
    send(cfg, registry, marker)
    tasks.until(lambda evs: marker.event_id in tasks.at, timeout_s, "the marker on the log")
    topic, partition, offset = tasks.at[marker.event_id]
    wait_for(lambda: any((t, p) == (topic, partition) and o > offset for t, p, o in agent_state(work_dir)["offsets"]),
             timeout_s, "the agent past the marker")
    seq = agent_state(work_dir)["sequence"]
    wait_for(lambda: agent_state(work_dir)["sequence"] >= seq + ticks, timeout_s, f"{ticks} more ticks")


# -- (a) real commands -----------------------------------------------------------------------------------------

def test_process_agent_runs_restarts_fails_and_stops(cfg, registry, agents):
    m = "m-a"
    agent = agents.start(cfg, m)
    send(cfg, registry, allocated("j1", {"j1/crash": m, "j1/sleep": m}),
         command("j1/crash", "START", m, ["sh", "-c", "exit 3"]),
         command("j1/sleep", "START", m, ["sleep", "30"]))
    tasks = Reader(cfg, registry, "tasks")
    try:
        ev = tasks.until(lambda evs: (FAILED_3 in reports(evs, "j1/crash")
                                      and ("RUNNING", None) in reports(evs, "j1/sleep")), 30, "FAILED 3 and RUNNING")
        # STARTING then RUNNING, then after the local restarts (silent) FAILED with the exit code, once.
        assert reports(ev, "j1/crash")[-1] == FAILED_3 and reports(ev, "j1/crash").count(FAILED_3) == 1
        assert reports(ev, "j1/crash")[0] == ("STARTING", None)
        assert reports(ev, "j1/sleep") == [("STARTING", None), ("RUNNING", None)]
        crash_log = (agents.tmp / m / "logs" / "j1_crash.log").read_text()
        assert crash_log.count("spawn") == 3, crash_log  # the first run and two restarts
        pid = agents.task_pid(agents.tmp / m, "j1/sleep")
        assert pid and pid_alive(pid)
        assert open(f"/proc/{pid}/environ", "rb").read().count(b"ROPEWALK_TEST=1") == 1

        send(cfg, registry, command("j1/sleep", "STOP", m))
        tasks.until(lambda evs: any(s == "STOPPED" for s, _ in reports(evs, "j1/sleep")), 20, "STOPPED")
        assert reports(tasks.events, "j1/sleep")[-1] == ("STOPPED", killed_code(agents.tmp / m, signal.SIGTERM))
        wait_for(lambda: not pid_alive(pid), 5, f"pid {pid} gone")
        assert agent.poll() is None
    finally:
        tasks.close()


FAILED_3 = ("FAILED", 3)


def killed_code(work_dir: Path, sig: int) -> int:
    """The exit code a task killed by ``sig`` is reported with: -sig, or 128 + sig in the sandbox (bwrap's init
    reports it as a shell does: processors/agent/isolation.py)."""
    return 128 + sig if agent_state(work_dir).get("sandbox") == "bwrap" else -sig


def test_process_agent_applies_the_host_profile_before_the_start(cfg, registry, agents):
    """A START naming host profile ``web`` waits while the machine has the default one; Sidekick's request is applied
    by writing ``host-profile.json`` (the visible setting), answered HostProfileApplied on ``machines``, and only then
    is the task started (issue 16)."""
    m = "m-hp"
    agents.start(cfg, m)
    start = command("j1/web", "START", m, ["sleep", "30"])
    start = dataclasses.replace(start, payload={**start.payload, "host_profile": "web"})
    send(cfg, registry, allocated("j1", {"j1/web": m}), start)
    state = agents.tmp / m / "agent-state.json"
    wait_for(lambda: state.exists() and [c["task_id"] for c in json.loads(state.read_text())["host"]["held"]]
             == ["j1/web"], 30, "the START held for its profile")
    assert not (agents.tmp / m / "host-profile.json").exists()
    settings = dict(PROFILES["web"].settings)
    send(cfg, registry, new_event("HostProfileRequested", {
        "request_id": f"{m}@v1:web", "machine_id": m, "host_profile": "web", "previous_host_profile": "",
        "settings": settings}, entitlement="e1", entity_id=m, producer="sidekick"))
    tasks, machines = Reader(cfg, registry, "tasks"), Reader(cfg, registry, "machines")
    try:
        ev = tasks.until(lambda evs: ("RUNNING", None) in reports(evs, "j1/web"), 30, "j1/web RUNNING")
        (applied,) = [e for e in machines.until(lambda evs: any(e.type == "HostProfileApplied" for e in evs), 30,
                                                 "HostProfileApplied") if e.type == "HostProfileApplied"]
        assert (applied.payload["machine_id"], applied.payload["host_profile"]) == (m, "web")
        written = json.loads((agents.tmp / m / "host-profile.json").read_text())
        assert (written["host_profile"], written["settings"]) == ("web", settings)
        held, starting = [e for e in ev if e.type == "TaskStateChanged" and e.payload["task_id"] == "j1/web"][:2]
        assert (held.payload["state"], held.payload["reason"]) == ("STARTING", REASON_WAITING_FOR_PROFILE)
        assert held.timestamp_ms <= applied.timestamp_ms  # the hold is reported, the start waits
        assert starting.payload["state"] == "STARTING" and starting.payload["reason"] != REASON_WAITING_FOR_PROFILE
        assert starting.timestamp_ms >= applied.timestamp_ms
    finally:
        tasks.close()
        machines.close()


# -- (b) the broker goes away ------------------------------------------------------------------------------------

def test_tasks_keep_running_while_the_broker_is_down(tmp_path, registry, agents, infra_cfg):
    broker_port, controller_port = free_ports(2)
    own = Config.from_env({"ROPEWALK_BROKER_PORT": str(broker_port), "ROPEWALK_CONTROLLER_PORT": str(controller_port),
                           "ROPEWALK_REDIS_PORT": str(infra_cfg.redis_port), "ROPEWALK_RUN_DIR": str(tmp_path / "run"),
                           "ROPEWALK_PARTITIONS": "2", "ROPEWALK_TOPIC_PREFIX": "b."})
    assert own.broker_port != infra_cfg.broker_port and own.run_dir != infra_cfg.run_dir
    broker = services.broker(own)
    services.start_broker(own)
    try:
        provision(AdminClient({**own.kafka_conf()}), Topics(own.topic_prefix, own.partitions))
        acls.provision_region(own)
        m = "m-b"
        tasks = Reader(own, registry, "tasks")
        try:
            agent, pid = agents.start_running(own, registry, tasks, m, "j1/keep")
        finally:
            tasks.close()
        broker.stop()
        assert not port_open(own.broker_port)
        seq = agent_state(tmp_path / m)["sequence"]
        # many ticks (200 ms each) and polls against a dead broker: counted by the agent's own heartbeat sequence
        wait_for(lambda: agent.poll() is not None or agent_state(tmp_path / m)["sequence"] >= seq + 10, 60,
                 "10 ticks with the broker down")
        assert agent.poll() is None, (tmp_path / m / "agent.out").read_text()[-2000:]
        assert pid_alive(pid) and agents.task_pid(tmp_path / m, "j1/keep") == pid
        # The broker comes back (empty: the embedded broker keeps nothing across a restart, so only what the
        # agent sends afterwards can be checked): the agent's buffered producer delivers again.
        services.start_broker(own)
        provision(AdminClient({**own.kafka_conf()}), Topics(own.topic_prefix, own.partitions))
        acls.provision_region(own)
        beats = Reader(own, registry, "heartbeats")
        try:
            beats.until(lambda evs: any(e.payload["machine_id"] == m and e.payload["running_task_ids"] == ["j1/keep"]
                                        for e in evs), 60, "heartbeats after the broker came back")
        finally:
            beats.close()
        assert pid_alive(pid)
        assert agent.poll() is None
    finally:
        broker.stop()


# -- (c) the agent restarts ----------------------------------------------------------------------------------------

def test_restarted_agent_adopts_its_running_task(cfg, registry, agents):
    m = "m-c"
    tasks = Reader(cfg, registry, "tasks")
    try:
        first, pid = agents.start_running(cfg, registry, tasks, m, "j1/adopt")
        first.send_signal(signal.SIGKILL)  # a crash: no goodbye
        first.wait(5)
        assert pid_alive(pid)
        second = agents.start(cfg, m)
        agent_settled(cfg, registry, tasks, agents.tmp / m)  # it read the log again from its offsets and ticked
        assert second.poll() is None
        assert agents.task_pid(agents.tmp / m, "j1/adopt") == pid and pid_alive(pid)
        procs = subprocess.run(["pgrep", "-f", "^sleep 600$"], capture_output=True, text=True).stdout.split()
        mine = [p for p in procs if os.getpgid(int(p)) == pid] if procs else []
        assert len(mine) == 1  # one task process (in the group of its sandbox, if it has one), no duplicate
        assert (agents.tmp / m / "logs" / "j1_adopt.log").read_text().count("spawn") == 1
        # the adopted task is still controlled: STOP kills it
        send(cfg, registry, command("j1/adopt", "STOP", m))
        tasks.until(lambda evs: any(s == "STOPPED" for s, _ in reports(evs, "j1/adopt")), 20, "STOPPED")
        wait_for(lambda: not pid_alive(pid), 5, f"pid {pid} gone")
    finally:
        tasks.close()


def test_a_start_admitted_before_the_move_it_is_stale_for_is_stopped_when_the_fold_reads_the_move(cfg, registry,
                                                                                                  agents):
    """Issue 26: a scheduler shard paused past its group's session timeout wakes up stale and STARTs a task on the
    machine it was moved off, after the new owner's fence STOP; the agent, whose fold of ``allocations`` has not read
    the move yet, runs it (its fold still places the task here). Made here in that order, each step waiting on the
    agent's report: RUNNING, the fence STOP, the stale START run again, then the move read: the agent stops the task
    itself (STOPPED ``not_placed``) and its process is gone."""
    m, task = "m-s", "j1/stale"
    tasks = Reader(cfg, registry, "tasks")
    try:
        agent, pid = agents.start_running(cfg, registry, tasks, m, task)
        send(cfg, registry, command(task, "STOP", m))  # the new owner's fence, before the move is placed
        tasks.until(lambda evs: reports(evs, task)[-1][0] == "STOPPED", 20, "STOPPED by the fence")
        send(cfg, registry, command(task, "START", m, ["sleep", "600"]))  # the stale shard's START, read first
        tasks.until(lambda evs: reports(evs, task).count(("RUNNING", None)) == 2, 30, "the stale START running")
        stale = agents.task_pid(agents.tmp / m, task)
        assert stale and pid_alive(stale) and stale != pid
        send(cfg, registry, allocated("j1", {task: "m-elsewhere"}))  # the move, read late
        tasks.until(lambda evs: reports(evs, task)[-1][0] == "STOPPED", 30, "the task stopped by the agent itself")
        last = [e for e in tasks.events if e.type == "TaskStateChanged" and e.payload["task_id"] == task][-1]
        assert last.payload["reason"] == REASON_NOT_PLACED and last.payload["machine_id"] == m
        wait_for(lambda: not pid_alive(stale), 10, f"pid {stale} gone")
        assert agent.poll() is None
    finally:
        tasks.close()


def test_an_agent_killed_before_the_stop_a_move_needs_makes_it_after_its_restart(cfg, registry, agents):
    """The agent reads the move of a task it runs and saves its state (offsets past the move, the stop pending), then
    dies before the fold is final (a failpoint: ``os._exit`` there, as a SIGKILL). Restarted, it resumes past the
    move, which it never reads again: the pending stop from its state file stops the task (STOPPED ``not_placed``)."""
    m, task = "m-k", "j1/pending"
    tasks = Reader(cfg, registry, "tasks")
    try:
        agent, pid = agents.start_running(cfg, registry, tasks, m, task, env={FAILPOINT_ENV: "stop_pending"})
        send(cfg, registry, allocated("j1", {task: "m-elsewhere"}))  # the move (its new owner's fence aside)
        assert agent.wait(30) == FAILPOINT_EXIT
        assert agent_state(agents.tmp / m)["gate"]["unplacing"] == [[task, m]] and pid_alive(pid)
        again = agents.start(cfg, m)
        tasks.until(lambda evs: reports(evs, task)[-1][0] == "STOPPED", 30, "the task stopped after the restart")
        last = [e for e in tasks.events if e.type == "TaskStateChanged" and e.payload["task_id"] == task][-1]
        assert last.payload["reason"] == REASON_NOT_PLACED and last.payload["machine_id"] == m
        wait_for(lambda: not pid_alive(pid), 10, f"pid {pid} gone")
        wait_for(lambda: agent_state(agents.tmp / m)["gate"]["unplacing"] == [], 10, "no stop pending")
        assert again.poll() is None
    finally:
        tasks.close()


# -- (d) simulated agents ----------------------------------------------------------------------------------------

def test_simulated_agents_run_10000_machines(cfg, registry):
    machines = [f"sim-{i:05d}" for i in range(10_000)]
    sim = SimulatedAgents(cfg, machines, registry=registry, interval_ms=1000, start_delay_ms=100)
    sim.connect()
    placed = {f"j{t % 10}/{t}": machines[(t * 7919) % len(machines)] for t in range(1000)}  # spread, some share
    by_job = defaultdict(list)  # the scheduler's form: one TasksCommanded per job, many machines' commands in it
    for t, m in placed.items():
        by_job[t.split("/")[0]].append({"task_id": t, "machine_id": m, "command": "START", "spec_version": 1,
                                         "reason": "test"})
    send(cfg, registry, *[allocated(job, {r["task_id"]: r["machine_id"] for r in rows}, f"e{job[1]}")
                          for job, rows in sorted(by_job.items())])
    send(cfg, registry, *[new_event("TasksCommanded", {"job_id": job, "argv": ["sleep", "1"], "env": {},
                                                       "commands": rows, "part": 0, "parts": 1},
                                    entitlement=f"e{job[1]}", entity_id=job, producer="scheduler")
                          for job, rows in sorted(by_job.items())])
    tasks = Reader(cfg, registry, "tasks")
    beats = Reader(cfg, registry, "heartbeats")

    def drive(pred, reader, timeout_s, what):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sim.step(0.02)
            reader.events += reader.poll(20_000, 0.02)
            if pred(reader.events):
                return
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")

    def running(evs):
        return {e.payload["task_id"] for e in evs if e.type == "TaskStateChanged" and e.payload["state"] == "RUNNING"}

    try:
        drive(lambda evs: len(running(evs)) == 1000, tasks, 60, "1000 RUNNING")
        started = [e for e in tasks.events if e.type == "TaskStateChanged"]
        assert len([e for e in started if e.payload["state"] == "RUNNING"]) == 1000  # no duplicates
        assert all(e.payload["machine_id"] == placed[e.payload["task_id"]] for e in started)
        assert all(e.entitlement == f"e{e.payload['task_id'][1]}" for e in started)
        assert tasks.types["TaskStateChanged"] == 0 and 0 < tasks.types["TaskStatesChanged"] < len(started)  # batched

        # Heartbeats flow: every machine beats once per interval and lists its running tasks.
        drive(lambda evs: len({e.payload["machine_id"] for e in evs}) == len(machines), beats, 30, "every machine")
        victim = placed["j3/3"]
        latest = {}
        for e in beats.events:
            latest[e.payload["machine_id"]] = e
        assert "j3/3" in latest[victim].payload["running_task_ids"]

        # A simulated machine failure: its heartbeats stop, the others' go on; it reports nothing any more.
        sim.fail(victim)
        failed_at = int(time.time() * 1000)
        before = len(beats.events)
        neighbour = machines[(machines.index(victim) + 1) % len(machines)]
        drive(lambda evs: sum(1 for e in evs[before:] if e.payload["machine_id"] == neighbour) >= 2, beats, 30,
              "two more rounds")
        after = [e for e in beats.events[before:] if e.payload["machine_id"] == victim]
        assert all(e.timestamp_ms <= failed_at for e in after) and len(after) <= 1  # at most one already queued
        seqs = [e.payload["sequence"] for e in beats.events if e.payload["machine_id"] == neighbour]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

        alive = placed["j1/1"]
        assert alive != victim
        send(cfg, registry, command("j1/1", "STOP", alive, job="j1", entitlement="e1"),
             command("j3/3", "STOP", victim, job="j3", entitlement="e3"))
        drive(lambda evs: any(e.type == "TaskStateChanged" and e.payload["task_id"] == "j1/1"
                              and e.payload["state"] == "STOPPED" for e in evs), tasks, 30, "STOPPED")
        # the marker: the simulated agents read ``tasks`` to the end it has now (both STOPs), handed over what that
        # made, and the test's reader then read the topic to its end (instead of a sleep)
        ends = tasks.consumer.high_watermarks(tasks.consumer.partitions())
        deadline = time.monotonic() + 30
        while not sim.consumer.read_up_to(ends, {}):
            assert time.monotonic() < deadline, "the simulated agents did not read the STOPs"
            sim.step(0.02)
        sim.producer.flush(10)
        ends = tasks.consumer.high_watermarks(tasks.consumer.partitions())
        while not tasks.consumer.read_up_to(ends, {}):
            assert time.monotonic() < deadline, "the test's reader did not reach the end of tasks"
            tasks.events += tasks.poll(20_000, 0.2)
        assert not [e for e in tasks.events if e.type == "TaskStateChanged" and e.payload["task_id"] == "j3/3"
                    and e.payload["state"] == "STOPPED"]
        assert sim.heartbeats >= 2 * len(machines)
    finally:
        tasks.close()
        beats.close()
        sim.close()


def test_a_restarted_simulated_agents_process_beats_under_new_ids(cfg, registry, tmp_path):
    """Its state file may be a few rounds behind what a killed process beat (it is written every few seconds): the
    process that resumes from it must not beat those rounds again under the same event ids with other contents
    (the kill storm found 43 such heartbeats: one id, two different lists of running tasks)."""
    machines = [f"sim-{i}" for i in range(3)]
    state_file = tmp_path / "simulated.json"

    def beat(sim, rounds):
        deadline = time.monotonic() + 30
        start = sim._round
        while sim._round < start + rounds and time.monotonic() < deadline:
            sim.step(0.02)
        sim.producer.flush(10)

    first = SimulatedAgents(cfg, machines, registry=registry, interval_ms=200, state_file=state_file)
    first.connect()
    beat(first, 2)
    first.save()
    beat(first, 4)  # rounds the file does not know of: then the process dies (no close, no save)
    second = SimulatedAgents(cfg, machines, registry=registry, interval_ms=200, state_file=state_file)
    second.connect()
    beat(second, 4)
    beats = Reader(cfg, registry, "heartbeats")
    try:
        beats.until(lambda evs: len(evs) >= 3 * 8, 30, "the heartbeats of both processes")
    finally:
        beats.close()
        first.consumer.close()
        second.close()
    ids = [e.event_id for e in beats.events]
    assert len(set(ids)) == len(ids), [i for i, n in Counter(ids).items() if n > 1]  # every heartbeat its own event


def test_the_simulated_agents_save_their_state_only_once_what_they_sent_is_delivered(cfg, registry, tmp_path):
    """The kill storm found a job stopping for good: the agents process stopped four tasks, saved a state file that
    said so (and that the STOP commands were read), then died before the STOPPED reports it had sent reached the
    broker; restarted from that file it neither ran the tasks nor read the commands again, and nobody told the
    scheduler. A save now waits until what was sent before it is on the log; what cannot be delivered (here a producer
    whose broker does not answer: a leader's node stopped) leaves the file as it was, for a later save."""
    state_file = tmp_path / "simulated.json"
    sim = SimulatedAgents(cfg, ["sim-0"], registry=registry, interval_ms=200, state_file=state_file)
    sim.connect()
    try:
        sim.save()
        saved = state_file.read_text()
        live, away = sim.producer, EventProducer(cfg.with_(bootstrap_servers=f"127.0.0.1:{free_ports(1)[0]}"),
                                                 registry, "agent-away", signer=None)
        try:
            sim.producer = away
            away.send_raw(Topics(cfg.topic_prefix, cfg.partitions).name("tasks"), b"k", b"a report in flight")
            sim.offsets[("elsewhere", 0)] = 7  # what the state would say: the command that report answers was read
            sim._dirty = True
            sim.save()
            assert state_file.read_text() == saved  # not written: the report it depends on is not on the log
        finally:
            sim.producer = live
            away._producer.purge()  # the record that cannot be delivered (its broker is not there) is dropped
        sim.save()
        assert json.loads(state_file.read_text())["offsets"] != json.loads(saved)["offsets"]  # delivered: written
    finally:
        sim.close()


def test_the_process_agent_keeps_what_it_told_until_the_broker_has_it(cfg, registry, tmp_path):
    """The process agent saves its state at every step, before the reports of that step are delivered (its pids must
    be on disk before anything runs). Killed between the two, it restarted from a state that said "reported", and
    nobody told the scheduler. Now the state file carries every event sent and not yet confirmed (here: a producer
    whose broker does not answer), and the agent started from it sends them again, under the same ids."""
    machine = "m-flight"
    write_machine_key(cfg.secrets, machine)
    work = tmp_path / machine
    report = d.refused_start(machine, command("j7/0", "START", machine, ["true"]), "flight_test", int(time.time() * 1000))
    first = ProcessAgent(cfg, machine, work, registry=registry)
    live = first.producer
    away = EventProducer(cfg.with_(bootstrap_servers=f"127.0.0.1:{free_ports(1)[0]}"), registry, "agent-away",
                         signer=None)
    try:
        first.producer = away
        first._send(report)
        first.flush_reports()  # batched, handed to the producer: in flight, not on the log
        first.save()
        saved = agent_state(work)
        told = [e.event_id for e in (*first._in_flight, *first._unsent)]  # in flight (or not even handed over)
        assert len(saved["unsent"]) == len(told) == 1 and saved["reports"] == []
        # and two entries no agent could read (a damaged file, a schema this version does not know): passed over
        (work / "agent-state.json").write_text(json.dumps({**saved, "unsent": [*saved["unsent"], "zz",
                                                                              "c301" + "00" * 8]}))
    finally:
        first.producer = live
        away._producer.purge()  # dropped, as a killed agent's buffer is
        first.partition_map.close()
        live.flush(5)
    second = ProcessAgent(cfg, machine, work, registry=registry)  # the agent restarted from that file
    tasks = Reader(cfg, registry, "tasks")
    try:
        assert second.errors == 2 and [e.event_id for e in second._unsent] == told
        second.flush_reports()
        tasks.until(lambda evs: any(e.event_id == report.event_id for e in evs), 30, "the report sent again")
        second.save()
        assert agent_state(work)["unsent"] == []  # delivered: no longer carried
    finally:
        tasks.close()
        second.partition_map.close()
        second.producer.flush(5)


@pytest.mark.parametrize("killer", ["STOP", "RESTART", "unplaced"])
def test_what_the_simulated_agents_report_does_not_hang_on_when_a_start_ends(cfg, registry, killer):
    """A stop (or a restart, or the allocations log taking the task away) that comes while a task's simulated start
    is under way, and one that comes after it ended, are reported alike. The kill storm found one event id with two
    contents: a process restarted from a state file older than its reports re-read a STOP before its task's start
    ended, where the process before it had read it after (STOPPED after STARTING, then after RUNNING)."""
    start = command("j1/0", "START", "sim-0", ["sleep", "1"])
    second = d.Unplaced("j1/0") if killer == "unplaced" else d.Command(command("j1/0", killer, "sim-0", ["sleep", "1"]))

    def reports(start_ended_first: bool) -> dict[str, dict]:
        sim = SimulatedAgents(cfg, ["sim-0"], registry=registry, start_delay_ms=1_000)
        try:
            sim.feed("sim-0", d.Command(start), 0)
            if start_ended_first:
                assert sim.due_spawns(1_000) == 1
            sim.feed("sim-0", second, 1_500 if start_ended_first else 500)
            sim.due_spawns(10_000)  # what is still to start (a restart's new run) starts
            return {ev.event_id: ev.payload for ev in sim._outbox}
        finally:
            sim.close()

    late, early = reports(True), reports(False)
    assert early == late
    states = [p["state"] for p in late.values()]
    assert states[:2] == ["STARTING", "RUNNING"]
    # a restart's new run starts (the kill's exit starts it: CI's storm once left such tasks STARTING for good)
    assert states[-1] == ("RUNNING" if killer == "RESTART" else "STOPPED"), states


def test_the_process_agent_deletes_the_working_directory_of_a_task_gone_for_long(cfg, registry, tmp_path):
    """#29: a task's working directory was kept for ever (its logs already were not). A task that ran and exited
    leaves its directory to the rule of its logs (``ROPEWALK_TASK_LOG_KEEP_S``, here 0); a running task's directory,
    however old, stays."""
    machine = "m-dirs"
    write_machine_key(cfg.secrets, machine)
    work = tmp_path / machine
    agent = ProcessAgent(cfg, machine, work, registry=registry)
    try:
        agent.feed(d.Command(command("j8/0", "START", machine, ["sh", "-c", "echo done > out.txt"])))
        agent.feed(d.Command(command("j8/1", "START", machine, ["sleep", "60"])))
        deadline = time.monotonic() + 30
        while "j8/0" in agent.procs or "j8/0" in agent.uids:  # exited, its uid (if any) handed back
            assert time.monotonic() < deadline, agent.procs
            agent.check_processes()
            time.sleep(0.05)
        ended, running = task_dir(work, "j8/0"), task_dir(work, "j8/1")
        assert (ended / "out.txt").read_text() == "done\n" and running.is_dir()
        agent.bound_logs()  # the default keeps them a day
        assert ended.is_dir()
        agent.log_keep_s = 0.0
        agent.bound_logs()
        assert not ended.exists() and running.is_dir()
    finally:
        agent.suspend_tasks()
        agent.partition_map.close()
        agent.producer.flush(5)
