"""The HTTP API (FastAPI on uvicorn): what the CLI does, for authenticated users, in front of the log.

Every route but ``/healthz`` needs ``Authorization: Bearer <token>`` (``users.py``); every action is decided by
``authz.decide`` (403 with the reason otherwise) and done by the shared front end (``processors/frontend/service.py``),
which validates with the intent rules, produces with the API's own broker principal (``api``) and records the user
in the envelope's ``principal``. Errors are ``{"error": <reason constant>, "message": <one line naming the field>}``.

| method, path                          | action (authz.py)      | answer |
|---------------------------------------|------------------------|--------|
| GET /v1/whoami                        | any user               | the user, roles, region admin |
| GET /v1/entitlements                  | entitlement.view       | the entitlements the user may see |
| POST /v1/entitlements                 | entitlement.quota      | 201, EntitlementCreated |
| PATCH /v1/entitlements/{name}         | entitlement.update; a quota: entitlement.quota | 202, EntitlementUpdated |
| POST /v1/entitlements/{name}/move     | entitlement.move       | 202, EntitlementMoveRequested; with wait_s, once it moved (409: refused) |
| GET /v1/jobs[?entitlement=]           | job.view               | job views (all the user may see) |
| POST /v1/jobs[?wait=&timeout_s=]      | job.submit             | 201 accepted, 409 refused (reason), 202 pending / not waited |
| GET /v1/jobs/{job}[?at=]              | job.view               | the job's view (`job status --json`); `at`: as it was then; a job stopped and gone: its last state, `deleted` |
| GET /v1/jobs/{job}/describe[?events=] | job.view               | tasks with their story, recent events, last refusals (`job describe`) |
| GET /v1/jobs/{job}/logs[?task=&tail=&follow=] | job.view       | the tasks' output, text (`job logs`; a simulated machine's task has none: header X-Ropewalk-No-Output) |
| PUT /v1/jobs/{job}/spec               | job.update             | a rolling update (verdict as submit, not waited by default) |
| POST /v1/jobs/{job}/resize, /stop     | job.resize, job.stop   | as update |
| GET /v1/machines[?entitlement=&free=&at=] | machine.view       | machine views (free machines: any user); `at`: as then |
| POST /v1/machines/{id}/fail, /recover | machine.fail, .recover | the events (`fail?dry_run=true`: what would happen) |
| POST /v1/power/loss, /v1/power/restore | machine.power_loss, .power_restore | `{dc|msb|rack}`: a fault domain's power lost or back: the machines changed, the POWER UEs |
| POST /v1/maintenance, /v1/maintenance/{id}/end | maintenance.plan, .end | the plan (`?dry_run=true`: what it would do) |
| GET /v1/maintenance                   | machine.view (filtered) | maintenance not ended: start, deadline, machines (those on machines the user may see) |
| GET /v1/region?at=                    | region.view            | the whole region at a moment (`ropewalk at TIME`) |
| GET /v1/tasks/{task}/explain[?at=&why_not=] | job.view        | why the task is where it is (`ropewalk explain`) |
| GET /v1/rebalance/plans[?entitlement=&all=] | rebalance.view  | the ReBalancer's plans, each move's progress (`rebalance plan --json`) |
| GET /v1/replay?...                    | replay.view (one entitlement or job) / region.view | NDJSON: one event per line, then `{"stats": ...}` |
| GET /v1/events/jobs, /v1/events/machines[?entitlement=] | job.view / machine.view | server-sent events |
| GET /v1/intents                       | intents.view (filtered) | every job with intents: who wants what, the reconciled spec |
| GET /v1/jobs/{job}/intents[/history]  | intents.view           | the job's intents and reconciled spec; every reconciliation with provenance |
| GET /v1/jobs/{job}/intents/ledger     | intents.view           | every intent declared: applied (generation), refused (reason, field), declared |
| POST /v1/jobs/{job}/intents/{push,canary,size,resources} | intents.declare | 202, the intent (the Job Control Plane reconciles it) |
| GET /v1/jobs/{job}/srm                | srm.view               | the autoscaler's picture of the job |
| GET /v1/jobs/{job}/srm/plan           | srm.view               | what the SRM would decide now, and why (a dry run: writes nothing) |
| GET /v1/srm                           | srm.view (filtered)    | every job the SRM knows: picture, decision now, latest decision |
| GET /v1/srm/decisions[?job=]          | srm.view (a job) / region.view | the SRM's decisions with inputs and forecast, reversals |
| GET /v1/loans[?entitlement=]          | loans.view (one entitlement) / region.view | loans, revocations, returns (took_ms vs bound), p99 |
| PUT /v1/entitlements/{name}/elasticity | entitlement.elastic   | 202, EntitlementElasticityChanged |
| GET /healthz                          | none                   | `{"ok": true}` |
| GET /metrics                          | none                   | Prometheus text (infra/metrics.py) |

The routes are processors/api/routes/, one ``APIRouter`` per resource, each route acting through a ``Door``
(processors/api/door.py: the user, authorized per action, the front end as that user); the request bodies are
processors/api/models.py. ``create_app`` assembles them with the error handlers, the small doors and the web UI.

Server-sent events: each state record as ``event: job`` (or ``machine``) with its view as ``data``, first the
current state of everything the user may see, then ``event: ready``, then each change as it is published (a
comment every ``KEEPALIVE_S`` while nothing changes). A web UI subscribes with ``EventSource``. At most
``MAX_STREAMS`` streams are open at once (``ROPEWALK_API_MAX_STREAMS``): one more is refused with 503
``too_many_streams`` and ``Retry-After``; a client that stops reading holds its stream's reader still (nothing is
queued for it: the reader is polled only as the client takes what was sent), and one gone is closed at the next poll.
"""
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from infra import metrics
from infra.config import Config
from infra.metrics import API_REQUESTS
from processors.api import ui, users as users_mod
from processors.api.door import PRODUCER, Door, UsersFile
from processors.api.errors import ApiError
from processors.api.guards import BodyLimit, NoTokenInUrl
from processors.api.routes import entitlements, history, intents, jobs, loans, log, machines, maintenance, meta, \
    rebalance, srm
