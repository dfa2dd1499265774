"""``ropewalk entitlement create|update|move|list|get``: entitlements, quota as a pseudo-cluster; their parser beside
their handlers. Through the API unless ``--direct``."""
from __future__ import annotations

from infra.config import Config
from processors import rules
from processors.frontend.console import CliError, _front, user_command
from processors.frontend.jobspec import JobSpecError, _name, refuse
from processors.frontend.render import _partition_cell, _print, _table


def add_commands(sub) -> None:
    """``entitlement`` and its actions under the CLI's subcommands ``sub``."""
    ent = sub.add_parser("entitlement", help="entitlements: quota as a pseudo-cluster").add_subparsers(dest="action", required=True)
    sp = user_command(ent.add_parser("create", help="create an entitlement (region admin)"))
    sp.set_defaults(fn=cmd_entitlement_create)
    sp.add_argument("name")
    sp.add_argument("--quota", type=int, required=True, help="machines the entitlement may hold")
    sp.add_argument("--host-profile")
    sp.add_argument("--machine-type")
    sp.add_argument("--dc", help="pin the entitlement to one data center")
    sp.add_argument("--json", action="store_true")
    sp = user_command(ent.add_parser("update", help="change an entitlement (a quota: region admin; else its owner)"))
    sp.set_defaults(fn=cmd_entitlement_update)
    sp.add_argument("name")
    sp.add_argument("--quota", type=int)
    sp.add_argument("--host-profile")
    sp.add_argument("--machine-type")
    sp.add_argument("--dc")
    sp.add_argument("--json", action="store_true")
    sp = user_command(ent.add_parser(
        "move", help="move an entitlement to another partition (another scheduler shard), its jobs running on "
                     "(region admin); waits until it lives there"))
    sp.set_defaults(fn=cmd_entitlement_move)
    sp.add_argument("name")
    sp.add_argument("--partition", type=int, required=True, help="the partition it is to live on")
    sp.add_argument("--reason", default="", help="why (kept on the log)")
    sp.add_argument("--no-wait", action="store_true", help="return once the request is on the log")
    sp.add_argument("--wait-s", type=float, default=60.0, help="how long to wait for it to arrive (default 60)")
    sp.add_argument("--json", action="store_true")
    sp = user_command(ent.add_parser("list", help="the entitlements you may see"))
    sp.set_defaults(fn=cmd_entitlement_list)
    sp.add_argument("--json", action="store_true")
    sp = user_command(ent.add_parser("get", help="one entitlement: quota, machine type, DC pin, host profile"))
    sp.set_defaults(fn=cmd_entitlement_list)
    sp.add_argument("name")
    sp.add_argument("--json", action="store_true")


def cmd_entitlement_create(cfg: Config, args) -> int:
    fields = {"name": "NAME", "quota_machines": "--quota"}
    payload = {"name": args.name, "quota_machines": args.quota, "machine_type": args.machine_type, "dc_pin": args.dc,
               "host_profile": args.host_profile}
    try:  # at the door, naming the flag (the API and the scheduler check again)
        name = _name(args.name, "NAME")
        refuse(rules.intent_problems("EntitlementCreated", payload, name), fields)
    except JobSpecError as exc:
        raise CliError(str(exc)) from None
    doc = _front(cfg, args).entitlement_create(name, args.quota, machine_type=args.machine_type, dc=args.dc,
                                               host_profile=args.host_profile, fields=fields)
    _print(doc, args.json, doc["entitlement"])
    return 0


def cmd_entitlement_update(cfg: Config, args) -> int:
    changes = {"quota_machines": args.quota, "machine_type": args.machine_type, "dc_pin": args.dc,
               "host_profile": args.host_profile}
    if all(v is None for v in changes.values()):
        raise CliError("nothing to change: give --quota, --machine-type, --dc or --host-profile")
    doc = _front(cfg, args).entitlement_update(args.name, changes)
    _print(doc, args.json, doc["entitlement"])
    return 0


def cmd_entitlement_move(cfg: Config, args) -> int:
    doc = _front(cfg, args).entitlement_move(args.name, args.partition, args.reason,
                                             wait_s=None if args.no_wait else args.wait_s)
    text = (f"{doc['entitlement']}: {doc['state']} from partition {doc['from_partition']} to "
            f"{doc['to_partition']}")
    _print(doc, args.json, text)
    if doc["state"] not in ("moved", "requested"):
        raise CliError(f"{doc['entitlement']} did not arrive on partition {doc['to_partition']} within "
                       f"{args.wait_s:.0f} s (state: {doc['state']}); `ropewalk entitlement get {doc['entitlement']}` "
                       f"shows where it lives")
    return 0


def cmd_entitlement_list(cfg: Config, args) -> int:
    rows = _front(cfg, args).entitlements()
    if getattr(args, "name", None) is not None:  # `entitlement get NAME`
        found = [r for r in rows if r["entitlement"] == args.name]
        if not found:
            raise CliError(f"no entitlement {args.name!r} (or not one you may see); `ropewalk entitlement list` "
                           f"shows them")
        rows = found
    _print(rows[0] if getattr(args, "name", None) is not None else rows, args.json,
           _table(["ENTITLEMENT", "QUOTA", "MACHINE-TYPE", "DC", "HOST-PROFILE", "PARTITION"],
                  [[r["entitlement"], r["quota_machines"], r["machine_type"] or "-", r["dc_pin"] or "-",
                    r.get("host_profile") or "-", _partition_cell(r)] for r in rows], "no entitlements"))
    return 0
