"""Reference TaskControllers: each a ``decide(request, view) -> Answer(approved operation ids, maintenance
choices)``. Pure.

* ``LeaderLast``  an ensemble (ZooKeeper-like): followers first, one at a time, the leader last, so an n-member
                  ensemble sees at most one leader change per release (Twine §2.5).
* ``ReplicaAware`` a sharded service: never approves an operation that would leave a shard with fewer than
                  ``min_live`` live replicas, counting tasks already down for any reason (Figure 14).
* ``Pacing``      a stateless tier: how many operations may be in flight follows a load signal (§5.2: slower at
                  peak, normal pace off peak).

Common rule: an operation on a task that is already down (in ``unhealthy_task_ids``, e.g. a MOVE off a failed
machine) costs no availability and is approved, except by ``LeaderLast`` for the leader while followers wait.

**Maintenance choices** (advance notices, Twine §2.5). Each request's notices name the tasks still awaiting a
choice; a task left without one is asked about again in a later request (the scheduler asks again when a task
runs again under an open notice) and stopped at the deadline if it never gets one. Approvals are decided first;
the choices count the tasks those take down. A task under notice that is already down is MOVEd by all three
(nothing is lost). Then:

* ``LeaderLast``   MOVEs followers one at a time (while fewer than ``max_down`` tasks are down, in flight or
                   unhealthy), the leader last: only when no follower awaits a choice, nothing is in flight and
                   every other task serves. Never KEEP or STOP: an ensemble member out for the window is a quorum
                   member lost, a move costs one member for as long as a restart.
* ``ReplicaAware`` KEEPs a task when the maintenance is short (``expected_duration_ms <= keep_below_ms``) and each
                   of its shards has ``min_live`` live replicas on tasks outside the maintenance (the Shard Manager
                   case of §2.7: "if the maintenance duration is short and the shards have replicas elsewhere, do
                   nothing"); else MOVEs it if each of its shards keeps ``min_live`` live replicas without it; else
                   leaves it for a later request. Never KEEPs through a long (or unsaid) maintenance.
* ``Pacing``       KEEPs every task when the maintenance is short (the top-of-rack switch case); else MOVEs
                   tasks while fewer than ``width(load)`` are down (in flight or unhealthy, those it just
                   approved included), the rest in later requests.

    python -m processors.taskcontrol.controllers leader-last --name zk --leader e1.zk=e1.zk/0
    python -m processors.taskcontrol.controllers replica-aware --name sm --shards shards.json --min-live 2
    python -m processors.taskcontrol.controllers pacing --name web --load-file load.txt
"""
from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from infra.config import Config
from processors.taskcontrol.protocol import CHOICE_KEEP, CHOICE_MOVE, Answer, Choice, Request, View

KEEP_BELOW_MS = 10 * 60_000  # default: a maintenance expected to last at most this long may be sat through


def _down(request: Request, view: View) -> set[str]:
    """Tasks not serving: unhealthy for any reason, or taken by an operation this controller approved."""
    return set(request.unhealthy) | set(view.in_flight_tasks)


def _under_notice(request: Request) -> list[tuple[str, str, int | None]]:
    """(unavailability id, task, expected duration) of every task awaiting a maintenance choice, in notice
    order, each task once (its first notice)."""
    out, seen = [], set()
    for n in request.notices:
        for t in n.task_ids:
            if t not in seen:
                seen.add(t)
                out.append((n.unavailability_id, t, n.expected_duration_ms))
    return out


def _short(duration_ms: int | None, keep_below_ms: int) -> bool:
    return duration_ms is not None and duration_ms <= keep_below_ms


