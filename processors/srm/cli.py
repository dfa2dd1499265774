"""`ropewalk srm ...`: what the autoscaler sees and decided.

    ropewalk srm show JOB [--json]        # its policy, load, forecast, current size, last change
    ropewalk srm decisions [--job JOB] [--json]   # every sizing decision on the log: inputs, forecast, rule
    ropewalk srm rules [--json]           # its rules, in the order they apply

``show`` folds ``intents`` and ``metrics`` with the SRM's own pure ``decide`` (no deciding: one full read of both
topics per call); ``decisions`` replays ``intents`` for the SRM's SizingIntentDeclared. To let the SRM size a job:
``ropewalk intents size JOB --auto --min N --max M --load-per-task L``.
"""
from __future__ import annotations

from processors.srm import decide as sd


def _cli():
    from processors.frontend import cli

    return cli


def fold_srm(cfg, registry, *, skipped=None) -> sd.SrmState:
    from processors.resourcebroker.processor import read_to_end
    from streams.clients import EventConsumer
    from streams.topics import Topics

    topics = Topics(cfg.topic_prefix, cfg.partitions)
    consumer = EventConsumer(cfg, registry, [topics.name("intents"), topics.name("metrics")], name="srm-view",
                             skipped=skipped, types=sd.CONSUMED)
    state = sd.SrmState()
    try:
        def fold(records) -> None:
            nonlocal state
            for r in records:
                state, _ = sd.decide(state, r.event, live=False)

        read_to_end(consumer, fold)
    finally:
        consumer.close()
    return state


def cmd_show(cfg, args) -> int:
    cli = _cli()
    cli._require_broker(cfg)
    job = fold_srm(cfg, cli._registry(), skipped=args.skipped).jobs.get(args.job)
    if job is None:
        raise cli.CliError(f"the SRM knows nothing of {args.job!r} (no policy, size or load sample on the log)")
    v = sd.job_view(job)
    f = v["forecast"] or {}
    pol = v["policy"]
    lines = [f"job {v['job']}  size {v['current_tasks']}  "
             + (f"autoscaled {pol['min_tasks']}..{pol['max_tasks']}, {pol['load_per_task']} load per task"
                if pol else "not autoscaled (ropewalk intents size JOB --auto ...)"),
             f"load {v['load']:.1f} ({v['samples']} samples)  forecast {f.get('forecast', 0):.1f} "
             f"(recent {f.get('recent', 0):.1f}, historical {f.get('historical', 0):.1f})"]
    if v["last_change"]:
        lines.append(f"last change {v['last_change']['direction']} at {v['last_change']['at_ms']}")
    cli._print(v, args.json, "\n".join(lines))
    return 0


def cmd_decisions(cfg, args) -> int:
    from streams import replay as rp

    cli = _cli()
    cli._require_broker(cfg)
    run = rp.replay(cfg, cli._registry(), rp.ReplayFilter(job=args.job, topics=("intents",)), skipped=args.skipped)
    rows = [{"job": r.event.payload["job_id"], "tasks": r.event.payload["tasks"], "event_id": r.event.event_id,
             "offset": r.offset, **r.event.payload["decision"]}
            for r in run if r.event.type == "SizingIntentDeclared" and r.event.producer == sd.PRODUCER]
    lines = [f"{r['job']:24} {r['direction']:4} {r['current_tasks']:>6} -> {r['tasks']:<6} load {r['load']:.1f} "
             f"forecast {r['forecast']:.1f} ({r['rule']}, frees {r['machines_freed']} machines)  at {r['at_ms']}"
             for r in rows]
    flips = sd.reversals(rows)
    lines.append(f"-- {len(rows)} decisions, {len(flips)} reversals, at most "
                 f"{sd.most_in_window(flips, 3600_000)} in an hour of the load signal's clock")
    cli._print(rows, args.json, "\n".join(lines))
    return 0


def cmd_rules(cfg, args) -> int:  # noqa: ARG001
    table = sd.rules_table()
    _cli()._print(table, args.json, "\n".join(f"{i + 1:2}. {r['rule']:22} {r['says']}" for i, r in enumerate(table)))
    return 0


def add_commands(sub) -> None:
    grp = sub.add_parser("srm", help="the autoscaler (SRM): what it sees and decided").add_subparsers(
        dest="action_", required=True)
    sp = grp.add_parser("show", help="a job as the SRM sees it: policy, load, forecast, size")
    sp.set_defaults(fn=cmd_show)
    sp.add_argument("job")
    sp.add_argument("--json", action="store_true")
    sp = grp.add_parser("decisions", help="every sizing decision on the log, with its inputs and forecast")
    sp.set_defaults(fn=cmd_decisions)
    sp.add_argument("--job")
    sp.add_argument("--json", action="store_true")
    sp = grp.add_parser("rules", help="the SRM's rules in the order they apply")
    sp.set_defaults(fn=cmd_rules)
    sp.add_argument("--json", action="store_true")
