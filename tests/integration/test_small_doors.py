"""The small doors of issue 27, each tried as an attacker would, on the real API process and the real redis-server.

* a 50 MB body to ``POST /v1/jobs`` and to the unauthenticated ``POST /ui/login`` is answered 413 while most of it is
  still unsent — announced (Content-Length) or not (chunked);
* a token in a URL is refused, and no token reaches the API's log (uvicorn's access log included);
* env names ``A=B`` or with a NUL are refused at the API and at the CLI, naming the field;
* an intent's owner is the caller: a body naming another owner is refused, and what reaches the log names the caller;
* a read-only Redis user cannot EVAL (a loop, or anything), load or kill a script or function, nor make a registered
  read function do unbounded work: what it can do cannot stall the allocator.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import redis

from infra.config import PROJECT_ROOT
from processors.allocator import lua
from processors.allocator.index import _READ_CHUNK, READ, SUMMARY_OF, MachineIndex
from processors.api.guards import BODY_TOO_LARGE, MAX_BODY_BYTES, TOKEN_IN_URL
from processors.controlplane import worker_env
from streams.clients import EventConsumer
from streams.topics import Topics
from test_trust import Api

FIFTY_MB = 50 * 1024 * 1024


@pytest.fixture
def api(cfg, tmp_path):
    a = Api(cfg, tmp_path)
    yield a
    a.close()


def raw_request(port: int, head: str, chunks, *, timeout_s: float = 60) -> tuple[int, dict, int]:
    """Send ``head`` and then ``chunks`` (bytes, one at a time) until the server answers; (status, JSON body, bytes
    of the body sent before the answer came). The server must answer before the chunks run out (else the test
    fails: it waited for the whole body)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sent = 0
    try:
        s.sendall(head.encode())
        s.setblocking(False)
        answer = b""
        for chunk in chunks:
            try:
                answer += s.recv(65536)
            except BlockingIOError:
                pass
            if b"\r\n\r\n" in answer:
                break
            try:
                s.setblocking(True)
                s.settimeout(5)
                s.sendall(chunk)
                sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                break  # the server stopped reading (it answered, or is about to)
            finally:
                s.setblocking(False)
        s.setblocking(True)
        s.settimeout(timeout_s)
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            more = s.recv(65536)
            if not more:
                break
            answer += more
    finally:
        s.close()
    head_part, _, body = answer.partition(b"\r\n\r\n")
    assert head_part, f"no answer after {sent:,} bytes of the body"
    status = int(head_part.split(b" ", 2)[1])
    return status, json.loads(body[:_length(answer)] or b"{}"), sent


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 0


