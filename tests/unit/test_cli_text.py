"""The CLI's human text (issue 13): tables with header rows, times a person reads, relative times, endpoints
remembered from the last `up`. Pure functions and a file in a temporary run directory."""
import os

import pytest

from infra import config
from processors.frontend import console, render
from processors.frontend.service import maintenance_windows
from streams.events import new_event

NOW = 1_795_440_810_008


@pytest.mark.parametrize("ms, text", [
    (NOW, "2026-11-23 13:33:30Z (now)"),
    (NOW + 600_000, "2026-11-23 13:43:30Z (in 10m)"),
    (NOW - 45_000, "2026-11-23 13:32:45Z (45s ago)"),
    (NOW - 3 * 86_400_000, "2026-11-20 13:33:30Z (3d ago)"),
    (None, "-"),
])
def test_human_time(ms, text):
    assert render.human_time(ms, NOW) == text


def test_table_pads_columns_under_a_header_row():
    assert render._table(["A", "LONGER"], [["xyz", 1], ["q", 22]], "none") == "A    LONGER\nxyz  1\nq    22"
    assert render._table(["A"], [], "nothing here") == "nothing here"


@pytest.mark.parametrize("value, ago_ms", [("10m", 600_000), ("1h", 3_600_000), ("2d", 172_800_000), ("90s", 90_000)])
def test_since_takes_a_duration_ago(value, ago_ms, monkeypatch):
    monkeypatch.setattr(render.time, "time", lambda: NOW / 1000)
    assert console._parse_time(value) == NOW - ago_ms
    assert console._parse_time("1795440810008") == NOW
    with pytest.raises(console.CliError, match="10m"):
        console._parse_time("yesterday")


def test_endpoints_are_remembered_for_a_shell_without_the_variables(tmp_path, monkeypatch):
    for k in config.ENDPOINT_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ROPEWALK_RUN_DIR", str(tmp_path))
    up_env = {**os.environ, "ROPEWALK_BROKER_PORT": "29092", "ROPEWALK_API_PORT": "29080"}
    config.remember_endpoints(up_env)
    cfg = config.Config.from_env()
    assert cfg.bootstrap_servers == "127.0.0.1:29092" and cfg.api_url == "http://127.0.0.1:29080"
    assert cfg.embedded_broker  # a port remembered, not an external cluster
    monkeypatch.setenv("ROPEWALK_REDIS_PORT", "16400")  # a shell naming its region mixes in nothing remembered
    cfg = config.Config.from_env()
    assert cfg.broker_port == config.DEFAULT_BROKER_PORT and cfg.redis_port == 16400
    assert config.Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)}).broker_port == config.DEFAULT_BROKER_PORT


def job(job_id, tasks, **kw):
    ent = job_id.split(".")[0]
    return {"job": job_id, "name": job_id.split(".")[1], "entitlement": ent, "state": "running", "incarnation": 1,
            "spec_version": 1, "desired_tasks": len(tasks), "last_reason": "", "updated_ms": NOW - 60_000,
            "tasks": [{"id": f"{job_id}/{i}", "state": st, "machine": m, "dc": m and m.split("-")[0], "msb": None,
                       "rack": None, "spec_version": 1, "reason": ""} for i, (st, m) in enumerate(tasks)], **kw}


