"""The region as its log says it was at any moment, and its decisions made again. Pure: no faust, Kafka or Redis
(the reading is ``reader.py``'s, the snapshots ``snapshots.py``'s).

    region = Region(topics)                                   # or snapshots.load(...): a Region at a cut
    for event, position in reader.merged(...):                # the log in ``fold.merged`` order
        region.read(event, position)
        if event.timestamp_ms > moment + region.lookahead_ms:
            break
    region.advance(moment)
    region.machine_states(), region.job_states()              # what machine list / job status printed then

**Two processors, two orders, one clock.** The region is what two processors hold: the allocator's fold of the
log (``fold.RegionFold``: machines, placements, entitlements) and the scheduler's state (``decide.SchedulerState``:
jobs and tasks). Both are rebuilt by the processors' own code, record by record:

* the fold applies the allocator's sources in ``fold.merged`` order (as a start and ``ropewalk rebuild`` do):
  the records of every partition, merged by envelope time;
* the scheduler's ``decide`` takes each of its inputs at the **time the live shard decided it**: the time of the
  outputs the shard stamped with that input as their cause (``causation_id``, ``timestamp_ms`` = its ``now_ms``).
  An input whose outputs are not on the log within ``lookahead_ms`` of it (it changed nothing visible) is taken at
  its own time, but never before an earlier input of its topic-partition (the shard reads a partition in order).
  The timer's decisions (``retry_unplaced``, outputs without a cause) are taken again at their time, for their
  partition's jobs, as the shard's timer ran them. Each partition has its own rate-limiter bucket, as in the shard.

So deciding an input needs the log up to ``lookahead_ms`` past it: ``read`` takes records ahead (they wait in
``_lag``), ``advance(cut)`` applies what lies at or before ``cut``. The moment ``cut`` is a **prefix of the merged
log**: every partition up to its first record stamped after ``cut`` (the records ``fold.merged`` yields before the
first one after ``cut``); an input is decided at ``cut`` when its decision time is at or before it.

**What equals the live region, and what cannot.** The fold is the allocator's (``ropewalk rebuild`` proves it
equal to the live index). The scheduler's state is its ``decide`` on the same inputs at the same ``now_ms``; what
the log does not record is the order of inputs of different topics decided in the same batch (taken by envelope
time) and the limiter's state between two decisions without outputs. ``machine_states`` gives each machine's
``MachineStatePublished`` as the allocator builds it, stamped with the time of the last event that changed the
machine (the live record is stamped when the outbox published it, up to ``PUBLISH_INTERVAL_S`` later);
``job_states`` gives each job's latest ``JobStatePublished`` as ``decide`` emitted it.

**Shadow** (``start_shadow``): from a cut on, the recorded decisions of the allocator are not applied; the
scheduler's requests are decided again by the allocator's own code on this fold under a placement ``Policy``, at
the time the live allocator decided the same request (else at once), and fed back to the scheduler at the time the
live shard read that decision (same event ids: same lookups). Agents' reports are recorded; a report about the
k-th placement of a task is moved to the machine of the k-th placement the shadow made (and dropped if it made
none), and a command the recorded scheduler never gave (a task placed only in the shadow) is answered by a
simulated agent (the agent's own ``decide``, ``start_delay_ms``). The requests one live allocator batch decided
(its decision time names it) are decided in the live allocator's order (``decide.in_decision_order``: by
partition from the one the decision time names, each in log order), so the live policy's shadow takes the recorded decisions. **What-if** (``start_what_if``): no log ahead at all;
events given are injected, every agent is simulated, the timer runs every ``retry_ms``.
"""
from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from infra.config import DEFAULT_MAX_TASKS_PER_JOB
from processors.agent import decide as agent
from processors.allocator.fastplace import PlacementIndex
from processors.allocator.fold import (
    ALLOCATOR_PRODUCER, DECISION_TYPES, EVENT_TYPES as FOLD_TYPES, FoldError, RegionFold, job_of, profile_state,
)
from processors.allocator.placement import LIVE, Entitlement, Plan, Policy, Request, run_policy
from processors.allocator.decide import in_decision_order, machine_state_event
from processors.allocator.processor import free_on_fold, place_on_fold
from processors.cowmap import CowMap
from processors.scheduler import decide as sd
from processors.scheduler import lifecycle as lc
from processors.scheduler import model as sm
from processors.scheduler import records
from processors.scheduler import steps
from processors.taskcontrol.limiter import DEFAULT_LIMITS, Bucket, Limits
from streams import batches, state as states
from streams.events import Event
from processors.scheduler.handover import MOVE_REQUESTED
from streams.partitioner import partition_for
from streams.topics import Topics

