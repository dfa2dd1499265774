#!/usr/bin/env python3
"""Submit a job to a Ropewalk region through its HTTP API with Python's standard library alone, and wait until its
tasks run.

    python examples/submit_job.py --entitlement e1 --name hello --tasks 2
    ROPEWALK_TOKEN=rwt_... python examples/submit_job.py --api http://127.0.0.1:19080 ...

The token: ``--token``, else ``ROPEWALK_TOKEN``, else the region administrator's (``.run/secrets/token``, made by
``ropewalk up``; ``ropewalk user add NAME --role E=operator`` makes a user's). The API (OpenAPI at ``/docs``):
``POST /v1/jobs`` with the spec waits for the scheduler's verdict (201 accepted, 409 refused with its reason);
``GET /v1/jobs/{job}`` is the job's state. An error answer is ``{"error": <reason>, "message": <one line>}``.
"""
import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def call(api: str, token: str, method: str, path: str, body=None):
    """The answer's status and JSON document (an error answer too)."""
    req = urllib.request.Request(api.rstrip("/") + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--api", default=os.environ.get("ROPEWALK_API_URL", "http://127.0.0.1:19080"))
    ap.add_argument("--token", default=os.environ.get("ROPEWALK_TOKEN"))
    ap.add_argument("--token-file", default=".run/secrets/token")
    ap.add_argument("--entitlement", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--tasks", type=int, default=1)
    ap.add_argument("--wait-s", type=float, default=60, help="how long to wait for every task to run")
    args = ap.parse_args()
    token = args.token or open(args.token_file).read().strip()
    spec = {"name": args.name, "entitlement": args.entitlement, "tasks": args.tasks,
            "command": ["sleep", "3600"], "resources": {"cpu_millicores": 500, "memory_mib": 256}}

    status, doc = call(args.api, token, "POST", "/v1/jobs", spec)
    if status not in (200, 201, 202):  # 409: refused by the scheduler; 400/422: a wrong field; 403: your role
        print(f"refused ({status}): {doc.get('error')}: {doc.get('message')}", file=sys.stderr)
        return 1
    job = doc["job"]
    print(f"{job}: {doc['verdict']}")
    deadline = time.monotonic() + args.wait_s
    while time.monotonic() < deadline:
        status, view = call(args.api, token, "GET", f"/v1/jobs/{job}")
        running = [t for t in view.get("tasks", []) if t["state"] == "RUNNING"] if status == 200 else []
        if len(running) == view.get("desired_tasks", -1):
            for t in running:
                print(f"{t['id']} RUNNING on {t['machine']} ({t['dc']}/{t['msb']}/{t['rack']})")
            return 0
        time.sleep(0.5)
    print(f"{job}: not every task runs after {args.wait_s:g} s; `ropewalk job describe {job}` says why",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
