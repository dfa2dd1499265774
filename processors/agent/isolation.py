"""How the process agent keeps its tasks apart from one another and from the region (issue 27).

**A uid of its own.** An agent running as root runs each task as a uid leased for it from a range
(``--task-uids``, ``ROPEWALK_TASK_UIDS``, default ``DEFAULT_UIDS``), as systemd's ``DynamicUser`` does: no name in
``/etc/passwd``, its gid the same number, no supplementary groups. The uid is the task's while the agent runs it
(across its restarts in place and the agent's own restarts: ``agent-state.json`` keeps it), and handed back when the
task is stopped or failed for good: then every process left with that uid is killed, and its directory is given to
root (kept, unreadable, for the task's next run under another uid). Two tasks never share a uid, so neither can
read the other's files, write into its directory, or signal its processes (the kernel refuses a signal to another
uid). A uid is leased **host-wide**, by a file ``<leases>/<uid>`` created exclusively (``--task-uid-leases``,
``ROPEWALK_TASK_UID_LEASES``, default ``/run/ropewalk/task-uids``: gone at a reboot, like the processes), so
several agents on one machine (regions side by side, tests) never hand out the same uid. A uid named in
``/etc/passwd`` or ``/etc/group``, or any process runs as, is skipped. A lease whose owner (an agent's state file)
no longer lists it, and no process runs as, is stale and taken over.

**A directory only it can open.** ``<work>/tasks/<task>/``, mode 0700, owned by the task's uid (what is in it
chowned from the former uid of the range when the uid changes); the directories above it are passages (0711:
entered, not listed), and everything else under the run directory is 0700/0600 (``infra/private.py``). Its stdout
and stderr go to files the agent opens (0600, root's) and hands over as descriptors.

**A sandbox** (bubblewrap, Debian's ``bubblewrap``: ``--task-sandbox``, ``ROPEWALK_TASK_SANDBOX``: ``auto`` (the
default: used if it runs here), ``bwrap`` (required: the agent refuses to start without it) or ``none``). The agent
runs ``bwrap`` as root (no user namespace needed) with a mount namespace — the root file system read-only, the run
directory, the secrets and the agent's work directory each hidden under an empty tmpfs but for the passages to the
task's own directory, bound writable; private ``/tmp``, ``/var/tmp`` and ``/dev/shm``; a minimal ``/dev`` — a PID
namespace (its ``/proc`` shows its own processes alone) and an IPC namespace; ``setpriv`` then drops to the task's
uid with no capabilities (and bwrap sets no-new-privileges) before the task's command runs. The network is shared
(a task is a service). In the sandbox a task killed by signal N exits ``128 + N`` (bwrap's init reports it as a
shell would), not ``-N``. ``sandbox_argv`` builds that command line (pure; ``tests/unit/test_isolation_parts.py``).
What it costs at start: ``bench/task_start.py`` (README, "Tasks isolated from one another").

**Stopping one** (``signal``): with a uid of its own, a SIGTERM goes to the processes of that uid (never to the
sandbox's own processes, root's: bwrap's monitor dies of a SIGTERM, which would cut the task's grace short), a
SIGKILL to those and to the process group. Without root (an agent run by a user), tasks run as the agent's user,
unsandboxed, signalled by their process group, as before.

**Its environment** (``task_env``): ``PATH``, ``LANG``, ``LC_ALL``, ``LC_CTYPE`` and ``TZ`` of the agent's, ``HOME``
its directory, and the command's env on top; nothing else of the agent's (its ``ROPEWALK_*`` variables, a token an
operator exported).
"""
from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.private import PASSAGE_MODE, PRIVATE_DIR_MODE, make_dir
from infra.process import processes_of, signal_group, uids_in_use

UIDS_ENV = "ROPEWALK_TASK_UIDS"
DEFAULT_UIDS = "70000-79999"  # between Debian's and systemd's named ranges and the usual /etc/subuid ranges (100000+)
LEASES_ENV = "ROPEWALK_TASK_UID_LEASES"
DEFAULT_LEASES = "/run/ropewalk/task-uids"
SANDBOX_ENV = "ROPEWALK_TASK_SANDBOX"
AUTO, BWRAP, NONE = "auto", "bwrap", "none"
SANDBOXES = (AUTO, BWRAP, NONE)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KEPT_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")  # what a task gets of the agent's environment
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # each a fresh tmpfs in the sandbox; without it, cleaned at release
TASK_DIR_MODE = PRIVATE_DIR_MODE
KILL_TIMEOUT_S = 5.0
OWNER_UIDS_KEY = "uids"  # the key of an owner's state file that maps its tasks to their uids (process.py saves it)


class IsolationError(RuntimeError):
    """Tasks cannot be isolated as asked (no uid left, the sandbox required and not running), with what to do."""


