"""The ReBalancer's solver: one entitlement's machines and tasks + goals -> a plan of moves. Pure: no I/O.

Twine §3.3: the allocator places fast and greedily; the ReBalancer runs asynchronously with a constraint solver
and fixes what greed leaves behind. Here the problem is CPU hot spots among the machines an entitlement holds
(its pseudo-cluster): the allocator packs (``placement.SCORES``: the fullest machine that fits first), so a job
whose tasks are small in memory can pile onto a few machines while the rest sit half empty.

**Load.** A machine's load is the CPU its tasks reserve divided by its CPU capacity (what the log has: the
allocator's fold). The balance of a scope is ``max load / mean load`` over its *open* machines (UP, not under a
planned maintenance); the mean does not change when tasks move within the scope, so lowering the maximum is the
whole game. A measured utilization could replace the reservation per task (``TaskLoad.cpu``) without changing the
model.

**Stages** (``solve``), in this order:

1. ``balance``: loads, the mean, ``before``; a scope at or under ``Goals.trigger_ratio``, or whose hottest machine is
   under ``Goals.min_hot_load`` (a nearly idle entitlement: nothing is hot), is left alone.
2. ``sources``: open machines above ``Goals.target_ratio`` x mean, hottest first; on each, as many movable tasks
   as would bring it under the target plus ``SPARE_CANDIDATES`` alternatives (smallest memory first: they fit
   most places), at most ``MAX_CANDIDATES_PER_SOURCE``. A task that may not move says why (``TaskLoad.movable``,
   counted in ``Plan.excluded``).
3. ``targets``: per candidate task, ``Goals.targets_per_task`` open machines under the target load, taken from
   the coldest first with a rotating start (so that the candidates of a hot spot spread over many machines),
   each passing the hard filters: fits the task's CPU and memory, meets the job's requirements (dc, machine
   type), is not the task's machine nor one it left within ``Goals.no_bounce_ms`` (``TaskLoad.banned``), ends
   colder than the source is now, and does not push the job's count in its fault domain (at the job's spread
   level) above the job's fullest domain today.
4. ``greedy``: a feasible plan (hottest source first, each task to its coldest target that stays under the
   target load): the warm start, and the plan if the solver finds nothing in its limit.
5. ``model`` (CP-SAT): a boolean per (task, target); each task moves at most once; every touched machine keeps
   its CPU and memory capacity; each job's count per fault domain stays <= its fullest domain today; at most
   ``max_moves`` moves (``Goals.max_move_fraction`` of the scope's tasks, at most ``Goals.max_moves``). The
   objective ``excess * (max_moves + 1) + moves``, ``excess`` being the CPU above the target load summed over the
   machines, means: shed as much of the hot spot as the cap allows (every machine brought under the target when
   it can be; a cap too small for the whole hot spot still fixes as much of it as it can, where minimizing the
   maximum alone would see no gain until the last hot machine is fixed), then use as few moves as possible.
   The solution is kept only if it is no worse than the warm start.

**Determinism.** One search worker, a fixed seed and a *deterministic* time limit
(``Goals.deterministic_limit``: CP-SAT's work units, not the clock): the same scope and goals give the same plan
on a busy machine and an idle one. ``Goals.wall_limit_ms`` is a wall-clock safety net only (a plan cut by it says
so: ``Plan.wall_limited``).
"""
from __future__ import annotations

import argparse
import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from processors.allocator.placement import FAULT_DOMAIN_OF

# Why a task may not move (TaskLoad.movable; counted per reason in Plan.excluded).
TASK_JOB_NOT_RUNNING = "job_not_running"  # its job is not running (updating, pending, stopping): TaskControl holds it
TASK_JOB_UNKNOWN = "job_spec_unknown"  # no AllocationRequested of its job seen (spread and requirements unknown)
TASK_IN_PLAN = "move_in_flight"  # a plan in flight moves it already
TASK_NOT_OPEN = "machine_not_open"  # its machine is down or under maintenance: the scheduler moves it anyway

# Plan.status.
STATUS_BALANCED = "balanced"  # max/mean at or under the trigger: nothing to do
STATUS_COOL = "cool"  # no machine is loaded enough to be a hot spot (Goals.min_hot_load): nothing to do
STATUS_NO_MOVE = "no_improving_move"  # above the trigger, but no candidate task has a target
STATUS_OPTIMAL = "optimal"  # CP-SAT proved the plan optimal
STATUS_FEASIBLE = "feasible"  # CP-SAT's best within its limit (not proved optimal)
STATUS_GREEDY = "greedy"  # the solver found no solution within its limit: the greedy warm start is the plan

