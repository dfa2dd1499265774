"""Issue 30, the operator's view, on one real region started by `ropewalk up` (12 simulated machines and the demo
job on the process agent) that every test of this module shares: the metrics scraped from every target, Kafka's own
tools, the CLI as a subprocess (through the API, as a user drives it), and the examples/ a user of the state streams
copies first, each run against the region."""
from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from processes import scrape, value
from regioncli import ROOT, RegionCli, wait_for

WORKERS = ("resourcebroker", "allocator-0", "scheduler-0", "agents", "agent-local", "health", "api", "rebalancer",
           "sidekick", "jobcontrol", "srm", "loans")
SPEC = ("name: {name}\nentitlement: {ent}\ntasks: {tasks}\ncommand: [sleep, '3600']\n"
        "resources: {{cpu_millicores: {cpu}, memory_mib: 256}}\nspread: msb\n")


class Region:
    def __init__(self, run: Path):
        self.cli = RegionCli(run)
        self.run = run

    def spec(self, path: Path, name: str, ent: str = "e1", tasks: int = 3, cpu: int = 1000) -> str:
        path.write_text(SPEC.format(name=name, ent=ent, tasks=tasks, cpu=cpu))
        return str(path)

    def targets(self) -> dict[str, str]:
        return {g["labels"]["worker"]: g["targets"][0]
                for g in json.loads((self.run / "metrics" / "targets.json").read_text())}

    def user(self, name: str, *roles: str) -> dict:
        made = self.cli.json("user", "add", name, *[a for r in roles for a in ("--role", r)])
        return {**self.cli.env, "ROPEWALK_TOKEN": made["token"]}


@pytest.fixture(scope="module")
def region(tmp_path_factory):
    r = Region(tmp_path_factory.mktemp("operator") / "run")
    up = r.cli("up", "--machines", "12")
    try:
        assert up.returncode == 0, up.stderr
        r.cli.ok("entitlement", "create", "e1", "--quota", "4")
        r.cli.ok("job", "submit", r.spec(r.run.parent / "web.yaml", "web"))
        r.cli.wait_for(lambda: r.cli.running("e1.web", 3), "e1.web running")
        yield r
    finally:
        down = r.cli("down")
    assert down.returncode == 0, down.stderr


# -- metrics that tell the truth ---------------------------------------------------------------------------------

def test_every_target_exports_what_its_process_does_and_nothing_else(region):
    """All 13 targets scraped: an unlabelled gauge or histogram only where its process owns it (before, every
    target reported index_staleness 0 and empty histograms), no _created series, a build-info series everywhere,
    a zero restarts series per program, the allocator's time per decision, and no lag from the API's one-shot
    reads (they kept 134-442 s on an idle region)."""
    region.cli.ok("job", "status", "e1.web")  # the API reads state.jobs once: it must not leave a lag series
    targets = region.targets()
    assert set(targets) == {*WORKERS, "supervisor"}, targets
    got = {w: scrape(a) for w, a in targets.items()}
    owners = {"ropewalk_index_staleness_seconds": {"allocator-0"},
              "ropewalk_allocator_tail_records": {"allocator-0"},
              "ropewalk_allocation_decision_duration_seconds": {"allocator-0"},
              "ropewalk_machines": {"allocator-0"},
              "ropewalk_scheduling_attempt_duration_seconds": {"scheduler-0"},
              "ropewalk_submit_to_running_seconds": {"scheduler-0"},
              "ropewalk_taskcontrol_pending_operations": {"scheduler-0"},
              "ropewalk_taskcontrol_ack_duration_seconds": {"scheduler-0"},
              "ropewalk_api_request_duration_seconds": {"api"},
              "ropewalk_worker_restarts": {"supervisor"}}  # a counter's family name has no _total
    for name, where in owners.items():
        assert {w for w, fams in got.items() if name in fams} == where, name
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout[:12]
    for worker, fams in got.items():
        samples = [s for f in fams.values() for s in f]
        assert not [s.name for s in samples if s.name.endswith("_created")], worker
        (info,) = fams["ropewalk_build_info"]
        assert info.value == 1 and info.labels["worker"] == worker and info.labels["version"] != "unknown"
        assert info.labels["revision"] == revision, (worker, info.labels)
    restarts = {s.labels["worker"]: s.value for s in got["supervisor"]["ropewalk_worker_restarts"]
                if s.name == "ropewalk_worker_restarts_total"}
    assert set(restarts) == {*WORKERS, "redis", "broker"} and all(v == 0 for v in restarts.values()), restarts
    assert value(got["allocator-0"], "ropewalk_allocation_decision_duration_seconds_count", result="placed") >= 1
    assert "ropewalk_consumer_lag_seconds" not in got["api"]
    lagging = {"allocator-0", "resourcebroker", "health", "agents", "agent-local"}
    assert lagging <= {w for w, fams in got.items() if "ropewalk_consumer_lag_seconds" in fams}

    def idle() -> dict:  # an idle region's readers are not behind: every lag series falls to 0 (no false alert)
        lags = {(w, tuple(sorted(s.labels.items()))): s.value for w, a in targets.items()
                for s in scrape(a).get("ropewalk_consumer_lag_seconds", [])}
        return {k: v for k, v in lags.items() if v > 60}
    wait_for(lambda: not idle(), "every consumer's lag under 60 s", 60, 1.0, lambda: f": {idle()}")


