"""Twine Figure 14 (§5.1): a rolling update of a sharded service under TaskControl while an MSB fails.

**An in-process simulation of the processors' pure decisions, no broker.** The scheduler is the real
``processors.scheduler.decide`` (``decide`` for every input, ``retry_unplaced`` as its timer); the TaskController
is the real ``ReplicaAware`` (min live replicas 2) behind the real controller library's bookkeeping
(``processors.taskcontrol.controller``: absorb / due / answer). What is simulated: the clock, the agents (a
START becomes RUNNING after ``start_s``, jittered and seeded; a STOP becomes STOPPED after ``stop_s``; agents on a
failed machine say nothing), the allocator (places a moved task on a free machine that is up, else rejects it
with ``no_feasible_machine``; the scheduler's timer asks again), and the failure (UnavailabilityStarted FAILURE
for the MSB's machines at ``msb_fail_at_s``, back UP with UnavailabilityEnded ``msb_down_s`` later).

Shards: ``shards`` × ``replicas`` replicas, each shard's replicas on distinct tasks drawn with ``seed`` (Shard
Manager-like placement that ignores fault domains, so an MSB can hold two replicas of a shard). A replica is
live while its task is RUNNING.

Counting (a shard counts once per total):

* ``shards_lost_second_replica_by_ropewalk``: shards whose live replicas fell below ``min_live`` when the
  scheduler took a task down (an update's STOP: any task leaving RUNNING on an input that is not the failure),
  plus shards that an ack approved an operation on while the approved tasks would leave them below
  ``min_live`` (acked while a replica was already down counts, even if the operation ran later).
* ``shards_lost_second_replica_by_failure``: shards whose live replicas fell below ``min_live`` at the MSB
  failure itself.
"""
from __future__ import annotations

import heapq
import json
import random
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from processors.scheduler import decide as sd
from processors.scheduler import lifecycle as lc
from processors.scheduler import model as sm
from processors.scheduler.lifecycle import OP_APPROVED, OP_RUNNING
from processors.scheduler.model import SchedulerState
from processors.taskcontrol import controller as ctl
from processors.taskcontrol.controllers import ReplicaAware
from processors.taskcontrol.limiter import Limits, Rate
from processors.taskcontrol.protocol import OP_UPDATE
from streams import batches
from streams.events import Event, new_event

ENT = "figure14"
JOB = "figure14.cache"
CONTROLLER = "shard-manager"
FAILURE_UE = "figure14-msb-failure"
SIMULATION_NOTE = ("in-process simulation of the processors' pure decisions (scheduler decide/retry_unplaced, "
                   "ReplicaAware through the controller library); simulated clock, agents and allocator; no broker")


