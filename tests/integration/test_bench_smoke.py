"""`ropewalk bench` at a smoke size: the harness runs end to end, prints one JSON document with every required
figure (a number, or null only with a note saying why), its conditions, ratios consistent with the rates they are
computed from, and leaves no process behind. Benchmarks are not tests: this proves the harness works, not how fast
anything is."""
import json
import math
import os
import sys
from pathlib import Path

import pytest

from processes import phase_drawn, run_stopped_on_timeout

from bench.harness import REQUIRED, format_table
from bench.workloads import HOPS
from infra.process import pid_alive

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ from this checkout (the project also installs it: pyproject's bench*)
    sys.path.append(str(ROOT))
MACHINES = 300


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """The bench run as a user at a terminal runs it: stderr a (pseudo-)terminal, where its progress is drawn;
    stdout a pipe, for the JSON document alone."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ROPEWALK_")}  # the bench picks its own ports, run dir and prefix
    out = run_stopped_on_timeout([sys.executable, "-m", "processors.frontend.cli", "bench", "--quick", "--machines",
                                  str(MACHINES), "--schedulers", "2", "--allocators", "2", "--json"], 200, terminal=True, cwd=tmp_path_factory.mktemp("cwd"),
                                 env={**env, "TERM": "xterm", "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def bench_doc(bench_run):
    return json.loads(bench_run.stdout)  # stdout is the document alone, progress or not


@pytest.mark.timeout(240)
def test_progress_is_drawn_on_the_terminal(bench_run):
    """Each phase is a line of rich's live display on stderr, ticked once over (issue 13)."""
    shown = bench_run.stderr
    assert "\x1b[" in shown  # drawn (escape sequences), not plain lines
    for phase in ("registering a simulated region", "1/5 allocation", "2/5 failover", "3/5 rebuild", "5/5 per-event"):
        assert phase_drawn(shown, phase), (phase, shown[-2000:])


@pytest.mark.timeout(240)
def test_every_required_figure_is_a_number_or_explained(bench_doc):
    doc = bench_doc
    assert set(REQUIRED) <= set(doc), sorted(set(REQUIRED) - set(doc))
    for key in REQUIRED:
        value = doc[key]
        assert _number(value) or (value is None and key in doc["notes"]), (key, value, doc["notes"])
    assert doc["machines"] == MACHINES
    assert doc["cores"] == len(os.sched_getaffinity(0))
    assert doc["raw_produce_per_s"] > 0 and doc["raw_consume_per_s"] > 0
    assert doc["alloc_jobs_per_s"] > 0 and doc["alloc_tasks_per_s"] > 0
    if doc["cache_hit_ratio"] is not None:
        assert 0 <= doc["cache_hit_ratio"] <= 1


@pytest.mark.timeout(240)
def test_conditions_and_consistency(bench_doc):
    doc = bench_doc
    c = doc["conditions"]
    for key in ("machines", "jobs", "tasks_per_job", "partitions", "worker_processes", "cores"):
        assert c[key] is not None, key
    assert c["machines"] == MACHINES and c["partitions"] == doc["partitions"]
    assert c["worker_processes"]["scheduler"] == 2 and c["worker_processes"]["allocator"] == 2
    assert doc["schedulers"] == doc["allocators"] == 2
    # the burst's CPU per job, per process: every shard and allocator its own figure, and their sum
    cpu = doc["cpu_ms_per_job"]
    assert {"scheduler-0", "scheduler-1", "allocator-0", "allocator-1"} <= set(cpu), cpu
    assert all(_number(v) and v >= 0 for v in cpu.values()) and cpu["allocator-0"] + cpu["allocator-1"] > 0
    assert doc["cpu_ms_per_job_total"] == pytest.approx(sum(cpu.values()), abs=0.01)
    assert 12 <= doc["tasks_per_job"] <= 64
    burst = doc["details"]["allocation"]["burst"]
    assert burst["jobs"] > 0
    # the burst's rates come from the same jobs and the same seconds
    assert doc["alloc_tasks_per_s"] == pytest.approx(burst["tasks"] / burst["seconds"], rel=0.02)
    assert doc["alloc_jobs_per_s"] == pytest.approx(burst["jobs"] / burst["seconds"], rel=0.02)
    for lo, hi in (("alloc_p50_ms", "alloc_p99_ms"), ("failover_p50_ms", "failover_p99_ms")):
        if doc[lo] is not None:
            assert 0 < doc[lo] <= doc[hi]
    fo = doc["details"]["failover"]
    assert fo["machines_failed"] == max(1, round(MACHINES * 0.01))
    assert fo["tasks_affected"] >= 1 and fo["tasks_moved"] <= fo["tasks_affected"]
    # each moved task's time, hop by hop, from the log: every moved task was asked for, placed, started, RUNNING
    assert sorted(fo["hops"]) == sorted(HOPS)  # (the JSON document's keys are sorted)
    for hop in fo["hops"].values():
        assert hop["n"] == fo["tasks_moved"], fo["hops"]
        if hop["n"]:
            assert 0 <= hop["p50_ms"] <= hop["p99_ms"], fo["hops"]
    rb = doc["details"]["rebuild"]  # from the log, then from a snapshot of that fold (nothing after it)
    assert rb["from_snapshot"]["snapshot"] and rb["from_snapshot"]["snapshot_records"] == rb["events"]
    assert rb["from_snapshot"]["events"] < rb["events"], rb
    starts = rb["allocator_start"]
    assert starts["from_log"]["snapshot"] is None and starts["from_snapshot"]["snapshot"], starts
    assert starts["from_log"]["machines"] == starts["from_snapshot"]["machines"] > 0, starts
    assert starts["from_snapshot"]["records"] < starts["from_log"]["records"], starts
    rp = doc["details"]["replay"]
    assert rp["job"]["matched"] >= 1 and rp["job"]["examined"] >= rp["job"]["matched"]
    assert doc["redis_bytes_per_machine"] > 0


@pytest.mark.timeout(240)
def test_every_rate_has_its_ratio_to_the_raw_rate(bench_doc):
    doc = bench_doc
    ratios = doc["ratios"]
    for rate in ("alloc_jobs_per_s", "alloc_tasks_per_s", "rebuild_events_per_s", "replay_events_per_s"):
        assert rate in ratios, rate
    for rate, entry in ratios.items():
        assert entry["base"] in ("raw_produce_per_s", "raw_consume_per_s")
        if doc[rate] is None:
            assert entry["ratio"] is None
            continue
        assert entry["ratio"] == pytest.approx(doc[rate] / doc[entry["base"]], rel=1e-3, abs=1e-6), rate


@pytest.mark.timeout(240)
def test_profile_memory_and_nothing_left_running(bench_doc):
    doc = bench_doc
    prof = doc["profile"]
    assert prof["top_cumulative"] and prof["top_self"]
    assert all(_number(row["cumulative_s"]) for row in prof["top_cumulative"])
    assert prof["pipeline_stages"]["burst"]["allocator_p50_ms"] is not None
    rss = doc["memory"]["peak_rss_kib"]
    for name in ("broker", "redis", "allocator-0", "allocator-1", "scheduler-0", "scheduler-1", "agents",
                 "resourcebroker", "health"):
        assert _number(rss.get(name)) and rss[name] > 0, (name, rss)
    assert set(doc["pids"]) >= {"broker", "redis", "allocator-0", "allocator-1", "scheduler-0", "scheduler-1", "agents"}
    assert not [name for name, pid in doc["pids"].items() if pid_alive(pid)]


def test_table_shows_every_required_figure(bench_doc):
    table = format_table(bench_doc)
    missing = [k for k in REQUIRED if k not in ("machines", "cores") and k not in table]
    assert not missing
    assert f"{MACHINES:,} machines" in table
    assert all(hop in table for hop in HOPS)


@pytest.mark.timeout(240)
def test_what_a_job_costs_per_hop(bench_doc):
    """Records written per job by producer and type, and the broker's requests (its JMX counts) per job, over the
    burst (to allocated and to RUNNING) and the failover: counted, not invented (issue 28)."""
    doc = bench_doc
    cost = doc["details"]["allocation"]["burst"]["cost"]
    records = cost["to_running"]["records_per_job"]
    assert records["complete"]
    by_type = records["by_type"]
    # every burst job was submitted once, asked for once and answered: one of each per job, at least
    assert by_type["bench: JobSubmitted"] == pytest.approx(1.0, abs=0.01)
    assert by_type["scheduler: AllocationRequested"] >= 1.0 and by_type["allocator: TasksAllocated"] >= 1.0
    assert by_type.get("scheduler: TasksCommanded", 0) >= 1.0  # the starts
    assert doc["records_per_job"] == records["total"] > 0
    for phase in ("to_allocated", "to_running"):
        b = cost[phase]["broker_per_job"]
        assert b["requests"]["Produce"] > 0 and b["requests"]["Fetch"] > 0, b
        assert b["requests_total"] == pytest.approx(sum(b["requests"].values()), abs=0.01)
    assert doc["broker_requests_per_job"] <= doc["broker_requests_per_job_to_running"]
    assert doc["cpu_ms_per_job_to_running_total"] >= doc["cpu_ms_per_job_total"] - 0.01
    assert _number(cost["background"]["cpu_ms_per_s"]["broker"])
    fo = doc["details"]["failover"]["cost"]
    assert fo["records"]["by_type"]["scheduler: AllocationRequested"] >= 1  # the moves were asked for
    assert doc["failover_broker_requests"] > 0
