"""A control-plane process run by a test as ``python -m MODULE``: its environment pointed at the session's broker
and Redis, its log in a file, ready when its log says so, stopped with TERM then KILL."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from infra import metrics
from infra.config import PROJECT_ROOT
from infra.process import die_with_parent


def scrape(addr: str) -> dict[str, list]:
    """``{metric family: [samples]}`` of one target's Prometheus text."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
        return {f.name: f.samples for f in text_string_to_metric_families(resp.read().decode())}


def value(families: dict, name: str, **labels) -> float:
    return sum(s.value for f, samples in families.items() for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def timer_ticks(run_dir, program: str, worker: str) -> float | None:
    """The rounds a worker's timers completed (``ropewalk_timer_ticks_total{worker=...}``) from the metrics of the
    program ``program`` under ``run_dir``; None while it serves none."""
    fams = worker_metrics(run_dir, program)
    return value(fams, "ropewalk_timer_ticks_total", worker=worker) if fams else None


def worker_metrics(run_dir, worker: str) -> dict[str, list]:
    """``scrape`` of the worker named ``worker`` (``ROPEWALK_WORKER_NAME``) under ``run_dir``; {} while it serves
    none (not started yet, or gone)."""
    addr = metrics.targets(run_dir).get(worker)
    if addr is None:
        return {}
    try:
        return scrape(addr)
    except OSError:
        return {}


def env_of(cfg, tmp_path) -> dict:
    return {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
            "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions),
            "ROPEWALK_RUN_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}


def start(cfg, tmp_path, module: str, *args: str, name: str, worker: str | None = None) -> subprocess.Popen:
    """``python -m module args`` with its output in ``tmp_path/<name>-<n>.log`` (``proc.log_path``); named
    ``worker`` it serves its metrics as the supervisor's workers do (``worker_metrics(tmp_path, worker)``)."""
    log_path = tmp_path / f"{name}-{time.monotonic_ns()}.log"
    env = {**env_of(cfg, tmp_path), **({"ROPEWALK_WORKER_NAME": worker} if worker else {})}
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=PROJECT_ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent)
    proc.log_path = log_path
    return proc


def wait_ready(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """Read the process's log until its ready line; fail with the log if it dies or takes too long."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = proc.log_path.read_text()
        for line in text.splitlines():
            if " ready" in line:
                return line
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    stop(proc)
    raise AssertionError("process not ready:\n" + "\n".join(proc.log_path.read_text().splitlines()[-40:]))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def run_stopped_on_timeout(argv: list[str], timeout_s: float, terminal: bool = False,
                           **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True)``, but past ``timeout_s`` the command gets SIGTERM
    (a bench or an experiment then stops the region it started: bench/env.py's ``sigterm_as_interrupt``) and the
    test fails saying so. ``subprocess.run``'s own timeout, and pytest's, SIGKILL it and leave that region running
    for the rest of the suite. Keep ``timeout_s`` below the test's pytest timeout.

    ``terminal``: the command's stderr is a terminal (a pseudo-terminal, python's ``pty``), and the result's
    ``stderr`` is what it showed there, escape sequences and all; stdout stays a pipe."""
    if terminal:
        master, slave = os.openpty()
        shown: list[bytes] = []

        def drain() -> None:
            while True:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the command and its children closed the terminal
                    return
                if not chunk:
                    return
                shown.append(chunk)

        reader = threading.Thread(target=drain, daemon=True)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, text=True, preexec_fn=die_with_parent,
                                **kwargs)
        os.close(slave)
        reader.start()
    else:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=die_with_parent, **kwargs)

    def stderr(err: str | None) -> str:
        if not terminal:
            return err or ""
        reader.join(10)
        os.close(master)
        return b"".join(shown).decode("utf-8", errors="replace")

    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"{' '.join(argv[:4])} ... still running after {timeout_s:.0f} s: stopped (SIGTERM); "
                             f"its last output: {stderr(err)[-2000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, stderr(err))


def phase_drawn(shown: str, phase: str) -> bool:
    """Whether what a terminal showed (``run_stopped_on_timeout(..., terminal=True).stderr``) has ``phase`` as a line
    of rich's progress display ticked once over (console.Progress): a ✓, then on the same line, before any other
    line's spinner or tick, the phase's description."""
    return bool(re.search(rf"✓[^\r\n✓\u2800-\u28ff]*? {re.escape(phase)}", shown))
