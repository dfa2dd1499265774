"""The history's commands (wired into ``ropewalk`` by processors/frontend/cli.py): ``at``, ``--at`` on the read
commands, ``shadow``, the what-if ``--dry-run``s, ``explain``, ``history snapshot|list``. Thin IO around the pure
modules of this package; every failure is a ``CliError`` with one line."""
from __future__ import annotations

import json
import time
from typing import Any

from infra.config import Config


def _cli():
    from processors.frontend import cli

    return cli


def _now_ms() -> int:
    return int(time.time() * 1000)


def moment(cfg: Config, value: str) -> int:
    """A moment as the commands take it (see ``moments.parse_moment``)."""
    from processors.history import moments

    cli = _cli()
    try:
        return moments.parse_moment(value, _now_ms(),
                                    lambda t, p, o: moments.record_time(cfg, cli._registry(), t, p, o))
    except (moments.MomentError, ValueError) as exc:
        raise cli.CliError(str(exc)) from None


def region_at(cfg: Config, args, at_ms: int, scheduler_partitions: frozenset[int] | None = None):
    from processors.history import moments

    cli = _cli()
    cli._require_broker(cfg)
    region, stats = moments.region_at(cfg, cli._registry(), at_ms, skipped=args.skipped,
                                      scheduler_partitions=scheduler_partitions)
    args.history = stats  # how it was made (``ropewalk at`` says it)
    return region


def _iso(ms: int) -> str:
    from streams.replay import iso_time

    return iso_time(ms)


# -- time travel ---------------------------------------------------------------------------------------------
def machine_views_at(cfg: Config, args, at_ms: int) -> list[dict]:
    """``machine list --at``: what ``machine list --json`` printed then (rows of ``state.machine_view``)."""
    from streams import state

    region = region_at(cfg, args, at_ms, frozenset())  # machines are the allocator's: no job decided
    rows = [state.machine_view(ev) for ev in region.machine_states()]
    if args.entitlement:
        rows = [r for r in rows if r["entitlement"] == args.entitlement]
    return rows


def job_state_at(cfg: Config, args, at_ms: int):
    """``job status --at``: the job's JobStatePublished then (only its partition's jobs decided)."""
    from processors.history import moments

    region = region_at(cfg, args, at_ms, moments.partitions_of(cfg, [args.job.split(".", 1)[0]]))
    ev = region.job_states().get(args.job)
    if ev is None:
        raise _cli().CliError(f"unknown job {args.job!r} at {_iso(at_ms)} (not submitted yet, or stopped and gone)")
    return ev


def cmd_at(cfg: Config, args) -> int:
    """``ropewalk at TIME [machine list ... | job status JOB ... | explain TASK ...]``: the command as it would have
    printed at TIME; without a command, the whole region then."""
    cli = _cli()
    at_ms = moment(cfg, args.moment)
    while args.rest and args.rest[0] == "--json":  # ``at TIME --json``: the option is at's own
        args.json = True
        args.rest = args.rest[1:]
    if args.rest:
        inner = cli.build_parser().parse_args(args.rest)
        if not hasattr(inner, "at"):
            raise cli.CliError(f"at: {' '.join(args.rest[:2])} does not look back; these do: machine list, "
                               f"job status, explain")
        inner.at = str(at_ms)
        inner.skipped = args.skipped
        return inner.fn(cfg, inner)
    region = region_at(cfg, args, at_ms)
    doc = {**overview(region, at_ms), "history": args.history}
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
    st = args.history
    lines.append(f"({st['applied']} records folded" + (f" from snapshot {st['snapshot']}" if st["snapshot"] else
                                                        " from the beginning") + f" in {st['seconds']:.2f}s)")
    cli._print(doc, args.json, "\n".join(lines))
    return 0


