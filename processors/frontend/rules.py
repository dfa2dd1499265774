"""The rules an intent must meet, in one place. Pure: no I/O.

The front end refuses an intent that breaks one at the door, naming the field (``job submit/update/resize``,
``entitlement create``, ``produce intents ...``); the scheduler applies the very same rules to every intent it
reads, so a record that reaches the log anyway (another writer, an older front end, ``kcat``) is refused with an
``IntentRefused`` event carrying the reason and the field, and not applied. The allocator skips an entitlement
intent they refuse, so it never holds what the scheduler refused.

    problems = intent_problems("EntitlementCreated", {"name": "e1", "quota_machines": -5, ...}, "e1")
    # [Problem("quota_machines", "expected an integer from 0 to 1,000,000, got -5", "invalid_entitlement")]

Quantities are refused when negative, and when absurd: beyond what any machine or region could take (a task of
more than ``MAX_TASK_CPU_MILLICORES`` or ``MAX_TASK_MEMORY_MIB`` fits no machine and would wait for ever; a job
beyond ``max_tasks``, the region's ``ROPEWALK_MAX_TASKS_PER_JOB``). Payloads are the events' (typed by their Avro
schema); the front end checks the types of what users write first (``jobspec.validate_spec``,
``streams.validate``) and then these rules. Names (``NAME``) are checked at the door only: nothing downstream
depends on their form.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infra.config import DEFAULT_MAX_TASKS_PER_JOB
from processors.allocator.placement import REQUIREMENT_KEYS, SPREAD_LEVELS
from processors.sidekick import catalogue
from streams.batches import size_of
from streams.validate import describe_value

# Reasons an intent is refused (IntentRefused.reason, a job's last_reason).
INVALID_SPEC = "invalid_spec"  # a job spec (JobSubmitted, JobSpecChanged) or resize breaks a rule below
TOO_MANY_TASKS = "too_many_tasks"  # a job (submitted, resized, updated) beyond the maximum tasks per job
INVALID_ENTITLEMENT = "invalid_entitlement"  # EntitlementCreated/Updated breaks a rule below

MAX_TASK_CPU_MILLICORES = 1_000_000  # 1,000 cores: no machine has more
MAX_TASK_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB: no machine has more
MAX_QUOTA_MACHINES = 1_000_000  # machines one entitlement may hold: more than a region has
MAX_SPEC_BYTES = 256 * 1024  # a job's argv and env together at most (they travel in every TasksCommanded record)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")  # entitlement, job and controller names
NAME_RULE = "expected a name of letters, digits, '_' or '-' (at most 63)"


@dataclass(frozen=True)
class Problem:
    """One broken rule: the field (a dotted path in the payload), what is wrong, and the refusal's reason."""

    field: str
    message: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def quantity(value: Any, field: str, low: int, high: int, reason: str = INVALID_SPEC, *,
             limit: str | None = None) -> Problem | None:
    """``value`` must be an integer from ``low`` to ``high``; ``limit`` names the bound above it (e.g. ``tasks
    per job (ROPEWALK_MAX_TASKS_PER_JOB)``) when it is a limit of the region rather than of sense."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = "a positive integer" if low == 1 else f"an integer from {low:,}"
        bound = f" up to {high:,}" if low == 1 else f" to {high:,}"
        return Problem(field, f"expected {what}{bound}, got {describe_value(value)}", reason)
    if value > high:
        return Problem(field, f"at most {high:,} {limit or 'allowed'}, got {value:,}", reason)
    return None


def task_count(value: Any, max_tasks: int, field: str = "tasks", *, low: int = 1) -> Problem | None:
    """A job's task count: ``low`` (1 in a spec, 0 in a resize) to ``max_tasks``; beyond it ``too_many_tasks``."""
    problem = quantity(value, field, low, max_tasks, INVALID_SPEC)
    if problem is not None and isinstance(value, int) and value > max_tasks:
        return Problem(field, f"at most {max_tasks:,} tasks per job (ROPEWALK_MAX_TASKS_PER_JOB), got {value:,}",
                       TOO_MANY_TASKS)
    return problem


