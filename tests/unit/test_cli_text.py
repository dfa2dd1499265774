"""The CLI's human text (issue 13): tables with header rows, times a person reads, relative times, endpoints
remembered from the last `up`. Pure functions and a file in a temporary run directory."""
import os

import pytest

from infra import config
from processors.frontend import cli

NOW = 1_795_440_810_008


@pytest.mark.parametrize("ms, text", [
    (NOW, "2026-11-23 13:33:30Z (now)"),
    (NOW + 600_000, "2026-11-23 13:43:30Z (in 10m)"),
    (NOW - 45_000, "2026-11-23 13:32:45Z (45s ago)"),
    (NOW - 3 * 86_400_000, "2026-11-20 13:33:30Z (3d ago)"),
    (None, "-"),
])
def test_human_time(ms, text):
    assert cli.human_time(ms, NOW) == text


def test_table_pads_columns_under_a_header_row():
    assert cli._table(["A", "LONGER"], [["xyz", 1], ["q", 22]], "none") == "A    LONGER\nxyz  1\nq    22"
    assert cli._table(["A"], [], "nothing here") == "nothing here"


@pytest.mark.parametrize("value, ago_ms", [("10m", 600_000), ("1h", 3_600_000), ("2d", 172_800_000), ("90s", 90_000)])
def test_since_takes_a_duration_ago(value, ago_ms, monkeypatch):
    monkeypatch.setattr(cli.time, "time", lambda: NOW / 1000)
    assert cli._parse_time(value) == NOW - ago_ms
    assert cli._parse_time("1795440810008") == NOW
    with pytest.raises(cli.CliError, match="10m"):
        cli._parse_time("yesterday")


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
