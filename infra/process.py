"""A daemon process that Ropewalk starts and stops: pid file and log under the run directory,
idempotent start that waits until the process accepts connections, and stop that leaves nothing behind."""
from __future__ import annotations

import ctypes
import logging
import os
import random
import resource
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from infra.private import PRIVATE_UMASK, open_private, write_private


class InfraError(RuntimeError):
    """A start/stop problem with a one-line reason a user can act on."""


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# Ports handed out for services a test or a bench starts: below Linux's ephemeral range (32768-60999 by
# default), so an outgoing connection of some client cannot take a port between our check and the service's bind
# (a broker lost its controller port that way) -- and above the fixed ports of a developer's own region.
SERVICE_PORTS = range(20000, 32000)


def free_ports(n: int = 1, *, seed: int | None = None) -> list[int]:
    """``n`` distinct ports no process listens on, picked at random from ``SERVICE_PORTS``."""
    rng = random.Random(seed)
    ports: list[int] = []
    while len(ports) < n:
        port = rng.choice(SERVICE_PORTS)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if not port_open(port):
            ports.append(port)
    return ports


def free_port() -> int:
    return free_ports(1)[0]


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive ports no process listens on, in ``SERVICE_PORTS``: an embedded cluster of k
    broker nodes takes 2k of them (``ROPEWALK_BROKER_PORT`` the first, ``ROPEWALK_CONTROLLER_PORT`` the second;
    infra/config.broker_nodes)."""
    rng = random.Random()
    while True:
        base = rng.randrange(SERVICE_PORTS.start, SERVICE_PORTS.stop - n)
        if all(_bindable(p) and not port_open(p) for p in range(base, base + n)):
            return base


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# A Kafka broker holds one open file per partition (its active segment; measured: 96 + 1 per partition), so a
# soft limit of 1,024 or 4,096 ends a broker with a few thousand partitions ("Too many open files"). Children
# get the hard limit, up to this.
WANTED_OPEN_FILES = 1 << 20


def raise_open_files_limit() -> None:
    """In a child before exec: the soft limit on open files raised to the hard limit (capped)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        pass


FAILPOINT_EXIT = 70  # the exit code of a process that stopped at a failpoint


def failpoint(env: str, name: str, log: logging.Logger) -> None:
    """Exit at once (``os._exit``: nothing flushed or closed, as a SIGKILL would leave it) if the environment variable
    ``env`` names this point: tests of a crash between two steps (the scheduler's moves, the agent's pending stops)."""
    if os.environ.get(env) == name:
        log.warning("failpoint %s: exiting", name)
        os._exit(FAILPOINT_EXIT)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own exited child not yet reaped) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if gone or a
    zombie. With the pid it names one process: a pid reused by another process has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            rest = fh.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    if rest[0] == "Z":
        return None
    return int(rest[19])


def _status_uids(pid: str) -> tuple[set[int], bool] | None:
    """(real, effective, saved and file-system uids, a zombie) of ``/proc/<pid>``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            text = fh.read()
    except OSError:
        return None
    uids: set[int] = set()
    zombie = False
    for line in text.splitlines():
        if line.startswith("Uid:"):
            uids = {int(x) for x in line.split()[1:]}
        elif line.startswith("State:"):
            zombie = line.split()[1] == "Z"
    return uids, zombie


def uids_in_use() -> set[int]:
    """Every uid some process of this machine runs as (any of its real, effective, saved, file-system uids)."""
    out: set[int] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (st := _status_uids(pid)) is not None:
            out |= st[0]
    return out


def processes_of(uid: int) -> list[int]:
    """The live (not zombie) processes running as ``uid`` (any of their uids)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (st := _status_uids(pid)) is not None and uid in st[0] and not st[1]:
            out.append(int(pid))
    return out


# A region that must not outlive the process that started it (a test, an experiment): this variable names that
# process, and any before it, as "<pid>:<start time>" separated by commas. The supervisor watches them and takes its
# region down once one is gone, however it ended (SIGKILL included); a ManagedProcess started by one of them directly
# dies with it (``die_with_parent``). Unset (a user's `ropewalk up`): the region outlives the shell, as it should.
STOP_WITH_VAR = "ROPEWALK_STOP_WITH"
PR_SET_PDEATHSIG = 1  # prctl(2)


def stop_with(env: Mapping[str, str] | None = None) -> list[tuple[int, int]]:
    """The processes a region started with ``env`` (default: this process's environment) dies with: (pid, start
    time). A malformed entry is ignored (a region with nothing to watch lives on, as a user's does)."""
    out = []
    for item in (os.environ if env is None else env).get(STOP_WITH_VAR, "").split(","):
        pid, _, start = item.strip().partition(":")
        if pid.isdigit() and start.isdigit():
            out.append((int(pid), int(start)))
    return out


def tie_regions_to_this_process() -> None:
    """From now on, a region this process (or any process it starts) starts stops when this process ends: this
    process is added to ``STOP_WITH_VAR`` in its environment (children inherit it)."""
    me = (os.getpid(), process_start_time(os.getpid()) or 0)
    if me in stop_with():
        return
    os.environ[STOP_WITH_VAR] = ",".join([*(f"{p}:{t}" for p, t in stop_with()), f"{me[0]}:{me[1]}"])