SPARE_CANDIDATES = 2  # tasks per source beyond what would bring it under the target: alternatives for the solver
MAX_CANDIDATES_PER_SOURCE = 64
SCAN_PER_TARGET = 32  # machines a target walk looks at per target it wants, at most


@dataclass(frozen=True, slots=True)
class MachineLoad:
    """A machine of the scope. ``open``: UP and under no planned maintenance (it may give and take tasks)."""

    id: str
    dc: str
    msb: str
    rack: str
    machine_type: str
    cpu_capacity: int
    mem_capacity: int
    cpu_used: int
    mem_used: int
    open: bool = True

    @property
    def load(self) -> float:
        return self.cpu_used / self.cpu_capacity if self.cpu_capacity > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TaskLoad:
    """A task on a machine of the scope. ``movable``: None, or why it may not move (TASK_*). ``banned``: machines
    it must not go to (those it left within the no-bounce window)."""

    id: str
    job: str
    machine: str
    cpu: int
    mem: int
    movable: str | None = None
    banned: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class JobRule:
    """What placement asked of a job's tasks: the fault domain to spread over, hard requirements."""

    spread: str = "msb"
    requirements: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Scope:
    """One entitlement's machines (all it holds) and the tasks on them."""

    entitlement: str
    machines: tuple[MachineLoad, ...]
    tasks: tuple[TaskLoad, ...]
    jobs: Mapping[str, JobRule] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Goals:
    target_ratio: float = 1.10  # moves bring every machine to at most this x the mean load
    trigger_ratio: float = 1.15  # a scope is planned only when max/mean is above this ...
    min_hot_load: float = 0.5  # ... and its hottest machine is at least this loaded (moving tasks among idle
    #                            machines buys nothing)
    max_move_fraction: float = 0.05  # moves per plan: at most this fraction of the scope's tasks ...
    max_moves: int = 10_000  # ... and at most this many
    targets_per_task: int = 8  # candidate targets per task
    no_bounce_ms: int = 3_600_000  # a task never goes back to a machine it left this recently
    deterministic_limit: float = 5.0  # CP-SAT work units (about a second of one core each);
    #                                   0: no solver, the greedy stage's plan
    wall_limit_ms: int = 30_000  # wall-clock safety net (the deterministic limit is what normally stops a search)
    seed: int = 1

    def __post_init__(self) -> None:
        if not 1.0 <= self.target_ratio <= self.trigger_ratio:
            raise ValueError(f"need 1 <= target_ratio <= trigger_ratio, got {self.target_ratio}, "
                             f"{self.trigger_ratio}")
        if not 0.0 <= self.max_move_fraction <= 1.0 or self.max_moves < 0 or self.targets_per_task < 1:
            raise ValueError("max_move_fraction in [0, 1], max_moves >= 0, targets_per_task >= 1")

    def move_cap(self, tasks: int) -> int:
        return min(self.max_moves, math.floor(self.max_move_fraction * tasks))


def goals_arguments(ap: argparse.ArgumentParser) -> None:
    """The goals as command-line options (the processor's and ``ropewalk rebalance plan --dry-run``'s)."""
    g = Goals()
    ap.add_argument("--target-ratio", type=float, default=g.target_ratio, help="bring max/mean load to this")
    ap.add_argument("--trigger-ratio", type=float, default=g.trigger_ratio, help="plan when max/mean is above this")
    ap.add_argument("--max-move-fraction", type=float, default=g.max_move_fraction,
                    help="moves per plan: at most this fraction of the entitlement's tasks")
    ap.add_argument("--deterministic-limit", type=float, default=g.deterministic_limit,
                    help="the solver's deterministic work limit (0: the greedy stage alone)")


def goals_of(args: argparse.Namespace) -> Goals:
    return Goals(target_ratio=args.target_ratio, trigger_ratio=args.trigger_ratio,
                 max_move_fraction=args.max_move_fraction, deterministic_limit=args.deterministic_limit)


@dataclass(frozen=True, slots=True)
class Move:
    task_id: str
    job_id: str
    from_machine: str
    to_machine: str
    cpu: int
    mem: int


@dataclass(frozen=True)
class Balance:
    max_load: float
    mean_load: float
    machines: int  # open machines
    tasks: int  # tasks on them

    @property
    def ratio(self) -> float:
        return self.max_load / self.mean_load if self.mean_load > 0 else 1.0