@dataclass(frozen=True)
class Conditions:
    tasks: int = 1000
    shards: int = 15000
    replicas: int = 3
    min_live: int = 2
    msbs: int = 20  # tasks are spread round-robin over the MSBs (1 task per machine): tasks / msbs per MSB
    failed_msb: int = 0
    msb_fail_at_s: int = 120
    msb_down_s: int = 295  # the paper's failure lasted T120..T415
    stop_s: float = 5.0
    start_s: float = 220.0  # an update's start (package fetch, cache warm-up); the paper's batch took ~240 s
    jitter: float = 0.2  # start times uniform in start_s × [1 - jitter, 1 + jitter]
    controller_delay_s: float = 1.0
    allocator_delay_s: float = 1.0
    timer_s: float = 10.0  # the scheduler's retry_unplaced timer (shard.RETRY_S)
    step_s: float = 10.0  # one row of the curves
    max_s: float = 4 * 3600.0
    seed: int = 14
    placement: str = "grouped"  # "grouped" (replica r of each shard in the r-th slice of the tasks) or "random"
    limiter: str = "wide open (job and shard: 1,000,000/min, burst 1,000,000): TaskControl alone paces"

    def __post_init__(self) -> None:
        if not (1 <= self.replicas <= self.tasks and 1 <= self.msbs <= self.tasks and self.shards >= 1):
            raise ValueError(f"need 1 <= replicas <= tasks, 1 <= msbs <= tasks, shards >= 1; got {self}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not 0 <= self.failed_msb < self.msbs:
            raise ValueError(f"failed_msb must be in [0, {self.msbs}), got {self.failed_msb}")


PLACEMENTS = ("grouped", "random")


def place_replicas(tasks: int, shards: int, replicas: int, seed: int, placement: str = "grouped"
                   ) -> dict[str, list[str]]:
    """Task id → the shards it hosts: each shard's ``replicas`` replicas on distinct tasks, seeded.

    ``random``: any ``replicas`` distinct tasks. ``grouped`` (Shard Manager-like replica sets): the tasks are cut
    into ``replicas`` slices of consecutive indices and replica r of every shard goes to a task of slice r, so a
    whole slice can be down at once without any shard losing two replicas (what lets the paper's controller
    update 274 of 1,000 tasks at once; with random placement a greedy controller finds far fewer)."""
    rng = random.Random(seed)
    hosted: dict[str, list[str]] = {task_id(i): [] for i in range(tasks)}
    bounds = [tasks * r // replicas for r in range(replicas + 1)]
    for s in range(shards):
        if placement == "random":
            chosen = rng.sample(range(tasks), replicas)
        else:
            chosen = [rng.randrange(bounds[r], bounds[r + 1]) for r in range(replicas)]
        for i in chosen:
            hosted[task_id(i)].append(f"s{s}")
    return hosted


def task_id(i: int) -> str:
    return sm.task_id(JOB, i)


def machine_of(i: int) -> str:
    return f"m{i}"


def msb_of(i: int, c: Conditions) -> str:
    return f"msb{i % c.msbs}"


def failed_tasks(c: Conditions) -> list[str]:
    return [task_id(i) for i in range(c.tasks) if i % c.msbs == c.failed_msb]


@dataclass
class Result:
    conditions: Conditions
    rows: list[dict[str, Any]] = field(default_factory=list)
    by_ropewalk: set[str] = field(default_factory=set)
    by_ropewalk_at_ack: set[str] = field(default_factory=set)
    by_failure: set[str] = field(default_factory=set)
    peak_updating: int = 0
    update_done_s: float | None = None
    all_running_s: float | None = None
    down_before_failure: frozenset[str] = frozenset()
    decisions: int = 0
    acks: int = 0
    mode: str = SIMULATION_NOTE  # how the curves were made (this simulation, or figure14_pipeline's real run)

    def totals(self) -> dict[str, Any]:
        return {
            "shards_lost_second_replica_by_ropewalk": len(self.by_ropewalk | self.by_ropewalk_at_ack),
            "shards_lost_second_replica_by_failure": len(self.by_failure),
            "peak_concurrent_updates": self.peak_updating,
            "update_duration_s": self.update_done_s,
            "all_tasks_running_again_s": self.all_running_s,
            "peak_shards_one_replica_down": max((r["shards_1_down"] for r in self.rows), default=0),
            "peak_shards_two_or_more_down": max((r["shards_2plus_down"] for r in self.rows), default=0),
            "scheduler_decisions": self.decisions, "controller_acks": self.acks,
        }

    def document(self) -> dict[str, Any]:
        return {"experiment": "figure14", "mode": self.mode, "conditions": asdict(self.conditions),
                "failed_tasks": len(failed_tasks(self.conditions)), "totals": self.totals(), "curves": self.rows}


class _Run:
    """One simulation: the scheduler state, the controller's books, the agents' and allocator's pending
    answers on a heap keyed by simulated time (ms)."""

    def __init__(self, c: Conditions):
        self.c = c
        self.rng = random.Random(c.seed + 1)
        self.hosted = place_replicas(c.tasks, c.shards, c.replicas, c.seed, c.placement)
        self.decide_ctl = ReplicaAware(self.hosted, c.min_live)
        self.limits = Limits(job=Rate(1_000_000, 1_000_000), shard=Rate(1_000_000, 1_000_000))
        self.state = SchedulerState()
        self.books = ctl.Books()
        self.heap: list[tuple[int, int, Any]] = []
        self.seq = 0
        self.now = 0
        self.live = Counter({s: 0 for s in (f"s{i}" for i in range(c.shards))})
        self.running: set[str] = set()
        self.down_machines: set[str] = set()
        self.free_machines: set[str] = set()
        self.placed: dict[str, str] = {}  # task → machine (the simulated allocator's book)
        self.result = Result(c)
        self._n = 0

    # -- inputs ---------------------------------------------------------------------------------------------
    def ev(self, type_: str, payload: Mapping[str, Any], producer: str, entity: str, ent: str = ENT) -> Event:
        self._n += 1
        return new_event(type_, dict(payload), entitlement=ent, entity_id=entity, producer=producer,
                         timestamp_ms=self.now, event_id=f"fig14-in-{self._n}")

    def at(self, when_ms: int, item: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when_ms, self.seq, item))

    def spec(self, version: int) -> dict[str, Any]:
        return {"job_id": JOB, "name": JOB, "spec_version": version, "tasks": self.c.tasks,
                "command": ["cache", f"--release={version}"], "resources": {"cpu_millicores": 1000, "memory_mib": 1024},
                "requirements": {}, "spread": "msb", "max_unavailable": self.c.tasks, "env": {},
                "controller": CONTROLLER}

    def placement(self, tid: str, machine: str) -> dict[str, str]:
        i = int(machine[1:])
        return {"task_id": tid, "machine_id": machine, "dc": "dc1", "msb": msb_of(i, self.c), "rack": f"rk{i}"}

    # -- the scheduler --------------------------------------------------------------------------------------
    def feed(self, event: Event | None, *, failure: bool = False) -> None:
        before = self.state
        if event is None:
            self.state, out = sd.retry_unplaced(before, self.now, limits=self.limits)
        else:
            self.state, out = sd.decide(before, event, self.now, limits=self.limits)
        self.result.decisions += 1
        touched = {e.payload["task_id"] for e in out if "task_id" in e.payload}
        touched.update(c["task_id"] for e in out for c in batches.task_commands(e))
        touched.update(r["task_id"] for e in out for r in batches.task_reports(e))
        if event is not None and "task_id" in event.payload:
            touched.add(event.payload["task_id"])
        self._account(touched, failure)
        for e in out:
            self._react(e)

    def _account(self, touched: set[str], failure: bool) -> None:
        job = self.state.jobs.get(JOB)
        if job is None:
            return
        for tid in touched:
            t = job.tasks.get(tid)
            now_running = t is not None and t.state == lc.RUNNING
            if now_running and tid not in self.running:
                self.running.add(tid)
                for s in self.hosted[tid]:
                    self.live[s] += 1
            elif not now_running and tid in self.running:
                self.running.discard(tid)
                lost = self.result.by_failure if failure else self.result.by_ropewalk
                for s in self.hosted[tid]:
                    self.live[s] -= 1
                    if self.live[s] == self.c.min_live - 1:
                        lost.add(s)
        updating = sum(1 for t in job.tasks.values() if t.op == OP_UPDATE and t.op_state == OP_RUNNING)
        self.result.peak_updating = max(self.result.peak_updating, updating)

    def _react(self, e: Event) -> None:
        p, ms = e.payload, int(self.c.allocator_delay_s * 1000)
        if e.type in ("TaskCommanded", "TasksCommanded"):
            for c in batches.task_commands(e):
                if c["machine_id"] in self.down_machines:
                    continue  # the agent is gone with its machine
                if c["command"] == "STOP":
                    self.at(self.now + int(self.c.stop_s * 1000), ("report", c, "STOPPED"))
                else:
                    spread = self.rng.uniform(1 - self.c.jitter, 1 + self.c.jitter)
                    self.at(self.now + int(self.c.start_s * spread * 1000), ("report", c, "RUNNING"))
        elif e.type == "TaskControlRequested":
            self.books = ctl.absorb(self.books, e, CONTROLLER)
            self.at(self.now + int(self.c.controller_delay_s * 1000), ("controller",))
        elif e.type == "AllocationRequested":
            self.at(self.now + ms, ("allocate", p))

    def _report(self, p: Mapping[str, Any], state: str) -> Event:
        return self.ev("TaskStateChanged", {
            "task_id": p["task_id"], "job_id": p["job_id"], "machine_id": p["machine_id"], "state": state,
            "previous_state": "STARTING" if state == "RUNNING" else "STOPPING",
            "exit_code": 0 if state == "STOPPED" else None, "spec_version": p["spec_version"], "reason": ""},
            "agent", p["task_id"])

    def _controller_turn(self) -> None:
        for req in ctl.due(self.books):
            self.books, ack = ctl.answer(self.books, req, self.decide_ctl, CONTROLLER, self.now)
            self._check_ack(ack)
            self.result.acks += 1
            self.feed(ack)

    def _check_ack(self, ack: Event) -> None:
        """Independently of the controller: would the tasks this ack approves, with those approved before and
        not yet taken down, leave a shard below ``min_live``? Such shards count against Ropewalk."""
        job = self.state.jobs[JOB]
        approved = {op.split(":")[0] for op in ack.payload["approved_operation_ids"]}
        going = {t.id for t in job.tasks.values() if t.op_state == OP_APPROVED} | approved
        going &= self.running
        if not approved & self.running:
            return
        taken = Counter(s for tid in going for s in self.hosted[tid])
        for tid in approved & self.running:
            for s in self.hosted[tid]:
                if self.live[s] - taken[s] < self.c.min_live:
                    self.result.by_ropewalk_at_ack.add(s)

    def _allocate(self, p: Mapping[str, Any]) -> None:
        for tid in p["free_task_ids"]:
            m = self.placed.pop(tid, None)
            if m is not None:
                self.free_machines.add(m)
        avoid = set(p["avoid_machine_ids"])
        placements, unplaced = [], []
        for tid in p["place_task_ids"]:
            choice = min((m for m in self.free_machines if m not in avoid and m not in self.down_machines),
                         key=lambda m: int(m[1:]), default=None)
            if choice is None:
                unplaced.append(tid)
                continue
            self.free_machines.discard(choice)
            self.placed[tid] = choice
            placements.append(self.placement(tid, choice))
        rid = p["request_id"]
        if placements:
            self.feed(self.ev("TasksAllocated", {"request_id": rid, "job_id": JOB, "placements": placements},
                              "allocator", rid))
        if unplaced:
            self.feed(self.ev("AllocationRejected", {
                "request_id": rid, "job_id": JOB, "reason": "no_feasible_machine",
                "message": "no free machine up outside the failed MSB", "unplaced_task_ids": unplaced},
                "allocator", rid))

    # -- the story ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        c = self.c
        self.feed(self.ev("EntitlementCreated", {"name": ENT, "quota_machines": c.tasks, "machine_type": None,
                                                 "dc_pin": None, "host_profile": None}, "cli", ENT))
        submitted = self.ev("JobSubmitted", self.spec(1), "cli", JOB)
        self.feed(submitted)
        rid = sm.request_id(JOB, 1, 1, sm.incarnation_tag(submitted.event_id))
        placements = [self.placement(task_id(i), machine_of(i)) for i in range(c.tasks)]
        self.placed = {task_id(i): machine_of(i) for i in range(c.tasks)}
        self.feed(self.ev("TasksAllocated", {"request_id": rid, "job_id": JOB, "placements": placements},
                          "allocator", rid))
        for i in range(c.tasks):
            self.feed(self._report({"task_id": task_id(i), "job_id": JOB, "machine_id": machine_of(i),
                                    "spec_version": 1}, "RUNNING"))
        self.heap.clear()  # the START reactions of the setup: they are the RUNNING reports just fed
        assert len(self.running) == c.tasks, "every task runs before the experiment starts"

    def fail_msb(self) -> None:
        machines = [machine_of(i) for i in range(self.c.tasks) if i % self.c.msbs == self.c.failed_msb]
        self.result.down_before_failure = frozenset(set(self.hosted) - self.running)
        self.down_machines |= set(machines)
        self.heap = [h for h in self.heap if not (h[2][0] == "report" and h[2][1]["machine_id"] in machines)]
        heapq.heapify(self.heap)
        self.feed(self.ev("UnavailabilityStarted", {
            "unavailability_id": FAILURE_UE, "kind": "FAILURE", "machine_ids": machines, "start_ms": self.now,
            "deadline_ms": None, "expected_duration_ms": int(self.c.msb_down_s * 1000), "reason": "msb_failure"},
            "resourcebroker", FAILURE_UE), failure=True)

    def recover_msb(self) -> None:
        machines = sorted(m for m in self.down_machines)
        self.down_machines.clear()
        for m in machines:
            self.feed(self.ev("MachineStatusChanged", {"machine_id": m, "status": "UP", "previous_status": "DOWN",
                                                       "reason": "msb_recovered"}, "resourcebroker", m))
        self.feed(self.ev("UnavailabilityEnded", {"unavailability_id": FAILURE_UE, "machine_ids": machines},
                          "resourcebroker", FAILURE_UE))

    def row(self) -> dict[str, Any]:
        job = self.state.jobs[JOB]
        v = job.spec_version
        updating = sum(1 for t in job.tasks.values() if t.op == OP_UPDATE and t.op_state == OP_RUNNING)
        updated = sum(1 for t in job.tasks.values() if t.spec_version == v and t.state == lc.RUNNING)
        waiting = sum(1 for t in job.tasks.values() if t.spec_version < v and t.op_state != OP_RUNNING)
        failed = set(failed_tasks(self.c))
        down_failed = sum(1 for tid in failed if tid not in self.running)
        down = Counter(self.c.replicas - n for n in self.live.values())
        return {"t_s": round(self.now / 1000), "tasks_updating": updating, "tasks_updated": updated,
                "tasks_waiting": waiting, "failed_msb_tasks_down": down_failed,
                "shards_1_down": down[1], "shards_2plus_down": sum(k for d, k in down.items() if d >= 2)}

    def run(self) -> Result:
        c = self.c
        self.setup()
        self.now = 0
        self.feed(self.ev("JobSpecChanged", self.spec(2), "cli", JOB))
        self.at(int(c.msb_fail_at_s * 1000), ("fail",))
        self.at(int((c.msb_fail_at_s + c.msb_down_s) * 1000), ("recover",))
        next_timer, next_row = int(c.timer_s * 1000), 0
        step, timer = int(c.step_s * 1000), int(c.timer_s * 1000)
        while self.now <= c.max_s * 1000:
            upcoming = min(self.heap[0][0] if self.heap else next_timer, next_timer, next_row)
            if upcoming == next_row:
                self.now = next_row
                self.result.rows.append(self.row())
                next_row += step
                if self._done() and not self.heap:
                    break
                continue
            if upcoming == next_timer and (not self.heap or self.heap[0][0] >= next_timer):
                self.now = next_timer
                self.feed(None)
                next_timer += timer
                continue
            when, _, item = heapq.heappop(self.heap)
            self.now = when
            self._handle(item)
            self._note_done()
        self._note_done()
        return self.result

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "report":
            if item[1]["machine_id"] not in self.down_machines:
                self.feed(self._report(item[1], item[2]))
        elif kind == "controller":
            self._controller_turn()
        elif kind == "allocate":
            self._allocate(item[1])
        elif kind == "fail":
            self.fail_msb()
        elif kind == "recover":
            self.recover_msb()

    def _done(self) -> bool:
        job = self.state.jobs[JOB]
        return not job.updating and len(self.running) == self.c.tasks

    def _note_done(self) -> None:
        job = self.state.jobs[JOB]
        if self.result.update_done_s is None and not job.updating and self.now > 0:
            self.result.update_done_s = self.now / 1000
        if self.result.all_running_s is None and self._done() and self.now > 0:
            self.result.all_running_s = self.now / 1000


def run(c: Conditions = Conditions()) -> Result:
    """Run the experiment (deterministic for given conditions)."""
    return _Run(c).run()


def failure_alone(c: Conditions, hosted: Mapping[str, list[str]], down_before: frozenset[str]) -> set[str]:
    """Shards the MSB failure alone drops below ``min_live``: live before it (all tasks but ``down_before``)
    at least ``min_live``, and fewer once the failed MSB's tasks are gone too."""
    gone = set(failed_tasks(c))
    before, after = Counter(), Counter()
    for tid, shards in hosted.items():
        for s in shards:
            if tid not in down_before:
                before[s] += 1
                if tid not in gone:
                    after[s] += 1
    return {s for s in before if before[s] >= c.min_live > after[s]}


# -- output ------------------------------------------------------------------------------------------------------

COLUMNS = ("t_s", "tasks_updating", "tasks_waiting", "tasks_updated", "failed_msb_tasks_down", "shards_1_down",
           "shards_2plus_down")


def table(result: Result) -> Iterator[str]:
    c = result.conditions
    yield (f"Figure 14 ({result.mode}): {c.tasks} tasks, {c.shards} shards x {c.replicas} replicas, "
           f"{c.placement} placement, ReplicaAware min live {c.min_live}; MSB {c.failed_msb} of {c.msbs} "
           f"({len(failed_tasks(c))} tasks) fails at T{c.msb_fail_at_s} for {c.msb_down_s} s")
    yield "  ".join(f"{h:>14}" for h in COLUMNS)
    for r in result.rows:
        yield "  ".join(f"{r[h]:>14}" for h in COLUMNS)
    for k, v in result.totals().items():
        yield f"{k}: {v}"


def write_png(result: Result, path: str) -> None:
    """The two panels of Figure 14 with matplotlib (an optional dependency: ``pip install .[plot]``)."""
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency: matplotlib (the plot extra) only for the PNG; the rest works without it
    except ImportError:
        raise RuntimeError("--png needs matplotlib (pip install 'ropewalk[plot]'); not installed") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional dependency: matplotlib (the plot extra) only for the PNG; the rest works without it

    rows, c, totals = result.rows, result.conditions, result.totals()
    t = [r["t_s"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    a.plot(t, [r["tasks_waiting"] for r in rows], color="tab:blue", label="tasks still to update")
    a.plot(t, [r["tasks_updating"] for r in rows], color="tab:orange", label="tasks being updated now")
    a.plot(t, [r["failed_msb_tasks_down"] for r in rows], color="tab:red", label="tasks down with the failed MSB")
    a.set_ylabel("tasks")
    a.set_title("Tasks of the job during the rolling update", fontsize=10, loc="left")
    b.plot(t, [r["shards_1_down"] for r in rows], color="tab:olive", label="shards with one replica down")
    b.plot(t, [r["shards_2plus_down"] for r in rows], color="tab:red",
           label="shards with two or more replicas down")
    b.set_ylabel("shards")
    b.set_xlabel("seconds since the rolling update started")
    b.set_title("Shard replicas down", fontsize=10, loc="left")
    for ax in (a, b):
        ax.axvspan(c.msb_fail_at_s, c.msb_fail_at_s + c.msb_down_s, color="grey", alpha=0.15,
                   label=f"one MSB ({len(failed_tasks(c))} tasks) failed")
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    done = totals["update_duration_s"]
    headline = (f"Ropewalk's updates took a second replica of a shard down {totals['shards_lost_second_replica_by_ropewalk']}"
                f" times; the MSB failure alone did {totals['shards_lost_second_replica_by_failure']:,}. "
                f"Peak {totals['peak_concurrent_updates']} tasks updating at once"
                + (f"; update done at {done:,.0f} s." if done is not None else "."))
    fig.suptitle(f"Ropewalk's rolling update never takes a shard's second replica down, even while an MSB fails\n"
                 f"(Twine Figure 14: {c.tasks:,} tasks hosting {c.shards:,} shards x {c.replicas} replicas, "
                 f"ReplicaAware TaskController)", fontsize=11)
    fig.text(0.5, 0.905, textwrap.fill(headline, 110), ha="center", va="top", fontsize=9, weight="bold",
             color="darkred")
    fig.text(0.01, 0.005, textwrap.fill(result.mode, 160), fontsize=6, color="dimgrey", va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 0.86))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(ap) -> None:
    """The experiment's flags (``ropewalk experiment figure14``; ``figure14_pipeline.add_arguments`` adds its own)."""
    ap.add_argument("--json", action="store_true", help="print one JSON document (conditions, totals, curves)")
    ap.add_argument("--png", help="write the two panels to this PNG file (needs matplotlib: ropewalk[plot])")
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--shards", type=int, default=15000)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--msbs", type=int, default=20, help="MSBs the tasks are spread over (tasks/msbs fail)")
    ap.add_argument("--msb-fail-at", type=int, default=120, help="seconds into the update")
    ap.add_argument("--msb-down", type=int, default=295, help="seconds the MSB stays down")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--placement", choices=["grouped", "random"], default="grouped",
                    help="replica placement: grouped (Shard Manager-like replica sets, default) or random")


def conditions(args) -> Conditions:
    """The conditions the flags of ``add_arguments`` say (a bad combination: ValueError, naming it)."""
    return Conditions(tasks=args.tasks, shards=args.shards, replicas=args.replicas, msbs=args.msbs,
                      msb_fail_at_s=args.msb_fail_at, msb_down_s=args.msb_down, seed=args.seed,
                      placement=args.placement)


def main(args, c: Conditions) -> int:
    """``ropewalk experiment figure14`` without ``--pipeline``: the simulation under ``c``, printed."""
    t0 = time.monotonic()
    result = run(c)
    wall = time.monotonic() - t0
    if args.png:
        write_png(result, args.png)
    if args.json:
        doc = result.document()
        doc["wall_time_s"] = round(wall, 2)
        doc["png"] = args.png
        print(json.dumps(doc, sort_keys=True))
    else:
        for line in table(result):
            print(line)
        print(f"wall time: {wall:.1f} s" + (f"; plot written to {args.png}" if args.png else ""))
    sys.stdout.flush()
    return 0
