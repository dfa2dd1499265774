"""The process agent's task logs and working directories stay bounded (processors/agent/logs.py): tables of what
``plan`` and ``plan_dirs`` do, a rotation on disk while the writer keeps its append-mode descriptor, and a deletion
on disk."""
from __future__ import annotations

import os
import time

import pytest

from processors.agent import logs
from processors.agent.logs import DELETE, ROTATE, LogFile, TaskDir

NOW = 1_000_000.0
MB = 1024 * 1024

PLAN = {  # case -> (files, running stems, expected)
    "a running task's small log": ([LogFile("e.j_0.log", MB, NOW)], {"e.j_0"}, []),
    "a running task's log past the limit": ([LogFile("e.j_0.log", 17 * MB, NOW)], {"e.j_0"}, [(ROTATE, "e.j_0.log")]),
    "its rotated generation is kept, whatever its size": (
        [LogFile("e.j_0.log.1", 17 * MB, NOW - 10 * logs.KEEP_S)], {"e.j_0"}, []),
    "a task gone lately": ([LogFile("e.j_1.log", MB, NOW - 60)], set(), []),
    "a task gone for long: both generations deleted": (
        [LogFile("e.j_1.log", MB, NOW - logs.KEEP_S), LogFile("e.j_1.log.1", 17 * MB, NOW - logs.KEEP_S - 1)],
        set(), [(DELETE, "e.j_1.log"), (DELETE, "e.j_1.log.1")]),
    "not a task log": ([LogFile("notes.txt", 100 * MB, 0.0)], set(), []),
}


@pytest.mark.parametrize("files, running, expected", PLAN.values(), ids=PLAN)
def test_plan(files, running, expected):
    assert logs.plan(files, running, NOW, max_bytes=16 * MB) == expected


def test_rotation_keeps_the_writer_writing_to_the_log(tmp_path):
    path = tmp_path / "e.j_0.log"
    with open(path, "ab") as out:  # as the agent opens it for the task
        out.write(b"x" * 2000)
        out.flush()
        assert logs.apply(tmp_path, {"e.j_0"}, NOW, max_bytes=1000) == [(ROTATE, "e.j_0.log")]
        out.write(b"after\n")
        out.flush()
    assert path.read_bytes() == b"after\n"  # appended at the new end, not at offset 2000 (no hole)
    assert (tmp_path / "e.j_0.log.1").read_bytes() == b"x" * 2000
    os.utime(path, (NOW - logs.KEEP_S, NOW - logs.KEEP_S))
    os.utime(tmp_path / "e.j_0.log.1", (NOW - logs.KEEP_S, NOW - logs.KEEP_S))
    assert sorted(logs.apply(tmp_path, set(), NOW)) == [(DELETE, "e.j_0.log"), (DELETE, "e.j_0.log.1")]
    assert list(tmp_path.iterdir()) == []
    assert logs.apply(tmp_path / "none", set(), NOW) == []


PLAN_DIRS = {  # case -> (directories, live names, expected deletions)
    "a live task's directory, however old": ([TaskDir("e.j_0", NOW - 10 * logs.KEEP_S)], {"e.j_0"}, []),
    "a task gone lately": ([TaskDir("e.j_1", NOW - 60)], set(), []),
    "a task gone for long": ([TaskDir("e.j_1", NOW - logs.KEEP_S)], set(), ["e.j_1"]),
    "in name order, the live one kept": (
        [TaskDir("e.j_3", 0.0), TaskDir("e.j_2", 0.0), TaskDir("e.j_0", 0.0)], {"e.j_0"}, ["e.j_2", "e.j_3"]),
}


@pytest.mark.parametrize("dirs, live, expected", PLAN_DIRS.values(), ids=PLAN_DIRS)
def test_plan_dirs(dirs, live, expected):
    assert logs.plan_dirs(dirs, live, NOW) == expected


def test_the_working_directory_of_a_task_gone_for_long_is_deleted_and_nothing_else(tmp_path):
    """On disk: a directory's last change is its mtime or its ctime (the agent gives an ended task's directory to
    root), so "long ago" is a ``now`` past it here. What a task left in it goes with it; a symbolic link it left is
    deleted, never followed; a live task's directory, a file and a symbolic link beside them are left alone."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the task's")
    tasks = tmp_path / "tasks"
    gone = tasks / "e.j_1"
    (gone / "sub").mkdir(parents=True)
    (gone / "sub" / "data").write_bytes(b"x" * 100)
    (gone / "escape").symlink_to(outside)
    (tasks / "e.j_0").mkdir()
    (tasks / "stray.txt").write_text("not a task directory")
    (tasks / "e.j_9").symlink_to(outside)
    later = time.time() + logs.KEEP_S + 1
    assert logs.apply_dirs(tasks, {"e.j_0"}, time.time()) == []  # nothing is old yet
    assert logs.apply_dirs(tasks, {"e.j_0"}, later) == ["e.j_1"]
    assert sorted(p.name for p in tasks.iterdir()) == ["e.j_0", "e.j_9", "stray.txt"]
    assert (outside / "keep.txt").read_text() == "not the task's"
    assert logs.apply_dirs(tmp_path / "none", set(), later) == []
