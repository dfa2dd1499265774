"""Job specs: a bad spec is refused naming the wrong field."""
import pytest

from infra.config import DEFAULT_MAX_TASKS_PER_JOB, Config
from processors.api.models import JobSpec, Resources
from processors.frontend.jobspec import FIELDS, JobSpecError, check, parse_text, validate_spec
from processors.frontend.service import FrontendError, spec_payload
from streams.serde import SchemaRegistry

GOOD = {"name": "web", "entitlement": "e1", "tasks": 6, "command": ["sleep", "3600"],
        "resources": {"cpu_millicores": 1000, "memory_mib": 2048}}


def spec(**over):
    d = {**GOOD, **over}
    return {k: v for k, v in d.items() if v is not ...}


@pytest.mark.parametrize("data,field,message", [
    (spec(tasks=0), "tasks", "expected a positive integer"),
    (spec(tasks="6"), "tasks", "got string '6'"),
    (spec(tasks=True), "tasks", "got boolean"),
    (spec(tasks=...), "tasks", "missing required field"),
    (spec(name="we b"), "name", "expected a name"),
    (spec(entitlement=...), "entitlement", "missing required field"),
    (spec(command="sleep 3600"), "command", "expected a list of arguments"),
    (spec(command=[]), "command", "non-empty list"),
    (spec(command=["sleep", 3600]), "command[1]", "expected a string, got number 3600"),
    (spec(resources={"cpu_millicores": 1000}), "resources.memory_mib", "missing required field"),
    (spec(resources={"cpu_millicores": -1, "memory_mib": 1}), "resources.cpu_millicores", "positive integer"),
    (spec(resources={"cpu_millicores": 1, "memory_mib": 1, "gpu": 1}), "resources.gpu", "unknown field"),
    (spec(resources=4), "resources", "expected a mapping"),
    (spec(requirements={"machine_type": 5}), "requirements.machine_type", "non-empty string"),
    (spec(requirements={"colour": "red"}), "requirements.colour", "unknown requirement"),
    (spec(spread="planet"), "spread", "expected one of dc, msb, rack"),
    (spec(max_unavailable=0), "max_unavailable", "positive integer"),
    (spec(env={"PORT": 80}), "env.PORT", "quote numbers"),
    (spec(replicas=3), "replicas", "unknown field"),
    ([1, 2], "", "a job spec is a mapping"),
])
def test_bad_specs_name_the_field(data, field, message):
    with pytest.raises(JobSpecError) as exc:
        validate_spec(data)
    assert exc.value.field == field
    assert message in str(exc.value)


def test_good_spec_fills_defaults_and_names_the_job():
    p = validate_spec(spec(requirements={"machine_type": "skylake"}))
    assert p["job_id"] == "e1.web" and p["spread"] == "msb" and p["max_unavailable"] == 1 and p["env"] == {}
    assert validate_spec(spec(), entitlement_override="e2")["job_id"] == "e2.web"


@pytest.mark.parametrize("text,ok", [
    ('{"name": "web"}', True),
    ("name: web\ntasks: 3\n", True),
    ("name: [unclosed\n", False),
])
def test_parse_text(text, ok):
    if ok:
        assert parse_text(text)["name"] == "web"
    else:
        with pytest.raises(JobSpecError, match="not valid YAML/JSON at line"):
            parse_text(text)


# -- the size of a job: served or refused at the door --------------------------------------------------------------

LIMITS = {  # tasks, max_tasks (None: the default, 25,000) -> refusal message or None
    "Twine's largest job (~15K tasks)": (15_000, None, None),
    "the default limit itself": (25_000, None, None),
    "one over the default": (25_001, None, "tasks: at most 25,000 tasks per job (ROPEWALK_MAX_TASKS_PER_JOB), got 25,001"),
    "a region's own lower limit": (600, 500, "tasks: at most 500 tasks per job (ROPEWALK_MAX_TASKS_PER_JOB), got 600"),
    "within a region's higher limit": (40_000, 50_000, None),
}


