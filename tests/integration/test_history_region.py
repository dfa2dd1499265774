"""What only a log can do (issue 14), on a real region driven through the CLI (``ropewalk up``: the broker, Redis,
the Resource Broker, the allocator, a scheduler shard, simulated agents, the health check):

* **time travel**: what ``machine list --json`` and ``job status --json`` printed at moments of the run is what
  ``--at`` (and ``ropewalk at``) prints for those moments afterwards, before and after ``history snapshot``;
* **shadow replay**: with the live policy the diff of the whole recorded run is empty (the determinism check);
  with another policy it is not;
* **what-if**: ``maintenance plan --dry-run`` names, task for task, what the real maintenance then does (moves and
  where to, the task held for a controller that never answers, the controller asked);
* **explain**: the decision that placed a moved task, its filters, its cause (the machine's failure);
* through the API (the CLI's default) and ``--direct`` alike, the API deciding who may look back (a viewer of one
  entitlement sees its past, not another's, not the whole region, no dry run);
* bad input gets one line.

Placement is kept away from races the log cannot order: the maintenance is on a dc1 MSB and only e1's jobs run in
dc1 (e3's are pinned to dc2), so the moves it causes are one partition's, decided in the scheduler's order.
"""
from __future__ import annotations

import json
import time

import pytest

from regioncli import RegionCli

SPEC = ("name: {name}\nentitlement: {ent}\ntasks: {tasks}\ncommand: [sleep, '3600']\n"
        "resources: {{cpu_millicores: {cpu}, memory_mib: 1024}}\nspread: msb\n{extra}")


def machines(cli, *extra) -> list[dict]:
    rows = cli.json("machine", "list", *extra)
    for r in rows:
        r.pop("updated_ms")  # when the allocator's outbox published the state: see processors/history/README.md
    return rows


def capture(cli, jobs) -> tuple[int, dict]:
    """What machine list and job status print now, on a quiet region (machine list the same after the moment)."""
    for _ in range(20):
        seen = {"machines": machines(cli), "jobs": {j: cli.status(j) for j in jobs}}
        moment = int(time.time() * 1000)
        time.sleep(0.3)
        if machines(cli) == seen["machines"]:
            return moment, seen
        time.sleep(1)
    raise AssertionError("the region did not settle")


def task(view, tid):
    return next(t for t in view["tasks"] if t["id"] == tid)


