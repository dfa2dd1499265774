"""`ropewalk loans ...`: elastic compute, what the Resource Broker lends and takes back.

    ropewalk loans show [--entitlement E] [--json]   # loans, revocations under way, returns (took vs bound), p99
    ropewalk loans elastic E --max N [--notice-ms MS] [--no-lend-idle] | --off   # E may borrow up to N machines
    ropewalk loans rules [--json]                    # the lender's rules, in the order a tick applies them

Through the region's API (``/v1/loans``, ``PUT /v1/entitlements/{name}/elasticity``) or, ``--direct``, on the log as
the operator; both run the front end's operations (``processors/frontend/service.py``; the view is
``processors/resourcebroker/loans_view.py``: the lender's topics folded with its own pure ``loans.apply``).
"""
from __future__ import annotations

from processors.frontend.console import CliError, _front, user_command
from processors.frontend.render import _print, human_time
from processors.resourcebroker import loans as ln


def cmd_show(cfg, args) -> int:
    doc = _front(cfg, args).loans(args.entitlement)
    lines = [f"free machines {doc['free_machines']} (headroom {doc['headroom']})"]
    lines += [f"  loan {x['loan_id']:24} {x['machines']:>4} machines  {x['lender']} -> {x['borrower']}"
              for x in doc["loans"]] or ["  no loan"]
    lines += [f"  taking back {r['revocation_id']}: {len(r['returned'])}/{len(r['machines'])} returned, deadline "
              f"{human_time(r['deadline_ms'])}{'  OVERDUE' if r['overdue'] else ''}" for r in doc["revocations"]]
    if doc["returns"]:
        lines.append(f"  {len(doc['returns'])} machines returned, p99 {doc['returned_p99_ms']} ms (bound "
                     f"{doc['returns'][-1]['bound_ms']} ms)")
    lines += [f"  elastic {e}: borrows up to {p['max_borrowed']}, notice {p['notice_ms']} ms"
              for e, p in doc["elastic"].items() if p["elastic"]]
    _print(doc, args.json, "\n".join(lines))
    return 0


def cmd_elastic(cfg, args) -> int:
    if not args.off and args.max is None:
        raise CliError("elastic: give --max N (machines it may borrow) or --off")
    doc = _front(cfg, args).elasticity_set(args.entitlement, not args.off, 0 if args.off else args.max,
                                               args.notice_ms, not args.no_lend_idle)
    _print(doc, args.json, f"{args.entitlement}: " + ("not elastic" if args.off else
                                                          f"elastic, borrows up to {args.max} machines"))
    return 0


def cmd_rules(cfg, args) -> int:  # noqa: ARG001 - the table is code
    table = ln.rules_table()
    _print(table, args.json, "\n".join(f"{i + 1:2}. {r['rule']:28} {r['says']}" for i, r in enumerate(table)))
    return 0


def add_commands(sub) -> None:
    grp = sub.add_parser("loans", help="elastic compute: machines lent to elastic entitlements and taken back"
                         ).add_subparsers(dest="action_", required=True)

    def cmd(name, fn, help_, direct=True):
        sp = grp.add_parser(name, help=help_, description=help_)
        sp.set_defaults(fn=fn)
        sp.add_argument("--json", action="store_true", help="print one JSON document")
        if direct:
            user_command(sp)
        return sp

    sp = cmd("show", cmd_show, "what is lent, what is being taken back, how long returns took")
    sp.add_argument("--entitlement", help="only what concerns this entitlement")
    sp = cmd("elastic", cmd_elastic, "let an entitlement borrow idle machines (region admin)")
    sp.add_argument("entitlement")
    sp.add_argument("--max", type=int, help="machines it may borrow at most")
    sp.add_argument("--notice-ms", type=int, default=30_000, help="notice it gets when a loan is taken back")
    sp.add_argument("--no-lend-idle", action="store_true", help="keep its own idle quota out of any loan")
    sp.add_argument("--off", action="store_true", help="no longer elastic")
    cmd("rules", cmd_rules, "the lender's rules, in the order a tick applies them", direct=False)