@dataclass(frozen=True)
class LeaderLast:
    """Approve follower operations while fewer than ``max_down`` tasks are down (in flight included), lowest task
    first; the leader's only when no other operation is pending or in flight and no other task is down."""

    leaders: Mapping[str, str]  # job id → the leader's task id
    max_down: int = 1

    def __call__(self, request: Request, view: View) -> Answer:
        leader = self.leaders.get(request.job_id)
        down = _down(request, view)
        approved = []
        followers = [o for o in request.pending if o.task_id != leader]
        for op in followers:
            if op.task_id in down:  # down already: no availability to lose
                approved.append(op.operation_id)
            elif len(down) < self.max_down:
                approved.append(op.operation_id)
                down.add(op.task_id)
        if len(followers) == 0 and not view.in_flight:
            for op in request.pending:  # the leader, alone: only if every other task serves
                if not (down - {op.task_id}):
                    approved.append(op.operation_id)
                    down.add(op.task_id)
        return Answer(tuple(approved), tuple(self._moves(request, view, leader, down, bool(followers))))

    def _moves(self, request: Request, view: View, leader: str | None, down: set[str], ops_wait: bool
               ) -> list[Choice]:
        """Followers under notice moved one at a time, the leader last and alone."""
        noticed = _under_notice(request)
        choices = []
        for ue, task, _ in noticed:
            if task == leader:
                continue
            if task in down or len(down) < self.max_down:
                choices.append(Choice(ue, task, CHOICE_MOVE))
                down.add(task)
        waiting = [t for _, t, _ in noticed if t != leader and t not in {c.task_id for c in choices}]
        for ue, task, _ in noticed:
            if (task == leader and not choices and not waiting and not ops_wait and not view.in_flight
                    and not (down - {task})):
                choices.append(Choice(ue, task, CHOICE_MOVE))
        return choices


@dataclass(frozen=True)
class ReplicaAware:
    """``shards`` maps each task to the shards it hosts; an operation is approved only if every shard of its task
    keeps at least ``min_live`` live replicas afterwards (tasks down for any reason do not count as live)."""

    shards: Mapping[str, Iterable[str]]
    min_live: int = 2
    keep_below_ms: int = KEEP_BELOW_MS

    def __call__(self, request: Request, view: View) -> Answer:
        down = _down(request, view)
        live = Counter(s for task, hosted in self.shards.items() if task not in down for s in hosted)
        approved = []
        for op in request.pending:
            if op.task_id in down:
                approved.append(op.operation_id)
                continue
            hosted = list(self.shards.get(op.task_id, ()))
            if all(live[s] - 1 >= self.min_live for s in hosted):
                approved.append(op.operation_id)
                down.add(op.task_id)
                live.subtract(hosted)
        return Answer(tuple(approved), tuple(self._choices(request, down, live)))

    def _choices(self, request: Request, down: set[str], live: Counter) -> list[Choice]:
        noticed = _under_notice(request)
        affected = {t for _, t, _ in noticed}
        # live replicas on tasks outside every maintenance: what serves a shard while kept tasks are out
        outside = Counter(s for task, hosted in self.shards.items() if task not in down and task not in affected
                          for s in hosted)
        choices = []
        for ue, task, duration in noticed:
            hosted = list(self.shards.get(task, ()))
            if task in down:
                choices.append(Choice(ue, task, CHOICE_MOVE))
            elif _short(duration, self.keep_below_ms) and all(outside[s] >= self.min_live for s in hosted):
                choices.append(Choice(ue, task, CHOICE_KEEP))
            elif all(live[s] - 1 >= self.min_live for s in hosted):
                choices.append(Choice(ue, task, CHOICE_MOVE))
                down.add(task)
                live.subtract(hosted)
        return choices


