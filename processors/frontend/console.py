"""What the CLI's commands share (processors/frontend/cli.py and processors/frontend/commands/): the one-line error
(``CliError``), the front end a command talks to (``_front``: the API, or the log with ``--direct``), waiting for
and reporting the scheduler's verdict, reading a file, parsing times, the parser's shared pieces (``command``,
``user_command``, ``AT_HELP``, ``DRY_RUN_HELP``) and the progress of long steps. How things are shown is
``processors/frontend/render.py``.

A command module imports this one and never ``cli.py`` (which imports the command modules to register their
parsers). The imports inside functions here are start-up cost: ``ropewalk --help`` does not load the API client
or rich.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from infra.config import Config
from infra.credentials import OPERATOR
from processors import times
from processors.frontend.render import _print
from processors.frontend.service import DEFAULT_WAIT_S, PENDING, REFUSED, UNCHANGED, Frontend, require_broker
from streams.serde import SchemaRegistry


class CliError(Exception):
    """A one-line reason for a non-zero exit."""


def _registry():
    return SchemaRegistry.from_dir()


def _require_broker(cfg: Config) -> None:
    require_broker(cfg)


def direct(args) -> bool:
    """Whether this command acts on the log itself (``--direct`` or ROPEWALK_DIRECT=1) rather than through the API."""
    return bool(getattr(args, "direct", False)) or os.environ.get("ROPEWALK_DIRECT", "") not in ("", "0")


def _front(cfg: Config, args):
    """The front end this command talks to: the API (``processors.api.client.ApiClient``) or, ``--direct``, the log
    (``processors.frontend.service.Frontend`` as the operator). Both have the same operations and documents."""
    if direct(args):
        return Frontend(cfg, _registry(), principal=OPERATOR, producer="cli", skipped=args.skipped)
    from processors.api.client import ApiClient  # noqa: PLC0415 - start-up: urllib.request, ssl (~12 ms)
    from processors.api.users import read_token  # noqa: PLC0415 - start-up: yaml (~20 ms)

    return ApiClient(cfg.api_url, os.environ.get("ROPEWALK_TOKEN") or read_token(cfg.secrets))


def _wait_s(args) -> float | None:
    """How long an intent waits for the scheduler's verdict: through the API by default (``--no-wait``: not at all);
    on the log directly only with ``--wait``."""
    if args.no_wait:
        return None
    return DEFAULT_WAIT_S if args.wait or not direct(args) else None


def _verdict(doc: dict, args) -> None:
    """A refused intent is a failed command: its reason and message are the one error line."""
    if doc.get("verdict") == REFUSED:
        if args.json:
            _print(doc, True, "")
        raise CliError(f"refused by the scheduler: {doc.get('reason')}: {doc.get('message')}".rstrip(": "))
    if doc.get("verdict") == PENDING:
        print(f"ropewalk: {doc.get('message')}; `ropewalk job status` shows what happened", file=sys.stderr)
    if doc.get("verdict") == UNCHANGED and not args.json:  # not an error: said as what it is
        print(f"unchanged: {doc.get('message')}", file=sys.stderr)


def _parse_time(value: str | None) -> int | None:
    """ms since epoch, an ISO-8601 time (UTC unless it has an offset), or a duration ago (``10m``, ``1h``, ``2d``):
    ``processors/times.parse_time``, a bad one a ``CliError``."""
    try:
        return times.parse_time(value)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _duration_ms(value: str) -> int:
    """``90`` (seconds), ``90s``, ``15m``, ``2h`` or ``500ms`` → ms (``processors/times.duration_ms``), a bad one a
    ``CliError``."""
    try:
        return times.duration_ms(value)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None


# -- the parser's pieces every command module uses -------------------------------------------------------------------
AT_HELP = ("a moment: ms since epoch, ISO-8601, now-DURATION (now-15m), or TOPIC/PARTITION@OFFSET (when that "
           "record was written)")


DRY_RUN_HELP = "say what would happen (tasks moved, stopped, waiting; controllers asked; capacity left); produce nothing"


def command(sub, name: str, fn, help_: str, json_flag: bool = True, json_help: str = "print one JSON document"):
    """A command under ``sub`` (the parser's subcommands) run by ``fn(cfg, args)``, its help as its description."""
    sp = sub.add_parser(name, help=help_, description=help_)
    sp.set_defaults(fn=fn)
    if json_flag:
        sp.add_argument("--json", action="store_true", help=json_help)
    return sp


def user_command(sp, intent: bool = False):
    """A command of the front end: through the API unless --direct (cli.py's docstring)."""
    sp.add_argument("--direct", action="store_true",
                    help="act on the log itself as the operator, not through the API (or ROPEWALK_DIRECT=1)")
    if intent:
        when = sp.add_mutually_exclusive_group()
        when.add_argument("--wait", action="store_true", help="wait for the scheduler's verdict (through the "
                          "API, job submit waits by default)")
        when.add_argument("--no-wait", action="store_true", help="do not wait for the scheduler's verdict")
    return sp


# -- progress of long steps ------------------------------------------------------------------------------------------
class Progress:
    """Progress of a long command on stderr, the one helper of `up`, `bench`, `replay`, `rebuild`, `archive` and
    `restore`: ``progress(what)`` starts a phase, ``progress(what, done, total)`` says how far it is (``total``
    None: not known). A library function that reports progress takes it as a plain callable of that signature
    (streams/ and the components know nothing of the front end).

    On a terminal (rich's ``Console(stderr=True).is_terminal``: stderr a tty, or ``FORCE_COLOR``/``TTY_COMPATIBLE``
    set) each phase is a live line of rich's progress display — spinner, time elapsed, a bar and done/total when
    they are known, what — left on the screen, ticked, when the next phase starts. Otherwise (a pipe, a file, CI) at
    most one plain line per phase when it starts (``ropewalk: [  1.2s] what ...``), and only when ``lines``: a read
    command whose stderr already ends with its one summary line passes ``lines=False`` and says nothing more. stdout
    and ``--json`` never see any of it (rich is told not to redirect them). Use it as a context manager: the display
    stops before the command prints its result or its error line."""

    def __init__(self, lines: bool = True, name: str = "ropewalk", console=None):
        from rich.console import Console  # noqa: PLC0415 - start-up: rich (~24 ms), for a long step's display

        self.console = console or Console(stderr=True)
        self.live, self.lines, self.name = self.console.is_terminal, lines, name
        self.t0 = time.monotonic()
        self._what: str | None = None
        self._bar = self._task = None

    def __call__(self, what: str, done: int | None = None, total: int | None = None) -> None:
        if what != self._what:
            self._start(what, total)
        if self._bar is not None and done is not None:
            self._bar.update(self._task, completed=done, total=total, counted=True)

    def _start(self, what: str, total: int | None) -> None:
        self._what = what
        if not self.live:
            if self.lines:
                print(f"{self.name}: [{time.monotonic() - self.t0:5.1f}s] {what} ...", file=sys.stderr, flush=True)
            return
        from rich import progress as rp  # noqa: PLC0415 - start-up: rich, as Progress

        if self._bar is None:
            from rich.table import Column  # noqa: PLC0415 - start-up: rich, as Progress

            # the phase's description last: a long one is cut (…) at the width of the terminal, not the figures
            self._bar = rp.Progress(rp.SpinnerColumn(finished_text="[green]✓"), rp.TimeElapsedColumn(),
                                    rp.BarColumn(bar_width=20), _Count(),
                                    rp.TextColumn("{task.description}", table_column=Column(no_wrap=True,
                                                                                            overflow="ellipsis")),
                                    console=self.console, redirect_stdout=False, redirect_stderr=False)
            self._bar.start()
        self._finish_task()
        self._task = self._bar.add_task(what, total=total, counted=False)

    def _finish_task(self) -> None:
        if self._task is not None:  # ticked, its bar full, its count what it counted (a phase that counts nothing: 1/1)
            task = self._bar.tasks[-1]
            done = int(task.completed) if task.fields.get("counted") else 1
            self._bar.update(self._task, total=done, completed=done)
            self._bar.stop_task(self._task)
            self._task = None

    def close(self, ok: bool = True) -> None:
        if self._bar is not None:
            if ok:
                self._finish_task()
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)


def _Count():  # named for the class it makes: rich is imported only when a display is drawn
    """rich's column of a phase's count: ``done/total``, ``done`` when the total is not known, nothing for a phase
    that counts nothing (a step of `up`)."""
    from rich.progress import ProgressColumn  # noqa: PLC0415 - start-up: rich, as Progress
    from rich.text import Text  # noqa: PLC0415 - start-up: rich, as Progress

    class Count(ProgressColumn):
        def render(self, task) -> Text:
            if not task.fields.get("counted"):
                return Text("")
            done = f"{int(task.completed):,}"
            return Text(done if task.total is None else f"{done}/{int(task.total):,}", style="progress.download")

    return Count()
