"""The CLI's side of the API: the operations of ``processors/frontend/service.Frontend`` over HTTP (stdlib only).

    api = ApiClient("http://127.0.0.1:19080", token)
    api.job_status("e1.web")                      # the same document Frontend.job_status returns
    for event, data in api.events("jobs"):        # server-sent events: ("job", view) ..., ("ready", {...}), ...

An error answer raises ``ApiClientError`` with the API's one-line message (and its reason constant and status); an
API that does not answer says how to reach the log directly instead.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator

from processors.frontend.jobspec import ValidSpec

DEFAULT_TIMEOUT_S = 180.0


class ApiClientError(Exception):
    def __init__(self, message: str, reason: str = "", status: int = 0, doc: dict | None = None):
        super().__init__(message)
        self.reason, self.status, self.doc = reason, status, doc or {}


class ApiClient:
    def __init__(self, url: str, token: str | None, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    # -- plumbing --------------------------------------------------------------------------------------------
    def _open(self, method: str, path: str, body: Any = None, query: dict | None = None, *,
              ok: tuple[int, ...] = ()):
        q = {k: v for k, v in (query or {}).items() if v is not None}
        url = self.url + path + ("?" + urllib.parse.urlencode(q, doseq=True) if q else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            try:
                doc = json.loads(exc.read() or b"{}")
            except ValueError:
                doc = {}
            if exc.code in ok:
                return _Answer(exc.code, doc)
            message = doc.get("message") or f"HTTP {exc.code} from {url}"
            if exc.code == 401:
                message += " (set ROPEWALK_TOKEN to a token from `ropewalk user add`)"
            raise ApiClientError(message, doc.get("error", ""), exc.code, doc) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            why = getattr(exc, "reason", exc)
            raise ApiClientError(f"cannot reach the API at {self.url} ({why}); is `ropewalk up` running? (`--direct` "
                                 f"or ROPEWALK_DIRECT=1 writes to the log itself, as the operator)") from None

    def _json(self, method: str, path: str, body: Any = None, query: dict | None = None, *,
              ok: tuple[int, ...] = ()):
        resp = self._open(method, path, body, query, ok=ok)
        if isinstance(resp, _Answer):
            return resp.doc
        with resp:
            return json.loads(resp.read() or b"null")

    # -- the operations (as processors/frontend/service.Frontend) --------------------------------------------
    def whoami(self) -> dict:
        return self._json("GET", "/v1/whoami")

    def entitlement_create(self, name, quota, *, machine_type=None, dc=None, host_profile=None, fields=None) -> dict:
        return self._json("POST", "/v1/entitlements", {"name": name, "quota_machines": quota,
                                                        "machine_type": machine_type, "dc_pin": dc,
                                                        "host_profile": host_profile})

    def entitlement_update(self, name: str, changes: dict) -> dict:
        return self._json("PATCH", f"/v1/entitlements/{_q(name)}", changes)

    def entitlements(self) -> list[dict]:
        return self._json("GET", "/v1/entitlements")

    def entitlement_move(self, name: str, partition: int, reason: str = "", *, wait_s: float | None = None) -> dict:
        return self._json("POST", f"/v1/entitlements/{_q(name)}/move",
                          {"partition": partition, "reason": reason, "wait_s": wait_s})

    def job_status(self, job: str, at: str | None = None) -> dict:
        return self._json("GET", f"/v1/jobs/{_q(job)}", query={"at": at})

    def job_describe(self, job: str, events: int | None = None) -> dict:
        return self._json("GET", f"/v1/jobs/{_q(job)}/describe", query={"events": events})

    def job_logs(self, job: str, task: str | None = None, tail: int = 100, follow: bool = False
                 ) -> tuple[dict[str, str], Iterator[str]]:
        """The tasks without output (task -> why) and the output's lines as they come (``follow``: until closed)."""
        api = ApiClient(self.url, self.token, timeout_s=None) if follow else self  # -f: waits as long as it must
        resp = api._open("GET", f"/v1/jobs/{_q(job)}/logs", query={"task": task, "tail": tail,
                                                                    "follow": "true" if follow else None})
        missing = json.loads(resp.headers.get("X-Ropewalk-No-Output") or "{}")

        def lines() -> Iterator[str]:
            with resp:
                for raw in resp:
                    yield raw.decode("utf-8", "replace").rstrip("\n")

        return missing, lines()

    def jobs(self, entitlement: str | None = None) -> list[dict]:
        return self._json("GET", "/v1/jobs", query={"entitlement": entitlement})

    @staticmethod
    def _wait(wait_s: float | None) -> dict:
        return {"wait": "true", "timeout_s": wait_s} if wait_s else {"wait": "false"}

    def job_submit(self, spec: ValidSpec, *, wait_s: float | None = None, where: str = "") -> dict:
        """The spec the CLI checked (its file named in its refusals); the API checks it again at its own door: it
        trusts no client."""
        return self._json("POST", "/v1/jobs", spec.spec(), self._wait(wait_s), ok=(409,))

    def job_update(self, job: str, spec: ValidSpec, *, wait_s: float | None = None, where: str = "") -> dict:
        return self._json("PUT", f"/v1/jobs/{_q(job)}/spec", spec.spec(), self._wait(wait_s), ok=(409,))

    def job_resize(self, job: str, tasks, *, wait_s: float | None = None, field: str = "tasks") -> dict:
        return self._json("POST", f"/v1/jobs/{_q(job)}/resize", {"tasks": tasks}, self._wait(wait_s), ok=(409,))

    def job_stop(self, job: str, reason: str = "", *, wait_s: float | None = None) -> dict:
        return self._json("POST", f"/v1/jobs/{_q(job)}/stop", {"reason": reason}, self._wait(wait_s), ok=(409,))

    def machines(self, entitlement: str | None = None, free: bool = False, at: str | None = None) -> list[dict]:
        return self._json("GET", "/v1/machines", query={"entitlement": entitlement, "free": "true" if free else None,
                                                        "at": at})

    def machine_action(self, machine: str, action: str, *, dry_run: bool = False) -> dict:
        return self._json("POST", f"/v1/machines/{_q(machine)}/{_q(action)}",
                          query={"dry_run": "true" if dry_run else None})

    def machine_power(self, action: str, *, dc: str | None = None, msb: str | None = None,
                      rack: str | None = None) -> dict:
        body = {k: v for k, v in (("dc", dc), ("msb", msb), ("rack", rack)) if v is not None}
        return self._json("POST", f"/v1/power/{_q(action)}", body)

    def maintenance_plan(self, *, dry_run: bool = False, **plan) -> dict:
        return self._json("POST", "/v1/maintenance", plan, {"dry_run": "true" if dry_run else None})

    def region(self, at: str) -> dict:
        return self._json("GET", "/v1/region", query={"at": at})

    def explain(self, task: str, at: str | None = None, why_not: str | None = None) -> dict:
        return self._json("GET", f"/v1/tasks/{_q(task)}/explain", query={"at": at, "why_not": why_not})

    def maintenance_end(self, unavailability_id: str) -> dict:
        return self._json("POST", f"/v1/maintenance/{_q(unavailability_id)}/end")

    def rebalance_plans(self, entitlement: str | None = None, every: bool = False) -> list[dict]:
        return self._json("GET", "/v1/rebalance/plans", query={"entitlement": entitlement,
                                                                "all": "true" if every else None})

    def intent_declare(self, job: str, dimension: str, payload: dict) -> dict:
        return self._json("POST", f"/v1/jobs/{_q(job)}/intents/{_q(dimension)}", payload)

    def intents(self, job: str | None = None):
        return self._json("GET", f"/v1/jobs/{_q(job)}/intents" if job is not None else "/v1/intents")

    def intents_history(self, job: str) -> list[dict]:
        return self._json("GET", f"/v1/jobs/{_q(job)}/intents/history")

    def srm(self, job: str) -> dict:
        return self._json("GET", f"/v1/jobs/{_q(job)}/srm")

    def srm_plan(self, job: str) -> dict:
        return self._json("GET", f"/v1/jobs/{_q(job)}/srm/plan")

    def srm_overview(self) -> list[dict]:
        return self._json("GET", "/v1/srm")

    def intents_ledger(self, job: str) -> list[dict]:
        return self._json("GET", f"/v1/jobs/{_q(job)}/intents/ledger")

    def maintenance_windows(self) -> list[dict]:
        return self._json("GET", "/v1/maintenance")

    def srm_decisions(self, job: str | None = None, entitlement: str | None = None) -> dict:
        return self._json("GET", "/v1/srm/decisions", query={"job": job})

    def loans(self, entitlement: str | None = None) -> dict:
        return self._json("GET", "/v1/loans", query={"entitlement": entitlement})

    def elasticity_set(self, entitlement: str, elastic, max_borrowed=0, notice_ms=30_000, lend_idle=True) -> dict:
        return self._json("PUT", f"/v1/entitlements/{_q(entitlement)}/elasticity",
                          {"elastic": elastic, "max_borrowed_machines": max_borrowed, "revoke_notice_ms": notice_ms,
                           "lend_idle": lend_idle})

    def replay(self, **query) -> "ReplayLines":
        """The audit timeline: iterate for one event document per line; ``.stats`` once it ended."""
        return ReplayLines(self._open("GET", "/v1/replay", query=query))

    def events(self, kind: str, entitlement: str | None = None) -> Iterator[tuple[str, Any]]:
        """Server-sent events of ``/v1/events/<kind>``: (event name, data) until the stream ends."""
        resp = self._open("GET", f"/v1/events/{_q(kind)}", query={"entitlement": entitlement})
        with resp:
            event, data = "message", []
            for raw in resp:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line:
                    if data:
                        yield event, json.loads("\n".join(data))
                    event, data = "message", []
                elif line.startswith(":"):
                    continue
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())


class ReplayLines:
    def __init__(self, resp):
        self.resp = resp
        self.stats: dict = {}

    def __iter__(self) -> Iterator[tuple[str, dict]]:
        """(the line as the API sent it, its document), for each event."""
        with self.resp:
            for raw in self.resp:
                line = raw.decode("utf-8").rstrip("\n")
                if not line:
                    continue
                doc = json.loads(line)
                if set(doc) == {"stats"}:
                    self.stats = doc["stats"]
                    continue
                yield line, doc


class _Answer:
    def __init__(self, status: int, doc: dict):
        self.status, self.doc = status, doc


def _q(part: str) -> str:
    return urllib.parse.quote(str(part), safe="")
