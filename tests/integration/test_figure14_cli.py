"""`ropewalk experiment figure14 --json` as an outside tool runs it: the console script, one JSON document."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROPEWALK = Path(sys.executable).with_name("ropewalk")


def run_cli(*args, timeout=300):
    return subprocess.run([str(ROPEWALK), "experiment", "figure14", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def test_figure14_json_small(tmp_path):
    png = tmp_path / "fig14.png"
    r = run_cli("--json", "--tasks", "60", "--shards", "600", "--msbs", "6", "--msb-fail-at", "60", "--png", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000  # the plot was drawn
    doc = json.loads(r.stdout)
    assert "no broker" in doc["mode"]
    c, totals = doc["conditions"], doc["totals"]
    assert (c["tasks"], c["shards"], c["replicas"], c["msbs"], c["msb_fail_at_s"]) == (60, 600, 3, 6, 60)
    assert totals["shards_lost_second_replica_by_ropewalk"] == 0
    assert totals["shards_lost_second_replica_by_failure"] > 0
    assert totals["peak_concurrent_updates"] >= 2 and totals["update_duration_s"] > 0
    assert doc["failed_tasks"] == 10
    assert doc["curves"][0]["t_s"] == 0 and doc["curves"][-1]["tasks_updated"] == 60


def test_figure14_text_and_bad_argument():
    r = run_cli("--tasks", "30", "--shards", "200", "--msbs", "3")
    assert r.returncode == 0, r.stderr
    assert "shards_lost_second_replica_by_ropewalk: 0" in r.stdout and "in-process simulation" in r.stdout
    bad = run_cli("--tasks", "2", "--shards", "10")
    assert bad.returncode == 1 and bad.stderr.startswith("ropewalk: ") and len(bad.stderr.strip().splitlines()) == 1
