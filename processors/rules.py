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
INVALID_INTENT = "invalid_intent"  # a per-dimension intent (push, canary, sizing, resources, elasticity) breaks one

MAX_TASK_CPU_MILLICORES = 1_000_000  # 1,000 cores: no machine has more
MAX_TASK_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB: no machine has more
MAX_QUOTA_MACHINES = 1_000_000  # machines one entitlement may hold: more than a region has
MAX_SPEC_BYTES = 256 * 1024  # a job's argv and env together at most (they travel in every TasksCommanded record)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")  # entitlement, job and controller names
NAME_RULE = "expected a name of letters, digits, '_' or '-' (at most 63)"
# An environment variable's name, as POSIX names them (letters, digits, '_'; not a digit first): no '=' (exec would
# cut the name there) and no NUL (exec refuses it: the task would fail at its spawn, on the machine).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
ENV_NAME_RULE = "expected an environment variable name (letters, digits, '_'; not a digit first)"


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


def printable(text: str) -> str:
    """``text`` with its control characters escaped (a NUL shows as ``\\x00``): fit for a field's name. Pure."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def code_problems(command: Any, env: Any, reason: str, prefix: str = "") -> list[Problem]:
    """A version's argv and env that no machine could run: a NUL in an argument, an env name that is not one
    (``ENV_NAME``), a NUL in an env value. ``prefix``: the fields' (``versions[0].``). Types are checked before."""
    found = []
    for i, arg in enumerate(command if isinstance(command, (list, tuple)) else ()):
        if isinstance(arg, str) and "\x00" in arg:
            found.append(Problem(f"{prefix}command[{i}]", "contains a NUL character (no program can be given one)",
                                 reason))
    for k, v in sorted((env if isinstance(env, Mapping) else {}).items(), key=lambda kv: str(kv[0])):
        field = f"{prefix}env.{printable(str(k))}"
        if not isinstance(k, str) or not ENV_NAME.match(k):
            found.append(Problem(field, f"{ENV_NAME_RULE}, got {describe_value(printable(str(k)))}", reason))
        elif isinstance(v, str) and "\x00" in v:
            found.append(Problem(field, "the value contains a NUL character (no environment can hold one)", reason))
    return found


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
    found += code_problems(p.get("command"), p.get("env"), INVALID_SPEC)
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


def one_of(value: Any, field: str, choices, reason: str) -> Problem | None:
    """``value`` must be one of ``choices``."""
    if value in choices:
        return None
    return Problem(field, f"expected one of {', '.join(choices)}, got {describe_value(value)}", reason)


def intent_problems(event_type: str, p: Mapping[str, Any], entitlement: str,
                    max_tasks: int = DEFAULT_MAX_TASKS_PER_JOB) -> list[Problem]:
    """What is wrong with an intent of ``event_type`` (its payload ``p``, keyed to ``entitlement``); empty if
    nothing, or if the event type has no rules here."""
    if event_type in ("EntitlementCreated", "EntitlementUpdated"):
        found: list[Problem | None] = []  # a rule's check is None when it holds; the Nones are dropped below
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
    if event_type in DIMENSION_RULES:
        return [x for x in DIMENSION_RULES[event_type](p, max_tasks) if x is not None]
    return []


# -- the Job Control Plane's per-dimension intents, its reconciled spec, and elasticity (issue 15) --------------

CANARY_ACTIONS = ("start", "promote", "abort")
SIZING_SOURCES = ("person", "autoscaler")
MAX_NOTICE_MS = 24 * 3600 * 1000  # a revocation's notice: at most a day
MAX_LOAD_PER_TASK = 1e12


def _percent(value: Any, field: str) -> Problem | None:
    return quantity(value, field, 0, 100, INVALID_INTENT, limit="(a percentage)")


def _code(p: Mapping[str, Any], required: bool = True) -> list[Problem | None]:
    """A version's argv and env (a push target's, a canary's)."""
    if not p.get("command"):
        return [Problem("command", "expected a non-empty list of strings, got an empty list", INVALID_INTENT)
                if required else None]
    size = size_of(list(p.get("command") or ())) + size_of(dict(p.get("env") or {}))
    if size > MAX_SPEC_BYTES:
        return [Problem("command", f"command and env take {size:,} bytes, at most {MAX_SPEC_BYTES:,}", INVALID_INTENT)]
    return list(code_problems(p.get("command"), p.get("env"), INVALID_INTENT))


def _owner(p: Mapping[str, Any]) -> Problem | None:
    return None if p.get("owner") else Problem("owner", "expected who wants it, got an empty string", INVALID_INTENT)


def _push(p: Mapping[str, Any], max_tasks: int) -> list[Problem | None]:
    found = [_owner(p), _percent(p.get("percent"), "percent"), *_code(p)]
    steps = list(p.get("steps") or ())
    found += [_percent(s, f"steps[{i}]") for i, s in enumerate(steps)]
    if steps and any(b <= a for a, b in zip(steps, steps[1:])):
        found.append(Problem("steps", f"expected ascending percentages, got {steps}", INVALID_INTENT))
    if steps and p.get("percent") not in steps:
        found.append(Problem("percent", f"expected one of the step plan {steps}, got {describe_value(p.get('percent'))}",
                             INVALID_INTENT))
    return found


