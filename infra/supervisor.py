"""The supervisor of a local region: one small process that runs Ropewalk's redis-server and control-plane workers
as its children, restarts one that dies (after a capped exponential backoff, never giving up), and records every
exit and restart.

    python -m infra.supervisor --run-dir DIR      # started by `ropewalk up` (``ensure``); stopped by `down` (``stop``)

```
 `ropewalk up` ──writes──► supervisor.programs.json ──(start, or SIGHUP: add the new ones, ──► supervisor
                                                       retire those no longer listed)
                           [{name, argv, env, service}]                                          │ fork/exec each,
                                                                                                 │ own session
   child exits (any cause: kill -9, a crash, exit 0) ◄── waitpid ────────────────────────────────┘
        │  restarts + 1, last exit (code or signal, uptime), one line in supervisor.restarts.jsonl and the log
        ▼
   BACKOFF for Backoff.delay(previous delay, uptime) ──► started again ──► RUNNING
 `ropewalk status` reads supervisor.state.json (each program's state, pid, restarts, last exit)
 `ropewalk down` ──SIGTERM──► workers stopped together (TERM to each process group, KILL after STOP_TIMEOUT_S),
                              then services (redis-server: its append-only file is flushed at its shutdown)
```

**Why a loop of our own** rather than supervisord or circus (both on PyPI): what a control plane needs of its
supervisor is (1) a program that keeps dying is retried for ever with a capped exponential backoff — supervisord
backs off only while a program fails to *start* (exits before ``startsecs``), linearly, and then gives it up for
good (FATAL); one that runs a while and dies is restarted at once, every time; (2) restarts counted and
readable by ``ropewalk status`` — supervisord's ``getProcessInfo`` has no restart count (its log would have to be
parsed), circus needs ZeroMQ and its own daemon protocol; (3) the conventions the rest of ``infra`` already has:
``<name>.pid`` and ``<name>.log`` under the run directory, children in their own sessions (a stop takes their
process group), the hard open-files limit (``raise_open_files_limit``). That is the loop below: fork/exec,
``waitpid``, a pure backoff rule (``Backoff``, table-tested) and an atomically written state file, about 200 lines.

**Its starter's death.** A region a test or an experiment starts must not outlive it (a killed `make test` once
left a supervisor, twelve workers and three brokers running for an hour). Such a starter names itself in
``ROPEWALK_STOP_WITH`` (``infra.process.tie_regions_to_this_process``); the supervisor inherits the variable,
watches those processes (pid and start time, once a second) and, once one is gone, however it ended, stops its
programs as `down` would and exits. A user's `ropewalk up` sets nothing: its region outlives the shell.

**Its own death.** The children live in their own sessions, so a supervisor killed by ``kill -9`` leaves them
running; the next supervisor stops those orphans (only a process whose pid *and* start time match what was
recorded: never a reused pid) before it starts its programs, and ``down`` stops them by their pid files even
with no supervisor left.

**A cold start** (a power loss: every process gone, the programs file still listing the workers, since only `down`
empties it). ``ensure`` starting the supervisor marks the workers it was not given as held (``Program.held``): the
supervisor starts the services (the broker's nodes, redis-server) alone, and a held worker waits until `up` lists it
again (``controlplane.up``, once the broker and Redis answer). Started with them, every worker would fail against a
broker still starting and come back only after its backoff. `ropewalk status` shows a held worker as held.

Files under the run directory::

    supervisor.pid / supervisor.log     the supervisor itself (a ManagedProcess: ``ensure`` starts it)
    supervisor.programs.json            what to run, in start order (``write_programs``; ``retire`` takes programs
                                        out: the supervisor stops them for good)
    supervisor.state.json               per program: state, pid, start time, restarts, last exit; rewritten
                                        atomically on every change
    supervisor.restarts.jsonl           one line per restart: program, old pid, how it ended, uptime, delay
    <name>.pid / <name>.log             each program's pid (while it runs) and output
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from infra.private import PRIVATE_UMASK, open_private, private_umask, write_private
from infra.process import (
    STOP_WITH_VAR, InfraError, ManagedProcess, gone, pid_alive, process_start_time, raise_open_files_limit,
    signal_group, stop_with,
)

log = logging.getLogger("ropewalk.supervisor")

PROGRAMS_FILE = "supervisor.programs.json"
STATE_FILE = "supervisor.state.json"
RESTARTS_FILE = "supervisor.restarts.jsonl"
NAME = "supervisor"
TICK_S = 0.1  # how often exits are reaped and due restarts started
OWNER_CHECK_TICKS = 10  # every so many ticks: are the processes the region stops with (STOP_WITH_VAR) still there?
STOP_TIMEOUT_S = 20.0  # TERM, then KILL after this (the process agent stops its own tasks first: 5 s grace)
START_TIMEOUT_S = 15.0  # `ensure` waits this long for every program to run

# Program states (``supervisor.state.json``; `ropewalk status` shows them).
RUNNING = "RUNNING"
BACKOFF = "BACKOFF"  # exited; started again at ``next_start_ms``
STOPPED = "STOPPED"  # stopped by `down` (or never started)
HELD = "HELD"  # (status only) listed as held: a cold start's worker, waiting until `up` starts it
EXITED = "EXITED"  # (status only) its process is gone and the supervisor has not taken note (yet, or cannot: gone)


@dataclass(frozen=True)
class Backoff:
    """How long a program that exited waits before it is started again. Pure."""

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 10.0  # a worker that keeps dying is tried every 10 s, for ever
    reset_after_s: float = 10.0  # a program that ran this long before it exited starts over at ``initial_s``

    def delay(self, previous_s: float | None, uptime_s: float) -> float:
        """The delay after an exit, given the delay before the last start (None: the first) and how long the
        program ran: ``initial_s`` after a long run, else the previous delay times ``factor``, at most ``max_s``."""
        if previous_s is None or uptime_s >= self.reset_after_s:
            return self.initial_s
        return min(self.max_s, max(self.initial_s, previous_s * self.factor))


DEFAULT_BACKOFF = Backoff()


@dataclass(frozen=True)
class Program:
    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the supervisor's own environment
    service: bool = False  # stopped after the workers (redis-server), started before them
    held: bool = False  # listed, not started: a cold start's worker, until `up` lists it again (``ensure``)

    def to_json(self) -> dict:
        return {"name": self.name, "argv": list(self.argv), "env": dict(self.env), "service": self.service,
                "held": self.held}

    @classmethod
    def from_json(cls, d: Mapping) -> "Program":
        return cls(d["name"], tuple(d["argv"]), dict(d.get("env") or {}), bool(d.get("service")),
                   bool(d.get("held")))


@dataclass
class ProgramState:
    state: str = STOPPED
    pid: int | None = None
    start_time: int | None = None  # /proc start time of ``pid`` (with the pid it names one process)
    started_ms: int | None = None
    restarts: int = 0
    last_exit: dict | None = None  # {"code" | "signal", "at_ms", "uptime_s"}
    delay_s: float | None = None  # the backoff before the last start (None: started once, not restarted yet)
    next_start_ms: int | None = None


def describe_exit(returncode: int) -> dict:
    """A ``Popen.returncode`` as {"code": n} or, killed by a signal (negative), {"signal": "SIGKILL"}."""
    if returncode < 0:
        try:
            return {"signal": signal.Signals(-returncode).name}
        except ValueError:
            return {"signal": str(-returncode)}
    return {"code": returncode}


def exit_text(last_exit: Mapping | None) -> str:
    if not last_exit:
        return ""
    how = f"killed by {last_exit['signal']}" if "signal" in last_exit else f"exit code {last_exit.get('code')}"
    return f"{how} after {last_exit.get('uptime_s', 0):.1f} s"


def now_ms() -> int:
    return int(time.time() * 1000)


class Supervisor:
    def __init__(self, run_dir: Path, backoff: Backoff = DEFAULT_BACKOFF, stop_timeout_s: float = STOP_TIMEOUT_S):
        self.run_dir = Path(run_dir)
        self.backoff = backoff
        self.stop_timeout_s = stop_timeout_s
        self.programs: dict[str, Program] = {}
        self.states: dict[str, ProgramState] = {}
        self.children: dict[int, tuple[str, subprocess.Popen]] = {}  # pid -> (program, its process)
        self._stopping = False
        self._reload = True
        self.held: set[str] = set()  # programs listed as held (``Program.held``) at the last reload
        self._previous = read_state(self.run_dir) or {}  # a former supervisor's record: its programs' start times
        self.retiring: dict[str, float] = {}  # program no longer listed -> when it is killed (monotonic) if still up
        self.owners = stop_with()  # the processes this region stops with (none: it runs until `down`)

    # -- files ---------------------------------------------------------------------------------------------
    def load_programs(self) -> list[Program]:
        try:
            return [Program.from_json(d) for d in json.loads((self.run_dir / PROGRAMS_FILE).read_text())]
        except FileNotFoundError:
            return []

    def save_state(self) -> None:
        doc = {"pid": os.getpid(), "updated_ms": now_ms(),
               "programs": {n: asdict(self.states[n]) for n in self.programs}}
        _write_atomic(self.run_dir / STATE_FILE, json.dumps(doc, indent=1, sort_keys=True))

    def _pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    # -- programs ------------------------------------------------------------------------------------------
    def reload(self) -> None:
        """Take the programs file: programs new to it are started (in file order); running ones are left as they
        are (a second `up` changes nothing that runs); programs no longer in it are retired (``retire``: `up` with
        fewer scheduler shards or allocators)."""
        self._reload = False
        programs = self.load_programs()
        listed = [p for p in programs if not p.held]  # a held one is neither started nor retired
        held = {p.name for p in programs if p.held}
        if held - self.held:
            log.info("held until `up` lists them again (a cold start: the broker and Redis first): %s",
                     ", ".join(sorted(held - self.held)))
        self.held = held
        for name in [n for n in self.programs
                     if n not in {p.name for p in listed} and n not in held and n not in self.retiring]:
            self.retire(name)
        for prog in listed:
            if prog.name in self.programs:  # running (or retiring: listed again, it starts anew once it stopped)
                continue
            self.programs[prog.name] = prog
            from infra.metrics import WORKER_RESTARTS  # noqa: PLC0415 - start-up cost: prometheus_client (~30 ms), only the supervisor's own process serves metrics; `ropewalk down`/`status` import this module

            WORKER_RESTARTS.labels(worker=prog.name)  # a zero series: increase() sees the first restart
            st = self.states[prog.name] = ProgramState()
            _stop_orphan(self._pid_file(prog.name), self._recorded_start_time(prog.name), self.stop_timeout_s)
            self.start(prog.name, st)

    def _recorded_start_time(self, name: str) -> int | None:
        """The start time a former supervisor recorded for ``name``'s pid (guards against a reused pid)."""
        return ((self._previous.get("programs") or {}).get(name) or {}).get("start_time")

    def start(self, name: str, st: ProgramState) -> None:
        prog = self.programs[name]
        env = {**os.environ, **prog.env}
        with open_private(self.run_dir / f"{name}.log") as out:
            try:
                proc = subprocess.Popen(list(prog.argv), stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=raise_open_files_limit, umask=PRIVATE_UMASK, cwd=self.run_dir,
                                        env=env)
            except OSError as exc:  # no such binary: counted as an exit, retried with the backoff
                log.error("%s: cannot start %s: %s", name, prog.argv[0], exc)
                self._exited(name, st, None, {"code": 127, "error": str(exc)})
                return
        self.children[proc.pid] = (name, proc)
        st.state, st.pid, st.started_ms, st.next_start_ms = RUNNING, proc.pid, now_ms(), None
        st.start_time = process_start_time(proc.pid)
        self._pid_file(name).write_text(str(proc.pid))
        log.info("%s: started, pid %d%s", name, proc.pid, f" (restart {st.restarts})" if st.restarts else "")

    def retire(self, name: str) -> None:
        """Stop a program for good (no longer in the programs file): TERM to its group now, KILL after
        ``stop_timeout_s``; once it exited it is forgotten, not restarted. One waiting for its restart goes at once."""
        st = self.states[name]
        if st.pid is None:
            self._forget(name)
            return
        log.info("%s: retired (no longer in %s): stopping pid %d", name, PROGRAMS_FILE, st.pid)
        signal_group(st.pid, signal.SIGTERM)
        self.retiring[name] = time.monotonic() + self.stop_timeout_s

    def _forget(self, name: str) -> None:
        self.programs.pop(name, None)
        self.states.pop(name, None)
        self.retiring.pop(name, None)
        self._pid_file(name).unlink(missing_ok=True)
        log.info("%s: retired", name)

    def kill_overdue(self) -> None:
        """A retired program still running ``stop_timeout_s`` after its TERM: KILL."""
        for name, at in list(self.retiring.items()):
            pid = self.states[name].pid
            if pid is not None and time.monotonic() >= at:
                log.warning("%s: pid %d did not stop in %.0f s: killed", name, pid, self.stop_timeout_s)
                signal_group(pid, signal.SIGKILL)
                self.retiring[name] = float("inf")

    def _exited(self, name: str, st: ProgramState, pid: int | None, how: dict) -> None:
        uptime = (now_ms() - st.started_ms) / 1000 if st.started_ms and pid is not None else 0.0
        st.last_exit = {**how, "at_ms": now_ms(), "uptime_s": round(uptime, 3)}
        st.pid = st.start_time = None
        self._pid_file(name).unlink(missing_ok=True)
        if name in self.retiring:
            self._forget(name)
            self._reload = self._reload or name in {p.name for p in self.load_programs()}  # listed again meanwhile
            return
        if self._stopping:
            st.state = STOPPED
            return
        delay = self.backoff.delay(st.delay_s, uptime)
        st.restarts += 1
        from infra.metrics import WORKER_RESTARTS  # noqa: PLC0415 - start-up cost: prometheus_client (~30 ms), only the supervisor's own process serves metrics; `ropewalk down`/`status` import this module

        WORKER_RESTARTS.labels(worker=name).inc()
        st.state, st.delay_s, st.next_start_ms = BACKOFF, delay, now_ms() + int(delay * 1000)
        record = {"program": name, "pid": pid, **st.last_exit, "restart": st.restarts, "delay_s": delay}
        with open(self.run_dir / RESTARTS_FILE, "a") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
        log.warning("%s: pid %s ended (%s); restart %d in %.1f s", name, pid, exit_text(st.last_exit),
                    st.restarts, delay)

    def reap(self) -> bool:
        """Collect the children that exited; True if any did. (Through each child's ``Popen``: a Popen let go would
        reap its process itself, in its finalizer, before a ``waitpid(-1)`` here could.)"""
        changed = False
        for pid, (name, proc) in list(self.children.items()):
            code = proc.poll()
            if code is not None:
                del self.children[pid]
                self._exited(name, self.states[name], pid, describe_exit(code))
                changed = True
        return changed

    def start_due(self) -> bool:
        started = False
        for name, st in self.states.items():
            if st.state == BACKOFF and st.next_start_ms is not None and st.next_start_ms <= now_ms():
                self.start(name, st)
                started = True
        return started

    # -- running -------------------------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        from infra import metrics  # noqa: PLC0415 - start-up cost: prometheus_client (~30 ms), only the supervisor's own process serves metrics; `ropewalk down`/`status` import this module

        metrics.serve(self.run_dir, NAME, (metrics.WORKER_RESTARTS,))  # ropewalk_worker_restarts_total
        if self.owners:
            log.info("stops with pid %s (%s)", ", ".join(str(p) for p, _ in self.owners), STOP_WITH_VAR)
        ticks = 0
        while not self._stopping:
            ticks += 1
            if self.owners and ticks % OWNER_CHECK_TICKS == 0 and (ended := gone(self.owners)):
                log.warning("pid %s, which this region stops with, is gone: stopping every program",
                            ", ".join(map(str, ended)))
                self._stopping = True  # as `down`: its exits are not restarts
                break
            changed = False
            if self._reload:
                self.reload()
                changed = True
            changed |= self.reap()
            changed |= self.start_due()
            self.kill_overdue()
            if changed:
                self.save_state()
            time.sleep(TICK_S)
        self.stop_all()
        self.save_state()

    def _on_stop(self, *_) -> None:
        self._stopping = True

    def _on_hup(self, *_) -> None:
        self._reload = True

    def stop_all(self) -> None:
        """Workers together, then services: TERM to each process group, KILL after ``stop_timeout_s``."""
        for wave in ([n for n, p in self.programs.items() if not p.service],
                     [n for n, p in self.programs.items() if p.service]):
            pids = {self.states[n].pid: n for n in wave if self.states[n].pid is not None}
            for pid in pids:
                signal_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            while time.monotonic() < deadline and any(p in self.children for p in pids):
                self.reap()
                time.sleep(0.05)
            for pid in pids:
                if pid in self.children:
                    log.warning("%s: pid %d did not stop in %.0f s: killed", pids[pid], pid, self.stop_timeout_s)
                    signal_group(pid, signal.SIGKILL)
            while any(p in self.children for p in pids):
                self.reap()
                time.sleep(0.02)
            for n in wave:
                self.states[n].state = STOPPED
                self._pid_file(n).unlink(missing_ok=True)


