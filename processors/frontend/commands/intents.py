"""`ropewalk intents ...`: declare a job's per-dimension intents, and see who wants what and the reconciled spec.

    ropewalk intents push JOB --percent 50 --command "serve --v2" [--label v2] [--env K=V] [--steps 10,50,100]
    ropewalk intents canary JOB start --count 2 --command "serve --canary" [--label c1] | promote [--percent 100] | abort
    ropewalk intents size JOB N | --auto --min 60 --max 140 --load-per-task 1.0 | --release
    ropewalk intents resources JOB --cpu 2000 --mem 4096
    ropewalk intents show JOB [--json]      # every intent in force (owner, where on the log) and the reconciled spec
    ropewalk intents list [--json]          # jobs with intents: generation, push, canary, size
    ropewalk intents history JOB [--json]   # every JobSpecReconciled of the job, with provenance and rules
    ropewalk intents rules [--json]         # the conflict rules, in the order they apply

Thin IO: through the region's API (``processors/api``: ``/v1/jobs/{job}/intents...``) or, ``--direct``, on the log
as the operator; both run the front end's operations (``processors/frontend/service.py``). A declaration is checked
at the door by the intent rules (``processors/rules.py``: a bad one exits 1 naming the field) and produced
on ``intents``, keyed by the job's entitlement. The views (``processors/jobcontrol/views.py``) fold ``intents`` with
the Job Control Plane's own pure ``decide`` (one full read of the topic per call).
"""
from __future__ import annotations

import json
import shlex

from processors.frontend.console import CliError, _front, user_command
from processors.frontend.render import _print
from processors.jobcontrol import decide as jd


def _declare(cfg, args, dimension: str, payload: dict) -> int:
    # the owner is who declares it (the API's user; --direct: operator): --owner naming another is refused
    doc = _front(cfg, args).intent_declare(args.job, dimension, {"owner": args.owner, **payload})
    _print(doc, args.json, f"{args.job}: {doc['intent']} {doc['event_id']} (ropewalk intents show {args.job})")
    return 0


def _argv(text: str | None) -> list[str]:
    return shlex.split(text) if text else []


