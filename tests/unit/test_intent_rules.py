"""The intent rules (processors/rules.py): one table, applied by the front end at the door and by the
scheduler to what reaches the log anyway. Each case: the intent, the field refused and the reason (None: good)."""
import pytest

from processors import rules
from processors.frontend.jobspec import JobSpecError, validate_spec

ENT = "e1"


def spec(**over):
    p = {"job_id": "e1.web", "name": "web", "spec_version": 1, "tasks": 3, "command": ["sleep", "60"],
         "resources": {"cpu_millicores": 1000, "memory_mib": 256}, "requirements": {}, "spread": "msb",
         "max_unavailable": 1, "env": {}, "controller": None}
    for k, v in over.items():
        if k in ("cpu_millicores", "memory_mib"):
            p["resources"] = {**p["resources"], k: v}
        else:
            p[k] = v
    return p


def ent(**over):
    return {"name": ENT, "quota_machines": 4, "machine_type": None, "dc_pin": None, "host_profile": None, **over}


CASES = {  # (event type, payload) -> (field, reason) of the first problem, or None
    "good spec": (("JobSubmitted", spec()), None),
    "negative tasks": (("JobSubmitted", spec(tasks=-1)), ("tasks", rules.INVALID_SPEC)),
    "no tasks in a spec": (("JobSubmitted", spec(tasks=0)), ("tasks", rules.INVALID_SPEC)),
    "over the job limit": (("JobSubmitted", spec(tasks=25_001)), ("tasks", rules.TOO_MANY_TASKS)),
    "the job limit itself": (("JobSubmitted", spec(tasks=25_000)), None),
    "negative cpu": (("JobSubmitted", spec(cpu_millicores=-5)), ("resources.cpu_millicores", rules.INVALID_SPEC)),
    "absurd cpu": (("JobSubmitted", spec(cpu_millicores=2_000_000)), ("resources.cpu_millicores", rules.INVALID_SPEC)),
    "zero memory": (("JobSpecChanged", spec(memory_mib=0)), ("resources.memory_mib", rules.INVALID_SPEC)),
    "absurd memory": (("JobSpecChanged", spec(memory_mib=2**31 - 1)), ("resources.memory_mib", rules.INVALID_SPEC)),
    "max_unavailable 0": (("JobSpecChanged", spec(max_unavailable=0)), ("max_unavailable", rules.INVALID_SPEC)),
    "spec version 0": (("JobSpecChanged", spec(spec_version=0)), ("spec_version", rules.INVALID_SPEC)),
    "empty command": (("JobSubmitted", spec(command=[])), ("command", rules.INVALID_SPEC)),
    "argv too big to travel": (("JobSubmitted", spec(command=["x" * (300 * 1024)])), ("command", rules.INVALID_SPEC)),
    "unknown spread": (("JobSubmitted", spec(spread="zone")), ("spread", rules.INVALID_SPEC)),
    "unknown requirement": (("JobSubmitted", spec(requirements={"gpu": "a100"})), ("requirements.gpu",
                                                                                   rules.INVALID_SPEC)),
    "empty requirement": (("JobSubmitted", spec(requirements={"dc": ""})), ("requirements.dc", rules.INVALID_SPEC)),
    "resize to 0": (("JobResized", {"job_id": "e1.web", "tasks": 0}), None),
    "negative resize": (("JobResized", {"job_id": "e1.web", "tasks": -3}), ("tasks", rules.INVALID_SPEC)),
    "resize over the limit": (("JobResized", {"job_id": "e1.web", "tasks": 10**6}), ("tasks", rules.TOO_MANY_TASKS)),
    "good entitlement": (("EntitlementCreated", ent()), None),
    "quota 0": (("EntitlementCreated", ent(quota_machines=0)), None),
    "negative quota": (("EntitlementCreated", ent(quota_machines=-5)), ("quota_machines", rules.INVALID_ENTITLEMENT)),
    "absurd quota": (("EntitlementCreated", ent(quota_machines=10**7)), ("quota_machines",
                                                                       rules.INVALID_ENTITLEMENT)),
    "update without quota": (("EntitlementUpdated", {"quota_machines": None, "machine_type": "skylake"}), None),
    "negative quota update": (("EntitlementUpdated", {"quota_machines": -1}), ("quota_machines",
                                                                             rules.INVALID_ENTITLEMENT)),
    "keyed to another entitlement": (("EntitlementCreated", ent(name="e2")), ("name", rules.INVALID_ENTITLEMENT)),
    "a stop has no quantities": (("JobStopped", {"job_id": "e1.web", "reason": ""}), None),
    # env names as POSIX has them; no NUL anywhere exec would meet it (issue 27)
    "env names": (("JobSubmitted", spec(env={"A": "1", "_B2": "x=y", "lower_ok": ""})), None),
    "env name with =": (("JobSubmitted", spec(env={"A=B": "1"})), ("env.A=B", rules.INVALID_SPEC)),
    "env name with a NUL": (("JobSubmitted", spec(env={"A\x00B": "1"})), ("env.A\\x00B", rules.INVALID_SPEC)),
    "env name starting with a digit": (("JobSubmitted", spec(env={"1A": "1"})), ("env.1A", rules.INVALID_SPEC)),
    "empty env name": (("JobSpecChanged", spec(env={"": "1"})), ("env.", rules.INVALID_SPEC)),
    "env name with a dash": (("JobSpecChanged", spec(env={"MY-VAR": "1"})), ("env.MY-VAR", rules.INVALID_SPEC)),
    "env value with a NUL": (("JobSubmitted", spec(env={"A": "x\x00y"})), ("env.A", rules.INVALID_SPEC)),
    "argument with a NUL": (("JobSubmitted", spec(command=["sh", "a\x00b"])), ("command[1]", rules.INVALID_SPEC)),
    "push env name with =": (("PushIntentDeclared", {"job_id": "e1.web", "owner": "alice", "percent": 10,
                                                     "command": ["x"], "env": {"A=B": "1"}, "steps": []}),
                             ("env.A=B", rules.INVALID_INTENT)),
    "canary env with a NUL": (("CanaryIntentDeclared", {"job_id": "e1.web", "owner": "alice", "action": "start",
                                                        "count": 1, "command": ["x"], "env": {"K\x00": "1"}}),
                              ("env.K\\x00", rules.INVALID_INTENT)),
}


