"""The web UI in a real browser (issue 13): Debian's chromium driven by Playwright, on a region started by
`ropewalk up`. A job is followed through submit -> running -> its machine fails -> moved, on the jobs page, the job
page (tasks and the timeline drawn from the log) and live over server-sent events; every page loads.

``ROPEWALK_SCREENSHOTS_DIR=docs`` also writes the pages' screenshots there (how docs/ui-*.png were made)."""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from regioncli import RegionCli

SPEC = ("name: web\nentitlement: e1\ntasks: 3\ncommand: [sleep, '3600']\n"
        "resources: {cpu_millicores: 1000, memory_mib: 1024}\nspread: msb\n")


class Region:
    """One region started by `ropewalk up` for the module's tests (each test uses its own entitlements)."""

    def __init__(self, run: Path):
        self.cli = RegionCli(run)
        self.run = run

    def start(self) -> None:
        up = self.cli("up", "--machines", "12", "--no-demo")
        assert up.returncode == 0, up.stderr
        self.base = f"http://127.0.0.1:{self.cli.env['ROPEWALK_API_PORT']}"
        self.token = (self.run / "secrets" / "token").read_text().strip()


@pytest.fixture(scope="module")
def region(tmp_path_factory):
    # A ReBalancer round every 2 s (60 s in a region): a plan shows while the test looks.
    r = Region(tmp_path_factory.mktemp("ui") / "run")
    r.cli.env["ROPEWALK_REBALANCE_INTERVAL_S"] = "2"
    try:
        r.start()
        yield r
    finally:
        down = r.cli("down")
    assert down.returncode == 0, down.stderr


def chromium_path() -> str:
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: infra/bootstrap.sh --for-tests installs it"
    return chromium


def sign_in(page, base: str, token: str) -> None:
    from playwright.sync_api import expect  # noqa: PLC0415 - start-up cost: playwright (~90 ms)

    page.goto(f"{base}/ui/login")
    page.fill("#token", token)
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Jobs")


