"""``/healthz``, ``/metrics`` (unauthenticated: they name no user, job, task or machine) and ``/v1/whoami``."""
from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from processors.api.door import CurrentUser

router = APIRouter(tags=["meta"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"ok": True}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics_text() -> PlainTextResponse:
    """Prometheus metrics of the API process (infra/metrics.py); unauthenticated like /healthz: they name no
    user, job, task or machine."""
    return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/whoami")
async def whoami(user: CurrentUser) -> dict:
    return {"user": user.name, "region_admin": user.region_admin, "roles": dict(user.roles)}
