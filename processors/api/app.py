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

Server-sent events: each state record as ``event: job`` (or ``machine``) with its view as ``data``, first the
current state of everything the user may see, then ``event: ready``, then each change as it is published (a
comment every ``KEEPALIVE_S`` while nothing changes). A web UI subscribes with ``EventSource``. At most
``MAX_STREAMS`` streams are open at once (``ROPEWALK_API_MAX_STREAMS``): one more is refused with 503
``too_many_streams`` and ``Retry-After``; a client that stops reading holds its stream's reader still (nothing is
queued for it: the reader is polled only as the client takes what was sent), and one gone is closed at the next poll.
"""
import asyncio
import json
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from infra.config import Config
from processors.api import authz, users as users_mod
from processors.api.errors import ApiError
from processors.api.guards import BodyLimit, NoTokenInUrl
from processors.api.authz import User
from processors.frontend import service as fe
from processors.frontend.service import Frontend, FrontendError
from processors.history.reader import MomentGone
from processors.times import MAX_MOMENT_CHARS
from streams.events import MAX_TIME_MS

PRODUCER = "api"
KEEPALIVE_S = 15.0
# Event streams open at once, at most (each holds a reader of the state topics: a consumer and the latest state of
# what it shows); one more is refused (503, too_many_streams) until one closes. ROPEWALK_API_MAX_STREAMS.
MAX_STREAMS = 64
MAX_STREAMS_ENV = "ROPEWALK_API_MAX_STREAMS"
TOO_MANY_STREAMS = "too_many_streams"
MOMENT_GONE = "moment_gone"  # a look needs records the broker deleted (processors/history/reader.MomentGone): 410
UNAUTHENTICATED = "unauthenticated"
BROKER_UNAVAILABLE = "broker_unavailable"
USERS_UNREADABLE = "users_file_unreadable"
# explain --why-not of a machine another entitlement held then, to a user with no role on it: no filter, no scores
WHY_NOT_HIDDEN = "held then by an entitlement you have no role on: its state is not shown"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"  # rules.NAME
JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}\.[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"  # <entitlement>.<name>
Name = Annotated[str, PathParam(pattern=NAME_PATTERN)]
JobId = Annotated[str, PathParam(pattern=JOB_PATTERN, description="<entitlement>.<name>")]


class TimedRequests:
    """ASGI middleware: ``ropewalk_api_request_duration_seconds`` by route template (``/v1/jobs/{job}``, never the
    ids in the path), method and status. Plain ASGI, so event streams pass through untouched (a stream's duration
    is how long it was open)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from infra.metrics import API_REQUESTS

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


# -- request bodies (strict: a string is not a number) ----------------------------------------------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Resources(Strict):
    cpu_millicores: int
    memory_mib: int


class JobSpec(Strict):
    """A job spec, as `ropewalk job submit FILE` takes it (processors/frontend/jobspec.py)."""
    name: str
    entitlement: str | None = None  # required to submit; an update keeps the job's
    tasks: int
    command: list[str]
    resources: Resources
    requirements: dict[str, str] | None = None
    spread: str | None = None
    max_unavailable: int | None = None
    env: dict[str, str] | None = None
    controller: str | None = None


class EntitlementCreate(Strict):
    name: str
    quota_machines: int
    machine_type: str | None = None
    dc_pin: str | None = None
    host_profile: str | None = None


class EntitlementUpdate(Strict):
    quota_machines: int | None = None
    machine_type: str | None = None
    dc_pin: str | None = None
    host_profile: str | None = None


class EntitlementMove(Strict):
    partition: int
    reason: str = ""
    wait_s: float | None = Field(None, ge=0, le=600)


class Resize(Strict):
    tasks: int


class Stop(Strict):
    reason: str = ""


class MaintenancePlan(Strict):
    """Exactly one of machines, rack (DC/MSB/RACK), msb (DC/MSB)."""
    machines: list[str] | None = None
    rack: str | None = None
    msb: str | None = None
    start_ms: int
    duration_ms: int = Field(gt=0)
    deadline_ms: int | None = None
    reason: str = "maintenance"


class PowerDomain(Strict):
    """Exactly one of dc, msb (DC/MSB), rack (DC/MSB/RACK): the fault domain whose power is lost or back."""
    dc: str | None = None
    msb: str | None = None
    rack: str | None = None


