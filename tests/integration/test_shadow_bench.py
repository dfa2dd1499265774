"""Shadow replay on a recorded bench workload (issue #14): bench/shadow_bench.py records ``bench --quick``'s
workload on a real region (jobs one at a time, a burst across partitions, repeats, 1% of the machines failing)
and replays it in memory. With the live policy the diff must be empty (the determinism test); another policy's
must not be."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from processes import run_stopped_on_timeout

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_live_policy_reproduces_a_recorded_bench_workload_and_another_does_not(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPEWALK_")}  # its own ports and run dir
    out = run_stopped_on_timeout([sys.executable, str(ROOT / "bench" / "shadow_bench.py"), "--machines", "300",
                                  "--burst", "20", "--json"], 260, cwd=tmp_path, env=env)
    try:  # a live shadow that differs exits 1 after printing its document: say what differed (the tail did not)
        doc = json.loads(out.stdout)
    except ValueError:
        raise AssertionError(f"exit {out.returncode}: " + out.stdout[-3000:] + out.stderr[-3000:]) from None
    assert doc["recorded"]["jobs"] >= 30 and doc["recorded"]["tasks_moved"] > 0  # a burst and a failover were recorded
    live, other = doc["live"], doc["policy"]
    assert live["decisions_compared"] >= 30 and live["scheduler_events_compared"] > 0
    assert (live["decisions_differ"], live["scheduler_events_differ"], live["empty"]) == (0, 0, True), \
        json.dumps({k: v for k, v in live.items() if k != "totals"}, indent=1)[:6000]
    assert out.returncode == 0, out.stderr[-3000:]
    assert other["decisions_differ"] > 0 and not other["empty"]
