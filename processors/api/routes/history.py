"""``/v1/region``: the whole region at a moment; ``/v1/tasks/{task}/explain``: why a task is where it is
(processors/history)."""
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi import Path as PathParam

from processors.api import authz
from processors.api.door import AT_DESCRIPTION, AtQuery, Caller, call
from processors.frontend import service as fe
from processors.times import MAX_MOMENT_CHARS

# explain --why-not of a machine another entitlement held then, to a user with no role on it: no filter, no scores
WHY_NOT_HIDDEN = "held then by an entitlement you have no role on: its state is not shown"

router = APIRouter(tags=["history"])


@router.get("/v1/region")
async def region(door: Caller, at: Annotated[str, Query(min_length=1, max_length=MAX_MOMENT_CHARS,
                                                        description=AT_DESCRIPTION)]) -> dict:
    door.allow("region.view", None)
    return await call(door.front.region, at)


@router.get("/v1/tasks/{task:path}/explain")
async def explain(task: Annotated[str, PathParam(max_length=200, description="<job>/<index>, e.g. e1.web/0")],
                  door: Caller, at: AtQuery = None,
                  why_not: Annotated[str | None, Query(min_length=1, max_length=200)] = None) -> dict:
    door.allow("job.view", fe.entitlement_of_job(task))
    doc = await call(door.front.explain, task, at, why_not)
    w = doc.get("why_not") or {}
    if "owner" in w and not authz.visible(door.user, w["owner"]):  # another entitlement's machine: not its state
        doc["why_not"] = {"machine": w["machine"], "answer": WHY_NOT_HIDDEN}
    return doc
