"""`ropewalk job ...`: submit, inspect and change jobs; their parser beside their handlers.

    ropewalk job submit FILE | update JOB FILE | stop JOB | resize JOB N | list   # the intents and the list
    ropewalk job status JOB [-o wide|json] [--at TIME]   # tasks: state, machine; wide: version, age, restarts,
                                                          # moves, previous machine (from the job's events)
    ropewalk job describe JOB [--events N] [--json]       # the job, its tasks' story, its last refusals and events
    ropewalk job logs JOB [TASK] [-f] [--tail N]          # its tasks' output, where the process agent keeps it

A job stopped and gone is shown by its last state (``deleted``), not refused as unknown: the scheduler's final
record of it stays on ``state.jobs`` until the job id is submitted again or its grace passes (``ROPEWALK_JOB_GC_S``,
an hour: then it is unknown; processors/scheduler/README.md "Stopped jobs leave"). Through the region's API
(``/v1/jobs/{job}``, ``/describe``, ``/logs``) or, ``--direct``, on the log and the run directory as the operator
(``processors/frontend/describe.py``, ``logs.py``).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Mapping

from infra.config import Config
from processors import rules
from processors.frontend import logs
from processors.frontend.console import AT_HELP, CliError, _front, _read, _verdict, _wait_s, direct, user_command
from processors.frontend.jobspec import JobSpecError, ValidSpec, parse_text
from processors.frontend.render import _ago, _print, _table, human_time, job_table, task_counts
from processors.frontend.service import entitlement_of_job, spec_payload

def add_commands(sub) -> None:
    """``job`` and its actions under the CLI's subcommands ``sub``."""
    job = sub.add_parser("job", help="submit, inspect and change jobs").add_subparsers(dest="action", required=True)
    for name, fn, help_, extra in (
        ("submit", cmd_job_submit, "submit a job spec (YAML or JSON); prints the job id once the scheduler accepted "
                                   "it (through the API: a refusal fails with its reason)", ("file",)),
        ("update", cmd_job_update, "replace a job's spec (rolling update)", ("job", "file")),
        ("stop", cmd_job_stop, "stop a job and free its tasks", ("job",)),
    ):
        sp = user_command(job.add_parser(name, help=help_, description=help_), intent=True)
        sp.set_defaults(fn=fn)
        for a in extra:
            sp.add_argument(a)
        sp.add_argument("--json", action="store_true")
        if name == "stop":
            sp.add_argument("--reason", default="")
    _add_looks(job)  # status, describe, logs
    sp = user_command(job.add_parser("list", help="the jobs you may see: state, tasks running"))
    sp.set_defaults(fn=cmd_job_list)
    sp.add_argument("--entitlement")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("-o", "--output", choices=["wide", "json"],
                    help="wide: also entitlement, spec version, machines, DCs, when updated; json: as --json")
    sp = user_command(job.add_parser("resize", help="change a job's task count"), intent=True)
    sp.set_defaults(fn=cmd_job_resize)
    sp.add_argument("job")
    sp.add_argument("tasks", type=int, metavar="N")
    sp.add_argument("--json", action="store_true")


def _spec_data(path: str, entitlement: str | None, max_tasks: int) -> ValidSpec:
    """The spec file, parsed and checked at the door, once (the error names the file and the field)."""
    try:
        data = parse_text(_read(path), path)
    except JobSpecError as exc:
        raise CliError(f"{path}: {exc}") from None
    return spec_payload(data, entitlement, max_tasks, f"{path}: ")


def cmd_job_submit(cfg: Config, args) -> int:
    spec = _spec_data(args.file, None, cfg.max_tasks_per_job)
    doc = _front(cfg, args).job_submit(spec, wait_s=_wait_s(args), where=f"{args.file}: ")
    _verdict(doc, args)
    _print(doc, args.json, doc["job"])
    return 0


def cmd_job_list(cfg: Config, args) -> int:
    rows = _front(cfg, args).jobs(args.entitlement)
    _print(rows, args.json or args.output == "json", job_table(rows, args.output == "wide"))
    return 0


def cmd_job_update(cfg: Config, args) -> int:
    front = _front(cfg, args)
    spec = _spec_data(args.file, entitlement_of_job(args.job), cfg.max_tasks_per_job)
    if spec.job_id != args.job:
        raise CliError(f"{args.file}: name: the spec names job {spec.job_id!r}, not {args.job!r}")
    doc = front.job_update(args.job, spec, wait_s=_wait_s(args) if args.wait else None, where=f"{args.file}: ")
    _verdict(doc, args)
    _print(doc, args.json, f"{args.job} v{doc['spec_version']}")
    return 0


