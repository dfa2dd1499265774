"""``ropewalk machine fail|recover|power-loss|power-restore|list``: the operator's actions on machines and the
machines' state; their parser beside their handlers. Through the API unless ``--direct``."""
from __future__ import annotations

from infra.config import Config
from processors.frontend.console import AT_HELP, DRY_RUN_HELP, _front, user_command
from processors.frontend.render import _print, _profile_text, _table


def add_commands(sub) -> None:
    """``machine`` and its actions under the CLI's subcommands ``sub``."""
    mach = sub.add_parser("machine", help="operator actions on machines").add_subparsers(dest="action", required=True)
    for name, help_ in (("fail", "mark a machine DOWN (its tasks move elsewhere)"), ("recover", "mark a machine UP again")):
        sp = user_command(mach.add_parser(name, help=help_, description=help_))
        sp.set_defaults(fn=cmd_machine_fail)
        sp.add_argument("machine")
        sp.add_argument("--json", action="store_true")
        if name == "fail":
            sp.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    add_machine_power(mach)
    sp = user_command(mach.add_parser("list", help="machines: status, owner, fault domains, free capacity",
                      description="machines: status, owner, fault domains, free capacity (from state.machines)"))
    sp.set_defaults(fn=cmd_machine_list)
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--entitlement", help="only the machines this entitlement holds")
    which.add_argument("--free", action="store_true", help="only the machines in the free pool")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("-o", "--output", choices=["wide", "json"], help="wide: every task id; json: as --json")
    sp.add_argument("--at", metavar="TIME", help=AT_HELP)


def cmd_machine_fail(cfg: Config, args) -> int:
    front = _front(cfg, args)
    if getattr(args, "dry_run", False):
        from processors.history import whatif  # noqa: PLC0415 - start-up: faust (~0.9 s), dry run only

        doc = front.machine_action(args.machine, args.action, dry_run=True)
        _print(doc, args.json, whatif.text(doc))
        return 0
    doc = front.machine_action(args.machine, args.action)
    verb = "failed" if args.action == "fail" else "recovered"
    _print(doc, args.json, f"{args.machine} {verb}" if doc["event_ids"] else
           f"{args.machine}: nothing to do (already {'down' if args.action == 'fail' else 'up'})")
    return 0


def cmd_machine_power(cfg: Config, args) -> int:
    """`machine power-loss` / `power-restore` of a DC, an MSB or a rack (processors/resourcebroker: power_lost,
    power_restored): what a power controller announces. The tasks there are gone at once and move (paced by the
    scheduler's limiter); power back, the machines boot and the tasks restart (paced too)."""
    action = POWER_ACTIONS[args.action]
    doc = front_power(cfg, args, action)
    what = args.dc or args.msb or args.rack
    if not doc["machines"]:
        text = f"{what}: nothing to do ({'every machine there is down already' if action == 'loss' else 'no machine there is down for a power loss'})"
    elif action == "loss":
        text = (f"{what}: power lost on {len(doc['machines'])} machines (UnavailabilityStarted POWER "
                f"{', '.join(doc['unavailability_ids'])}); their tasks are gone and move")
    else:
        text = (f"{what}: power back on {len(doc['machines'])} machines; their tasks restart, paced by the "
                f"scheduler's limiter")
    _print(doc, args.json, text)
    return 0


POWER_ACTIONS = {"power-loss": "loss", "power-restore": "restore"}
def front_power(cfg: Config, args, action: str) -> dict:
    return _front(cfg, args).machine_power(action, dc=args.dc, msb=args.msb, rack=args.rack)


def add_machine_power(mach) -> None:
    """The parsers of `machine power-loss` and `machine power-restore`."""
    for name, help_ in (("power-loss", "a DC, MSB or rack lost its power: its machines DOWN and an UnavailabilityStarted "
                                       "POWER (its tasks are gone at once and move)"),
                        ("power-restore", "power is back in a DC, MSB or rack: its machines down for a power loss UP "
                                          "again, the POWER unavailability ended (the tasks restart, paced)")):
        sp = user_command(mach.add_parser(name, help=help_, description=help_))
        sp.set_defaults(fn=cmd_machine_power)
        where = sp.add_mutually_exclusive_group(required=True)
        where.add_argument("--dc", metavar="DC")
        where.add_argument("--msb", metavar="DC/MSB")
        where.add_argument("--rack", metavar="DC/MSB/RACK")
        sp.add_argument("--json", action="store_true")


def cmd_machine_list(cfg: Config, args) -> int:
    """`machine list`: the latest state of every machine, from state.machines (published by the allocator)."""
    rows = _front(cfg, args).machines(args.entitlement, args.free, at=args.at)
    wide = args.output == "wide"
    head = ["MACHINE", "STATUS", "OWNER", "DC/MSB/RACK", "TYPE", "FREE-CPU(m)", "FREE-MEM(MiB)", "TASKS", "MAINTENANCE",
            "PROFILE"]
    table = [[r["id"], r["status"], r["entitlement"] or "free", f"{r['dc']}/{r['msb']}/{r['rack']}", r["type"],
              f"{r['free']['cpu_millicores']}/{r['capacity']['cpu_millicores']}",
              f"{r['free']['memory_mib']}/{r['capacity']['memory_mib']}",
              ",".join(r["tasks"]) if wide else len(r["tasks"]), ",".join(r["maintenance"]) or "-",
              _profile_text(r) or "-"] for r in rows]
    empty = "no machines at that moment" if args.at else "no machines (none published on state.machines yet)"
    _print(rows, args.json or args.output == "json", _table(head, table, empty))
    return 0
