"""Job specs: a bad spec is refused naming the wrong field."""
import pytest

from processors.frontend.jobspec import JobSpecError, parse_text, validate_spec

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
