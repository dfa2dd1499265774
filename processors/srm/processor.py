"""The SRM (autoscaler) as a running worker: thin wiring of ``processors.follower`` around ``decide.py``.

    python -m processors.srm.processor       # configuration from ROPEWALK_* (infra.config)

It folds ``intents`` (autoscaling policies, reconciled sizes, its own past decisions) and ``metrics`` (load
samples) from their beginning without deciding, then follows both: each new load sample may make a
SizingIntentDeclared (owner srm) on ``intents``, keyed by the job's entitlement, which the Job Control Plane
reconciles. A decision lost in a crash is simply made again by the next sample. A stopped job's learned day is
dropped a week (``Tuning.shape_keep_ms``) of log time after its stop (``decide.collect``, now and then).
"""
from __future__ import annotations

import sys

from infra.credentials import SRM
from processors.follower import Follower, main_of
from processors.srm.decide import CONSUMED, PRODUCER, SrmState, Tuning, collect, decide
from streams.clients import Record
from streams.events import Event


class Autoscaler(Follower):
    NAME = PRODUCER
    PRINCIPAL = SRM
    TOPICS = ("intents", "metrics")
    TYPES = CONSUMED

    def __init__(self, cfg, *, tuning: Tuning = Tuning(), **kw):
        super().__init__(cfg, **kw)
        self.state = SrmState()
        self.tuning = tuning

    def handle(self, records: list[Record], live: bool) -> list[Event]:
        out: list[Event] = []
        for r in records:
            self.state, emitted = decide(self.state, r.event, live=live, tuning=self.tuning)
            for e in emitted:  # its own decision is a fact at once (read back later, it changes nothing)
                self.state, _ = decide(self.state, e, live=False, tuning=self.tuning)
            out += emitted
        if (now := self.log_time_due("collect", records, self.tuning.shape_keep_ms // 10)) is not None:
            self.state, _ = collect(self.state, now, self.tuning)  # the stopped jobs' shapes, now and then
        return out


if __name__ == "__main__":
    sys.exit(main_of(Autoscaler))