def _write_atomic(path: Path, text: str) -> None:
    write_private(path, text)


def _stop_orphan(pid_file: Path, start_time: int | None, timeout_s: float) -> int | None:
    """Stop the process a pid file names if it is still the one recorded (pid and start time; without a recorded
    start time, any live pid: a pid file written by ``ManagedProcess``). Returns its pid if one was stopped."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if not pid_alive(pid) or (start_time is not None and process_start_time(pid) != start_time):
        pid_file.unlink(missing_ok=True)
        return None
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        signal_group(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pid_alive(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.05)
        if not pid_alive(pid):
            break
    pid_file.unlink(missing_ok=True)
    return pid


# ---------------------------------------------------------------------------------------------------------
# The client side: what `ropewalk up`, `status` and `down` do with the supervisor.

def process(run_dir: Path, env: Mapping[str, str] | None = None) -> ManagedProcess:
    """The supervisor as a ManagedProcess (its pid file and log under ``run_dir``). It watches the processes its
    region stops with itself (``STOP_WITH_VAR``, from ``env`` or else this process's environment)."""
    run_dir = Path(run_dir)
    if env is not None and STOP_WITH_VAR not in env and STOP_WITH_VAR in os.environ:
        env = {**env, STOP_WITH_VAR: os.environ[STOP_WITH_VAR]}
    return ManagedProcess(name=NAME, argv=[sys.executable, "-m", "infra.supervisor", "--run-dir", str(run_dir)],
                          port=None, run_dir=run_dir, ready=lambda: _state_pid(run_dir) is not None,
                          start_timeout_s=10.0, env=dict(env) if env is not None else None, watches_owner=True)


def _state_pid(run_dir: Path) -> int | None:
    """The pid of the supervisor that wrote the state file, if it runs."""
    doc = read_state(run_dir)
    pid = doc.get("pid") if doc else None
    return pid if pid and pid_alive(pid) else None


def read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_programs(run_dir: Path, programs: Sequence[Program], *, hold_others: bool = False) -> None:
    """Add ``programs`` to the programs file (a program of the same name is replaced), keeping its order.
    ``hold_others``: the workers listed besides them are held (``Program.held``; a cold start, ``ensure``)."""
    path = Path(run_dir) / PROGRAMS_FILE
    try:
        current = [Program.from_json(d) for d in json.loads(path.read_text())]
    except (OSError, ValueError):
        current = []
    if hold_others:
        current = [replace(p, held=True) if not p.service else p for p in current]
    new = {p.name: p for p in programs}
    merged = [new.pop(p.name, p) for p in current] + list(new.values())
    merged.sort(key=lambda p: not p.service)  # services first: started before the workers
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps([p.to_json() for p in merged], indent=1))


