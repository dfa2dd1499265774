"""The process agent's task logs stay bounded (processors/agent/logs.py): a table of what ``plan`` does, and a
rotation on disk while the writer keeps its append-mode descriptor."""
from __future__ import annotations

import os

import pytest

from processors.agent import logs
from processors.agent.logs import DELETE, ROTATE, LogFile

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