@pytest.mark.timeout(300)
def test_a_job_followed_in_the_browser_through_a_machine_failure(region, tmp_path):
    from playwright.sync_api import expect, sync_playwright  # noqa: PLC0415 - start-up cost: playwright (~90 ms)

    chromium = chromium_path()
    shots = Path(os.environ.get("ROPEWALK_SCREENSHOTS_DIR") or tmp_path)
    cli, base, token = region.cli, region.base, region.token
    cli.ok("entitlement", "create", "e1", "--quota", "6")
    (tmp_path / "web.yaml").write_text(SPEC)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.goto(f"{base}/ui/jobs")
        expect(page).to_have_url(f"{base}/ui/login")  # signed out: the sign-in page
        page.fill("#token", "rwt_not-a-token")
        page.click("button[type=submit]")
        expect(page.locator("#error")).to_have_text("unknown token")
        page.fill("#token", token)
        page.click("button[type=submit]")
        expect(page.locator("h1")).to_have_text("Jobs")
        expect(page.locator("#live")).to_have_attribute("data-ready", "1")

        # submitted from the CLI: the row appears live, then RUNNING
        cli.ok("job", "submit", str(tmp_path / "web.yaml"))
        row = page.locator('tr[data-job="e1.web"]')
        expect(row.locator(".running")).to_have_text("3/3", timeout=60_000)
        page.screenshot(path=str(shots / "ui-jobs.png"))

        page.click("text=e1.web")
        expect(page.locator("h1")).to_have_text("e1.web")
        expect(page.locator("#timeline")).to_have_attribute("data-moves", "3", timeout=20_000)
        assert page.locator("#timeline .vis-item").count() > 3  # vis-timeline drew the bars and points
        first = page.locator('#tasks tr[data-task="e1.web/0"] .machine').inner_text()

        # its machine fails: the page shows the task moved, on the table and on the timeline, live
        before_ms = int(time.time() * 1000)
        cli.ok("machine", "fail", first)
        moved = page.locator('#tasks tr[data-task="e1.web/0"] .machine')
        expect(moved).not_to_have_text(first, timeout=60_000)
        expect(page.locator('#tasks tr[data-task="e1.web/0"] .state')).to_have_text("RUNNING", timeout=60_000)
        expect(page.locator("#timeline")).to_have_attribute("data-moves", "4", timeout=20_000)
        assert page.locator("#timeline .vis-item", has_text=f"on {first}").count() >= 1
        lag_ms = int(page.locator("body").get_attribute("data-lag-ms"))
        assert 0 <= lag_ms < 1000, f"a live update reached the page {lag_ms} ms after its record was made"
        page.screenshot(path=str(shots / "ui-job-timeline.png"), full_page=True)

        page.goto(f"{base}/ui/machines")
        expect(page.locator(f'tr[data-machine="{first}"] .status')).to_have_text("DOWN")
        page.screenshot(path=str(shots / "ui-fleet.png"))
        after_ms = int(time.time() * 1000)

        # time travel (issue 14): the fleet and the job as they were before the failure, from the log
        page.goto(f"{base}/ui/machines?at={before_ms}")
        expect(page.locator("#at-banner")).to_have_attribute("data-at-ms", str(before_ms))
        expect(page.locator(f'tr[data-machine="{first}"] .status')).to_have_text("UP")
        page.screenshot(path=str(shots / "ui-fleet-at.png"))
        page.locator("#at-slider").fill(str(after_ms))  # let go of the slider: the page at that moment
        expect(page.locator("#at-banner")).to_have_attribute("data-at-ms", str(after_ms))
        expect(page.locator(f'tr[data-machine="{first}"] .status')).to_have_text("DOWN")
        page.goto(f"{base}/ui/jobs/e1.web?at={before_ms}")
        expect(page.locator('#tasks tr[data-task="e1.web/0"] .machine')).to_have_text(first)
        page.click("#at-now")
        expect(page.locator('#tasks tr[data-task="e1.web/0"] .machine')).not_to_have_text(first)
        assert page.locator("#at-banner").count() == 0
        page.goto(f"{base}/ui/machines?at=yesterday")  # a bad moment: refused, naming the field
        expect(page.locator("body")).to_contain_text("at: ")

        page.goto(f"{base}/ui/machines")
        cli.ok("machine", "recover", first)
        expect(page.locator(f'tr[data-machine="{first}"] .status')).to_have_text("UP", timeout=30_000)

        page.goto(f"{base}/ui/entitlements")
        expect(page.locator("#entitlements tbody tr").first).to_contain_text("e1")
        page.goto(f"{base}/ui/events?job=e1.web&type=JobSubmitted,TasksCommanded&since=1h")
        expect(page.locator("#events tbody tr").first).to_be_visible()
        assert {t.strip() for t in page.locator("#events tbody td:nth-child(2)").all_inner_texts()} == {
            "JobSubmitted", "TasksCommanded"}
        page.goto(f"{base}/ui/events?since=1h")
        page.screenshot(path=str(shots / "ui-events.png"))
        browser.close()


def job_spec(name: str, ent: str, tasks: int, cpu: int, spread: str = "rack") -> str:
    return (f"name: {name}\nentitlement: {ent}\ntasks: {tasks}\ncommand: [sleep, '3600']\n"
            f"resources: {{cpu_millicores: {cpu}, memory_mib: 64}}\nspread: {spread}\n")


XSS_LABEL = '<img src=x onerror="window.__xss=1">v2'