@dataclass(frozen=True)
class Plan:
    entitlement: str
    status: str  # STATUS_*
    moves: tuple[Move, ...]
    before: Balance
    after: Balance
    max_moves: int
    candidates: int  # candidate tasks considered
    variables: int  # (task, target) pairs in the model
    solve_ms: int  # wall time of the whole solve (stages 1-5)
    work: float  # CP-SAT's deterministic work units spent
    wall_limited: bool  # the wall-clock safety net cut the search (the plan may differ run to run)
    excluded: Mapping[str, int]  # tasks on hot machines that may not move, per reason


def balance(machines: Iterable[MachineLoad], tasks: int) -> Balance:
    ms = [m for m in machines if m.open]
    cap = sum(m.cpu_capacity for m in ms)
    mean = sum(m.cpu_used for m in ms) / cap if cap else 0.0
    return Balance(max_load=max((m.load for m in ms), default=0.0), mean_load=mean, machines=len(ms), tasks=tasks)


def after_moves(machines: Sequence[MachineLoad], moves: Iterable[Move]) -> list[MachineLoad]:
    """The machines with ``moves`` applied to their used CPU and memory."""
    cpu: Counter[str] = Counter()
    mem: Counter[str] = Counter()
    for mv in moves:
        cpu[mv.from_machine] -= mv.cpu
        mem[mv.from_machine] -= mv.mem
        cpu[mv.to_machine] += mv.cpu
        mem[mv.to_machine] += mv.mem
    return [MachineLoad(m.id, m.dc, m.msb, m.rack, m.machine_type, m.cpu_capacity, m.mem_capacity,
                        m.cpu_used + cpu[m.id], m.mem_used + mem[m.id], m.open) for m in machines]


