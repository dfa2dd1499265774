"""Sidekick as a running processor: thin wiring around ``decide``.

    python -m processors.sidekick.processor [--max-switching 0.1] [--interval-ms 500]

It follows the log into a ``SidekickView`` (the allocator's sources, plus its own HostProfileRequested on
``tasks``: ``processors/allocator/follow.py``) and every ``interval_ms`` produces the switches ``decide`` asks
for, flushed. One process for the region; restarted, it folds the log again and finds its requests in flight on
it (a request asked again from the same fold is the same event).
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
from processors.sidekick import decide as sk
from processors.worker import LoopWorker, close_clients
from streams.deadletter import DeadLetters
from streams.partitionmap import routed_producer
from streams.serde import SchemaRegistry

log = logging.getLogger("ropewalk.sidekick")

DEFAULT_MAX_SWITCHING = float(os.environ.get("ROPEWALK_PROFILE_MAX_SWITCHING", sk.DEFAULT_MAX_SWITCHING))
DEFAULT_INTERVAL_MS = 500


def now_ms() -> int:
    return int(time.time() * 1000)


class Sidekick(LoopWorker):
    def __init__(self, cfg: Config, max_switching: float = DEFAULT_MAX_SWITCHING,
                 interval_ms: int = DEFAULT_INTERVAL_MS, *, registry: SchemaRegistry | None = None):
        if not 0.0 < max_switching <= 1.0:
            raise ValueError(f"max_switching must be in (0, 1], got {max_switching}")
        self.cfg, self.max_switching, self.interval_ms = cfg, max_switching, interval_ms
        self.registry = registry or SchemaRegistry.from_dir()
        self.view = sk.SidekickView()
        self.producer = routed_producer(cfg, self.registry, sk.PRODUCER)
        self.follower = Follower(cfg, self.registry, self.view, topics=(*SOURCES, "tasks"),
                                 types=region_fold.EVENT_TYPES | sk.EVENT_TYPES, name=sk.PRODUCER,
                                 dead_letters=DeadLetters(self.producer, sk.PRODUCER))  # forged machine events
        self.caught_up = False
        self._next = 0
        self.requested = 0

    def step(self) -> None:
        if not self.caught_up:
            log.info("sidekick: folded the log: %s", self.follower.catch_up())
            self.caught_up = True
        self.follower.poll(timeout_s=self.interval_ms / 1000)
        if now_ms() >= self._next:
            self._next = now_ms() + self.interval_ms
            events = self.view.switches(now_ms(), self.max_switching)
            if events:
                self.producer.send_all(events)
                self.producer.flush()
                self.requested += len(events)
                log.info("sidekick: %d switches asked (%s)", len(events),
                         ", ".join(f"{e.payload['machine_id']}->{e.payload['host_profile'] or 'default'}"
                                   for e in events[:5]))

    def close(self) -> None:
        self.follower.close()
        close_clients(None, self.producer, log, sk.PRODUCER)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m processors.sidekick.processor", description=__doc__.split("\n")[0])
    ap.add_argument("--max-switching", type=float, default=DEFAULT_MAX_SWITCHING,
                    help="at most this fraction of an entitlement's machines switch at once "
                         "(ROPEWALK_PROFILE_MAX_SWITCHING, default 0.1; at least one)")
    ap.add_argument("--interval-ms", type=int, default=DEFAULT_INTERVAL_MS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    metrics.serve_worker(Config.from_env().run_dir)  # infra/metrics.py; `ropewalk up` lists the targets
    worker = Sidekick(Config.from_env().as_principal("sidekick"), args.max_switching, args.interval_ms)
    worker.stop_on_signals()
    worker.loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
