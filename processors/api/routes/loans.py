"""``/v1/loans``: the Resource Broker's elastic loans; ``/v1/entitlements/{name}/elasticity``: an entitlement's
elasticity."""
from fastapi import APIRouter

from processors.api import authz
from processors.api.door import Caller, Door, EntitlementQuery, Name, call
from processors.api.models import Elasticity
from processors.resourcebroker.loans_view import only

router = APIRouter(tags=["loans"])


@router.get("/v1/loans")
async def loans(door: Caller, entitlement: EntitlementQuery = None) -> dict:
    door.allow("loans.view" if entitlement is not None else "region.view", entitlement)
    return await call(door.front.loans, entitlement)


async def loans_visible(door: Door) -> dict:
    """The loans document narrowed to what concerns the entitlements the user holds a role on (all of it for a
    region admin): the web UI's loans page, which a viewer may open without naming an entitlement."""
    user = door.user
    doc = await call(door.front.loans, None)
    return doc if user.region_admin else only(doc, [e for e in user.roles
                                                    if authz.decide(user, "loans.view", e).allowed])


@router.put("/v1/entitlements/{name}/elasticity", status_code=202)
async def elasticity(name: Name, body: Elasticity, door: Caller) -> dict:
    door.allow("entitlement.elastic", name)
    return await call(door.front.elasticity_set, name, body.elastic, body.max_borrowed_machines,
                      body.revoke_notice_ms, body.lend_idle)
