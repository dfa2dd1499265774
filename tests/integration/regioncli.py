"""A local region driven through the `ropewalk` CLI, as a user drives it: its own ports and run directory,
faust group timing lowered. Shared by the end-to-end tests (not a test module: no test_ prefix)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from infra.process import free_ports

ROOT = Path(__file__).resolve().parents[2]


def wait_for(pred, what: str, timeout_s: float = 15.0, poll_s: float = 0.05, detail=lambda: ""):
    """What ``pred()`` returns once it is truthy; AssertionError after ``timeout_s`` (with ``detail()``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}{detail()}")


class RegionCli:
    def __init__(self, run_dir: Path, **extra_env: str):
        self.run_dir = Path(run_dir)
        ports = free_ports(4)
        self.env = {**os.environ, "ROPEWALK_BROKER_PORT": str(ports[0]), "ROPEWALK_REDIS_PORT": str(ports[1]),
                    "ROPEWALK_CONTROLLER_PORT": str(ports[2]), "ROPEWALK_API_PORT": str(ports[3]),
                    "ROPEWALK_RUN_DIR": str(self.run_dir),
                    "ROPEWALK_PARTITIONS": "4", "ROPEWALK_FAUST_SESSION_TIMEOUT": "2",
                    "ROPEWALK_FAUST_HEARTBEAT_INTERVAL": "0.5", "ROPEWALK_FAUST_REBALANCE_TIMEOUT": "2", **extra_env}
        # Its own region: its own credentials (under the run directory), and the CLI through the region's API as a
        # user drives it (the test session's environment points elsewhere and at the log directly).
        for k in ("ROPEWALK_BOOTSTRAP_SERVERS", "ROPEWALK_REDIS_URL", "ROPEWALK_TOPIC_PREFIX", "ROPEWALK_SECRETS_DIR",
                  "ROPEWALK_DIRECT", "ROPEWALK_API_URL", "ROPEWALK_TOKEN"):
            self.env.pop(k, None)

    def __call__(self, *args: str, timeout_s: float = 180, input_: str | None = None) -> subprocess.CompletedProcess:
        return self.run_with(self.env, *args, timeout_s=timeout_s, input_=input_)

    def run_with(self, env: dict, *args: str, timeout_s: float = 180,
                 input_: str | None = None) -> subprocess.CompletedProcess:
        """`ropewalk ARGS` with another environment (another user's token, no credentials, ...)."""
        return subprocess.run([sys.executable, "-m", "processors.frontend.cli", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout_s, input=input_)

    def json(self, *args: str):
        """A read command's --json document (None when the command fails)."""
        out = self(*args, "--json")
        return json.loads(out.stdout) if out.returncode == 0 else None

    def ok(self, *args: str) -> str:
        out = self(*args)
        assert out.returncode == 0, f"ropewalk {' '.join(args)}: {out.stderr}"
        return out.stdout

    def status(self, job: str):
        return self.json("job", "status", job)

    def replay(self) -> list[dict]:
        out = self("replay", "--json")
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]

    def wait_for(self, pred, what: str, timeout_s: float = 60):
        logs = lambda: {p.name: p.read_text()[-1500:] for p in self.run_dir.glob("*.log")}  # noqa: E731
        return wait_for(pred, what, timeout_s, 0.5, lambda: f"; logs: {json.dumps(logs(), indent=1)}")

    def running(self, job: str, n: int):
        """The job's status once n tasks are RUNNING (else None)."""
        view = self.status(job)
        return view if view and sum(t["state"] == "RUNNING" for t in view["tasks"]) == n else None
