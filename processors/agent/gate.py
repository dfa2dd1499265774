"""An agent runs only what the scheduler signed and the allocator placed: every command is judged here.

The ``tasks`` topic is written by the scheduler (commands) and by the agents (reports), so the broker's ACL cannot
tell a scheduler's command from one an agent principal forged. Three checks, in this order:

* **Signed by the scheduler** (issue 27). Every command batch is signed with the scheduler's Ed25519 key over all it
  says (tasks, machines, spec versions, argv, env, resources, host profile: ``streams/auth.py``); the agent's
  consumer checks the signature against the scheduler's public key (pinned in the agent's file, rotations from the
  ``keys`` topic) and hands over only what verifies, with its proven ``identity``. A command that does not verify
  (forged, altered, unsigned, signed with a retired key) never reaches the gate: the wiring answers it with a
  ``TaskCommandRefused`` naming why (``forged``: unsigned, bad_proof, ...) and the record is dead-lettered. The gate then checks the proven
  identity is the scheduler's (or the operator's) — for STOP too: a forged STOP is refused like a forged START.
* **Placed here.** ``allocations`` is written only by the scheduler and the allocator (``infra/acls.py``); a START or
  RESTART runs only if the agent's fold of it says the allocator placed that task on its machine, for the command's
  entitlement and job.
* **Not older than the last command applied** to the task (``stale_command``). A signature proves who wrote a
  command, not that it is the latest: a copy of an old, genuinely signed STOP (or START of an older spec version)
  written again by an agent principal verifies. The agent keeps, per task placed on it, the time (the scheduler's
  own, signed) of the last command it applied, and refuses an older one. (Not the spec version: a canary rolled
  back runs an older version on purpose, ``processors/scheduler/versions.py``.) Commands of one task come on one
  partition, in order; across partitions (an entitlement moving) an older one read late is refused, not applied.

Anything else is refused with a ``TaskCommandRefused`` event on ``tasks`` naming the reason. In a region without keys
(``infra/trust.py``: nothing is signed) the first check falls back to the command's envelope producer.

Commands and placements travel on two topics, read by one consumer: a START may be read before the TasksAllocated
that placed it (written before it, but on another partition of another topic). So a START whose placement is
not (yet) in the fold WAITS; once the agent has read ``allocations`` up to the high watermarks measured after the
command arrived (``Gate.expire``, driven by the wiring), every placement written before the command is in the
fold and the verdict is final: still not placed, it is refused.

A STOP is not judged by the placement (stopping is what a fenced or forgotten task needs); its origin and its
freshness are.

**A fold behind the log admits a stale START** (issue 26). The fold places a task here until it reads the event that
moves it: a START read before that event (a scheduler shard that woke up stale after the move — SIGSTOPped past its
group's session timeout — and commands the task where it was) is admitted, and runs beside the task's new machine.
The new owner's STOP to the old machine (the move's fence) may have come before it, and the scheduler ignores a
report from a machine its task left, so nothing else would ever stop that run. So the fold also says which of our
machines a task left (``Gate.take_unplaced``: placed on another machine, or freed) and, once the agent has read
``allocations`` up to the high watermarks measured after that (``Judge.refusals``, as for a waiting command: a task
moved away and back here is not stopped for the move it already undid), the wiring stops the task there if it runs
it and the fold still does not place it there (``Judge.take_stops`` -> ``decide.Unplaced``, reported STOPPED
``not_placed``): the double run lasts as long as the agent's fold lags, not for good. (Refusing such a START outright needs a version of the placement in the command
to compare with the fold's, or every START to wait for the fold to reach the high watermarks: not done.)
**These pending stops are saved in the agent's state file** with the gate (``Judge.to_json``), atomically with the
offsets past the move: an agent killed between reading the move and stopping the task resumes from those offsets,
so its fold never reads the move again and could not find the stop again by itself. Reloaded, they are judged
again like a move just read (``Judge.load_json``).

Pure but for the state the ``Gate`` object holds: no I/O, no clock (the caller passes marks and times).

    gate = Gate(machine_ok)
    gate.admit(cmd, mark)   -> ADMIT | WAIT | a refusal reason (final)
    gate.fold(ev)           -> the waiting commands a TasksAllocated now admits (in arrival order)
    gate.expire(mark)       -> [(command, reason)] for the waiting commands that arrived at or before ``mark``
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

from processors.agent.decide import commands
from streams import auth, batches
from streams.events import Event, derived_event_id, new_event

ALLOCATION_TYPES = frozenset({"TasksAllocated", "TasksDeallocated"})  # what an agent reads of ``allocations``
SCHEDULER_PRODUCERS = ("scheduler",)  # a command's envelope producer: ``scheduler`` or ``scheduler/<n>``
COMMANDERS = frozenset({"scheduler", auth.OPERATOR})  # who may command an agent (the proven identity)

ADMIT = "admit"
WAIT = "wait"

# Why a command was refused (TaskCommandRefused.reason).
REFUSED_NOT_ALLOCATED = "not_allocated"  # no placement of the task on this machine in the allocations log
REFUSED_OTHER_ENTITLEMENT = "allocated_to_other_entitlement"  # placed here, but for another entitlement
REFUSED_OTHER_JOB = "allocated_to_other_job"  # placed here, but for another job
REFUSED_NOT_SCHEDULER = "not_from_scheduler"  # not proven to come from the scheduler (or the operator)
REFUSED_STALE = "stale_command"  # older than the last command applied to the task: a copy of an old one
# (and, for a command whose proof failed, the reason of streams/auth.py: unsigned, bad_proof, unknown_key, ...)

JUDGED = frozenset({"START", "RESTART"})  # commands that run something, judged by the placement


@dataclass(frozen=True, slots=True)
class Placement:
    machine_id: str
    entitlement: str
    job_id: str


def changes(ev: Event, machine_ok: Callable[[str], bool]) -> list[tuple[str, str, Placement | None]]:
    """What one ``allocations`` event changes in the placements of the machines ``machine_ok`` accepts, as
    ``(task_id, machine_id, placement or None)``: a TasksAllocated places (None: placed on another machine, so not
    on any of ours any more), a TasksDeallocated frees (None) the task from that machine. Other events: none. Pure."""
    if ev.type == "TasksAllocated":
        return [(p["task_id"], p["machine_id"],
                 Placement(p["machine_id"], ev.entitlement, ev.payload["job_id"]) if machine_ok(p["machine_id"])
                 else None) for p in ev.payload["placements"]]
    if ev.type == "TasksDeallocated":
        return [(p["task_id"], p["machine_id"], None) for p in ev.payload["placements"]]
    return []


def from_scheduler(cmd: Event) -> bool:
    """Whether the command comes from the scheduler (or the operator): its proven identity; in a region without keys
    (no identity proven) what its envelope producer says."""
    if cmd.identity is not None:
        return cmd.identity in COMMANDERS
    return cmd.producer in SCHEDULER_PRODUCERS or cmd.producer.startswith("scheduler/")


def verdict(cmd: Event, held: Placement | None, last_ms: int | None = None) -> str | None:
    """None if the command (a TaskCommanded for one of our machines) may act on the placement ``held`` for its task,
    given the time of the last command applied to it (``last_ms``), else why not. A STOP is judged by its origin
    and time only. Pure."""
    p = cmd.payload
    if not from_scheduler(cmd):
        return REFUSED_NOT_SCHEDULER
    if p["command"] in JUDGED:
        if held is None or held.machine_id != p["machine_id"]:
            return REFUSED_NOT_ALLOCATED
        if held.entitlement != cmd.entitlement:
            return REFUSED_OTHER_ENTITLEMENT
        if held.job_id != p["job_id"]:
            return REFUSED_OTHER_JOB
    if last_ms is not None and cmd.timestamp_ms < last_ms:
        return REFUSED_STALE
    return None


MESSAGES = {
    REFUSED_NOT_ALLOCATED: "the allocations log places task {task} on no machine of this agent as {machine}",
    REFUSED_OTHER_ENTITLEMENT: "task {task} is placed on {machine} for entitlement {held}, not {entitlement}",
    REFUSED_OTHER_JOB: "task {task} is placed on {machine} for job {held}, not {job}",
    REFUSED_NOT_SCHEDULER: "commands come from the scheduler; this one is proven to come from {identity}",
    REFUSED_STALE: "task {task} was last commanded by a newer command than this one (a copy of an old one?)",
}
FORGED_MESSAGE = "the command's proof does not verify against the scheduler's key: {detail}"


def refusal(cmd: Event, reason: str, held: Placement | None, now_ms: int, detail: str = "") -> Event:
    """The TaskCommandRefused answering ``cmd`` (its id derived from the command's: refusing it again is the same
    event); ``reason`` one of ours or, with its ``detail``, why its proof failed (``streams.auth.REASONS``). Pure."""
    p = cmd.payload
    if reason in auth.REASONS:
        message = FORGED_MESSAGE.format(detail=detail or reason)
    else:
        message = MESSAGES[reason].format(
            task=p["task_id"], machine=p["machine_id"], entitlement=cmd.entitlement, job=p["job_id"],
            identity=cmd.identity or f"nobody (its producer says {cmd.producer!r})",
            held=(None if held is None else
                  held.entitlement if reason == REFUSED_OTHER_ENTITLEMENT else held.job_id))
    return new_event("TaskCommandRefused", {
        "task_id": p["task_id"], "job_id": p["job_id"], "machine_id": p["machine_id"], "command": p["command"],
        "command_id": cmd.event_id, "command_producer": cmd.producer, "reason": reason, "message": message},
        entitlement=cmd.entitlement, entity_id=p["task_id"], producer=f"agent/{p['machine_id']}",
        causation_id=cmd.event_id or None, timestamp_ms=now_ms,
        event_id=derived_event_id("agent", "refused", p["machine_id"], cmd.event_id, reason))


def forged(ev: Event, reason: str, detail: str, machine_ok: Callable[[str], bool], now_ms: int) -> list[Event]:
    """The TaskCommandRefused answering each command of ``ev`` (a TaskCommanded or TasksCommanded whose proof a reader
    refused for ``reason``) addressed to a machine ``machine_ok`` accepts. Pure."""
    return [refusal(cmd, reason, None, now_ms, detail) for cmd in commands(ev, machine_ok)]


class Gate:
    """The placements of one agent process's machines, the time of the last command applied to each task placed on
    them, and the commands waiting for the fold to catch up."""

    def __init__(self, machine_ok: Callable[[str], bool]):
        self.machine_ok = machine_ok
        self.held: dict[str, Placement] = {}  # task -> its placement on one of our machines
        self.last: dict[str, int] = {}  # task placed here -> time of the last command applied to it
        self.waiting: list[tuple[int, Event]] = []  # (mark when it arrived, command), in arrival order
        self.unplaced: list[tuple[str, str]] = []  # (task, machine of ours it left) since ``take_unplaced``

    def fold(self, ev: Event) -> list[Event]:
        """Apply an ``allocations`` event; return the waiting commands it admits (removed from the wait)."""
        touched = set()
        for task, machine, placement in changes(ev, self.machine_ok):
            cur = self.held.get(task)
            if placement is not None:
                if cur is not None and cur.machine_id != placement.machine_id:  # moved between two of ours
                    self.unplaced.append((task, cur.machine_id))
                self.held[task] = placement
                touched.add(task)
            elif cur is not None and (ev.type == "TasksAllocated" or cur.machine_id == machine):
                del self.held[task]
                self.last.pop(task, None)
                self.unplaced.append((task, cur.machine_id))
        if not touched or not self.waiting:
            return []
        admitted, still = [], []
        for mark, cmd in self.waiting:
            if cmd.payload["task_id"] in touched and self._verdict(cmd) is None:
                admitted.append(cmd)
                self._applied(cmd)
            else:
                still.append((mark, cmd))
        self.waiting = still
        return admitted

    def take_unplaced(self) -> list[tuple[str, str]]:
        """The (task, machine) pairs whose placement on one of our machines the fold ended (another machine, or
        freed) since the last call, in fold order (``placed_on`` tells whether it is there again since)."""
        out, self.unplaced = self.unplaced, []
        return out

    def placed_on(self, task: str, machine: str) -> bool:
        """Whether the fold places ``task`` on ``machine`` now."""
        cur = self.held.get(task)
        return cur is not None and cur.machine_id == machine

    def _verdict(self, cmd: Event) -> str | None:
        task = cmd.payload["task_id"]
        return verdict(cmd, self.held.get(task), self.last.get(task))

    def _applied(self, cmd: Event) -> None:
        task = cmd.payload["task_id"]
        if task in self.held:  # forgotten with the placement (a task placed here again starts afresh)
            self.last[task] = max(self.last.get(task, cmd.timestamp_ms), cmd.timestamp_ms)

    def admit(self, cmd: Event, mark: int) -> str:
        """ADMIT (act on it now), WAIT (held until the fold catches up: ``fold`` or ``expire`` decides), or the
        reason it is refused now (a reason the fold cannot change)."""
        why = self._verdict(cmd)
        if why is None:
            self._applied(cmd)
            return ADMIT
        if why in (REFUSED_NOT_SCHEDULER, REFUSED_STALE):
            return why
        self.waiting.append((mark, cmd))
        return WAIT

    def expire(self, mark: int) -> list[tuple[Event, str, Placement | None]]:
        """The waiting commands that arrived at or before ``mark`` (the fold has read every placement written
        before them): each with why it is refused and the placement held for its task."""
        done = [(cmd, self._verdict(cmd)) for m, cmd in self.waiting if m <= mark]
        self.waiting = [(m, cmd) for m, cmd in self.waiting if m > mark]
        return [(cmd, why or REFUSED_NOT_ALLOCATED, self.held.get(cmd.payload["task_id"])) for cmd, why in done]

    # -- persistence (the agents' state files) ----------------------------------------------------------------
    def to_json(self) -> dict:
        return {"held": {t: [p.machine_id, p.entitlement, p.job_id] for t, p in sorted(self.held.items())},
                "last": dict(sorted(self.last.items())),
                "waiting": [[m, _event_json(cmd)] for m, cmd in self.waiting]}

    def load_json(self, doc: dict | None) -> None:
        doc = doc or {}
        self.held = {t: Placement(*v) for t, v in (doc.get("held") or {}).items()}
        self.last = {t: int(ms) for t, ms in (doc.get("last") or {}).items() if t in self.held}
        self.waiting = [(0, _event_of(e)) for _, e in doc.get("waiting") or ()]  # judged by the first expire


def _event_json(ev: Event) -> dict:
    return {"type": ev.type, "entitlement": ev.entitlement, "entity_id": ev.entity_id, "payload": dict(ev.payload),
            "producer": ev.producer, "causation_id": ev.causation_id, "timestamp_ms": ev.timestamp_ms,
            "event_id": ev.event_id, "identity": ev.identity}


def _event_of(d: dict) -> Event:
    return Event(**d)


class Judge:
    """A ``Gate`` fed by one consumer of ``tasks`` and ``allocations`` (the wiring both agents share; the consumer is
    a ``streams.clients.EventConsumer``, the only I/O). ``take(records)`` returns the commands to act on, in order;
    ``refusals(consumer, now_ms)`` the TaskCommandRefused events of the waiting commands whose verdict became final:
    once the consumer has read ``allocations`` up to the high watermarks measured after they arrived."""

    def __init__(self, gate: Gate, allocation_partitions: Iterable[tuple[str, int]]):
        self.gate = gate
        self.partitions = list(allocation_partitions)
        self.mark = 0  # one per ``take``: when a command arrived
        self.target: dict[tuple[str, int], int] | None = None  # high watermarks measured at ``target_mark``
        self.target_mark = 0
        self.refused: list[Event] = []  # refused at once (forged, not from the scheduler, stale): ``refusals``
        self.unplacing: list[tuple[int, str, str]] = []  # (mark, task, machine it left), until the fold is final
        self.stops: list[tuple[str, str]] = []  # (task, machine): the fold is final and places it elsewhere
        # ``unplacing`` and ``stops`` are saved with the gate (``to_json``): the fold that found them is not read
        # again after a restart (the agent resumes from its saved offsets, past the move).
        self.admitted = 0
        self.waited = 0

    def take(self, events: Iterable[Event], machine_ok: Callable[[str], bool], now_ms: int) -> list[Event]:
        """The commands (TaskCommanded, one per line of a TasksCommanded) to act on now, from ``events`` in order:
        allocation events are folded (and release the commands that waited for them)."""
        self.mark += 1
        act: list[Event] = []
        for ev in events:
            if ev.type in ALLOCATION_TYPES:
                released = self.gate.fold(ev)
                self.admitted += len(released)
                act += released
                continue
            act += self._judge(commands(ev, machine_ok), now_ms)
        self.unplacing += [(self.mark, t, m) for t, m in self.gate.take_unplaced()]
        return act

    def take_stops(self) -> Iterator[tuple[str, str]]:
        """The (task, machine) pairs to stop if that machine runs the task (``decide.Unplaced``): the fold placed the
        task elsewhere (or freed it), has read ``allocations`` up to the high watermarks measured after, and still
        does not place it there. Filled by ``refusals``; each taken out as the caller comes to it, so a state saved
        while the caller stops one (``to_json``) still holds the others."""
        while self.stops:
            yield self.stops.pop(0)

    # -- persistence (the agents' state files: the gate's, with the stops still pending) ---------------------------
    def to_json(self) -> dict:
        """The gate's state and the stops not yet made (``unplacing`` and ``stops``, as ``[task, machine]`` pairs)."""
        pending = [[t, m] for _, t, m in self.unplacing] + [[t, m] for t, m in self.stops]
        return {**self.gate.to_json(), "unplacing": pending}

    def load_json(self, doc: dict | None) -> None:
        """The state ``to_json`` saved. The pending stops are judged again, as those of a move folded just now: once
        the fold has read ``allocations`` up to the high watermarks measured after the restart, each is stopped if
        the fold still does not place its task there (a task moved back meanwhile is not stopped). A file without
        them (an older agent's) has none."""
        self.gate.load_json(doc)
        self.unplacing = [(0, t, m) for t, m in dict.fromkeys(tuple(u) for u in (doc or {}).get("unplacing") or ())]
        self.stops = []

    def take_refused(self, consumer, machine_ok: Callable[[str], bool], now_ms: int, dead_letters=None) -> int:
        """The records ``consumer`` refused for their proof (its ``refused``, emptied) that concern a machine
        ``machine_ok`` accepts: each command of them answered (``forged``), each record dead-lettered with its reason
        (on ``dead_letters``); the others are left to the agents and readers they concern. Returns how many concerned
        these machines."""
        taken, consumer.refused = consumer.refused, []
        mine = 0
        for ev, reason, detail, where in taken:
            answers = forged(ev, reason, detail, machine_ok, now_ms)
            if not answers and not any(machine_ok(m) for m in batches.machine_ids(ev)):
                continue
            mine += 1
            self.refused += answers
            if dead_letters is not None:
                dead_letters.route(**where, reason=reason, detail=detail)
        return mine

    def take_commands(self, cmds: Iterable[Event], now_ms: int) -> list[Event]:
        """``take`` for commands already taken out of their batches (TaskCommanded events for our machines)."""
        self.mark += 1
        return self._judge(cmds, now_ms)

    def _judge(self, cmds: Iterable[Event], now_ms: int) -> list[Event]:
        act = []
        for cmd in cmds:
            got = self.gate.admit(cmd, self.mark)
            if got == ADMIT:
                act.append(cmd)
            elif got == WAIT:
                self.waited += 1
            else:
                self.refused.append(refusal(cmd, got, None, now_ms))
        self.admitted += len(act)
        return act

    def refusals(self, consumer, now_ms: int, start: Mapping[tuple[str, int], int] | None = None) -> list[Event]:
        out, self.refused = self.refused, []
        if not self.gate.waiting and not self.unplacing:
            self.target = None
            return out
        if self.target is None:  # every placement written before the waiting commands is below these
            self.target, self.target_mark = consumer.high_watermarks(self.partitions), self.mark
        elif consumer.read_up_to(self.target, start or {}):
            out += [refusal(cmd, why, held, now_ms) for cmd, why, held in self.gate.expire(self.target_mark)]
            final = [(t, m) for mark, t, m in self.unplacing if mark <= self.target_mark]
            self.unplacing = [u for u in self.unplacing if u[0] > self.target_mark]
            self.stops += [(t, m) for t, m in dict.fromkeys(final) if not self.gate.placed_on(t, m)]
            self.target = None
        return out