def body_chunks(total: int, size: int = 64 * 1024, chunked: bool = False):
    piece = b"x" * size
    for _ in range(total // size):
        yield (b"%x\r\n" % size + piece + b"\r\n") if chunked else piece


@pytest.mark.parametrize("path, authed", [("/v1/jobs", True), ("/ui/login", False)])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50_mb_body_is_refused_413_before_it_is_read(api, path, authed, chunked):
    auth = f"Authorization: Bearer {api.admin}\r\n" if authed else ""
    kind = "application/json" if path.startswith("/v1") else "application/x-www-form-urlencoded"
    length = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {FIFTY_MB}\r\n"
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: {kind}\r\n{length}\r\n"
    status, doc, sent = raw_request(api.port, head, body_chunks(FIFTY_MB, chunked=chunked))
    assert status == 413 and doc["error"] == BODY_TOO_LARGE, doc
    # announced: refused before a byte is read; chunked: as soon as the cap is passed (what the socket buffers held)
    assert sent < (8 * MAX_BODY_BYTES if chunked else 4 * MAX_BODY_BYTES), f"{sent:,} bytes sent before the 413"
    assert sent < FIFTY_MB / 4


def test_a_body_under_the_cap_is_read_as_before(api):
    status, doc = api.call("POST", "/v1/jobs", api.admin, {"name": "big", "entitlement": "e1", "tasks": 1,
                                                           "command": ["x" * (MAX_BODY_BYTES // 2)],
                                                           "resources": {"cpu_millicores": 1, "memory_mib": 1}})
    assert status == 400 and "command and env take" in doc["message"], doc  # read whole, refused by the rules


def test_a_token_in_a_url_is_refused_and_no_token_reaches_the_log(api, tmp_path):
    for path in (f"/v1/jobs?token={api.admin}", f"/v1/whoami?access_token={api.alice}&x=1",
                 f"/ui/login?Token={api.admin}", f"/healthz?TOKEN={api.admin}"):
        status, doc = api.call("GET", path, None)
        assert status == 400 and doc["error"] == TOKEN_IN_URL and "Authorization: Bearer" in doc["message"], doc
    assert api.call("GET", f"/v1/jobs/{api.admin}", api.admin)[0] == 422  # a token where a job id goes: refused
    assert api.call("GET", "/v1/whoami", api.admin) == (200, {"user": "root", "region_admin": True, "roles": {}})
    with urllib.request.urlopen(urllib.request.Request(f"{api.url}/ui/login", data=f"token={api.alice}x".encode(),
                                                       method="POST")) as resp:  # a wrong token, in the form's body
        assert resp.status == 200
    marker = "/healthz?after=last"  # the access log line of the last request: everything before it is written
    assert api.call("GET", marker, None)[0] == 200
    log = tmp_path / "api.log"
    deadline = time.monotonic() + 30
    while marker not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    assert marker in text, text[-2000:]
    assert api.admin not in text and api.alice not in text, text[-3000:]
    assert "token=<redacted>" in text and "access_token=<redacted>" in text and "rwt_<redacted>" in text, text[-3000:]


@pytest.mark.parametrize("name, field", [("A=B", "env.A=B"), ("A\x00B", "env.A\\x00B"), ("9LIVES", "env.9LIVES")])
def test_env_names_are_refused_at_the_api_naming_the_field(api, name, field):
    status, doc = api.call("POST", "/v1/jobs", api.admin,
                           {"name": "web", "entitlement": "e1", "tasks": 1, "command": ["sleep", "1"],
                            "resources": {"cpu_millicores": 100, "memory_mib": 64}, "env": {name: "1"}})
    assert status == 400 and field in doc["message"] and "environment variable name" in doc["message"], doc
    status, doc = api.call("POST", "/v1/jobs/e1.web/intents/push", api.admin,
                           {"percent": 10, "command": ["sleep", "2"], "env": {name: "1"}})
    assert status == 400 and field in doc["message"], doc


def test_env_names_are_refused_at_the_cli_naming_the_field(cfg, tmp_path):
    spec = tmp_path / "web.json"
    spec.write_text(json.dumps({"name": "web", "entitlement": "e1", "tasks": 1, "command": ["sleep", "1"],
                                "resources": {"cpu_millicores": 100, "memory_mib": 64}, "env": {"A=B": "1"}}))

    out = subprocess.run([sys.executable, "-m", "processors.frontend.cli", "job", "submit", str(spec), "--direct"],
                         env={**worker_env(cfg), "ROPEWALK_DIRECT": "1"}, cwd=PROJECT_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "env.A=B" in out.stderr, (out.stdout, out.stderr)


def test_an_intents_owner_is_the_caller(api, cfg, registry):
    status, doc = api.call("POST", "/v1/jobs/e1.web/intents/push", api.alice,
                           {"owner": "bob", "percent": 10, "command": ["sleep", "2"]})
    assert status == 403 and doc["error"] == "owner_not_caller" and "'alice'" in doc["message"], doc
    ids = []
    for body in ({"percent": 10, "command": ["sleep", "2"]}, {"owner": "alice", "percent": 20, "command": ["x"]}):
        status, doc = api.call("POST", "/v1/jobs/e1.web/intents/push", api.alice, body)
        assert status == 202, doc
        ids.append(doc["event_id"])
    c = EventConsumer(cfg, registry, [Topics(cfg.topic_prefix, cfg.partitions).name("intents")], name="test-owner")
    try:
        seen: dict = {}
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            seen.update({r.event.event_id: r.event for r in c.poll(100, 0.5) if r.event.event_id in ids})
    finally:
        c.close()
    assert {e.payload["owner"] for e in seen.values()} == {"alice"} and len(seen) == 2
    assert {e.principal for e in seen.values()} == {"alice"}


# -- Redis: what a read-only user can do cannot stall the allocator ---------------------------------------------

def test_a_read_only_redis_user_cannot_eval_a_loop_nor_make_a_read_function_work_unbounded(cfg):
    reader = cfg.redis_client(read_only=True)
    allocator = cfg.as_principal("allocator").redis_client()
    try:
        for attempt in (lambda: reader.eval("while true do end", 0),
                        lambda: reader.eval("return string.rep('x', 200 * 1024 * 1024)", 0),
                        lambda: reader.execute_command("EVAL_RO", "while true do end", "0"),
                        lambda: reader.script_load("while true do end"),
                        lambda: reader.function_load("#!lua name=evil\nredis.register_function('evil', "
                                                     "function() while true do end end)", replace=True),
                        lambda: reader.fcall("evil", 0),
                        lambda: reader.script_kill(), lambda: reader.function_kill(),
                        lambda: reader.execute_command("CLIENT", "KILL", "ID", "1"),
                        lambda: reader.execute_command("CLIENT", "PAUSE", "10000"),
                        lambda: reader.hgetall(f"{cfg.topic_prefix}taskres"), lambda: reader.keys("*"),
                        lambda: reader.scan(0, count=100_000_000), lambda: reader.get(f"{cfg.topic_prefix}m:x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        assert allocator.ping()  # answered at once: nothing of the above ran

        index = MachineIndex(allocator, cfg.topic_prefix)
        index.load_functions()
        mine = MachineIndex(reader, cfg.topic_prefix)
        assert mine.machines(["m1"]) == {} and mine.summary() is None  # it reads, through the functions
        for fn, args, why in ((READ, [cfg.topic_prefix, *(f"m{i}" for i in range(100_000))], "at most 1000"),
                              (READ, [cfg.topic_prefix, "m" * (1024 * 1024)], "longer than 256"),
                              (SUMMARY_OF, ["p" * (1024 * 1024)], "longer than 256")):
            with pytest.raises(redis.ResponseError, match=why):
                reader.fcall_ro(fn, 0, *args)
        # the largest read it may ask, measured by Redis itself: far below the threshold after which Redis answers
        # BUSY to the others (busy-reply-threshold; the allocator's own commands wait meanwhile)
        op = cfg.redis_client()
        threshold_ms = int(op.config_get("busy-reply-threshold")["busy-reply-threshold"])
        op.config_resetstat()
        reader.fcall_ro(READ, 0, cfg.topic_prefix, *(f"nosuch{i}" for i in range(_READ_CHUNK)))
        stats = op.info("commandstats")["cmdstat_fcall_ro"]
        assert stats["calls"] == 1 and stats["usec"] / 1000 < threshold_ms / 10, (stats, threshold_ms)
        assert lua.MAX_NAME == 256 and _READ_CHUNK == 1000
        op.close()
    finally:
        reader.close()
        allocator.close()
