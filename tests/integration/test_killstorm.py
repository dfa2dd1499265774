"""The kill storm (issue #11) at CI size, through the command a user runs: `ropewalk experiment killstorm` starts a
region of its own, kills one control-plane process (allocator, scheduler shard, health check, Resource Broker,
simulated agents, process agent, redis-server) with SIGKILL every two seconds under a stream of submissions,
resizes, stops and machine failures, the supervisor starting each again; then every job converges and the replayed
log and Redis show nothing lost, doubled, over-committed or over quota, and Redis equals a rebuild from the log.
The full storm (100 kills) is `ropewalk experiment killstorm`; its figures are in RELIABILITY.md."""
import json
import os
import sys

import pytest

from processes import run_stopped_on_timeout

from bench.killstorm import COUNTS, VICTIMS

KILLS = len(VICTIMS)


@pytest.mark.timeout(400)
def test_a_small_kill_storm_loses_and_doubles_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPEWALK_")}  # its own ports, run dir, prefix
    out = run_stopped_on_timeout([sys.executable, "-m", "processors.frontend.cli", "experiment", "killstorm",
                                  "--kills", str(KILLS), "--interval-s", "2", "--machines", "16", "--json"], 370,
                                 cwd=tmp_path, env=env)
    doc = json.loads(out.stdout)
    failed = {k: doc[k] for k in (*COUNTS, "redis_matches_log", "converged", "not_converged", "running_twice",
                                  "overcommitted", "restarts_by_program", "kills_by_victim")}
    assert out.returncode == 0 and doc["passed"], failed
    assert sum(doc["kills_by_victim"].values()) == KILLS
    assert sum(doc["restarts_by_program"].values()) >= KILLS  # each killed process was started again, and recorded
    assert doc["converged"] and not doc["not_converged"]
    assert all(doc[k] == 0 for k in COUNTS) and doc["redis_matches_log"]
    assert doc["workload"]["jobs_submitted"] > 0 and doc["workload"]["resizes"] > 0 and doc["tasks_placed"] > 0
    assert not list(tmp_path.iterdir())  # nothing written where it ran (its run directory is its own, removed)
