"""The API's request bodies (strict: a string is not a number, an unknown field is refused). A job spec's is made
from processors/frontend/jobspec.py's ``SHAPE`` (what `ropewalk job submit FILE` takes), the one place its fields and
types are written; the route then checks it with ``jobspec``'s rules (``routes/jobs.py``)."""
from typing import TYPE_CHECKING, Any, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, create_model

from processors.frontend import jobspec


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _spec_model() -> tuple[type[Strict], type[Strict]]:
    """``Resources`` and ``JobSpec`` from ``jobspec.SHAPE``: the fields ``jobspec.REQUIRED`` names are required,
    except ``entitlement`` (required to submit; an update keeps the job's); the others may be left out or null."""
    amounts: dict[str, Any] = {f: (t, ...) for f, t in jobspec.RESOURCES.items()}
    resources = create_model("Resources", __base__=Strict, **amounts)
    required = set(jobspec.REQUIRED) - {"entitlement"}
    fields: dict[str, Any] = {}
    for f, t in jobspec.SHAPE.items():
        t = resources if t is jobspec.RESOURCES else t
        fields[f] = (t, ...) if f in required else (t | None, None)
    spec = create_model("JobSpec", __base__=Strict, __doc__="A job spec, as `ropewalk job submit FILE` takes it "
                        "(processors/frontend/jobspec.py).", **fields)
    return resources, spec


if TYPE_CHECKING:  # a model made at run time is no type to a checker: to it, both are Strict models (fields: SHAPE's)
    Resources: TypeAlias = Strict
    JobSpec: TypeAlias = Strict
else:
    Resources, JobSpec = _spec_model()


class EntitlementCreate(Strict):
    name: str
    quota_machines: int
    machine_type: str | None = None
    dc_pin: str | None = None
    host_profile: str | None = None


class EntitlementUpdate(Strict):
    quota_machines: int | None = None
    machine_type: str | None = None
    dc_pin: str | None = None
    host_profile: str | None = None


class EntitlementMove(Strict):
    partition: int
    reason: str = ""
    wait_s: float | None = Field(None, ge=0, le=600)


class Resize(Strict):
    tasks: int


class Stop(Strict):
    reason: str = ""


class MaintenancePlan(Strict):
    """Exactly one of machines, rack (DC/MSB/RACK), msb (DC/MSB)."""
    machines: list[str] | None = None
    rack: str | None = None
    msb: str | None = None
    start_ms: int
    duration_ms: int = Field(gt=0)
    deadline_ms: int | None = None
    reason: str = "maintenance"


class PowerDomain(Strict):
    """Exactly one of dc, msb (DC/MSB), rack (DC/MSB/RACK): the fault domain whose power is lost or back."""
    dc: str | None = None
    msb: str | None = None
    rack: str | None = None


class Elasticity(BaseModel):
    model_config = ConfigDict(extra="forbid")
    elastic: bool
    max_borrowed_machines: int = Field(0, ge=0)
    revoke_notice_ms: int = Field(30_000, ge=0)
    lend_idle: bool = True
