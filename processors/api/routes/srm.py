"""``/v1/srm``, ``/v1/jobs/{job}/srm...``: the autoscaler's picture of jobs, what it would decide now, its
decisions."""
from typing import Annotated

from fastapi import APIRouter, Query

from processors.api import authz
from processors.api.door import JOB_PATTERN, Caller, JobId, call
from processors.frontend import service as fe

router = APIRouter(tags=["srm"])


@router.get("/v1/jobs/{job}/srm")
async def srm_show(job: JobId, door: Caller) -> dict:
    door.allow("srm.view", fe.entitlement_of_job(job))
    return await call(door.front.srm, job)


@router.get("/v1/jobs/{job}/srm/plan")
async def srm_plan(job: JobId, door: Caller) -> dict:
    door.allow("srm.view", fe.entitlement_of_job(job))
    return await call(door.front.srm_plan, job)


@router.get("/v1/srm")
async def srm_overview(door: Caller) -> list[dict]:
    rows = await call(door.front.srm_overview)
    return [r for r in rows if authz.decide(door.user, "srm.view", r["entitlement"]).allowed]


@router.get("/v1/srm/decisions")
async def srm_decisions(door: Caller, job: Annotated[str | None, Query(pattern=JOB_PATTERN)] = None) -> dict:
    scope = fe.entitlement_of_job(job) if job is not None else None
    door.allow("srm.view" if scope is not None else "region.view", scope)
    return await call(door.front.srm_decisions, job)