def cmd_job_resize(cfg: Config, args) -> int:
    if (problem := rules.task_count(args.tasks, cfg.max_tasks_per_job, "N", low=0)) is not None:
        raise CliError(str(problem))
    doc = _front(cfg, args).job_resize(args.job, args.tasks, wait_s=_wait_s(args) if args.wait else None, field="N")
    _verdict(doc, args)
    _print(doc, args.json, f"{args.job} -> {args.tasks} tasks")
    return 0


def cmd_job_stop(cfg: Config, args) -> int:
    doc = _front(cfg, args).job_stop(args.job, args.reason, wait_s=_wait_s(args) if args.wait else None)
    _verdict(doc, args)
    _print(doc, args.json, f"{args.job} stopping")
    return 0


EXAMPLES = {
    "status": "examples:\n  ropewalk job status e1.web\n  ropewalk job status e1.web -o wide    # + version, age, "
              "restarts, moves, previous machine\n  ropewalk job status e1.web --at now-15m",
    "describe": "examples:\n  ropewalk job describe e1.web\n  ropewalk job describe e1.web --events 50 --json",
    "logs": "examples:\n  ropewalk job logs demo.hello            # every task's last 100 lines, [task] before each\n"
            "  ropewalk job logs demo.hello 0 -f       # task 0's output as it is written (Ctrl-C stops)",
}


def cmd_status(cfg, args) -> int:
    front = _front(cfg, args)
    wide = args.output == "wide"
    if wide and args.at:
        raise CliError("-o wide tells each task's story up to now: without --at")
    view = front.job_describe(args.job, 0)["job"] if wide else front.job_status(args.job, at=args.at)
    as_json = args.json or args.output == "json"
    again = f" (incarnation {view['incarnation']})" if view["incarnation"] != 1 else ""
    lines = []
    if view.get("deleted"):
        lines.append(f"job {view['job']}{again} was stopped and is gone since {human_time(view['updated_ms'])}; "
                     f"its last state:")
    lines.append(f"job {view['job']}{again}  entitlement {view['entitlement']}  state {view['state']}  "
                 f"spec v{view['spec_version']}  tasks: {task_counts(view)}")
    if view["last_reason"]:
        lines.append(f"reason: {view['last_reason']}")
    if wide:
        head, rows = task_rows(view["tasks"], int(time.time() * 1000))
        lines.append(_table(head, rows, "no tasks"))
    else:
        lines.append(_table(["TASK", "STATE", "MACHINE", "DC/MSB/RACK", "REASON"],
                            [[t["id"], t["state"], t["machine"] or "-",
                              f"{t['dc'] or '-'}/{t['msb'] or '-'}/{t['rack'] or '-'}", t["reason"] or ""]
                             for t in view["tasks"]], "no tasks"))
    _print(view, as_json, "\n".join(lines))
    return 0


def cmd_describe(cfg, args) -> int:
    doc = _front(cfg, args).job_describe(args.job, args.events)
    _print(doc, args.json, describe_text(doc))
    return 0


def cmd_logs(cfg, args) -> int:
    if direct(args):
        srcs = _front(cfg, args).job_log_sources(args.job, args.task)
        missing = {s["task"]: s["why"] for s in srcs if s["path"] is None}
        reader = logs.Reader(srcs)
        several = len(srcs) > 1
        if not reader.srcs:
            raise CliError(f"no output: {logs.no_output(missing)}")
        _say_missing(missing)
        for t, line in reader.first(args.tail):
            print(logs.line_of(t, line, several), flush=True)
        while args.follow:
            got = reader.new()
            for t, line in got:
                print(logs.line_of(t, line, several), flush=True)
            if not got:
                time.sleep(logs.FOLLOW_POLL_S)
        return 0
    from processors.api.client import ApiClientError  # noqa: PLC0415 - start-up: urllib.request, ssl (~12 ms)

    try:
        missing, lines = _front(cfg, args).job_logs(args.job, args.task, args.tail, args.follow)
    except ApiClientError as exc:
        if exc.reason == "no_output":
            raise CliError(f"no output: {exc}") from None
        raise
    _say_missing(missing)
    for line in lines:
        print(line, flush=True)
    return 0