def _env(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for p in pairs or ():
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise CliError(f"--env: expected KEY=VALUE, got {p!r}")
        out[k] = v
    return out


def cmd_push(cfg, args) -> int:
    steps = [int(s) for s in args.steps.split(",")] if args.steps else []
    return _declare(cfg, args, "push", {"label": args.label, "command": _argv(args.command),
                                                      "env": _env(args.env), "percent": args.percent,
                                                      "steps": steps})


def cmd_canary(cfg, args) -> int:
    return _declare(cfg, args, "canary", {
        "action": args.action, "count": args.count or 0, "label": args.label, "command": _argv(args.command),
        "env": _env(args.env), "promote_percent": args.percent})


def cmd_size(cfg, args) -> int:
    if args.auto:
        payload = {"tasks": None, "autoscale": True, "min_tasks": args.min, "max_tasks": args.max,
                   "load_per_task": args.load_per_task}
    elif args.release:
        payload = {"tasks": None}
    elif args.tasks is None:
        raise CliError("size: give N, --auto (with --min, --max, --load-per-task) or --release")
    else:
        payload = {"tasks": args.tasks}
    return _declare(cfg, args, "size", payload)


def cmd_resources(cfg, args) -> int:
    return _declare(cfg, args, "resources",
                    {"resources": {"cpu_millicores": args.cpu, "memory_mib": args.mem}})


def _summary(spec) -> str:
    if spec is None:
        return "no intent in force"
    push = f"push v{spec['push']['version']} {spec['push']['percent']}%" if spec.get("push") else "no push"
    canary = f"canary v{spec['canary']['version']} x{spec['canary']['count']}" if spec.get("canary") else "no canary"
    return f"{spec['tasks']} tasks, stable v{spec['stable_version']}, {push}, {canary}"


def cmd_show(cfg, args) -> int:
    view = _front(cfg, args).intents(args.job)
    lines = [f"job {view['job']}  generation {view['generation']}  {'live' if view['live'] else 'stopped'}"]
    for dim, h in view["intents"].items():
        p = {k: v for k, v in h["payload"].items() if k not in ("job_id", "owner") and v not in (None, [], {})}
        lines.append(f"  {dim:18} {h['owner']:10} {h['type']:24} intents[{h['at']['partition']}]@{h['at']['offset']}"
                     f"  {json.dumps(p, sort_keys=True)}")
    spec = view["reconciled"]
    lines.append(f"reconciled: {_summary(spec)}")
    if spec:
        lines += [f"  v{v['version']} {v['label'] or '-':10} {' '.join(v['command'])}" for v in spec["versions"]]
    _print(view, args.json, "\n".join(lines))
    return 0


def cmd_list(cfg, args) -> int:
    rows = _front(cfg, args).intents()
    _print(rows, args.json, "\n".join(f"{r['job']:28} gen {r['generation']:<4} {', '.join(r['intents'])}: "
                                          f"{_summary(r['reconciled'])}" for r in rows) or "no job has intents")
    return 0


def cmd_history(cfg, args) -> int:
    rows = _front(cfg, args).intents_history(args.job)
    lines = []
    for r in rows:
        if "refused" in r:
            lines.append(f"@{r['offset']:<6} refused {r['refused']}: {r['reason']}: {r['message']}")
            continue
        lines.append(f"@{r['offset']:<6} gen {r['generation']:<4} {_summary(r)}  from "
                     + ", ".join(f"{p['dimension']}({p['owner']}@{p['offset']})" for p in r["provenance"]))
        lines += [f"         rule {x['rule']}: {x['message']}" for x in r["rules"]]
    _print(rows, args.json, "\n".join(lines) or f"no reconciliation of {args.job} on the log")
    return 0


def cmd_rules(cfg, args) -> int:  # noqa: ARG001 - the table is code
    table = jd.rules_table()
    _print(table, args.json, "\n".join(f"{i + 1:2}. {r['rule']:32} {r['kind']:7} {r['says']}"
                                              for i, r in enumerate(table)))
    return 0


def add_commands(sub) -> None:
    """`ropewalk intents ...` under the front end's parser."""
    grp = sub.add_parser("intents", help="the Job Control Plane: per-dimension intents and the reconciled spec"
                         ).add_subparsers(dest="action_", required=True)

    def cmd(name, fn, help_, job=True, direct=True):
        sp = grp.add_parser(name, help=help_, description=help_)
        sp.set_defaults(fn=fn)
        if job:
            sp.add_argument("job")
        sp.add_argument("--json", action="store_true", help="print one JSON document")
        if direct:
            user_command(sp)
        return sp

    def declared(sp):
        sp.add_argument("--owner", help="who wants it: you (the API's user; --direct: operator); another is refused")
        return sp

    sp = declared(cmd("push", cmd_push, "code push: run a version on a percentage of the job's non-canary tasks"))
    sp.add_argument("--percent", type=int, required=True)
    sp.add_argument("--command", required=True, help="argv of the target version, one shell-quoted string")
    sp.add_argument("--label", default="")
    sp.add_argument("--env", action="append", metavar="KEY=VALUE")
    sp.add_argument("--steps", help="the step plan, e.g. 1,10,50,100")
    sp = declared(cmd("canary", cmd_canary, "canary: start one on a number of tasks, promote it or abort it"))
    sp.add_argument("action", choices=jd.rules.CANARY_ACTIONS)
    sp.add_argument("--count", type=int)
    sp.add_argument("--command", help="start: argv of the canary's version")
    sp.add_argument("--label", default="")
    sp.add_argument("--env", action="append", metavar="KEY=VALUE")
    sp.add_argument("--percent", type=int, default=100, help="promote: the push percentage it gets")
    sp = declared(cmd("size", cmd_size, "sizing: pin a task count, let the autoscaler size within bounds, or release"))
    sp.add_argument("tasks", type=int, nargs="?", metavar="N")
    sp.add_argument("--auto", action="store_true", help="let the autoscaler (SRM) size the job")
    sp.add_argument("--min", type=int)
    sp.add_argument("--max", type=int)
    sp.add_argument("--load-per-task", type=float, help="--auto: the load one task serves")
    sp.add_argument("--release", action="store_true", help="no pin, no autoscaling: the job's own size")
    sp = declared(cmd("resources", cmd_resources, "resources of every version's tasks"))
    sp.add_argument("--cpu", type=int, required=True, help="millicores")
    sp.add_argument("--mem", type=int, required=True, help="MiB")
    cmd("show", cmd_show, "who wants what of a job, and the reconciled spec")
    cmd("list", cmd_list, "jobs with intents and their reconciled specs", job=False)
    cmd("history", cmd_history, "every reconciliation of a job on the log, with provenance and rules")
    cmd("rules", cmd_rules, "the conflict rules, in the order they apply", job=False, direct=False)
