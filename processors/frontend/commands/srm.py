"""`ropewalk srm ...`: what the autoscaler sees and decided.

    ropewalk srm show JOB [--json]        # its policy, load, forecast, current size, last change
    ropewalk srm decisions [--job JOB] [--json]   # every sizing decision on the log: inputs, forecast, rule
    ropewalk srm rules [--json]           # its rules, in the order they apply
    ropewalk srm plan JOB [--json]        # a dry run: what it would decide now, and why; writes nothing

Through the region's API (``/v1/jobs/{job}/srm``, ``/v1/srm/decisions``) or, ``--direct``, on the log as the
operator (``processors/srm/views.py``: ``show`` folds ``intents`` and ``metrics`` with the SRM's own pure
``decide``, no deciding; ``decisions`` replays ``intents`` for the SRM's SizingIntentDeclared). To let the SRM
size a job: ``ropewalk intents size JOB --auto --min N --max M --load-per-task L``.
"""
from __future__ import annotations

from processors.frontend.console import _front
from processors.frontend.render import _print, human_time
from processors.srm import decide as sd


def utc(ms: int) -> str:
    """A moment of the load signal's clock, UTC to the second (not how far from now: its clock may not be this
    one's)."""
    return human_time(ms).split(" (")[0]


def cmd_show(cfg, args) -> int:
    v = _front(cfg, args).srm(args.job)
    f = v["forecast"] or {}
    pol = v["policy"]
    lines = [f"job {v['job']}  size {v['current_tasks']}  "
             + (f"autoscaled {pol['min_tasks']}..{pol['max_tasks']}, {pol['load_per_task']} load per task"
                if pol else "not autoscaled (ropewalk intents size JOB --auto ...)"),
             f"load {v['load']:.1f} ({v['samples']} samples)  forecast {f.get('forecast', 0):.1f} "
             f"(recent {f.get('recent', 0):.1f}, historical {f.get('historical', 0):.1f})"]
    if v["last_change"]:
        lines.append(f"last change {v['last_change']['direction']} at {human_time(v['last_change']['at_ms'])}")
    _print(v, args.json, "\n".join(lines))
    return 0


def cmd_decisions(cfg, args) -> int:
    doc = _front(cfg, args).srm_decisions(args.job)
    rows = doc["decisions"]
    lines = [f"{r['job']:24} {r['direction']:4} {r['current_tasks']:>6} -> {r['tasks']:<6} load {r['load']:.1f} "
             f"forecast {r['forecast']:.1f} ({r['rule']}, frees {r['machines_freed']} machines)  at {human_time(r['at_ms'])}"
             for r in rows]
    flips = sum(len(f) for f in doc["reversals"].values())
    lines.append(f"-- {len(rows)} decisions, {flips} reversals, at most {doc['most_reversals_in_an_hour']} in an "
                 f"hour of the load signal's clock (per job)")
    _print(doc, args.json, "\n".join(lines))
    return 0


def cmd_plan(cfg, args) -> int:
    d = _front(cfg, args).srm_plan(args.job)
    act = f"{d['direction']} {d['current_tasks']} -> {d['tasks']}" if d["direction"] != sd.HOLD else \
        f"hold at {d['current_tasks']}"
    text = f"job {d['job']}  would {act}  ({d['rule']}: {d['says']})"
    if d.get("forecast") is not None:
        text += (f"\nload {d['load']:.1f}  forecast {d['forecast']:.1f} (recent {d['recent']:.1f}, historical "
                 f"{d['historical']:.1f}) at the latest sample's time {utc(d['at_ms'])}  (dry run: nothing written)")
    _print(d, args.json, text)
    return 0


def cmd_rules(cfg, args) -> int:  # noqa: ARG001
    table = sd.rules_table()
    _print(table, args.json, "\n".join(f"{i + 1:2}. {r['rule']:22} {r['says']}" for i, r in enumerate(table)))
    return 0


def add_commands(sub) -> None:
    grp = sub.add_parser("srm", help="the autoscaler (SRM): what it sees and decided").add_subparsers(
        dest="action_", required=True)
    for name, fn, job_arg, help_ in (
            ("show", cmd_show, "job", "a job as the SRM sees it: policy, load, forecast, size"),
            ("decisions", cmd_decisions, "--job", "every sizing decision on the log, with its inputs and forecast"),
            ("plan", cmd_plan, "job", "a dry run: what the SRM would decide for a job now, and why (writes nothing)")):
        sp = grp.add_parser(name, help=help_)
        sp.set_defaults(fn=fn)
        sp.add_argument(job_arg)
        sp.add_argument("--json", action="store_true")
        sp.add_argument("--direct", action="store_true",
                        help="read the log itself as the operator, not through the API")
    sp = grp.add_parser("rules", help="the SRM's rules in the order they apply")
    sp.set_defaults(fn=cmd_rules)
    sp.add_argument("--json", action="store_true")