@pytest.mark.parametrize("intent, expected", CASES.values(), ids=CASES)
def test_intent_rules(intent, expected):
    event_type, payload = intent
    problems = rules.intent_problems(event_type, payload, ENT, max_tasks=25_000)
    if expected is None:
        assert problems == []
        return
    assert (problems[0].field, problems[0].reason) == expected
    assert problems[0].field in str(problems[0]) and problems[0].message
    assert rules.refusal(problems)[0] == expected[1]


SPEC_CASES = {k: v for k, v in CASES.items() if v[0][0] in ("JobSubmitted", "JobSpecChanged")
              and (v[1] is None or v[1][0] != "spec_version")}


@pytest.mark.parametrize("intent, expected", SPEC_CASES.values(), ids=SPEC_CASES)
def test_the_front_end_refuses_what_the_scheduler_refuses(intent, expected):
    """``job submit``'s validation (jobspec) refuses exactly the specs the rules refuse, naming the same field."""
    p = intent[1]
    user = {"name": p["name"], "entitlement": ENT, "tasks": p["tasks"], "command": p["command"],
            "resources": p["resources"], "requirements": p["requirements"], "spread": p["spread"],
            "max_unavailable": p["max_unavailable"], "env": p["env"]}
    if expected is None:
        assert validate_spec(user, max_tasks=25_000)["job_id"] == "e1.web"
        return
    with pytest.raises(JobSpecError) as exc:
        validate_spec(user, max_tasks=25_000)
    assert exc.value.field == expected[0]