class Elasticity(BaseModel):
    model_config = ConfigDict(extra="forbid")
    elastic: bool
    max_borrowed_machines: int = Field(0, ge=0)
    revoke_notice_ms: int = Field(30_000, ge=0)
    lend_idle: bool = True


# -- the app ---------------------------------------------------------------------------------------------------

class UsersFile:
    """The users file, read again whenever it changes (``ropewalk user add`` needs no restart)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._stamp: tuple | None = None
        self._users = users_mod.parse({})

    def current(self) -> users_mod.Users:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            try:
                self._users = users_mod.load(self.path)
            except users_mod.UsersError as exc:
                raise ApiError(500, USERS_UNREADABLE, str(exc)) from None
            self._stamp = stamp
        return self._users


BEARER = HTTPBearer(auto_error=False, description="a token from `ropewalk user add` (or <secrets>/token)")


def current_user(request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> User:
    """The user of the request's bearer token (401 without one, or with an unknown one)."""
    if cred is None or cred.scheme.lower() != "bearer" or not cred.credentials:
        raise ApiError(401, UNAUTHENTICATED, "a bearer token is required (Authorization: Bearer <token>)",
                       {"WWW-Authenticate": "Bearer"})
    user = request.app.state.users.current().authenticate(cred.credentials)
    if user is None:
        raise ApiError(401, UNAUTHENTICATED, "unknown token", {"WWW-Authenticate": "Bearer"})
    return user


CurrentUser = Annotated[User, Depends(current_user)]
Wait = Annotated[bool | None, Query(description="wait for the scheduler's verdict")]
WaitS = Annotated[float, Query(ge=0, le=fe.MAX_WAIT_S, description="how long to wait at most, s")]
EntitlementQuery = Annotated[str | None, Query(pattern=NAME_PATTERN)]
AT_DESCRIPTION = ("a moment: ms since epoch, ISO-8601, now, now-DURATION (now-15m), or TOPIC/PARTITION@OFFSET "
                  "(processors/history/moments.parse_moment)")
AtQuery = Annotated[str | None, Query(min_length=1, max_length=MAX_MOMENT_CHARS, description=AT_DESCRIPTION)]
DryRun = Annotated[bool, Query(description="say what would happen; produce nothing (processors/history/whatif.py)")]


