"""The process agent: runs one machine's tasks as local OS processes. Thin wiring around ``decide``.

    python -m processors.agent.process --machine-id M [--work-dir DIR] [--tick-ms 1000]

* Reads every partition of ``tasks`` (keyed by entitlement, so any partition may hold a command for this
  machine) and keeps the commands addressed to ``--machine-id`` (a job's TasksCommanded holds many machines'
  commands; older logs hold a TaskCommanded per task). It also folds ``allocations``: a START or RESTART runs only
  if the allocator placed that task on this machine for the command's entitlement and job (``gate.py``); anything
  else is answered by a TaskCommandRefused.
* Reports go out batched: the TaskStateChanged transitions of one step as one TaskStatesChanged per entitlement
  (``decide.batch``); heartbeats as they come.
* Each task runs as ``argv`` with a clean environment (``isolation.task_env``: a few of the agent's variables,
  ``HOME``, the command's env on top), in its own session (its own process group, so a stop takes its children
  too), stdout+stderr appended to ``<work>/logs/<task>.log``: rotated past ``ROPEWALK_TASK_LOG_MAX_BYTES`` (16 MiB;
  one older generation ``.log.1`` kept), deleted once no task of it ran for ``ROPEWALK_TASK_LOG_KEEP_S`` (a day):
  ``logs.py``. A kill is SIGTERM to the task (the processes of its uid, or its group without one), then SIGKILL
  after ``STOP_GRACE_MS``; after any exit its group and its uid's processes are SIGKILLed so nothing is left behind.
* The control plane going away is not the agent's business: when the broker is unreachable the agent keeps
  its tasks running (and restarting), the producer buffers the reports (no delivery timeout), and the
  consumer resumes from the agent's own offsets when the broker is back.
* ``<work>/agent-state.json`` holds the agent's view — each task's run and process (pid, start time), the
  next offset of every partition and the id of the topic they are offsets of, the heartbeat sequence — written
  atomically after every change. A restarted agent re-adopts the processes still alive (same pid *and* start
  time) instead of starting duplicates; a task whose process vanished meanwhile counts as a crash (exit code
  unknown). **What it told of that state goes with it**: every event it sent that the broker has not yet
  confirmed (and those it could not send yet) is in the file too, and a restarted agent sends them again (the
  same ids: a reader that got one already drops it). Before, a save came before the delivery of the reports of
  the same step: an agent killed between the two restarted from a state that said "stopped, reported", and the
  scheduler never heard it (the simulated agents' fix, stop 37, waits for the delivery instead; this agent saves
  its pids before anything runs, so it cannot wait).
* **Stopping.** On SIGTERM (``ropewalk down``) the agent stops its tasks (SIGTERM to each group, SIGKILL after
  the grace) and exits; at its next start it starts them again (``decide.Suspended``: nothing reported, the log
  still says they run). After ``KEEP_TASKS_SIGNAL`` (``ropewalk down --keep-tasks``) it leaves them running and
  the next agent adopts them. A killed agent (``kill -9``) leaves them running too.
* **Another log.** Saved offsets are offsets of one ``tasks`` topic (its Kafka topic id is saved with them). If
  the topic is another one at start (the broker's data was deleted, or restored from an archive), the offsets
  mean nothing there: the agent reads that log's backlog from its beginning, applies the last command per task
  (a START for a task it still runs adopts it and reports it RUNNING), and stops the tasks it runs that this
  log does not command (``decide.Orphaned``).
* **Tasks isolated from one another** (``isolation.py``). An agent running as root runs each task as a uid of its
  own, leased from ``--task-uids`` (``ROPEWALK_TASK_UIDS``) and kept in the state file, in a working directory
  ``<work>/tasks/<task>/`` only that uid can open, in a bubblewrap sandbox where it runs (``--task-sandbox``,
  ``ROPEWALK_TASK_SANDBOX``: ``auto``, ``bwrap``, ``none``); their stdout/stderr go to files the agent opens. The uid
  is handed back (its processes killed) when the task is stopped or failed. A non-root agent runs them as itself.
* Host profiles (``hostprofile.py``): a ``HostProfileRequested`` for this machine is applied by writing the
  profile and its settings to ``<work>/host-profile.json`` (the harmless, visible setting this agent stands for:
  a real one would write sysctls) and answered ``HostProfileApplied`` (``HostProfileFailed`` if the file cannot be
  written). A START the allocation gate admits (``gate.py``) that names another profile than the one applied
  waits until it is.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

from confluent_kafka import KafkaException

from infra.config import Config
from infra.private import PASSAGE_MODE, make_dir, open_private, private_umask, secure_work_dir, write_private
from infra.credentials import CredentialsError
from infra.process import failpoint, process_start_time
from infra.trust import machine_signer
from streams.deadletter import DeadLetters
from streams.clients import DeliveryError, EventConsumer, EventProducer
from streams.partitionmap import MapFollower
from streams.events import Event
from streams.serde import SchemaRegistry
from streams.topics import Topics, topic_id

from . import decide as d
from . import gate as g
from . import hostprofile as hp
from . import isolation as iso
from . import logs as task_logs
from processors.worker import LoopWorker

log = logging.getLogger("ropewalk.agent")

STATE_FILE = "agent-state.json"
PROFILE_FILE = "host-profile.json"  # the host profile applied: its name and settings
KEEP_TASKS_SIGNAL = signal.SIGUSR2  # `ropewalk down --keep-tasks`: the agent leaves its tasks running when it stops


def task_log(work_dir: Path, task_id: str) -> Path:
    """Where a task's stdout and stderr go."""
    return Path(work_dir) / "logs" / (task_id.replace("/", "_") + ".log")