@dataclass(frozen=True)
class UidRange:
    first: int
    last: int

    @classmethod
    def parse(cls, text: str) -> "UidRange":
        """``FIRST-LAST`` (inclusive). ValueError naming what is wrong."""
        first, sep, last = text.partition("-")
        try:
            r = cls(int(first), int(last)) if sep else None
        except ValueError:
            r = None
        if r is None:
            raise ValueError(f"task uids: expected FIRST-LAST (e.g. {DEFAULT_UIDS}), got {text!r}")
        if not 0 < r.first <= r.last < 2**32 - 1:
            raise ValueError(f"task uids: expected 0 < FIRST <= LAST < 4294967295, got {text!r}")
        return r

    def __iter__(self):
        return iter(range(self.first, self.last + 1))

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


# -- pure ------------------------------------------------------------------------------------------------------

def task_env(command_env: Mapping[str, str], home: Path | str, agent_env: Mapping[str, str]) -> dict[str, str]:
    """A task's environment: ``KEPT_ENV`` of the agent's (``PATH`` by default ``DEFAULT_PATH``), ``HOME`` its
    directory, the command's env on top. Pure."""
    env = {k: agent_env[k] for k in KEPT_ENV if k in agent_env}
    env.setdefault("PATH", DEFAULT_PATH)
    env["HOME"] = str(home)
    env.update(command_env)
    return env


def outermost(paths: Iterable[Path]) -> list[Path]:
    """``paths`` without those inside another of them (and without repeats), sorted. Pure."""
    ps = sorted(set(Path(p) for p in paths), key=lambda p: len(p.parts))
    out: list[Path] = []
    for p in ps:
        if not any(p == q or q in p.parents for q in out):
            out.append(p)
    return sorted(out)


def sandbox_argv(argv: Sequence[str], *, task_dir: Path, hidden: Iterable[Path], uid: int, gid: int,
                 bwrap: str = "bwrap", setpriv: str = "setpriv") -> list[str]:
    """The command line that runs ``argv`` in the sandbox (module doc): paths absolute and resolved. Pure."""
    task_dir = Path(task_dir)
    roots = outermost(hidden)
    args = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for d in SHARED_TMP:
        args += ["--perms", "1777", "--tmpfs", d]
    for root in roots:
        args += ["--perms", f"{PASSAGE_MODE:04o}", "--tmpfs", str(root)]
    above = next((r for r in roots if r in task_dir.parents), None)
    if above is not None:  # the passages from the hidden directory down to the task's
        for p in reversed(task_dir.parents[:len(task_dir.parents) - len(above.parents) - 1]):
            args += ["--perms", f"{PASSAGE_MODE:04o}", "--dir", str(p)]
    args += ["--bind", str(task_dir), str(task_dir), "--chdir", str(task_dir), "--unshare-pid", "--unshare-ipc",
             "--", setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
             "--bounding-set=-all", "--", *argv]
    return args


# -- processes of a uid (which processes run as it: infra/process.py) ---------------------------------------

def signal_uid(uid: int, sig: int) -> int:
    """``sig`` to every process of ``uid``; how many were signalled."""
    n = 0
    for pid in processes_of(uid):
        try:
            os.kill(pid, sig)
            n += 1
        except ProcessLookupError:
            pass
    return n


def kill_uid(uid: int, timeout_s: float = KILL_TIMEOUT_S) -> bool:
    """SIGKILL every process of ``uid`` until none is left (one forking meanwhile is killed in the next round);
    False if some still run after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while signal_uid(uid, signal.SIGKILL):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _named(uid: int) -> bool:
    """A user or a group of this number exists (``/etc/passwd``, ``/etc/group``, or NSS)."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


# -- host-wide leases ------------------------------------------------------------------------------------------

