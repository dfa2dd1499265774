"""`ropewalk experiment figure14 --pipeline`: Figure 14 run by the real processes on an embedded broker and Redis
of the command's own (the console script, as an outside tool runs it), checked on its JSON document and, for the
failure's toll, against the shard map independently of the experiment's own counting."""
import json
import os
import sys
from pathlib import Path

import pytest

from bench.experiments import figure14 as sim
from processes import run_stopped_on_timeout

ROPEWALK = Path(sys.executable).with_name("ropewalk")
SMALL = dict(tasks=100, shards=1500, msbs=10)


def run_cli(*args, timeout=480):
    return run_stopped_on_timeout([str(ROPEWALK), "experiment", "figure14", "--pipeline", *args], timeout,
                                  env=os.environ.copy())


@pytest.mark.timeout(540)  # ~90 s alone; more beside another worker's region tests (CI once passed 300 s)
def test_figure14_on_the_pipeline(tmp_path):
    png, events = tmp_path / "fig14.png", tmp_path / "events.jsonl"
    # a time scale of 40: a 220 s start takes 5.5 s, the MSB fails 3 s into the update for 7.4 s (quick and tight:
    # the pipeline's own delays are a larger share of each step than at the default scale)
    r = run_cli("--json", "--tasks", "100", "--shards", "1500", "--msbs", "10", "--time-scale", "40",
                "--png", str(png), "--events-out", str(events))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["mode"].startswith("real pipeline")
    totals, details = doc["totals"], doc["pipeline"]
    assert details["timed_out"] is False and details["time_scale"] == 40
    assert totals["shards_lost_second_replica_by_ropewalk"] == 0, details["first_operations_that_lost_shards"]
    assert details["tasks_down_otherwise"] == 0
    assert totals["peak_concurrent_updates"] >= 2, "the controller lets several tasks update at once"
    assert doc["curves"][-1]["tasks_updated"] == 100 and doc["curves"][-1]["shards_2plus_down"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the failure's toll, recomputed here from the events file and the shard map: the shards that had at least
    # min_live live replicas just before the failure and fewer once the failed MSB's running tasks were gone
    c = sim.Conditions(**SMALL)
    hosted = sim.place_replicas(c.tasks, c.shards, c.replicas, c.seed, c.placement)
    running, machine_of, failed, before = set(), {}, set(), None
    for line in events.read_text().splitlines():
        e = json.loads(line)
        p = e["payload"]
        if e["type"] == "TaskStatesChanged":  # the agents' reports, batched
            for r in p["reports"]:
                if r["state"] == "RUNNING":
                    running.add(r["task_id"])
                    machine_of[r["task_id"]] = r["machine_id"]
        elif e["type"] == "TasksCommanded":  # the scheduler's commands, one event per job and decision
            running -= {c["task_id"] for c in p["commands"] if c["command"] == "STOP"}
        elif e["type"] == "UnavailabilityStarted" and p["kind"] == "FAILURE":
            before = set(running) if before is None else before
            gone = {t for t in running if machine_of[t] in p["machine_ids"]}
            failed |= gone
            running -= gone
    assert before is not None and details["failed_msb_tasks"] == len(failed) > 0
    live = {s: 0 for s in (f"s{i}" for i in range(c.shards))}
    lost = dict(live)
    for t in before:
        for s in hosted[t]:
            live[s] += 1
            lost[s] += t in failed
    hit = {s for s in live if live[s] >= c.min_live > live[s] - lost[s]}
    assert totals["shards_lost_second_replica_by_failure"] == len(hit) > 0


def test_figure14_pipeline_refuses_an_uneven_region():
    r = run_cli("--tasks", "101", "--msbs", "10")
    assert r.returncode == 1 and r.stderr.startswith("ropewalk: ") and "multiple of msbs" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
