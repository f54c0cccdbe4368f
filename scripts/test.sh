#!/usr/bin/env bash
# The whole test suite: lint, format check, then pytest against SQLite and the real Postgres.
# Called by `make test` (the README's test command) after the venv is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=$VENV/bin

"$BIN/ruff" check .
"$BIN/ruff" format --check .
"$BIN/mypy"  # service/ (pyproject's [tool.mypy] files), pydantic plugin

# Postgres: start the local cluster if it is down, and use it when it answers.
if command -v pg_ctlcluster >/dev/null 2>&1 && ! pg_isready -q -h 127.0.0.1 -p 5432; then
  ver=$(ls /etc/postgresql 2>/dev/null | head -1)
  [ -n "$ver" ] && pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
  for _ in $(seq 20); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
fi
if [ -z "${RINGLAB_TEST_POSTGRES_URL:-}" ] && command -v pg_isready >/dev/null 2>&1 \
    && pg_isready -q -h 127.0.0.1 -p 5432; then
  export RINGLAB_TEST_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/test
fi
if [ -z "${RINGLAB_TEST_POSTGRES_URL:-}" ]; then
  echo "note: no Postgres reachable and RINGLAB_TEST_POSTGRES_URL unset: Postgres tests will skip"
fi

# The dashboard's browser tests drive Debian's chromium: install it when it is missing.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium for the browser tests (apt-get install -y chromium)"
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi

# One OpenMP thread per test process (and the rank processes tests spawn, which inherit it): two
# workers, their ranks and Ray's actors already hold more processes than this machine has cores,
# and torch's default of a thread per core made each op's threads spin-wait on cores the others
# held (the CPU attention tests took 92 s on two workers, 49 s with one thread each).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# --durations: the slowest tests, so the suite can be kept within its 12 minutes on 2 cores
# Two workers (RINGLAB_TEST_WORKERS): the tests that use or start a Ray are split in two groups
# (tests/conftest.py RAY_GROUPS), each run one test after another on one worker with that
# worker's own local Ray, so the two groups' waits overlap; everything else fills in around them.
exec "$BIN/python" -m pytest -n "${RINGLAB_TEST_WORKERS:-2}" --dist loadgroup --durations=30 "$@"
