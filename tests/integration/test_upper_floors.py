"""Issue 15's combined test on the real broker: the Job Control Plane, the SRM and the lender of elastic loans run as
the workers they are (``Follower`` loops, each authenticated as its own principal, in threads of this process)
against the session's Kafka, fed the intents, the load signal of a compressed day and the allocator's answers.

Then the log is replayed and checked:

* **push and canary while SRM scales.** A 100-task job at a 50 % push with a 2-task canary, autoscaled within
  60..140 from a daily trace (100 at midnight, 50 at 4 h, 150 at 16 h; a sample every 12 trace minutes). The
  ``intents`` partition of the job is read in offset order and every JobSpecReconciled the Job Control Plane wrote
  is fed, with the job's submission, to the scheduler's own pure ``decide`` (the ``Sim`` harness, the allocator and
  agents played by ``Region``): after every scheduler decision, once the push has converged, the non-canary tasks
  on the push version stay within 50 % ± 1 task, the canary holds at most 2 tasks and never takes a push target's
  task; at every reconciled offset, once settled, exactly ``round_half_up(50 %, tasks - 2)`` push targets. The job
  went down to 60 and up to 140, and the SRM's decisions on the log reverse direction at most once in any hour of
  the trace.
* **loans.** An elastic entitlement waiting for quota borrows; the owner then waits for machines and the lender
  revokes with notice (an UnavailabilityStarted with ``vacate`` on the borrowed machine); once the machine is
  released (here by the test, playing the borrower's scheduler and the allocator) a LoanReturned says how long it
  took, within the bound.

What it does NOT run: scheduler shards, the allocator, agents as processes (their decisions are the pure ones,
fed from the replayed log); the time a revoked machine takes to come back through a real scheduler and allocator
is measured by ``bench/loans.py`` (a region of its own), not here.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the scheduler's pure harness

from test_cli_jobs import cli  # noqa: E402
from test_scheduler_decide import Sim  # noqa: E402
from test_versions import Region  # noqa: E402

from infra.credentials import AGENT, JOBCONTROL, LENDER, SRM  # noqa: E402
from processors.agent.load import DailyTrace  # noqa: E402
from processors.allocator.placement import NO_FEASIBLE_MACHINE, QUOTA_EXCEEDED  # noqa: E402
from processors.controlplane import worker_env  # noqa: E402
from processors.jobcontrol.processor import JobControlPlane  # noqa: E402
from processors.resourcebroker import decide as rb  # noqa: E402
from processors.resourcebroker import loans as ln  # noqa: E402
from processors.resourcebroker.lender import Lender  # noqa: E402
from processors.resourcebroker.region import generate_region, iter_machines  # noqa: E402
from processors.scheduler import versions as vs  # noqa: E402
from processors.srm import decide as sd  # noqa: E402
from processors.srm.processor import Autoscaler  # noqa: E402
from regioncli import ROOT, wait_for  # noqa: E402
from test_trust import Api  # noqa: E402
from streams import batches  # noqa: E402
from streams import replay as rp  # noqa: E402
from streams.clients import EventProducer  # noqa: E402
from streams.events import new_event  # noqa: E402

ENT, JOB = "e1", "e1.web"
BORROWER = "b1"
MIN = 60_000
HOUR = 60 * MIN
TRACE = "0:100,4:50,16:150,24:100"
SAMPLE_EVERY = 12 * MIN
PERCENT, CANARY = 50, 2


class Running:
    """Followers run in threads until the block ends; entering waits until each is following (caught up)."""

    def __init__(self, *workers):
        self.workers = workers
        self.threads = [threading.Thread(target=w.run, daemon=True, name=w.NAME) for w in workers]

    def __enter__(self):
        for t in self.threads:
            t.start()
        wait_for(lambda: all(w.live for w in self.workers), "the workers caught up", 60,
                 detail=lambda: f": {[(w.NAME, w.live) for w in self.workers]}")
        return self

    def __exit__(self, *exc):
        for w in self.workers:
            w.stop()
        for t in self.threads:
            t.join(30)
        assert all(w.errors == 0 for w in self.workers), [(w.NAME, w.errors) for w in self.workers]


def send(cfg, registry, events, name="test"):
    p = EventProducer(cfg, registry, name)
    for e in events:
        p.send(e)
    p.flush(20)


def event(type_, payload, ent=ENT, producer="cli", entity=None):
    return new_event(type_, payload, entitlement=ent, entity_id=entity or payload.get("job_id", ent),
                     producer=producer)


def entitlement(name, quota):
    return event("EntitlementCreated", {"name": name, "quota_machines": quota, "machine_type": None,
                                        "dc_pin": None, "host_profile": None}, ent=name)


def job_intents():
    return [
        entitlement(ENT, 200),
        event("JobSubmitted", {"job_id": JOB, "name": "web", "spec_version": 1, "tasks": 100,
                               "command": ["serve", "--v1"], "resources": {"cpu_millicores": 1000, "memory_mib": 1024},
                               "requirements": {}, "spread": "msb", "max_unavailable": 10, "env": {},
                               "controller": None}),
        event("PushIntentDeclared", {"job_id": JOB, "owner": "conveyor", "label": "v2", "command": ["serve", "--v2"],
                                     "env": {}, "percent": PERCENT, "steps": [1, 10, 50]}),
        event("CanaryIntentDeclared", {"job_id": JOB, "owner": "alice", "action": "start", "count": CANARY,
                                       "label": "c1", "command": ["serve", "--canary"], "env": {},
                                       "promote_percent": 100}),
        event("SizingIntentDeclared", {"job_id": JOB, "owner": "bob", "source": "person", "tasks": None,
                                       "autoscale": True, "min_tasks": 60, "max_tasks": 140, "load_per_task": 1.0,
                                       "decision": None}),
    ]


def load_samples():
    trace = DailyTrace.parse(TRACE, noise=0.02, seed=3)
    return [event("JobLoadReported", {"job_id": JOB, "at_ms": k * SAMPLE_EVERY, "load": trace.load(k * SAMPLE_EVERY),
                                       "running_tasks": 0, "unit": "load"}, producer="agent/simulated")
            for k in range(24 * HOUR // SAMPLE_EVERY + 1)]


def intents_log(cfg, registry):
    return sorted(rp.replay(cfg, registry, rp.ReplayFilter(topics=("intents",), entitlement=ENT)),
                  key=lambda r: (r.partition, r.offset))


class ShareWatch:
    """After every scheduler decision: the shares of the live tasks under the job's current mix."""

    def __init__(self, sim):
        self.sim = sim
        self.armed = False
        self.version_of: dict[int, int] = {}
        self.checked = 0
        self.sizes: set[int] = set()

    def __call__(self, sim):
        if JOB not in sim.state.jobs:
            return
        view = sim.view(JOB)
        mix = view.get("mix")
        if not mix or not mix["push"] or not mix["canary"]:
            return
        push, canary = mix["push"]["version"], mix["canary"]["version"]
        desired = view["desired_tasks"]
        live = {int(t["id"].rsplit("/", 1)[1]): t["spec_version"] for t in view["tasks"]}
        for i, v in live.items():
            assert not (self.version_of.get(i) == push and v == canary), f"task {i} went from the push to the canary"
            self.version_of[i] = v
        live = {i: v for i, v in live.items() if i < desired}
        non_canary = [v for v in live.values() if v != canary]
        pushed = sum(v == push for v in non_canary)
        within = abs(pushed - PERCENT * len(non_canary) / 100) <= 1
        canaries = sum(v == canary for v in live.values())
        if not self.armed:
            self.armed = within and canaries == CANARY
            return
        assert within, f"{pushed} of {len(non_canary)} non-canary tasks on the push version (desired {desired})"
        assert canaries <= CANARY
        self.checked += 1
        self.sizes.add(desired)


