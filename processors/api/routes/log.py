"""The log: ``/v1/replay`` (NDJSON, one event per line, then ``{"stats": ...}``) and the event streams
``/v1/events/jobs``, ``/v1/events/machines`` (server-sent events: the current state of everything the user may see,
then ``event: ready``, then each change; at most ``MAX_STREAMS`` open at once, processors/api/app.py)."""
import asyncio
import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from processors.api import authz
from processors.api.door import Caller, Door, EntitlementQuery, call
from processors.api.errors import ApiError
from processors.frontend import service as fe
from streams import replay as rp
from streams.events import MAX_TIME_MS
from streams.topics import TopicError

KEEPALIVE_S = 15.0
# Event streams open at once, at most (each holds a reader of the state topics: a consumer and the latest state of
# what it shows); one more is refused (503, too_many_streams) until one closes. ROPEWALK_API_MAX_STREAMS.
MAX_STREAMS = 64
MAX_STREAMS_ENV = "ROPEWALK_API_MAX_STREAMS"
TOO_MANY_STREAMS = "too_many_streams"

router = APIRouter(tags=["log"])


@router.get("/v1/replay", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-ndjson": {}},
                             "description": "one event per line (envelope, payload, topic, partition, offset), "
                                            "then {\"stats\": ...}"}})
async def replay(door: Caller,
                 entitlement: EntitlementQuery = None,
                 job: str | None = None, machine: str | None = None,
                 since_ms: Annotated[int | None, Query(ge=0, le=MAX_TIME_MS)] = None,
                 until_ms: Annotated[int | None, Query(ge=0, le=MAX_TIME_MS)] = None,
                 topic: Annotated[list[str] | None, Query()] = None,
                 type: Annotated[list[str] | None, Query(description="event types to keep")] = None,
                 exclude_type: Annotated[list[str] | None, Query(description="event types to leave out")] = None
                 ) -> StreamingResponse:
    flt = replay_filter(door, entitlement=entitlement, job=job, machine=machine, since_ms=since_ms,
                        until_ms=until_ms, topics=tuple(topic) if topic else None,
                        types=frozenset(type) if type else None,
                        exclude_types=frozenset(exclude_type) if exclude_type else None)
    run = await call(door.front.replay, flt)
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


def replay_filter(door: Door, *, entitlement: str | None = None, job: str | None = None, **rest):
    """The replay filter of a request, authorized: one entitlement's (or job's) events for its viewers, the
    whole region's for a region admin; 400 naming a wrong topic or event type."""
    scope = entitlement or (fe.entitlement_of_job(job) if job is not None else None)
    door.allow("replay.view" if scope is not None else "region.view", scope)
    if not door.user.region_admin and entitlement is None and scope is not None:
        entitlement = scope  # a job's events are keyed to its entitlement: read only that one
    try:
        return rp.ReplayFilter(entitlement=entitlement, job=job, **rest)
    except TopicError as exc:
        raise ApiError(400, fe.INVALID_REQUEST, str(exc) if str(exc).startswith(("type", "exclude"))
                       else f"topic: {exc}") from None


async def replay_docs(door: Door, **flt) -> list[dict]:
    """The replay documents (``format_json``'s) a user may see, read whole (the UI's timeline and feed)."""
    run = await call(door.front.replay, replay_filter(door, **flt))
    return await call(lambda: [json.loads(rp.format_json(rec)) for rec in run])


async def events(request: Request, door: Door, kind: str, entitlement: str | None) -> StreamingResponse:
    """A state stream of ``kind`` (jobs, machines) as server-sent events, refused while ``MAX_STREAMS`` are open."""
    if entitlement is not None:
        door.allow("job.view" if kind == "jobs" else "machine.view", entitlement)
    state = request.app.state
    if state.streams >= state.max_streams:
        raise ApiError(503, TOO_MANY_STREAMS, f"{state.streams} event streams are open, the most this API "
                       f"serves at once ({MAX_STREAMS_ENV}={state.max_streams}): try again later",
                       headers={"Retry-After": "5"})
    reader = await call(door.front.state_reader, kind, entitlement)
    return StreamingResponse(_stream(request, door, kind, reader), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, sort_keys=True)}\n\n"


async def _stream(request: Request, door: Door, kind: str, reader):
    """The stream's events: the current state, ``ready``, then each change (a keep-alive comment every
    ``KEEPALIVE_S`` while nothing changes), until the client goes; counted in ``app.state.streams`` while it runs
    (a response never started counts nothing)."""
    name = "job" if kind == "jobs" else "machine"
    state = request.app.state
    state.streams += 1
    try:
        current = await run_in_threadpool(reader.catch_up)
        for ev in sorted(current.values(), key=lambda e: e.entity_id):
            view = fe.state_view(kind, ev)
            if authz.visible(door.user, view["entitlement"]):
                yield _sse(name, view)
        yield _sse("ready", {"kind": kind})
        quiet_since = time.monotonic()
        while not await request.is_disconnected():
            recs = await run_in_threadpool(reader.poll, 0.5)
            for rec in recs:
                view = fe.state_view(kind, rec.event)
                if authz.visible(door.user, view["entitlement"]):
                    yield _sse(name, view)
                    quiet_since = time.monotonic()
            if time.monotonic() - quiet_since > KEEPALIVE_S:
                yield ": keep-alive\n\n"
                quiet_since = time.monotonic()
    except asyncio.CancelledError:
        raise
    finally:
        state.streams -= 1
        reader.close()


SSE = {200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}}


@router.get("/v1/events/jobs", response_class=StreamingResponse, responses=SSE)
async def job_events(request: Request, door: Caller, entitlement: EntitlementQuery = None) -> StreamingResponse:
    return await events(request, door, "jobs", entitlement)


@router.get("/v1/events/machines", response_class=StreamingResponse, responses=SSE)
async def machine_events(request: Request, door: Caller, entitlement: EntitlementQuery = None) -> StreamingResponse:
    return await events(request, door, "machines", entitlement)
