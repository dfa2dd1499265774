"""Simulated agents: one process stands for many machines (up to 100,000). Thin wiring around ``decide``.

    python -m processors.agent.simulated (--region FILE | --machines N) [--interval-ms 10000] [--start-delay-ms 200]

Commands arrive as a job's TasksCommanded (or, from older logs, TaskCommanded): each simulated machine takes the
ones addressed to it, and runs a START or RESTART only if its fold of ``allocations`` placed that task on it for the
command's entitlement and job (``gate.py``: a TaskCommandRefused answers anything else). The reports one ``step``
makes, of every machine, go out as one TaskStatesChanged per entitlement (``decide.batch``), not one record per
transition.

No OS processes: a SPAWN action becomes ``Spawned`` (→ RUNNING) after ``start_delay_ms`` (times a factor drawn
uniformly from ``[1 - start_jitter, 1 + start_jitter]`` with a seeded generator, when a jitter is set), a KILL becomes
``Exited(-SIGTERM)`` at once (→ STOPPED). Each machine's tasks go through the same ``decide`` as the process
agent's; a machine holds an ``AgentState`` only while it has tasks (finished tasks are forgotten), so an idle
machine costs one string and one slot in a list.

Heartbeats: one per machine per ``interval_ms``, spread evenly over the interval (machine ``i`` beats at
offset ``i/N`` of each round) and produced in batches; the sequence is the round number, so it increases by
one per heartbeat of every machine. ``fail(machine)`` simulates a dead machine: no heartbeats, no reports,
commands ignored, its tasks gone; ``recover(machine)`` brings it back empty (a new incarnation).

**State file** (``--state-file``; ``ropewalk up`` gives ``<run dir>/agents/simulated.json``). The simulated
machines outlive the process that simulates them, as real machines outlive their agent: the file holds every
machine's tasks, the pending spawns, failed machines, incarnations, the heartbeat round and the next offset of
every ``tasks`` partition. It is written atomically at most every ``SAVE_INTERVAL_S`` while something changed,
and at exit. A restarted process resumes from it: the same tasks run, under a new incarnation (heartbeat ids: the
file may be a few rounds behind the beats of the process that died), and reading goes on from the saved offsets. Records read after the last save are read again: a command already applied is
a no-op (``decide`` keeps each task's recent command ids) and a report sent again has the same event id.
Without a state file (tests, the bench) a restart reads ``tasks`` from the beginning as a new incarnation.

**Host profiles** (``hostprofile.py``): a ``HostProfileRequested`` for a simulated machine is applied after the
profile's switch time (``sidekick/catalogue.py``, times ``profile_switch_scale``; ``ROPEWALK_PROFILE_SWITCH_SCALE``,
default 1) and answered ``HostProfileApplied``, or ``HostProfileFailed`` on a machine of ``profile_failures`` (a
kernel that cannot allocate huge pages, say; ``--profile-fail MACHINE[:PROFILE]``: every switch of the machine, or
only its switches to that profile). Until then the START commands that need the
profile are held. Only machines with a profile other than the default (or a switch under way) take memory.

**Load signals** (``--load JOB=SPEC``, repeatable; ``load.py``): every ``--load-interval-ms`` one JobLoadReported per
such job on ``metrics``: the load of a daily trace (compressed in time by the spec's ``speed``) and the tasks of the
job these machines run. What the autoscaler (``processors/srm``) sizes the job from.
"""
from __future__ import annotations

import argparse
import heapq
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Sequence

from infra.config import Config
from infra.trust import simulated_signer
from processors.resourcebroker.region import iter_machines, load_region
from streams.catchup import read_to_end
from streams.clients import EventConsumer, EventProducer
from streams.partitionmap import routed_producer
from streams.deadletter import DeadLetters
from streams.events import Event
from streams.serde import SchemaRegistry
from streams.topics import Topics

from . import decide as d
from . import gate as g
from . import hostprofile as hp
from . import power as pw
from processors.sidekick import catalogue
from .load import JobLoad, LoadSpecError, parse_job_load
from processors.worker import LoopWorker

log = logging.getLogger("ropewalk.agent.simulated")

