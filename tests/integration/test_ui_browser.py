"""The web UI in a real browser (issue 13): Debian's chromium driven by Playwright, on a region started by
`ropewalk up`. A job is followed through submit -> running -> its machine fails -> moved, on the jobs page, the job
page (tasks and the timeline drawn from the log) and live over server-sent events; every page loads.

``ROPEWALK_SCREENSHOTS_DIR=docs`` also writes the pages' screenshots there (how docs/ui-*.png were made)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from regioncli import RegionCli

SPEC = ("name: web\nentitlement: e1\ntasks: 3\ncommand: [sleep, '3600']\n"
        "resources: {cpu_millicores: 1000, memory_mib: 1024}\nspread: msb\n")


@pytest.mark.timeout(300)
def test_a_job_followed_in_the_browser_through_a_machine_failure(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: infra/bootstrap.sh --for-tests installs it"
    shots = Path(os.environ.get("ROPEWALK_SCREENSHOTS_DIR") or tmp_path)
    cli = RegionCli(tmp_path / "run")
    up = cli("up", "--machines", "12", "--no-demo")
    try:
        assert up.returncode == 0, up.stderr
        base = f"http://127.0.0.1:{cli.env['ROPEWALK_API_PORT']}"
        token = (tmp_path / "run" / "secrets" / "token").read_text().strip()
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
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