@pytest.mark.parametrize("tasks, max_tasks, refusal", LIMITS.values(), ids=LIMITS)
def test_a_job_over_the_limit_is_refused_naming_the_field_and_the_limit(tasks, max_tasks, refusal):
    kwargs = {} if max_tasks is None else {"max_tasks": max_tasks}
    if refusal is None:
        assert validate_spec(spec(tasks=tasks), **kwargs)["tasks"] == tasks
        return
    with pytest.raises(JobSpecError) as exc:
        validate_spec(spec(tasks=tasks), **kwargs)
    assert exc.value.field == "tasks" and str(exc.value) == refusal and "\n" not in str(exc.value)


def test_the_default_limit_is_the_configured_one():
    assert DEFAULT_MAX_TASKS_PER_JOB == 25_000
    assert Config.from_env({}).max_tasks_per_job == 25_000
    assert Config.from_env({"ROPEWALK_MAX_TASKS_PER_JOB": "1000"}).max_tasks_per_job == 1000
    with pytest.raises(ValueError, match="ROPEWALK_MAX_TASKS_PER_JOB must be >= 1"):
        Config.from_env({"ROPEWALK_MAX_TASKS_PER_JOB": "0"})


def test_the_three_shapes_of_a_job_spec_agree():
    """A job spec's shape is written twice (issue 31): ``jobspec.SHAPE`` (what ``validate_spec``, the one check both
    doors run, takes; the API's request body, ``processors/api/models.JobSpec``, is made from it, for the OpenAPI
    document and pydantic's strict parse) and the Avro schemas of JobSubmitted and JobSpecChanged (what the log
    holds). A field added to one of them and not the other fails here."""
    assert tuple(JobSpec.model_fields) == FIELDS
    payload = validate_spec(GOOD)
    assert tuple(Resources.model_fields) == tuple(payload["resources"])
    registry = SchemaRegistry.from_dir()
    for event in ("JobSubmitted", "JobSpecChanged"):
        schema = registry.reader(event)
        resources = next(f for f in schema.raw["fields"] if f["name"] == "resources")["type"]
        # on the log: the payload without the entitlement (the envelope's), with the spec's version
        assert schema.field_names - {"envelope"} == set(payload) - {"entitlement"} | {"spec_version"}, event
        assert [f["name"] for f in resources["fields"]] == list(payload["resources"]), event


# -- checked once, at the door: what is past it trusts a ValidSpec -------------------------------------------------

ROUND_TRIPS = {  # a spec as a user writes it -> what the CLI sends the API (ValidSpec.spec) checks the same again
    "the minimal spec": spec(),
    "every field": spec(requirements={"machine_type": "skylake", "dc": "dc1"}, spread="rack", max_unavailable=2,
                        env={"PORT": "80"}, controller="zk-leader-last"),
    "defaults written out": spec(spread="msb", max_unavailable=1, env={}, requirements={}),
}


@pytest.mark.parametrize("data", ROUND_TRIPS.values(), ids=ROUND_TRIPS)
def test_a_checked_spec_sent_on_is_the_same_spec(data):
    valid = check(data)
    assert valid.entitlement == "e1" and valid.job_id == "e1.web" and "entitlement" not in valid.payload
    assert {**valid.payload, "entitlement": valid.entitlement} == validate_spec(data)
    assert check(valid.spec()) == valid  # the API's door, given what the CLI's door let through
    assert check(valid.spec(), entitlement_override="e2").job_id == "e2.web"


def test_a_refusal_at_the_door_names_the_file_and_the_field():
    with pytest.raises(FrontendError) as exc:
        spec_payload(spec(tasks="6"), None, 100, "web.yaml: ")
    assert exc.value.message.startswith("web.yaml: tasks: ") and "got string '6'" in exc.value.message