def expected(run_dir: Path) -> list[str]:
    """The programs the supervisor is to run (the programs file), in start order."""
    return [d["name"] for d in _listed(run_dir)]


def _listed(run_dir: Path) -> list[dict]:
    """The programs file's entries, in start order ([] when there is none, or it cannot be read)."""
    try:
        return json.loads((Path(run_dir) / PROGRAMS_FILE).read_text())
    except (OSError, ValueError):
        return []


def ensure(run_dir: Path, programs: Sequence[Program], env: Mapping[str, str] | None = None,
           timeout_s: float = START_TIMEOUT_S) -> dict[str, dict]:
    """Make the supervisor run ``programs`` (besides what it runs already): write them to the programs file, start
    the supervisor or tell the running one (SIGHUP), and wait until each has been started. Returns ``programs()``.

    Starting the supervisor (none runs), the other workers its programs file lists are held (a cold start: the
    module's docstring) until a later ``ensure`` names them."""
    run_dir = Path(run_dir)
    sup = process(run_dir, env)
    pid = sup.pid()
    write_programs(run_dir, programs, hold_others=pid is None)
    if pid is None:
        sup.start()
    else:
        os.kill(pid, signal.SIGHUP)
    names = [p.name for p in programs]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = programs_state(run_dir)
        if all(st.get(n, {}).get("state") in (RUNNING, BACKOFF) and st[n].get("started_ms") for n in names):
            return st
        if sup.pid() is None:
            raise InfraError(f"supervisor: exited: {sup._log_tail()}")
        time.sleep(0.05)
    raise InfraError(f"supervisor: {', '.join(names)} not started after {timeout_s:.0f} s: {sup._log_tail()}")