@pytest.mark.timeout(420)
def test_the_upper_floors_in_the_browser(region, tmp_path):
    """The ReBalancer's plans, a job's intents, the SRM and loans (issues 13, 15) on real events made through the
    CLI: each page's empty state first, then its rows; a push label with HTML in it shows as text; a viewer of
    one entitlement sees only its things, and a clear refusal for another's job."""
    from playwright.sync_api import expect, sync_playwright  # noqa: PLC0415 - start-up cost: playwright (~90 ms)

    cli, base = region.cli, region.base
    shots = Path(os.environ.get("ROPEWALK_SCREENSHOTS_DIR") or tmp_path)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        sign_in(page, base, region.token)
        # nothing yet: each page says so, and what makes it show something
        for path, empty in (("/ui/rebalance", "#empty"), ("/ui/intents", "#intents tr.empty"),
                            ("/ui/srm", "#srm tr.unsized[data-job='e1.web']"), ("/ui/loans", "#history tr.empty")):
            page.click(f"header nav a[href='{path}']")  # reached from the navigation
            expect(page.locator(empty)).to_be_visible()

        # the events, through the CLI (the API, as the region admin)
        cli.ok("entitlement", "create", "e2", "--quota", "2", "--dc", "dc1")
        cli.ok("entitlement", "create", "e3", "--quota", "1", "--dc", "dc2")
        cli.ok("entitlement", "create", "e4", "--quota", "2")
        for name, ent, n, cpu, spread in (("base", "e2", 2, 500, "rack"), ("api", "e4", 2, 500, "rack"),
                                          ("batch", "e3", 2, 20_000, "rack")):
            (tmp_path / f"{name}.yaml").write_text(job_spec(name, ent, n, cpu, spread))
            cli.ok("job", "submit", str(tmp_path / f"{name}.yaml"), "--no-wait")
        cli.wait_for(lambda: cli.running("e2.base", 2), "e2.base running")
        # a hot spot: 20 tasks of 1 core, packed by the allocator onto one of e2's two machines
        (tmp_path / "hot.yaml").write_text(job_spec("hot", "e2", 20, 1000, "dc"))
        cli.ok("job", "submit", str(tmp_path / "hot.yaml"), "--no-wait")
        # intents: a push with HTML in its label (applied), a promote without a canary (refused: action)
        cli.wait_for(lambda: cli.running("e4.api", 2), "e4.api running")
        cli.ok("intents", "push", "e4.api", "--percent", "50", "--command", "sleep 3601", "--label", XSS_LABEL)
        cli.ok("intents", "canary", "e4.api", "promote")
        # the SRM sizes e4.api from 10 to 40 load (10 a task): a decision up, with its reason
        cli.ok("intents", "size", "e4.api", "--auto", "--min", "1", "--max", "4", "--load-per-task", "10")
        cli.wait_for(lambda: "sizing/person" in ((cli.json("intents", "show", "e4.api") or {}).get("intents") or {}),
                     "the autoscaling policy in force")
        now = int(time.time() * 1000)
        samples = [{"job_id": "e4.api", "at_ms": now - (3 - k) * 60_000, "load": load, "running_tasks": 2,
                    "unit": "rps"} for k, load in enumerate((10.0, 20.0, 30.0, 38.0))]
        (tmp_path / "load.json").write_text(json.dumps(samples))
        cli.ok("produce", "metrics", "JobLoadReported", str(tmp_path / "load.json"), "--entitlement", "e4")
        # e3 may borrow: its second task waits for quota, the lender lends it a free machine
        cli.ok("loans", "elastic", "e3", "--max", "2")

        cli.wait_for(lambda: cli.json("rebalance", "plan", "--entitlement", "e2"), "a ReBalancer plan for e2",
                     timeout_s=120)
        cli.wait_for(lambda: (cli.json("srm", "decisions", "--job", "e4.api") or {}).get("decisions"),
                     "the SRM's decision on e4.api", timeout_s=60)
        lent = cli.wait_for(lambda: (cli.json("loans", "show") or {}).get("loans"), "a loan to e3", timeout_s=90)

        page.click("header nav a[href='/ui/rebalance']")
        plan = page.locator("section.plan[data-entitlement='e2']").first
        expect(plan.locator("td.nmoves")).not_to_have_text("0")
        assert float(plan.locator("td.before").inner_text()) > float(plan.locator("td.after").inner_text())
        expect(plan.locator("p.why")).to_contain_text("above the trigger")
        assert plan.locator("table.moves tbody tr[data-task^='e2.hot/']").count() >= 1
        page.screenshot(path=str(shots / "ui-rebalance.png"), full_page=True)

        page.click("header nav a[href='/ui/intents']")
        page.click("#intents a[href='/ui/jobs/e4.api/intents']")
        expect(page.locator("h1")).to_have_text("e4.api · intents")
        push = page.locator("#ledger tr", has_text="50%")
        expect(push.locator(".outcome")).to_contain_text("applied", timeout=30_000)
        expect(push.locator(".wants")).to_have_text(f"50% on {XSS_LABEL}")  # the markup as text
        expect(push.locator(".owner")).to_have_text("admin")  # the caller: a body's owner is refused (issue 27)
        assert page.locator("#ledger img, #ledger td.owner b").count() == 0
        assert page.evaluate("window.__xss") is None
        refused = page.locator("#ledger tr.o-refused", has_text="canary promote")
        expect(refused.locator(".reason")).to_have_text("no_canary")
        expect(refused.locator(".field")).to_have_text("action")
        expect(page.locator("#elasticity")).to_have_text("not set")
        expect(page.locator("#ledger tr", has_text="autoscale 1..4").locator(".outcome")).to_have_text(
            "in force (no spec change yet)")  # a policy: the SRM's sizes change the spec, not the policy itself
        page.screenshot(path=str(shots / "ui-intents.png"), full_page=True)

        page.click("header nav a[href='/ui/srm']")
        row = page.locator("#srm tr[data-job='e4.api']")
        expect(row.locator(".decision")).to_contain_text("up 2 → 4")
        expect(row.locator(".decision")).to_contain_text("scale_up")
        expect(row.locator(".why")).to_contain_text("hold_same")  # now: it holds at the size it chose
        expect(row.locator(".size")).to_have_text("4")
        assert cli.json("srm", "plan", "e4.api")["rule"] == "hold_same"  # the same dry run, through the API
        page.screenshot(path=str(shots / "ui-srm.png"), full_page=True)

        page.click("header nav a[href='/ui/loans']")
        loan = page.locator("#loans tbody tr").first
        expect(loan.locator(".borrower")).to_have_text("e3")
        expect(loan.locator(".lender")).to_have_text(lent[0]["lender"])  # the free pool, or e1's idle quota
        expect(page.locator("#history tr.k-granted .borrower").first).to_have_text("e3")
        expect(page.locator("#loans tbody tr")).to_have_count(1)  # one machine for its one waiting task, lent once
        page.screenshot(path=str(shots / "ui-loans.png"), full_page=True)

        # a viewer of e2 only: its plan, nothing of e3's loans or e4's SRM, a refusal for e4's intents
        made = cli.json("user", "add", "viewer2", "--role", "e2=viewer")
        viewer = browser.new_context().new_page()
        sign_in(viewer, base, made["token"])
        viewer.goto(f"{base}/ui/rebalance")
        expect(viewer.locator("section.plan[data-entitlement='e2']").first).to_be_visible()
        viewer.goto(f"{base}/ui/loans")
        expect(viewer.locator("#loans tr.empty")).to_contain_text("nothing lent to or by your entitlements")
        assert viewer.locator("#history tr.k-granted").count() == 0
        viewer.goto(f"{base}/ui/srm")  # its jobs, none autoscaled; nothing of e4's
        expect(viewer.locator("#srm tr.unsized[data-job='e2.base']")).to_be_visible()
        assert viewer.locator("#srm tr[data-job^='e4.'], #srm tr:not(.unsized)[data-job]").count() == 0
        answer = viewer.goto(f"{base}/ui/jobs/e4.api/intents")
        assert answer.status == 403
        expect(viewer.locator("#refused")).to_have_attribute("data-reason", "no_role_on_entitlement")
        expect(viewer.locator("#refused")).to_contain_text("viewer2 has no role on entitlement 'e4'")
        assert viewer.goto(f"{base}/ui/jobs/e4.api").status == 403  # the job's own page: the same refusal
        expect(viewer.locator("#refused")).to_have_attribute("data-reason", "no_role_on_entitlement")
        assert viewer.goto(f"{base}/ui/jobs/e2.nosuch").status == 404  # a job of its own that is not there
        expect(viewer.locator("#refused")).to_have_attribute("data-reason", "unknown_job")
        browser.close()


