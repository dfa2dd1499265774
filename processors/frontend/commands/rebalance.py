"""``ropewalk rebalance plan``: the ReBalancer's plans of moves and each move's progress, or (``--dry-run``) the plan
the log calls for now; its parser beside its handler."""
from __future__ import annotations

from infra.config import Config
from processors.frontend.console import CliError, _front, _registry, _require_broker, direct, user_command
from processors.frontend.render import _print
from processors.rebalancer.solver import goals_arguments, goals_of


def add_commands(sub) -> None:
    """``rebalance`` and its action under the CLI's subcommands ``sub``."""
    reb = sub.add_parser("rebalance", help="the ReBalancer's plans of moves").add_subparsers(dest="action",
                                                                                           required=True)
    sp = user_command(reb.add_parser(
        "plan", help="the latest plan per entitlement and each move's progress",
        description="The ReBalancer's plans (RebalancePlanned on intents): goals, constraints, balance before and "
                    "after, and every move with its progress (done, elsewhere, moving, waiting). --dry-run (with "
                    "--direct): the plan the log calls for now, produced nowhere"))
    sp.set_defaults(fn=cmd_rebalance)
    sp.add_argument("--entitlement", help="only this entitlement")
    sp.add_argument("--all", action="store_true", help="every plan, not only the latest per entitlement")
    sp.add_argument("--dry-run", action="store_true", help="plan now from the log, here (needs --direct); produce "
                    "nothing")
    goals_arguments(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON document")


def cmd_rebalance(cfg: Config, args) -> int:
    """`rebalance plan`: the ReBalancer's latest plan per entitlement (or every plan) and each move's progress;
    with --dry-run, the plan the log calls for now, produced nowhere (processors/rebalancer/)."""
    from processors.rebalancer import queries as rb  # noqa: PLC0415 - start-up: the state readers (~0.13 s)

    if args.dry_run:  # the solver runs here, on the caller's CPU, over the whole region's log: not the API's work
        if not direct(args):
            raise CliError("rebalance plan --dry-run folds the log and solves here, as the operator: add --direct")
        _require_broker(cfg)
        try:
            views = rb.dry_run(cfg, _registry(), goals_of(args), args.entitlement)
        except ValueError as exc:
            raise CliError(f"rebalance plan --dry-run: {exc}") from None
    else:
        views = _front(cfg, args).rebalance_plans(args.entitlement, args.all)
    _print(views, args.json, rb.format_views(views) or "no plans yet (the ReBalancer found nothing to move)")
    return 0