@dataclass
class Leases:
    """The uids of ``uids`` leased to tasks on this machine: one file per uid in ``directory`` (JSON: the owner's
    state file, the task, the agent's pid, when). ``owner``: this agent's state file, whose ``OWNER_UIDS_KEY``
    lists the uids it holds."""

    directory: Path
    uids: UidRange
    owner: Path

    def path(self, uid: int) -> Path:
        return self.directory / str(uid)

    def read(self, uid: int) -> dict | None:
        try:
            doc = json.loads(self.path(uid).read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def mine(self) -> dict[int, str]:
        """uid -> task of the leases this agent holds (its ``owner`` file named in them)."""
        out = {}
        for f in self.directory.iterdir() if self.directory.is_dir() else ():
            if f.name.isdigit() and int(f.name) in self.uids:
                doc = self.read(int(f.name))
                if doc is not None and doc.get("owner") == str(self.owner):
                    out[int(f.name)] = doc.get("task", "")
        return out

    def holds(self, uid: int) -> bool:
        doc = self.read(uid)
        return doc is not None and doc.get("owner") == str(self.owner)

    def acquire(self, task_id: str) -> int:
        """A uid of the range leased to ``task_id``: the first one no lease, user, group or process has (a stale
        lease is taken over)."""
        make_dir(self.directory)
        busy = uids_in_use()
        for uid in self.uids:
            if uid in busy or _named(uid):
                continue
            if self._claim(uid, task_id):
                return uid
            if self._stale(uid, busy):
                self.path(uid).unlink(missing_ok=True)
                if self._claim(uid, task_id):
                    return uid
        raise IsolationError(f"no uid left for task {task_id} in {self.uids} ({len(self.uids)} uids, leased in "
                             f"{self.directory}): widen {UIDS_ENV} (--task-uids)")

    def claim(self, uid: int, task_id: str) -> bool:
        """Lease ``uid`` again (its file gone: a reboot emptied /run) if nothing else has it."""
        if self.holds(uid):
            return True
        if uid in uids_in_use() or _named(uid):
            return False
        make_dir(self.directory)
        return self._claim(uid, task_id)

    def _claim(self, uid: int, task_id: str) -> bool:
        doc = {"owner": str(self.owner), "task": task_id, "pid": os.getpid(), "at_ms": int(time.time() * 1000)}
        try:
            fd = os.open(self.path(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(doc))
        return True

    def _stale(self, uid: int, busy: set[int]) -> bool:
        """No process runs as ``uid`` and the agent named in its lease does not hold it (its state file gone, or not
        listing it). A lease being written (empty for an instant) counts as held."""
        if uid in busy:
            return False
        doc = self.read(uid)
        if doc is None:
            try:
                return time.time() - self.path(uid).stat().st_mtime > 60  # an unreadable lease, not one being written
            except OSError:
                return True
        if doc.get("owner") == str(self.owner):
            return False  # ours: handed back by ``release`` or ``reconcile``, never taken over
        try:
            held = json.loads(Path(doc["owner"]).read_text()).get(OWNER_UIDS_KEY) or {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return True
        return uid not in set(held.values()) if isinstance(held, dict) else True

    def release(self, uid: int) -> None:
        self.path(uid).unlink(missing_ok=True)


# -- the agent's side ------------------------------------------------------------------------------------------

def own(task_dir: Path, uid: int, uids: UidRange) -> None:
    """``task_dir`` made (0700) and given to ``uid``: what is in it and belongs to another uid of the range (the task's
    former one) too. Entries of other owners are left as they are (a hard link to someone else's file is never
    given away); symbolic links are changed themselves, never followed."""
    task_dir.mkdir(parents=True, exist_ok=True, mode=TASK_DIR_MODE)
    st = os.lstat(task_dir)
    if st.st_uid != uid:
        for root, dirs, files in os.walk(task_dir):
            for name in dirs + files:
                p = os.path.join(root, name)
                try:
                    if os.lstat(p).st_uid in uids:
                        os.lchown(p, uid, uid)
                except OSError:
                    pass
        os.chown(task_dir, uid, uid)
    os.chmod(task_dir, TASK_DIR_MODE)


def disown(task_dir: Path) -> None:
    """``task_dir`` given back to root, 0700: nobody but root opens it until its task runs again."""
    try:
        os.chown(task_dir, 0, 0)
        os.chmod(task_dir, TASK_DIR_MODE)
    except FileNotFoundError:
        pass


def remove_leftovers(uid: int, places: Sequence[str] = SHARED_TMP) -> list[str]:
    """What ``uid`` left at the top of the shared temporary directories (unsandboxed tasks), removed: the next task
    given this uid must not find it. Returns the paths removed."""
    gone = []
    for d in places:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
                gone.append(e.path)
            except OSError:
                pass
    return gone


def probe_sandbox(bwrap: str, setpriv: str, scratch: Path) -> str | None:
    """None if the sandbox runs here (a ``true`` run in it as ``nobody``), else why not, in one line."""
    nobody = _nobody()
    scratch.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="probe-", dir=scratch))
    try:
        argv = sandbox_argv(["true"], task_dir=d, hidden=[scratch], uid=nobody, gid=nobody, bwrap=bwrap,
                            setpriv=setpriv)
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{bwrap} did not run: {exc}"
        if out.returncode != 0:
            return f"{bwrap} failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[:300]}"
        return None
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


@dataclass
class Isolation:
    """What the process agent does to keep its tasks apart (module doc), as decided at its start (``start``)."""

    leases: Leases | None  # None: the agent is not root; tasks run as its own user
    sandbox: str = NONE  # BWRAP or NONE
    hidden: tuple[Path, ...] = ()  # what the sandbox hides (the run directory, the secrets, the agent's work dir)
    why_not: str = ""  # why there is no sandbox
    bwrap: str = "bwrap"
    setpriv: str = "setpriv"

    @classmethod
    def start(cls, *, want: str, uids: UidRange, leases_dir: Path, owner: Path, hidden: Iterable[Path],
              scratch: Path) -> "Isolation":
        """Decide how tasks run here: as root, a uid per task, in the sandbox if ``want`` allows and it runs
        (``BWRAP``: IsolationError when it does not); as another user, as that user without a sandbox."""
        if want not in SANDBOXES:
            raise IsolationError(f"task sandbox: expected one of {', '.join(SANDBOXES)}, got {want!r}")
        hidden = tuple(Path(os.path.realpath(p)) for p in hidden)
        if os.geteuid() != 0:
            why = "the agent does not run as root: tasks run as its own user, without a sandbox"
            if want == BWRAP:
                raise IsolationError(f"task sandbox bwrap required, but {why}")
            return cls(None, NONE, hidden, why)
        leases = Leases(Path(leases_dir), uids, Path(os.path.realpath(owner)))
        if want == NONE:
            return cls(leases, NONE, hidden, f"{SANDBOX_ENV}=none")
        bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
        why = ("bubblewrap is not installed (`apt-get install bubblewrap`; infra/bootstrap.sh does as root)"
               if bwrap is None else "setpriv (util-linux) is not installed" if setpriv is None
               else probe_sandbox(bwrap, setpriv, scratch))
        if why:
            if want == BWRAP:
                raise IsolationError(f"task sandbox bwrap required, but {why}")
            return cls(leases, NONE, hidden, why)
        return cls(leases, BWRAP, hidden, "", bwrap, setpriv)

    def describe(self) -> str:
        if self.leases is None:
            return self.why_not
        each = f"each as a uid of its own from {self.leases.uids} (leases in {self.leases.directory})"
        return f"{each}, in a bubblewrap sandbox" if self.sandbox == BWRAP else f"{each}, without a sandbox: {self.why_not}"

    # -- a task's uid ----------------------------------------------------------------------------------------
    def prepare(self, task_id: str, task_dir: Path, uid: int | None) -> int | None:
        """The uid ``task_id`` runs as (its own ``uid`` while it still holds it, else a new lease), and its
        directory made and given to it; None when the agent is not root (the directory is the agent's)."""
        task_dir = Path(task_dir)
        if self.leases is None:
            task_dir.mkdir(parents=True, exist_ok=True, mode=TASK_DIR_MODE)
            return None
        if uid is None or not self.leases.claim(uid, task_id):
            uid = self.leases.acquire(task_id)
        own(task_dir, uid, self.leases.uids)
        return uid

    def command(self, argv: Sequence[str], task_dir: Path, uid: int | None) -> tuple[list[str], dict]:
        """(argv, extra ``subprocess.Popen`` keywords) that run ``argv`` as ``uid`` (the sandbox's, or a switch)."""
        if uid is None:
            return list(argv), {}
        if self.sandbox == BWRAP:
            hidden = [h for h in self.hidden if h.is_dir()]  # (a secrets directory may not exist: nothing to hide)
            return sandbox_argv(argv, task_dir=Path(os.path.realpath(task_dir)), hidden=hidden, uid=uid, gid=uid,
                                bwrap=self.bwrap, setpriv=self.setpriv), {}
        return list(argv), {"user": uid, "group": uid, "extra_groups": []}

    def signal(self, pid: int, uid: int | None, sig: int) -> None:
        """``sig`` to a task: to its uid's processes when it has one (SIGKILL: to its process group too); else to its
        process group."""
        if uid is None:
            signal_group(pid, sig)
            return
        if sig == signal.SIGKILL:
            kill_uid(uid)
            signal_group(pid, sig)
        else:
            signal_uid(uid, sig)

    def release(self, uid: int, task_dir: Path) -> list[str]:
        """``uid`` handed back: its processes killed, what it left in the shared temporary directories removed
        (no sandbox: returned), its task's directory given to root, its lease gone."""
        kill_uid(uid)
        left = remove_leftovers(uid) if self.sandbox == NONE else []
        disown(Path(task_dir))
        if self.leases is not None:
            self.leases.release(uid)
        return left

    def reconcile(self, held: Mapping[str, int]) -> list[int]:
        """At the agent's start: the leases it holds that its state does not list (a crash between leasing and
        saving, or after the task finished) handed back — their processes killed — and those its state lists
        claimed again if their files are gone (a reboot). Returns the uids handed back."""
        if self.leases is None:
            return []
        listed = set(held.values())
        gone = [uid for uid in self.leases.mine() if uid not in listed]
        for uid in gone:
            kill_uid(uid)
            self.leases.release(uid)
        for task_id, uid in held.items():
            self.leases.claim(uid, task_id)
        return gone