def task_rows(tasks: list[Mapping[str, Any]], now_ms: int) -> tuple[list[str], list[list]]:
    """`job status -o wide` and `describe`'s task table: placement, version, and the story of each task."""
    head = ["TASK", "STATE", "VERSION", "MACHINE", "DC/MSB/RACK", "AGE", "RESTARTS", "MOVES", "PREVIOUS-MACHINE",
            "REASON"]
    rows = [[t["id"], t["state"], f"v{t['spec_version']}", t["machine"] or "-",
             f"{t['dc'] or '-'}/{t['msb'] or '-'}/{t['rack'] or '-'}",
             _ago(t["since_ms"] - now_ms).removesuffix(" ago") if t.get("since_ms") else "-",
             t.get("restarts", 0), t.get("moves", 0), t.get("previous_machine") or "-", t["reason"] or ""]
            for t in tasks]
    return head, rows


def describe_text(doc: Mapping[str, Any]) -> str:
    """`job describe`'s text."""
    v, now = doc["job"], doc["at_ms"]
    counts = task_counts(v)
    lines = [f"Job:          {v['job']}" + (f" (incarnation {v['incarnation']})" if v.get("incarnation", 1) != 1 else ""),
             f"Entitlement:  {v['entitlement']}",
             f"State:        {v['state']}" + ("  (stopped and gone: its last state)" if v.get("deleted") else "")
             + f"  spec v{v['spec_version']}  tasks: {counts}",
             f"Updated:      {human_time(v.get('updated_ms'), now)}",
             f"Last reason:  {v['last_reason'] or '-'}", "", "Tasks:"]
    head, rows = task_rows(v["tasks"], now)
    lines += ["  " + r for r in _table(head, rows, "no tasks").splitlines()]
    lines += ["", "Last refusals:"]
    lines += ["  " + r for r in _table(["TIME", "TYPE", "REASON", "MESSAGE"],
                                       [[human_time(e["at_ms"], now), e["type"], e["reason"], e["message"]]
                                        for e in doc["refusals"]], "none").splitlines()]
    shown = len(doc["events"])
    lines += ["", f"Events (the last {shown} of {doc['events_total']}; `ropewalk replay --job {v['job']}` has all):"]
    lines += ["  " + r for r in _table(["TIME", "TYPE", "BY", "WHAT"],
                                       [[human_time(e["at_ms"], now), e["type"], e.get("principal") or "-",
                                         e["summary"][:140]] for e in doc["events"]], "none").splitlines()]
    return "\n".join(lines)


def _say_missing(missing: dict[str, str]) -> None:
    """Tasks without output, on stderr (the output itself alone on stdout): at most 5 named, then how many more."""
    for t, why in list(missing.items())[:5]:
        print(f"ropewalk: {t}: {why}", file=sys.stderr)
    if len(missing) > 5:
        print(f"ropewalk: and {len(missing) - 5} more tasks without output", file=sys.stderr)


def _add_looks(job) -> None:
    """`status`, `describe` and `logs` under `ropewalk job` (``job``: its subparsers)."""
    def parser(name: str, help_: str):
        return user_command(job.add_parser(name, help=help_, description=help_, epilog=EXAMPLES[name],
                                           formatter_class=argparse.RawDescriptionHelpFormatter))

    sp = parser("status", "a job's tasks: state, machine, fault domains (a job stopped and gone: its last state)")
    sp.set_defaults(fn=cmd_status)
    sp.add_argument("job")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("-o", "--output", choices=["wide", "json"],
                    help="wide: also each task's spec version, age in its state, restarts, moves and previous machine "
                         "(from the job's events); json: as --json")
    sp.add_argument("--at", metavar="TIME", help=AT_HELP)
    sp = parser("describe", "a job, its tasks with their placement and story, its last refusals and recent events")
    sp.set_defaults(fn=cmd_describe)
    sp.add_argument("job")
    sp.add_argument("--events", type=int, default=None, metavar="N", help="how many recent events (default 20)")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp = parser("logs", "the output of a job's tasks (stdout and stderr, as their agent keeps it)")
    sp.set_defaults(fn=cmd_logs)
    sp.add_argument("job")
    sp.add_argument("task", nargs="?", help="one task: its index (0) or id (e1.web/0); default every task")
    sp.add_argument("-f", "--follow", action="store_true", help="then print each line as it is written (Ctrl-C stops)")
    sp.add_argument("--tail", type=int, default=100, metavar="N", help="the last N lines of each task first (100)")
