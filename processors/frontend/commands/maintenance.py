"""``ropewalk maintenance plan|list|end``: the Ops Planner's planned maintenance, with advance notice and deadline;
their parser beside their handlers. Through the API unless ``--direct``."""
from __future__ import annotations

import time
from collections import defaultdict

from infra.config import Config
from processors.frontend.console import DRY_RUN_HELP, _duration_ms, _front, _parse_time, user_command
from processors.frontend.render import _ago, _print, human_time, maintenance_table


def add_commands(sub) -> None:
    """``maintenance`` and its actions under the CLI's subcommands ``sub``."""
    mnt = sub.add_parser("maintenance", help="Ops Planner: planned maintenance with advance notice and deadline"
                         ).add_subparsers(dest="action", required=True)
    sp = user_command(mnt.add_parser("plan", help="announce maintenance of machines, a rack or an MSB",
                      description="UnavailabilityStarted(MAINTENANCE) for the machines concerned: their jobs' "
                                  "TaskControllers choose per task (move, stop and restart after, keep running); "
                                  "at the deadline the scheduler stops what remains"))
    sp.set_defaults(fn=cmd_maintenance)
    where = sp.add_mutually_exclusive_group(required=True)
    where.add_argument("--machines", help="M1,M2,...")
    where.add_argument("--rack", help="DC/MSB/RACK")
    where.add_argument("--msb", help="DC/MSB")
    sp.add_argument("--start", required=True, help="ms since epoch, ISO-8601, or +DURATION from now (+1h)")
    sp.add_argument("--duration", required=True, help="seconds, or 500ms, 90s, 15m, 2h")
    sp.add_argument("--deadline", help="when what remains is stopped (default: the start); same forms as --start")
    sp.add_argument("--reason", default="maintenance")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    sp = user_command(mnt.add_parser("list", help="maintenance machines are under: its id, machines, their "
                                                  "statuses"))
    sp.set_defaults(fn=cmd_maintenance_list)
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("-o", "--output", choices=["wide", "json"],
                    help="wide: also start, deadline, duration, reason and every machine; json: as --json")
    sp = user_command(mnt.add_parser("end", help="the maintenance is over: machines back UP, tasks stopped for it "
                                                 "start again"))
    sp.set_defaults(fn=cmd_maintenance)
    sp.add_argument("unavailability_id")
    sp.add_argument("--json", action="store_true", help="print one JSON document")


def _when_ms(value: str, now_ms: int) -> int:
    """An absolute time (ms since epoch, ISO-8601) or ``+DURATION`` from now."""
    return now_ms + _duration_ms(value[1:]) if value.startswith("+") else _parse_time(value)


def cmd_maintenance(cfg: Config, args) -> int:
    """`maintenance plan`: UnavailabilityStarted(MAINTENANCE) with advance notice and deadline for the machines of
    the region concerned; `maintenance end UE`: the window is over (tasks stopped for it start again)."""
    front = _front(cfg, args)
    now = int(time.time() * 1000)
    if args.action == "end":
        doc = front.maintenance_end(args.unavailability_id)
        _print(doc, args.json, f"maintenance {args.unavailability_id} ended: {len(doc['machines'])} machines")
        return 0
    plan = dict(start_ms=_when_ms(args.start, now), duration_ms=_duration_ms(args.duration),
                deadline_ms=None if args.deadline is None else _when_ms(args.deadline, now),
                machines=[m for m in args.machines.split(",") if m] if args.machines else None,
                rack=args.rack, msb=args.msb, reason=args.reason)
    if args.dry_run:
        from processors.history import whatif  # noqa: PLC0415 - start-up: faust (~0.9 s), dry run only

        doc = front.maintenance_plan(**plan, dry_run=True)
        _print(doc, args.json, whatif.text(doc))
        return 0
    doc = front.maintenance_plan(**plan)
    _print(doc, args.json, f"maintenance {doc['unavailability_id']} planned: {len(doc['machines'])} machines, start "
                           f"{human_time(doc['start_ms'], now)}, deadline {human_time(doc['deadline_ms'], now)}, "
                           f"lasting {_ago(doc['expected_duration_ms']).removeprefix('in ')}")
    return 0


def cmd_maintenance_list(cfg: Config, args) -> int:
    """`maintenance list`: every maintenance that machines are under now, with its machines (from their views)."""
    by_id: dict[str, list[dict]] = defaultdict(list)
    for r in _front(cfg, args).machines(None, False):
        for ue in r["maintenance"]:
            by_id[ue].append(r)
    rows = [{"unavailability_id": ue, "machines": sorted(m["id"] for m in ms),
             "statuses": {s: sum(m["status"] == s for m in ms) for s in sorted({m["status"] for m in ms})}}
            for ue, ms in sorted(by_id.items())]
    wide = args.output == "wide"
    if wide:  # when, from the log's UnavailabilityStarted (the machines' views name only the id)
        windows = {w["unavailability_id"]: w for w in _front(cfg, args).maintenance_windows()}
        rows = [{**r, **{k: windows.get(r["unavailability_id"], {}).get(k) for k in MAINTENANCE_WHEN}} for r in rows]
    _print(rows, args.json or args.output == "json", maintenance_table(rows, wide))
    return 0


MAINTENANCE_WHEN = ("start_ms", "deadline_ms", "expected_duration_ms", "reason")