# -- Kafka's own tools -----------------------------------------------------------------------------------------

def kafka_tool(region, tool: str, *args: str) -> subprocess.CompletedProcess:
    broker = f"127.0.0.1:{region.cli.env['ROPEWALK_BROKER_PORT']}"
    return subprocess.run([str(ROOT / "infra" / "kafka" / "bin" / tool), "--bootstrap-server", broker, *args],
                          capture_output=True, text=True, timeout=120)


def test_kafka_consumer_groups_sees_every_worker_that_reads_the_log(region):
    """`kafka-consumer-groups --describe --all-groups` (Kafka's own tool, copied by the set-up): the scheduler's and
    the allocator's groups, and a position group for every worker that assigns its partitions itself, whose
    offsets catch up with the log (only two of twelve workers showed before)."""
    props = str(region.run / "secrets" / "kafka-tools.properties")
    wanted = {"scheduler", "allocator", *(f"ropewalk-position-{n}" for n in (
        "allocator", "resourcebroker", "health", "agent-simulated", "agent-local-msb1-r01-m001", "rebalancer",
        "sidekick", "jobcontrol", "srm", "resourcebroker-loans"))}

    def groups() -> dict[str, dict]:
        out = kafka_tool(region, "kafka-consumer-groups", "--command-config", props, "--describe", "--all-groups")
        assert out.returncode == 0, out.stderr
        rows: dict[str, dict] = {}
        for m in re.finditer(r"^(\S+) +(\S+) +(\d+) +(\d+|-) +(\d+) +(\d+|-) ", out.stdout, re.M):
            rows.setdefault(m.group(1), {})[(m.group(2), int(m.group(3)))] = m.group(6)
        return rows

    got = wait_for(lambda: (g := groups()) and (g if wanted <= set(g) else None), "every worker's group", 60, 2.0,
                   lambda: f": {sorted(groups())}")
    # the allocator's fold of `intents` has read everything: its lag there is 0 on every partition
    wait_for(lambda: set(groups()["ropewalk-position-allocator"].get(("intents", p), "x") for p in range(4)) == {"0"},
             "the allocator's position on intents at the end", 30, 1.0)
    assert all(lag == "-" or int(lag) >= 0 for g in got.values() for lag in g.values())
    listed = kafka_tool(region, "kafka-get-offsets", "--command-config", props, "--topic", "state.jobs")
    assert listed.returncode == 0 and re.search(r"^state\.jobs:\d+:\d+$", listed.stdout, re.M), listed.stderr


# -- the CLI, as a user drives it ---------------------------------------------------------------------------------