@dataclass(frozen=True)
class Pacing:
    """At most ``width(load)`` operations in flight: ``fast`` below ``low`` load, ``slow`` above ``high``, in
    between ``normal``. ``load`` is read at every request (the scheduler re-asks periodically while operations
    are pending, so a falling load speeds the release up without any task completing)."""

    load: Callable[[], float]
    low: float = 0.5
    high: float = 0.8
    slow: int = 1
    normal: int = 2
    fast: int = 4
    keep_below_ms: int = KEEP_BELOW_MS

    def width(self, load: float) -> int:
        return self.fast if load < self.low else self.slow if load > self.high else self.normal

    def __call__(self, request: Request, view: View) -> Answer:
        width = self.width(self.load())
        room = width - len(view.in_flight)
        down = set(request.unhealthy)
        approved = []
        for op in request.pending:
            if op.task_id in down:
                approved.append(op.operation_id)
            elif room > 0:
                approved.append(op.operation_id)
                room -= 1
        taken = _down(request, view) | {o.task_id for o in request.pending if o.operation_id in set(approved)}
        choices = []
        for ue, task, duration in _under_notice(request):
            if task in down:
                choices.append(Choice(ue, task, CHOICE_MOVE))
            elif _short(duration, self.keep_below_ms):
                choices.append(Choice(ue, task, CHOICE_KEEP))
            elif len(taken) < width:
                choices.append(Choice(ue, task, CHOICE_MOVE))
                taken.add(task)
        return Answer(tuple(approved), tuple(choices))


def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        job, sep, task = item.partition("=")
        if not sep:
            raise SystemExit(f"--leader expects JOB=TASK, got {item!r}")
        out[job] = task
    return out


def main(argv: list[str] | None = None) -> None:
    # main only: the controllers above are pure (simulated by bench/experiments/figure14.py), and the process's
    # metrics and log clients cost ~50 ms (-X importtime)
    from infra import metrics  # noqa: PLC0415 - start-up: prometheus_client, main only
    from processors.taskcontrol.controller import TaskControllerProcess  # noqa: PLC0415 - start-up, as above

    ap = argparse.ArgumentParser(prog="python -m processors.taskcontrol.controllers")
    ap.add_argument("kind", choices=("leader-last", "replica-aware", "pacing"))
    ap.add_argument("--name", required=True, help="the controller name jobs declare in their spec")
    ap.add_argument("--leader", action="append", default=[], help="JOB=TASK (leader-last)")
    ap.add_argument("--max-down", type=int, default=1)
    ap.add_argument("--shards", type=Path, help="JSON {task: [shard, ...]} (replica-aware)")
    ap.add_argument("--min-live", type=int, default=2)
    ap.add_argument("--load-file", type=Path, help="a file holding the current load, 0..1 (pacing)")
    ap.add_argument("--keep-below-s", type=float, default=KEEP_BELOW_MS / 1000,
                    help="a maintenance expected to last at most this many seconds may be sat through (KEEP) "
                         "(replica-aware, pacing)")
    a = ap.parse_args(argv)
    try:
        decide = _decider(a)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        cfg = Config.from_env()
        metrics.serve_worker(cfg.run_dir)  # infra/metrics.py: its read position among them (READ_POSITION)
        TaskControllerProcess(cfg.as_principal("controller"), a.name, decide).run()
    except KeyboardInterrupt:
        raise SystemExit(130)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - one line with the reason, never a traceback (the CLI's rule)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SystemExit(f"{ap.prog}: {text}") from None


def _read_file(path: Path, flag: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise SystemExit(f"{flag} {path}: {exc.strerror}") from None


def _decider(a: argparse.Namespace):
    """The decide function of the controller the arguments name; SystemExit with one line on a bad argument."""
    keep_below_ms = int(a.keep_below_s * 1000)
    if a.kind == "leader-last":
        return LeaderLast(_pairs(a.leader), a.max_down)
    if a.kind == "replica-aware":
        if a.shards is None:
            raise SystemExit("replica-aware needs --shards FILE")
        try:
            shards = json.loads(_read_file(a.shards, "--shards"))
        except ValueError as exc:
            raise SystemExit(f"--shards {a.shards}: not JSON: {exc}") from None
        if not isinstance(shards, dict) or not all(isinstance(v, list) for v in shards.values()):
            raise SystemExit(f"--shards {a.shards}: expected a JSON object {{task: [shard, ...]}}")
        return ReplicaAware(shards, a.min_live, keep_below_ms)
    if a.load_file is None:
        raise SystemExit("pacing needs --load-file FILE")
    _read_file(a.load_file, "--load-file")  # there now; read again at each decision
    return Pacing(lambda: float(a.load_file.read_text().strip() or 0), keep_below_ms=keep_below_ms)

if __name__ == "__main__":
    main()
