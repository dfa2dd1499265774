"""The history's commands (wired into ``ropewalk`` by processors/frontend/cli.py): ``at``, ``--at`` on the read
commands, ``shadow``, the what-if ``--dry-run``s, ``explain``, ``history snapshot|list``. Thin IO around the pure
modules of this package. The reads at a moment (``at``, ``--at``, ``explain``) and the what-if dry runs are
operations of the front end (processors/frontend/service.Frontend calls the functions here): through the API by
default, on the log with ``--direct``. ``shadow`` and ``history`` are the operator's and act on the log directly
(a shadow's ``--policy MODULE`` imports code: never a request the API runs). Every failure is one line."""
from __future__ import annotations

import json
import time
from typing import Any

from infra.config import Config
from streams.deadletter import Skipped
from streams.events import Event
from streams.serde import SchemaRegistry


def _cli():
    from processors.frontend import cli

    return cli


def _now_ms() -> int:
    return int(time.time() * 1000)


def _iso(ms: int) -> str:
    from streams.replay import iso_time

    return iso_time(ms)


def moment(cfg: Config, registry: SchemaRegistry, value: str, field: str = "at") -> int:
    """A moment as the commands and the API take it (see ``moments.parse_moment``); a bad one is the front end's
    ``invalid_request`` naming ``field``."""
    from processors.frontend.service import INVALID_REQUEST, FrontendError
    from processors.history import moments

    try:
        return moments.parse_moment(str(value), _now_ms(),
                                    lambda t, p, o: moments.record_time(cfg, registry, t, p, o))
    except (moments.MomentError, ValueError) as exc:
        raise FrontendError(INVALID_REQUEST, f"{field}: {exc}") from None


# -- the front end's reads at a moment (processors/frontend/service.Frontend: the API and --direct alike) ------
def machine_views_at(cfg: Config, registry: SchemaRegistry, at: str, entitlement: str | None = None, *,
                     skipped: Skipped | None = None) -> list[dict]:
    """``machine list --at``: what ``machine list --json`` printed then (rows of ``state.machine_view``)."""
    from processors.history import moments
    from streams import state

    region, _ = moments.region_at(cfg, registry, moment(cfg, registry, at), skipped=skipped,
                                  scheduler_partitions=frozenset())  # machines are the allocator's: no job decided
    rows = [state.machine_view(ev) for ev in region.machine_states()]
    return [r for r in rows if r["entitlement"] == entitlement] if entitlement else rows


def job_state_at(cfg: Config, registry: SchemaRegistry, job: str, at: str, *, skipped: Skipped | None = None
                 ) -> Event:
    """``job status --at``: the job's JobStatePublished then (only its partition's jobs decided)."""
    from processors.frontend.service import UNKNOWN_JOB, FrontendError, entitlement_of_job
    from processors.history import moments

    at_ms = moment(cfg, registry, at)
    region, _ = moments.region_at(cfg, registry, at_ms, skipped=skipped,
                                  scheduler_partitions=moments.partitions_of(cfg, [entitlement_of_job(job)]))
    ev = region.job_states().get(job)
    if ev is None:
        raise FrontendError(UNKNOWN_JOB, f"unknown job {job!r} at {_iso(at_ms)} (not submitted yet, or stopped and "
                                         f"gone)")
    return ev


def region_doc(cfg: Config, registry: SchemaRegistry, at: str, *, skipped: Skipped | None = None) -> dict:
    """``ropewalk at TIME``: the whole region then (``overview``) and how it was made (``history``)."""
    from processors.history import moments

    at_ms = moment(cfg, registry, at)
    region, stats = moments.region_at(cfg, registry, at_ms, skipped=skipped)
    return {**overview(region, at_ms), "history": stats}


def explain_doc(cfg: Config, registry: SchemaRegistry, task: str, at: str | None = None,
                why_not: str | None = None, *, skipped: Skipped | None = None) -> dict:
    """``ropewalk explain TASK [--at TIME] [--why-not MACHINE]`` (``explain.explain``)."""
    from processors.frontend.service import INVALID_REQUEST, UNKNOWN_TASK, FrontendError
    from processors.history import explain as ex

    at_ms = None if at is None else moment(cfg, registry, at)
    try:
        return ex.explain(cfg, registry, task, at_ms, why_not=why_not, skipped=skipped)
    except ex.BadTaskId as exc:
        raise FrontendError(INVALID_REQUEST, f"task: {exc}") from None
    except ex.ExplainError as exc:
        raise FrontendError(UNKNOWN_TASK, str(exc)) from None


def cmd_at(cfg: Config, args) -> int:
    """``ropewalk at TIME [machine list ... | job status JOB ... | explain TASK ...]``: the command as it would have
    printed at TIME; without a command, the whole region then."""
    cli = _cli()
    while args.rest and args.rest[0] in ("--json", "--direct"):  # ``at TIME --json``: the option is at's own
        setattr(args, args.rest[0][2:], True)
        args.rest = args.rest[1:]
    if args.rest:
        inner = cli.build_parser().parse_args(args.rest)
        if not hasattr(inner, "at"):
            raise cli.CliError(f"at: {' '.join(args.rest[:2])} does not look back; these do: machine list, "
                               f"job status, explain")
        inner.at = args.moment
        inner.skipped = args.skipped
        inner.direct = inner.direct or args.direct
        return inner.fn(cfg, inner)
    doc = cli._front(cfg, args).region(args.moment)
    cli._print(doc, args.json, region_text(doc))
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


def overview(region, at_ms: int) -> dict[str, Any]:
    """The whole region at a moment: its machines (each as ``machine list --json`` shows it, and counted),
    entitlements, jobs with their tasks and where they ran (each as ``job status --json`` shows it)."""
    from collections import Counter

    from processors.frontend.service import job_view
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
    registry = cli._registry()
    since = moment(cfg, registry, args.since, "--since")
    until = moment(cfg, registry, args.until, "--until") if args.until else _now_ms()
    if until <= since:
        raise cli.CliError(f"--until ({_iso(until)}) must be after --since ({_iso(since)})")
    cli._require_broker(cfg)
    doc = sh.shadow(cfg, registry, since, until, policy, skipped=args.skipped)
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


# -- explain ------------------------------------------------------------------------------------------------
def cmd_explain(cfg: Config, args) -> int:
    from processors.history import explain as ex

    cli = _cli()
    doc = cli._front(cfg, args).explain(args.task, at=args.at, why_not=args.why_not)
    cli._print(doc, args.json, ex.text(doc))
    return 0