def default_work_dir(run_dir: Path, machine_id: str) -> Path:
    return Path(run_dir) / "agents" / machine_id


def task_dir(work_dir: Path, task_id: str) -> Path:
    """A task's working directory (its own: given to the task user)."""
    return Path(work_dir) / "tasks" / task_id.replace("/", "_")


STATE_FORMAT = 1
DEFAULT_TICK_MS = 1000
POLL_S = 0.1
FAILPOINT_ENV = "ROPEWALK_AGENT_FAILPOINT"  # tests: exit at once at this point (``infra.process.failpoint``)
CATCH_UP_IDLE_POLLS = 20  # a fresh agent's backlog ends at end-of-partition everywhere, or this many empty polls
# Reports are buffered, never dropped, while the broker is away (librdkafka: 0 = no delivery timeout), and
# kept in order by one request in flight. Not idempotent: measured against the embedded broker, an idempotent
# producer never delivers again after a broker restart that lost its producer state (its buffered records stay
# queued forever), and an agent must outlive any control-plane outage. A retried record may be written twice;
# every report has a derived event id, so readers drop the copy (at-least-once, idempotent processing).
PRODUCER_CONF = {"message.timeout.ms": 0, "enable.idempotence": False,
                 "max.in.flight.requests.per.connection": 1, "linger.ms": 5}


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Proc:
    pid: int
    start_time: int | None
    popen: subprocess.Popen | None = None  # None for a process adopted from an earlier agent
    kill_deadline_ms: int | None = None  # SIGKILL after this, when a SIGTERM was sent

    def poll(self) -> tuple[bool, int | None]:
        """(exited, exit code; None when unknown)."""
        if self.popen is not None:
            code = self.popen.poll()
            return (code is not None), code
        return process_start_time(self.pid) != self.start_time, None


