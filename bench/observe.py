"""What the benchmark sees of the pipeline: a reader of ``allocations`` and ``tasks`` that keeps, per job and task,
what was allocated where and when, and which task runs where since when.

Times are the records' log timestamps (the producing process's clock at produce time, CreateTime): the latency
of a job is the log time of the TasksAllocated that completed it minus the JobSubmitted's envelope timestamp,
so how quickly the benchmark itself reads the log does not enter any figure. Everything runs on one machine,
so the clocks agree.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Callable

from infra.config import Config
from streams.batches import (
    SERVICE_DISCOVERY_UPDATED, TASK_STATES_CHANGED, TASKS_COMMANDED, discovery_changes, task_commands, task_reports,
)
from streams.clients import EventConsumer
from streams.serde import SchemaRegistry
from streams.topics import Topics

TOPICS = ("allocations", "tasks")


TASK_REPORTS = frozenset({"TaskStateChanged", TASK_STATES_CHANGED})  # one report, or an agent's batch of them
DISCOVERY = frozenset({"ServiceDiscoveryChanged", SERVICE_DISCOVERY_UPDATED})  # one task's change, or a job's
COMMANDS = frozenset({"TaskCommanded", TASKS_COMMANDED})  # one task's command, or a job's


class LogObserver:
    def __init__(self, cfg: Config, registry: SchemaRegistry):
        names = Topics(cfg.topic_prefix, cfg.partitions)
        self.consumer = EventConsumer(cfg, registry, [names.name(t) for t in TOPICS], name="bench-observer")
        self.placement: dict[str, str] = {}  # task -> machine, from TasksAllocated / TasksDeallocated
        self.allocated: dict[str, set[str]] = defaultdict(set)  # job -> tasks ever allocated
        self.wanted: dict[str, int] = {}  # job -> tasks it should have allocated (set by the workload)
        self.done_ms: dict[str, int] = {}  # job -> log time its wanted tasks were all allocated
        self.requested_ms: dict[str, int] = {}  # job -> log time of its first AllocationRequested since expect()
        self.running: dict[str, tuple[str, int]] = {}  # task -> (machine, log time) of its latest RUNNING
        # the hops of a task's latest move (the failover's timeline): log times of the job's latest AllocationRequested
        # naming it, of the TasksAllocated that placed it, of the START command to that machine
        self.asked_ms: dict[str, int] = {}
        self.allocated_ms: dict[str, tuple[str, int]] = {}  # task -> (machine, log time)
        self.started_ms: dict[str, tuple[str, int]] = {}  # task -> (machine, log time)
        self.discovered: dict[str, tuple[str, int]] = {}  # task -> (machine, log time) the scheduler enabled it on
        self.undiscovered_ms: dict[str, int] = {}  # task -> log time the scheduler last took it out of discovery
        self.rejected: Counter[str] = Counter()  # AllocationRejected reasons
        self.by_type: Counter[str] = Counter()
        self.records = 0
        self.times: list[int] = []  # log time of every record read

    def expect(self, job: str, tasks: int) -> None:
        """From now on, ``job`` is done when ``tasks`` of its tasks were allocated."""
        self.wanted[job] = tasks
        self.done_ms.pop(job, None)
        self.requested_ms.pop(job, None)

    def _check(self, job: str, ts: int | None) -> None:
        want = self.wanted.get(job)
        if want is not None and job not in self.done_ms and len(self.allocated[job]) >= want and ts is not None:
            self.done_ms[job] = ts

    def poll(self, timeout_s: float = 0.2) -> int:  # noqa: C901
        recs = self.consumer.poll(10_000, timeout_s)
        for rec in recs:
            ev = rec.event
            p = ev.payload
            self.records += 1
            self.by_type[ev.type] += 1
            ts = rec.log_timestamp_ms
            self.times.append(ts)
            if ev.type == "TasksAllocated":
                job = p["job_id"]
                for pl in p["placements"]:
                    self.placement[pl["task_id"]] = pl["machine_id"]
                    self.allocated[job].add(pl["task_id"])
                    self.allocated_ms[pl["task_id"]] = (pl["machine_id"], ts)
                self._check(job, ts)
            elif ev.type == "AllocationRequested":
                if p["place_task_ids"] and p["job_id"] in self.wanted:
                    self.requested_ms.setdefault(p["job_id"], ts)
                for t in p["place_task_ids"]:
                    self.asked_ms[t] = ts
            elif ev.type == "TasksDeallocated":
                for pl in p["placements"]:
                    if self.placement.get(pl["task_id"]) == pl["machine_id"]:
                        del self.placement[pl["task_id"]]
            elif ev.type == "AllocationRejected":
                self.rejected[p["reason"]] += len(p["unplaced_task_ids"])
            elif ev.type in TASK_REPORTS:
                for r in task_reports(ev):
                    if r["state"] == "RUNNING":
                        self.running[r["task_id"]] = (r["machine_id"], ts)
            elif ev.type in COMMANDS:
                for c in task_commands(ev):
                    if c["command"] != "STOP":
                        self.started_ms[c["task_id"]] = (c["machine_id"], ts)
            elif ev.type in DISCOVERY:
                for c in discovery_changes(ev):
                    if c["enabled"]:
                        self.discovered[c["task_id"]] = (c["machine_id"], ts)
                    elif self.discovered.get(c["task_id"], ("",))[0] == c["machine_id"]:
                        del self.discovered[c["task_id"]]
                        self.undiscovered_ms[c["task_id"]] = ts
        return len(recs)

    def wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Poll until ``done()`` or ``timeout_s``; whether it got done."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if done():
                return True
            if time.monotonic() > deadline:
                return False

    def close(self) -> None:
        self.consumer.close()
