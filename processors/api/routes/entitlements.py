"""``/v1/entitlements``: list, create (a quota: region admin), update, move to another partition."""
from fastapi import APIRouter

from processors.api import authz
from processors.api.door import Caller, Name, call
from processors.api.models import EntitlementCreate, EntitlementMove, EntitlementUpdate

router = APIRouter(tags=["entitlements"])


@router.get("/v1/entitlements")
async def entitlements(door: Caller) -> list[dict]:
    rows = await call(door.front.entitlements)
    return [r for r in rows if authz.decide(door.user, "entitlement.view", r["entitlement"]).allowed]


@router.post("/v1/entitlements", status_code=201)
async def entitlement_create(body: EntitlementCreate, door: Caller) -> dict:
    door.allow("entitlement.quota", body.name)
    return await call(door.front.entitlement_create, body.name, body.quota_machines,
                      machine_type=body.machine_type, dc=body.dc_pin, host_profile=body.host_profile)


@router.patch("/v1/entitlements/{name}", status_code=202)
async def entitlement_update(name: Name, body: EntitlementUpdate, door: Caller) -> dict:
    door.allow("entitlement.quota" if body.quota_machines is not None else "entitlement.update", name)
    return await call(door.front.entitlement_update, name, body.model_dump())


@router.post("/v1/entitlements/{name}/move", status_code=202)
async def entitlement_move(name: Name, body: EntitlementMove, door: Caller) -> dict:
    door.allow("entitlement.move", name)
    return await call(door.front.entitlement_move, name, body.partition, body.reason, wait_s=body.wait_s)