DEFAULT_INTERVAL_MS = 10_000
DEFAULT_START_DELAY_MS = 200
KILLED_EXIT_CODE = -15  # what a SIGTERMed process reports
MAX_BATCH = 20_000  # heartbeats produced per step at most (the rest catch up on the next steps)
PRODUCER_CONF = {"linger.ms": 5, "batch.num.messages": 10000, "queue.buffering.max.messages": 1_000_000}
# Heartbeats go through a producer of their own that waits 500 ms to fill its batches: a heartbeat is read against
# a timeout of seconds, and with 20 ms (one producer for everything) the heartbeats of a 10,000-machine region were
# ~160 produce requests a second, each waking the health check's fetch: most of the broker's 0.2 core at rest.
HEARTBEAT_PRODUCER_CONF = {**PRODUCER_CONF, "linger.ms": 500}
STATE_FORMAT = 1
SAVE_INTERVAL_S = 5.0  # the state file is rewritten at most this often while something changed
DELIVERED_WAIT_S = 1.0  # how long a save waits for the reports sent before it (then it is left for a later step)


def now_ms() -> int:
    return int(time.time() * 1000)


class SimulatedAgents(LoopWorker):
    def __init__(self, cfg: Config, machine_ids: Sequence[str], *, registry: SchemaRegistry | None = None,
                 interval_ms: int = DEFAULT_INTERVAL_MS, start_delay_ms: int = DEFAULT_START_DELAY_MS,
                 start_jitter: float = 0.0, seed: int = 0, name: str = "agent/simulated",
                 state_file: Path | str | None = None, profile_switch_scale: float | None = None,
                 profile_failures: Iterable[str] = (), loads: Sequence[JobLoad] = (),
                 load_interval_ms: int = 1000):
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be positive, got {interval_ms}")
        if not 0.0 <= start_jitter < 1.0:
            raise ValueError(f"start_jitter must be in [0, 1), got {start_jitter}")
        self.cfg = cfg
        self.registry = registry or SchemaRegistry.from_dir()
        self.machines: list[str] = list(machine_ids)
        self.known = frozenset(self.machines)
        self.interval_ms = interval_ms
        self.start_delay_ms = start_delay_ms
        self.start_jitter = start_jitter
        self._rng = random.Random(seed)
        self.name = name
        self.incarnation = now_ms()
        self.states: dict[str, d.AgentState] = {}  # only machines with tasks
        self.failed: set[str] = set()
        self.incarnations: dict[str, int] = {}  # machines recovered from a failure: their new incarnation
        self._spawns: list[tuple[int, str, str]] = []  # heap of (due ms, machine, task); stale ones skipped
        self._spawn_due: dict[tuple[str, str], int] = {}  # (machine, task) -> the due time of its live entry
        self.hosts: dict[str, hp.HostState] = {}  # machines whose host profile is not the default, or switching
        self._switches: list[tuple[int, str, str]] = []  # heap of (due ms, machine, request id)
        self.profile_switch_scale = (float(os.environ.get("ROPEWALK_PROFILE_SWITCH_SCALE", "1"))
                                     if profile_switch_scale is None else profile_switch_scale)
        self.profile_failures = frozenset(profile_failures)
        # Every machine's reports and heartbeats under its own key (the machine secret: these agents stand for every
        # machine they simulate, infra/trust.simulated_signer)
        self.signer = simulated_signer(cfg)
        self.producer = routed_producer(cfg, self.registry, name, signer=self.signer, **PRODUCER_CONF)
        self.beats = EventProducer(cfg, self.registry, name, signer=self.signer, **HEARTBEAT_PRODUCER_CONF)
        topics = Topics(cfg.topic_prefix, cfg.partitions)
        self.topic = topics.name("tasks")
        self.allocations = topics.name("allocations")
        self.unavailability = topics.name("unavailability")
        self.power = pw.PowerState()  # machines dark for a power loss (power.py)
        self.judge = g.Judge(g.Gate(self.known.__contains__),
                             [(self.allocations, i) for i in range(topics.partitions_of("allocations"))])
        self.consumer: EventConsumer | None = None
        self._round = 0  # heartbeat round: the sequence of this round's heartbeats
        self._round_start = 0
        self._next = 0  # index of the next machine to beat in this round
        self.heartbeats = 0
        self.reports = 0
        self._outbox: list[Event] = []  # this step's TaskStateChanged reports, sent batched at its end
        self.offsets: dict[tuple[str, int], int] = {}  # tasks partition -> next offset to read
        self.state_file = Path(state_file) if state_file is not None else None
        self.loads = tuple(loads)  # jobs whose load signal these agents emit (load.py)
        self.load_interval_ms = load_interval_ms
        self._next_load_ms = 0
        self._dirty = False
        self._saved_at = 0.0
        if self.state_file is not None:
            self._load()

    # -- state file ------------------------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            doc = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return
        if doc.get("format") != STATE_FORMAT:
            raise SystemExit(f"{self.state_file}: format {doc.get('format')!r}, this agent writes {STATE_FORMAT}")
        # A new incarnation of every machine: the file may be a few rounds behind what the process that wrote it
        # beat before it died, so resuming its incarnations would beat those rounds again under the same event ids
        # with other contents (the kill storm found 43 such heartbeats). Their sequences go on from the file.
        self.incarnation = max(self.incarnation, doc["incarnation"] + 1, *map(int, doc["incarnations"].values()))
        self.incarnations = {}
        self.failed = {m for m in doc["failed"] if m in self.known}
        self.states = {m: d.AgentState(m, incarnation=st["incarnation"], sequence=st["sequence"],
                                       tasks=MappingProxyType({r["task_id"]: d.run_from_json(r)
                                                               for r in st["tasks"]}))
                       for m, st in doc["states"].items() if m in self.known}
        self._spawns = [(due, m, t) for due, m, t in doc["spawns"] if m in self.states]
        heapq.heapify(self._spawns)
        self._spawn_due = {(m, t): due for due, m, t in sorted(self._spawns)}
        self.hosts = {m: hp.from_json(m, h) for m, h in doc.get("hosts", {}).items() if m in self.known}
        self._switches = [(due, m, r) for due, m, r in doc.get("switches", ()) if m in self.hosts]
        heapq.heapify(self._switches)
        self._round = doc["round"] + 1  # a new round: its heartbeats are new events, every machine beats at once
        self.offsets = {(t, int(p)): o for t, p, o in doc["offsets"]}
        self.judge.load_json(doc.get("gate"))
        self.power = pw.from_json(doc.get("power"), self.known.__contains__)
        log.info("%s: resumed %d machines with tasks, %d failed, from %s", self.name, len(self.states),
                 len(self.failed), self.state_file)

    def save(self) -> None:
        """Write the state file (atomically: a temp file renamed over it), once the reports already sent are on the
        log: a state that says a task was stopped, and the command read, must not outlive the STOPPED report that
        tells of it (a crash between the two would leave the scheduler waiting for good). Not yet delivered within
        ``DELIVERED_WAIT_S`` (a leader's node stopped): left dirty, saved at a later step."""
        if self.state_file is None:
            return
        if not self.producer.delivered(DELIVERED_WAIT_S):
            self._saved_at = time.monotonic()  # asked again after SAVE_INTERVAL_S, not at every step
            return
        doc = {"format": STATE_FORMAT, "incarnation": self.incarnation, "incarnations": self.incarnations,
               "failed": sorted(self.failed), "round": self._round,
               "states": {m: {"incarnation": st.incarnation, "sequence": st.sequence,
                              "tasks": [d.run_to_json(r) for r in st.tasks.values()]}
                          for m, st in self.states.items()},
               "spawns": sorted(s for s in self._spawns if self._spawn_due.get(s[1:]) == s[0]),
               "hosts": {m: hp.to_json(h) for m, h in self.hosts.items()}, "switches": sorted(self._switches),
               "offsets": [[t, p, o] for (t, p), o in sorted(self.offsets.items())],
               "gate": self.judge.to_json(), "power": pw.to_json(self.power)}
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        os.replace(tmp, self.state_file)
        self._dirty, self._saved_at = False, time.monotonic()

    def maybe_save(self) -> None:
        if self._dirty and time.monotonic() - self._saved_at >= SAVE_INTERVAL_S:
            self.save()

    # -- machines ------------------------------------------------------------------------------------------
    def fail(self, machine_id: str) -> None:
        """The machine dies: silence (even what it reported in this step is not sent), its tasks gone with it
        (its host profile stays applied; a switch under way is lost)."""
        self.failed.add(machine_id)
        self.states.pop(machine_id, None)
        host = self.hosts.get(machine_id)
        if host is not None:
            self._keep_host(hp.HostState(machine_id, applied=host.applied))
        self._outbox = [ev for ev in self._outbox if ev.payload.get("machine_id") != machine_id]
        self._dirty = True

    def recover(self, machine_id: str) -> None:
        self.failed.discard(machine_id)
        self.incarnations[machine_id] = now_ms()
        self._dirty = True

    # -- deciding ------------------------------------------------------------------------------------------
    def feed(self, machine_id: str, inp: d.Input, now: int) -> None:
        if machine_id in self.failed:
            return
        state = self.states.get(machine_id) or d.initial_state(
            machine_id, incarnation=self.incarnations.get(machine_id, self.incarnation))
        state = self._spawned_first(state, inp, now)
        state, events, actions = d.decide(state, inp, now)
        self._outbox += events
        while actions:  # a kill's exit may start the next spec (a RESTART, another version): its spawn is an action too
            act, actions = actions[0], actions[1:]
            if act.kind == d.SPAWN:
                due = now + self.start_delay()
                heapq.heappush(self._spawns, (due, machine_id, act.task_id))
                self._spawn_due[(machine_id, act.task_id)] = due
            elif act.kind == d.KILL:
                state, events, more = d.decide(state, d.Exited(act.task_id, KILLED_EXIT_CODE), now)
                self._outbox += events
                actions = [*actions, *more]
        state = d.forget_finished(state)
        if state.tasks:
            self.states[machine_id] = state
        else:
            self.states.pop(machine_id, None)
        self._dirty = True

    def _spawned_first(self, state: d.AgentState, inp: d.Input, now: int) -> d.AgentState:
        """A command, an ``Unplaced`` or an ``Orphaned`` for a task whose simulated start is still under way finds
        it started: its start ends first (RUNNING reported). Else what the agent reports would hang on how the
        start's delay and the input's arrival interleave (STOPPED after STARTING, or after RUNNING), and a process
        restarted from a state file older than its reports would report the same transition, under the same
        event id, with another ``previous_state`` (the kill storm's conflicting duplicate)."""
        if isinstance(inp, d.Command):
            task_id = inp.event.payload["task_id"]
        elif isinstance(inp, (d.Unplaced, d.Orphaned)):
            task_id = inp.task_id
        else:
            return state
        run = state.tasks.get(task_id)
        if run is None or run.phase != d.P_SPAWNING:
            return state
        self._spawn_due.pop((state.machine_id, task_id), None)  # its heap entry is stale now: skipped when due
        state, events, _ = d.decide(state, d.Spawned(task_id), now)
        self._outbox += events
        return state

    def start_delay(self) -> int:
        """START → RUNNING of one task, ms: ``start_delay_ms``, jittered if a jitter is set."""
        if not self.start_jitter:
            return self.start_delay_ms
        return round(self.start_delay_ms * self._rng.uniform(1 - self.start_jitter, 1 + self.start_jitter))

    def on_commands(self, events: Iterable[Event], now: int) -> int:
        """Apply the commands (TaskCommanded, or a job's TasksCommanded) addressed to the simulated machines that the
        allocations events among ``events`` (folded in order) placed there, and the HostProfileRequested for them;
        a START the allocation gate admits waits here while its machine lacks the host profile it names. Returns how
        many commands were applied or held."""
        n = 0
        run: list[Event] = []  # a run of events between two profile requests or power events: judged in one take
        for ev in [*events, None]:
            if ev is not None and ev.type != hp.REQUEST_TYPE and ev.type not in pw.TYPES:
                run.append(ev)
                continue
            for cmd in self.judge.take(run, self.known.__contains__, now) if run else ():
                self.command(cmd, now)
                n += 1
            run = []
            if ev is None:
                continue
            if ev.type in pw.TYPES:
                self.on_power(ev)
            else:
                self.profile_request(ev, now)
        return n

    def on_power(self, ev: Event) -> None:
        """A power event of the region (power.py): the machines it turns off go dark (``fail``: silent, tasks
        gone); those its end turns on again boot empty (``recover``)."""
        self.power, change = pw.on_unavailability(self.power, ev, self.known.__contains__)
        for m in change.off:
            self.fail(m)
        for m in change.on:
            self.recover(m)
        if change.off or change.on:
            self._dirty = True
            log.info("%s: power %s: %d machines off, %d on again", self.name, ev.payload["unavailability_id"],
                     len(change.off), len(change.on))

    def command(self, cmd: Event, now: int) -> None:
        """A command the allocation gate admitted, through the host-profile gate (a START waits for its profile)."""
        machine = cmd.payload["machine_id"]
        if machine in self.failed:
            return
        host, verdict, refused = hp.gate(self.host(machine), cmd, now)
        self._keep_host(host)
        self._outbox += refused
        if verdict == hp.RUN:
            self.feed(machine, d.Command(cmd), now)

    def send_refusals(self, now: int) -> int:
        """Produce the TaskCommandRefused events whose verdict is final (``gate.Judge``)."""
        if self.consumer is None:
            return 0
        refused = self.judge.refusals(self.consumer, now, self.offsets)
        for ev in refused:
            if ev.payload["machine_id"] not in self.failed:
                self.producer.send(ev, validate=False)
        for task, machine in self.judge.take_stops():  # placed elsewhere since: a START read before the move
            state = self.states.get(machine)
            if state is not None and task in state.tasks:
                self.feed(machine, d.Unplaced(task), now)
        if refused:
            self._dirty = True
        return len(refused)

    # -- host profiles -------------------------------------------------------------------------------------
    def host(self, machine_id: str) -> hp.HostState:
        return self.hosts.get(machine_id) or hp.HostState(machine_id)

    def _keep_host(self, host: hp.HostState) -> None:
        if host.idle:
            self.hosts.pop(host.machine_id, None)
        else:
            self.hosts[host.machine_id] = host
        self._dirty = True

    def profile_request(self, ev: Event, now: int) -> None:
        machine = ev.payload["machine_id"]
        if machine not in self.known or machine in self.failed:
            return
        host, events, actions = hp.request(self.host(machine), ev, now)
        self._keep_host(host)
        self._profile_events(events)
        self._schedule(actions, now)

    def _schedule(self, actions: Iterable[hp.Apply], now: int) -> None:
        for act in actions:
            due = now + catalogue.switch_ms(act.host_profile, self.profile_switch_scale)
            heapq.heappush(self._switches, (due, act.machine_id, act.request_id))

    def _profile_events(self, events: Iterable[Event]) -> None:
        for ev in events:
            if ev.type == "TaskStateChanged":
                self._outbox.append(ev)  # a held START answered FAILED: batched with the step's reports
            else:
                self.producer.send(ev, validate=False)

    def due_switches(self, now: int) -> int:
        """Profile switches whose time came: applied (or failed, on a machine of ``profile_failures``); the STARTs
        they held run."""
        n = 0
        while self._switches and self._switches[0][0] <= now:
            _, machine, request_id = heapq.heappop(self._switches)
            if machine in self.failed:
                continue
            host = self.host(machine)
            to = host.switching.host_profile if host.switching is not None else ""
            error = ("simulated: the profile's settings could not be applied"
                     if {machine, f"{machine}:{to}"} & self.profile_failures else None)
            host, events, actions, run = hp.done(host, request_id, now, error)
            self._keep_host(host)
            self._profile_events(events)
            self._schedule(actions, now)
            for cmd in run:
                self.feed(machine, d.Command(cmd), now)
            n += 1
        return n

    def send_reports(self, now: int) -> int:
        """Produce the reports made since the last call, batched (``d.batch``); returns how many reports."""
        reports, self._outbox = self._outbox, []
        for ev in d.batch(reports, self.name, now):
            self.producer.send(ev, validate=False)
        self.reports += len(reports)
        return len(reports)

    def due_spawns(self, now: int) -> int:
        n = 0
        while self._spawns and self._spawns[0][0] <= now:
            due, machine_id, task_id = heapq.heappop(self._spawns)
            if self._spawn_due.get((machine_id, task_id)) != due:
                continue  # stale: its start ended early (``_spawned_first``), or a later start replaced it
            del self._spawn_due[(machine_id, task_id)]
            if machine_id in self.states:
                self.feed(machine_id, d.Spawned(task_id), now)
                n += 1
        return n

    def due_heartbeats(self, now: int, max_batch: int = MAX_BATCH) -> int:
        """Produce the heartbeats due by ``now`` (machine i at round start + i*interval/N), at most max_batch."""
        total = len(self.machines)
        if total == 0:
            return 0
        if self._next >= total:
            if now < self._round_start + self.interval_ms:
                return 0
            self._round_start += self.interval_ms
            if self._round_start + self.interval_ms <= now:  # fell a whole round behind: start afresh
                self._round_start = now
            self._round += 1
            self._next = 0
        if self._round == 0:
            self._round, self._round_start = 1, now
        due = min(total, (now - self._round_start) * total // self.interval_ms + 1)
        end = min(due, self._next + max_batch)
        send = self.beats.send
        for i in range(self._next, end):
            m = self.machines[i]
            if m in self.failed:
                continue
            st = self.states.get(m)
            send(d.heartbeat(m, self.incarnations.get(m, self.incarnation), self._round,
                             st.live_task_ids() if st is not None else [], now), validate=False)
            self.heartbeats += 1
        sent = end - self._next
        self._next = end
        return sent

    def due_loads(self, now: int) -> int:
        """Every ``load_interval_ms``: one JobLoadReported per job of ``loads`` (its trace's load now, its tasks
        running here)."""
        if not self.loads or now < self._next_load_ms:
            return 0
        self._next_load_ms = now + self.load_interval_ms
        running: dict[str, int] = {}
        for st in self.states.values():
            for tid in st.live_task_ids():
                job = tid.rsplit("/", 1)[0]
                running[job] = running.get(job, 0) + 1
        for load in self.loads:
            self.producer.send(load.sample(now, running.get(load.job_id, 0), self.name), validate=False)
        return len(self.loads)

    # -- running -------------------------------------------------------------------------------------------
    def connect(self, start_offsets=None) -> None:
        """Read every partition of ``tasks`` and ``allocations``, from ``start_offsets``, else the state file's, else
        the beginning; ``unavailability`` from where the state file left it, else from its end once its power events
        are folded (``catch_up_power``: which machines are dark now, before any command)."""
        start = dict(start_offsets or self.offsets)
        if not any(t == self.unavailability for t, _ in start):
            start.update(self.catch_up_power())
        self.consumer = EventConsumer(self.cfg, self.registry, [self.topic, self.allocations, self.unavailability],
                                      name=self.name, start_offsets=start,
                                      dead_letters=DeadLetters(self.producer, self.name),
                                      types=d.COMMAND_TYPES | g.ALLOCATION_TYPES | {hp.REQUEST_TYPE} | pw.TYPES,
                                      keep_refused=True,  # forged commands: answered (gate.forged)
                                      follows=True)

    def catch_up_power(self) -> dict[tuple[str, int], int]:
        """Fold the power events of ``unavailability`` up to its end (a fresh agent: the machines of a DC whose
        power is still off stay dark); returns where to read on from, per partition."""
        consumer = EventConsumer(self.cfg, self.registry, [self.unavailability], name=f"{self.name}-power",
                                 types=pw.TYPES)
        try:
            nexts = {tp: high for tp, (_, high) in consumer.watermarks().items()}

            def fold(records) -> None:
                for r in records:
                    self.on_power(r.event)
                    nexts[(r.topic, r.partition)] = max(nexts.get((r.topic, r.partition), 0), r.offset + 1)

            read_to_end(consumer, fold)
        finally:
            consumer.close()
        return nexts

    def step(self, poll_s: float = 0.05) -> None:
        if self.consumer is not None:
            records = self.consumer.poll(10_000, poll_s, linger_s=0.0)
            self.judge.take_refused(self.consumer, self.known.__contains__, now_ms(), self.consumer.dead_letters)
            self.on_commands((r.event for r in records), now_ms())
            for r in records:
                self.offsets[(r.topic, r.partition)] = r.offset + 1
        else:
            time.sleep(poll_s)
        now = now_ms()
        self.due_switches(now)
        self.send_refusals(now)
        self.due_spawns(now)
        self.send_reports(now)
        self.due_heartbeats(now)
        self.due_loads(now)
        self.producer.poll(0)  # serve delivery reports (EventProducer polls every 1000 sends only)
        self.beats.poll(0)
        self.maybe_save()

    def run(self, until: float | None = None) -> None:
        if self.consumer is None:
            self.connect()
        self.loop(until)

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
        self.send_reports(now_ms())
        self.producer.flush()
        self.beats.flush()
        self.producer.stop_following()
        self.save()  # after the flush: the reports of the saved state are on the log


def measure_heartbeats(cfg: Config, n_machines: int, interval_ms: int, seconds: float,
                       registry: SchemaRegistry | None = None) -> dict:
    """Heartbeats/s one process sustains: ``n_machines`` beating every ``interval_ms`` for ``seconds``
    (everything flushed to the broker). With an interval shorter than one process can serve, the rate is the
    ceiling."""
    sim = SimulatedAgents(cfg, [f"sim-{i:06d}" for i in range(n_machines)], registry=registry,
                          interval_ms=interval_ms)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        sim.due_heartbeats(now_ms())
        sim.beats.poll(0)
    sim.beats.flush(120)
    elapsed = time.monotonic() - t0
    return {"machines": n_machines, "interval_ms": interval_ms, "seconds": round(elapsed, 2),
            "heartbeats": sim.heartbeats, "per_s": round(sim.heartbeats / elapsed),
            "wanted_per_s": round(n_machines * 1000 / interval_ms)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m processors.agent.simulated", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--region", help="region YAML: one simulated agent per machine of it")
    src.add_argument("--machines", type=int, help="N machines named sim-000000 …")
    ap.add_argument("--exclude", action="append", default=[], metavar="MACHINE",
                    help="a machine of the region another agent runs (repeatable)")
    ap.add_argument("--dc", action="append", default=[], metavar="DC",
                    help="simulate only the machines of this DC of the region (repeatable; default: every DC): "
                         "one process per DC shares a big region's heartbeats, as a real region's agents do")
    ap.add_argument("--interval-ms", type=int, default=DEFAULT_INTERVAL_MS, help="heartbeat interval per machine")
    ap.add_argument("--start-delay-ms", type=int, default=DEFAULT_START_DELAY_MS, help="START → RUNNING delay")
    ap.add_argument("--state-file", help="where the simulated machines' state is kept across restarts (JSON)")
    ap.add_argument("--profile-switch-scale", type=float,
                    help="host profile switch times are the catalogue's times this (ROPEWALK_PROFILE_SWITCH_SCALE)")
    ap.add_argument("--profile-fail", action="append", default=[], metavar="MACHINE[:PROFILE]",
                    help="a machine whose host profile switches (to PROFILE) fail (repeatable)")
    ap.add_argument("--load", action="append", default=[], metavar="JOB=SPEC",
                    help="emit a load signal for JOB from a daily trace (processors/agent/load.py), e.g. "
                         "e1.web=speed=2880;noise=0.02 (repeatable)")
    ap.add_argument("--load-interval-ms", type=int, default=1000, help="how often each load signal is sampled")
    ap.add_argument("--measure-s", type=float, help="only measure heartbeat throughput for this long, print JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from infra import metrics  # noqa: PLC0415 - start-up: prometheus_client (~20 ms); main only

    metrics.serve_worker(Config.from_env().run_dir)  # infra/metrics.py; `ropewalk up` lists the targets
    cfg = Config.from_env().as_principal("agent")
    if args.measure_s:
        print(json.dumps(measure_heartbeats(cfg, args.machines or 0, args.interval_ms, args.measure_s)))
        return 0
    if args.region:
        spec = load_region(Path(args.region))
        unknown = set(args.dc) - {dc.name for dc in spec.dcs}
        if unknown:
            print(f"simulated agents: --dc {', '.join(sorted(unknown))}: no such DC in {args.region}", file=sys.stderr)
            return 2
        ids = [m.id for m in iter_machines(spec) if m.id not in set(args.exclude) and (not args.dc or m.dc in args.dc)]
    else:
        ids = [f"sim-{i:06d}" for i in range(args.machines)]
    try:
        loads = [parse_job_load(spec, now_ms()) for spec in args.load]
    except LoadSpecError as exc:
        print(f"simulated agents: {exc}", file=sys.stderr)
        return 2
    sim = SimulatedAgents(cfg, ids, interval_ms=args.interval_ms, start_delay_ms=args.start_delay_ms,
                          state_file=args.state_file, profile_switch_scale=args.profile_switch_scale,
                          profile_failures=args.profile_fail, loads=loads, load_interval_ms=args.load_interval_ms)
    sim.stop_on_signals()
    log.info("simulating %d machines, heartbeat every %d ms, reading %s", len(ids), args.interval_ms, sim.topic)
    sim.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
