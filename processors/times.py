"""Times and durations as people write them, for the CLI, the API and the history. Pure: no I/O.

    parse_time("10m")                   # ten minutes ago, ms since epoch; also now-10m, now, ISO-8601 or ms
    duration_ms("90s")                  # 90000; also 500ms, 15m, 2h, 1d, or bare seconds
    expired(ended_ms, now_ms, keep_ms)  # whether what ended then is kept no longer (a grace, a retention)

A malformed value raises ``ValueError`` with a one-line reason naming the forms a value may take (the CLI prints it
as its error line; ``processors/history/moments.parse_moment`` adds its own forms on top of these).
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

UNITS = (("ms", 1), ("s", 1000), ("m", 60_000), ("h", 3_600_000), ("d", 86_400_000))
MAX_MOMENT_CHARS = 200  # the longest moment taken (`at`, `--at`): a topic, a partition and an offset fit many times


def expired(since: float | None, now: float, keep: float) -> bool:
    """Whether something that ended (or was last touched) at ``since`` is kept no longer at ``now``, kept ``keep``
    (any one unit: ms of log time, or seconds); never when it has not ended (``since`` None). The one rule of every
    grace: a stopped job's (the Job Control Plane's, the SRM's learned day), a task's logs and working directory."""
    return since is not None and now - since >= keep


def duration_ms(value: str) -> int:
    """``90`` (seconds), ``90s``, ``15m``, ``2h``, ``1d`` or ``500ms`` → ms."""
    for suffix, ms in UNITS:
        if value.endswith(suffix) and value[: -len(suffix)].isdigit():
            return int(value[: -len(suffix)]) * ms
    if value.isdigit():
        return int(value) * 1000
    raise ValueError(f"bad duration {value!r}: use seconds, or 500ms, 90s, 15m, 2h, 1d")


TIME_FORMS = "a duration ago (10m, now-10m), now, ISO-8601 (2026-11-22T10:00:00Z) or ms since epoch"


def parse_time(value: str | None, now_ms: int | None = None) -> int | None:
    """ms since epoch, an ISO-8601 time (UTC unless it has an offset), ``now``, or a duration ago (``10m``, ``1h``,
    ``2d``, or as ``at`` writes it, ``now-10m``) before ``now_ms`` (default: the clock); None for None. One
    grammar for every command that takes a time (``--since``, ``--until``, ``at``, ``--at``)."""
    if value is None:
        return None
    value = value.strip()
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if value.isdigit():
        return int(value)
    if value == "now":
        return now
    ago = value[4:] if value.startswith("now-") else value
    if ago[:1].isdigit() and ago[-1:] in ("s", "m", "h", "d"):
        try:
            return now - duration_ms(ago)
        except ValueError:
            raise ValueError(f"bad time {value!r}: use {TIME_FORMS}") from None
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"bad time {value!r}: use {TIME_FORMS}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)
