"""The web UI, served by the API at ``/ui/`` (server-rendered Jinja2 pages, live over server-sent events).

Pages: jobs (state, tasks running, last reason; live), a job (its tasks, where they run, reasons, and its
**timeline**: a Gantt chart of every task's states and operations from the log, ``timeline.py``; live), the fleet
(machines by DC/MSB/rack: status, owner, free capacity, host profile, maintenance; a page of ``FLEET_PAGE`` rows,
filtered by status, owner, DC or name; live), maintenance (each window: when, its deadline, why, its machines and
their status), entitlements (quota, machines held, the free pool by the one rule of ``resourcebroker.decide.is_free``,
as the loans page counts it), the region's event feed (the log, filtered by entitlement, job, event type and time),
and the upper
floors (issue 15): the ReBalancer's plans, a job's intents (declared, applied or refused with reason and field),
the SRM's picture and decisions per job, and elastic loans. A page the API refuses (a viewer of another
entitlement, an unknown job) says so with the API's reason constant (``refused.html``), status as the API's.

Why this shape: the pages are the API's own documents rendered on the server (one source of truth with the CLI,
no second client to keep in step), authorized by the same table (``authz.py``) for the user of the page's token;
the live parts use the API's existing event streams (``/ui/stream/{jobs,machines}``, the ``/v1/events`` streams
with the session's user), which an ``EventSource`` follows with a few lines of script; the Gantt is vis-timeline
(npm, ``infra/bootstrap.sh`` copies its standalone build into ``.ui-vendor/``: ``VENDOR``), which draws thousands
of ranges with zoom and pan. htmx was not needed: each live update is one fragment fetch or one cell.

Sign-in: ``/ui/login`` takes an API token (``ropewalk user add``) and keeps it in an HttpOnly, SameSite=Strict
cookie; every page authenticates it as the API authenticates a bearer token.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape

from infra.config import PROJECT_ROOT
from processors.api.errors import ApiError
from processors.api.ui.timeline import timeline
from processors.frontend.console import CliError, _parse_time
from processors.frontend.service import INVALID_REQUEST, FrontendError, entitlement_of_job
from processors.resourcebroker.decide import is_free
from processors.times import duration_ms
from streams.replay import DATA_TOPICS, format_text_doc, iso_time, time_order_key
from streams.topics import BY_NAME

HERE = Path(__file__).resolve().parent
VENDOR = PROJECT_ROOT / ".ui-vendor"  # vis-timeline's standalone build, copied from npm by infra/bootstrap.sh
COOKIE = "ropewalk_token"
FEED_LIMIT = 500  # events shown by the feed (the newest)
FEED_DEFAULT_SINCE = "15m"
FEED_DEFAULT_EXCLUDE = "AgentHeartbeat"  # every machine's, every few seconds: the feed is about changes
FLEET_PAGE = 50  # machines per page of the fleet (201 rows were one 6,369-px page)
AT_SPANS = ("15m", "1h", "6h", "24h", "7d")  # what the time slider covers, back from now
AT_DEFAULT_SPAN = "1h"


def moment_of(at: str, span: str, now_ms: int) -> dict[str, Any]:
    """The time slider's state (``_at.html``): the moment shown (None: now; ms, ISO-8601 or ``now-15m``: the slider
    sends ms) and the span it covers back from now. Raises ``MomentError`` naming the field for a bad one."""
    from processors.history.moments import MomentError, parse_moment  # noqa: PLC0415 - start-up: moments ~20 ms

    if span not in AT_SPANS:
        raise MomentError(f"span: one of {', '.join(AT_SPANS)}, got {span!r}")
    try:
        ms = parse_moment(at, now_ms) if at else None
    except (MomentError, ValueError) as exc:  # a TOPIC/PARTITION@OFFSET needs the log: the CLI and API take it
        raise MomentError(f"at: {exc}") from None
    return {"ms": ms, "now_ms": now_ms, "min_ms": min(now_ms - duration_ms(span), ms or now_ms), "span": span,
            "spans": AT_SPANS}


def mount(app: FastAPI, *, users, api: dict[str, Callable], events, replay_docs) -> None:  # noqa: C901
    """Add the UI's routes to the API ``app``. ``api``: the API's own route functions (same authorization);
    ``events(request, user, kind, entitlement)``: its event streams; ``replay_docs(user, **filter)``: the replay
    documents a user may see."""
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    env.filters["time"] = lambda ms: iso_time(ms).replace("T", " ")[:19] if ms else "-"
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")
    if VENDOR.is_dir():
        app.mount("/ui/vendor", StaticFiles(directory=VENDOR), name="ui-vendor")

    def user_of(request: Request):
        token = request.cookies.get(COOKIE)
        return users.current().authenticate(token) if token else None

    def page(name: str, request: Request, **ctx: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(name).render(request=request, vendor=VENDOR.is_dir(), **ctx))

    def refused(request: Request, user, exc: Exception) -> HTMLResponse:
        """A page the API refuses (403: the user's role; 404: nothing of that name; 503: the log): said on a page
        with the API's reason constant, in the page's frame."""
        status = getattr(exc, "status", None) or 400
        return HTMLResponse(env.get_template("refused.html").render(
            request=request, vendor=False, user=user, reason=getattr(exc, "reason", "error"), status=status,
            message=getattr(exc, "message", str(exc))), status)

    async def answered(request: Request, user, fn, *args):
        """``fn(*args)`` of the API, or the refusal page for its error (the API's own ApiError, FrontendError)."""
        try:
            return await fn(*args), None
        except (ApiError, FrontendError) as exc:
            return None, refused(request, user, exc)

    @app.get("/ui/login", include_in_schema=False)
    async def login_form(request: Request) -> HTMLResponse:
        return page("login.html", request, error=None)

    @app.post("/ui/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        token = parse_qs((await request.body()).decode("utf-8", "replace")).get("token", [""])[0]
        if users.current().authenticate(token.strip()) is None:
            return page("login.html", request, error="unknown token")
        resp = RedirectResponse("/ui/jobs", 303)
        resp.set_cookie(COOKIE, token.strip(), httponly=True, samesite="strict", path="/ui")
        return resp

    @app.get("/ui/", include_in_schema=False)
    async def home() -> RedirectResponse:
        return RedirectResponse("/ui/jobs", 303)

    @app.get("/ui/jobs", include_in_schema=False)
    async def jobs_page(request: Request) -> Response:
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        rows = await api["jobs"](user, None)
        return page("jobs.html", request, user=user, jobs=[_job_summary(v) for v in rows])

    def moment(request: Request, user, at: str, span: str) -> tuple[dict | None, HTMLResponse | None]:
        """The slider's state, or the refusal page for a bad ``at`` or ``span`` (400, the field named)."""
        from processors.history.moments import MomentError  # noqa: PLC0415 - start-up, as moment_of

        try:
            return moment_of(at, span, int(time.time() * 1000)), None
        except MomentError as exc:
            return None, refused(request, user, ApiError(400, INVALID_REQUEST, str(exc)))

    @app.get("/ui/jobs/{job}", include_in_schema=False)
    async def job_page(request: Request, job: str, at: str = "", span: str = AT_DEFAULT_SPAN) -> Response:
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        when, err = moment(request, user, at, span)
        if err is None:
            view, err = await answered(request, user, api["job_status"], job, user, str(when["ms"]) if at else None)
        return err or page("job.html", request, user=user, job=_job_summary(view), view=view, at=when)

    @app.get("/ui/jobs/{job}/tasks", include_in_schema=False)
    async def job_tasks(request: Request, job: str) -> Response:
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        view, err = await answered(request, user, api["job_status"], job, user)
        return err or page("tasks.html", request, job=_job_summary(view), view=view)

    @app.get("/ui/jobs/{job}/timeline.json", include_in_schema=False)
    async def job_timeline(request: Request, job: str) -> Response:
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        ent = entitlement_of_job(job)
        docs = await replay_docs(user, entitlement=ent, job=job)
        # the maintenance of its machines: keyed to their owner, the job's entitlement (they name machines, not jobs)
        down = await replay_docs(user, entitlement=ent, topics=("unavailability",),
                                 types=frozenset({"UnavailabilityStarted", "UnavailabilityEnded"}))
        return JSONResponse(timeline(docs, int(time.time() * 1000), job, down))

    @app.get("/ui/machines", include_in_schema=False)
    async def machines_page(request: Request, at: str = "", span: str = AT_DEFAULT_SPAN, status: str = "",
                            owner: str = "", dc: str = "", q: str = "", page_no: int = 1,
                            per: int = FLEET_PAGE) -> Response:
        """The fleet: a page of FLEET_PAGE machines by DC, MSB, rack and name, filtered (status, owner: an
        entitlement or ``free``, DC, a part of the name); each maintenance by its reason, linked to its page."""
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        when, err = moment(request, user, at, span)
        if err is None:
            rows, err = await answered(request, user, api["machines"], user, None, False,
                                       str(when["ms"]) if at else None)
        if err is not None:
            return err
        windows = {w["unavailability_id"]: w for w in (await answered(request, user, api["maintenance"], user))[0]
                   or ()} if not at else {}
        f = {"status": status, "owner": owner, "dc": dc, "q": q}
        shown = fleet_filter(rows, f)
        per = min(max(5, per), 1000)
        pages = max(1, -(-len(shown) // per))
        page_no = min(max(1, page_no), pages)
        if per != FLEET_PAGE:
            f["per"] = str(per)  # kept by the pager's links
        return page("machines.html", request, user=user, rows=shown[(page_no - 1) * per:page_no * per],
                    total=len(rows), matched=len(shown), page_no=page_no, pages=pages, per=per, f=f,
                    by_status=sorted(Counter(m["status"] for m in rows).items()),
                    dcs=sorted({m["dc"] for m in rows}), owners=sorted({m["entitlement"] or "free" for m in rows}),
                    windows=windows, at=when)

    @app.get("/ui/maintenance", include_in_schema=False)
    async def maintenance_page(request: Request) -> Response:
        """Maintenance planned or under way (the API's ``/v1/maintenance``, narrowed to the machines the user may
        see): its id, reason, start, deadline, how long, and its machines with their status now."""
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        windows, err = await answered(request, user, api["maintenance"], user)
        if err is not None:
            return err
        machines = {m["id"]: m for m in await api["machines"](user, None, False)}
        rows = [{**w, "by_status": sorted(Counter(machines[m]["status"] for m in w["machines"]
                                                  if m in machines).items()),
                 "now_ms": int(time.time() * 1000)} for w in sorted(windows, key=lambda w: w["start_ms"])]
        return page("maintenance.html", request, user=user, rows=rows, machines=machines)

    @app.get("/ui/entitlements", include_in_schema=False)
    async def entitlements_page(request: Request) -> Response:
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        ents = await api["entitlements"](user)
        rows = await api["machines"](user, None, False)
        held = Counter(m["entitlement"] for m in rows if m["entitlement"])
        pool: dict[str, Counter] = defaultdict(Counter)  # per DC: free (the loans page's rule), and unowned but not
        for m in rows:
            if m["entitlement"] is None:
                pool[m["dc"]]["free" if is_free(None, m["status"], bool(m["maintenance"])) else m["status"]
                              if not m["maintenance"] else "maintenance"] += 1
        return page("entitlements.html", request, user=user, ents=ents, held=held,
                    pool=sorted(pool.items()), free_total=sum(c["free"] for c in pool.values()))

    @app.get("/ui/events", include_in_schema=False)
    async def events_page(request: Request, entitlement: str = "", job: str = "", type: str = "",
                          exclude: str = FEED_DEFAULT_EXCLUDE, since: str = FEED_DEFAULT_SINCE) -> Response:
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        since_ms = _since_ms(since)
        error = None
        docs: list[dict] = []
        types = frozenset(t for t in type.split(",") if t) or None
        excluded = frozenset(t for t in exclude.split(",") if t) or None
        try:
            docs = await replay_docs(user, entitlement=entitlement or (entitlement_of_job(job) if job else None),
                                     job=job or None, since_ms=since_ms, types=types, exclude_types=excluded,
                                     topics=feed_topics(types, excluded))
        except Exception as exc:  # noqa: BLE001 - a bad filter is said on the page
            error = getattr(exc, "message", None) or str(exc)
        docs.sort(key=time_order_key, reverse=True)
        return page("events.html", request, user=user, rows=[(d, format_text_doc(d)) for d in docs[:FEED_LIMIT]],
                    shown=min(len(docs), FEED_LIMIT), matched=len(docs), error=error,
                    f={"entitlement": entitlement, "job": job, "type": type, "exclude": exclude, "since": since})

    @app.get("/ui/rebalance", include_in_schema=False)
    async def rebalance_page(request: Request) -> Response:
        """The ReBalancer's plans (every one the user may see, the newest first): when, its moves and their
        progress, max/mean before and after, and why (trigger, goals, constraints, what could not move)."""
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        plans, err = await answered(request, user, api["rebalance_plans"], user, None, True)
        if err is not None:
            return err
        plans.sort(key=lambda v: (v["planned_ms"], v["plan"]), reverse=True)
        return page("rebalance.html", request, user=user, plans=plans)

    @app.get("/ui/intents", include_in_schema=False)
    async def intents_page(request: Request) -> Response:
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        rows, err = await answered(request, user, api["intents_list"], user)
        return err or page("intents.html", request, user=user, rows=rows)

    @app.get("/ui/jobs/{job}/intents", include_in_schema=False)
    async def job_intents_page(request: Request, job: str) -> Response:
        """A job's intents: every one declared, applied (by which reconciliation) or refused (reason, field);
        those in force with their owner; the reconciled spec; the entitlement's elasticity."""
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        ledger, err = await answered(request, user, api["intents_ledger"], job, user)
        if err is not None:
            return err
        view, err = await answered(request, user, api["intents_show"], job, user)
        if err is not None and err.status_code != 404:  # 404: no intent known for the job yet (the empty state)
            return err
        loans, _ = await answered(request, user, api["loans"], user)
        ent = entitlement_of_job(job)
        return page("job_intents.html", request, user=user, job=job, entitlement=ent, ledger=ledger,
                    view=view, elastic=(loans or {}).get("elastic", {}).get(ent))

    @app.get("/ui/srm", include_in_schema=False)
    async def srm_page(request: Request) -> Response:
        """The SRM per job: its size, load and forecast, what it would decide now and why, its latest decision."""
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        rows, err = await answered(request, user, api["srm_overview"], user)
        if err is not None:
            return err
        known = {r["job"] for r in rows}  # every job the user sees: those the SRM does not size say so
        others = [{"job": v["job"], "entitlement": v["entitlement"], "current_tasks": v["desired_tasks"]}
                  for v in await api["jobs"](user, None) if v["job"] not in known]
        return page("srm.html", request, user=user, rows=rows, others=others)

    @app.get("/ui/loans", include_in_schema=False)
    async def loans_page(request: Request) -> Response:
        """Elastic loans: in force (lender, borrower, machines), being taken back (deadline), and every grant,
        revocation and return on the log."""
        if (user := user_of(request)) is None:
            return RedirectResponse("/ui/login", 303)
        doc, err = await answered(request, user, api["loans"], user)
        if err is not None:
            return err
        doc["history"] = sorted(doc["history"], key=lambda h: h["at_ms"], reverse=True)
        return page("loans.html", request, user=user, doc=doc)

    @app.get("/ui/stream/{kind}", include_in_schema=False)
    async def stream(request: Request, kind: str, entitlement: str | None = None) -> Response:
        user = user_of(request)
        if user is None or kind not in ("jobs", "machines"):
            return Response(status_code=401 if user is None else 404)
        return await events(request, user, kind, entitlement)


def fleet_filter(rows: list[dict], f: dict[str, str]) -> list[dict]:
    """The fleet page's machines: those matching every filter given (status, owner: an entitlement or ``free``, DC,
    ``q``: part of the name), by DC, MSB, rack and name. Pure."""
    out = [m for m in rows if (not f["status"] or m["status"] == f["status"])
           and (not f["owner"] or (m["entitlement"] or "free") == f["owner"])
           and (not f["dc"] or m["dc"] == f["dc"]) and (not f["q"] or f["q"] in m["id"])]
    return sorted(out, key=lambda m: (m["dc"], m["msb"], m["rack"], m["id"]))


def feed_topics(types: frozenset[str] | None, excluded: frozenset[str] | None) -> tuple[str, ...] | None:
    """The topics the event feed reads: those that carry an event type it may show (the catalogue's ``events``).
    Leaving out AgentHeartbeat (its default) skips the heartbeats topic instead of reading it record by record:
    the feed took 12 s for 500 rows on a 200-machine region. None: every topic."""
    if types is None and excluded is None:
        return None
    return tuple(t for t in DATA_TOPICS if not BY_NAME[t].events or any(  # a topic naming no types: read it
        (types is None or e in types) and (excluded is None or e not in excluded) for e in BY_NAME[t].events))


def _job_summary(v: dict) -> dict:
    by_state = Counter(t["state"] for t in v["tasks"])
    return {**v, "running": by_state.get("RUNNING", 0), "by_state": sorted(by_state.items())}


def _since_ms(since: str) -> int | None:
    """The CLI's ``--since`` forms (10m, 1h, ISO-8601, ms); None for none or a form it refuses."""
    try:
        return _parse_time(since or None)
    except CliError:
        return None
