"""The API process: ``python -m processors.api.server [--host 127.0.0.1] [--port N]`` (default ``ROPEWALK_API_PORT``).

Serves ``app.create_app`` with uvicorn, as broker principal ``api`` (infra/credentials.py), reading the users of
``<secrets>/users.yaml``. ``ropewalk up`` starts it beside the other workers (processors/controlplane.py).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn

from infra.config import Config
from processors.api.app import create_app
from processors.api.guards import redact_logs

PRINCIPAL = "api"


def main(argv: list[str] | None = None) -> int:
    cfg = Config.from_env().as_principal(PRINCIPAL)
    ap = argparse.ArgumentParser(prog="python -m processors.api.server", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=cfg.api_port)
    ap.add_argument("--users", help="the users file (default: <secrets>/users.yaml)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # One worker process; blocking log reads run in the thread pool. Graceful shutdown on SIGTERM (`ropewalk down`).
    app = create_app(cfg, users_path=Path(args.users) if args.users else None)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=True,
                            timeout_graceful_shutdown=5)  # (its logging configured here)
    redact_logs("uvicorn", "uvicorn.error", "uvicorn.access")  # no token in .run/api.log (guards.py)
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