def _canary(p: Mapping[str, Any], max_tasks: int) -> list[Problem | None]:
    action = p.get("action")
    if (wrong := one_of(action, "action", CANARY_ACTIONS, INVALID_INTENT)) is not None:
        return [wrong]
    found = [_owner(p)]
    if action == "start":
        found += [quantity(p.get("count"), "count", 1, max_tasks, INVALID_INTENT, limit="tasks per job"), *_code(p)]
    if action == "promote":
        found.append(_percent(p.get("promote_percent", 100), "promote_percent"))
    return found


def _sizing(p: Mapping[str, Any], max_tasks: int) -> list[Problem | None]:
    """A task count breaking a rule is an invalid intent (too_many_tasks stays what it is)."""
    return [x if x is None or x.reason != INVALID_SPEC else Problem(x.field, x.message, INVALID_INTENT)
            for x in _sizing_problems(p, max_tasks)]


def _sizing_problems(p: Mapping[str, Any], max_tasks: int) -> list[Problem | None]:
    source = p.get("source")
    if (wrong := one_of(source, "source", SIZING_SOURCES, INVALID_INTENT)) is not None:
        return [wrong]
    found = [_owner(p)]
    if p.get("tasks") is not None or source == "autoscaler":
        found.append(task_count(p.get("tasks"), max_tasks, low=0))
    if p.get("autoscale"):
        lo, hi = p.get("min_tasks"), p.get("max_tasks")
        found += [task_count(lo, max_tasks, "min_tasks", low=0), task_count(hi, max_tasks, "max_tasks", low=1)]
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            found.append(Problem("min_tasks", f"expected at most max_tasks ({hi:,}), got {lo:,}", INVALID_INTENT))
        per = p.get("load_per_task")
        if not isinstance(per, (int, float)) or isinstance(per, bool) or not 0 < per <= MAX_LOAD_PER_TASK:
            found.append(Problem("load_per_task", f"expected a positive number, got {describe_value(per)}",
                                 INVALID_INTENT))
        if source == "person" and p.get("tasks") is not None:
            found.append(Problem("tasks", "a size to pin or autoscaling, not both", INVALID_INTENT))
    return found


def _resources(p: Mapping[str, Any], max_tasks: int) -> list[Problem | None]:
    r = p.get("resources") or {}
    return [_owner(p),
            quantity(r.get("cpu_millicores"), "resources.cpu_millicores", 1, MAX_TASK_CPU_MILLICORES, INVALID_INTENT,
                     limit="millicores per task (no machine has more)"),
            quantity(r.get("memory_mib"), "resources.memory_mib", 1, MAX_TASK_MEMORY_MIB, INVALID_INTENT,
                     limit="MiB per task (no machine has more)")]


def _elasticity(p: Mapping[str, Any], max_tasks: int) -> list[Problem | None]:
    return [Problem(k, f"expected true or false, got {describe_value(p.get(k))}", INVALID_INTENT)
            for k in ("elastic", "lend_idle") if not isinstance(p.get(k, True), bool)] + [quantity(p.get("max_borrowed_machines", 0), "max_borrowed_machines", 0, MAX_QUOTA_MACHINES,
                     INVALID_INTENT, limit="machines (more than a region has)"),
            quantity(p.get("revoke_notice_ms", 0), "revoke_notice_ms", 0, MAX_NOTICE_MS, INVALID_INTENT,
                     limit="ms (a day)")]


def _reconciled(p: Mapping[str, Any], max_tasks: int) -> list[Problem | None]:
    """The Job Control Plane's output, read by the scheduler: a spec whose command is per version."""
    found: list[Problem | None] = list(spec_problems({**p, "command": ["-"]}, max_tasks))
    versions = {v["version"]: v for v in p.get("versions") or ()}
    for i, v in enumerate(p.get("versions") or ()):
        found += [Problem(f"versions[{i}].{x.field}", x.message, INVALID_SPEC) for x in _code(v) if x is not None]
    named = [("stable_version", p.get("stable_version"))] + [
        (f"{k}.version", (p.get(k) or {}).get("version")) for k in ("push", "canary") if p.get(k)]
    found += [Problem(f, f"no such version in versions ({sorted(versions)})", INVALID_SPEC)
              for f, v in named if v not in versions]
    if p.get("push"):
        found.append(quantity(p["push"].get("percent"), "push.percent", 0, 100, INVALID_SPEC, limit="(a percentage)"))
    if p.get("canary"):
        found.append(quantity(p["canary"].get("count"), "canary.count", 0, max_tasks, INVALID_SPEC))
    return found


DIMENSION_RULES = {"PushIntentDeclared": _push, "CanaryIntentDeclared": _canary, "SizingIntentDeclared": _sizing,
                   "ResourcesIntentDeclared": _resources, "EntitlementElasticityChanged": _elasticity,
                   "JobSpecReconciled": _reconciled}


def refusal(problems: list[Problem]) -> tuple[str, str]:
    """(reason, message) of a refusal for ``problems`` (not empty): the first problem's reason, every problem."""
    return problems[0].reason, "; ".join(map(str, problems))
