"""The region as the ReBalancer sees it: the allocator's fold of the log, plus what a plan needs beside it. Pure.

    view = RebalanceView()
    view.apply(event, (topic, partition, offset))     # the allocator's sources, state.jobs, RebalancePlanned
    view.due(now_ms)                                   # entitlements with no plan in flight
    scope = view.scope("e1", now_ms)                    # -> solver.Scope
    events = view.plan_events(plan, goals, now_ms)      # a solver.Plan -> the RebalancePlanned to produce

Beside the allocator's ``RegionFold`` (machines, owners, placements with each task's resources), it keeps:

* **job rules**: spread and requirements of each job, from its latest ``AllocationRequested``;
* **job states**: ``JobStatePublished.state`` (state.jobs): only a job that is ``running`` (every task RUNNING,
  no update) has tasks the plan may move; any other job's operations would be held by TaskControl anyway;
* **departures**: when each task left each machine (a ``TasksDeallocated`` freeing it, or a ``TasksAllocated``
  placing it elsewhere), kept ``no_bounce_ms``: a task is never planned back onto a machine it left that recently;
* **plans in flight**: the latest ``RebalancePlanned`` per entitlement, until every task it moves has been placed
  again after it (on its target or elsewhere) or ``PLAN_TTL_MS`` passed. An entitlement with a plan in flight is
  not planned again (``due``).

Every handler is idempotent (a record applied twice changes nothing); the fold's own marks skip redelivered offsets.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from processors.allocator.fold import RegionFold
from processors.rebalancer import solver
from processors.rebalancer.solver import Goals, JobRule, MachineLoad, Scope, TaskLoad
from processors.scheduler.lifecycle import JOB_RUNNING
from streams.events import Event, derived_event_id, new_event

PRODUCER = "rebalancer"
PLAN_TTL_MS = 15 * 60_000  # a plan whose moves are not all done by then no longer holds its entitlement back
EVENT_TYPES = frozenset({"AllocationRequested", "TasksAllocated", "TasksDeallocated", "JobStatePublished",
                         "RebalancePlanned"})  # read beside the fold's own (fold.EVENT_TYPES)


def constraints(goals: Goals, max_moves: int) -> list[str]:
    """The constraints every move of a plan meets, in words (RebalancePlanned.constraints)."""
    return [
        "capacity: every machine keeps its tasks' cpu and memory within its capacity",
        "scope: moves stay within the entitlement's machines that are UP and under no planned maintenance",
        "requirements: a task moves only to a machine meeting its job's dc and machine-type requirements",
        "spread: no job gets more tasks in a fault domain (at its spread level) than in its fullest one today",
        f"no bounce: no task moves to a machine it left less than {goals.no_bounce_ms} ms ago; the move's request "
        "avoids its source, so a fallback placement never lands back on it either",
        f"moves: at most {max_moves} ({goals.max_move_fraction:.0%} of the tasks, at most {goals.max_moves})",
        "taskcontrol: only tasks of running jobs; each move is a MOVE operation approved by the job's controller, "
        "paced by max_unavailable and the rate limiter",
    ]


@dataclass
class PlanInFlight:
    plan_id: str
    at_ms: int
    waiting: set[str] = field(default_factory=set)  # tasks of the plan not placed again since


class RebalanceView:
    def __init__(self, no_bounce_ms: int = Goals().no_bounce_ms):
        self.fold = RegionFold()
        self.no_bounce_ms = no_bounce_ms
        self.rules: dict[str, JobRule] = {}
        self.job_state: dict[str, str] = {}
        self.left: dict[str, dict[str, int]] = defaultdict(dict)  # task -> machine -> when it left it (ms)
        self.in_flight: dict[str, PlanInFlight] = {}  # entitlement -> its latest plan, while in flight
        self.plans: dict[str, int] = defaultdict(int)  # entitlement -> plans seen (names the next)

    # -- applying the log ----------------------------------------------------------------------------------
    def apply(self, event: Event, position: tuple[str, int, int] | None) -> bool:
        """Apply one record (the fold's marks make a redelivered offset a no-op for all of it)."""
        if position is not None:
            last = self.fold.marks.get((position[0], position[1]))
            if last is not None and position[2] <= last:
                return False
        handler = _HANDLERS.get(event.type)
        if handler is not None:
            handler(self, event)
        return self.fold.apply(event, position)

    def _departed(self, task: str, machine: str, at_ms: int) -> None:
        self.left[task][machine] = max(at_ms, self.left[task].get(machine, at_ms))

    def _placed_again(self, task: str) -> None:
        for ent, p in list(self.in_flight.items()):
            p.waiting.discard(task)
            if not p.waiting:
                del self.in_flight[ent]

    # -- planning ------------------------------------------------------------------------------------------
    def due(self, now_ms: int) -> list[str]:
        """Entitlements that hold machines and have no plan in flight (one older than PLAN_TTL_MS is dropped).
        Departures out of the no-bounce window are forgotten here, whether their task is still placed or not (a
        stopped job's tasks left for good: they stayed for ever, one per task freed)."""
        for ent in [e for e, p in self.in_flight.items() if now_ms - p.at_ms >= PLAN_TTL_MS]:
            del self.in_flight[ent]
        for task in [t for t, left in self.left.items() if all(now_ms - at >= self.no_bounce_ms for at in left.values())]:
            del self.left[task]
        owners = {m.entitlement for m in self.fold.machines.values() if m.entitlement}
        return sorted(e for e in owners if e not in self.in_flight)

    def scope(self, entitlement: str, now_ms: int) -> Scope:
        """The entitlement's machines and the tasks on them, as the solver takes them."""
        fold = self.fold
        machines = []
        tasks = []
        for m in sorted((m for m in fold.machines.values() if m.entitlement == entitlement), key=lambda m: m.id):
            is_open = m.status == "UP" and not m.maintenance
            machines.append(MachineLoad(m.id, m.dc, m.msb, m.rack, m.type, m.cpu_cap, m.mem_cap,
                                        m.cpu_cap - m.cpu_free, m.mem_cap - m.mem_free, is_open))
            for t in sorted(m.tasks):
                job = t.rpartition("/")[0]
                cpu, mem = fold.taskres[t]
                tasks.append(TaskLoad(t, job, m.id, cpu, mem, self._why_not(t, job, is_open),
                                      self._banned(t, now_ms)))
        jobs = {j: self.rules[j] for j in {t.job for t in tasks} if j in self.rules}
        return Scope(entitlement, tuple(machines), tuple(tasks), MappingProxyType(jobs))

    def _why_not(self, task: str, job: str, is_open: bool) -> str | None:
        if not is_open:
            return solver.TASK_NOT_OPEN
        if self.job_state.get(job) != JOB_RUNNING:  # (a deleted job's rule is forgotten: not running comes first)
            return solver.TASK_JOB_NOT_RUNNING
        if job not in self.rules:
            return solver.TASK_JOB_UNKNOWN
        if any(task in p.waiting for p in self.in_flight.values()):
            return solver.TASK_IN_PLAN
        return None

    def _banned(self, task: str, now_ms: int) -> frozenset[str]:
        left = self.left.get(task)
        if not left:
            return frozenset()
        recent = {m for m, at in left.items() if now_ms - at < self.no_bounce_ms}
        if len(recent) < len(left):  # forget what is out of the window
            self.left[task] = {m: at for m, at in left.items() if m in recent}
        return frozenset(recent)

    def plan_events(self, plan: solver.Plan, goals: Goals, now_ms: int) -> list[Event]:
        """The RebalancePlanned of a plan with moves (none for a plan without): id ``<entitlement>:p<n>``."""
        if not plan.moves:
            return []
        ent = plan.entitlement
        plan_id = f"{ent}:p{self.plans[ent] + 1}"
        payload: dict[str, Any] = {
            "plan_id": plan_id, "status": plan.status,
            "goals": {"target_ratio": goals.target_ratio, "trigger_ratio": goals.trigger_ratio,
                      "max_moves": plan.max_moves, "deterministic_limit": goals.deterministic_limit,
                      "wall_limit_ms": goals.wall_limit_ms},
            "constraints": constraints(goals, plan.max_moves), "no_bounce_ms": goals.no_bounce_ms,
            "before": balance_record(plan.before), "after": balance_record(plan.after),
            "moves": [{"task_id": mv.task_id, "job_id": mv.job_id, "from_machine_id": mv.from_machine,
                       "to_machine_id": mv.to_machine, "cpu_millicores": mv.cpu, "memory_mib": mv.mem}
                      for mv in plan.moves],
            "solve_ms": plan.solve_ms, "solver_work": plan.work, "wall_limited": plan.wall_limited,
            "candidates": plan.candidates, "variables": plan.variables, "excluded": dict(plan.excluded)}
        return [new_event("RebalancePlanned", payload, entitlement=ent, entity_id=plan_id, producer=PRODUCER,
                          timestamp_ms=now_ms, event_id=derived_event_id(PRODUCER, plan_id))]


def balance_record(b: solver.Balance) -> dict[str, Any]:
    return {"max_load": round(b.max_load, 6), "mean_load": round(b.mean_load, 6), "ratio": round(b.ratio, 6),
            "machines": b.machines, "tasks": b.tasks}


# -- handlers (before the fold applies the event: it still holds the placements the event changes) -------------

def _requested(v: RebalanceView, e: Event) -> None:
    p = e.payload
    if p["place_task_ids"]:
        v.rules[p["job_id"]] = JobRule(spread=p.get("spread") or "msb",
                                       requirements=MappingProxyType(dict(p.get("requirements") or {})))


def _allocated(v: RebalanceView, e: Event) -> None:
    placement = v.fold.placement
    for r in e.payload["placements"]:
        t, mid = r["task_id"], r["machine_id"]
        cur = placement.get(t)
        if cur is not None and cur != mid:
            v._departed(t, cur, e.timestamp_ms)
        v._placed_again(t)


def _deallocated(v: RebalanceView, e: Event) -> None:
    placement = v.fold.placement
    for r in e.payload["placements"]:
        if placement.get(r["task_id"]) == r["machine_id"]:
            v._departed(r["task_id"], r["machine_id"], e.timestamp_ms)


def _job_state(v: RebalanceView, e: Event) -> None:
    p = e.payload
    if p.get("deleted"):  # stopped and freed: nothing of it is planned again (a new incarnation asks anew)
        v.job_state.pop(p["job_id"], None)
        v.rules.pop(p["job_id"], None)
    else:
        v.job_state[p["job_id"]] = p["state"]


def _planned(v: RebalanceView, e: Event) -> None:
    p = e.payload
    ent = e.entitlement
    n = plan_number(p["plan_id"])
    if n <= v.plans[ent]:
        return  # seen already (a redelivery), or older than one seen
    v.plans[ent] = n
    v.in_flight[ent] = PlanInFlight(p["plan_id"], e.timestamp_ms, {mv["task_id"] for mv in p["moves"]})


def plan_number(plan_id: str) -> int:
    """n of a plan id ``<entitlement>:p<n>`` (0 if it is not one)."""
    head, sep, n = plan_id.rpartition(":p")
    return int(n) if sep and n.isdigit() else 0


_HANDLERS: Mapping[str, Any] = MappingProxyType({
    "AllocationRequested": _requested,
    "TasksAllocated": _allocated,
    "TasksDeallocated": _deallocated,
    "JobStatePublished": _job_state,
    "RebalancePlanned": _planned,
})


# -- what `ropewalk rebalance plan` shows --------------------------------------------------------------------------

MOVE_DONE = "done"  # the task runs on its target
MOVE_ELSEWHERE = "elsewhere"  # it left its source, but for another machine (the target no longer fitted)
MOVE_MOVING = "moving"  # it left its source and is not running yet
MOVE_WAITING = "waiting"  # still on its source (its operation awaits the controller, max_unavailable, a token)
MOVE_GONE = "gone"  # the task no longer exists


def plan_view(ev: Event, tasks: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A RebalancePlanned with each move's progress, from ``tasks`` (task id -> its row in the job's published
    state: ``machine_id``, ``state``)."""
    p = ev.payload
    moves = []
    for mv in p["moves"]:
        row = tasks.get(mv["task_id"])
        if row is None:
            progress = MOVE_GONE
        elif row.get("machine_id") == mv["from_machine_id"]:
            progress = MOVE_WAITING
        elif row.get("state") != "RUNNING":
            progress = MOVE_MOVING
        else:
            progress = MOVE_DONE if row.get("machine_id") == mv["to_machine_id"] else MOVE_ELSEWHERE
        moves.append({"task": mv["task_id"], "job": mv["job_id"], "from": mv["from_machine_id"],
                      "to": mv["to_machine_id"], "cpu_millicores": mv["cpu_millicores"],
                      "memory_mib": mv["memory_mib"], "progress": progress,
                      "now_on": None if row is None else row.get("machine_id")})
    return {"plan": p["plan_id"], "entitlement": ev.entitlement, "planned_ms": ev.timestamp_ms,
            "status": p["status"], "before": dict(p["before"]), "after": dict(p["after"]), "goals": dict(p["goals"]),
            "constraints": list(p["constraints"]), "solve_ms": p["solve_ms"], "solver_work": p["solver_work"],
            "wall_limited": p["wall_limited"], "candidates": p["candidates"], "variables": p["variables"],
            "excluded": dict(p["excluded"]), "moves": moves,
            "progress": dict(sorted(Counter(m["progress"] for m in moves).items()))}


def format_plan(v: Mapping[str, Any]) -> str:
    """``plan_view`` as text."""
    b, a = v["before"], v["after"]
    lines = [f"plan {v['plan']}  entitlement {v['entitlement']}  {v['status']}  "
             f"max/mean {b['ratio']:.3f} -> {a['ratio']:.3f} (mean load {b['mean_load']:.3f}, "
             f"{b['machines']} machines, {b['tasks']} tasks)  {len(v['moves'])} moves  solved in {v['solve_ms']} ms",
             "progress: " + (", ".join(f"{n} {k}" for k, n in v["progress"].items()) or "no moves")]
    if v["excluded"]:
        lines.append("not movable on hot machines: " + ", ".join(f"{n} {k}" for k, n in v["excluded"].items()))
    lines += [f"  {m['task']:28} {m['from']:22} -> {m['to']:22} {m['progress']}"
              + (f" (on {m['now_on']})" if m["progress"] == MOVE_ELSEWHERE else "") for m in v["moves"]]
    return "\n".join(lines)
