"""`ropewalk job logs JOB [TASK] [-f]` (and the API's ``GET /v1/jobs/{job}/logs``): the output of a job's tasks
where their agent keeps it, instead of digging in ``.run/agents/<machine>/logs/``.

The process agent appends each task's stdout and stderr to ``<run dir>/agents/<machine>/logs/<task>.log``
(``processors/agent/process.task_log``): those files are read, the last ``tail`` lines of each, and with ``follow``
what is appended after, until the reader stops. A simulated machine runs no process: a task placed there has no
output, and a task not placed yet has none either; ``sources`` says so for each such task (``why``), so the user
reads a reason, not an empty screen. The API serves the files of its own run directory: a region's process agents
and its API share the machine here (a real fleet would ask each machine's agent, as Nomad's ``alloc logs`` does).
"""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Mapping

TAIL_LINES = 100
FOLLOW_POLL_S = 0.25


def task_id(job: str, task: str | None) -> str | None:
    """``TASK`` as the user gives it: ``3`` or ``e1.web/3``; None for every task."""
    if task is None or task == "":
        return None
    return task if "/" in task else f"{job}/{task}"


def sources(view: Mapping[str, Any], run_dir: Path, task: str | None = None) -> list[dict[str, Any]]:
    """Per task of the job (``view``: a job_view; ``task``: only that one): ``task``, ``machine``, ``path`` of its
    output (None when it has none) and ``why`` not. ``LookupError`` for a task the job does not have."""
    from processors.agent.process import default_work_dir, task_log  # noqa: PLC0415 - start-up: the agent (~0.18 s)

    wanted = task_id(view["job"], task)
    tasks = [t for t in view["tasks"] if wanted is None or t["id"] == wanted]
    if wanted is not None and not tasks:
        raise LookupError(f"job {view['job']} has no task {wanted!r} (its tasks: "
                          f"{', '.join(t['id'] for t in view['tasks'][:5]) or 'none'}"
                          f"{' ...' if len(view['tasks']) > 5 else ''})")
    out = []
    for t in tasks:
        machine = t["machine"]
        path = None if machine is None else task_log(default_work_dir(run_dir, machine), t["id"])
        if machine is None or path is None:
            why = f"not placed ({t['state']}{': ' + t['reason'] if t['reason'] else ''}): no output yet"
        elif not path.parent.parent.is_dir():
            why = (f"runs on {machine}, a simulated machine: its agent starts no process, so there is no output "
                   f"(tasks on a process agent's machine, e.g. the demo's, have their output here)")
        elif not path.is_file():
            why = f"on {machine}: no output yet ({path} not written)"
        else:
            why = ""
        out.append({"task": t["id"], "machine": machine, "path": str(path) if path and not why else None,
                    "why": why})
    return out


def tail(path: str, lines: int = TAIL_LINES) -> tuple[list[str], int]:
    """The last ``lines`` lines of the file and where it ended (to follow from)."""
    with open(path, "rb") as fh:
        last = deque(fh, maxlen=max(0, lines))
        end = fh.tell()
    return [b.decode("utf-8", "replace").rstrip("\n") for b in last], end


class Reader:
    """The output of ``srcs`` (``sources``'s): ``first(lines)`` the last ``lines`` lines of each, then ``new()``
    every whole line appended since (``-f``), as ``(task, line)`` pairs."""

    def __init__(self, srcs: list[dict[str, Any]]):
        self.srcs = [s for s in srcs if s["path"] is not None]
        self.ends: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}

    def first(self, lines: int = TAIL_LINES) -> list[tuple[str, str]]:
        out = []
        for s in self.srcs:
            got, self.ends[s["path"]] = tail(s["path"], lines)
            out += [(s["task"], line) for line in got]
        return out

    def new(self) -> list[tuple[str, str]]:
        out = []
        for s in self.srcs:
            path = s["path"]
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.ends.get(path, 0))
                    chunk = fh.read()
                    self.ends[path] = fh.tell()
            except OSError:
                continue
            if chunk:
                *whole, rest = (self.partial.pop(path, b"") + chunk).split(b"\n")
                if rest:
                    self.partial[path] = rest
                out += [(s["task"], b.decode("utf-8", "replace")) for b in whole]
        return out


def no_output(missing: Mapping[str, str]) -> str:
    """Why none of the tasks has output, in one line: the first task's reason and how many more have none."""
    if not missing:
        return "the job has no tasks"
    (task, why), more = next(iter(missing.items())), len(missing) - 1
    return f"{task}: {why}" + (f"; and {more} more tasks without output" if more else "")


def line_of(task: str, line: str, several: bool) -> str:
    """A line as `job logs` prints it: prefixed by its task when the job's tasks are shown together."""
    return f"[{task}] {line}" if several else line
