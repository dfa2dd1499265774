"""The history's commands (processors/history): ``at``, ``shadow``, ``explain``, ``history snapshot|list``, their
parser beside their handlers. Thin IO around the history's pure modules. The reads at a moment (``at``, ``--at`` on
the read commands, ``explain``) and the what-if ``--dry-run``s are operations of the front end
(processors/frontend/service.Frontend): through the API by default, on the log with ``--direct``. ``shadow`` and
``history`` are the operator's and act on the log directly (a shadow's ``--policy MODULE`` imports code: never a
request the API runs). Every failure is one line."""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from infra.config import Config
from processors.frontend.console import AT_HELP, CliError, _front, _registry, _require_broker, command, user_command
from processors.frontend.render import _print
from processors.frontend.service import moment


def _now_ms() -> int:
    return int(time.time() * 1000)


def _iso(ms: int) -> str:
    from streams.replay import iso_time  # noqa: PLC0415 - start-up: streams.replay, confluent-kafka (~40 ms)

    return iso_time(ms)


def add_commands(sub, reparse) -> None:
    """``at``, ``shadow``, ``explain`` and ``history`` under the CLI's subcommands ``sub``. ``reparse()``: the whole
    CLI's parser (``cli.build_parser``), for the command ``at TIME COMMAND ...`` runs as it was then."""
    sp = user_command(command(sub, "at", cmd_at, "the region as it was at TIME, or a read command as it would have "
                              "printed then (machine list, job status, explain)"))
    sp.set_defaults(reparse=reparse)
    sp.add_argument("moment", metavar="TIME", help=AT_HELP)
    sp.add_argument("rest", nargs=argparse.REMAINDER, metavar="COMMAND", help="e.g. machine list --json")
    sp = command(sub, "shadow", cmd_shadow, "re-decide the recorded inputs of a window under another placement "
                 "policy, in memory, and print what differs")
    sp.add_argument("--since", required=True, metavar="TIME", help=AT_HELP)
    sp.add_argument("--until", metavar="TIME", help="default: now")
    sp.add_argument("--policy", default="live", help="live | scores=NAME,NAME,...;spread=dc|msb|rack | "
                    "MODULE[:NAME] (a placement.Policy)")
    sp = user_command(command(sub, "explain", cmd_explain, "why is this task here, and why not there: the decision "
                              "that placed it, the filters' rejections, the events that led to it"))
    sp.add_argument("task", help="<job>/<index>")
    sp.add_argument("--at", metavar="TIME", help=AT_HELP)
    sp.add_argument("--why-not", metavar="MACHINE", help="how MACHINE fared in that decision")
    sp = command(sub, "history", cmd_history, "snapshots of the region for time travel: fold the log to its end "
                 "writing them (snapshot), or list them")
    sp.add_argument("action", choices=["snapshot", "list"])
    sp.add_argument("--every", type=int, default=None, metavar="N",
                    help="records between two snapshots (default: processors/history/snapshots.SNAPSHOT_EVERY)")


def cmd_at(cfg: Config, args) -> int:
    """``ropewalk at TIME [machine list ... | job status JOB ... | explain TASK ...]``: the command as it would have
    printed at TIME; without a command, the whole region then."""
    while args.rest and args.rest[0] in ("--json", "--direct"):  # ``at TIME --json``: the option is at's own
        setattr(args, args.rest[0][2:], True)
        args.rest = args.rest[1:]
    if args.rest:
        inner = args.reparse().parse_args(args.rest)
        if not hasattr(inner, "at"):
            raise CliError(f"at: {' '.join(args.rest[:2])} does not look back; these do: machine list, "
                               f"job status, explain")
        inner.at = args.moment
        inner.skipped = args.skipped
        inner.direct = inner.direct or args.direct
        return inner.fn(cfg, inner)
    doc = _front(cfg, args).region(args.moment)
    _print(doc, args.json, region_text(doc))
    return 0


def region_text(doc: dict[str, Any]) -> str:
    c = doc["machine_counts"]
    lines = [f"the region at {doc['at']}: {c['total']} machines "
             + "(" + ", ".join(f"{n} {s}" for s, n in c["by_status"].items()) + f"; "
             f"{c['free']} free, {c['under_maintenance']} under maintenance; `machine list --at` lists them)"]
    for e in doc["entitlements"]:
        lines.append(f"entitlement {e['name']:16} holds {e['held']}/{e['quota']} machines"
                     + (f"  type {e['machine_type']}" if e["machine_type"] else "") + (f"  dc {e['dc_pin']}" if e["dc_pin"] else ""))
    for j in doc["jobs"]:
        lines.append(f"job {j['job']:28} {j['state']:9} {j['running']}/{j['desired_tasks']} running  "
                     + ", ".join(f"{t['id']}@{t['machine'] or '-'}" for t in j["tasks"][:6])
                     + (" ..." if len(j["tasks"]) > 6 else ""))
    st = doc["history"]
    lines.append(f"({st['applied']} records folded" + (f" from snapshot {st['snapshot']}" if st["snapshot"] else
                                                        " from the beginning") + f" in {st['seconds']:.2f}s)")
    return "\n".join(lines)