def retire(run_dir: Path, names: Sequence[str], timeout_s: float = STOP_TIMEOUT_S + 10.0) -> dict[str, bool]:
    """Stop these programs for good: take them out of the programs file, tell the supervisor (SIGHUP), and wait
    until each has stopped (``timeout_s`` in all). Returns {name: stopped}."""
    run_dir = Path(run_dir)
    path = run_dir / PROGRAMS_FILE
    gone = set(names)
    try:
        current = [Program.from_json(d) for d in json.loads(path.read_text())]
    except (OSError, ValueError):
        current = []
    before = {n: s for n, s in programs_state(run_dir).items() if n in gone}
    _write_atomic(path, json.dumps([p.to_json() for p in current if p.name not in gone], indent=1))
    pid = process(run_dir).pid()
    if pid is not None:
        os.kill(pid, signal.SIGHUP)
    else:  # no supervisor to tell: stop what a dead one left running (by pid file and recorded start time)
        for name in names:
            _stop_orphan(run_dir / f"{name}.pid", (before.get(name) or {}).get("start_time"), STOP_TIMEOUT_S)
    deadline = time.monotonic() + timeout_s
    out = {}
    for name in names:
        st = before.get(name) or {}
        victim, start_time = st.get("pid"), st.get("start_time")
        while (victim is not None and pid_alive(victim) and process_start_time(victim) == start_time
               and time.monotonic() < deadline):
            time.sleep(0.05)
        out[name] = victim is None or not pid_alive(victim) or process_start_time(victim) != start_time
    return out