def test_job_status_wide_and_describe_tell_a_moved_tasks_story(region, tmp_path):
    cli = region.cli
    bad = cli("job", "status", "e1.web", "-o", "yaml")
    assert bad.returncode == 2 and bad.stderr.startswith("usage: ropewalk job status "), bad.stderr
    first = cli.status("e1.web")["tasks"][0]
    cli.ok("machine", "fail", first["machine"])
    cli.wait_for(lambda: (v := cli.running("e1.web", 3)) and v["tasks"][0]["machine"] != first["machine"],
                 "e1.web/0 running elsewhere")
    wide = cli.ok("job", "status", "e1.web", "-o", "wide").splitlines()
    assert wide[1].split() == ["TASK", "STATE", "VERSION", "MACHINE", "DC/MSB/RACK", "AGE", "RESTARTS", "MOVES",
                               "PREVIOUS-MACHINE", "REASON"]
    row = next(r.split() for r in wide if r.startswith("e1.web/0 "))
    assert row[1:3] == ["RUNNING", "v1"] and row[6:9] == ["1", "1", first["machine"]], row
    assert re.fullmatch(r"\d+s", row[5]), row  # its age in that state
    # a refusal: the same job id with another spec
    refused = cli("job", "submit", region.spec(tmp_path / "other.yaml", "web", tasks=5))
    assert refused.returncode == 1 and "duplicate_job_id" in refused.stderr
    doc = cli.json("job", "describe", "e1.web")
    assert [r["reason"] for r in doc["refusals"]][-1:] == ["duplicate_job_id"]
    assert doc["job"]["tasks"][0]["previous_machine"] == first["machine"]
    assert any(e["type"] == "JobSubmitted" and e["principal"] == "admin" for e in doc["events"])
    text = cli.ok("job", "describe", "e1.web", "--events", "5")
    assert text.startswith("Job:          e1.web\n") and "duplicate_job_id" in text.split("Last refusals:")[1]
    assert re.search(r"^Events \(the last 5 of \d+; ", text, re.M)
    # an identical resubmission: not an error
    same = cli("job", "submit", str(region.run.parent / "web.yaml"))
    assert same.returncode == 0 and same.stdout == "e1.web\n" and same.stderr.startswith("unchanged: "), same.stderr
    assert "ropewalk:" not in same.stderr
    cli.ok("machine", "recover", first["machine"])


def test_tables_times_help_and_the_time_grammar(region):
    cli = region.cli
    status = cli.ok("status").splitlines()
    assert status[0].split()[:5] == ["SERVICE", "STATE", "ENDPOINT", "PID", "RESTARTS"]
    assert ["WORKER", "STATE", "PID", "RESTARTS", "LAST-EXIT", "LOG"] in [line.split() for line in status]
    users = cli.ok("user", "list").splitlines()
    assert users[0].split() == ["USER", "REGION-ADMIN", "ROLES"] and users[1].split()[:2] == ["admin", "yes"]
    watched = cli.ok("watch", "jobs", "--once")
    line = next(x for x in watched.splitlines() if " e1.web " in x)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ  e1\.web +running +tasks: 3 running of 3 desired( |$)", line), line
    for args in (["--help"], ["job", "logs", "--help"], ["machine", "--help"], ["replay", "--help"]):
        assert "examples:" in cli.ok(*args) or "examples (" in cli.ok(*args), args
    since = cli("replay", "--job", "e1.web", "--since", "now-1h", "--type", "JobSubmitted")
    assert since.returncode == 0 and "JobSubmitted" in since.stdout, since.stderr
    bad = cli("replay", "--since", "now-soon")
    assert bad.returncode == 1 and "now-10m" in bad.stderr
    machine = cli.status("e1.web")["tasks"][1]["machine"]
    dry = cli("machine", "fail", machine, "--dry-run")
    assert dry.returncode == 0 and not re.search(r"\b\d{13}\b", dry.stdout), dry.stdout  # no raw epoch ms
    assert re.search(r"simulated from the log at \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ to ", dry.stdout), dry.stdout


def test_owners_and_refusals_name_the_user(region):
    cli = region.cli
    carol = region.user("carol", "e1=operator")
    pushed = cli.run_with(carol, "intents", "push", "e1.web", "--percent", "50", "--command", "sleep 3601")
    assert pushed.returncode == 0, pushed.stderr
    cli.wait_for(lambda: ((json.loads(cli.run_with(carol, "intents", "show", "e1.web", "--json").stdout or "{}")
                           .get("intents") or {}).get("push") or {}).get("owner") == "carol",
                 "carol's push in force, owned by her (not by the Unix user)")
    fail = cli.run_with(carol, "machine", "fail", "dc1-msb1-r01-m001")
    assert fail.returncode == 1 and fail.stderr == ("ropewalk: failing a machine (machine fail) is for region "
                                                    "administrators; carol is not one\n"), fail.stderr
    viewer = region.user("vic", "e1=viewer")
    stop = cli.run_with(viewer, "job", "stop", "e1.web")
    assert stop.returncode == 1 and "stopping a job in entitlement 'e1' needs the operator role; vic is viewer" in \
        stop.stderr and "job.stop" not in stop.stderr, stop.stderr