@pytest.mark.timeout(360)
def test_the_operator_pages_in_the_browser(region, tmp_path):
    """Issue 30: the maintenance page; the fleet a page at a time, with its host profile and each maintenance by
    its reason linked to that page; a job's timeline marking a machine failure, a maintenance notice and deadline,
    and the spec version of each bar through a rolling update, no label cut to its bar; the free pool counted
    alike on the Entitlements and Loans pages; every job on the SRM page."""
    from playwright.sync_api import expect, sync_playwright  # noqa: PLC0415 - start-up cost: playwright (~90 ms)

    cli, base = region.cli, region.base
    shots = Path(os.environ.get("ROPEWALK_SCREENSHOTS_DIR") or tmp_path)
    cli.ok("entitlement", "create", "e5", "--quota", "2", "--host-profile", "web")
    (tmp_path / "ops.yaml").write_text(job_spec("ops", "e5", 2, 500, "rack"))
    cli.ok("job", "submit", str(tmp_path / "ops.yaml"))
    cli.wait_for(lambda: cli.running("e5.ops", 2), "e5.ops running", timeout_s=90)
    (tmp_path / "ops2.yaml").write_text(job_spec("ops", "e5", 2, 500, "rack").replace("'3600'", "'3601'"))
    cli.ok("job", "update", "e5.ops", str(tmp_path / "ops2.yaml"))
    view = cli.wait_for(lambda: (v := cli.running("e5.ops", 2)) and all(t["spec_version"] == 2 for t in v["tasks"])
                        and v, "e5.ops at v2", timeout_s=90)
    kept, lost = view["tasks"][0]["machine"], view["tasks"][1]["machine"]
    planned = cli.json("maintenance", "plan", "--machines", kept, "--start", "+10m", "--duration", "30m",
                       "--deadline", "+5m", "--reason", "kernel upgrade")
    ue = planned["unavailability_id"]
    cli.ok("machine", "fail", lost)
    cli.wait_for(lambda: (v := cli.running("e5.ops", 2)) and lost not in {t["machine"] for t in v["tasks"]},
                 "e5.ops/1 moved off the failed machine", timeout_s=90)
    free = [m for m in cli.json("machine", "list", "--free") if m["status"] == "UP" and not m["maintenance"]]
    cli.ok("machine", "fail", free[0]["id"])  # a free machine DOWN: unowned, but not free
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        sign_in(page, base, region.token)

        page.goto(f"{base}/ui/jobs/e5.ops")
        box = page.locator("#timeline")
        expect(box).to_have_attribute("data-failure", re.compile(r"[1-9]"), timeout=20_000)
        assert int(box.get_attribute("data-deadline")) >= 1 and int(box.get_attribute("data-maintenance")) >= 1
        assert int(box.get_attribute("data-intent")) >= 2  # submitted, then the update
        expect(page.locator("#timeline .vis-item.vis-range", has_text=re.compile(r"^RUNNING v2 on "))).not_to_have_count(0)
        expect(page.locator("#timeline .vis-item.vis-range", has_text=re.compile(r"^RUNNING v1 on "))).not_to_have_count(0)
        overflow = page.evaluate("getComputedStyle(document.querySelector('#timeline .vis-item.open "
                                 ".vis-item-overflow')).overflow")
        assert overflow == "visible"  # a task's current bar, however short yet, is not cut to "RU"
        page.screenshot(path=str(shots / "ui-job-timeline.png"), full_page=True)

        page.click("header nav a[href='/ui/maintenance']")
        row = page.locator(f'#maintenance tr[data-maintenance="{ue}"]')
        expect(row.locator(".reason")).to_have_text("kernel upgrade")
        expect(row.locator(".machines")).to_contain_text(kept)
        expect(row.locator(".start")).to_contain_text("(in ")
        page.screenshot(path=str(shots / "ui-maintenance.png"), full_page=True)

        page.goto(f"{base}/ui/machines")
        machine = page.locator(f'#machines tr[data-machine="{kept}"]')
        expect(machine.locator(".profile")).to_contain_text("web")
        link = machine.locator(".maint a")
        expect(link).to_have_text(f"kernel upgrade ({ue[:8]})")
        page.screenshot(path=str(shots / "ui-fleet.png"), full_page=True)
        link.click()
        expect(page).to_have_url(f"{base}/ui/maintenance#{ue}")
        page.goto(f"{base}/ui/machines?per=5")
        expect(page.locator("#machines tbody tr")).to_have_count(5)
        expect(page.locator(".pager").first).to_contain_text("page 1 of 3")
        page.locator(".pager a.next").first.click()
        expect(page.locator(".pager").first).to_contain_text("page 2 of 3")
        expect(page.locator("#machines tbody tr")).to_have_count(5)
        page.goto(f"{base}/ui/machines?status=DOWN")
        statuses = page.locator("#machines tbody td.status").all_inner_texts()
        assert statuses and set(statuses) == {"DOWN"}, statuses

        def free_counts():
            page.goto(f"{base}/ui/entitlements")
            ents = page.locator("#free-total").inner_text()
            page.goto(f"{base}/ui/loans")
            return ents, page.locator("#free-machines").inner_text()
        deadline = time.monotonic() + 60
        while (counts := free_counts())[0] != counts[1] and time.monotonic() < deadline:
            time.sleep(1)
        assert counts[0] == counts[1], counts  # one rule: a DOWN free machine is not free on either page
        page.goto(f"{base}/ui/entitlements")
        expect(page.locator("#free-pool td.unusable", has_text="DOWN")).not_to_have_count(0)

        page.goto(f"{base}/ui/srm")
        for job in (v["job"] for v in cli.json("job", "list")):
            expect(page.locator(f'#srm tr[data-job="{job}"]')).to_have_count(1)
        expect(page.locator('#srm tr[data-job="e5.ops"] td', has_text="not autoscaled").first).to_be_visible()
        page.goto(f"{base}/ui/events")
        expect(page.locator("#events tbody tr").first).to_be_visible()
        browser.close()
    cli.ok("machine", "recover", free[0]["id"])
    cli.ok("machine", "recover", lost)
    cli.ok("maintenance", "end", ue)
