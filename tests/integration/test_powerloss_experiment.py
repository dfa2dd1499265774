"""The power-loss experiment at CI size, through the command a user runs: `ropewalk experiment powerloss` starts a
region of its own (200 machines in two DCs), runs one task per machine of dc1 in jobs pinned there, cuts dc1's power
(UnavailabilityStarted POWER) and restores it: every task stops, then runs again on dc1, the restarts paced by the
scheduler's shard limiter (here 50 at once, then 50 a timer tick), and the health check judges none of the dark
machines. The figures at 10,000 and 100,000 machines are in RELIABILITY.md."""
import json
import os
import sys

import pytest

from processes import run_stopped_on_timeout

BURST = 50


@pytest.mark.timeout(400)
def test_a_small_power_loss_stops_every_task_then_restarts_every_one_paced(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPEWALK_")}  # its own ports, run dir, prefix
    out = run_stopped_on_timeout([sys.executable, "-m", "processors.frontend.cli", "experiment", "powerloss",
                                  "--machines", "200", "--dark-s", "3", "--tasks-per-job", "25",
                                  "--shard-per-minute", "3000", "--shard-burst", str(BURST), "--json"], 370,
                                 cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["passed"] and doc["tasks"] == 100 and doc["jobs"] == 4
    assert doc["all_stopped"] and doc["loss_to_all_stopped_ms"] is not None
    assert doc["all_running"] and doc["restarted"] == 100 and doc["running_outside_dc"] == 0
    assert doc["dark_machines_judged"] == 0 and doc["zone_disruptions"] == 0
    # paced: never more than the bucket's burst in one second, and over at least two timer ticks
    assert 0 < doc["peak_restarts_per_s"] <= BURST, doc["restarts_by_10s"]
    assert len([n for n in doc["restarts_by_10s"] if n]) >= 2, doc["restarts_by_10s"]
    assert doc["back_to_all_running_ms"] >= 1000 * doc["pacing_floor_s"]
    assert doc["raw_produce_per_s"] > 0 and doc["conditions"]["shard_limit"] == f"3000/min, burst {BURST}"
    assert not list(tmp_path.iterdir())  # nothing written where it ran
