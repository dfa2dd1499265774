"""The ReBalancer as a running processor: thin wiring around ``view`` and ``solver``.

    python -m processors.rebalancer.processor [--interval-s 60] [--target-ratio 1.10] [--trigger-ratio 1.15]
                                              [--max-move-fraction 0.05] [--deterministic-limit 5]

It follows the log into a ``RebalanceView`` (the allocator's sources, plus ``state.jobs`` and its own plans:
``processors/allocator/follow.py``), and every ``interval_s`` plans each entitlement that holds machines and has
no plan in flight: ``solver.solve`` on the entitlement's scope; a plan with moves is produced as one
``RebalancePlanned`` on ``intents`` (keyed by the entitlement: its scheduler shard performs the moves) and
flushed before the next round. It is applied to the view at once, so the next round already sees it in flight.

One process for the region (Twine's ReBalancer is one asynchronous service). Restarted, it folds the log again:
its plans are on it (a plan's id, ``<entitlement>:p<n>``, and its event id derive from the log), so nothing is
planned twice.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from infra import metrics
from infra.config import Config
from processors.allocator import fold as region_fold
from processors.allocator.follow import SOURCES, Follower
from processors.rebalancer import view as rv
from processors.rebalancer.solver import Goals, Plan, goals_arguments, goals_of, solve
from processors.worker import LoopWorker, close_clients
from streams.partitionmap import routed_producer
from streams.serde import SchemaRegistry

log = logging.getLogger("ropewalk.rebalancer")

DEFAULT_INTERVAL_S = float(os.environ.get("ROPEWALK_REBALANCE_INTERVAL_S", "60"))
TOPICS = (*SOURCES, "state.jobs")


def now_ms() -> int:
    return int(time.time() * 1000)


class Rebalancer(LoopWorker):
    def __init__(self, cfg: Config, goals: Goals = Goals(), interval_s: float = DEFAULT_INTERVAL_S, *,
                 registry: SchemaRegistry | None = None):
        self.cfg, self.goals, self.interval_s = cfg, goals, interval_s
        self.registry = registry or SchemaRegistry.from_dir()
        self.view = rv.RebalanceView(goals.no_bounce_ms)
        self.follower = Follower(cfg, self.registry, self.view, topics=TOPICS,
                                 types=region_fold.EVENT_TYPES | rv.EVENT_TYPES, name=rv.PRODUCER)
        self.producer = routed_producer(cfg, self.registry, rv.PRODUCER)
        self.caught_up = False
        self._planned_at = 0.0

    def catch_up(self) -> dict:
        stats = self.follower.catch_up()
        self.caught_up = True
        log.info("rebalancer: folded the log: %s", stats)
        return stats

    def plan_round(self, at_ms: int | None = None) -> list[Plan]:
        """Plan every due entitlement now; produce (and flush) the plans with moves. Returns every plan made."""
        at = now_ms() if at_ms is None else at_ms
        plans = []
        for ent in self.view.due(at):
            plan = solve(self.view.scope(ent, at), self.goals)
            plans.append(plan)
            events = self.view.plan_events(plan, self.goals, at)
            if not events:
                continue
            self.producer.send_all(events)
            self.producer.flush()
            for ev in events:
                self.view.apply(ev, None)  # in flight now; its echo from the log is a no-op (plan number)
            log.info("rebalancer: %s: %s, %d moves, max/mean %.3f -> %.3f, solved in %d ms (%s)",
                     ent, events[0].payload["plan_id"], len(plan.moves), plan.before.ratio, plan.after.ratio,
                     plan.solve_ms, plan.status)
        return plans

    def step(self) -> None:
        if not self.caught_up:
            self.catch_up()
        self.follower.poll(timeout_s=0.2)
        if time.monotonic() - self._planned_at >= self.interval_s:
            self._planned_at = time.monotonic()
            self.plan_round()

    def close(self) -> None:
        self.follower.close()
        close_clients(None, self.producer, log, rv.PRODUCER)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m processors.rebalancer.processor", description=__doc__.split("\n")[0])
    ap.add_argument("--interval-s", type=float, default=DEFAULT_INTERVAL_S,
                    help="seconds between planning rounds (ROPEWALK_REBALANCE_INTERVAL_S, default 60)")
    goals_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    metrics.serve_worker(Config.from_env().run_dir)  # infra/metrics.py; `ropewalk up` lists the targets
    worker = Rebalancer(Config.from_env().as_principal("rebalancer"), goals_of(args), args.interval_s)
    worker.stop_on_signals()
    worker.loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
