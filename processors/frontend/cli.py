"""`ropewalk`: the command line of Ropewalk (contract in docs/architecture.md; outside tools script against it).

Every read command takes --json and prints one JSON document (replay: one JSON event per line); every
command exits non-zero with a one-line reason on error. A record a command's readers cannot decode is skipped
and counted; the command goes on and says so once, in one line on stderr, when it ends (``args.skipped``; on an
error, at the end of the error's line).

**Through the API, or on the log.** The user's commands (entitlement, job, machine, maintenance, replay, watch) go
through the region's HTTP API (``ROPEWALK_API_URL``, default ``http://127.0.0.1:$ROPEWALK_API_PORT``) with the token
``ROPEWALK_TOKEN`` (default: the region administrator's, ``<secrets>/token``), which authorizes them
(processors/api). ``--direct`` (or ``ROPEWALK_DIRECT=1``) does them on the log itself as broker principal
``operator`` (the operator's way, and the tests'): both ways run the same operations
(processors/frontend/service.py) and print the same documents. The operator's commands (up, down, status, produce,
rebuild, archive, restore, user, bench) always act directly.

This module is the entry point: it assembles the parser from the command modules, one per resource
(processors/frontend/commands/: region, log, entitlements, jobs, machines, maintenance, rebalance, users, history,
keys, intents, srm, loans; each registers its parser beside its handlers) and runs the command asked for. What the
commands share is processors/frontend/console.py; how they show things, processors/frontend/render.py.
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from infra.config import Config
from infra.private import private_umask
from processors.frontend.commands import entitlements, history, intents, jobs, keys, loans, log, machines, \
    maintenance, rebalance, region, srm, users
from processors.frontend.console import command
from streams.deadletter import Skipped


BENCH_COMMANDS = ("bench", "experiment")


def exec_bench(argv: list[str]):
    """``bench ...`` and ``experiment ...`` are bench/'s (bench/cli.py: their flags and handlers, on this parser):
    this process becomes ``python -P -m bench.cli ARGV``, so a signal sent to it (Ctrl-C, ``kill``) reaches the bench
    (which stops the region it started), and its output and exit code are the bench's. Nothing outside bench/
    imports bench/ (tests/unit/test_layers.py). ``-P``: the working directory is not put on sys.path, so a
    ``bench/`` there is not the one run (the installed package is). Does not return."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-P", "-m", "bench.cli", *argv])


# --- parser -------------------------------------------------------------------------------------------------
def _version() -> str:
    try:
        return version("ropewalk")
    except PackageNotFoundError:
        return "unknown (not installed)"

EXAMPLES = """examples (the README's "Using it" has more):
  ropewalk up                                   # a local region: broker, Redis, 200 simulated machines, the API
  ropewalk status                               # every worker and topic
  ropewalk entitlement create e1 --quota 4
  ropewalk job submit examples/web.yaml         # prints the job id, e1.web
  ropewalk job status e1.web -o wide            # its tasks: machine, version, age, restarts, moves
  ropewalk job describe e1.web                  # + its last refusals and recent events
  ropewalk job logs demo.hello -f               # a task's output as it is written
  ropewalk machine fail dc1-msb2-r02-m001 --dry-run   # what would move where
  ropewalk replay --job e1.web --since now-10m  # its events, in time order
  ropewalk at now-15m                           # the whole region 15 minutes ago
  ropewalk <command> --help                     # a command's flags and examples
"""
SUBCOMMAND_EXAMPLES = {  # a command's examples under its --help
    "machine": "examples:\n  ropewalk machine list --entitlement e1\n  ropewalk machine list -o wide\n"
               "  ropewalk machine fail dc1-msb2-r02-m001 --dry-run\n  ropewalk machine recover dc1-msb2-r02-m001",
    "replay": "examples:\n  ropewalk replay --entitlement e1 --since 10m\n  ropewalk replay --job e1.web --since now-1h "
              "--exclude-type TaskStatesChanged\n  ropewalk replay --machine dc1-msb2-r02-m001 --json",
    "maintenance": "examples:\n  ropewalk maintenance plan --msb dc1/msb2 --start +15m --duration 30m --deadline +10m\n"
                   "  ropewalk maintenance list -o wide\n  ropewalk maintenance end ID",
    "up": "examples:\n  ropewalk up                      # 200 simulated machines and the demo job\n"
          "  ropewalk up --machines 0 --no-demo   # the broker, Redis and topics alone",
}


