"""Reference TaskControllers: each a ``decide(request, view) -> approved operation ids``. Pure.

* ``LeaderLast``  an ensemble (ZooKeeper-like): followers first, one at a time, the leader last, so an n-member
                  ensemble sees at most one leader change per release (Twine §2.5).
* ``ReplicaAware`` a sharded service: never approves an operation that would leave a shard with fewer than
                  ``min_live`` live replicas, counting tasks already down for any reason (Figure 14).
* ``Pacing``      a stateless tier: how many operations may be in flight follows a load signal (§5.2: slower at
                  peak, normal pace off peak).

Common rule: an operation on a task that is already down (in ``unhealthy_task_ids``, e.g. a MOVE off a failed
machine) costs no availability and is approved, except by ``LeaderLast`` for the leader while followers wait.

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

from processors.taskcontrol.protocol import Request, View


def _down(request: Request, view: View) -> set[str]:
    """Tasks not serving: unhealthy for any reason, or taken by an operation this controller approved."""
    return set(request.unhealthy) | set(view.in_flight_tasks)


@dataclass(frozen=True)
class LeaderLast:
    """Approve follower operations while fewer than ``max_down`` tasks are down (in flight included), lowest task
    first; the leader's only when no other operation is pending or in flight and no other task is down."""

    leaders: Mapping[str, str]  # job id → the leader's task id
    max_down: int = 1

    def __call__(self, request: Request, view: View) -> list[str]:
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
        return approved


@dataclass(frozen=True)
class ReplicaAware:
    """``shards`` maps each task to the shards it hosts; an operation is approved only if every shard of its task
    keeps at least ``min_live`` live replicas afterwards (tasks down for any reason do not count as live)."""

    shards: Mapping[str, Iterable[str]]
    min_live: int = 2

    def __call__(self, request: Request, view: View) -> list[str]:
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
        return approved


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

    def width(self, load: float) -> int:
        return self.fast if load < self.low else self.slow if load > self.high else self.normal

    def __call__(self, request: Request, view: View) -> list[str]:
        room = self.width(self.load()) - len(view.in_flight)
        down = set(request.unhealthy)
        approved = []
        for op in request.pending:
            if op.task_id in down:
                approved.append(op.operation_id)
            elif room > 0:
                approved.append(op.operation_id)
                room -= 1
        return approved


def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        job, sep, task = item.partition("=")
        if not sep:
            raise SystemExit(f"--leader expects JOB=TASK, got {item!r}")
        out[job] = task
    return out


def main(argv: list[str] | None = None) -> None:
    from infra.config import Config
    from processors.taskcontrol.controller import TaskControllerProcess

    ap = argparse.ArgumentParser(prog="python -m processors.taskcontrol.controllers")
    ap.add_argument("kind", choices=("leader-last", "replica-aware", "pacing"))
    ap.add_argument("--name", required=True, help="the controller name jobs declare in their spec")
    ap.add_argument("--leader", action="append", default=[], help="JOB=TASK (leader-last)")
    ap.add_argument("--max-down", type=int, default=1)
    ap.add_argument("--shards", type=Path, help="JSON {task: [shard, ...]} (replica-aware)")
    ap.add_argument("--min-live", type=int, default=2)
    ap.add_argument("--load-file", type=Path, help="a file holding the current load, 0..1 (pacing)")
    a = ap.parse_args(argv)
    if a.kind == "leader-last":
        decide = LeaderLast(_pairs(a.leader), a.max_down)
    elif a.kind == "replica-aware":
        if a.shards is None:
            raise SystemExit("replica-aware needs --shards FILE")
        decide = ReplicaAware(json.loads(a.shards.read_text()), a.min_live)
    else:
        if a.load_file is None:
            raise SystemExit("pacing needs --load-file FILE")
        decide = Pacing(lambda: float(a.load_file.read_text().strip() or 0))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    TaskControllerProcess(Config.from_env(), a.name, decide).run()


if __name__ == "__main__":
    main()
