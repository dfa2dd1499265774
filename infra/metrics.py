"""Prometheus metrics of every Ropewalk process (prometheus-client), defined here once.

Names follow Prometheus's conventions: a ``ropewalk_`` prefix, base units in the name (``_seconds``, ``_bytes``),
``_total`` for counters. Labels are small closed sets (a result, a reason constant, a worker, a topic, a consumer
group, a state, an entitlement): never a machine id or a task id, whose cardinality grows with the region.

**A target exports what its process does, nothing else.** A metric is registered in a process's registry only when
that process owns it: declared at start (``serve_worker(run_dir, owns=...)``: the allocator's index staleness, the
scheduler's histograms, present from the start with their zero values) or first used (a dead letter). A metric no
code of the process touches is not exported there, so a ``sum`` across targets adds only real series: before, all 13
targets (the supervisor's too) reported ``ropewalk_index_staleness_seconds 0`` and empty histograms. Counters have
no ``_created`` series (``disable_created_metrics``), and every target has ``ropewalk_build_info`` (version, git
revision, Python) and the process's own ``process_*``/``python_*`` series.

Each worker serves its registry over HTTP (``serve``): on an ephemeral port on 127.0.0.1 (``ROPEWALK_METRICS_ADDR``
``HOST:PORT`` says otherwise: a worker on another machine, scraped from the Prometheus host), written to
``<run dir>/metrics/<worker>.port``; ``targets(run_dir)`` lists them and ``write_file_sd`` writes a Prometheus
``file_sd_configs`` file (``<run dir>/metrics/targets.json``) that `ropewalk up` prints. The HTTP API serves the same
registry on its own port at ``/metrics``. An ephemeral port never collides with another region on the machine
(tests run several). A Grafana dashboard of these metrics is ``infra/grafana/ropewalk.json``.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from infra.config import PROJECT_ROOT
from infra.private import make_dir, write_private

log = logging.getLogger(__name__)
METRICS_DIR = "metrics"
TARGETS_FILE = "targets.json"
METRICS_ADDR_ENV = "ROPEWALK_METRICS_ADDR"  # HOST:PORT a worker serves its metrics on (default 127.0.0.1:0)
# Latencies of a control plane: from a few ms (one decision) to minutes (a big job through a busy region).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# One placement decision of the allocator: from tens of microseconds (a task on a small region) to seconds.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

disable_created_metrics()  # no ``*_created`` series beside every counter and histogram (issue 30)


class Metric:
    """A metric of the catalogue below, made and registered in this process's registry the first time it is used
    or declared (``own``): a process exports only the metrics it owns. Reads like the prometheus-client object it
    wraps (``.labels``, ``.inc``, ``.set``, ``.observe``, ``.collect``)."""

    def __init__(self, kind, name: str, doc: str, labels=(), **kwargs):
        self.kind, self.name, self.doc, self.label_names, self.kwargs = kind, name, doc, tuple(labels), kwargs
        self._made = None
        self._lock = threading.Lock()

    def made(self):
        with self._lock:
            if self._made is None:
                self._made = self.kind(self.name, self.doc, self.label_names, **self.kwargs)
            return self._made

    @property
    def registered(self) -> bool:
        return self._made is not None

    def __getattr__(self, attr: str):
        return getattr(self.made(), attr)


# -- the metrics (one place; a process exports those it touches) ------------------------------------------------
SCHEDULING_ATTEMPT = Metric(Histogram, "ropewalk_scheduling_attempt_duration_seconds",
                               "Time the scheduler spent deciding on one event, by result (events: it emitted "
                               "events; noop: nothing to do; refused: an intent refused)", ["result"],
                               buckets=LATENCY_BUCKETS)
SUBMIT_TO_RUNNING = Metric(Histogram, "ropewalk_submit_to_running_seconds",
                              "From a job's submission (its JobSubmitted event time) to all its tasks RUNNING, as "
                              "the scheduler reads it", buckets=LATENCY_BUCKETS)
PENDING_TASKS = Metric(Gauge, "ropewalk_pending_tasks", "Tasks not running, by the reason they wait (the allocator's or "
                                                "the scheduler's reason constant; none: not yet decided)", ["reason"])
TASK_MOVES = Metric(Counter, "ropewalk_task_moves_total", "Tasks the scheduler moved to another machine, by reason",
                     ["reason"])
ALLOCATION_ATTEMPTS = Metric(Counter, "ropewalk_allocation_attempts_total",
                              "Tasks the allocator tried to place, by result (placed, unplaceable, conflict)",
                              ["result"])
ALLOCATION_DECISION = Metric(Histogram, "ropewalk_allocation_decision_duration_seconds",
                             "The allocator's time to decide one request on its fold (placement filters, scores, the "
                             "fold's commit; not the Redis commit), by result (placed: some task placed, unplaceable: "
                             "none placed, freed: a request that only frees)", ["result"], buckets=DECISION_BUCKETS)
INDEX_STALENESS = Metric(Gauge, "ropewalk_index_staleness_seconds",
                        "How far the allocator's Redis index is behind the log: now minus the time of the newest "
                        "event it applied, 0 when it has read everything")
ALLOCATOR_TAIL = Metric(Gauge, "ropewalk_allocator_tail_records",
                       "Records of the log the allocator has read since its newest snapshot of its fold (written or "
                       "loaded: processors/allocator/snapshot.py): what a restart would read after the snapshot; it "
                       "grows past ROPEWALK_ALLOC_SNAPSHOT_RECORDS only while no snapshot can be written")
MACHINES = Metric(Gauge, "ropewalk_machines", "Machines by status and owning entitlement (free: the free pool)",
                 ["status", "entitlement"])
TASKCONTROL_ACK = Metric(Histogram, "ropewalk_taskcontrol_ack_duration_seconds",
                            "From a TaskControl request to its controller's ack", buckets=LATENCY_BUCKETS)
TASKCONTROL_PENDING = Metric(Gauge, "ropewalk_taskcontrol_pending_operations",
                            "Operations waiting for their controller's ack")
CONSUMER_LAG = Metric(Gauge, "ropewalk_consumer_lag_seconds",
                     "How far a worker's reader of the log is behind its topic: now minus the log time of the oldest "
                     "record its last poll returned (0 after a poll that found nothing new). Only readers that follow "
                     "the log for a worker export it, not one-shot reads (an API request reading state.jobs)",
                     ["group", "topic"])
READ_POSITION = Metric(Gauge, "ropewalk_reader_position",
                      "The next offset a reader without a consumer group (a TaskController) has read and acted on, "
                      "its outputs flushed: where a group's committed offset would be, by reader, topic and "
                      "partition (a test's marker that a reader has read past an event)",
                      ["reader", "topic", "partition"])
TIMER_TICKS = Metric(Counter, "ropewalk_timer_ticks_total",
                      "Rounds of a worker's timer completed, their output flushed, by worker kind (a test's marker "
                      "that time passed for the worker, however slow the machine)", ["worker"])
DEAD_LETTERS = Metric(Counter, "ropewalk_dead_letters_total", "Records dead-lettered, by origin topic and reason",
                       ["topic", "reason"])
WORKER_RESTARTS = Metric(Counter, "ropewalk_worker_restarts_total", "Restarts of a worker by the region's supervisor",
                          ["worker"])
HEALTH_ZONE_STATE = Metric(Gauge, "ropewalk_health_zone_state",
                          "The health check's view of each zone (DC) for its protection against mass failure: 0 normal, "
                          "1 partial disruption, 2 full disruption (processors/health/zones.py)", ["dc"])
HEALTH_ZONE_SILENT = Metric(Gauge, "ropewalk_health_zone_silent_machines",
                           "Machines of a zone the health check finds silent (or failed itself), at its last tick",
                           ["dc"])
HEALTH_ZONE_HELD = Metric(Gauge, "ropewalk_health_zone_held_machines",
                         "Silent machines of a zone its failure rate kept from being failed at the last tick", ["dc"])
HEALTH_REGION_DISRUPTED = Metric(Gauge, "ropewalk_health_region_disrupted",
                                "1 while every zone is in full disruption: the health check fails nobody")
HEALTH_CLOCK_RESTARTS = Metric(Counter, "ropewalk_health_clock_restarts_total",
                                "Times the health check counted every silence anew, by reason (started, tick_gap, "
                                "reading_behind, region_disruption_ended)", ["reason"])
BUILD_INFO = Metric(Gauge, "ropewalk_build_info", "Always 1: what this process runs (the package version, the "
                    "git revision of the checkout, or unknown, and the Python version) and as which worker",
                    ["version", "revision", "python", "worker"])
API_REQUESTS = Metric(Histogram, "ropewalk_api_request_duration_seconds",
                         "HTTP API requests by route template, method and status code",
                         ["route", "method", "status"], buckets=LATENCY_BUCKETS)


def logical_topic(physical: str, prefix: str) -> str:
    """A topic label without the region's prefix (one series per topic of the catalogue, whatever the prefix)."""
    return physical[len(prefix):] if prefix and physical.startswith(prefix) else physical