class _Problem:
    """The scope indexed for one solve (stages 2-3); never outlives ``solve``."""

    def __init__(self, scope: Scope, goals: Goals, before: Balance):
        self.scope, self.goals = scope, goals
        self.machines = {m.id: m for m in scope.machines}
        self.open = [m for m in scope.machines if m.open]
        self.target_load = goals.target_ratio * before.mean_load
        self.on: dict[str, list[TaskLoad]] = defaultdict(list)
        for t in scope.tasks:
            if t.machine in self.machines:
                self.on[t.machine].append(t)
        # each job's tasks per fault domain (at its spread level), on open machines
        self.domains: dict[str, Counter[str]] = defaultdict(Counter)
        for t in scope.tasks:
            m = self.machines.get(t.machine)
            if m is not None and m.open:
                self.domains[t.job][self.domain(t.job, m)] += 1
        self.fullest = {j: max(c.values()) for j, c in self.domains.items()}
        self.excluded: Counter[str] = Counter()
        self.candidates: list[TaskLoad] = []
        self.arcs: dict[str, list[str]] = {}  # task -> its targets

    def rule(self, job: str) -> JobRule:
        return self.scope.jobs.get(job) or JobRule()

    def domain(self, job: str, m: MachineLoad) -> str:
        return FAULT_DOMAIN_OF[self.rule(job).spread](m)

    def sources(self) -> list[MachineLoad]:
        hot = [m for m in self.open if m.load > self.target_load]
        return sorted(hot, key=lambda m: (-m.load, m.id))

    def pick_candidates(self) -> None:
        for m in self.sources():
            excess = m.cpu_used - self.target_load * m.cpu_capacity
            taken, spare = 0, 0
            movable = []
            for t in self.on[m.id]:
                if t.movable is not None:
                    self.excluded[t.movable] += 1
                else:
                    movable.append(t)
            for t in sorted(movable, key=lambda t: (t.mem, -t.cpu, t.id))[:MAX_CANDIDATES_PER_SOURCE]:
                if taken >= excess:
                    if spare >= SPARE_CANDIDATES:
                        break
                    spare += 1
                self.candidates.append(t)
                taken += t.cpu

    def pick_targets(self) -> None:  # noqa: C901
        """Per candidate, up to ``targets_per_task`` targets from the source's own fault domain (at the job's spread
        level: a move there never touches the job's spread) when it has at least twice as many cold machines as
        candidates; else half from it and the rest one from each other domain the job may still grow in, in turn
        (a hot spot bigger than its own domain's room). Cross-domain pairs are what makes the model hard (they
        bring the spread constraints), so they are offered only where needed. Each domain's machines
        are walked coldest first from a rotating start, so that the candidates of one hot spot spread over many
        machines; a walk gives up after ``SCAN_PER_TARGET`` machines per target wanted, and a task bigger than
        every cold machine's room is not walked at all."""
        cold = sorted((m for m in self.open if m.load < self.target_load), key=lambda m: (m.load, m.id))
        if not cold:
            return
        room_cpu = max(m.cpu_capacity - m.cpu_used for m in cold)
        room_mem = max(m.mem_capacity - m.mem_used for m in cold)
        k = self.goals.targets_per_task
        near: dict[tuple[str, str], list[MachineLoad]] = defaultdict(list)  # (spread level, domain) -> cold ones
        for m in cold:
            for level, dom in FAULT_DOMAIN_OF.items():
                near[(level, dom(m))].append(m)
        demand: Counter = Counter((self.rule(t.job).spread, self.domain(t.job, self.machines[t.machine]))
                                  for t in self.candidates)
        starts: Counter = Counter()
        turn = 0
        for t in self.candidates:
            if t.cpu > room_cpu or t.mem > room_mem:
                continue
            src, rule = self.machines[t.machine], self.rule(t.job)
            own = (rule.spread, self.domain(t.job, src))
            found: list[str] = []

            def walk(key: tuple[str, str], want: int) -> None:
                pool = near.get(key, ())
                n, start = len(pool), starts[key]
                taken = 0
                for i in range(min(n, SCAN_PER_TARGET * want)):
                    m = pool[(start + i) % n]
                    if m.id not in found and self.allows(t, src, rule, m):
                        found.append(m.id)
                        taken += 1
                        if taken == want:
                            break
                if n:
                    starts[key] = (start + max(1, taken)) % n

            roomy = len(near.get(own, ())) >= 2 * demand[own]
            walk(own, k if roomy else (k + 1) // 2)
            others = [] if roomy and len(found) >= k else [
                key for key in near if key[0] == rule.spread and key != own
                and self.domains[t.job][key[1]] < self.fullest[t.job]]
            if others:
                turn += 1
                for i in range(len(others)):
                    if len(found) >= k:
                        break
                    walk(others[(turn + i) % len(others)], 1)
            if len(found) < k:  # the own domain again: more of its machines
                walk(own, k - len(found))
            if found:
                self.arcs[t.id] = found

    def spread_rows(self, pairs: Iterable[tuple[str, str, object]]) -> list[tuple[str, str, list, list]]:
        """The spread constraints of the model: for (task id, target, value) ``pairs`` (a value per pair: a model
        variable), (job, fault domain, the values moving a task of the job into it, those moving one out) of each
        domain that could end above the job's fullest domain today (a job's count there + what comes in - what
        goes out <= its fullest domain's count); a domain that cannot exceed needs no row."""
        inflow: dict[tuple[str, str], list] = defaultdict(list)
        outflow: dict[tuple[str, str], list] = defaultdict(list)
        tasks = {t.id: t for t in self.candidates}
        for tid, mid, v in pairs:
            t = tasks[tid]
            src_d, dst_d = self.domain(t.job, self.machines[t.machine]), self.domain(t.job, self.machines[mid])
            if src_d != dst_d:
                inflow[(t.job, dst_d)].append(v)
                outflow[(t.job, src_d)].append(v)
        return [(job, d, inflow[(job, d)], outflow.get((job, d), [])) for job, d in sorted(inflow)
                if self.domains[job][d] + len(inflow[(job, d)]) > self.fullest[job]]

    def allows(self, t: TaskLoad, src: MachineLoad, rule: JobRule, m: MachineLoad) -> bool:
        """The hard filters of one (task, target) pair (stage 3)."""
        if m.id == t.machine or m.id in t.banned:
            return False
        if m.cpu_used + t.cpu > m.cpu_capacity or m.mem_used + t.mem > m.mem_capacity:
            return False
        if (m.cpu_used + t.cpu) / m.cpu_capacity >= src.load:
            return False  # no better off than where it is
        req = rule.requirements
        if ("dc" in req and m.dc != req["dc"]) or ("machine_type" in req and m.machine_type != req["machine_type"]):
            return False
        d = self.domain(t.job, m)
        return d == self.domain(t.job, src) or self.domains[t.job][d] < self.fullest[t.job]


def _greedy(p: _Problem, cap: int) -> dict[str, str]:  # noqa: C901
    """Stage 4: hottest source first, each candidate to the target where it lowers the CPU above the target load
    (the model's objective) the most, the coldest such on a tie, while its source is above the target. A target
    may end a little above the target load when that still sheds more from the source than it adds (loads come
    in whole tasks: a target load of 0.62 on a machine of 16 one-core tasks is 9.9 tasks)."""
    used = {m.id: m.cpu_used for m in p.open}
    mem = {m.id: m.mem_used for m in p.open}
    allowed = {m.id: math.floor(p.target_load * m.cpu_capacity) for m in p.open}
    counts = {j: Counter(c) for j, c in p.domains.items()}
    by_source: dict[str, list[TaskLoad]] = defaultdict(list)
    for t in p.candidates:
        by_source[t.machine].append(t)
    chosen: dict[str, str] = {}
    for src in p.sources():
        for t in by_source[src.id]:
            shed = min(t.cpu, used[src.id] - allowed[src.id])
            if len(chosen) >= cap or shed <= 0:
                break
            best, best_key = None, None
            sd = p.domain(t.job, src)
            for mid in p.arcs.get(t.id, ()):
                m = p.machines[mid]
                if used[mid] + t.cpu > m.cpu_capacity or mem[mid] + t.mem > m.mem_capacity:
                    continue
                added = max(0, used[mid] + t.cpu - allowed[mid]) - max(0, used[mid] - allowed[mid])
                if added >= shed:
                    continue  # no gain
                d = p.domain(t.job, m)
                if d != sd and counts[t.job][d] >= p.fullest[t.job]:
                    continue
                key = (added, (used[mid] + t.cpu) / m.cpu_capacity)
                if best_key is None or key < best_key:
                    best, best_key = mid, key
            if best is None:
                continue
            chosen[t.id] = best
            used[src.id] -= t.cpu
            used[best] += t.cpu
            mem[src.id] -= t.mem
            mem[best] += t.mem
            d = p.domain(t.job, p.machines[best])
            if d != sd:
                counts[t.job][sd] -= 1
                counts[t.job][d] += 1
    return chosen


def _model(p: _Problem, cap: int, hint: Mapping[str, str], wall_s: float):  # noqa: C901
    """Stage 5: the CP-SAT model and its solution: (status, {task: target}, deterministic time, wall limited).
    ``hint`` (the greedy plan) is given complete, every variable's value, so the search starts from it. When the
    hint already brings every machine under the target (no excess: it cannot be lowered), the model is the simpler
    one of that case: every touched machine under the target, as few moves as possible."""
    from ortools.sat.python import cp_model  # noqa: PLC0415 - start-up: OR-Tools (~0.5 s), paid only by a solve

    model = cp_model.CpModel()
    tasks = {t.id: t for t in p.candidates if t.id in p.arcs}
    x: dict[tuple[str, str], cp_model.IntVar] = {}
    for tid in sorted(tasks):
        for mid in p.arcs[tid]:
            x[(tid, mid)] = model.new_bool_var(f"x[{tid},{mid}]")
    moved: dict[str, list[cp_model.IntVar]] = defaultdict(list)
    into: dict[str, list[tuple[TaskLoad, cp_model.IntVar]]] = defaultdict(list)
    for (tid, mid), v in x.items():
        moved[tid].append(v)
        into[mid].append((tasks[tid], v))
    for tid in sorted(moved):
        model.add_at_most_one(moved[tid])
    out_of: dict[str, list[tuple[TaskLoad, cp_model.IntVar]]] = defaultdict(list)
    for tid in sorted(moved):
        t = tasks[tid]
        for v in moved[tid]:
            out_of[t.machine].append((t, v))
    touched = sorted(set(into) | set(out_of))
    hinted = _used_after(p, hint)
    exact = _excess(p, hint) == 0
    excess = []  # CPU above the target load, per touched machine (millicores)
    for mid in touched:
        m = p.machines[mid]
        ins, outs = into.get(mid, ()), out_of.get(mid, ())
        cpu = m.cpu_used + sum(t.cpu * v for t, v in ins) - sum(t.cpu * v for t, v in outs)
        mem = m.mem_used + sum(t.mem * v for t, v in ins) - sum(t.mem * v for t, v in outs)
        model.add(cpu <= m.cpu_capacity)
        model.add(mem <= m.mem_capacity)
        allowed = math.floor(p.target_load * m.cpu_capacity)
        if exact:
            model.add(cpu <= allowed)
            continue
        over = model.new_int_var(0, max(0, m.cpu_capacity - allowed), f"over[{mid}]")
        model.add(over >= cpu - allowed)
        model.add_hint(over, max(0, hinted[mid] - allowed))
        excess.append(over)
    for job, d, coming, leaving in p.spread_rows((tid, mid, v) for (tid, mid), v in x.items()):
        model.add(p.domains[job][d] + sum(coming) - sum(leaving) <= p.fullest[job])
    total = sum(x.values())
    model.add(total <= cap)
    model.minimize(total if exact else sum(excess) * (cap + 1) + total)
    for (tid, mid), v in x.items():
        model.add_hint(v, hint.get(tid) == mid)
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = 1
    prm.random_seed = p.goals.seed
    prm.max_deterministic_time = p.goals.deterministic_limit
    prm.max_time_in_seconds = max(0.1, wall_s)
    t0 = time.monotonic()
    status = solver.Solve(model)
    wall = time.monotonic() - t0
    det = solver.deterministic_time
    wall_limited = wall >= prm.max_time_in_seconds and det < p.goals.deterministic_limit
    if status == cp_model.OPTIMAL:
        name = STATUS_OPTIMAL
    elif status == cp_model.FEASIBLE:
        name = STATUS_FEASIBLE
    else:
        return STATUS_GREEDY, dict(hint), det, wall_limited
    return name, {tid: mid for (tid, mid), v in x.items() if solver.Value(v)}, det, wall_limited


def solve(scope: Scope, goals: Goals = Goals()) -> Plan:
    """The plan for one scope (see the module doc for the stages)."""
    t0 = time.monotonic()
    is_open = {m.id: m.open for m in scope.machines}
    on_open = sum(1 for t in scope.tasks if is_open.get(t.machine, False))
    before = balance(scope.machines, on_open)
    cap = goals.move_cap(on_open)

    def plan(status: str, moves: Mapping[str, str] = MappingProxyType({}), p: _Problem | None = None,
             det: float = 0.0, wall_limited: bool = False) -> Plan:
        ms = _moves(scope, moves)
        return Plan(entitlement=scope.entitlement, status=status, moves=ms, before=before,
                    after=balance(after_moves(scope.machines, ms), on_open), max_moves=cap,
                    candidates=len(p.candidates) if p else 0, variables=sum(map(len, p.arcs.values())) if p else 0,
                    solve_ms=round((time.monotonic() - t0) * 1000), work=round(det, 3),
                    wall_limited=wall_limited, excluded=MappingProxyType(dict(sorted(p.excluded.items())) if p else {}))

    if before.mean_load <= 0 or before.ratio <= goals.trigger_ratio:
        return plan(STATUS_BALANCED)
    if before.max_load < goals.min_hot_load:
        return plan(STATUS_COOL)
    p = _Problem(scope, goals, before)
    p.pick_candidates()
    p.pick_targets()
    if not p.arcs or cap <= 0:
        return plan(STATUS_NO_MOVE, p=p)
    hint = _greedy(p, cap)
    if goals.deterministic_limit <= 0:
        return plan(STATUS_GREEDY, hint, p)
    left_s = goals.wall_limit_ms / 1000 - (time.monotonic() - t0)  # the safety net covers the whole solve
    status, chosen, det, limited = _model(p, cap, hint, left_s)
    if status != STATUS_GREEDY and (_excess(p, chosen), len(chosen)) > (_excess(p, hint), len(hint)):
        status, chosen = STATUS_GREEDY, hint  # never worse than the warm start (a search cut short)
    return plan(status, chosen, p, det, limited)


def _used_after(p: _Problem, chosen: Mapping[str, str]) -> dict[str, int]:
    """Each open machine's used CPU once ``chosen`` (task -> target) is done."""
    used = {m.id: m.cpu_used for m in p.open}
    tasks = {t.id: t for t in p.candidates}
    for tid, mid in chosen.items():
        used[tasks[tid].machine] -= tasks[tid].cpu
        used[mid] += tasks[tid].cpu
    return used


def _excess(p: _Problem, chosen: Mapping[str, str]) -> int:
    """CPU above the target load, summed over the open machines, after ``chosen`` (the model's objective)."""
    used = _used_after(p, chosen)
    return sum(max(0, used[m.id] - math.floor(p.target_load * m.cpu_capacity)) for m in p.open)


def _moves(scope: Scope, chosen: Mapping[str, str]) -> tuple[Move, ...]:
    tasks = {t.id: t for t in scope.tasks if t.id in chosen}
    return tuple(Move(tid, tasks[tid].job, tasks[tid].machine, chosen[tid], tasks[tid].cpu, tasks[tid].mem)
                 for tid in sorted(chosen))