def name_problem(value: Any, field: str, reason: str) -> Problem | None:
    if isinstance(value, str) and NAME.match(value):
        return None
    return Problem(field, f"{NAME_RULE}, got {describe_value(value)}", reason)


def spec_problems(p: Mapping[str, Any], max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB) -> list[Problem]:
    """What is wrong with a job spec (a JobSubmitted / JobSpecChanged payload, or the front end's payload)."""
    found = [
        task_count(p.get("tasks"), max_tasks),
        quantity(p["resources"]["cpu_millicores"], "resources.cpu_millicores", 1, MAX_TASK_CPU_MILLICORES,
                 limit="millicores per task (no machine has more)"),
        quantity(p["resources"]["memory_mib"], "resources.memory_mib", 1, MAX_TASK_MEMORY_MIB,
                 limit="MiB per task (no machine has more)"),
        quantity(p.get("max_unavailable", 1), "max_unavailable", 1, max_tasks, limit="(tasks per job)"),
    ]
    if "spec_version" in p:
        found.append(quantity(p["spec_version"], "spec_version", 1, 2**31 - 1))
    if not p.get("command"):
        found.append(Problem("command", "expected a non-empty list of strings, got an empty list", INVALID_SPEC))
    size = size_of(list(p.get("command") or ())) + size_of(dict(p.get("env") or {}))
    if size > MAX_SPEC_BYTES:
        found.append(Problem("command", f"command and env take {size:,} bytes, at most {MAX_SPEC_BYTES:,}",
                             INVALID_SPEC))
    spread = p.get("spread", "msb")
    if spread not in SPREAD_LEVELS:
        found.append(Problem("spread", f"expected one of {', '.join(SPREAD_LEVELS)}, got {describe_value(spread)}",
                             INVALID_SPEC))
    for k, v in sorted((p.get("requirements") or {}).items()):
        if k not in REQUIREMENT_KEYS:
            found.append(Problem(f"requirements.{k}", "unknown requirement (known: "
                                 f"{', '.join(sorted(REQUIREMENT_KEYS))})", INVALID_SPEC))
        elif not isinstance(v, str) or not v:
            found.append(Problem(f"requirements.{k}", f"expected a non-empty string, got {describe_value(v)}",
                                 INVALID_SPEC))
    return [x for x in found if x is not None]


def intent_problems(event_type: str, p: Mapping[str, Any], entitlement: str,
                    max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB) -> list[Problem]:
    """What is wrong with an intent of ``event_type`` (its payload ``p``, keyed to ``entitlement``); empty if
    nothing, or if the event type has no rules here."""
    if event_type in ("EntitlementCreated", "EntitlementUpdated"):
        found = []
        if event_type == "EntitlementCreated" and p.get("name") != entitlement:
            found.append(Problem("name", f"must be the entitlement it is keyed to ({entitlement!r}: the partition "
                                         f"key), got {describe_value(p.get('name'))}", INVALID_ENTITLEMENT))
        if event_type == "EntitlementCreated" or p.get("quota_machines") is not None:
            found.append(quantity(p.get("quota_machines"), "quota_machines", 0, MAX_QUOTA_MACHINES,
                                  INVALID_ENTITLEMENT, limit="machines (more than a region has)"))
        if not catalogue.known(p.get("host_profile")):
            found.append(Problem("host_profile", f"unknown host profile {describe_value(p.get('host_profile'))} "
                                 f"(known: {', '.join(repr(n) for n in catalogue.PROFILES if n)}, or none for the default)",
                                 INVALID_ENTITLEMENT))
        return [x for x in found if x is not None]
    if event_type in ("JobSubmitted", "JobSpecChanged"):
        return spec_problems(p, max_tasks)
    if event_type == "JobResized":
        problem = task_count(p.get("tasks"), max_tasks, low=0)
        return [problem] if problem is not None else []
    return []


def refusal(problems: list[Problem]) -> tuple[str, str]:
    """(reason, message) of a refusal for ``problems`` (not empty): the first problem's reason, every problem."""
    return problems[0].reason, "; ".join(map(str, problems))
