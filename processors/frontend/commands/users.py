"""``ropewalk user add|grant|revoke|remove|list``: the API's users (<secrets>/users.yaml): tokens, roles per
entitlement, region admin; their parser beside their handler. The operator's: on the file itself."""
from __future__ import annotations

from infra.config import Config
from processors import rules
from processors.api.authz import ROLES
from processors.frontend.console import CliError
from processors.frontend.render import _print, _table


def add_commands(sub) -> None:
    """``user`` and its actions under the CLI's subcommands ``sub``."""
    usr = sub.add_parser("user", help="the API's users: tokens, roles per entitlement, region admin "
                         "(<secrets>/users.yaml)").add_subparsers(dest="action", required=True)
    sp = usr.add_parser("add", help="add a user; prints its token (shown once: only its hash is kept)")
    sp.add_argument("name")
    sp.add_argument("--role", action="append", metavar="ENTITLEMENT=ROLE",
                    help="viewer, operator or owner of an entitlement (repeatable)")
    sp.add_argument("--region-admin", action="store_true", help="may do everything (quotas, machines, maintenance)")
    for name, help_, extra in (("grant", "give a user a role on an entitlement", ("name", "entitlement", "role")),
                               ("revoke", "take a user's role on an entitlement away", ("name", "entitlement")),
                               ("remove", "remove a user (its token stops working)", ("name",)),
                               ("list", "users and their roles", ())):
        sp2 = usr.add_parser(name, help=help_)
        for a in extra:
            sp2.add_argument(a)
        sp2.add_argument("--json", action="store_true")
        sp2.set_defaults(fn=cmd_user)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_user)


def cmd_user(cfg: Config, args) -> int:
    """The API's users file (<secrets>/users.yaml): add (prints the token once), grant, revoke, remove, list."""
    from processors.api import users as u  # noqa: PLC0415 - start-up: yaml (~20 ms)

    path = cfg.secrets / u.USERS_FILE
    try:
        if args.action == "add":
            roles = dict(_role(r) for r in args.role or ())
            token = u.add_user(path, args.name, roles, args.region_admin)
            _print({"user": args.name, "token": token, "roles": roles, "region_admin": args.region_admin}, args.json,
                   token)
            return 0
        if args.action == "grant":
            u.grant(path, args.name, *_role(f"{args.entitlement}={args.role}"))
        elif args.action == "revoke":
            u.grant(path, args.name, args.entitlement, None)
        elif args.action == "remove":
            u.remove_user(path, args.name)
        users = u.load(path).by_name
    except u.UsersError as exc:
        raise CliError(str(exc)) from None
    rows = [{"user": n, "region_admin": x.region_admin, "roles": dict(x.roles)} for n, x in sorted(users.items())]
    _print(rows, args.json, _table(["USER", "REGION-ADMIN", "ROLES"],
                                   [[r["user"], "yes" if r["region_admin"] else "no",
                                     " ".join(f"{e}={role}" for e, role in sorted(r["roles"].items())) or "-"]
                                    for r in rows], "no users"))
    return 0


def _role(text: str) -> tuple[str, str]:
    ent, _, role = text.partition("=")
    if rules.name_problem(ent, "entitlement", "") is not None or role not in ROLES:
        raise CliError(f"--role: expected ENTITLEMENT=ROLE with a role of {', '.join(ROLES)}, got {text!r}")
    return ent, role
