"""``/v1/maintenance``: plan (``dry_run``: what it would do), the windows not ended, end one."""
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from processors.api.door import Caller, DryRun, call
from processors.api.errors import ApiError
from processors.api.models import MaintenancePlan
from processors.api.routes.machines import machines
from processors.frontend import service as fe

router = APIRouter(tags=["maintenance"])


@router.post("/v1/maintenance", status_code=201,
             responses={200: {"description": "dry_run: what the maintenance would do"}})
async def maintenance_plan(body: MaintenancePlan, door: Caller, dry_run: DryRun = False) -> JSONResponse:
    door.allow("maintenance.plan", None)
    chosen = [k for k in ("machines", "rack", "msb") if getattr(body, k) is not None]
    if len(chosen) != 1:
        raise ApiError(400, fe.INVALID_REQUEST, "give exactly one of machines, rack, msb"
                       + (f" (got {', '.join(chosen)})" if chosen else ""))
    doc = await call(door.front.maintenance_plan, start_ms=body.start_ms, duration_ms=body.duration_ms,
                     deadline_ms=body.deadline_ms, machines=body.machines, rack=body.rack, msb=body.msb,
                     reason=body.reason, dry_run=dry_run)
    return JSONResponse(doc, 200 if dry_run else 201)


@router.get("/v1/maintenance")
async def maintenance_windows(door: Caller) -> list[dict]:
    rows = await call(door.front.maintenance_windows)
    if door.user.region_admin:
        return rows
    seen = {m["id"] for m in await machines(door, None, False, None)}  # a window shows on the machines the user may see
    return [dict(r, machines=[m for m in r["machines"] if m in seen]) for r in rows
            if seen.intersection(r["machines"])]


@router.post("/v1/maintenance/{unavailability_id}/end")
async def maintenance_end(unavailability_id: str, door: Caller) -> dict:
    door.allow("maintenance.end", None)
    return await call(door.front.maintenance_end, unavailability_id)
