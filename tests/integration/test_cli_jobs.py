"""Job commands through the real CLI on the real broker. The scheduler's output on `state.jobs` is played
by hand here (its own tests cover producing it), so this checks the front end's side of the contract."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path


from streams.clients import EventConsumer, EventProducer
from streams.events import new_event
from streams.topics import Topics

ROOT = Path(__file__).resolve().parents[2]


def cli(cfg, *args, stdin=None):
    env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
           "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions)}
    return subprocess.run([sys.executable, "-m", "processors.frontend.cli", *args], env=env, cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=120)


def intents(cfg, registry, n):
    c = EventConsumer(cfg, registry, [Topics(cfg.topic_prefix).name("intents")], name="test")
    out, deadline = [], time.monotonic() + 20
    while len(out) < n and time.monotonic() < deadline:
        out += c.poll(100, 0.3)
    c.close()
    return [r.event for r in out]


def job_state(job, ent, state, tasks, version=1, deleted=False):
    return new_event("JobStatePublished", {
        "job_id": job, "name": job.split(".", 1)[1], "state": state, "spec_version": version,
        "desired_tasks": len(tasks), "last_reason": "", "deleted": deleted,
        "tasks": [{"task_id": f"{job}/{i}", "state": s, "machine_id": m, "dc": "dc1" if m else None,
                   "msb": "msb1" if m else None, "rack": "r1" if m else None, "spec_version": version, "reason": ""}
                  for i, (s, m) in enumerate(tasks)]}, entitlement=ent, entity_id=job, producer="scheduler")


def test_job_lifecycle_commands(cfg, registry, tmp_path):
    assert cli(cfg, "entitlement", "create", "e1", "--quota", "4").returncode == 0
    spec = tmp_path / "web.yaml"
    spec.write_text("name: web\nentitlement: e1\ntasks: 2\ncommand: [sleep, '60']\n"
                    "resources: {cpu_millicores: 500, memory_mib: 256}\n")
    sub = cli(cfg, "job", "submit", str(spec))
    assert sub.returncode == 0 and sub.stdout.strip() == "e1.web", sub.stderr

    # Unknown until the scheduler publishes its state.
    st = cli(cfg, "job", "status", "e1.web")
    assert st.returncode == 1 and st.stderr.startswith("ropewalk: unknown job 'e1.web'")
    assert cli(cfg, "job", "resize", "e1.web", "3").returncode == 1

    p = EventProducer(cfg, registry, "test")
    p.send(job_state("e1.web", "e1", "pending", [("PENDING", None), ("PENDING", None)]))
    p.send(job_state("e1.web", "e1", "running", [("RUNNING", "m1"), ("RUNNING", "m2")]))
    p.send(job_state("e1.other", "e1", "running", [("RUNNING", "m1")]))
    p.send(job_state("e1.gone", "e1", "stopped", [], deleted=True))
    p.flush()

    st = cli(cfg, "job", "status", "e1.web", "--json")
    assert st.returncode == 0, st.stderr
    view = json.loads(st.stdout)
    assert view["job"] == "e1.web" and view["entitlement"] == "e1" and view["state"] == "running"
    assert [(t["id"], t["state"], t["machine"], t["dc"], t["msb"], t["rack"]) for t in view["tasks"]] == [
        ("e1.web/0", "RUNNING", "m1", "dc1", "msb1", "r1"), ("e1.web/1", "RUNNING", "m2", "dc1", "msb1", "r1")]

    watch = cli(cfg, "watch", "jobs", "--once", "--json")
    assert watch.returncode == 0
    assert sorted(json.loads(line)["job"] for line in watch.stdout.splitlines()) == ["e1.other", "e1.web"]

    assert cli(cfg, "job", "resize", "e1.web", "3").returncode == 0
    spec.write_text(spec.read_text().replace("'60'", "'120'"))
    up = cli(cfg, "job", "update", "e1.web", str(spec), "--json")
    assert up.returncode == 0 and json.loads(up.stdout)["spec_version"] == 2
    assert cli(cfg, "job", "stop", "e1.web", "--reason", "done").returncode == 0

    events = intents(cfg, registry, 5)
    assert [e.type for e in events] == ["EntitlementCreated", "JobSubmitted", "JobResized", "JobSpecChanged",
                                        "JobStopped"]
    assert all(e.entitlement == "e1" for e in events)
    submitted = events[1].payload
    assert submitted["job_id"] == "e1.web" and submitted["command"] == ["sleep", "60"] and submitted["spec_version"] == 1
    assert events[3].payload["command"] == ["sleep", "120"] and events[3].payload["spec_version"] == 2
    assert events[2].payload["tasks"] == 3 and events[4].payload["reason"] == "done"


def test_watch_follows_changes(cfg, registry):
    p = EventProducer(cfg, registry, "test")
    p.send(job_state("e2.api", "e2", "pending", [("PENDING", None)]))
    p.flush()
    env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix,
           "ROPEWALK_PARTITIONS": str(cfg.partitions), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "processors.frontend.cli", "watch", "jobs", "--json"], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        assert first["job"] == "e2.api" and first["state"] == "pending"
        p.send(job_state("e2.api", "e2", "running", [("RUNNING", "m9")]))
        p.flush()
        second = json.loads(proc.stdout.readline())
        assert second["state"] == "running" and second["tasks"][0]["machine"] == "m9"
        # The same state published again is no change: not shown; the next real change is the next line.
        p.send(job_state("e2.api", "e2", "running", [("RUNNING", "m9")]))
        p.send(job_state("e2.api", "e2", "stopping", [("RUNNING", "m9")]))
        p.flush()
        third = json.loads(proc.stdout.readline())
        assert third["state"] == "stopping"
    finally:
        proc.kill()
        proc.wait()