def programs_state(run_dir: Path) -> dict[str, dict]:
    """Every expected program: its state as the supervisor recorded it (EXITED if that process is gone and the
    supervisor has not taken note: it is about to, or it is stopped or gone itself), pid, restarts, last exit, log,
    and whether a supervisor runs (``supervised``). Cheap: files and /proc only."""
    run_dir = Path(run_dir)
    doc = read_state(run_dir) or {}
    alive = doc.get("pid") is not None and pid_alive(doc["pid"])
    out = {}
    for entry in _listed(run_dir):  # one read of the programs file (``ensure`` asks this every 50 ms)
        name = entry["name"]
        st = dict(doc.get("programs", {}).get(name) or asdict(ProgramState()))
        if entry.get("held"):
            st = {**asdict(ProgramState()), "state": HELD}
        pid = st.get("pid")
        running = pid is not None and pid_alive(pid) and process_start_time(pid) == st.get("start_time")
        if st.get("state") == RUNNING and not running:
            st["state"] = EXITED
        st.update(name=name, running=bool(running and st.get("state") == RUNNING), pid=pid if running else None,
                  log=str(run_dir / f"{name}.log"), supervised=alive)
        out[name] = st
    return out


def stop(run_dir: Path, *, timeout_s: float = STOP_TIMEOUT_S + 15.0) -> dict[str, dict]:
    """Stop the supervisor and every program it runs; then any program left by a supervisor that died (by its pid
    file). Forgets the programs (nothing is expected any more). Idempotent. Returns {name: {stopped: bool}}."""
    run_dir = Path(run_dir)
    names = expected(run_dir)
    before = {n: s["pid"] for n, s in programs_state(run_dir).items() if s["pid"]}
    out: dict[str, dict] = {}
    sup = process(run_dir)
    stopped = sup.stop(timeout_s=timeout_s)  # also forgets the pid file of a supervisor that died
    if stopped["stopped"]:
        out[NAME] = stopped
    state = read_state(run_dir) or {}
    for name in reversed(names):  # as they were stopped: workers, then services
        recorded = (state.get("programs", {}).get(name) or {}).get("start_time")
        orphan = _stop_orphan(run_dir / f"{name}.pid", recorded, STOP_TIMEOUT_S)
        out[name] = {"name": name, "stopped": name in before or orphan is not None}
    for f in (PROGRAMS_FILE, STATE_FILE):
        (run_dir / f).unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.supervisor", description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    private_umask()  # its files, and its programs' (they inherit it), are the region owner's alone (infra/private.py)
    Supervisor(Path(args.run_dir)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
