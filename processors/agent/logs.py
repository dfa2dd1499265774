"""The process agent's task logs, bounded: a running task's log is rotated once it passes ``max_bytes`` (one older
generation kept, ``<task>.log.1``), and the logs of tasks that no longer run are deleted once untouched for
``keep_s``. ``plan`` decides (pure: a table test, ``tests/unit/test_agent_logs.py``); ``apply`` does it.

**Rotation without the task's help** (logrotate's ``copytruncate``): a task writes its stdout and stderr to a
descriptor the agent opened in append mode (``process._spawn``), which it keeps for its life, so the file cannot be
renamed under it (it would go on writing to the renamed one). The agent copies the log to ``<task>.log.1`` (over the
older one) and truncates it to 0; the task's next write lands at the new end (append mode). What the task writes
between the copy and the truncation is lost (a few lines at most: the copy of ``max_bytes`` takes milliseconds).
So a task's logs take at most about 2 x ``max_bytes`` on disk, and a machine's, that times the tasks it runs plus
those stopped within ``keep_s``.

**Working directories** (``process.task_dir``: what a task wrote where it ran) follow the same rule: the directory of
a task no longer live here (no process, no restart pending, no uid leased: ``plan_dirs``'s ``live``) is deleted
once untouched for ``keep_s`` (its mtime, or its ctime: the agent gives an ended task's directory to root, which is
the last touch of a task that wrote nothing at its end). A task started again within ``keep_s`` on the same machine
finds its files, as on a machine's own disk; after that it starts in an empty directory. The agent deletes it with
``shutil.rmtree`` (on Linux by file descriptors, never following a symbolic link a task left in it).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from processors.times import expired

MAX_BYTES = 16 * 1024 * 1024  # a running task's log is rotated past this (ROPEWALK_TASK_LOG_MAX_BYTES)
KEEP_S = 24 * 3600.0  # the logs and working directory of a task that no longer runs are deleted this long after
# their last change
CHECK_S = 10.0  # how often the agent looks
MAX_BYTES_ENV = "ROPEWALK_TASK_LOG_MAX_BYTES"
KEEP_ENV = "ROPEWALK_TASK_LOG_KEEP_S"
SUFFIX = ".log"
ROTATED = ".log.1"

ROTATE = "rotate"
DELETE = "delete"


@dataclass(frozen=True)
class LogFile:
    name: str  # the file's name in the logs directory (``<task>.log`` or ``<task>.log.1``)
    size: int
    mtime: float


@dataclass(frozen=True)
class TaskDir:
    name: str  # the directory's name under ``tasks/`` (``process.task_dir``: the task id, "/" as "_")
    touched: float  # its last change: the later of its mtime and its ctime


def stem(name: str) -> str | None:
    """The task part of a log file's name (None: not a task log)."""
    for suffix in (ROTATED, SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def plan(files: list[LogFile], running: set[str], now: float, *, max_bytes: int = MAX_BYTES,
         keep_s: float = KEEP_S) -> list[tuple[str, str]]:
    """(ROTATE or DELETE, file name), in name order: a running task's log (``running``: the stems of the tasks
    running, ``process.task_log``'s names without ``.log``) past ``max_bytes`` is rotated; a file of a task not
    running, untouched for ``keep_s``, is deleted. Anything else in the directory is left alone."""
    out = []
    for f in sorted(files, key=lambda f: f.name):
        task = stem(f.name)
        if task is None:
            continue
        if task in running:
            if f.name.endswith(SUFFIX) and not f.name.endswith(ROTATED) and f.size > max_bytes:
                out.append((ROTATE, f.name))
        elif expired(f.mtime, now, keep_s):
            out.append((DELETE, f.name))
    return out


def _entries(directory: Path, *, directories: bool) -> list[tuple[str, os.stat_result]]:
    """The files (or the directories) in ``directory`` with their status, symbolic links left out (none if the
    directory is not there; an entry gone meanwhile is passed over)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        try:
            if (e.is_dir(follow_symlinks=False) if directories else e.is_file(follow_symlinks=False)):
                out.append((e.name, e.stat(follow_symlinks=False)))
        except FileNotFoundError:
            continue
    return out


def plan_dirs(dirs: list[TaskDir], live: set[str], now: float, *, keep_s: float = KEEP_S) -> list[str]:
    """The names of the working directories to delete, in name order: those of tasks not ``live`` here (the names of
    the tasks with a process, a restart pending or a uid leased), untouched for ``keep_s``."""
    return [d.name for d in sorted(dirs, key=lambda d: d.name) if d.name not in live and expired(d.touched, now, keep_s)]


def apply_dirs(tasks_dir: Path, live: set[str], now: float, *, keep_s: float = KEEP_S) -> list[str]:
    """``plan_dirs`` on ``tasks_dir`` as it is, done (a symbolic link or a file there is left alone); returns the
    names deleted."""
    dirs = [TaskDir(name, max(st.st_mtime, st.st_ctime)) for name, st in _entries(tasks_dir, directories=True)]
    done = []
    for name in plan_dirs(dirs, live, now, keep_s=keep_s):
        try:
            shutil.rmtree(tasks_dir / name)
        except FileNotFoundError:
            continue
        done.append(name)
    return done


def apply(logs_dir: Path, running: set[str], now: float, *, max_bytes: int = MAX_BYTES,
          keep_s: float = KEEP_S) -> list[tuple[str, str]]:
    """``plan`` on the directory as it is, done; returns what was done (a file gone meanwhile is passed over, a
    symbolic link left alone)."""
    files = [LogFile(name, st.st_size, st.st_mtime) for name, st in _entries(logs_dir, directories=False)]
    done = []
    for action, name in plan(files, running, now, max_bytes=max_bytes, keep_s=keep_s):
        path = logs_dir / name
        try:
            if action == ROTATE:
                shutil.copyfile(path, logs_dir / (name[: -len(SUFFIX)] + ROTATED))
                os.truncate(path, 0)
            else:
                path.unlink()
        except FileNotFoundError:
            continue
        done.append((action, name))
    return done
