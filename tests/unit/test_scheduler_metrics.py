"""The shard's gauges of pending tasks and awaited TaskControl operations (processors/scheduler/metrics.py) are the
sums over the jobs' latest states, kept as each job's state changes (not summed over every job at each change)."""
from collections import Counter

from infra import metrics
from processors.scheduler.metrics import NO_REASON, ShardMetrics
from streams.events import new_event

T0 = 1_700_000_000_000


def state(job, tasks, deleted=False):
    """A JobStatePublished of ``job`` whose tasks are (state, reason) pairs."""
    return new_event("JobStatePublished", {
        "job_id": job, "name": job, "state": "RUNNING", "spec_version": 1, "desired_tasks": len(tasks),
        "tasks": [{"task_id": f"{job}/{i}", "state": s, "machine_id": None, "dc": None, "msb": None, "rack": None,
                   "spec_version": 1, "reason": r} for i, (s, r) in enumerate(tasks)],
        "last_reason": "", "deleted": deleted, "task_parts": 1, "task_count": len(tasks), "incarnation": 1},
        entitlement="e1", entity_id=job, producer="scheduler", timestamp_ms=T0)


def requested(job, operations):
    return new_event("TaskControlRequested", {"job_id": job, "sequence": 1, "pending_operations": [
        {"task_id": f"{job}/{i}"} for i in range(operations)]}, entitlement="e1", entity_id=job, producer="scheduler",
        timestamp_ms=T0)


def gauge(g, **labels):
    return (g.labels(**labels) if labels else g)._value.get()


STEPS = [  # (job, tasks or None: deleted)
    ("a", [("PENDING", "no_capacity"), ("PENDING", ""), ("RUNNING", "")]),
    ("b", [("PENDING", "no_capacity"), ("STARTING", "")]),
    ("a", [("RUNNING", ""), ("PENDING", ""), ("RUNNING", "")]),
    ("c", [("PENDING", "machine_failed")]),
    ("b", None),
    ("c", [("RUNNING", "")]),
]


def test_the_pending_gauges_are_the_sums_of_the_jobs_latest_states():
    m = ShardMetrics()
    latest: dict[str, Counter] = {}
    for job, tasks in STEPS:
        m.decided(new_event("TaskStatesChanged", {}, entitlement="e1", entity_id=job, producer="x", timestamp_ms=T0),
                  [state(job, tasks or [], deleted=tasks is None)], 0.001, T0)
        before = latest.pop(job, Counter())
        if tasks is not None:
            latest[job] = Counter(r or NO_REASON for s, r in tasks if s != "RUNNING")
        want = sum(latest.values(), Counter())
        assert m.pending_total == want, (job, tasks)
        for reason in set(before) | set(latest.get(job, ())):  # the gauges this state set (they are the process's)
            assert gauge(metrics.PENDING_TASKS, reason=reason) == want[reason], reason


def test_the_awaited_operations_gauge_follows_each_jobs_latest_request():
    m = ShardMetrics()
    m.decided(requested("a", 0), [requested("a", 3)], 0.001, T0)
    m.decided(requested("b", 0), [requested("b", 2)], 0.001, T0)
    assert gauge(metrics.TASKCONTROL_PENDING) == 5
    m.decided(requested("a", 0), [requested("a", 1)], 0.001, T0)  # a's latest request awaits one
    assert gauge(metrics.TASKCONTROL_PENDING) == 3 == m.awaiting_total
    m.decided(requested("b", 0), [state("b", [], deleted=True)], 0.001, T0)  # b gone
    assert gauge(metrics.TASKCONTROL_PENDING) == 1 == m.awaiting_total