def test_job_logs_reads_a_tasks_output_and_says_why_another_has_none(region):
    cli = region.cli
    lines = cli.ok("job", "logs", "demo.hello", "--tail", "3").splitlines()
    assert 1 <= len(lines) <= 3 and all(x.startswith("hello from Ropewalk at ") for x in lines), lines
    none = cli("job", "logs", "e1.web")
    assert none.returncode == 1 and "a simulated machine" in none.stderr and "2 more tasks" in none.stderr
    missing = cli("job", "logs", "demo.hello", "7")
    assert missing.returncode == 1 and "has no task 'demo.hello/7'" in missing.stderr
    follow = subprocess.Popen([sys.executable, "-m", "processors.frontend.cli", "job", "logs", "demo.hello", "0", "-f",
                               "--tail", "0"], env=region.cli.env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        new = follow.stdout.readline()  # the demo writes a line every 5 s: -f prints it as it is written
        assert new.startswith("hello from Ropewalk at "), (new, follow.stderr.read() if follow.poll() else "")
    finally:
        os.killpg(follow.pid, signal.SIGINT)
        follow.wait(30)


def test_a_task_waiting_for_its_host_profile_says_so(region, tmp_path):
    cli = region.cli
    cli.ok("entitlement", "create", "e3", "--quota", "1", "--host-profile", "hugepages")  # a 244 s switch
    cli.ok("job", "submit", region.spec(tmp_path / "hp.yaml", "slow", ent="e3", tasks=1), "--no-wait")
    view = cli.wait_for(lambda: (v := cli.status("e3.slow")) and v["tasks"] and v["tasks"][0]["reason"]
                        == "waiting_for_host_profile" and v, "e3.slow's task waiting for hugepages")
    assert view["tasks"][0]["state"] == "STARTING"


def test_a_stopped_job_is_shown_by_its_last_state_not_unknown(region, tmp_path):
    cli = region.cli
    cli.ok("job", "submit", region.spec(tmp_path / "brief.yaml", "brief", tasks=1))
    cli.ok("job", "stop", "e1.brief")
    gone = cli.wait_for(lambda: (v := cli.status("e1.brief")) and v["deleted"] and v, "e1.brief gone")
    assert gone["state"] == "stopped"
    text = cli("job", "status", "e1.brief")
    assert text.returncode == 0 and text.stdout.startswith("job e1.brief was stopped and is gone since ")
    resize = cli("job", "resize", "e1.brief", "2")
    assert resize.returncode == 1 and "was stopped and is gone since" in resize.stderr
    assert cli("job", "describe", "e1.brief").returncode == 0
    assert cli("job", "status", "e1.never").returncode == 1


# -- what a user of the state streams copies first -----------------------------------------------------------------

def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
            for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in (n.names if isinstance(n, ast.Import) else [n])}


def test_the_examples_read_the_state_and_submit_a_job_without_ropewalk(region):
    stdlib = set(sys.stdlib_module_names)
    assert imports_of(ROOT / "examples" / "state_jobs.py") - stdlib == {"confluent_kafka", "fastavro"}
    assert imports_of(ROOT / "examples" / "submit_job.py") <= stdlib
    env = {**region.cli.env, "PYTHONPATH": ""}
    cwd = region.run.parent  # where the examples find .run/secrets as in a checkout
    (cwd / ".run").symlink_to(region.run) if not (cwd / ".run").exists() else None
    api = f"http://127.0.0.1:{env['ROPEWALK_API_PORT']}"
    submitted = subprocess.run([sys.executable, "-I", str(ROOT / "examples" / "submit_job.py"), "--api", api,
                                "--entitlement", "e1", "--name", "hello", "--tasks", "2"],
                               cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.splitlines()[0] == "e1.hello: accepted"
    assert len(re.findall(r"^e1\.hello/\d RUNNING on \S+ \(\w+/\w+/\w+\)$", submitted.stdout, re.M)) == 2
    refused = subprocess.run([sys.executable, "-I", str(ROOT / "examples" / "submit_job.py"), "--api", api,
                              "--entitlement", "nosuch", "--name", "x"], cwd=cwd, env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 1 and refused.stderr.startswith("refused (409): unknown_entitlement: ")
    read = subprocess.run([sys.executable, "-I", str(ROOT / "examples" / "state_jobs.py"), "--bootstrap",
                           f"127.0.0.1:{env['ROPEWALK_BROKER_PORT']}", "--json"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr
    jobs = {d["job_id"]: d for d in map(json.loads, read.stdout.splitlines())}
    listed = {v["job"]: v for v in region.cli.json("job", "list")}
    assert set(listed) <= set(jobs) and jobs["e1.hello"]["desired_tasks"] == 2
    assert all(jobs[j]["state"] == v["state"] and len(jobs[j]["tasks"]) == len(v["tasks"]) for j, v in listed.items())
