"""``/v1/machines``: the machines' views (free ones: any user), fail and recover; ``/v1/power``: a fault domain's
power lost or back."""
from typing import Literal

from fastapi import APIRouter

from processors.api import authz
from processors.api.door import AtQuery, Caller, DryRun, EntitlementQuery, call
from processors.api.models import PowerDomain

router = APIRouter(tags=["machines"])


@router.get("/v1/machines")
async def machines(door: Caller, entitlement: EntitlementQuery = None, free: bool = False,
                   at: AtQuery = None) -> list[dict]:
    if entitlement is not None:
        door.allow("machine.view", entitlement)
    rows = await call(door.front.machines, entitlement, free, at)
    return [r for r in rows if authz.visible(door.user, r["entitlement"])]


@router.post("/v1/machines/{machine}/{action}")
async def machine_action(machine: str, action: Literal["fail", "recover"], door: Caller,
                         dry_run: DryRun = False) -> dict:
    door.allow(f"machine.{action}", None)
    return await call(door.front.machine_action, machine, action, dry_run=dry_run)


@router.post("/v1/power/{action}")
async def machine_power(action: Literal["loss", "restore"], body: PowerDomain, door: Caller) -> dict:
    door.allow(f"machine.power_{action}", None)
    return await call(door.front.machine_power, action, dc=body.dc, msb=body.msb, rack=body.rack)
