"""The API's request bodies (strict: a string is not a number, an unknown field is refused). A job spec's shape is
also processors/frontend/jobspec.py's (what `ropewalk job submit FILE` takes) and the Avro schema of JobSubmitted."""
from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Resources(Strict):
    cpu_millicores: int
    memory_mib: int


class JobSpec(Strict):
    """A job spec, as `ropewalk job submit FILE` takes it (processors/frontend/jobspec.py)."""
    name: str
    entitlement: str | None = None  # required to submit; an update keeps the job's
    tasks: int
    command: list[str]
    resources: Resources
    requirements: dict[str, str] | None = None
    spread: str | None = None
    max_unavailable: int | None = None
    env: dict[str, str] | None = None
    controller: str | None = None


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