SOURCES = ("intents", "machines", "unavailability", "allocations", "tasks", "taskcontrol")  # logical topics read
LOOKAHEAD_MS = 60_000  # how long after an input the shard's decision of it may come and still be recognised
RETRY_MS = 10_000  # the scheduler's timer (shard.RETRY_S) where the log does not show when it ran
START_DELAY_MS = 200  # a simulated agent: START -> RUNNING (the simulated agents' default)
WHAT_IF_LATENCY_MS = 5  # what-if: a request to its decision, a command to its report (causes before effects)
SHADOW_AGENT = "agent/shadow"  # producer of a simulated agent's reports
WHAT_IF_TOPIC = "what-if"  # where a what-if's hypothetical events are "read" from
LOOP_REQUESTS = 100  # a job's allocation requests at one instant beyond which the shadow takes it for a loop
WAIT_TRIES = 8  # a silent input is tried again after this many decisions of its partition at most, then decided
PRUNE_AT = 200_000  # remembered decision times beyond which those long past are forgotten
# The jobs ``decide.retry_unplaced`` acts on (it passes over the others): the only ones the timer is given here;
# and a stopped job awaiting the answer to its free request (``timer_acts_on``).
TIMER_STATES = frozenset({lc.JOB_ACTIVE, lc.JOB_STOPPING})
STATE_TYPES = frozenset({"JobStatePublished", "JobTasksPublished"})  # not read back: the shard coalesces them
ECHO_TYPES = frozenset({"MachineAssignedToEntitlement", "MachineReleasedToFreePool"})


def timer_acts_on(job: sm.Job) -> bool:
    """Whether the shard's timer may act on ``job`` (the jobs ``_timer`` gives ``retry_unplaced``)."""
    return job.status in TIMER_STATES or steps.frees_unanswered(job)

Position = tuple[str, int, int]  # (physical topic, partition, offset)

# Decision-queue kinds, in the order they go within one millisecond.
_INPUT, _TIMER, _ALLOC, _SPAWN, _FORCE = range(5)


class PolicyIndex(PlacementIndex):
    """fastplace's index placing under a placement ``Policy``: fastplace itself when the policy ranks as the live
    allocator does (whatever spread level it sets), else ``placement.run_policy`` over the snapshot fastplace
    would have placed on. Kept in step by the fold like the live one."""

    policy: Policy = LIVE

    @classmethod
    def under(cls, policy: Policy, machines: Iterable) -> "PolicyIndex":
        index = cls.of(machines)
        index.policy = policy
        return index

    def run(self, entitlement: Entitlement, request: Request, held_machine_count: int,
            dc: str | None = None, machine_type: str | None = None) -> Plan:
        if self.policy.live_scores:
            return super().run(entitlement, self.policy.request(request), held_machine_count, dc, machine_type)
        return run_policy(self.snapshot(entitlement.name, dc, machine_type), entitlement, request,
                          held_machine_count, self.policy)


def _decide(fold: RegionFold, request: Event, ts: int) -> list[Event]:
    """The allocator's own decision of one request (``free_on_fold`` then ``place_on_fold``: frees, then placement
    on the fold, committed to it) on a fold of ours; the processor's Redis commit is not part of it."""
    freeing = free_on_fold(fold, request, ts)
    placing, _ = place_on_fold(fold, request, 1, ts)
    return freeing + placing


@dataclass
class Agents:
    """Simulated machines for what no recorded agent reported: the agent's own ``decide`` per machine; a spawn
    runs ``start_delay_ms`` after its START, a kill exits at once. A machine the fold shows DOWN or UNHEALTHY is
    silent (its commands are lost, as on a dead machine)."""

    start_delay_ms: int = START_DELAY_MS
    report_delay_ms: int = 0  # from a decision to its report reaching the scheduler
    states: dict[str, agent.AgentState] = field(default_factory=dict)

    def feed(self, machine_id: str, inp: agent.Input, now: int) -> tuple[list[Event], list[tuple[int, str, str]]]:
        """The reports ``inp`` makes now, and the spawns it starts: (due ms, machine, task)."""
        st = self.states.get(machine_id) or agent.initial_state(machine_id)
        st, reports, actions = agent.decide(st, inp, now)
        spawns = []
        for act in actions:
            if act.kind == agent.SPAWN:
                spawns.append((now + self.start_delay_ms, machine_id, act.task_id))
            elif act.kind == agent.KILL:
                st, more, _ = agent.decide(st, agent.Exited(act.task_id, -15), now)
                reports += more
        st = agent.forget_finished(st)
        if st.tasks:
            self.states[machine_id] = st
        else:
            self.states.pop(machine_id, None)
        return reports, spawns


@dataclass
class ShadowLog:
    """What a shadow run decided, beside what the log recorded, for the diff (``shadow.compare``)."""

    policy: Policy
    since: int
    recorded: dict[str, list[Event]] = field(default_factory=lambda: defaultdict(list))  # request id -> decision
    decided: dict[str, list[Event]] = field(default_factory=dict)  # request id -> the shadow's decision
    requests: dict[str, Event] = field(default_factory=dict)  # request id -> the request (shadow's or recorded)
    scheduler_recorded: dict[str, Event] = field(default_factory=dict)  # event id -> the shard's output
    scheduler_decided: dict[str, Event] = field(default_factory=dict)  # event id -> the shadow scheduler's
    synthesized: int = 0  # reports made by simulated agents
    dropped_reports: int = 0  # recorded reports about a placement the shadow did not make
    controller_requests: list[Event] = field(default_factory=list)  # TaskControlRequested the shadow sent
    # requests of a job beyond LOOP_REQUESTS at one instant: decided a retry interval later (``Region._requested``)
    looped: Counter[str] = field(default_factory=Counter)
    _at_once: dict[tuple[str, int], int] = field(default_factory=dict)  # (job, instant) -> requests made then


