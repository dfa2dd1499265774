"""`ropewalk bench` and `ropewalk experiment figure14|killstorm|powerloss|soak`: the bench package's commands of the
CLI.

The front end (processors/frontend/cli.py) names these commands in its parser (so `ropewalk --help` lists them) and
hands them over whole: it replaces itself with this program, ``python -P -m bench.cli COMMAND ...`` (the same
process: a signal sent to it, its output and its exit code are the bench's), because nothing outside bench/ imports
bench/. Here the commands get their flags and handlers on the front end's own parser, and run as every command of
the CLI does (``cli.run``: a failure is one line with its reason, Ctrl-C or ``kill`` exits 130), so
`ropewalk bench --help`, a bad flag's message, the output and the exit code are the CLI's.

    python -P -m bench.cli bench --quick --json          # what `ropewalk bench --quick --json` runs
"""
from __future__ import annotations

import sys

from bench import harness, killstorm
from bench.experiments import figure14, figure14_pipeline, powerloss, soak
from processors.frontend import cli


def add_commands(bench, experiment) -> None:
    """The flags and handlers of the front end's ``bench`` and ``experiment`` parsers."""
    harness.add_arguments(bench)
    bench.set_defaults(fn=cmd_bench)
    exp = experiment.add_subparsers(dest="experiment", required=True)
    sp = exp.add_parser("figure14", help="rolling update + MSB failure under the ReplicaAware TaskController",
                        description="Twine Figure 14: a rolling update of a sharded job through TaskControl while "
                                    "an MSB fails. By default an in-process simulation of the processors' pure "
                                    "decisions (no broker, seconds); with --pipeline a run of the real processes on "
                                    "an embedded broker and Redis of its own (minutes)")
    sp.set_defaults(fn=cmd_figure14)
    figure14.add_arguments(sp)
    figure14_pipeline.add_arguments(sp)
    sp = exp.add_parser("killstorm", help="kill -9 the control plane's processes under load; check nothing is lost",
                        description="A kill storm on a region of its own (own broker, Redis, ports, run dir): one "
                                    "control-plane process killed every --interval-s under a stream of job "
                                    "submissions, resizes, stops and machine failures, the supervisor starting each "
                                    "again; then every job must converge and the replayed log and Redis show no task "
                                    "lost, placed or running twice, no machine over-committed, no quota broken. "
                                    "Exits 1 if a check fails (bench/killstorm.py)")
    sp.set_defaults(fn=cmd_killstorm)
    killstorm.add_arguments(sp)
    add_powerloss(exp)
    add_soak(exp)


def add_powerloss(exp) -> None:
    sp = exp.add_parser("powerloss", help="a DC loses its power and gets it back: tasks stopped, then all running",
                        description="On a region of its own: every machine of dc1 loses its power (the Resource "
                                    "Broker's UnavailabilityStarted POWER, as `ropewalk machine power-loss` "
                                    "announces it) under jobs pinned to dc1, then gets it back: the time until every "
                                    "task is stopped, and until every task runs again (the restarts paced by the "
                                    "scheduler's shard limiter). Exits 1 if a check fails "
                                    "(bench/experiments/powerloss.py)")
    sp.set_defaults(fn=cmd_powerloss)
    powerloss.add_arguments(sp)


def add_soak(exp) -> None:
    sp = exp.add_parser("soak", help="simulated days of churn on a region; what stays bounded (RSS, disk, Redis)",
                        description="A soak on a region of its own (own broker, Redis, ports, run dir): D simulated "
                                    "days of churn (jobs submitted, resized, updated and stopped; machines failing "
                                    "and recovering; maintenance) at S simulated seconds per second, sampling every "
                                    "process's RSS, the broker's disk per topic, Redis's memory, the changelogs, a "
                                    "shard's recovery time after kill -9 and the latencies of `at` and `replay`; a "
                                    "table and a plot (PNG) over simulated time (bench/experiments/soak.py)")
    sp.set_defaults(fn=cmd_soak)
    soak.add_arguments(sp)


def cmd_bench(cfg, args) -> int:  # noqa: ARG001 - a region of its own (own ports and run dir): not the user's
    """The benchmark harness (bench/harness.py)."""
    return harness.run_cli(args)


def cmd_figure14(cfg, args) -> int:  # noqa: ARG001 - its own region (--pipeline) or none: not the user's

    c = figure14.conditions(args)
    return figure14_pipeline.main(args, c) if args.pipeline else figure14.main(args, c)


def cmd_killstorm(cfg, args) -> int:  # noqa: ARG001 - a region of its own: the user's is not touched

    return killstorm.run_cli(args)


def cmd_powerloss(cfg, args) -> int:  # noqa: ARG001 - a region of its own: the user's is not touched

    return powerloss.run_cli(args)


def cmd_soak(cfg, args) -> int:  # noqa: ARG001 - a region of its own: the user's is not touched

    return soak.run_cli(args)


def main(argv: list[str] | None = None) -> int:
    return cli.run(cli.build_parser(bench_commands=add_commands), sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