def _with_examples(p: argparse.ArgumentParser) -> None:
    """Give the commands of SUBCOMMAND_EXAMPLES their examples (an epilog kept as written)."""
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, text in SUBCOMMAND_EXAMPLES.items():
        sp = sub.choices[name]
        sp.epilog, sp.formatter_class = text, argparse.RawDescriptionHelpFormatter


def build_parser(bench_commands=None) -> argparse.ArgumentParser:
    """The CLI's parser, assembled from the command modules (in the order ``ropewalk --help`` lists them).
    ``bench_commands(bench, experiment)``: gives those two commands their flags and handlers (bench/cli.add_commands;
    without it they are names in the help, and ``main`` hands them to bench/cli.py)."""
    p = argparse.ArgumentParser(prog="ropewalk", description="Ropewalk: a Twine-style cluster manager on a Kafka log",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ropewalk {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    region.add_commands(sub)  # up, down, status
    log.add_produce(sub)
    entitlements.add_commands(sub)
    jobs.add_commands(sub)
    machines.add_commands(sub)
    log.add_commands(sub)  # watch, replay, rebuild, archive, restore, schemas, topics
    bench = command(sub, "bench", None, "benchmark the whole pipeline on a region of its own (own ports and run "
                    "dir); prints every figure with its conditions", json_flag=False)  # flags, handler: bench/cli.py
    maintenance.add_commands(sub)
    rebalance.add_commands(sub)
    users.add_commands(sub)
    # the history (processors/history): the region at any moment, shadow replay, what-if, explain
    history.add_commands(sub, reparse=build_parser)
    keys.add_commands(sub)  # the keys behind the identities on the log (infra/trust.py)
    experiment = sub.add_parser("experiment", help="reproduce the Twine paper's experiments")  # bench/cli.py's
    for upper_floor in (intents, srm, loans):  # the Job Control Plane, the autoscaler, elastic loans
        upper_floor.add_commands(sub)
    if bench_commands is not None:
        bench_commands(bench, experiment)
    _with_examples(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    private_umask()  # what the CLI writes (the run directory, archives) is its user's alone (infra/private.py)
    if argv[:1] and argv[0] in BENCH_COMMANDS:
        exec_bench(argv)
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Parse ``argv`` and run its command: a failure is one line with its reason (exit 1), an interrupt exits 130."""
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, with its usage (not the top level's: `job status X -o wide`)
        _deepest(parser, argv).error(f"unrecognized arguments: {' '.join(extra)}")
    args.skipped = Skipped()  # what the command's readers could not decode: said once, when it ends
    failed = False
    try:
        cfg = Config.from_env().with_(kafka_log_level=0)  # this one line says what failed (Config.kafka_log_level)
        return args.fn(cfg, args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure is one line with a reason, never a traceback
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        skipped = args.skipped.report()  # on the same line: it may be why (a job whose only state was unreadable)
        print(f"ropewalk: {msg}" + (f" ({skipped})" if skipped else ""), file=sys.stderr)
        failed = True
        return 1
    finally:
        if not failed and (line := args.skipped.report()) is not None:
            print(f"ropewalk: {line}", file=sys.stderr)


def _deepest(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``argv`` names: ``job status`` → the `job status` parser."""
    current = parser
    for token in argv:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            current = subs[0].choices[token]
    return current


if __name__ == "__main__":
    sys.exit(main())
