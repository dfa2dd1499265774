"""Elastic loans as a running worker: thin wiring of ``processors.follower`` around ``loans.py`` (the Resource
Broker's package; a worker of its own so that the registry process keeps reading only machines).

    python -m processors.resourcebroker.lender      # configuration from ROPEWALK_* (infra.config)

It folds ``machines`` (owners, statuses), ``intents`` (entitlements' quotas, elasticity), ``unavailability``
(maintenance windows), ``allocations`` (rejections and placements: who waits for what; only those two types are
decoded) and ``loans`` (its own past decisions) from their beginning, then follows them and decides every
``TICK_S``: ``LoanGranted``/``LoanRevoked`` on ``loans``, quotas (EntitlementUpdated) on ``intents``, the notice of a
revocation (UnavailabilityStarted with ``vacate``) and its end on ``unavailability``; a machine returned is
announced (``LoanReturned``) as its release is read. ``ROPEWALK_LOANS_HEADROOM``, ``ROPEWALK_LOANS_COOLDOWN_MS``
tune it.
"""
from __future__ import annotations

import os
import sys

from infra.credentials import LENDER
from processors.follower import Follower, main_of
from processors.resourcebroker import loans as ln
from streams.clients import Record
from streams.events import Event

OWN_LOAN_EVENTS = frozenset({"LoanGranted", "LoanRevoked", "LoanReturned"})


def tuning_from_env(env=None) -> ln.Tuning:
    env = os.environ if env is None else env
    d = ln.Tuning()
    return ln.Tuning(headroom_machines=int(env.get("ROPEWALK_LOANS_HEADROOM", d.headroom_machines)),
                     lend_cooldown_ms=int(env.get("ROPEWALK_LOANS_COOLDOWN_MS", d.lend_cooldown_ms)),
                     demand_window_ms=int(env.get("ROPEWALK_LOANS_DEMAND_WINDOW_MS", d.demand_window_ms)))


class Lender(Follower):
    NAME = ln.PRODUCER
    PRINCIPAL = LENDER
    TOPICS = ln.TOPICS
    TYPES = ln.CONSUMED
    TICK_S = 1.0

    def __init__(self, cfg, *, tuning: ln.Tuning | None = None, **kw):
        super().__init__(cfg, background=True, **kw)
        self.book = ln.LoanBook()
        self.tuning = tuning or tuning_from_env()

    def handle(self, records: list[Record], live: bool) -> list[Event]:
        out: list[Event] = []
        for r in records:
            ev = r.event
            if live and ev.producer == ln.PRODUCER and ev.type in OWN_LOAN_EVENTS:
                continue  # applied when decided
            self.book, emitted = ln.apply(self.book, ev, self.tuning)
            if live:
                out += emitted
        return out

    def tick(self, now_ms: int) -> list[Event]:
        self.book, out = ln.tick(self.book, now_ms, self.tuning)
        return out


if __name__ == "__main__":
    sys.exit(main_of(Lender))