def observe_lag(group: str, records, prefix: str = "", now_s: float | None = None) -> None:
    """``CONSUMER_LAG`` from one poll's records (``streams.clients.Record``: ``log_timestamp_ms``, ``topic``)."""
    now_ms = (time.time() if now_s is None else now_s) * 1000
    oldest: dict[str, int] = {}
    for rec in records:
        ts = getattr(rec, "log_timestamp_ms", None)
        if ts is not None:
            t = logical_topic(rec.topic, prefix)
            oldest[t] = min(ts, oldest.get(t, ts))
    for topic, ts in oldest.items():
        CONSUMER_LAG.labels(group=group, topic=topic).set(max(0.0, (now_ms - ts) / 1000))
    if not records:
        for sample in _samples(CONSUMER_LAG):
            if sample.labels.get("group") == group:
                CONSUMER_LAG.labels(**sample.labels).set(0)


def observe_position(reader: str, positions: Mapping[tuple[str, int], int], prefix: str = "") -> None:
    """``READ_POSITION`` of a reader from ``{(physical topic, partition): next offset}``; call it once what was
    read is acted on (its outputs flushed), never right after a poll."""
    for (topic, partition), offset in positions.items():
        READ_POSITION.labels(reader=reader, topic=logical_topic(topic, prefix), partition=str(partition)).set(offset)


