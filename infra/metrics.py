"""Prometheus metrics of every Ropewalk process (prometheus-client), defined here once.

Names follow Prometheus's conventions: a ``ropewalk_`` prefix, base units in the name (``_seconds``, ``_bytes``),
``_total`` for counters. Labels are small closed sets (a result, a reason constant, a worker, a topic, a consumer
group, a state, an entitlement): never a machine id or a task id, whose cardinality grows with the region.

Each worker serves its registry over HTTP (``serve``): on an ephemeral port on 127.0.0.1 (``ROPEWALK_METRICS_ADDR``
``HOST:PORT`` says otherwise: a worker on another machine, scraped from the Prometheus host), written to
``<run dir>/metrics/<worker>.port``; ``targets(run_dir)`` lists them and ``write_file_sd`` writes a Prometheus
``file_sd_configs`` file (``<run dir>/metrics/targets.json``) that `ropewalk up` prints. The HTTP API serves the same
registry on its own port at ``/metrics``. An ephemeral port never collides with another region on the machine
(tests run several).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)
METRICS_DIR = "metrics"
TARGETS_FILE = "targets.json"
METRICS_ADDR_ENV = "ROPEWALK_METRICS_ADDR"  # HOST:PORT a worker serves its metrics on (default 127.0.0.1:0)
# Latencies of a control plane: from a few ms (one decision) to minutes (a big job through a busy region).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# -- the metrics (one place; a process exports those it touches) ------------------------------------------------
SCHEDULING_ATTEMPT = Histogram("ropewalk_scheduling_attempt_duration_seconds",
                               "Time the scheduler spent deciding on one event, by result (events: it emitted "
                               "events; noop: nothing to do; refused: an intent refused)", ["result"],
                               buckets=LATENCY_BUCKETS)
SUBMIT_TO_RUNNING = Histogram("ropewalk_submit_to_running_seconds",
                              "From a job's submission (its JobSubmitted event time) to all its tasks RUNNING, as "
                              "the scheduler reads it", buckets=LATENCY_BUCKETS)
PENDING_TASKS = Gauge("ropewalk_pending_tasks", "Tasks not running, by the reason they wait (the allocator's or "
                                                "the scheduler's reason constant; none: not yet decided)", ["reason"])
TASK_MOVES = Counter("ropewalk_task_moves_total", "Tasks the scheduler moved to another machine, by reason",
                     ["reason"])
ALLOCATION_ATTEMPTS = Counter("ropewalk_allocation_attempts_total",
                              "Tasks the allocator tried to place, by result (placed, unplaceable, conflict)",
                              ["result"])
INDEX_STALENESS = Gauge("ropewalk_index_staleness_seconds",
                        "How far the allocator's Redis index is behind the log: now minus the time of the newest "
                        "event it applied, 0 when it has read everything")
MACHINES = Gauge("ropewalk_machines", "Machines by status and owning entitlement (free: the free pool)",
                 ["status", "entitlement"])
TASKCONTROL_ACK = Histogram("ropewalk_taskcontrol_ack_duration_seconds",
                            "From a TaskControl request to its controller's ack", buckets=LATENCY_BUCKETS)
TASKCONTROL_PENDING = Gauge("ropewalk_taskcontrol_pending_operations",
                            "Operations waiting for their controller's ack")
CONSUMER_LAG = Gauge("ropewalk_consumer_lag_seconds",
                     "How far a consumer is behind its topic: now minus the log time of the oldest record its last "
                     "poll returned (0 after a poll that found nothing new)", ["group", "topic"])
READ_POSITION = Gauge("ropewalk_reader_position",
                      "The next offset a reader without a consumer group (a TaskController) has read and acted on, "
                      "its outputs flushed: where a group's committed offset would be, by reader, topic and "
                      "partition (a test's marker that a reader has read past an event)",
                      ["reader", "topic", "partition"])
TIMER_TICKS = Counter("ropewalk_timer_ticks_total",
                      "Rounds of a worker's timer completed, their output flushed, by worker kind (a test's marker "
                      "that time passed for the worker, however slow the machine)", ["worker"])
DEAD_LETTERS = Counter("ropewalk_dead_letters_total", "Records dead-lettered, by origin topic and reason",
                       ["topic", "reason"])
WORKER_RESTARTS = Counter("ropewalk_worker_restarts_total", "Restarts of a worker by the region's supervisor",
                          ["worker"])
HEALTH_ZONE_STATE = Gauge("ropewalk_health_zone_state",
                          "The health check's view of each zone (DC) for its protection against mass failure: 0 normal, "
                          "1 partial disruption, 2 full disruption (processors/health/zones.py)", ["dc"])
HEALTH_ZONE_SILENT = Gauge("ropewalk_health_zone_silent_machines",
                           "Machines of a zone the health check finds silent (or failed itself), at its last tick",
                           ["dc"])
HEALTH_ZONE_HELD = Gauge("ropewalk_health_zone_held_machines",
                         "Silent machines of a zone its failure rate kept from being failed at the last tick", ["dc"])
HEALTH_REGION_DISRUPTED = Gauge("ropewalk_health_region_disrupted",
                                "1 while every zone is in full disruption: the health check fails nobody")
HEALTH_CLOCK_RESTARTS = Counter("ropewalk_health_clock_restarts_total",
                                "Times the health check counted every silence anew, by reason (started, tick_gap, "
                                "reading_behind, region_disruption_ended)", ["reason"])
API_REQUESTS = Histogram("ropewalk_api_request_duration_seconds",
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


def serve(run_dir: Path | str, worker: str) -> int | None:
    """Serve this process's metrics on an ephemeral port of 127.0.0.1 and write the port to
    ``<run dir>/metrics/<worker>.port``; the port, or None when it could not (logged; the worker goes on)."""
    import os

    from prometheus_client import start_http_server

    host, _, port = (os.environ.get(METRICS_ADDR_ENV) or "127.0.0.1:0").rpartition(":")
    try:
        server, _thread = start_http_server(int(port or 0), addr=host or "127.0.0.1")
        port = server.server_address[1]
        d = Path(run_dir) / METRICS_DIR
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{worker}.port"
        tmp.write_text(f"{port}\n")
        tmp.replace(d / f"{worker}.port")
        return port
    except (OSError, ValueError) as exc:
        log.warning("%s: metrics not served (%s=%r): %s", worker, METRICS_ADDR_ENV, os.environ.get(METRICS_ADDR_ENV),
                    exc)
        return None


def serve_worker(run_dir: Path | str) -> int | None:
    """``serve`` under the name the supervisor gave this worker (``ROPEWALK_WORKER_NAME``); nothing without one (a
    processor started by hand or by a test)."""
    import os

    name = os.environ.get("ROPEWALK_WORKER_NAME")
    return serve(run_dir, name) if name else None


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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"targets": [addr], "labels": {"job": "ropewalk", "worker": w}}
                                for w, addr in sorted(found.items())], indent=2) + "\n")
    return path


def forget(run_dir: Path | str, worker: str) -> None:
    (Path(run_dir) / METRICS_DIR / f"{worker}.port").unlink(missing_ok=True)