from processors.frontend import service as fe
from processors.frontend.service import FrontendError
from processors.history.reader import MomentGone
from streams.clients import EventProducer
from streams.partitionmap import MapFollower
from streams.serde import SchemaRegistry

MOMENT_GONE = "moment_gone"  # a look needs records the broker deleted (processors/history/reader.MomentGone): 410
# the routers in the order of the table above (and of the OpenAPI document)
ROUTERS = (meta, entitlements, jobs, machines, maintenance, rebalance, intents, srm, loans, history, log)


class TimedRequests:
    """ASGI middleware: ``ropewalk_api_request_duration_seconds`` by route template (``/v1/jobs/{job}``, never the
    ids in the path), method and status. Plain ASGI, so event streams pass through untouched (a stream's duration
    is how long it was open)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.monotonic(), ["500"]

        async def sent(message):
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = scope.get("route")
            API_REQUESTS.labels(route=getattr(route, "path", "unmatched"), method=scope["method"],
                                status=status[0]).observe(time.monotonic() - t0)


def create_app(cfg: Config, *, users_path: Path | None = None) -> FastAPI:
    registry = SchemaRegistry.from_dir()
    users_file = UsersFile(users_path or cfg.secrets / users_mod.USERS_FILE)
    metrics.own(metrics.API_REQUESTS)  # what /metrics exports from the start (infra/metrics.py)
    metrics.build_info(PRODUCER)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.partition_map = await run_in_threadpool(MapFollower.start, cfg, registry, name="api-map")
        app.state.producer = EventProducer(cfg, registry, PRODUCER, route=app.state.partition_map,
                                           **{"message.timeout.ms": 15000})
        yield
        await run_in_threadpool(app.state.producer.flush, 10)
        await run_in_threadpool(app.state.partition_map.close)

    app = FastAPI(title="Ropewalk API", version="1", lifespan=lifespan,
                  description="The control plane of a Ropewalk region for authenticated users: entitlements, jobs, "
                              "machines, maintenance, the audit log and live state. Bearer tokens: `ropewalk user "
                              "add`.")
    app.state.cfg, app.state.registry, app.state.users = cfg, registry, users_file
    app.state.streams = 0  # event streams open now (routes/log.py)
    app.state.max_streams = int(os.environ.get(log.MAX_STREAMS_ENV) or log.MAX_STREAMS)
    errors(app)
    # The small doors (guards.py): no token in a URL, no body beyond MAX_BODY_BYTES; inside TimedRequests, which
    # counts their refusals too.
    app.add_middleware(BodyLimit)
    app.add_middleware(NoTokenInUrl)
    app.add_middleware(TimedRequests)
    for routes in ROUTERS:
        app.include_router(routes.router)
    ui.mount(app, users=users_file, api=ui_calls(app), events=lambda request, user, kind, entitlement: log.events(
        request, Door(app, user), kind, entitlement), replay_docs=lambda user, **flt: log.replay_docs(
        Door(app, user), **flt))  # the web UI at /ui/ (processors/api/ui)
    return app


def errors(app: FastAPI) -> None:
    """Every error as ``{"error": <reason constant>, "message": <one line naming the field>}``."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse({"error": exc.reason, "message": exc.message}, exc.status, headers=exc.headers)

    @app.exception_handler(FrontendError)
    async def _frontend_error(request: Request, exc: FrontendError):
        return JSONResponse({"error": exc.reason, "message": exc.message}, exc.status)

    @app.exception_handler(MomentGone)
    async def _moment_gone(request: Request, exc: MomentGone):  # a look before what the broker still holds
        return JSONResponse({"error": MOMENT_GONE, "message": str(exc)}, 410)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(x) for x in first.get("loc", ()) if x not in ("body",))
        return JSONResponse({"error": fe.INVALID_REQUEST, "message": f"{where}: {first.get('msg')}".lstrip(": ")},
                            422)


def ui_calls(app: FastAPI) -> dict:
    """The routes the web UI calls itself (same authorization), each with the user the UI signed in."""
    return {
        "jobs": lambda user, entitlement: jobs.jobs(Door(app, user), entitlement),
        "job_status": lambda job, user, at=None: jobs.job_status(job, Door(app, user), at),
        "machines": lambda user, entitlement, free, at=None: machines.machines(Door(app, user), entitlement, free, at),
        "entitlements": lambda user: entitlements.entitlements(Door(app, user)),
        "rebalance_plans": lambda user, entitlement, all_: rebalance.rebalance_plans(Door(app, user), entitlement,
                                                                                     all_),
        "intents_list": lambda user: intents.intents_list(Door(app, user)),
        "intents_show": lambda job, user: intents.intents_show(job, Door(app, user)),
        "intents_ledger": lambda job, user: intents.intents_ledger(job, Door(app, user)),
        "srm_overview": lambda user: srm.srm_overview(Door(app, user)),
        "loans": lambda user: loans.loans_visible(Door(app, user)),
        "maintenance": lambda user: maintenance.maintenance_windows(Door(app, user)),
    }