def _samples(metric):
    for family in metric.collect():
        yield from family.samples


def own(*owned: Metric, **series: list[dict[str, str]]) -> None:
    """Declare the metrics this process exports from its start: each is registered now (an unlabelled gauge or
    histogram at 0, so a scrape shows it before the first event). ``series``: per metric name, the label sets to
    create now at zero (``ropewalk_worker_restarts_total`` of every program: ``increase()`` then sees the first
    restart, which it misses on a series born at 1)."""
    for m in owned:
        m.made()
        for labels in series.get(m.name, ()):
            m.labels(**labels)


def build_info(worker: str) -> None:
    """``ropewalk_build_info{version, revision, python, worker} 1``."""
    BUILD_INFO.labels(version=_version(), revision=_revision(), python=platform.python_version(),
                      worker=worker).set(1)


def _version() -> str:
    try:
        return version("ropewalk")
    except PackageNotFoundError:
        return "unknown"


def _revision() -> str:
    """The checkout's git commit (12 hex digits), read from .git without running git; ``unknown`` elsewhere."""
    try:
        git = PROJECT_ROOT / ".git"
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = Path(git.read_text().split(":", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            common = git / "commondir"
            base = (git / common.read_text().strip()).resolve() if common.is_file() else git
            for d in (git, base):
                if (d / ref).is_file():
                    return (d / ref).read_text().strip()[:12]
            for d in (git, base):
                packed = d / "packed-refs"
                if packed.is_file():
                    for line in packed.read_text().splitlines():
                        if line.endswith(" " + ref):
                            return line.split()[0][:12]
            return "unknown"
        return head[:12]
    except (OSError, IndexError):
        return "unknown"


def serve(run_dir: Path | str, worker: str, owns: tuple[Metric, ...] = (), **series) -> int | None:
    """Serve this process's metrics on an ephemeral port of 127.0.0.1 and write the port to
    ``<run dir>/metrics/<worker>.port``; the port, or None when it could not (logged; the worker goes on).
    ``owns``/``series``: the metrics it exports from the start (``own``)."""
    own(*owns, **series)
    build_info(worker)
    host, _, port = (os.environ.get(METRICS_ADDR_ENV) or "127.0.0.1:0").rpartition(":")
    try:
        server, _thread = start_http_server(int(port or 0), addr=host or "127.0.0.1")
        port = server.server_address[1]
        d = make_dir(Path(run_dir) / METRICS_DIR)  # 0700 (infra/private.py)
        tmp = d / f".{worker}.port"
        tmp.write_text(f"{port}\n")
        tmp.replace(d / f"{worker}.port")
        return port
    except (OSError, ValueError) as exc:
        log.warning("%s: metrics not served (%s=%r): %s", worker, METRICS_ADDR_ENV, os.environ.get(METRICS_ADDR_ENV),
                    exc)
        return None


def serve_worker(run_dir: Path | str, owns: tuple[Metric, ...] = ()) -> int | None:
    """``serve`` under the name the supervisor gave this worker (``ROPEWALK_WORKER_NAME``); nothing without one (a
    processor started by hand or by a test). ``owns``: the metrics the worker exports from its start."""
    name = os.environ.get("ROPEWALK_WORKER_NAME")
    return serve(run_dir, name, owns) if name else None


def targets(run_dir: Path | str) -> dict[str, str]:
    """``{worker: "127.0.0.1:PORT"}`` of the workers that serve metrics under ``run_dir``."""
    d = Path(run_dir) / METRICS_DIR
    out = {}
    for f in sorted(d.glob("*.port")) if d.is_dir() else ():
        try:
            out[f.stem] = f"127.0.0.1:{int(f.read_text().strip())}"
        except (OSError, ValueError):
            continue
    return out


def write_file_sd(run_dir: Path | str, extra: dict[str, str] | None = None) -> Path:
    """A Prometheus ``file_sd_configs`` file of every target (``extra``: the API's), one group per worker."""
    found = {**targets(run_dir), **(extra or {})}
    path = Path(run_dir) / METRICS_DIR / TARGETS_FILE
    make_dir(path.parent)
    write_private(path, json.dumps([{"targets": [addr], "labels": {"job": "ropewalk", "worker": w}}
                                for w, addr in sorted(found.items())], indent=2) + "\n")
    return path


def forget(run_dir: Path | str, worker: str) -> None:
    (Path(run_dir) / METRICS_DIR / f"{worker}.port").unlink(missing_ok=True)
