"""The Job Control Plane as a running worker: thin wiring of ``processors.follower`` around ``decide.py``.

    python -m processors.jobcontrol.processor      # configuration from ROPEWALK_* (infra.config)

It folds ``intents`` from the beginning (every partition: one worker serves the region), then follows it; each
JobSpecReconciled and IntentRefused it decides goes back on ``intents``, keyed by the job's entitlement, so the
scheduler shard of that entitlement reads it after the intents that caused it. Its decisions are a function of
the log alone: at a restart the fold re-decides everything without producing it, and produces only the decisions
whose events are not on the log (a crash between deciding and producing); the ids derive from the inputs', so a
reader that got one twice drops it. A stopped job leaves its state after ``ROPEWALK_JOB_GC_S`` (``decide.collect``,
run as the log's time passes a tenth of that grace; no decision depends on when).
"""
from __future__ import annotations

import sys

from infra.credentials import JOBCONTROL
from processors.follower import Follower, main_of
from processors.jobcontrol.decide import CONSUMED, PRODUCER, JcpState, collect, decide
from streams.clients import Record
from streams.events import Event


class JobControlPlane(Follower):
    NAME = PRODUCER
    PRINCIPAL = JOBCONTROL
    TOPICS = ("intents",)
    TYPES = CONSUMED | {"JobSpecReconciled"}  # its own outputs, to know which are on the log

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.state = JcpState()
        self.gc_ms = int(self.cfg.job_gc_s * 1000)  # a stopped job's grace
        self._pending: dict[str, Event] = {}  # catching up: decided, not (yet) seen on the log
        self._on_log: set[str] = set()  # catching up: its own events seen on the log

    def handle(self, records: list[Record], live: bool) -> list[Event]:
        out: list[Event] = []
        for r in records:
            ev = r.event
            if ev.producer == PRODUCER:
                if not live:
                    self._on_log.add(ev.event_id)
                    self._pending.pop(ev.event_id, None)
                continue
            self.state, emitted = decide(self.state, ev, (self.logical(r), r.partition, r.offset),
                                         max_tasks=self.cfg.max_tasks_per_job, gc_ms=self.gc_ms)
            if live:
                out += emitted
            else:
                self._pending.update((e.event_id, e) for e in emitted if e.event_id not in self._on_log)
        if (now := self.log_time_due("collect", records, self.gc_ms // 10)) is not None:  # the jobs held, now and then
            self.state, _ = collect(self.state, now, self.gc_ms)
        return out

    def caught_up(self) -> list[Event]:
        missing = [e for i, e in self._pending.items() if i not in self._on_log]
        self._pending, self._on_log = {}, set()
        return missing


if __name__ == "__main__":
    sys.exit(main_of(JobControlPlane))