class ProcessAgent(LoopWorker):
    def __init__(self, cfg: Config, machine_id: str, work_dir: Path | str, *, registry: SchemaRegistry | None = None,
                 tick_ms: int = DEFAULT_TICK_MS, policy: d.Policy = d.DEFAULT_POLICY,
                 stop_grace_ms: int = d.STOP_GRACE_MS, isolation: iso.Isolation | None = None,
                 machine_key: Path | None = None):
        self.cfg = cfg
        self.machine_id = machine_id
        self.signer = machine_signer(cfg, machine_id, machine_key)  # what it says, it says as this machine
        self.work_dir = Path(work_dir)
        self.registry = registry or SchemaRegistry.from_dir()
        self.tick_ms = tick_ms
        self.policy = policy
        self.stop_grace_ms = stop_grace_ms
        self.isolation = isolation or iso.Isolation(None, why_not="tasks run as the agent's own user")
        self.uids: dict[str, int] = {}  # task -> the uid leased to it (isolation.py), saved with the state
        self.keep_tasks = False  # at stop: leave the tasks running (KEEP_TASKS_SIGNAL) instead of stopping them
        topics = Topics(cfg.topic_prefix, cfg.partitions)
        self.topic, self.partitions = topics.name("tasks"), topics.partitions_of("tasks")
        self.allocations = topics.name("allocations")
        self.judge = g.Judge(g.Gate(machine_id.__eq__),
                             [(self.allocations, i) for i in range(topics.partitions_of("allocations"))])
        secure_work_dir(self.work_dir)  # passages to the task directories; the rest the agent's alone
        make_dir(self.work_dir / "logs")
        self.procs: dict[str, Proc] = {}
        self.offsets: dict[tuple[str, int], int] = {}
        self.log_id: str | None = None  # the id of the `tasks` topic ``offsets`` are offsets of
        self.host = hp.HostState(machine_id, applied=self.profile_on_disk())
        self.errors = 0  # broker/delivery errors survived (and events of the state file that could not be read)
        self._unsent: deque[Event] = deque()  # events not yet handed to the producer, in order
        self._in_flight: list[Event] = []  # handed to the producer, not yet confirmed on the log
        self._reports: list[Event] = []  # this step's TaskStateChanged reports, batched into _unsent at its end
        self.state, fresh = self._load()  # (and what the last agent had not seen delivered, in _unsent)
        self.partition_map = MapFollower.start(cfg, self.registry, name=f"agent-{machine_id}-map")
        self.producer = self._new_producer()
        self.consumer: EventConsumer | None = None
        self._catch_up = fresh  # a fresh agent applies only the latest command per task of the backlog
        self._reconcile = False  # at the end of the catch-up: stop the tasks the backlog does not command
        self._backlog: dict[str, Event] = {}
        self._backlog_profile: Event | None = None  # and the latest host profile request
        self._idle_polls = 0
        self._next_tick = 0
        self.log_max_bytes = int(os.environ.get(task_logs.MAX_BYTES_ENV) or task_logs.MAX_BYTES)
        self.log_keep_s = float(os.environ.get(task_logs.KEEP_ENV) or task_logs.KEEP_S)
        self._next_log_check = 0.0

    # -- state file ------------------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.work_dir / STATE_FILE

    def _load(self) -> tuple[d.AgentState, bool]:
        try:
            doc = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return d.initial_state(self.machine_id, incarnation=now_ms()), True
        if doc.get("machine_id") != self.machine_id:
            raise SystemExit(f"{self.state_path} belongs to machine {doc.get('machine_id')!r}, not "
                             f"{self.machine_id!r}; use another --work-dir")
        runs = {r["task_id"]: d.run_from_json(r) for r in doc["tasks"]}
        self.judge.load_json(doc.get("gate"))
        state = d.AgentState(self.machine_id, incarnation=now_ms(), sequence=doc.get("sequence", 0),
                             tasks=MappingProxyType(runs))
        self.offsets = {(t, int(p)): o for t, p, o in doc.get("offsets", [])}
        self._unsent.extend(self._decoded(doc.get("unsent", ())))
        self._reports.extend(self._decoded(doc.get("reports", ())))
        self.log_id = doc.get("log_id")
        self.uids = {t: int(u) for t, u in (doc.get(iso.OWNER_UIDS_KEY) or {}).items()}
        for task_id, pr in doc.get("procs", {}).items():
            self.procs[task_id] = Proc(pid=pr["pid"], start_time=pr["start_time"],
                                       kill_deadline_ms=pr.get("kill_deadline_ms"))
        if "host" in doc:  # what is on disk is what is applied (a switch the agent died in is lost: asked again)
            host = hp.from_json(self.machine_id, doc["host"])
            self.host = hp.HostState(self.machine_id, applied=self.profile_on_disk(), failed=host.failed,
                                     held=host.held)
        return state, False

    def save(self) -> None:
        """The state file (atomically), with every event told of it that is not yet confirmed on the log."""
        self._settle_in_flight()
        doc = {"format": STATE_FORMAT, "machine_id": self.machine_id, "sequence": self.state.sequence,
               "offsets": [[t, p, o] for (t, p), o in sorted(self.offsets.items())], "log_id": self.log_id,
               "tasks": [d.run_to_json(r) for r in self.state.tasks.values()],
               "procs": {t: {"pid": p.pid, "start_time": p.start_time, "kill_deadline_ms": p.kill_deadline_ms}
                         for t, p in self.procs.items()},
               "gate": self.judge.to_json(), "host": hp.to_json(self.host),
               iso.OWNER_UIDS_KEY: dict(sorted(self.uids.items())), "sandbox": self.isolation.sandbox,
               "unsent": [self._encoded(e) for e in (*self._in_flight, *self._unsent)],
               "reports": [self._encoded(e) for e in self._reports]}
        write_private(self.state_path, json.dumps(doc, indent=1, sort_keys=True))

    def _decoded(self, kept: list[str]):
        """The events the state file kept (``_encoded``); one that cannot be read (a file of another version whose
        schema this one does not know, or damaged) is passed over, said in the log."""
        for h in kept:
            try:
                yield Event.from_record(*self.registry.decode(bytes.fromhex(h)))
            except (ValueError, KeyError, TypeError) as exc:  # DecodeError is a ValueError
                self.errors += 1
                log.warning("agent %s: an event the state file kept cannot be read, not sent again: %s",
                            self.machine_id, exc)

    def _encoded(self, ev: Event) -> str:
        """An event as the state file keeps it: its Avro record, in hex (as it goes on the log)."""
        return self.registry.encode(ev.type, ev.to_record(), validate=False).hex()

    def _settle_in_flight(self) -> None:
        """Forget the events the broker confirmed; those it failed go back in front of ``_unsent``, to be sent again
        (a failed delivery raises at the producer's next call, for any record of its batch)."""
        if not self._in_flight:
            return
        try:
            if self.producer.delivered(0):
                self._in_flight.clear()
        except (DeliveryError, KafkaException) as exc:  # some record of what is in flight did not make it
            self.errors += 1
            log.warning("agent %s: %s: sending %d events again", self.machine_id, exc, len(self._in_flight))
            self._send_again()

    def _send_again(self) -> None:
        """What is in flight goes back in front of ``_unsent``, in order: a delivery of it failed."""
        self._unsent.extendleft(reversed(self._in_flight))
        self._in_flight.clear()

    # -- deciding and acting ---------------------------------------------------------------------------------
    def feed(self, inp: d.Input) -> None:
        self.state, events, actions = d.decide(self.state, inp, now_ms(), self.policy)
        for ev in events:
            self._send(ev)
        for act in actions:
            self._act(act)
        if events or actions or not isinstance(inp, d.Tick):
            self.save()

    # -- host profiles ---------------------------------------------------------------------------------------
    def profile_on_disk(self) -> str:
        """The profile applied: what ``host-profile.json`` says (the default when there is none)."""
        try:
            return json.loads((self.work_dir / PROFILE_FILE).read_text()).get("host_profile", hp.DEFAULT_PROFILE)
        except (FileNotFoundError, ValueError):
            return hp.DEFAULT_PROFILE

    def command(self, cmd: Event) -> None:
        """A TaskCommanded for this machine, through the host-profile gate (a START waits for its profile)."""
        self.host, verdict, refused = hp.gate(self.host, cmd, now_ms())
        for ev in refused:
            self._send(ev)
        if verdict == hp.RUN:
            self.feed(d.Command(cmd))
        else:
            self.save()

    def profile_request(self, ev: Event) -> None:
        self.host, events, actions = hp.request(self.host, ev, now_ms())
        self._profile_done(events, actions, [])

    def _profile_done(self, events: list[Event], actions: list[hp.Apply], run: list[Event]) -> None:
        for ev in events:
            self._send(ev)
        self.save()
        for act in actions:
            self._apply_profile(act)
        for cmd in run:
            self.feed(d.Command(cmd))

    def _apply_profile(self, act: hp.Apply) -> None:
        """Write the profile and its settings to ``host-profile.json`` (atomically): the setting this agent applies."""
        path = self.work_dir / PROFILE_FILE
        error = None
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"host_profile": act.host_profile, "settings": dict(act.settings),
                                       "request_id": act.request_id, "applied_ms": now_ms()}, indent=1,
                                      sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:
            error = f"{path}: {exc}"
        self.host, events, actions, run = hp.done(self.host, act.request_id, now_ms(), error)
        self._profile_done(events, actions, run)

    def _send(self, ev: Event) -> None:
        if ev.type == "TaskStateChanged":
            self._reports.append(ev)  # sent batched by flush_reports (end of the step), in order
            return
        self.flush_reports()
        self._unsent.append(ev)
        self._send_unsent()

    def flush_reports(self) -> None:
        """Hand the reports made since the last call to the producer, batched (``d.batch``)."""
        if self._reports:
            reports, self._reports = self._reports, []
            self._unsent.extend(d.batch(reports, f"agent/{self.machine_id}", now_ms()))
        self._send_unsent()

    def _send_unsent(self) -> None:
        """Produce the reports not yet handed to the producer, in order. A broker that is away does not stop
        the agent: what cannot be handed over now is tried again on the next step."""
        while self._unsent:
            try:
                self.producer.send(self._unsent[0], validate=False)
            except Exception as exc:  # noqa: BLE001 - DeliveryError (earlier records, or the schema not yet published)
                self.errors += 1
                log.warning("agent %s: cannot send %s: %s", self.machine_id, self._unsent[0].type, exc)
                if isinstance(exc, KafkaException) and exc.args and exc.args[0].fatal():
                    self.producer = self._new_producer()  # e.g. the broker lost the idempotent producer's id
                if isinstance(exc, DeliveryError):  # an earlier record did not make it: what is in flight again
                    self._send_again()
                return
            self._in_flight.append(self._unsent.popleft())

    def _new_producer(self) -> EventProducer:
        return EventProducer(self.cfg, self.registry, f"agent/{self.machine_id}", route=self.partition_map,
                             signer=self.signer, **PRODUCER_CONF)

    def _act(self, act: d.Action) -> None:
        if act.kind == d.SPAWN:
            self._spawn(act)
        elif act.kind == d.KILL:
            self._kill(act.task_id)

    def _spawn(self, act: d.Action) -> None:
        """Run the action's argv as the task's own uid, in its own directory (and sandbox): ``isolation.py``."""
        logfile = task_log(self.work_dir, act.task_id)
        cwd = task_dir(self.work_dir, act.task_id)
        try:
            uid = self.isolation.prepare(act.task_id, cwd, self.uids.get(act.task_id))
            if uid is not None and self.uids.get(act.task_id) != uid:
                self.uids[act.task_id] = uid
                self.save()  # the lease is in the state before anything runs as it: a restarted agent knows it
            argv, switch = self.isolation.command(act.argv, cwd, uid)
            who = f"uid {uid}" + (" in a sandbox" if self.isolation.sandbox == iso.BWRAP else "") if uid is not None \
                else "the agent's user"
            with open_private(logfile) as out:  # opened by the agent: written by the task through the descriptor
                out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} spawn {list(act.argv)} spec "
                          f"{act.spec_version} as {who} ({act.reason})\n".encode())
                out.flush()
                popen = subprocess.Popen(argv, env=iso.task_env(dict(act.env), cwd, os.environ), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, cwd=cwd, **switch)
        except (OSError, ValueError, subprocess.SubprocessError, iso.IsolationError) as exc:
            self.feed(d.SpawnFailed(act.task_id, str(exc)))
            return
        self.procs[act.task_id] = Proc(popen.pid, process_start_time(popen.pid), popen)
        self.save()  # the pid is on disk before anything else happens: a restarted agent adopts it
        self.feed(d.Spawned(act.task_id))

    def _kill(self, task_id: str) -> None:
        proc = self.procs.get(task_id)
        if proc is None:  # no process (it vanished): the exit is all there is to report
            self.feed(d.Exited(task_id, None))
            return
        self.isolation.signal(proc.pid, self.uids.get(task_id), signal.SIGTERM)
        proc.kill_deadline_ms = now_ms() + self.stop_grace_ms

    def check_processes(self) -> None:
        for task_id, proc in list(self.procs.items()):
            exited, code = proc.poll()
            if exited:
                self.isolation.signal(proc.pid, self.uids.get(task_id), signal.SIGKILL)  # whatever it left behind
                del self.procs[task_id]
                self.feed(d.Exited(task_id, code))
            elif proc.kill_deadline_ms is not None and now_ms() >= proc.kill_deadline_ms:
                self.isolation.signal(proc.pid, self.uids.get(task_id), signal.SIGKILL)
                proc.kill_deadline_ms = None
        self.release_uids()

    def release_uids(self) -> None:
        """Hand back the uid of every task that no longer runs nor will run again here (stopped, failed, forgotten):
        its processes killed, its directory given to root (``isolation.Isolation.release``)."""
        done = [t for t in self.uids if t not in self.procs
                and (self.state.tasks.get(t) is None or self.state.tasks[t].phase not in d.LIVE)]
        for task_id in done:
            left = self.isolation.release(self.uids.pop(task_id), task_dir(self.work_dir, task_id))
            if left:
                log.info("agent %s: %s left %s: removed", self.machine_id, task_id, left)
        if done:
            self.save()

    def adopt(self) -> None:
        """After a restart: processes of the state file that are gone become exits (or are dropped)."""
        for task_id, proc in list(self.procs.items()):
            run = self.state.tasks.get(task_id)
            if run is None or run.phase not in d.HAS_PROCESS:
                del self.procs[task_id]  # not the agent's any more; leave it be
            elif proc.start_time is None or process_start_time(proc.pid) != proc.start_time:
                del self.procs[task_id]
                if task_id in self.uids:  # what outlived it (a sandbox whose monitor alone was killed) goes too
                    self.isolation.signal(proc.pid, self.uids[task_id], signal.SIGKILL)
                self.feed(d.Exited(task_id, None))
            else:
                log.info("agent %s: adopted %s pid %d", self.machine_id, task_id, proc.pid)
        for task_id, run in self.state.tasks.items():  # SPAWNING with no process on disk: spawn never happened
            if run.phase == d.P_SPAWNING and task_id not in self.procs:
                if task_id in self.uids:  # (or happened, and the agent died before it saved the pid)
                    iso.kill_uid(self.uids[task_id])
                self.feed(d.SpawnFailed(task_id, "agent stopped while spawning"))
        self.save()

    # -- the log ---------------------------------------------------------------------------------------------
    def _check_log(self) -> None:
        """The offsets are offsets of the ``tasks`` topic whose id was saved with them: if the topic now has another
        id (a new log), forget them and read this log from its beginning (``_catch_up_with``), then stop what it does
        not command. Raises if the broker cannot say (the caller tries again later)."""
        current = topic_id(self.cfg, self.topic)
        if self.log_id is not None and current != self.log_id:
            log.warning("agent %s: %s is another topic than the one its offsets belong to (id %s, saved %s): reading "
                        "it from the beginning; tasks it does not command are stopped", self.machine_id, self.topic,
                        current, self.log_id)
            self.offsets = {}
            self._catch_up = self._reconcile = True
        self.log_id = current
        self.save()

    def _connect(self) -> bool:
        try:
            self._check_log()
            self.consumer = EventConsumer(self.cfg, self.registry, [self.topic, self.allocations],
                                          name=f"agent/{self.machine_id}", start_offsets=self.offsets,
                                          dead_letters=DeadLetters(self.producer, f"agent/{self.machine_id}"),
                                          types=d.COMMAND_TYPES | g.ALLOCATION_TYPES | {hp.REQUEST_TYPE},
                                          keep_refused=True,  # forged commands: answered (gate.forged)
                                          follows=True)
            return True
        except Exception as exc:  # noqa: BLE001 - broker away: try again later, tasks go on
            self.errors += 1
            self.consumer = None
            log.warning("agent %s: cannot read %s: %s", self.machine_id, self.topic, exc)
            return False

    def poll_commands(self, timeout_s: float = POLL_S) -> int:
        """Read and apply the commands for this machine; returns how many records were read."""
        if self.consumer is None and not self._connect():
            time.sleep(timeout_s)
            return 0
        try:
            records = self.consumer.poll(1000, timeout_s)
        except Exception as exc:  # noqa: BLE001 - a broker error: librdkafka reconnects by itself; records of the failed
            self.errors += 1       # batch are read again from the agent's own offsets (duplicates are no-ops)
            log.warning("agent %s: reading %s: %s", self.machine_id, self.topic, exc)
            try:
                self.consumer.assign(self.offsets, only=[(self.topic, i) for i in range(self.partitions)]
                                     + self.judge.partitions)
            except Exception:  # noqa: BLE001 - the assignment failed: the consumer is made again next time
                self._close_consumer()
            time.sleep(timeout_s)
            return 0
        mine = self.machine_id.__eq__
        self.judge.take_refused(self.consumer, mine, now_ms(), self.consumer.dead_letters)
        if self._catch_up:
            return self._catch_up_with(records)
        for rec in records:
            self.offsets[(rec.topic, rec.partition)] = rec.offset + 1  # saved with the state the record makes
            if rec.event.type == hp.REQUEST_TYPE:
                if mine(rec.event.payload["machine_id"]):
                    self.profile_request(rec.event)
                continue
            for cmd in self.judge.take([rec.event], mine, now_ms()):
                self.command(cmd)
        self._refuse()
        if records:
            self.save()
            if self.judge.unplacing:  # a move read, the stop it may need not made yet (its test kills the agent here)
                failpoint(FAILPOINT_ENV, "stop_pending", log)
        return len(records)

    def _refuse(self) -> None:
        """Send the refusals whose verdict is final (``gate.Judge``)."""
        if self.consumer is None:
            return
        try:
            refused = self.judge.refusals(self.consumer, now_ms(), self.offsets)
        except Exception as exc:  # noqa: BLE001 - the broker away: asked again on the next step
            log.warning("agent %s: allocations watermarks: %s", self.machine_id, exc)
            return
        for ev in refused:
            log.warning("agent %s: refused %s of %s: %s", self.machine_id, ev.payload["command"],
                        ev.payload["task_id"], ev.payload["message"])
            self._send(ev)
        for task_id, _ in self.judge.take_stops():  # placed elsewhere since: a START read before the move
            if task_id in self.state.live_task_ids():
                log.warning("agent %s: stops %s: the allocations log placed it elsewhere", self.machine_id, task_id)
                self.feed(d.Unplaced(task_id))
        if refused:
            self.save()

    def _catch_up_with(self, records) -> int:
        """A fresh agent reads the backlog to its end first and then applies only the last command per task
        (a START long since followed by a STOP starts nothing)."""
        mine = self.machine_id.__eq__
        for rec in records:
            self.offsets[(rec.topic, rec.partition)] = rec.offset + 1
            if rec.event.type in g.ALLOCATION_TYPES:
                self.judge.take([rec.event], mine, now_ms())  # the fold (nothing waits yet)
                continue
            if rec.event.type == hp.REQUEST_TYPE:
                if mine(rec.event.payload["machine_id"]):
                    self._backlog_profile = rec.event
                continue
            for cmd in d.commands(rec.event, mine):
                self._backlog.pop(cmd.payload["task_id"], None)
                self._backlog[cmd.payload["task_id"]] = cmd
        self._idle_polls = 0 if records else self._idle_polls + 1
        if (len(self.consumer.eof) >= self.partitions + len(self.judge.partitions)
                or self._idle_polls >= CATCH_UP_IDLE_POLLS):
            self._catch_up = False
            backlog, self._backlog = list(self._backlog.values()), {}
            if self._backlog_profile is not None:  # the profile first: the backlog's STARTs may need it
                self.profile_request(self._backlog_profile)
                self._backlog_profile = None
            for ev in self.judge.take_commands(backlog, now_ms()):
                self.command(ev)
            if self._reconcile:  # a new log: what it does not command is not ours to run
                self._reconcile = False
                commanded = {ev.payload["task_id"] for ev in backlog}
                for task_id in [t for t in self.state.live_task_ids() if t not in commanded]:
                    self.feed(d.Orphaned(task_id))
            self._refuse()
            self.save()
        return len(records)

    def _close_consumer(self) -> None:
        if self.consumer is not None:
            try:
                self.consumer.close()
            except Exception:  # noqa: BLE001 - closing a broken consumer: nothing more to do
                pass
        self.consumer = None

    # -- running ---------------------------------------------------------------------------------------------
    def step(self) -> None:
        self._send_unsent()
        self.poll_commands()
        self.check_processes()
        if now_ms() >= self._next_tick:
            self._next_tick = now_ms() + self.tick_ms
            self.feed(d.Tick())
        self.flush_reports()
        if time.monotonic() >= self._next_log_check:
            self._next_log_check = time.monotonic() + task_logs.CHECK_S
            self.bound_logs()
        try:
            self.producer._producer.poll(0)  # serve delivery reports (EventProducer polls only every 1000 sends)
        except Exception:  # noqa: BLE001 - delivery reports are served again at the next poll
            pass

    def bound_logs(self) -> None:
        """Rotate the logs of running tasks past their size, delete those of tasks gone for long, and their working
        directories (``logs.py``)."""
        running = {task_log(self.work_dir, t).name[: -len(task_logs.SUFFIX)] for t in self.procs}
        now = time.time()
        try:
            done = task_logs.apply(self.work_dir / "logs", running, now, max_bytes=self.log_max_bytes,
                                   keep_s=self.log_keep_s)
        except OSError as exc:  # a disk full or a permission: the tasks go on, the next look tries again
            log.warning("agent %s: bounding the task logs: %s", self.machine_id, exc)
            done = []
        for action, name in done:
            log.info("agent %s: task log %s: %s", self.machine_id, name, "rotated" if action == task_logs.ROTATE
                     else f"deleted (no task of it ran for {self.log_keep_s:.0f} s)")
        live = {task_dir(self.work_dir, t).name for t in
                {*self.procs, *self.uids, *(t for t, run in self.state.tasks.items() if run.phase in d.LIVE)}}
        try:
            gone = task_logs.apply_dirs(self.work_dir / "tasks", live, now, keep_s=self.log_keep_s)
        except OSError as exc:
            log.warning("agent %s: deleting the working directories of tasks gone: %s", self.machine_id, exc)
            return
        for name in gone:
            log.info("agent %s: task directory %s deleted (no task of it ran for %.0f s)", self.machine_id, name,
                     self.log_keep_s)

    def run(self, until: float | None = None) -> None:
        gone = self.isolation.reconcile(self.uids)
        if gone:
            log.warning("agent %s: uids %s were leased to it but not in its state: handed back", self.machine_id, gone)
        if self.isolation.leases is not None:  # a directory no uid holds is root's (one an older agent gave nobody)
            held = {task_dir(self.work_dir, t) for t in self.uids}
            for d in (self.work_dir / "tasks").iterdir():
                if d.is_dir() and not d.is_symlink() and d not in held:
                    iso.disown(d)
        self.adopt()
        self.release_uids()
        self.flush_reports()
        self.loop(until)

    def close(self) -> None:
        """Stop the tasks (started again at the next start), unless asked to keep them (``KEEP_TASKS_SIGNAL``: a
        restarted agent adopts them); save, flush what the broker takes."""
        if not self.keep_tasks:
            self.suspend_tasks()
        self.save()
        try:
            self.flush_reports()
        except Exception as exc:  # noqa: BLE001 - at exit, report and go
            log.warning("agent %s: reports not handed over at exit: %s", self.machine_id, exc)
        self._close_consumer()
        try:
            self.producer.flush(5.0)
        except Exception as exc:  # noqa: BLE001 - at exit: logged, nothing more to do
            log.warning("agent %s: reports not delivered at exit: %s", self.machine_id, exc)
        self.partition_map.close()

    def suspend_tasks(self) -> None:
        """Stop every task's process group (SIGTERM, SIGKILL after the grace) and tell ``decide`` (``Suspended``)."""
        procs = dict(self.procs)
        for task_id, proc in procs.items():
            self.isolation.signal(proc.pid, self.uids.get(task_id), signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_ms / 1000
        while time.monotonic() < deadline and any(not p.poll()[0] for p in procs.values()):
            time.sleep(0.05)
        for task_id, proc in procs.items():
            self.isolation.signal(proc.pid, self.uids.get(task_id), signal.SIGKILL)
            if proc.popen is not None:
                proc.popen.wait()
            self.procs.pop(task_id, None)
            self.feed(d.Suspended(task_id))
        if procs:
            log.info("agent %s: stopped %d tasks (started again at the next start)", self.machine_id, len(procs))

    def keep_tasks_at_stop(self, *_) -> None:
        self.keep_tasks = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m processors.agent.process", description=__doc__.split("\n")[0])
    ap.add_argument("--machine-id", required=True)
    ap.add_argument("--work-dir", help="state file and task logs (default: $ROPEWALK_RUN_DIR/agents/<machine>)")
    ap.add_argument("--tick-ms", type=int, default=DEFAULT_TICK_MS, help="heartbeat interval")
    ap.add_argument("--max-restarts", type=int, default=d.MAX_RESTARTS)
    ap.add_argument("--backoff-ms", type=int, default=d.BACKOFF_MS)
    ap.add_argument("--stop-grace-ms", type=int, default=d.STOP_GRACE_MS)
    ap.add_argument("--task-uids", default=os.environ.get(iso.UIDS_ENV) or iso.DEFAULT_UIDS,
                    help=f"as root: the uids leased to tasks, one each, FIRST-LAST (${iso.UIDS_ENV}, default "
                         f"{iso.DEFAULT_UIDS})")
    ap.add_argument("--task-sandbox", choices=iso.SANDBOXES, default=os.environ.get(iso.SANDBOX_ENV) or iso.AUTO,
                    help=f"as root: run tasks in a bubblewrap sandbox: auto (if it runs here), bwrap (required), none "
                         f"(${iso.SANDBOX_ENV}, default auto)")
    ap.add_argument("--task-uid-leases", default=os.environ.get(iso.LEASES_ENV) or iso.DEFAULT_LEASES,
                    help=f"the directory of this machine's uid leases, shared by its agents (${iso.LEASES_ENV})")
    ap.add_argument("--machine-key", help="this machine's key file (default: <secrets>/machines/<machine>.json; the "
                                          "operator writes it: `ropewalk keys machine M`)")
    args = ap.parse_args(argv)
    private_umask()  # its state, logs and task logs are root's alone (infra/private.py)
    try:
        uids = iso.UidRange.parse(args.task_uids)
    except ValueError as exc:
        ap.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from infra import metrics  # noqa: PLC0415 - start-up: prometheus_client (~20 ms); main only

    metrics.serve_worker(Config.from_env().run_dir)  # infra/metrics.py; `ropewalk up` lists the targets
    cfg = Config.from_env().as_principal("agent")
    work = Path(args.work_dir) if args.work_dir else default_work_dir(cfg.run_dir, args.machine_id)
    if not args.work_dir:  # the passages to its task directories: <run dir> and <run dir>/agents (infra/private.py)
        make_dir(cfg.run_dir, PASSAGE_MODE)
        make_dir(work.parent, PASSAGE_MODE)
    try:
        isolation = iso.Isolation.start(want=args.task_sandbox, uids=uids, leases_dir=Path(args.task_uid_leases),
                                        owner=work / STATE_FILE, hidden=[cfg.run_dir, cfg.secrets, work],
                                        scratch=work / "tasks")
    except iso.IsolationError as exc:
        raise SystemExit(f"agent {args.machine_id}: {exc}") from None
    try:
        agent = ProcessAgent(cfg, args.machine_id, work, tick_ms=args.tick_ms,
                             policy=replace(d.DEFAULT_POLICY, max_restarts=args.max_restarts,
                                            backoff_ms=args.backoff_ms),
                             stop_grace_ms=args.stop_grace_ms, isolation=isolation,
                             machine_key=Path(args.machine_key) if args.machine_key else None)
    except CredentialsError as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return 2
    faulthandler.register(signal.SIGUSR1)
    signal.signal(KEEP_TASKS_SIGNAL, agent.keep_tasks_at_stop)  # kill -USR1 <agent pid>: print every thread's stack to stderr
    agent.stop_on_signals()
    log.info("agent %s: work dir %s, reading %s; tasks run %s", args.machine_id, work, agent.topic,
             isolation.describe())
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
