"""Job specs as users write them (YAML or JSON) → the payload of JobSubmitted / JobSpecChanged. Pure.

    name: web
    entitlement: e1
    tasks: 6
    command: ["sleep", "3600"]
    resources: {cpu_millicores: 1000, memory_mib: 2048}
    requirements: {machine_type: skylake}     # optional hard requirements: machine_type, dc
    spread: msb                               # dc | msb | rack (default msb)
    max_unavailable: 1                        # default 1: tasks down at once, for any reason, in an update
    env: {KEY: value}                         # optional
    controller: zk-leader-last                # optional: the job's TaskController (processors/taskcontrol)

A wrong spec is refused with the field that is wrong: `resources.cpu_millicores: expected a positive
integer up to 1,000,000, got string 'lots'`. This module checks the shape of what a user wrote (fields, types);
the rules every quantity and choice must meet are ``processors/rules.py``'s, the ones the scheduler applies too: a
task count from 1 to the region's limit (``ROPEWALK_MAX_TASKS_PER_JOB``, default 25,000: Twine's largest jobs have
~15K tasks; `tasks: at most 25,000 tasks per job (ROPEWALK_MAX_TASKS_PER_JOB), got 30,000`), resources no machine
could lack, a spread level, known requirements, argv and env that fit a record. The job id is
`<entitlement>.<name>`: unique in the region (a scheduler shard only sees its own entitlements, so a bare name could
not be checked for uniqueness across shards).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from infra.config import DEFAULT_MAX_TASKS_PER_JOB
from processors import rules
from streams.validate import describe_value

# The shape of a job spec, written once: each field and its type as a user writes it (``validate_spec`` checks these
# types, naming the field; the API's request body, processors/api/models.JobSpec, is made from this table; the Avro
# schemas of JobSubmitted and JobSpecChanged are checked against it in tests/unit/test_jobspec.py).
RESOURCES: Mapping[str, type] = MappingProxyType({"cpu_millicores": int, "memory_mib": int})
SHAPE: Mapping[str, Any] = MappingProxyType({
    "name": str, "entitlement": str, "tasks": int, "command": list[str], "resources": RESOURCES,
    "requirements": dict[str, str], "spread": str, "max_unavailable": int, "env": dict[str, str], "controller": str,
})
FIELDS = tuple(SHAPE)
REQUIRED = ("name", "entitlement", "tasks", "command", "resources")
MAX_TASKS = DEFAULT_MAX_TASKS_PER_JOB  # the default limit (Config.max_tasks_per_job, ROPEWALK_MAX_TASKS_PER_JOB)


class JobSpecError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def job_id(entitlement: str, name: str) -> str:
    return f"{entitlement}.{name}"


def parse_text(text: str, source: str = "job spec") -> Any:
    """YAML (a superset of JSON) → data; a syntax error names the line."""
    import yaml  # noqa: PLC0415 - start-up: yaml (~12 ms); CLI path

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise JobSpecError("", f"{source} is not valid YAML/JSON{where}: {getattr(exc, 'problem', exc)}") from None


def refuse(problems: list[rules.Problem], fields: dict[str, str] | None = None) -> None:
    """Raise JobSpecError for the first of ``problems`` (if any), its field renamed by ``fields`` (a CLI flag)."""
    if problems:
        first = problems[0]
        raise JobSpecError((fields or {}).get(first.field, first.field), first.message)


def _name(value: Any, field: str) -> str:
    refuse([p for p in [rules.name_problem(value, field, rules.INVALID_SPEC)] if p is not None])
    return value


def validate_spec(data: Any, entitlement_override: str | None = None, max_tasks: int = MAX_TASKS) -> dict:  # noqa: C901
    """The JobSubmitted payload (without spec_version) for a user's spec, or JobSpecError naming the field;
    ``max_tasks``: the region's limit of tasks per job (``Config.max_tasks_per_job``)."""
    if not isinstance(data, Mapping):
        raise JobSpecError("", f"a job spec is a mapping of {', '.join(FIELDS)}; got {describe_value(data)}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise JobSpecError(unknown[0], f"unknown field (known: {', '.join(FIELDS)})")
    spec = dict(data)
    if entitlement_override is not None:
        spec["entitlement"] = entitlement_override
    for f in REQUIRED:
        if f not in spec or spec[f] is None:
            raise JobSpecError(f, "missing required field")
    name = _name(spec["name"], "name")
    entitlement = _name(spec["entitlement"], "entitlement")
    command = spec["command"]
    if isinstance(command, str):
        raise JobSpecError("command", "expected a list of arguments (argv), e.g. [\"sleep\", \"3600\"]; "
                                      f"got {describe_value(command)}")
    if not isinstance(command, list) or not command:
        raise JobSpecError("command", f"expected a non-empty list of strings, got {describe_value(command)}")
    for i, arg in enumerate(command):
        if not isinstance(arg, str):
            raise JobSpecError(f"command[{i}]", f"expected a string, got {describe_value(arg)}")
    res = spec["resources"]
    if not isinstance(res, Mapping):
        raise JobSpecError("resources", f"expected a mapping with {' and '.join(RESOURCES)}, got {describe_value(res)}")
    extra = sorted(set(res) - set(RESOURCES))
    if extra:
        raise JobSpecError(f"resources.{extra[0]}", f"unknown field (known: {', '.join(RESOURCES)})")
    for f in RESOURCES:
        if f not in res:
            raise JobSpecError(f"resources.{f}", "missing required field")
    reqs = spec.get("requirements") or {}
    if not isinstance(reqs, Mapping):
        raise JobSpecError("requirements", f"expected a mapping, got {describe_value(reqs)}")
    env = spec.get("env") or {}
    if not isinstance(env, Mapping):
        raise JobSpecError("env", f"expected a mapping of strings, got {describe_value(env)}")
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise JobSpecError(f"env.{k}", f"expected a string value, got {describe_value(v)} (quote numbers)")
    controller = spec.get("controller")
    if controller is not None:
        controller = _name(controller, "controller")
    payload = {
        "job_id": job_id(entitlement, name), "name": name, "tasks": spec["tasks"], "command": list(command),
        "resources": {f: res[f] for f in RESOURCES},
        "requirements": dict(reqs), "spread": spec.get("spread", "msb"),
        "max_unavailable": spec.get("max_unavailable", 1), "env": dict(env), "controller": controller,
    }
    refuse(rules.spec_problems(payload, max_tasks))  # the rules the scheduler applies too
    return {**payload, "entitlement": entitlement}


@dataclass(frozen=True)
class ValidSpec:
    """A job spec that passed ``validate_spec`` at a door (the CLI's file, the API's body): what is past the door
    takes it as it is and checks nothing again. Only ``check`` makes one."""

    entitlement: str
    payload: Mapping[str, Any]  # the JobSubmitted / JobSpecChanged payload, without spec_version and entitlement

    @property
    def job_id(self) -> str:
        return str(self.payload["job_id"])

    def spec(self) -> dict[str, Any]:
        """The spec as a user writes it (``FIELDS``, defaults filled in): what a client sends the API."""
        p = {k: v for k, v in self.payload.items() if k != "job_id" and v is not None}
        return {**p, "entitlement": self.entitlement}


def check(data: Any, entitlement_override: str | None = None, max_tasks: int = MAX_TASKS) -> ValidSpec:
    """``validate_spec``, as the value the rest of the front end trusts; JobSpecError naming the field."""
    payload = validate_spec(data, entitlement_override, max_tasks)
    entitlement = payload.pop("entitlement")
    return ValidSpec(entitlement, MappingProxyType(payload))


def spec_json(payload: Mapping[str, Any]) -> str:
    return json.dumps(payload, sort_keys=True)
