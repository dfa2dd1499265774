"""The scheduler shard's Prometheus metrics (infra/metrics.py), read from what it decides: each event in and the
events it emitted. One ``ShardMetrics`` per shard process (held by ``build_app``), fed after every decision; the
log stays the truth, these are a view of this process's work since it started.

* ``ropewalk_scheduling_attempt_duration_seconds{result}``: one decide() call; result ``refused`` (an
  IntentRefused out), ``events`` (anything else out), ``noop``.
* ``ropewalk_submit_to_running_seconds``: a JobSubmitted's time to the first published state with every desired
  task RUNNING (jobs submitted while this process runs).
* ``ropewalk_pending_tasks{reason}``: tasks of the shard's jobs not RUNNING, by their reason (the latest state of
  each job).
* ``ropewalk_task_moves_total{reason}``: tasks sent back to PENDING for a new placement because of their machine.
* ``ropewalk_taskcontrol_ack_duration_seconds`` / ``ropewalk_taskcontrol_pending_operations``: a TaskControl
  request to its ack; operations waiting for an ack (the latest request of each job).
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from infra import metrics
from processors.scheduler.reasons import (REASON_MACHINE_FAILED, REASON_MACHINE_MAINTENANCE,
                                          REASON_MACHINE_UNHEALTHY)
from streams.events import Event

MOVE_REASONS = frozenset({REASON_MACHINE_FAILED, REASON_MACHINE_UNHEALTHY, REASON_MACHINE_MAINTENANCE})
NO_REASON = "none"


class ShardMetrics:
    def __init__(self) -> None:
        self.submitted_ms: dict[str, int] = {}  # job -> its JobSubmitted time, until it first runs whole
        self.pending: dict[str, Counter] = {}  # job -> its tasks not RUNNING by reason
        # ... summed over the jobs, kept as each job's count changes: summing every job's at each published state
        # made a burst quadratic (3.5 % of a shard's CPU in a burst of 800 jobs at 10,000 machines, 2026-11-29)
        self.pending_total: Counter = Counter()
        self.requested_ms: dict[tuple[str, int], int] = {}  # (job, sequence) -> when its TaskControl request went
        self.awaiting: dict[str, int] = {}  # job -> operations its latest request awaits
        self.awaiting_total = 0  # ... summed over the jobs

    def decided(self, ev: Event, emitted: Sequence[Event], seconds: float, now_ms: int) -> None:
        result = ("refused" if any(e.type == "IntentRefused" for e in emitted) else "events" if emitted
                  else "noop")
        metrics.SCHEDULING_ATTEMPT.labels(result=result).observe(seconds)
        if ev.type == "JobSubmitted":
            self.submitted_ms.setdefault(ev.entity_id, ev.timestamp_ms)
        elif ev.type == "TaskControlAcked":
            sent = self.requested_ms.pop((ev.payload["job_id"], ev.payload["sequence"]), None)
            if sent is not None:
                metrics.TASKCONTROL_ACK.observe(max(0.0, (now_ms - sent) / 1000))
        for out in emitted:
            if out.type == "JobStatePublished":
                self._job_state(out, now_ms)
            elif out.type == "TaskStatesChanged":
                for r in out.payload["reports"]:
                    if (r["state"] == "PENDING" and r.get("previous_state") not in (None, "PENDING")
                            and r["reason"] in MOVE_REASONS):
                        metrics.TASK_MOVES.labels(reason=r["reason"]).inc()
            elif out.type == "TaskControlRequested":
                job = out.payload["job_id"]
                self.requested_ms[(job, out.payload["sequence"])] = now_ms
                self._awaits(job, len(out.payload["pending_operations"]))

    def _job_state(self, ev: Event, now_ms: int) -> None:
        p = ev.payload
        job = p["job_id"]
        tasks = p["tasks"]
        running = sum(t["state"] == "RUNNING" for t in tasks)
        if job in self.submitted_ms and tasks and running >= p["desired_tasks"]:
            metrics.SUBMIT_TO_RUNNING.observe(max(0.0, (now_ms - self.submitted_ms.pop(job)) / 1000))
        before = self.pending.pop(job, Counter())
        after: Counter = Counter()
        if not p.get("deleted"):
            after = self.pending[job] = Counter(t["reason"] or NO_REASON for t in tasks if t["state"] != "RUNNING")
        for reason in set(before) | set(after):
            total = self.pending_total[reason] - before[reason] + after[reason]
            if total:
                self.pending_total[reason] = total
            else:
                del self.pending_total[reason]
            metrics.PENDING_TASKS.labels(reason=reason).set(total)
        if p.get("deleted"):
            self._awaits(job, None)
            self.submitted_ms.pop(job, None)

    def _awaits(self, job: str, operations: int | None) -> None:
        """The operations ``job``'s latest TaskControl request awaits (None: the job is gone)."""
        self.awaiting_total -= self.awaiting.pop(job, 0)
        if operations is not None:
            self.awaiting[job] = operations
            self.awaiting_total += operations
        metrics.TASKCONTROL_PENDING.set(self.awaiting_total)
