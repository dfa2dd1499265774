"""Who may read what under the run directory: nobody but its owner (the user that runs the region), except the
passages to the process agent's task directories (issue 27).

A task of the process agent runs as a uid of its own (processors/agent/isolation.py) and must not read the broker's
segments, Redis's append-only file, the agents' state files and logs, the secrets, or another task's files. So the
run directory holds nothing another user can open:

    <run dir>/                 0711  (``PASSAGE_MODE``: entered, never listed)
      agents/                  0711
        <machine>/             0711  the process agent's work directory
          tasks/               0711
            <task>/            0700  owned by the task's own uid (the one directory it may open)
          logs/, agent-state.json, host-profile.json     0700 / 0600
        simulated.json         0600
      kafka/ redis/ faust/ metrics/ secrets/ history/ ...  0700 (``PRIVATE_DIR_MODE``)
      *.log *.pid *.json *.yaml                         0600 (``PRIVATE_FILE_MODE``)

How it is kept: every process of the region creates its files with the umask ``PRIVATE_UMASK`` (``077``: the CLI,
the supervisor and every program it starts, the process agent), so a file is 0600 and a directory 0700 unless
made otherwise on purpose; the passages are made 0711 by the agent (and by ``secure_run_dir``); ``secure_run_dir``
(run by ``infra.services.up`` before anything starts) takes away what other users could read of a run directory
made before (an older Ropewalk's 0644 logs, 0755 directories), at its top level: a private directory guards its
whole subtree. ``tests/integration/test_isolation.py`` opens every file under a real region's run directory as a
task and finds none it can read but its own.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PASSAGE_MODE = 0o711  # others may pass through (to a task's own directory), never list or read
AGENTS_DIR = "agents"  # <run dir>/agents: the agents' work directories (a passage)


def private_umask() -> int:
    """Make this process create files 0600 and directories 0700 (``PRIVATE_UMASK``); returns the umask before."""
    return os.umask(PRIVATE_UMASK)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (a temp file created 0600, renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_private_if_changed(path: Path, text: str) -> bool:
    """``write_private`` unless ``path`` holds ``text`` already (a secret written again only when it changed).
    Returns whether it was written."""
    try:
        if Path(path).read_text() == text:
            return False
    except OSError:
        pass
    write_private(path, text)
    return True


def open_private(path: Path, mode: str = "ab"):
    """``open(path, mode)``, the file created 0600 if it is new (whatever the umask)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, PRIVATE_FILE_MODE), mode)


def make_dir(path: Path, mode: int = PRIVATE_DIR_MODE) -> Path:
    """``path`` made if missing (its missing parents 0700) and given ``mode`` (whatever it had)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    if stat.S_IMODE(path.stat().st_mode) != mode:
        os.chmod(path, mode)
    return path


def restrict(path: Path) -> bool:
    """Take away every permission of group and others on ``path`` (a symlink is left alone); True if it changed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
        return False
    os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    return True


def secure_run_dir(run_dir: Path) -> list[str]:
    """The run directory as the module doc says, for what is at its top level (and in ``agents/``, but the task
    directories: the agent keeps those). Made if missing. Returns the paths it had to restrict (relative)."""
    run_dir = make_dir(run_dir, PASSAGE_MODE)
    changed = []
    for entry in sorted(run_dir.iterdir()):
        if entry.name == AGENTS_DIR and entry.is_dir() and not entry.is_symlink():
            make_dir(entry, PASSAGE_MODE)
            for sub in sorted(entry.iterdir()):
                if sub.is_dir() and not sub.is_symlink():
                    changed += [str(p.relative_to(run_dir)) for p in secure_work_dir(sub)]
                elif restrict(sub):
                    changed.append(str(sub.relative_to(run_dir)))
        elif restrict(entry):
            changed.append(str(entry.relative_to(run_dir)))
    return changed


TASKS_DIR = "tasks"  # <work dir>/tasks: the process agent's task directories (a passage)


def secure_work_dir(work_dir: Path) -> list[Path]:
    """A process agent's work directory: itself and ``tasks/`` passages (0711), everything else in it private. The
    task directories in ``tasks/`` are not touched (their owner is the task's uid: the agent sees to them). Made if
    missing, ``tasks/`` too. Returns the paths restricted."""
    work_dir = make_dir(work_dir, PASSAGE_MODE)
    make_dir(work_dir / TASKS_DIR, PASSAGE_MODE)
    changed = []
    for entry in sorted(work_dir.iterdir()):
        if entry.name != TASKS_DIR and restrict(entry):
            changed.append(entry)
    return changed
