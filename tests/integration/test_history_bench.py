"""The time-travel benchmark (``bench/history_rate.py``) in small, on the real embedded broker: it generates a log,
folds it into snapshots and looks at moments; ``--keep DIR`` keeps that region and ``--again DIR`` measures the same
log again without generating it (its broker restarted on the kept data, same ports and topics), ``--refold`` folding
the snapshots again. The full size (1,000,000 events, ~40 minutes) is a command: BENCHMARKS.md "Time travel"."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--events", "8000", "--machines", "200", "--moments", "2", "--json"]


def run(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "history_rate.py"), *args], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_kept_log_is_measured_again_without_generating_it(tmp_path):
    kept = tmp_path / "region"
    first = run(*SMALL, "--keep", str(kept))
    assert first["log"]["records"] >= 8000 and first["raw_consume"]["records"] >= first["log"]["records"]
    assert first["snapshots"]["files"] >= 2 and len(first["moments"]) == 2
    assert all(r["machines"] == 200 for r in first["moments"])
    assert any(r["snapshot"] for r in first["moments"])  # one is just before a snapshot: it starts from the one before

    again = run("--moments", "2", "--json", "--again", str(kept))
    assert again["log"] == first["log"]  # not generated again: the kept log's own figures
    assert again["conditions"]["again"] == str(kept)
    assert again["raw_consume"]["records"] == first["raw_consume"]["records"]  # the same log, read again
    assert again["snapshots"]["seconds"] == first["snapshots"]["seconds"]  # the kept snapshots, not folded again
    assert [r["moment_ms"] for r in again["moments"]] == [r["moment_ms"] for r in first["moments"]]
    assert [(r["applied"], r["jobs"]) for r in again["moments"]] == [(r["applied"], r["jobs"]) for r in first["moments"]]

    refolded = run("--moments", "2", "--json", "--again", str(kept), "--refold")  # its cuts may differ (2 s rule)
    assert refolded["snapshots"]["files"] >= 1 and refolded["log"] == first["log"]
    assert all(r["machines"] == 200 for r in refolded["moments"])


def test_keep_refuses_a_directory_that_exists_again_one_keep_did_not_write_refold_a_new_log(tmp_path):
    for args, says in ((["--keep", str(tmp_path)], "exists"), (["--again", str(tmp_path)], "history-bench.json"),
                       (["--refold"], "--refold goes with --again")):
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "history_rate.py"), *SMALL, *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and says in done.stderr, done.stderr