def check_push_canary_sizing(cfg, registry):
    log = intents_log(cfg, registry)
    sim = Sim()
    watch = ShareWatch(sim)
    region = Region(sim, watch)
    offsets = 0
    for rec in log:
        e = rec.event
        if e.type not in ("EntitlementCreated", "JobSubmitted", "JobSpecReconciled"):
            continue
        region.run(sim.feed(e))
        if e.type != "JobSpecReconciled" or not watch.armed:
            continue
        p = e.payload
        view = sim.view(JOB)
        live = [t for t in view["tasks"] if int(t["id"].rsplit("/", 1)[1]) < p["tasks"]]
        assert view["desired_tasks"] == p["tasks"] == len(live), f"@{rec.offset}"
        by_version = {v: sum(t["spec_version"] == v for t in live) for v in {t["spec_version"] for t in live}}
        assert by_version.get(p["canary"]["version"], 0) == CANARY, f"@{rec.offset}: {by_version}"
        assert by_version.get(p["push"]["version"], 0) == vs.round_half_up(PERCENT, p["tasks"] - CANARY), \
            f"@{rec.offset}: {by_version} of {p['tasks']}"
        offsets += 1
    decisions = [r.event.payload["decision"] for r in log
                 if r.event.type == "SizingIntentDeclared" and r.event.producer == sd.PRODUCER]
    return watch, offsets, decisions