def gone(owners: list[tuple[int, int]]) -> list[int]:
    """The pids of ``owners`` that no longer run (a pid now another process's, by its start time, counts as gone)."""
    return [pid for pid, start in owners if process_start_time(pid) != start]


def die_with_parent() -> None:
    """In a child before exec: SIGKILL when the thread that started it ends (Linux ``PR_SET_PDEATHSIG``; ``Popen``
    from the main thread: when the process ends, however). If the parent is already gone, exit at once."""

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the prctl: no signal will come
        os._exit(1)


def _tied_preexec() -> Callable[[], None]:
    """The ``preexec_fn`` of a ManagedProcess: the open-files limit raised, and ``die_with_parent`` if this process
    is one its region is to stop with (and starts it from its main thread: a death signal follows the thread)."""
    if (os.getpid() not in {pid for pid, _ in stop_with()}
            or threading.current_thread() is not threading.main_thread()):
        return raise_open_files_limit

    def preexec() -> None:
        raise_open_files_limit()
        die_with_parent()

    return preexec


def signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group ``pid`` leads (a process started in its own session: its children too); to the
    process alone if the group cannot be signalled; nothing if it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class ManagedProcess:
    name: str  # "broker", "redis", "allocator", ...
    argv: list[str]
    port: int | None  # None for processes that serve no port (control-plane workers)
    run_dir: Path
    ready: Callable[[], bool]  # True once the service answers its protocol, not just TCP
    start_timeout_s: float = 20.0
    env: dict[str, str] | None = None  # the child's environment (default: inherited)
    extra_ports: tuple[tuple[int, str], ...] = ()  # other (port, variable that sets it) it listens on
    prepare: Callable[[], None] | None = None  # run before each start (e.g. write config, format data)
    port_var: str | None = None  # the variable that sets ``port`` (default ROPEWALK_<NAME>_PORT)
    # it watches the processes of STOP_WITH_VAR itself (the supervisor: its children stop with it) rather than die
    # with the process that started it
    watches_owner: bool = False

    @property
    def pid_file(self) -> Path:
        return self.run_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def status(self) -> dict:
        pid = self.pid()
        return {
            "name": self.name,
            "running": pid is not None,
            "pid": pid,
            "port": self.port,
            "accepting": self.port is not None and port_open(self.port),
            "log": str(self.log_file),
        }

    def check_can_start(self) -> None:
        """Raise InfraError (one line) if `start` would fail at once: the port is taken by a process that is
        not ours, or the binary is missing. A no-op when the process already runs."""
        if self.pid() is not None:
            return
        for port, var in ((self.port, self.port_var or f"ROPEWALK_{self.name.upper()}_PORT"),
                          *self.extra_ports):
            if port is not None and port_open(port):
                raise InfraError(f"{self.name}: port {port} is taken by another process; stop it or set {var} "
                                 f"to a free port")
        if not Path(self.argv[0]).exists():
            raise InfraError(f"{self.name}: binary {self.argv[0]} is missing")

    def start(self) -> dict:
        """Start the process unless it already runs; wait until it is ready. Idempotent."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        pid = self.pid()
        if pid is not None:
            self._wait_ready(pid)
            return {**self.status(), "started": False}
        self.check_can_start()
        if self.prepare is not None:
            self.prepare()
        with open_private(self.log_file) as log:
            proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # survives the CLI that started it; not killed by its ^C
                # ... unless a test or an experiment started it (STOP_WITH_VAR): then not that process's death
                preexec_fn=raise_open_files_limit if self.watches_owner else _tied_preexec(),
                umask=PRIVATE_UMASK,  # what it writes under the run directory is its owner's alone (infra/private.py)
                cwd=self.run_dir,
                env=self.env,
            )
        write_private(self.pid_file, str(proc.pid))
        self._wait_ready(proc.pid, proc)
        return {**self.status(), "started": True}

    def _wait_ready(self, pid: int, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise InfraError(
                    f"{self.name}: exited with code {proc.returncode} at start: {self._log_tail()}"
                )
            if proc is None and not pid_alive(pid):
                raise InfraError(f"{self.name}: process {pid} died: {self._log_tail()}")
            if (self.port is None or port_open(self.port)) and self.ready():
                return
            time.sleep(0.1)
        where = f" on port {self.port}" if self.port is not None else ""
        raise InfraError(
            f"{self.name}: not ready{where} after {self.start_timeout_s:.0f}s: {self._log_tail()}"
        )

    def stop(self, timeout_s: float = 10.0) -> dict:
        """Stop the process (TERM, then KILL) and remove its pid file. Idempotent."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return {"name": self.name, "stopped": False}
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)  # its own session: take any children with it
            except ProcessLookupError:
                break
            except PermissionError:
                os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and pid_alive(pid):
                _reap(pid)
                time.sleep(0.05)
            if not pid_alive(pid):
                break
        _reap(pid)
        if pid_alive(pid):
            raise InfraError(f"{self.name}: process {pid} did not stop")
        self.pid_file.unlink(missing_ok=True)
        return {"name": self.name, "stopped": True, "pid": pid}

    def _log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_file.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
