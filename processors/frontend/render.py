"""How the CLI shows what it prints (processors/frontend/cli.py and processors/frontend/commands/): a document as
JSON (``--json``) or its text, tables padded like kubectl's, times as a person reads them, a job's task counts, and
the tables more than one command prints (jobs, maintenance, a machine's profile, an entitlement's partition). Pure:
strings from documents, no I/O but ``_print``."""
from __future__ import annotations

import json
import time
from collections import Counter
from datetime import datetime, timezone


def _print(doc, as_json: bool, text: str) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True) if as_json else text)


def _table(headers: list[str], rows: list[list], empty: str) -> str:
    """Rows under a header row, columns padded to their widest cell (kubectl's tables); ``empty`` when no rows."""
    if not rows:
        return empty
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *cells])


def task_counts(v: dict) -> str:
    """``4 running, 2 pending of 6 desired``: how many of a job view's tasks are in each state, not just how many
    exist."""
    by_state = Counter(t["state"] for t in v["tasks"])
    parts = [f"{n} {s.lower()}" for s, n in sorted(by_state.items(), key=lambda x: (x[0] != "RUNNING", x[0]))]
    return f"{', '.join(parts) or 'none'} of {v['desired_tasks']} desired"


def human_time(ms: int | None, now_ms: int | None = None) -> str:
    """ms since epoch as a person reads it: UTC time to the second and how far from now (``2026-11-25 23:40:00Z
    (in 10m)``); ``-`` for none. ``--json`` keeps the ms."""
    if ms is None:
        return "-"
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    at = datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    return f"{at} ({_ago(ms - now_ms)})"


def _ago(delta_ms: int) -> str:
    s = abs(delta_ms) // 1000
    span = f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h" if s < 172800 else f"{s // 86400}d"
    return "now" if s == 0 else f"in {span}" if delta_ms > 0 else f"{span} ago"


JOB_COLUMNS = ["JOB", "STATE", "RUNNING", "TASKS", "LAST-REASON"]
# `job list -o wide`: the columns a user looks for next (kubectl's wide: more of the same row), the last reason last
JOB_WIDE = (("ENTITLEMENT", lambda v, now: v["entitlement"]),
            ("SPEC", lambda v, now: f"v{v['spec_version']}" + (f" (incarnation {v['incarnation']})"
                                                               if v.get("incarnation", 1) != 1 else "")),
            ("MACHINES", lambda v, now: len({t["machine"] for t in v["tasks"] if t["machine"]})),
            ("DCS", lambda v, now: ",".join(sorted({t["dc"] for t in v["tasks"] if t["dc"]})) or "-"),
            ("UPDATED", lambda v, now: human_time(v.get("updated_ms"), now)))


def job_table(rows: list[dict], wide: bool = False, now_ms: int | None = None) -> str:
    """`job list` (``wide``: with JOB_WIDE's columns before the last reason)."""
    if not wide:
        return _table(JOB_COLUMNS, [_job_row(v) for v in rows], "no jobs")
    head = [*JOB_COLUMNS[:-1], *(name for name, _ in JOB_WIDE), JOB_COLUMNS[-1]]
    return _table(head, [[*_job_row(v)[:-1], *(cell(v, now_ms) for _, cell in JOB_WIDE), _job_row(v)[-1]]
                         for v in rows], "no jobs")


def _job_row(v: dict) -> list:
    running = sum(t["state"] == "RUNNING" for t in v["tasks"])
    return [v["job"], v["state"], f"{running}/{v['desired_tasks']}", task_counts(v), v["last_reason"] or ""]


def _job_line(v: dict) -> str:
    """`watch jobs`: a job in one line (its tasks counted once, by state)."""
    return (f"{v['job']:28} {v['state']:9} tasks: {task_counts(v)}"
            + (f"  {v['last_reason']}" if v["last_reason"] else ""))


def maintenance_table(rows: list[dict], wide: bool = False, now_ms: int | None = None) -> str:
    """`maintenance list` (``wide``: when it starts, its deadline, how long, why, and every machine)."""
    head = ["MAINTENANCE", "MACHINES", "STATUSES"]
    cells = [[r["unavailability_id"], len(r["machines"]), ", ".join(f"{s} {n}" for s, n in r["statuses"].items())]
             for r in rows]
    if not wide:
        return _table([*head, "FIRST-MACHINES"],
                      [[*c, ",".join(r["machines"][:3]) + (" ..." if len(r["machines"]) > 3 else "")]
                       for c, r in zip(cells, rows)], "no maintenance planned or under way")
    return _table([*head, "START", "DEADLINE", "DURATION", "REASON", "MACHINE-IDS"],
                  [[*c, human_time(r.get("start_ms"), now_ms), human_time(r.get("deadline_ms"), now_ms),
                    f"{r['expected_duration_ms'] // 60_000}m" if r.get("expected_duration_ms") else "-",
                    r.get("reason") or "-", ",".join(r["machines"])] for c, r in zip(cells, rows)],
                  "no maintenance planned or under way")


def _profile_text(r: dict) -> str:
    """`machine list`: the host profile, when the machine has or wants one other than the default."""
    have, want, st = r["host_profile"] or "", r["host_profile_wanted"], r["host_profile_state"]
    if not have and not want:
        return ""
    return f"{have or 'default'}" + (f" ({st} {want or 'default'})" if st and st != "applied" else "")


def _partition_cell(row: dict) -> str:
    """Where an entitlement lives (its scheduler shard's partition), and where it moves to if it does."""
    if row.get("partition") is None:
        return "-"
    return f"{row['partition']}->{row['moving_to']}" if row.get("moving_to") is not None else str(row["partition"])
