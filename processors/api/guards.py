"""The API's small doors (issue 27): no token in a URL or a log, no body beyond ``MAX_BODY_BYTES``.

* **Tokens in a URL are refused** (``NoTokenInUrl``): a request whose query string has a parameter ``TOKEN_PARAMS``
  names (``?token=``, ``?access_token=``, ...) is answered 400 ``token_in_url`` before anything reads it — a URL
  ends up in access logs, proxies and browser histories; a token goes in ``Authorization: Bearer`` (the web UI: its
  login form's body, then a cookie).
* **No token in any log** (``RedactTokens``): the API process's log handlers (its own, uvicorn's error and access
  logs) pass every record through ``redact``, which blanks a query parameter of ``TOKEN_PARAMS`` and anything
  shaped like an API token (``rwt_...``) wherever it is in the line. So the refused request above leaves
  ``GET /v1/jobs?token=<redacted>`` in ``.run/api.log``, not the token.
* **Bodies are capped** (``BodyLimit``): a request announcing more than ``MAX_BODY_BYTES`` (``Content-Length``) is
  answered 413 ``body_too_large`` at once, before its body is read; one without a length (chunked) is read up to the
  cap and answered 413 as soon as it goes past it. Every route (``POST /v1/jobs``, the unauthenticated ``POST
  /ui/login``, ...): the biggest legitimate body, a job spec, is at most ``rules.MAX_SPEC_BYTES`` (256 KiB) of argv
  and env.
"""
from __future__ import annotations

import json
import logging
import re
from urllib.parse import parse_qsl

MAX_BODY_BYTES = 1024 * 1024
BODY_TOO_LARGE = "body_too_large"
TOKEN_IN_URL = "token_in_url"
TOKEN_PARAMS = frozenset({"token", "access_token", "bearer", "auth", "authorization", "api_key", "apikey"})
REDACTED = "<redacted>"
_TOKEN = re.compile(r"rwt_[A-Za-z0-9_\-]{6,}")  # processors/api/users.py: TOKEN_PREFIX and token_urlsafe
_PARAM = re.compile(r"(?i)([?&;](?:" + "|".join(sorted(TOKEN_PARAMS)) + r")=)[^&;\s\"']*")


def redact(text: str) -> str:
    """``text`` with token query values and API tokens replaced by ``REDACTED``. Pure."""
    return _TOKEN.sub("rwt_" + REDACTED, _PARAM.sub(lambda m: m.group(1) + REDACTED, text))


def token_params(query_string: bytes) -> list[str]:
    """The parameters of a query string that would carry a token (``TOKEN_PARAMS``, any case). Pure."""
    names = {k.lower() for k, _ in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)}
    return sorted(names & TOKEN_PARAMS)


class RedactTokens(logging.Filter):
    """A log handler's filter: the record's message and each of its arguments through ``redact`` (the arguments
    kept as arguments: uvicorn's access formatter reads them one by one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


def redact_logs(*loggers: str) -> None:
    """Every handler of the root logger and of ``loggers`` gets ``RedactTokens`` (once)."""
    for name in ("", *loggers):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactTokens) for f in handler.filters):
                handler.addFilter(RedactTokens())


async def _refuse(send, status: int, reason: str, message: str) -> None:
    body = json.dumps({"error": reason, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class NoTokenInUrl:
    """ASGI middleware: 400 ``TOKEN_IN_URL`` for a request with a token parameter in its query string."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (names := token_params(scope.get("query_string") or b"")):
            await _refuse(send, 400, TOKEN_IN_URL, f"{names[0]}: a token in a URL is refused (URLs are logged): send "
                                                   f"it as 'Authorization: Bearer <token>'")
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: 413 ``BODY_TOO_LARGE`` for a body beyond ``limit`` bytes, without reading it whole."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):  # noqa: C901
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request's body is larger than {self.limit:,} bytes"
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _refuse(send, 413, BODY_TOO_LARGE, message)
        state = {"read": 0, "refused": False, "started": False}

        async def counted():
            msg = await receive()
            if msg["type"] == "http.request":
                state["read"] += len(msg.get("body", b""))
                if state["read"] > self.limit:
                    if not state["started"]:
                        state["refused"] = True
                        await _refuse(send, 413, BODY_TOO_LARGE, message)
                    return {"type": "http.disconnect"}  # the app stops reading; what it answers is dropped
            return msg

        async def sent(msg):
            if state["refused"]:
                return
            state["started"] = True
            await send(msg)

        try:
            await self.app(scope, counted, sent)
        except Exception:  # noqa: BLE001 - the app's error at the cut body (a disconnect), after the 413: nothing more
            if not state["refused"]:
                raise
