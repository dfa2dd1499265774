"""``/v1/jobs``: list, submit, status (at a moment), describe, logs (followed), update, resize, stop. An intent's
answer is the scheduler's verdict: 201/200 accepted or unchanged, 409 refused with the reason, 202 pending or not
waited for."""
import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from processors.api import authz
from processors.api.door import AtQuery, Caller, Door, EntitlementQuery, JobId, Wait, WaitS, call
from processors.api.errors import ApiError
from processors.api.models import JobSpec, Resize, Stop
from processors.frontend.jobspec import ValidSpec
from processors.frontend import logs, service as fe

router = APIRouter(tags=["jobs"])


@router.get("/v1/jobs")
async def jobs(door: Caller, entitlement: EntitlementQuery = None) -> list[dict]:
    if entitlement is not None:
        door.allow("job.view", entitlement)
    rows = await call(door.front.jobs, entitlement)
    return [r for r in rows if authz.visible(door.user, r["entitlement"])]


def _checked(door: Door, body: dict, entitlement: str | None) -> ValidSpec:
    """The API's door for a job spec: the body parsed to its types (``JobSpec``, made from ``jobspec.SHAPE``), then
    the spec's rules, once (``jobspec.validate_spec``, the CLI's too); the front end trusts what it returns."""
    return fe.spec_payload(body, entitlement, door.front.cfg.max_tasks_per_job)


def verdict_response(doc: dict, created: bool = False) -> JSONResponse:
    v = doc.get("verdict")
    if v == fe.REFUSED:
        return JSONResponse({**doc, "error": doc.get("reason") or fe.REFUSED}, 409)
    return JSONResponse(doc, 201 if created and v == fe.ACCEPTED else 200 if v in (fe.ACCEPTED, fe.UNCHANGED)
                        else 202)


@router.post("/v1/jobs", status_code=201,
             responses={201: {"description": "accepted"}, 202: {"description": "pending, or not waited for"},
                        409: {"description": "refused by the scheduler, with the reason"}})
async def job_submit(spec: JobSpec, door: Caller, wait: Wait = None,
                     timeout_s: WaitS = fe.DEFAULT_WAIT_S) -> JSONResponse:
    body = spec.model_dump(exclude_none=True)
    door.allow("job.submit", body.get("entitlement"))
    valid = _checked(door, body, None)
    doc = await call(door.front.job_submit, valid, wait_s=timeout_s if wait is not False else None)
    return verdict_response(doc, created=True)


@router.get("/v1/jobs/{job}")
async def job_status(job: JobId, door: Caller, at: AtQuery = None) -> dict:
    door.allow("job.view", fe.entitlement_of_job(job))
    return await call(door.front.job_status, job, at)


@router.get("/v1/jobs/{job}/describe")
async def job_describe(job: JobId, door: Caller,
                       events: Annotated[int, Query(ge=0, le=10_000, description="recent events shown")] = 20
                       ) -> dict:
    """The job, its tasks with their story (age, restarts, moves, previous machine, version), its recent events
    and its last refusals (`ropewalk job describe`)."""
    door.allow("job.view", fe.entitlement_of_job(job))
    return await call(door.front.job_describe, job, events)


@router.get("/v1/jobs/{job}/logs", response_class=StreamingResponse,
            responses={200: {"content": {"text/plain": {}},
                             "description": "the tasks' output, `[task] line` when several; a task without output "
                                            "is named in the X-Ropewalk-No-Output header (JSON: task -> why)"}})
async def job_logs(request: Request, job: JobId, door: Caller,
                   task: Annotated[str | None, Query(max_length=200)] = None,
                   tail: Annotated[int, Query(ge=0, le=100_000)] = 100, follow: bool = False
                   ) -> StreamingResponse:
    """The output of the job's tasks (`ropewalk job logs JOB [TASK] [-f]`): the last ``tail`` lines of each, then
    with ``follow`` each line as it is written, until the client goes."""
    door.allow("job.view", fe.entitlement_of_job(job))
    srcs = await call(door.front.job_log_sources, job, task)
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


@router.put("/v1/jobs/{job}/spec")
async def job_update(job: JobId, spec: JobSpec, door: Caller, wait: Wait = None,
                     timeout_s: WaitS = fe.DEFAULT_WAIT_S) -> JSONResponse:
    door.allow("job.update", fe.entitlement_of_job(job))
    valid = _checked(door, spec.model_dump(exclude_none=True), fe.entitlement_of_job(job))
    return verdict_response(await call(door.front.job_update, job, valid, wait_s=timeout_s if wait else None))


@router.post("/v1/jobs/{job}/resize")
async def job_resize(job: JobId, body: Resize, door: Caller, wait: Wait = None,
                     timeout_s: WaitS = fe.DEFAULT_WAIT_S) -> JSONResponse:
    door.allow("job.resize", fe.entitlement_of_job(job))
    return verdict_response(await call(door.front.job_resize, job, body.tasks, wait_s=timeout_s if wait else None))


@router.post("/v1/jobs/{job}/stop")
async def job_stop(job: JobId, door: Caller, body: Stop | None = None, wait: Wait = None,
                   timeout_s: WaitS = fe.DEFAULT_WAIT_S) -> JSONResponse:
    door.allow("job.stop", fe.entitlement_of_job(job))
    return verdict_response(await call(door.front.job_stop, job, (body or Stop()).reason,
                                       wait_s=timeout_s if wait else None))