def test_a_push_a_canary_and_the_srm_together_and_a_loan_taken_back(cfg, registry, tmp_path):
    workers = (JobControlPlane(cfg.as_principal(JOBCONTROL), registry=registry),
               Autoscaler(cfg.as_principal(SRM), registry=registry),
               Lender(cfg.as_principal(LENDER), registry=registry,
                      tuning=ln.Tuning(headroom_machines=2, lend_cooldown_ms=60_000, bound_ms=60_000)))
    jcp, srm, lender = workers
    with Running(*workers):
        # -- the job's intents, then the day's load ------------------------------------------------------------
        send(cfg, registry, job_intents())
        wait_for(lambda: (j := jcp.state.jobs.get(JOB)) is not None and j.last is not None
                 and (j.last.get("canary") or {}).get("count") == CANARY, "the push and canary reconciled", 30)
        samples = load_samples()
        send(cfg.as_principal(AGENT), registry, samples, "agent/simulated")

        def reconciled_all():
            job = srm.state.jobs.get(JOB)
            jc = jcp.state.jobs.get(JOB)
            if job is None or job.samples < len(samples) or jc is None or jc.last is None:
                return False
            return jc.last["tasks"] == job.current

        wait_for(reconciled_all, "the SRM's last decision reconciled", 60,
                 detail=lambda: f": srm {srm.state.jobs.get(JOB)}")

        # -- loans: an elastic borrower, then the owner short of machines ------------------------------------------
        _, machines = rb.register_all(rb.BrokerState(), iter_machines(generate_region(10)), int(time.time() * 1000))
        ids = [r["machine_id"] for m in machines for r in batches.machine_registrations(m)]
        send(cfg, registry, [*machines, entitlement(BORROWER, 0),
                             event("EntitlementElasticityChanged", {"elastic": True, "max_borrowed_machines": 4,
                                                                    "revoke_notice_ms": 3000, "lend_idle": True},
                                   ent=BORROWER)])
        wait_for(lambda: BORROWER in lender.book.elasticity and len(lender.book.broker.machines) == 10,
                 "the lender read the machines and the borrower", 30)
        send(cfg, registry, [rejected(BORROWER, f"{BORROWER}.crunch", QUOTA_EXCEEDED, 4)], "allocator")
        wait_for(lambda: lender.book.loans, "a loan", 30)
        send(cfg, registry, [assigned(m, BORROWER) for m in ids[:4]] + [assigned(m, ENT) for m in ids[4:8]],
             "allocator")
        wait_for(lambda: sum(m.owner is not None for m in lender.book.broker.machines.values()) == 8,
                 "the lender read the assignments", 30)
        send(cfg, registry, [rejected(ENT, JOB, NO_FEASIBLE_MACHINE, 2)], "allocator")
        rev = wait_for(lambda: next(iter(lender.book.revocations.values()), None), "a revocation", 30)
        assert len(rev.machines) == 1 and set(rev.machines) <= set(ids[:4])
        send(cfg, registry, [released(m, BORROWER) for m in rev.machines], "allocator")
        wait_for(lambda: not lender.book.revocations, "the machine returned", 30,
                 detail=lambda: f": {lender.book.revocations}, errors {lender.errors}, "
                                f"{[lender.book.broker.get(m) for m in rev.machines]}")

    # -- the log, replayed -----------------------------------------------------------------------------------------
    watch, offsets, decisions = check_push_canary_sizing(cfg, registry)
    tasks = [r.event.payload["tasks"] for r in intents_log(cfg, registry)
             if r.event.type == "SizingIntentDeclared" and r.event.producer == sd.PRODUCER]
    assert min(tasks) == 60 and max(tasks) == 140 and tasks.index(60) < tasks.index(140), tasks
    assert watch.armed and watch.checked > 50 and {60, 140} <= watch.sizes, (watch.checked, sorted(watch.sizes))
    assert offsets >= len(tasks), (offsets, len(tasks))
    flips = sd.reversals(decisions)
    assert 1 <= len(flips) and sd.most_in_window(flips, HOUR) <= 1, flips

    loan_log = {r.event.type: r.event.payload for r in
                rp.replay(cfg, registry, rp.ReplayFilter(topics=("loans", "unavailability", "intents"),
                                                         entitlement=BORROWER))}
    assert loan_log["LoanGranted"]["machines"] == 4 and loan_log["LoanGranted"]["quota_after"] == 4
    notice = loan_log["UnavailabilityStarted"]
    assert notice["vacate"] and notice["machine_ids"] == list(rev.machines)
    back = loan_log["LoanReturned"]
    assert back["machine_id"] == rev.machines[0] and 0 <= back["took_ms"] <= back["bound_ms"] == 60_000
    assert loan_log["UnavailabilityEnded"]["unavailability_id"] == rev.revocation_id
    assert loan_log["EntitlementUpdated"]["quota_machines"] == 3  # the latest quota: 4 lent, 1 taken back
    views(cfg, tmp_path, tasks, rev)
    print(f"combined: {watch.checked} scheduler decisions checked, {offsets} reconciled offsets settled, "
          f"{len(tasks)} SRM decisions ({min(tasks)}..{max(tasks)}), reversals at {flips}, "
          f"loan returned in {back['took_ms']} ms")


