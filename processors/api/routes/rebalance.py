"""``/v1/rebalance/plans``: the ReBalancer's plans and each move's progress."""
from fastapi import APIRouter

from processors.api import authz
from processors.api.door import Caller, EntitlementQuery, call

router = APIRouter(tags=["rebalance"])


@router.get("/v1/rebalance/plans")
async def rebalance_plans(door: Caller, entitlement: EntitlementQuery = None,
                          all: bool = False) -> list[dict]:  # noqa: A002 - the query parameter's name
    if entitlement is not None:
        door.allow("rebalance.view", entitlement)
    rows = await call(door.front.rebalance_plans, entitlement, all)
    return [r for r in rows if authz.visible(door.user, r["entitlement"])]