def overview(region, at_ms: int) -> dict[str, Any]:
    """The whole region at a moment: its machines (each as ``machine list --json`` shows it, and counted),
    entitlements, jobs with their tasks and where they ran (each as ``job status --json`` shows it)."""
    from collections import Counter

    from processors.frontend.cli import job_view
    from streams import state

    machines = list(region.fold.machines.values())
    held = Counter(m.entitlement for m in machines if m.entitlement)
    return {
        "at_ms": at_ms, "at": _iso(at_ms),
        "machine_counts": {"total": len(machines),
                           "by_status": dict(sorted(Counter(m.status for m in machines).items())),
                           "free": sum(1 for m in machines if not m.entitlement),
                           "under_maintenance": sum(1 for m in machines if m.maintenance)},
        "machines": [state.machine_view(ev) for ev in region.machine_states()],
        "entitlements": [{"name": n, "quota": e.quota_machines, "held": held.get(n, 0), "machine_type": e.machine_type,
                          "dc_pin": e.dc_pin} for n, e in sorted(region.fold.entitlements.items())],
        "jobs": [{**(v := job_view(ev)), "running": sum(t["state"] == "RUNNING" for t in v["tasks"])}
                 for ev in region.job_states().values()],
    }


# -- history snapshot / list ------------------------------------------------------------------------------------
def cmd_history(cfg: Config, args) -> int:
    from processors.history import moments, snapshots

    cli = _cli()
    if args.action == "list":
        rows = [{"file": str(s.path), "cut_ms": s.cut, "cut": _iso(s.cut), "records": s.applied,
                 "bytes": s.path.stat().st_size} for s in snapshots.listing(cfg)]
        cli._print(rows, args.json, "\n".join(f"{r['cut']}  {r['records']:>10} records  {r['bytes']:>10} bytes  "
                                              f"{r['file']}" for r in rows) or "no snapshots")
        return 0
    cli._require_broker(cfg)
    every = args.every or snapshots.SNAPSHOT_EVERY
    if every < 1:
        raise cli.CliError(f"--every: expected a positive number of records, got {every}")
    region, stats = moments.fold_log(cfg, cli._registry(), skipped=args.skipped, write_every=every)
    doc = {**stats, "snapshots": len(snapshots.listing(cfg)), "directory": str(snapshots.directory(cfg))}
    cli._print(doc, args.json, f"folded {stats['applied']} records in {stats['seconds']:.2f}s"
               + (f" from {stats['snapshot']}" if stats.get("snapshot") else "")
               + f"; {stats.get('snapshots_written', 0)} snapshots written; {doc['snapshots']} in {doc['directory']}")
    return 0


# -- shadow -------------------------------------------------------------------------------------------------
def cmd_shadow(cfg: Config, args) -> int:
    from processors.history import shadow as sh

    cli = _cli()
    try:
        policy = sh.policy_of(args.policy)
    except (sh.PolicyError, ValueError) as exc:
        raise cli.CliError(str(exc)) from None
    since = moment(cfg, args.since)
    until = moment(cfg, args.until) if args.until else _now_ms()
    if until <= since:
        raise cli.CliError(f"--until ({_iso(until)}) must be after --since ({_iso(since)})")
    cli._require_broker(cfg)
    doc = sh.shadow(cfg, cli._registry(), since, until, policy, skipped=args.skipped)
    cli._print(doc, args.json, shadow_text(doc))
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


# -- what-if ------------------------------------------------------------------------------------------------
def maintenance_dry_run(cfg: Config, args, plan) -> int:
    from processors.history import whatif

    cli = _cli()
    doc = whatif.maintenance(cfg, cli._registry(), plan, args.now_ms, skipped=args.skipped)
    cli._print(doc, args.json, whatif.text(doc))
    return 0


def machine_fail_dry_run(cfg: Config, args) -> int:
    from processors.history import whatif

    cli = _cli()
    doc = whatif.machine_failure(cfg, cli._registry(), args.machine, _now_ms(), skipped=args.skipped)
    cli._print(doc, args.json, whatif.text(doc))
    return 0


# -- explain ------------------------------------------------------------------------------------------------
def cmd_explain(cfg: Config, args) -> int:
    from processors.history import explain as ex

    cli = _cli()
    at_ms = moment(cfg, args.at) if args.at else None
    cli._require_broker(cfg)
    try:
        doc = ex.explain(cfg, cli._registry(), args.task, at_ms, why_not=args.why_not, skipped=args.skipped)
    except ex.ExplainError as exc:
        raise cli.CliError(str(exc)) from None
    cli._print(doc, args.json, ex.text(doc))
    return 0