def create_app(cfg: Config, *, users_path: Path | None = None) -> FastAPI:  # noqa: C901
    from streams.clients import EventProducer
    from streams.serde import SchemaRegistry

    registry = SchemaRegistry.from_dir()
    users_file = UsersFile(users_path or cfg.secrets / users_mod.USERS_FILE)
    from infra import metrics

    metrics.own(metrics.API_REQUESTS)  # what /metrics exports from the start (infra/metrics.py)
    metrics.build_info(PRODUCER)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from streams.partitionmap import MapFollower

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
    app.state.users = users_file
    app.state.streams = 0  # event streams open now (``events``)
    max_streams = int(os.environ.get(MAX_STREAMS_ENV) or MAX_STREAMS)

    def allow(user: User, action: str, entitlement: str | None) -> None:
        d = authz.decide(user, action, entitlement)
        if not d.allowed:
            raise ApiError(403, d.reason, d.message)

    def front(user: User) -> Frontend:
        return Frontend(cfg, registry, principal=user.name, producer=PRODUCER, events=app.state.producer,
                        partition_map=app.state.partition_map)

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

    async def call(fn, *args, **kwargs):
        """Run a blocking front-end call in the thread pool; the log failing to answer is a 503, not a 500."""
        from confluent_kafka import KafkaException

        from streams.clients import DeliveryError

        try:
            return await run_in_threadpool(fn, *args, **kwargs)
        except (KafkaException, DeliveryError, TimeoutError, ConnectionError) as exc:
            raise ApiError(503, BROKER_UNAVAILABLE, f"the log did not answer: {exc}") from None
        except RuntimeError as exc:  # a reader's broker error (streams.clients.EventConsumer)
            if str(exc).startswith(("consumer ", "topic ")):
                raise ApiError(503, BROKER_UNAVAILABLE, f"the log did not answer: {exc}") from None
            raise

    # -- who -------------------------------------------------------------------------------------------------
    @app.get("/healthz", tags=["meta"])
    async def healthz() -> dict:
        return {"ok": True}

    # The small doors (guards.py): no token in a URL, no body beyond MAX_BODY_BYTES; inside TimedRequests, which
    # counts their refusals too.
    app.add_middleware(BodyLimit)
    app.add_middleware(NoTokenInUrl)
    app.add_middleware(TimedRequests)

    @app.get("/metrics", tags=["meta"], response_class=PlainTextResponse)
    async def metrics_text() -> PlainTextResponse:
        """Prometheus metrics of the API process (infra/metrics.py); unauthenticated like /healthz: they name no
        user, job, task or machine."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/whoami", tags=["meta"])
    async def whoami(user: CurrentUser) -> dict:
        return {"user": user.name, "region_admin": user.region_admin, "roles": dict(user.roles)}

    # -- entitlements ----------------------------------------------------------------------------------------
    @app.get("/v1/entitlements", tags=["entitlements"])
    async def entitlements(user: CurrentUser) -> list[dict]:
        rows = await call(front(user).entitlements)
        return [r for r in rows if authz.decide(user, "entitlement.view", r["entitlement"]).allowed]

    @app.post("/v1/entitlements", status_code=201, tags=["entitlements"])
    async def entitlement_create(body: EntitlementCreate, user: CurrentUser) -> dict:
        allow(user, "entitlement.quota", body.name)
        return await call(front(user).entitlement_create, body.name, body.quota_machines,
                          machine_type=body.machine_type, dc=body.dc_pin, host_profile=body.host_profile)

    @app.patch("/v1/entitlements/{name}", status_code=202, tags=["entitlements"])
    async def entitlement_update(name: Name, body: EntitlementUpdate,
                                 user: CurrentUser) -> dict:
        allow(user, "entitlement.quota" if body.quota_machines is not None else "entitlement.update", name)
        return await call(front(user).entitlement_update, name, body.model_dump())

    @app.post("/v1/entitlements/{name}/move", status_code=202, tags=["entitlements"])
    async def entitlement_move(name: Name, body: EntitlementMove, user: CurrentUser) -> dict:
        allow(user, "entitlement.move", name)
        return await call(front(user).entitlement_move, name, body.partition, body.reason, wait_s=body.wait_s)

    # -- jobs ------------------------------------------------------------------------------------------------
    @app.get("/v1/jobs", tags=["jobs"])
    async def jobs(user: CurrentUser, entitlement: EntitlementQuery = None
                   ) -> list[dict]:
        if entitlement is not None:
            allow(user, "job.view", entitlement)
        rows = await call(front(user).jobs, entitlement)
        return [r for r in rows if authz.visible(user, r["entitlement"])]

    def verdict_response(doc: dict, created: bool = False) -> JSONResponse:
        v = doc.get("verdict")
        if v == fe.REFUSED:
            return JSONResponse({**doc, "error": doc.get("reason") or fe.REFUSED}, 409)
        return JSONResponse(doc, 201 if created and v == fe.ACCEPTED else 200 if v in (fe.ACCEPTED, fe.UNCHANGED)
                            else 202)

    @app.post("/v1/jobs", tags=["jobs"], status_code=201,
              responses={201: {"description": "accepted"}, 202: {"description": "pending, or not waited for"},
                         409: {"description": "refused by the scheduler, with the reason"}})
    async def job_submit(spec: JobSpec, user: CurrentUser, wait: Wait = None,
                         timeout_s: WaitS = fe.DEFAULT_WAIT_S) -> JSONResponse:
        allow(user, "job.submit", spec.entitlement if isinstance(spec.entitlement, str) else None)
        doc = await call(front(user).job_submit, spec.model_dump(exclude_none=True),
                         wait_s=timeout_s if wait is not False else None)
        return verdict_response(doc, created=True)

    @app.get("/v1/jobs/{job}", tags=["jobs"])
    async def job_status(job: JobId, user: CurrentUser, at: AtQuery = None) -> dict:
        allow(user, "job.view", fe.entitlement_of_job(job))
        return await call(front(user).job_status, job, at)

    @app.get("/v1/jobs/{job}/describe", tags=["jobs"])
    async def job_describe(job: JobId, user: CurrentUser,
                           events: Annotated[int, Query(ge=0, le=10_000, description="recent events shown")] = 20
                           ) -> dict:
        """The job, its tasks with their story (age, restarts, moves, previous machine, version), its recent events
        and its last refusals (`ropewalk job describe`)."""
        allow(user, "job.view", fe.entitlement_of_job(job))
        return await call(front(user).job_describe, job, events)

    @app.get("/v1/jobs/{job}/logs", tags=["jobs"], response_class=StreamingResponse,
             responses={200: {"content": {"text/plain": {}},
                              "description": "the tasks' output, `[task] line` when several; a task without output "
                                             "is named in the X-Ropewalk-No-Output header (JSON: task -> why)"}})
    async def job_logs(request: Request, job: JobId, user: CurrentUser,
                       task: Annotated[str | None, Query(max_length=200)] = None,
                       tail: Annotated[int, Query(ge=0, le=100_000)] = 100, follow: bool = False
                       ) -> StreamingResponse:
        """The output of the job's tasks (`ropewalk job logs JOB [TASK] [-f]`): the last ``tail`` lines of each, then
        with ``follow`` each line as it is written, until the client goes."""
        from processors.frontend import logs

        allow(user, "job.view", fe.entitlement_of_job(job))
        srcs = await call(front(user).job_log_sources, job, task)
        reader = logs.Reader(srcs)
        several = len(srcs) > 1
        missing = {s["task"]: s["why"] for s in srcs if s["path"] is None}
        if not reader.srcs:
            raise ApiError(404, "no_output", logs.no_output(missing))

        async def lines():
            for t, line in await run_in_threadpool(reader.first, tail):
                yield logs.line_of(t, line, several) + "\n"
            while follow and not await request.is_disconnected():
                got = await run_in_threadpool(reader.new)
                for t, line in got:
                    yield logs.line_of(t, line, several) + "\n"
                if not got:
                    await asyncio.sleep(0.25)

        return StreamingResponse(lines(), media_type="text/plain; charset=utf-8",
                                 headers={"X-Ropewalk-No-Output": json.dumps(missing), "Cache-Control": "no-cache"})

    @app.put("/v1/jobs/{job}/spec", tags=["jobs"])
    async def job_update(job: JobId, spec: JobSpec, user: CurrentUser, wait: Wait = None,
                         timeout_s: WaitS = fe.DEFAULT_WAIT_S) -> JSONResponse:
        allow(user, "job.update", fe.entitlement_of_job(job))
        return verdict_response(await call(front(user).job_update, job, spec.model_dump(exclude_none=True),
                                           wait_s=timeout_s if wait else None))

    @app.post("/v1/jobs/{job}/resize", tags=["jobs"])
    async def job_resize(job: JobId, body: Resize, user: CurrentUser, wait: Wait = None,
                         timeout_s: WaitS = fe.DEFAULT_WAIT_S) -> JSONResponse:
        allow(user, "job.resize", fe.entitlement_of_job(job))
        return verdict_response(await call(front(user).job_resize, job, body.tasks,
                                           wait_s=timeout_s if wait else None))

    @app.post("/v1/jobs/{job}/stop", tags=["jobs"])
    async def job_stop(job: JobId, user: CurrentUser, body: Stop | None = None, wait: Wait = None,
                       timeout_s: WaitS = fe.DEFAULT_WAIT_S) -> JSONResponse:
        allow(user, "job.stop", fe.entitlement_of_job(job))
        return verdict_response(await call(front(user).job_stop, job, (body or Stop()).reason,
                                           wait_s=timeout_s if wait else None))

    # -- machines and maintenance ---------------------------------------------------------------------------
    @app.get("/v1/machines", tags=["machines"])
    async def machines(user: CurrentUser, entitlement: EntitlementQuery = None,
                       free: bool = False, at: AtQuery = None) -> list[dict]:
        if entitlement is not None:
            allow(user, "machine.view", entitlement)
        rows = await call(front(user).machines, entitlement, free, at)
        return [r for r in rows if authz.visible(user, r["entitlement"])]

    @app.post("/v1/machines/{machine}/{action}", tags=["machines"])
    async def machine_action(machine: str, action: Literal["fail", "recover"], user: CurrentUser,
                             dry_run: DryRun = False) -> dict:
        allow(user, f"machine.{action}", None)
        return await call(front(user).machine_action, machine, action, dry_run=dry_run)

    @app.post("/v1/power/{action}", tags=["machines"])
    async def machine_power(action: Literal["loss", "restore"], body: PowerDomain, user: CurrentUser) -> dict:
        allow(user, f"machine.power_{action}", None)
        return await call(front(user).machine_power, action, dc=body.dc, msb=body.msb, rack=body.rack)

    @app.post("/v1/maintenance", status_code=201, tags=["maintenance"],
              responses={200: {"description": "dry_run: what the maintenance would do"}})
    async def maintenance_plan(body: MaintenancePlan, user: CurrentUser, dry_run: DryRun = False) -> JSONResponse:
        allow(user, "maintenance.plan", None)
        chosen = [k for k in ("machines", "rack", "msb") if getattr(body, k) is not None]
        if len(chosen) != 1:
            raise ApiError(400, fe.INVALID_REQUEST, "give exactly one of machines, rack, msb"
                           + (f" (got {', '.join(chosen)})" if chosen else ""))
        doc = await call(front(user).maintenance_plan, start_ms=body.start_ms, duration_ms=body.duration_ms,
                         deadline_ms=body.deadline_ms, machines=body.machines, rack=body.rack, msb=body.msb,
                         reason=body.reason, dry_run=dry_run)
        return JSONResponse(doc, 200 if dry_run else 201)

    @app.get("/v1/maintenance", tags=["maintenance"])
    async def maintenance_windows(user: CurrentUser) -> list[dict]:
        rows = await call(front(user).maintenance_windows)
        if user.region_admin:
            return rows
        seen = {m["id"] for m in await machines(user, None, False, None)}  # a window shows on the machines the user may see
        return [dict(r, machines=[m for m in r["machines"] if m in seen]) for r in rows
                if seen.intersection(r["machines"])]

    @app.post("/v1/maintenance/{unavailability_id}/end", tags=["maintenance"])
    async def maintenance_end(unavailability_id: str, user: CurrentUser) -> dict:
        allow(user, "maintenance.end", None)
        return await call(front(user).maintenance_end, unavailability_id)

    # -- the ReBalancer's plans -----------------------------------------------------------------------------
    @app.get("/v1/rebalance/plans", tags=["rebalance"])
    async def rebalance_plans(user: CurrentUser, entitlement: EntitlementQuery = None,
                              all: bool = False) -> list[dict]:  # noqa: A002 - the query parameter's name
        if entitlement is not None:
            allow(user, "rebalance.view", entitlement)
        rows = await call(front(user).rebalance_plans, entitlement, all)
        return [r for r in rows if authz.visible(user, r["entitlement"])]

    # -- the upper floors: intents, the SRM, loans (issue 15) ------------------------------------------------
    @app.get("/v1/intents", tags=["intents"])
    async def intents_list(user: CurrentUser) -> list[dict]:
        rows = await call(front(user).intents)
        return [r for r in rows if authz.visible(user, fe.entitlement_of_job(r["job"]))]

    @app.get("/v1/jobs/{job}/intents", tags=["intents"])
    async def intents_show(job: JobId, user: CurrentUser) -> dict:
        allow(user, "intents.view", fe.entitlement_of_job(job))
        return await call(front(user).intents, job)

    @app.get("/v1/jobs/{job}/intents/history", tags=["intents"])
    async def intents_history(job: JobId, user: CurrentUser) -> list[dict]:
        allow(user, "intents.view", fe.entitlement_of_job(job))
        return await call(front(user).intents_history, job)

    @app.get("/v1/jobs/{job}/intents/ledger", tags=["intents"])
    async def intents_ledger(job: JobId, user: CurrentUser) -> list[dict]:
        allow(user, "intents.view", fe.entitlement_of_job(job))
        return await call(front(user).intents_ledger, job)

    @app.post("/v1/jobs/{job}/intents/{dimension}", status_code=202, tags=["intents"])
    async def intent_declare(job: JobId, dimension: Literal["push", "canary", "size", "resources"],
                             body: dict[str, Any], user: CurrentUser) -> dict:
        allow(user, "intents.declare", fe.entitlement_of_job(job))
        return await call(front(user).intent_declare, job, dimension, body)

    @app.get("/v1/jobs/{job}/srm", tags=["srm"])
    async def srm_show(job: JobId, user: CurrentUser) -> dict:
        allow(user, "srm.view", fe.entitlement_of_job(job))
        return await call(front(user).srm, job)

    @app.get("/v1/jobs/{job}/srm/plan", tags=["srm"])
    async def srm_plan(job: JobId, user: CurrentUser) -> dict:
        allow(user, "srm.view", fe.entitlement_of_job(job))
        return await call(front(user).srm_plan, job)

    @app.get("/v1/srm", tags=["srm"])
    async def srm_overview(user: CurrentUser) -> list[dict]:
        rows = await call(front(user).srm_overview)
        return [r for r in rows if authz.decide(user, "srm.view", r["entitlement"]).allowed]

    @app.get("/v1/srm/decisions", tags=["srm"])
    async def srm_decisions(user: CurrentUser, job: Annotated[str | None, Query(pattern=JOB_PATTERN)] = None) -> dict:
        scope = fe.entitlement_of_job(job) if job is not None else None
        allow(user, "srm.view" if scope is not None else "region.view", scope)
        return await call(front(user).srm_decisions, job)

    @app.get("/v1/loans", tags=["loans"])
    async def loans(user: CurrentUser, entitlement: EntitlementQuery = None) -> dict:
        allow(user, "loans.view" if entitlement is not None else "region.view", entitlement)
        return await call(front(user).loans, entitlement)

    async def loans_visible(user: User) -> dict:
        """The loans document narrowed to what concerns the entitlements the user holds a role on (all of it for a
        region admin): the web UI's loans page, which a viewer may open without naming an entitlement."""
        from processors.resourcebroker.loans_view import only

        doc = await call(front(user).loans, None)
        return doc if user.region_admin else only(doc, [e for e in user.roles
                                                        if authz.decide(user, "loans.view", e).allowed])

    @app.put("/v1/entitlements/{name}/elasticity", status_code=202, tags=["loans"])
    async def elasticity(name: Name, body: Elasticity, user: CurrentUser) -> dict:
        allow(user, "entitlement.elastic", name)
        return await call(front(user).elasticity_set, name, body.elastic, body.max_borrowed_machines,
                          body.revoke_notice_ms, body.lend_idle)

    # -- the region at a moment, and why a task is where it is (processors/history) ----------------------
    @app.get("/v1/region", tags=["history"])
    async def region(user: CurrentUser, at: Annotated[str, Query(min_length=1, max_length=MAX_MOMENT_CHARS,
                                                                 description=AT_DESCRIPTION)]) -> dict:
        allow(user, "region.view", None)
        return await call(front(user).region, at)

    @app.get("/v1/tasks/{task:path}/explain", tags=["history"])
    async def explain(task: Annotated[str, PathParam(max_length=200, description="<job>/<index>, e.g. e1.web/0")],
                      user: CurrentUser, at: AtQuery = None,
                      why_not: Annotated[str | None, Query(min_length=1, max_length=200)] = None) -> dict:
        allow(user, "job.view", fe.entitlement_of_job(task))
        doc = await call(front(user).explain, task, at, why_not)
        w = doc.get("why_not") or {}
        if "owner" in w and not authz.visible(user, w["owner"]):  # another entitlement's machine: not its state
            doc["why_not"] = {"machine": w["machine"], "answer": WHY_NOT_HIDDEN}
        return doc

    # -- the log ---------------------------------------------------------------------------------------------
    @app.get("/v1/replay", tags=["log"], response_class=StreamingResponse,
             responses={200: {"content": {"application/x-ndjson": {}},
                              "description": "one event per line (envelope, payload, topic, partition, offset), "
                                             "then {\"stats\": ...}"}})
    async def replay(user: CurrentUser,
                     entitlement: EntitlementQuery = None,
                     job: str | None = None, machine: str | None = None,
                     since_ms: Annotated[int | None, Query(ge=0, le=MAX_TIME_MS)] = None,
                     until_ms: Annotated[int | None, Query(ge=0, le=MAX_TIME_MS)] = None,
                     topic: Annotated[list[str] | None, Query()] = None,
                     type: Annotated[list[str] | None, Query(description="event types to keep")] = None,
                     exclude_type: Annotated[list[str] | None, Query(description="event types to leave out")] = None
                     ) -> StreamingResponse:
        from streams import replay as rp

        flt = replay_filter(user, entitlement=entitlement, job=job, machine=machine, since_ms=since_ms,
                            until_ms=until_ms, topics=tuple(topic) if topic else None,
                            types=frozenset(type) if type else None,
                            exclude_types=frozenset(exclude_type) if exclude_type else None)
        run = await call(front(user).replay, flt)
        it = iter(run)
        # The first record is read before the answer starts: a log that does not answer is a 503, not a cut stream.
        first = await call(next, it, None)

        def lines():
            try:
                for rec in ([first] if first is not None else []):
                    yield rp.format_json(rec) + "\n"
                for rec in it:
                    yield rp.format_json(rec) + "\n"
                s = run.stats
                yield json.dumps({"stats": {"matched": s.matched, "read": s.read, "skipped": s.skipped,
                                            "elapsed_s": round(s.elapsed_s, 3)}}) + "\n"
            finally:
                it.close()  # the replay's consumer, also when the client went away mid-stream

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def replay_filter(user: User, *, entitlement: str | None = None, job: str | None = None, **rest):
        """The replay filter of a request, authorized: one entitlement's (or job's) events for its viewers, the
        whole region's for a region admin; 400 naming a wrong topic or event type."""
        from streams import replay as rp
        from streams.topics import TopicError

        scope = entitlement or (fe.entitlement_of_job(job) if job is not None else None)
        allow(user, "replay.view" if scope is not None else "region.view", scope)
        if not user.region_admin and entitlement is None and scope is not None:
            entitlement = scope  # a job's events are keyed to its entitlement: read only that one
        try:
            return rp.ReplayFilter(entitlement=entitlement, job=job, **rest)
        except TopicError as exc:
            raise ApiError(400, fe.INVALID_REQUEST, str(exc) if str(exc).startswith(("type", "exclude"))
                           else f"topic: {exc}") from None

    async def replay_docs(user: User, **flt) -> list[dict]:
        """The replay documents (``format_json``'s) a user may see, read whole (the UI's timeline and feed)."""
        from streams import replay as rp

        run = await call(front(user).replay, replay_filter(user, **flt))
        return await call(lambda: [json.loads(rp.format_json(rec)) for rec in run])

    async def events(request: Request, user: User, kind: str, entitlement: str | None) -> StreamingResponse:  # noqa: C901
        action = "job.view" if kind == "jobs" else "machine.view"
        if entitlement is not None:
            allow(user, action, entitlement)
        if app.state.streams >= max_streams:
            raise ApiError(503, TOO_MANY_STREAMS, f"{app.state.streams} event streams are open, the most this API "
                           f"serves at once ({MAX_STREAMS_ENV}={max_streams}): try again later",
                           headers={"Retry-After": "5"})
        reader = await call(front(user).state_reader, kind, entitlement)
        name = "job" if kind == "jobs" else "machine"

        def sse(event: str, data: Any) -> str:
            return f"event: {event}\ndata: {json.dumps(data, sort_keys=True)}\n\n"

        def shown(view: dict) -> bool:
            return authz.visible(user, view["entitlement"])

        async def stream():
            app.state.streams += 1  # counted while the stream runs (a response never started counts nothing)
            try:
                current = await run_in_threadpool(reader.catch_up)
                for ev in sorted(current.values(), key=lambda e: e.entity_id):
                    view = fe.state_view(kind, ev)
                    if shown(view):
                        yield sse(name, view)
                yield sse("ready", {"kind": kind})
                quiet_since = time.monotonic()
                while not await request.is_disconnected():
                    recs = await run_in_threadpool(reader.poll, 0.5)
                    for rec in recs:
                        view = fe.state_view(kind, rec.event)
                        if shown(view):
                            yield sse(name, view)
                            quiet_since = time.monotonic()
                    if time.monotonic() - quiet_since > KEEPALIVE_S:
                        yield ": keep-alive\n\n"
                        quiet_since = time.monotonic()
            except asyncio.CancelledError:
                raise
            finally:
                app.state.streams -= 1
                reader.close()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    SSE = {200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}}

    @app.get("/v1/events/jobs", tags=["log"], response_class=StreamingResponse, responses=SSE)
    async def job_events(request: Request, user: CurrentUser,
                         entitlement: EntitlementQuery = None) -> StreamingResponse:
        return await events(request, user, "jobs", entitlement)

    @app.get("/v1/events/machines", tags=["log"], response_class=StreamingResponse, responses=SSE)
    async def machine_events(request: Request, user: CurrentUser,
                             entitlement: EntitlementQuery = None
                             ) -> StreamingResponse:
        return await events(request, user, "machines", entitlement)

    from processors.api import ui  # the web UI at /ui/ (processors/api/ui)

    ui.mount(app, users=users_file, api={"jobs": jobs, "job_status": job_status, "machines": machines,
                                         "entitlements": entitlements, "rebalance_plans": rebalance_plans,
                                         "intents_list": intents_list, "intents_show": intents_show,
                                         "intents_ledger": intents_ledger, "srm_overview": srm_overview,
                                         "loans": loans_visible, "maintenance": maintenance_windows},
             events=events, replay_docs=replay_docs)
    return app