@pytest.mark.timeout(600)  # ~240 s on a quiet machine; 426 s once beside two kill storms (a hang guard, not a figure)
def test_time_travel_shadow_what_if_and_explain_on_a_recorded_region(tmp_path):  # noqa: C901
    cli = RegionCli(tmp_path / "run", ROPEWALK_HISTORY_LOOKAHEAD_MS="15000", ROPEWALK_SCHEDULER_RETRY_S="2")
    start = int(time.time() * 1000)
    up = cli("up", "--machines", "24", "--no-demo", "--json")
    try:
        assert up.returncode == 0, up.stderr
        cli.ok("entitlement", "create", "e1", "--quota", "6")
        cli.ok("entitlement", "create", "e3", "--quota", "4")
        for name, ent, tasks, cpu, extra in (("web", "e1", 4, 4000, ""), ("cache", "e1", 2, 6000, "controller: cachectl\n"),
                                             ("api", "e3", 3, 8000, "requirements: {dc: dc2}\n")):
            (tmp_path / f"{name}.yaml").write_text(SPEC.format(name=name, ent=ent, tasks=tasks, cpu=cpu, extra=extra))
            cli.ok("job", "submit", str(tmp_path / f"{name}.yaml"))
        jobs = {"e1.web": 4, "e1.cache": 2, "e3.api": 3}
        for job, n in jobs.items():
            cli.wait_for(lambda: cli.running(job, n), f"{job} running", 120)
        moments = [capture(cli, jobs)]

        web = cli.status("e1.web")
        failed = task(web, "e1.web/0")["machine"]
        cli.ok("machine", "fail", failed)
        cli.ok("job", "resize", "e3.api", "1")
        cli.wait_for(lambda: (v := cli.running("e1.web", 4)) and failed not in {t["machine"] for t in v["tasks"]},
                     "e1.web moved off the failed machine", 120)
        cli.wait_for(lambda: (v := cli.status("e3.api")) and len(v["tasks"]) == 1
                     and v["tasks"][0]["state"] == "RUNNING", "e3.api shrunk", 120)
        moments.append(capture(cli, jobs))

        # what-if, then the real maintenance: they agree task for task
        msb = next(t["msb"] for t in cli.status("e1.web")["tasks"] if t["dc"] == "dc1")
        args = ("maintenance", "plan", "--msb", f"dc1/{msb}", "--start", "+10m", "--duration", "30m", "--deadline", "+6s")
        dry = cli.json(*args, "--dry-run")
        assert dry is not None, cli(*args, "--dry-run").stderr
        assert dry["counts"]["move"] >= 1 and {c["job"] for c in dry["controllers"]} <= {"e1.cache"}
        assert all(t["job"] in ("e1.web", "e1.cache") for t in dry["tasks"])
        assert cli.json("machine", "list") is not None  # the dry run produced nothing: still no maintenance
        assert not any(m["maintenance"] for m in cli.json("machine", "list"))
        plan = cli.json(*args)
        assert set(plan["machines"]) == set(dry["machines"])
        expected = {t["task"]: t for t in dry["tasks"]}

        def as_predicted():
            views = {j: cli.status(j) for j in ("e1.web", "e1.cache")}
            for tid, t in expected.items():
                real = task(views[t["job"]], tid)
                if t["outcome"] == "move" and (real["machine"], real["state"]) != (t["to"], "RUNNING"):
                    return None
                if t["outcome"] == "stop" and (real["machine"], real["state"]) != (t["from"], "STOPPED"):
                    return None
            return views
        cli.wait_for(as_predicted, f"the maintenance doing what the dry run said: {expected}", 120)
        moments.append(capture(cli, jobs))  # settled after the maintenance's moves and stops
        # A snapshot of the whole log now: its cut is the log's end less the 15 s look-ahead, so at or before
        # moments[2] while the region stays quiet (the maintenance's window opens in 10 minutes). (Taken for
        # moments[1], the cut depended on how long the maintenance took: under load it fell after moments[1].)
        snap = cli.json("history", "snapshot")
        assert snap is not None and snap["snapshots"] >= 1, cli("history", "snapshot").stderr

        # time travel: --at prints what the commands printed then (through snapshots too)
        moment, seen = moments[0]
        assert machines(cli, "--at", str(moment)) == seen["machines"]  # through the API
        assert machines(cli, "--at", str(moment), "--direct") == seen["machines"]  # on the log as the operator
        for job, view in seen["jobs"].items():
            assert cli.json("job", "status", job, "--at", str(moment)) == view
        for moment, seen in moments[1:]:  # moments[2] from the snapshot just taken
            assert machines(cli, "--at", str(moment)) == seen["machines"]
            for job, view in seen["jobs"].items():
                assert cli.json("at", str(moment), "job", "status", job) == view
            whole = cli.json("at", str(moment))
            assert {j["job"]: j["running"] for j in whole["jobs"]} == {
                j: sum(t["state"] == "RUNNING" for t in v["tasks"]) for j, v in seen["jobs"].items()}
        assert whole["history"]["set_aside"] == [] and whole["history"]["snapshot"], whole["history"]
        whole = cli.json("at", str(moments[0][0]))
        assert {j["job"]: j["running"] for j in whole["jobs"]} == jobs

        # shadow: the live policy reproduces the whole run; another one does not. Both over the same window, ending
        # at moments[2] (settled) and read once the look-ahead past it is on the log: a window ending "now" could
        # cut a decision from its input (CI once saw the second run's baseline differ from the first's)
        until = moments[2][0]
        while time.time() * 1000 < until + 16_000:  # the 15 s look-ahead past the window: a passage of time
            time.sleep(0.5)
        window = ("--since", str(start), "--until", str(until))
        live = cli.json("shadow", *window)
        assert live is not None, cli("shadow", *window).stderr
        why = {k: live[k] for k in ("decisions", "scheduler", "looped_jobs", "totals_equal", "spread_differs")}
        assert live["empty"] and live["decisions_differ"] == 0 and live["decisions_compared"] >= 5, why  # in full
        assert live["scheduler_events_differ"] == 0 and live["scheduler_events_compared"] > 20, live["scheduler"]
        other = cli.json("shadow", *window, "--policy", "scores=spread,least_loaded")
        assert other["baseline"]["reproduces_the_log"] and other["decisions_differ"] >= 1, other

        # explain: the moved task's decision, its filters, its cause
        moved = cli.json("explain", "e1.web/0", "--at", str(moments[1][0]), "--why-not", failed)
        assert moved["machine"] == task(moments[1][1]["jobs"]["e1.web"], "e1.web/0")["machine"]
        assert moved["decision"]["filter_rejections"].get("machine_not_up") == 1
        assert moved["caused_by"][1]["type"] in ("MachineStatusChanged", "UnavailabilityStarted")
        assert moved["why_not"] == {**moved["why_not"], "answer": "filtered", "filter": "machine_not_up"}
        assert "because of" in cli.ok("explain", "e1.web/0")

        # the API decides who may look back: a viewer of e1 sees e1's past, not e3's, not the whole region
        viewer = cli.env | {"ROPEWALK_TOKEN": cli.ok("user", "add", "vic", "--role", "e1=viewer").strip()}
        out = cli.run_with(viewer, "job", "status", "e1.web", "--at", str(moments[0][0]), "--json")
        assert out.returncode == 0 and json.loads(out.stdout) == moments[0][1]["jobs"]["e1.web"], out.stderr
        # why not another entitlement's machine: the viewer learns it was held by someone else, not its state
        theirs = task(moments[1][1]["jobs"]["e3.api"], "e3.api/0")["machine"]
        admin_sees = cli.json("explain", "e1.web/0", "--at", str(moments[1][0]), "--why-not", theirs)["why_not"]
        assert admin_sees["owner"] == "e3" and admin_sees["answer"] in ("filtered", "passed every filter")
        out = cli.run_with(viewer, "explain", "e1.web/0", "--at", str(moments[1][0]), "--why-not", theirs, "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["why_not"] == {
            "machine": theirs, "answer": "held then by an entitlement you have no role on: its state is not shown"}
        for denied, reason in ((("job", "status", "e3.api", "--at", str(moments[0][0])), "no role on entitlement"),
                               (("at", str(moments[0][0])), "for region administrators"),
                               (("explain", "e3.api/0"), "no role on entitlement"),
                               (("maintenance", "plan", *args[2:], "--dry-run"), "for region administrators")):
            out = cli.run_with(viewer, *denied)
            assert out.returncode == 1 and reason in out.stderr, (denied, out.stderr)

        # bad input: one line each
        for bad, says in ((("at", "yesterday", "machine", "list"), "bad moment"),
                          (("at", "now", "machine", "fail", failed), "does not look back"),
                          (("shadow", "--since", str(start), "--policy", "scores=nope"), "unknown score 'nope'"),
                          (("explain", "nothing"), "bad task id"),
                          (("explain", "e1.none/0"), "no event names task"),
                          (("at", "tasks/99@0", "machine", "list"), "tasks has partitions 0..3"),
                          (("machine", "list", "--at", "now-99999999h"), "before 1970"),
                          (("job", "status", "e1.web", "--at", "1000"), "unknown job 'e1.web' at")):
            out = cli(*bad)
            assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and says in out.stderr, \
                (bad, out.stderr)
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