@pytest.mark.parametrize("name, rows, wide, want", [
    ("plain", [job("e1.web", [("RUNNING", "dc1-m1"), ("PENDING", None)], last_reason="no_feasible_machine")], False,
     ["JOB     STATE    RUNNING  TASKS                                 LAST-REASON",
      "e1.web  running  1/2      1 running, 1 pending of 2 desired     no_feasible_machine"]),
    ("wide: entitlement, spec, machines, DCs, updated; the reason last",
     [job("e1.web", [("RUNNING", "dc1-m1"), ("RUNNING", "dc2-m7"), ("RUNNING", "dc1-m1")], last_reason="moved"),
      job("e2.batch", [("PENDING", None)], spec_version=3, incarnation=2)], True,
     ["JOB       STATE    RUNNING  TASKS                  ENTITLEMENT  SPEC               MACHINES  DCS      "
      "UPDATED                          LAST-REASON",
      "e1.web    running  3/3      3 running of 3 desired  e1           v1                 2         dc1,dc2  "
      "2026-11-23 13:32:30Z (60s ago)  moved",
      "e2.batch  running  0/1      1 pending of 1 desired  e2           v3 (incarnation 2)  0         -        "
      "2026-11-23 13:32:30Z (60s ago)"]),
    ("wide, none", [], True, ["no jobs"]),
])
def test_job_list_table(name, rows, wide, want):
    got = render.job_table(rows, wide, NOW).splitlines()
    assert [line.split() for line in got] == [line.split() for line in want], name


MAINT = {"unavailability_id": "ue-1", "machines": ["dc1-m1", "dc1-m2", "dc1-m3", "dc1-m4"],
         "statuses": {"MAINTENANCE": 1, "UP": 3}}


@pytest.mark.parametrize("name, rows, wide, want", [
    ("plain: the first machines", [MAINT], False,
     [["MAINTENANCE", "MACHINES", "STATUSES", "FIRST-MACHINES"],
      ["ue-1", "4", "MAINTENANCE", "1,", "UP", "3", "dc1-m1,dc1-m2,dc1-m3", "..."]]),
    ("wide: start, deadline, duration, reason, every machine",
     [{**MAINT, "start_ms": NOW + 600_000, "deadline_ms": NOW + 300_000, "expected_duration_ms": 1_800_000,
       "reason": "kernel"}], True,
     [["MAINTENANCE", "MACHINES", "STATUSES", "START", "DEADLINE", "DURATION", "REASON", "MACHINE-IDS"],
      ["ue-1", "4", "MAINTENANCE", "1,", "UP", "3", "2026-11-23", "13:43:30Z", "(in", "10m)", "2026-11-23",
       "13:38:30Z", "(in", "5m)", "30m", "kernel", "dc1-m1,dc1-m2,dc1-m3,dc1-m4"]]),
    ("wide, its start not on the log (a window read before it)", [MAINT], True,
     [["MAINTENANCE", "MACHINES", "STATUSES", "START", "DEADLINE", "DURATION", "REASON", "MACHINE-IDS"],
      ["ue-1", "4", "MAINTENANCE", "1,", "UP", "3", "-", "-", "-", "-", "dc1-m1,dc1-m2,dc1-m3,dc1-m4"]]),
    ("none", [], True, [["no", "maintenance", "planned", "or", "under", "way"]]),
])
def test_maintenance_list_table(name, rows, wide, want):
    assert [line.split() for line in render.maintenance_table(rows, wide, NOW).splitlines()] == want, name


def test_maintenance_windows_are_those_started_and_not_ended():
    def ue(type_, uid, kind="MAINTENANCE", **kw):
        payload = {"unavailability_id": uid, "machine_ids": ["m2", "m1"]}
        if type_ == "UnavailabilityStarted":
            payload |= {"kind": kind, "start_ms": NOW, "deadline_ms": NOW + 5, "expected_duration_ms": 60_000,
                        "reason": "r", "vacate": False, **kw}
        return new_event(type_, payload, entitlement="free", entity_id=uid, producer="test")

    got = maintenance_windows([ue("UnavailabilityStarted", "a"), ue("UnavailabilityStarted", "f", kind="FAILURE"),
                               ue("UnavailabilityStarted", "b"), ue("UnavailabilityEnded", "a"),
                               ue("UnavailabilityEnded", "never-started")])
    assert got == [{"unavailability_id": "b", "start_ms": NOW, "deadline_ms": NOW + 5, "expected_duration_ms": 60_000,
                    "reason": "r", "machines": ["m1", "m2"]}]
