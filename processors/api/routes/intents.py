"""``/v1/intents``, ``/v1/jobs/{job}/intents...``: the Job Control Plane's intents, their ledger and history, and
declaring one (issue 15)."""
from typing import Any, Literal

from fastapi import APIRouter

from processors.api import authz
from processors.api.door import Caller, JobId, call
from processors.frontend import service as fe

router = APIRouter(tags=["intents"])


@router.get("/v1/intents")
async def intents_list(door: Caller) -> list[dict]:
    rows = await call(door.front.intents)
    return [r for r in rows if authz.visible(door.user, fe.entitlement_of_job(r["job"]))]


@router.get("/v1/jobs/{job}/intents")
async def intents_show(job: JobId, door: Caller) -> dict:
    door.allow("intents.view", fe.entitlement_of_job(job))
    return await call(door.front.intents, job)


@router.get("/v1/jobs/{job}/intents/history")
async def intents_history(job: JobId, door: Caller) -> list[dict]:
    door.allow("intents.view", fe.entitlement_of_job(job))
    return await call(door.front.intents_history, job)


@router.get("/v1/jobs/{job}/intents/ledger")
async def intents_ledger(job: JobId, door: Caller) -> list[dict]:
    door.allow("intents.view", fe.entitlement_of_job(job))
    return await call(door.front.intents_ledger, job)


@router.post("/v1/jobs/{job}/intents/{dimension}", status_code=202)
async def intent_declare(job: JobId, dimension: Literal["push", "canary", "size", "resources"],
                         body: dict[str, Any], door: Caller) -> dict:
    door.allow("intents.declare", fe.entitlement_of_job(job))
    return await call(door.front.intent_declare, job, dimension, body)