class Region:
    def __init__(self, topics: Topics, *, limits: Limits = DEFAULT_LIMITS, max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB,
                 lookahead_ms: int = LOOKAHEAD_MS, scheduler_partitions: frozenset[int] | None = None,
                 gc_ms: int = sd.DEFAULT_JOB_GC_MS):
        self.topics = topics
        # None: the whole region. A set: only these partitions' jobs are decided (a *partial* region: its other jobs
        # stand as the snapshot left them; never written as a snapshot). The fold is always whole.
        self.scheduler_partitions = scheduler_partitions
        self.limits = limits
        self.max_tasks = max_tasks
        self.gc_ms = gc_ms  # a stopped job's grace (ROPEWALK_JOB_GC_S): the live shard's, so decisions are alike
        self._collected_to: int | None = None  # the cut of the last ``collect``
        self.lookahead_ms = lookahead_ms
        self.fold = RegionFold()
        self.scheduler = sm.SchedulerState()
        self.buckets: dict[int, Bucket | None] = {}  # the shard's bucket per partition
        self.cut: int | None = None  # everything up to this time is applied and decided
        self.read_to: int | None = None  # the latest envelope time read
        self.positions: dict[tuple[str, int], int] = {}  # per partition: the offset after the last record applied
        self.last_ids: dict[tuple[str, int], str] = {}  # per partition: the event id of the last record applied
        self.applied = 0  # records applied
        self.fold_failed = 0  # records the fold could not apply (the allocator dead-lettered them)
        self.decide_failed = 0  # inputs whose decision raised (the shard dead-lettered them)
        self.changed_ms: dict[str, int] = {}  # machine -> time of the event that changed it last
        # what changed since the last snapshot (snapshots.py writes only that, as a delta)
        self.dirty_machines: set[str] = set()
        self.dirty_published: set[str] = set()
        self.snapshot_jobs: dict[str, sm.Job] = {}  # the jobs as the last snapshot held them (compared by identity)
        self.snapshot_file: str | None = None  # that snapshot's file name
        self.snapshot_depth = 0  # deltas between it and its whole snapshot
        self.published: dict[str, Event] = {}  # job -> its latest JobStatePublished
        self.parts: dict[str, dict[int, list]] = {}  # job -> part -> tasks (JobTasksPublished)
        self.open_requests: dict[str, tuple[Event, int]] = {}  # request id -> (request, partition) undecided
        # deleted jobs a snapshot held (``decide.is_dormant``), as their records (JSON) and when they ended: decoded
        # only when an input names one (``wake``), so a look at a moment does not decode every job stopped lately
        self.dormant: dict[str, tuple[str, int | None]] = {}
        self._last_key: dict[tuple[str, int], int] = {}  # per topic-partition: the decision time of its last input
        self._lag: deque[tuple[Event, Position]] = deque()  # read, not applied yet (after ``cut``)
        self._queue: list[tuple] = []  # (time, rank, seq, kind, data): decisions to take
        self._seq = 0
        self._decided_at: dict[str, int] = {}  # input event id -> when the shard decided it (its outputs' time)
        self._alloc_at: dict[str, int] = {}  # request event id -> when the allocator decided it
        self._timers: set[tuple[int, int]] = set()  # (time, partition) of the timer's decisions read
        self._waiting: dict[int, list[tuple[Event, int, int]]] = {}  # partition -> silent inputs waiting: (input,
        # since, tries) (``_decide``)
        self._topic_rank = {topics.name(t): i for i, t in enumerate(SOURCES)}
        self.homes: dict[str, int] = {}  # entitlement -> where the log placed or moved it (else: its hash partition)
        self._partition_of: dict[str, int] = {}
        self._live_jobs: dict[int, set[str]] | None = defaultdict(set)  # per partition: jobs the timer may act on
        self.shadow: ShadowLog | None = None
        self.agents: Agents | None = None
        self._what_if = False
        self._retry_ms = RETRY_MS
        self._injected = 0
        self.alloc_delay_ms = 0  # a request no recorded decision answers: decided this long after it
        self.on_emit: Callable[[Event], None] | None = None  # every event the shadow or what-if decides (its log)
        # shadow: per task, the machines of its placements, recorded and shadow (the k-th corresponds)
        self._rec_machines: dict[str, list[str]] = defaultdict(list)
        self._shadow_machines: dict[str, list[str]] = defaultdict(list)
        self._rec_commands: Counter[tuple[str, int, str]] = Counter()  # (task, k, START|STOP) the shard gave
        self._shadow_commands: Counter[tuple[str, int, str]] = Counter()
        self._rec_placed_read: dict[str, list[str]] = defaultdict(list)  # as read (ahead): task -> machines

    # -- reading -------------------------------------------------------------------------------------------------
    def read(self, event: Event, position: Position) -> None:  # noqa: C901
        """The next record in ``fold.merged`` order; applied by a later ``advance``."""
        ts = event.timestamp_ms
        if self.read_to is None or ts > self.read_to:
            self.read_to = ts
        if sd.is_own(event):
            cause = event.causation_id
            if cause is None:
                if (ts, position[1]) not in self._timers:
                    self._timers.add((ts, position[1]))
                    self._push(ts, (_TIMER, position[1]), _TIMER, position[1])
            elif cause not in self._decided_at or ts < self._decided_at[cause]:
                self._decided_at[cause] = ts
            if self.shadow is not None and event.type not in ("JobStatePublished", "JobTasksPublished"):
                self.shadow.scheduler_recorded[event.event_id] = event
                if event.type == batches.TASKS_COMMANDED:
                    self._read_commands(event)
        elif self.shadow is not None and event.producer == ALLOCATOR_PRODUCER and (
                event.type in DECISION_TYPES or event.type in ECHO_TYPES):
            cause = event.causation_id
            if cause is not None:
                if event.type in DECISION_TYPES and (cause not in self._alloc_at or ts < self._alloc_at[cause]):
                    self._alloc_at[cause] = ts
                self.shadow.recorded[cause].append(event)
                if event.type == "TasksAllocated":
                    for r in event.payload["placements"]:
                        self._rec_placed_read[r["task_id"]].append(r["machine_id"])
        self._lag.append((event, position))

    def _read_commands(self, event: Event) -> None:
        """A recorded TasksCommanded read ahead: which (task, placement, command) the shard gave, so a shadow
        command with a recorded counterpart is answered by the recorded reports, not by a simulated agent."""
        for c in batches.task_commands(event):
            placed = self._rec_placed_read.get(c["task_id"], ())
            k = _last_index(placed, c["machine_id"])
            if k is not None:
                self._rec_commands[(c["task_id"], k, _kind(c["command"]))] += 1

    # -- applying ------------------------------------------------------------------------------------------------
    def advance(self, cut: int) -> None:
        """Apply every record read up to ``cut`` (a prefix of the merged log) and take every decision due by then,
        in time order. The records up to ``cut + lookahead_ms`` must have been read (or the log's end)."""
        lag, queue = self._lag, self._queue
        while True:
            rec = lag[0] if lag and lag[0][0].timestamp_ms <= cut else None
            item = queue[0] if queue and queue[0][0] <= cut else None
            if rec is None and item is None:
                break
            if rec is not None and (item is None or rec[0].timestamp_ms <= item[0]):
                lag.popleft()
                self._apply(*rec)
            elif item is not None:
                heapq.heappop(queue)
                self._take(item)
        if self.cut is None or cut > self.cut:
            self.cut = cut
        if self._collected_to is None or cut - self._collected_to >= max(self.gc_ms, 60_000) // 4:
            self.collect(cut)
        if len(self._decided_at) > PRUNE_AT or len(self._timers) > PRUNE_AT:
            self._prune(cut)

    def collect(self, now: int) -> None:
        """The jobs whose grace passed at ``now`` leave the scheduler's state (``decide.collect``, as the live
        shard's timer takes them; ``decide`` takes them for gone either way, so when does not matter), and the
        dormant ones with them: a region's memory and its snapshots hold the jobs of the last grace, not every job
        it ever stopped."""
        self._collected_to = now
        self.scheduler, _ = sd.collect(self.scheduler, now, self.gc_ms)
        gone = [j for j, (_, ended) in self.dormant.items() if sd.ended_before(lc.JOB_DELETED, ended, now, self.gc_ms)]
        for j in gone:
            del self.dormant[j]

    def _prune(self, cut: int) -> None:
        """Forget decision times whose input was applied long ago (outputs of inputs before a snapshot's cut)."""
        old = cut - 2 * self.lookahead_ms
        self._decided_at = {k: v for k, v in self._decided_at.items() if v >= old}
        self._timers = {t for t in self._timers if t[0] >= old}

    def pending(self) -> int:
        """Records read but not applied, and decisions not taken."""
        return len(self._lag) + len(self._queue)

    def _push(self, when: int, rank: tuple, kind: int, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (when, rank, self._seq, kind, data))

    def _apply(self, event: Event, position: Position) -> None:  # noqa: C901
        tp = (position[0], position[1])
        self.positions[tp] = position[2] + 1
        self.last_ids[tp] = event.event_id
        self.applied += 1
        own = sd.is_own(event)
        decision = event.producer == ALLOCATOR_PRODUCER and (event.type in DECISION_TYPES or event.type in ECHO_TYPES)
        if self.shadow is not None and (own or decision):
            if decision and event.type == "TasksAllocated":
                for r in event.payload["placements"]:
                    self._rec_machines[r["task_id"]].append(r["machine_id"])
            return  # the shadow decides these again
        if event.type in FOLD_TYPES:
            self._fold(event, position)
        if event.type == "AllocationRequested":
            self.open_requests[event.event_id] = (event, position[1])
        elif decision and event.causation_id is not None:
            self.open_requests.pop(event.causation_id, None)
        if event.type == MOVE_REQUESTED:
            self._moved(event)
        elif event.type == "EntitlementCreated" and event.entitlement not in self.homes:
            self.homes[event.entitlement] = tp[1]  # where it was created: the partition map's choice
            self._partition_of.pop(event.entitlement, None)
        if event.type in sd.CONSUMED and not own:
            if self.shadow is not None and event.type in ("TaskStatesChanged", "TaskStateChanged"):
                translated = self._translate(event)
                if translated is None:
                    return
                event = translated
            self._enqueue_input(event, tp, self._topic_rank.get(position[0], len(SOURCES)), position[2])

    def _moved(self, event: Event) -> None:
        """An entitlement moved to another partition (processors/scheduler/handover.py): its decisions take that
        partition's rate-limiter bucket from then on, as the shard that adopts it does. One whole region holds every
        partition's jobs here, so nothing else of a move concerns it. (A move the scheduler refused, to a partition
        the topics have, is taken as made: a known approximation of the buckets.)"""
        to = event.payload.get("to_partition")
        if isinstance(to, int) and 0 <= to < self.topics.partitions:
            self.homes[event.entitlement] = to
            self._partition_of.pop(event.entitlement, None)

    def _fold(self, event: Event, position: Position | None) -> None:
        try:
            self.fold.apply(event, position)
        except FoldError:
            self.fold_failed += 1  # as the allocator: dead-lettered there, skipped here
            return
        for mid in self.fold.drain_changes():
            self.changed_ms[mid] = event.timestamp_ms
            self.dirty_machines.add(mid)

    def _enqueue_input(self, event: Event, tp: tuple[str, int], topic_rank: int, offset: int, *,
                       recorded: bool = True) -> None:
        """Queue an input at its decision time. ``recorded``: it is the log's, so the log says whether the shard's
        decision of it had outputs; one that had none (``silent``) is decided where it makes none (``_decide``)."""
        ts = event.timestamp_ms
        key = max(ts, self._last_key.get(tp, ts))
        decided = self._decided_at.pop(event.event_id, None)
        silent = recorded and not self._what_if and (decided is None or decided > ts + self.lookahead_ms)
        if not silent and decided is not None and decided <= ts + self.lookahead_ms:
            key = max(key, decided)
        self._last_key[tp] = key
        if self.scheduler_partitions is not None and tp[1] not in self.scheduler_partitions:
            return  # a partial region: this partition's jobs are not asked about
        self._push(key, (_INPUT, ts, topic_rank, tp[1], offset), _INPUT, (event, tp[1], silent))

    def _take(self, item: tuple) -> None:  # noqa: C901
        when, _, _, kind, data = item
        if kind == _INPUT:
            self._decide(data[0], data[1], when, silent=data[2])
        elif kind == _TIMER:
            self._timer(when, data)
            if self._what_if:
                self._push(when + self._retry_ms, (_TIMER, data), _TIMER, data)
        elif kind == _FORCE:
            self._force(data[0], data[1], when)
        elif kind == _ALLOC:
            batch = [data]
            while self._queue and self._queue[0][0] == when and self._queue[0][3] == _ALLOC:
                batch.append(heapq.heappop(self._queue)[4])
            self._allocate(batch, when)
        elif kind == _SPAWN:  # the spawns due now, reported together (an agent reports a poll step at once)
            due = [data]
            while self._queue and self._queue[0][0] == when and self._queue[0][3] == _SPAWN:
                due.append(heapq.heappop(self._queue)[4])
            reports, spawns = [], []
            for machine, task in due:
                if self.agents is not None and self._alive(machine):
                    more, later = self.agents.feed(machine, agent.Spawned(task), when)
                    reports += more
                    spawns += later
            self._agent_reports(reports, spawns, when)

    # -- the scheduler -------------------------------------------------------------------------------------------
    def partition(self, entitlement: str) -> int:
        p = self.homes.get(entitlement)
        if p is None:
            p = self._partition_of.get(entitlement)
        if p is None:
            p = self._partition_of[entitlement] = partition_for(entitlement, self.topics.partitions)
        return p

    def _decide(self, event: Event, partition: int, now: int, *, silent: bool = False, retry: bool = True) -> bool:
        """``decide`` one input at ``now`` with its partition's bucket. A ``silent`` input (the shard's decision of it
        put nothing on the log) whose decision here would put something there came later in the shard than here
        (in the same batch as, or after, an input that did the work it would do: a machine's failure seen through
        its MachineStatusChanged and its UnavailabilityStarted): it waits, and is tried again after each decision
        of its partition that has outputs, until it decides silently or ``lookahead_ms`` passed (``_force``).
        Returns whether it was decided."""
        if self.dormant:
            self.wake(sd.named_jobs(event))
        state = self.scheduler
        bucket = self.buckets.get(partition)
        if state.shard_bucket is not bucket:
            state = replace(state, shard_bucket=bucket)
        try:
            new, out = sd.decide(state, event, now, limits=self.limits, max_tasks=self.max_tasks, gc_ms=self.gc_ms)
        except Exception:  # noqa: BLE001 - as the shard: the event is dead-lettered, the state kept
            self.decide_failed += 1
            return True
        visible = any(e.type not in STATE_TYPES for e in out)
        if silent and visible:
            waiting = self._waiting.setdefault(partition, [])
            if retry:  # the first try: it is decided ``lookahead_ms`` from now at the latest
                self._push(now + self.lookahead_ms, (_FORCE, now, partition), _FORCE, (partition, event.event_id))
            waiting.append((event, now, 0))
            return False
        self.buckets[partition] = new.shard_bucket
        self.scheduler = new
        if event.type == "JobSubmitted" and self._live_jobs is not None:
            self._live_jobs[self.partition(event.entitlement)].add(event.payload.get("job_id", ""))
        self._scheduled(out, now)
        if visible and retry and self._waiting.get(partition):
            self._retry_waiting(partition, now)
        return True

    def wake(self, job_ids: Iterable[str]) -> None:
        """The dormant jobs among ``job_ids`` decoded into the scheduler's state (an input names them: ``decide``
        reads no other dormant job, ``decide.concerned_jobs``)."""
        woken = {j: records.job_from_record(json.loads(kept[0])) for j in job_ids
                 if (kept := self.dormant.pop(j, None)) is not None}
        if woken:
            self.scheduler = replace(self.scheduler, jobs=self.scheduler.jobs.updated(woken))

    def _retry_waiting(self, partition: int, now: int) -> None:
        """Try the partition's waiting inputs again, in order; one tried ``WAIT_TRIES`` times is decided whatever it
        emits."""
        waiting = self._waiting.pop(partition, [])
        left = []
        for event, since, tries in waiting:
            if not self._decide(event, partition, now, silent=tries < WAIT_TRIES, retry=False):
                self._waiting[partition].pop()  # re-added by _decide: kept in ``left``, in order
                left.append((event, since, tries + 1))
        if left:
            self._waiting[partition] = left + self._waiting.get(partition, [])

    def _force(self, partition: int, event_id: str, now: int) -> None:
        """A waiting input ``lookahead_ms`` after it began to wait: decided now, outputs or not."""
        waiting = self._waiting.get(partition, [])
        for i, (event, _, _) in enumerate(waiting):
            if event.event_id == event_id:
                del waiting[i]
                self._decide(event, partition, now, silent=False, retry=False)
                return

    def _timer(self, now: int, partition: int) -> None:
        """``retry_unplaced`` over the jobs of one partition with its bucket, as the shard's timer runs it."""
        if self.scheduler_partitions is not None and partition not in self.scheduler_partitions:
            return
        state = self.scheduler
        if self._live_jobs is None:  # (after a snapshot's load) every job once; then kept by ``_decide``
            self._live_jobs = defaultdict(set)
            for j in state.jobs.values():
                if timer_acts_on(j):
                    self._live_jobs[self.partition(j.entitlement)].add(j.id)
        ids = self._live_jobs.get(partition, set())
        # the timer acts on active and stopping jobs, and stopped ones awaiting their free: the others are left out
        jobs = [j for i in sorted(ids) if (j := state.jobs.get(i)) is not None and timer_acts_on(j)]
        ids.intersection_update(j.id for j in jobs)
        if not jobs:
            return
        part = sm.SchedulerState(entitlements=state.entitlements, jobs=CowMap((j.id, j) for j in jobs),
                                 machines_down=state.machines_down, shard_bucket=self.buckets.get(partition))
        new, out = sd.retry_unplaced(part, now, limits=self.limits)
        changed = {j.id: new.jobs[j.id] for j in jobs if new.jobs[j.id] is not j}
        self.buckets[partition] = new.shard_bucket
        if changed:
            self.scheduler = replace(state, jobs=state.jobs.updated(changed))
        self._scheduled(out, now)

    def _scheduled(self, events: Sequence[Event], now: int) -> None:  # noqa: C901
        for ev in events:
            if self.on_emit is not None:
                self.on_emit(ev)
            if ev.type in STATE_TYPES:
                self.dirty_published.add(ev.payload["job_id"])
            if ev.type == "JobStatePublished":
                if ev.payload.get("deleted"):
                    self.published.pop(ev.entity_id, None)
                    self.parts.pop(ev.entity_id, None)
                else:
                    self.published[ev.entity_id] = ev
                continue
            if ev.type == "JobTasksPublished":
                p = ev.payload
                parts = self.parts.setdefault(p["job_id"], {})
                if p["deleted"]:
                    parts.pop(p["part"], None)
                else:
                    parts[p["part"]] = p["tasks"]
                continue
            if self.shadow is None:
                continue
            self.shadow.scheduler_decided[ev.event_id] = ev
            if ev.type == "AllocationRequested":
                self._requested(ev, now)
            elif ev.type == batches.TASKS_COMMANDED:
                self._commanded(ev, now)
            elif ev.type == "TaskControlRequested":
                self.shadow.controller_requests.append(ev)

    # -- views -----------------------------------------------------------------------------------------------
    def machine_states(self) -> list[Event]:
        """Every machine's MachineStatePublished as the allocator builds it from its index, by machine id."""
        out = []
        for mid in sorted(self.fold.machines):
            m = self.fold.machines[mid]
            fields = {"id": mid, **m.fields(), "task_ids": sorted(m.tasks), **profile_state(self.fold, m)}
            out.append(machine_state_event(fields, None, self.changed_ms.get(mid, 0)))
        return out

    def job_states(self) -> dict[str, Event]:
        """Every job's latest JobStatePublished (with its tasks), deleted ones left out, by job id."""
        return {j: states.job_whole(ev, self.parts.get(j, {})) for j, ev in sorted(self.published.items())}

    # -- shadow ------------------------------------------------------------------------------------------------
    def start_shadow(self, policy: Policy, *, start_delay_ms: int = START_DELAY_MS) -> ShadowLog:
        """From ``cut`` on, decide the scheduler's requests again under ``policy`` (see the module doc). The records
        read ahead of ``cut`` are dropped: read the log again from ``positions``, so the shadow learns what they say."""
        assert self.cut is not None, "advance to the shadow's start first"
        self.shadow = ShadowLog(policy, self.cut)
        self.agents = Agents(start_delay_ms)
        self.fold.place_with(PolicyIndex.under(policy, (m.view() for m in self.fold.machines.values())))
        for task, mid in self.fold.placement.items():
            self._rec_machines[task] = [mid]
            self._shadow_machines[task] = [mid]
            self._rec_placed_read[task] = [mid]
        self._lag.clear()  # read again from ``positions`` (the decision times already read stay known)
        for rid, (ev, partition) in sorted(self.open_requests.items(), key=lambda kv: kv[1][0].timestamp_ms):
            self._requested(ev, ev.timestamp_ms, partition)
        self.open_requests.clear()
        return self.shadow

    def start_what_if(self, events: Sequence[Event], now: int, *, retry_ms: int = RETRY_MS,
                      start_delay_ms: int = START_DELAY_MS, latency_ms: int = WHAT_IF_LATENCY_MS) -> ShadowLog:
        """No log from here: ``events`` (hypothetical: a maintenance, a failure) happen at ``now``, every agent is
        simulated, requests are decided ``latency_ms`` after they are made (and reports come as late after their
        command) under the live policy, the timer runs every ``retry_ms`` for every partition (its phase in the live
        shard is unknown)."""
        self.advance(now)
        self._lag.clear()
        self.shadow = ShadowLog(LIVE, now)
        self.agents = Agents(start_delay_ms, report_delay_ms=latency_ms)
        self.alloc_delay_ms = latency_ms
        self._what_if = True
        self._retry_ms = retry_ms
        for task, mid in self.fold.placement.items():
            self._shadow_machines[task] = [mid]
        for task in self.fold.placement:  # their agents run them: simulated agents take them over
            self._adopt(task)
        self.inject(events)
        for ev, partition in [v for v in self.open_requests.values()]:
            self._requested(ev, now, partition)
        self.open_requests.clear()
        for p in range(self.topics.partitions):
            self._push(now + retry_ms, (_TIMER, p), _TIMER, p)
        return self.shadow

    @property
    def _log(self) -> ShadowLog:
        """The shadow's log: the shadow's paths run only once ``start_shadow`` or ``start_what_if`` made it."""
        if self.shadow is None:
            raise RuntimeError("not a shadow region: start_shadow() or start_what_if() first")
        return self.shadow

    @property
    def _agents(self) -> Agents:
        """The shadow's simulated agents (made with its log)."""
        if self.agents is None:
            raise RuntimeError("not a shadow region: start_shadow() or start_what_if() first")
        return self.agents

    def inject(self, events: Sequence[Event]) -> None:
        """What-if: hypothetical events, in time order (none before the last one injected), as records of their
        own: applied when the region advances to their time."""
        for ev in events:
            self._injected += 1
            self._lag.append((ev, (WHAT_IF_TOPIC, self.partition(ev.entitlement), self._injected)))

    def _adopt(self, task: str) -> None:
        """A task placed before the what-if: its simulated agent runs it (at the job's spec version)."""
        job = self.scheduler.jobs.get(job_of(task))
        if job is None:
            return
        t = job.tasks.get(task)
        if t is None or t.machine is None or t.state not in (lc.STARTING, lc.RUNNING):
            return
        run = agent.TaskRun(task_id=task, spec=agent.Spec(job.id, job.entitlement, t.spec_version, (), (), "adopted"),
                            phase=agent.P_RUNNING, reported=agent.RUNNING)
        agents = self._agents
        st = agents.states.get(t.machine) or agent.initial_state(t.machine)
        agents.states[t.machine] = st._with(run)

    def _requested(self, request: Event, now: int, partition: int | None = None) -> None:
        """A request of the shadow scheduler: its resources go into the fold at once (as the allocator folds a
        request it reads); it is decided when the live allocator decided the same request, else at once."""
        rid = request.event_id
        log = self._log
        log.requests[rid] = request
        self._fold(request, None)
        when = self._alloc_at.get(rid)
        if when is None or when < now or when > request.timestamp_ms + self.lookahead_ms:
            when = now + self.alloc_delay_ms
        job = request.payload["job_id"]
        key = (job, now)
        at_once = log._at_once[key] = log._at_once.get(key, 0) + 1
        if at_once > LOOP_REQUESTS:
            # A job asking again and again at one instant: the shadow's scheduler and allocator disagree on a machine
            # (seen: the shadow's scheduler held machines down that its allocator had up again, after a DOWN that
            # waited as a silent input was decided after its UP: each placement there was moved off at once, 20,000
            # decisions without time moving, and `ropewalk shadow` hung). Its next request is decided a retry
            # interval later, as the shard's timer would ask again; the report counts it (``looped``).
            log.looped[job] += 1
            when = max(when, now + self._retry_ms)
            if len(log._at_once) > PRUNE_AT:
                log._at_once.clear()
        p = self.partition(request.entitlement) if partition is None else partition
        self._push(when, (_ALLOC, request.timestamp_ms, p), _ALLOC, (request, p))

    def _allocate(self, batch: list[tuple[Event, int]], when: int) -> None:
        for request, partition in in_decision_order(batch, lambda b: b[1], when,
                                                    self.topics.partitions_of("allocations")):
            events = _decide(self.fold, request, when)
            for mid in self.fold.drain_changes():
                self.changed_ms[mid] = when
                self.dirty_machines.add(mid)
            self._log.decided[request.event_id] = events
            for ev in events:
                if self.on_emit is not None:
                    self.on_emit(ev)
                if ev.type == "TasksAllocated":
                    for r in ev.payload["placements"]:
                        self._shadow_machines[r["task_id"]].append(r["machine_id"])
                if ev.type in DECISION_TYPES:
                    tp = (self.topics.name("allocations"), partition)
                    self._enqueue_input(ev, tp, self._topic_rank[tp[0]], -1, recorded=False)

    def _translate(self, event: Event) -> Event | None:
        """A recorded agent report moved to the shadow's machine of the same placement (see the module doc)."""
        reports, changed = [], False
        for r in batches.task_reports(event):
            rec = self._rec_machines.get(r["task_id"])
            k = _last_index(rec, r.get("machine_id")) if rec else None
            if k is None:
                reports.append(r)
                continue
            mine = self._shadow_machines.get(r["task_id"], [])
            if k >= len(mine):
                self._log.dropped_reports += 1
                changed = True
                continue
            if mine[k] != r.get("machine_id"):
                r = {**r, "machine_id": mine[k]}
                changed = True
            reports.append(r)
        if not changed:
            return event
        if not reports:
            return None
        if event.type == "TaskStateChanged":
            r = reports[0]
            return replace(event, payload={k: v for k, v in r.items() if k not in ("report_id", "cause_id")})
        return replace(event, payload={**event.payload, "reports": reports})

    def _commanded(self, event: Event, now: int) -> None:
        """The shadow scheduler's commands: the recorded reports answer those the recorded scheduler gave too; a
        simulated agent answers the others."""
        reports: list[Event] = []
        spawns: list[tuple[int, str, str]] = []
        for cmd in batches.command_events(event):
            task, machine = cmd.payload["task_id"], cmd.payload["machine_id"]
            k = _last_index(self._shadow_machines.get(task, ()), machine)
            key = (task, -1 if k is None else k, _kind(cmd.payload["command"]))
            self._shadow_commands[key] += 1
            if not self._what_if and self._shadow_commands[key] <= self._rec_commands[key]:
                continue
            if not self._alive(machine):
                continue
            more, later = self._agents.feed(machine, agent.Command(cmd), now)
            reports += more
            spawns += later
        self._agent_reports(reports, spawns, now)

    def _agent_reports(self, reports: list[Event], spawns: list[tuple[int, str, str]], now: int) -> None:
        for due, machine, task in spawns:
            self._push(due, (_SPAWN, due, machine, task), _SPAWN, (machine, task))
        if not reports:
            return
        self._log.synthesized += len(reports)
        now += self._agents.report_delay_ms
        for ev in agent.batch(reports, SHADOW_AGENT, now):
            if self.on_emit is not None:
                self.on_emit(ev)
            tp = (self.topics.name("tasks"), self.partition(ev.entitlement))
            self._enqueue_input(ev, tp, self._topic_rank[tp[0]], -1, recorded=False)

    def _alive(self, machine: str) -> bool:
        m = self.fold.machines.get(machine)
        return m is not None and m.status not in ("DOWN", "UNHEALTHY")

def _last_index(machines: Sequence[str] | None, machine: str | None) -> int | None:
    if not machines or machine is None:
        return None
    for i in range(len(machines) - 1, -1, -1):
        if machines[i] == machine:
            return i
    return None


def _kind(command: str) -> str:
    return "STOP" if command == "STOP" else "START"  # a RESTART answers like a START


__all__ = ["Region", "PolicyIndex", "ShadowLog", "Agents", "SOURCES", "LOOKAHEAD_MS", "RETRY_MS"]
