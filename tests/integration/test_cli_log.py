"""The README's user path through the real CLI: produce, replay, archive, restore into another prefix."""
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def run(cfg, *args, stdin=None, prefix=None):
    env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
           "ROPEWALK_TOPIC_PREFIX": prefix if prefix is not None else cfg.topic_prefix,
           "ROPEWALK_PARTITIONS": str(cfg.partitions),
           "ROPEWALK_RUN_DIR": str(cfg.run_dir)}  # not the checkout's .run: `up` remembers its endpoints there
    return subprocess.run([sys.executable, "-m", "processors.frontend.cli", *args], env=env, cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_produce_replay_archive_restore(cfg, tmp_path):
    docs = "\n".join(json.dumps({"job_id": f"j{i}", "tasks": i + 1, "envelope": {"entitlement": f"e{i % 2}"}})
                     for i in range(6))
    out = run(cfg, "produce", "intents", "JobResized", "-", "--json", stdin=docs)
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout)["event_ids"]
    assert len(ids) == 6

    bad = run(cfg, "produce", "intents", "JobResized", "-", stdin='{"job_id": "j", "tasks": -1.5}', )
    assert bad.returncode == 1 and "tasks: expected int" in bad.stderr and bad.stdout == ""

    rep = run(cfg, "replay", "--entitlement", "e1", "--json")
    assert rep.returncode == 0, rep.stderr
    lines = [json.loads(line) for line in rep.stdout.splitlines()]
    assert [e["payload"]["job_id"] for e in lines] == ["j1", "j3", "j5"]
    assert all({"topic", "partition", "offset", "event_id", "entitlement", "timestamp_ms"} <= e.keys() for e in lines)

    text = run(cfg, "replay", "--job", "j2")
    assert text.returncode == 0 and len(text.stdout.splitlines()) == 1 and "JobResized" in text.stdout

    arc = run(cfg, "archive", str(tmp_path / "a"), "--json")
    assert arc.returncode == 0, arc.stderr
    assert json.loads(arc.stdout)["records"] >= 7  # six events and their schema

    other = cfg.topic_prefix + "restored."
    assert run(cfg, "up", "--machines", "0", prefix=other).returncode == 0  # provisions the topics only
    res = run(cfg, "restore", str(tmp_path / "a"), prefix=other)
    assert res.returncode == 0, res.stderr
    again = run(cfg, "replay", "--json", prefix=other)
    original = run(cfg, "replay", "--json")
    strip = lambda out: [{k: v for k, v in json.loads(x).items() if k != "offset"} for x in out.splitlines()]
    assert strip(again.stdout) == strip(original.stdout) and len(strip(again.stdout)) == 6

    refused = run(cfg, "restore", str(tmp_path / "a"), prefix=other)
    assert refused.returncode == 1 and "already hold records" in refused.stderr