def rejected(ent, job, reason, tasks):
    return event("AllocationRejected", {"request_id": f"req-{job}-{time.monotonic_ns()}", "job_id": job,
                                        "reason": reason, "message": "", "filter_rejections": {},
                                        "unplaced_task_ids": [f"{job}/{i}" for i in range(tasks)]},
                 ent=ent, producer="allocator")


def assigned(machine, ent):
    return event("MachineAssignedToEntitlement", {"machine_id": machine, "dc": "dc1", "reason": "placement"},
                 ent=ent, producer="allocator", entity=machine)


def released(machine, ent):
    return event("MachineReleasedToFreePool", {"machine_id": machine, "dc": "dc1", "reason": "empty"},
                 ent=ent, producer="allocator", entity=machine)


def views(cfg, tmp_path, tasks, rev):
    """The same log through the API's views (authorized per entitlement) and the CLI."""
    api = Api(cfg, tmp_path)
    try:
        code, doc = api.call("GET", f"/v1/jobs/{JOB}/intents", api.alice)
        assert code == 200 and set(doc["intents"]) >= {"push", "canary", "sizing/person", "sizing/autoscaler"}, doc
        assert doc["reconciled"]["tasks"] == tasks[-1] and doc["reconciled"]["push"]["percent"] == PERCENT
        code, hist = api.call("GET", f"/v1/jobs/{JOB}/intents/history", api.alice)
        assert code == 200 and [r["tasks"] for r in hist if "tasks" in r][-1] == tasks[-1]
        assert all(p["topic"] == "intents" for r in hist if "provenance" in r for p in r["provenance"])
        code, doc = api.call("GET", f"/v1/jobs/{JOB}/srm", api.alice)
        assert code == 200 and doc["policy"]["min_tasks"] == 60 and doc["current_tasks"] == tasks[-1], doc
        code, doc = api.call("GET", f"/v1/srm/decisions?job={JOB}", api.alice)
        assert code == 200 and [d["tasks"] for d in doc["decisions"]] == tasks
        assert doc["most_reversals_in_an_hour"] <= 1
        code, doc = api.call("GET", "/v1/loans", api.admin)
        assert code == 200 and len(doc["returns"]) == 1 and doc["returned_p99_ms"] <= 60_000, doc
        code, doc = api.call("GET", f"/v1/loans?entitlement={ENT}", api.alice)  # e1's idle quota backs the loan
        assert code == 200 and [x["lender"] for x in doc["loans"]] == [ENT] and doc["returns"] == [], doc
        refused = [("GET", "/v1/loans", None, "needs_region_admin"),
                   ("GET", f"/v1/loans?entitlement={BORROWER}", None, "no_role_on_entitlement"),
                   ("GET", f"/v1/jobs/{BORROWER}.crunch/intents", None, "no_role_on_entitlement"),
                   ("POST", f"/v1/jobs/{BORROWER}.crunch/intents/push", {"percent": 5}, "no_role_on_entitlement"),
                   ("GET", "/v1/srm/decisions", None, "needs_region_admin"),
                   ("PUT", f"/v1/entitlements/{ENT}/elasticity", {"elastic": True}, "needs_region_admin")]
        for method, path, body, reason in refused:
            code, doc = api.call(method, path, api.alice, body)
            assert (code, doc.get("error")) == (403, reason), (method, path, doc)
        bad = [("POST", f"/v1/jobs/{JOB}/intents/push", {"percent": 150, "command": ["x"]}, "percent"),
               ("POST", f"/v1/jobs/{JOB}/intents/size", {"tasks": -1}, "tasks"),
               ("POST", f"/v1/jobs/{JOB}/intents/volume", {"tasks": 1}, "dimension"),
               ("PUT", f"/v1/entitlements/{BORROWER}/elasticity", {"elastic": True, "max_borrowed_machines": -1},
                "max_borrowed_machines")]
        for method, path, body, field in bad:
            code, doc = api.call(method, path, api.admin, body)
            assert code in (400, 422) and field in doc["message"], (path, doc)
        code, doc = api.call("POST", f"/v1/jobs/{JOB}/intents/push", api.alice,
                             {"percent": 60, "command": ["serve", "--v2"], "label": "v2"})
        assert code == 202 and doc["intent"] == "PushIntentDeclared", doc
        env = {**worker_env(cfg), "ROPEWALK_API_URL": api.url, "ROPEWALK_TOKEN": api.alice}
        for argv, check in ((["intents", "show", JOB], lambda d: d["intents"]["push"]["payload"]["percent"] == 60),
                            (["srm", "decisions", "--job", JOB], lambda d: len(d["decisions"]) == len(tasks)),
                            (["loans", "show", "--entitlement", ENT], lambda d: d["loans"][0]["lender"] == ENT)):
            out = subprocess.run([sys.executable, "-m", "processors.frontend.cli", *argv, "--json"], env=env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and check(json.loads(out.stdout)), (argv, out.stderr)
    finally:
        api.close()


def test_srm_plan_says_what_it_would_decide_and_writes_nothing(cfg, registry):
    """`ropewalk srm plan JOB` (issue 15: HPA has no dry run, kubernetes#106765): the SRM's decision now, with its
    rule, from the log as it is, and not one record more on any topic."""
    job, ent = "dry.api", "dry"
    p = EventProducer(cfg, registry, "test")

    def send(type_, payload, producer="cli"):
        p.send(new_event(type_, {"job_id": job, **payload}, entitlement=ent, entity_id=job, producer=producer))

    send("SizingIntentDeclared", {"owner": "bob", "source": "person", "tasks": None, "autoscale": True,
                                  "min_tasks": 1, "max_tasks": 8, "load_per_task": 10.0, "decision": None})
    for k, load in enumerate((20.0, 40.0, 60.0)):
        send("JobLoadReported", {"at_ms": 1_700_000_000_000 + k * 60_000, "load": load, "running_tasks": 2,
                                 "unit": "rps"}, producer="agent/simulated")
    p.flush()

    def end_offsets():
        out = cli(cfg, "status", "--json")  # exits 1 here (no supervisor): its topics are what counts
        return json.loads(out.stdout)["topics"]

    before = end_offsets()
    got = cli(cfg, "srm", "plan", job, "--direct", "--json")
    assert got.returncode == 0, got.stderr
    plan = json.loads(got.stdout)
    assert (plan["direction"], plan["rule"], plan["current_tasks"], plan["tasks"]) == (sd.UP, "scale_up", 2, 8)
    assert plan["says"] == sd.SAYS["scale_up"] and plan["dry_run"] and plan["at_ms"] == 1_700_000_120_000
    text = cli(cfg, "srm", "plan", job, "--direct")
    readme = (ROOT / "processors" / "srm" / "README.md").read_text().split("$ ropewalk srm plan e1.web\n")[1]
    assert text.stdout.splitlines() == [line.strip().replace("e1.web", job)
                                        for line in readme.split("```")[0].strip().splitlines()]  # as written
    assert end_offsets() == before, "a dry run wrote to the log"
    unknown = cli(cfg, "srm", "plan", "dry.nothing", "--direct")
    assert unknown.returncode == 1 and "the SRM knows nothing of 'dry.nothing'" in unknown.stderr