# -- history snapshot / list ------------------------------------------------------------------------------------
def cmd_history(cfg: Config, args) -> int:
    from processors.history import moments, snapshots  # noqa: PLC0415 - start-up: the history loads faust (~0.6 s)

    if args.action == "list":
        rows = [{"file": str(s.path), "cut_ms": s.cut, "cut": _iso(s.cut), "records": s.applied,
                 "bytes": s.path.stat().st_size} for s in snapshots.listing(cfg)]
        _print(rows, args.json, "\n".join(f"{r['cut']}  {r['records']:>10} records  {r['bytes']:>10} bytes  "
                                              f"{r['file']}" for r in rows) or "no snapshots")
        return 0
    _require_broker(cfg)
    every = args.every or snapshots.SNAPSHOT_EVERY
    if every < 1:
        raise CliError(f"--every: expected a positive number of records, got {every}")
    region, stats = moments.fold_log(cfg, _registry(), skipped=args.skipped, write_every=every)
    doc = {**stats, "snapshots": len(snapshots.listing(cfg)), "directory": str(snapshots.directory(cfg))}
    _print(doc, args.json, f"folded {stats['applied']} records in {stats['seconds']:.2f}s"
               + (f" from {stats['snapshot']}" if stats.get("snapshot") else "")
               + f"; {stats.get('snapshots_written', 0)} snapshots written; {doc['snapshots']} in {doc['directory']}")
    return 0


# -- shadow -------------------------------------------------------------------------------------------------
def cmd_shadow(cfg: Config, args) -> int:
    from processors.history import shadow as sh  # noqa: PLC0415 - start-up: the history loads faust (~0.8 s)

    try:
        policy = sh.policy_of(args.policy)
    except (sh.PolicyError, ValueError) as exc:
        raise CliError(str(exc)) from None
    registry = _registry()
    since = moment(cfg, registry, args.since, "--since")
    until = moment(cfg, registry, args.until, "--until") if args.until else _now_ms()
    if until <= since:
        raise CliError(f"--until ({_iso(until)}) must be after --since ({_iso(since)})")
    _require_broker(cfg)
    doc = sh.shadow(cfg, registry, since, until, policy, skipped=args.skipped)
    _print(doc, args.json, shadow_text(doc))
    return 0


def shadow_text(doc: dict[str, Any]) -> str:
    b = doc["baseline"]
    lines = [f"shadow replay {_iso(doc['since_ms'])} .. {_iso(doc['until_ms'])} under {doc['policy']}",
             f"the live policy's replay {'reproduces' if b['reproduces_the_log'] else 'does NOT reproduce'} the log: "
             f"{b['decisions_differ']} of {b['decisions_compared']} allocator decisions and "
             f"{b['scheduler_events_differ']} of {b['scheduler_events_compared']} scheduler events differ"]
    if doc["empty"]:
        lines.append("diff: empty (every decision and total as recorded)")
    else:
        lines.append(f"diff: {doc['decisions_differ']} of {doc['decisions_compared']} decisions differ, "
                     f"{doc['scheduler_events_differ']} scheduler events")
        for d in doc["decisions"]:
            lines.append(f"  {d['request'] or d.get('request_event_id')}: {_decision_change(d)}")
    r, s = doc["totals"]["recorded"], doc["totals"]["shadow"]
    for key in ("requests", "tasks_placed", "moves", "rejections", "tasks_rejected", "machines_used",
                "machines_used_per_entitlement"):
        mark = "" if r[key] == s[key] else "   <- differs"
        lines.append(f"  {key:30} recorded {json.dumps(r[key])}  shadow {json.dumps(s[key])}{mark}")
    if doc["spread_differs"]:
        lines.append(f"  spread differs for {len(doc['spread_differs'])} jobs: " + ", ".join(
            f"{j} {r['spread'].get(j)} -> {s['spread'].get(j)}" for j in doc["spread_differs"][:5]))
    return "\n".join(lines)


def _decision_change(d: dict[str, Any]) -> str:
    a, s = d["recorded"] or {}, d["shadow"] or {}
    if not s:
        return "recorded, not decided in the shadow"
    if not a:
        return "decided only in the shadow"
    was, now = a.get("placed", {}), s.get("placed", {})
    moved = sorted(t for t in set(was) | set(now) if was.get(t) != now.get(t))
    out = f"{len(moved)} tasks elsewhere"
    if moved:
        out += " (" + ", ".join(f"{t}: {was.get(t)} -> {now.get(t)}" for t in moved[:3]) + (" ..." if len(moved) > 3 else "") + ")"
    if a.get("rejected") != s.get("rejected"):
        out += f"; rejected {a.get('rejected') or '-'} -> {s.get('rejected') or '-'}"
    return out


# -- explain ------------------------------------------------------------------------------------------------
def cmd_explain(cfg: Config, args) -> int:
    from processors.history import explain as ex  # noqa: PLC0415 - start-up: explain (~0.1 s)

    doc = _front(cfg, args).explain(args.task, at=args.at, why_not=args.why_not)
    _print(doc, args.json, ex.text(doc))
    return 0
