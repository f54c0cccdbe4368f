#!/usr/bin/env bash
# (Re)start the ringlab API and scheduler on a Ray head node, as `ray up` does after `ray start
# --head` (deploy/ray-cluster*.yaml). Reads the secrets and settings from ~/ringlab.env; logs
# and pid files go to ~/ringlab-logs/. Stops only the processes it started (by their pid files).
set -euo pipefail
ENV_FILE=${RINGLAB_ENV_FILE:-$HOME/ringlab.env}
LOG_DIR=${RINGLAB_LOG_DIR:-$HOME/ringlab-logs}
RAY_PORT=${RINGLAB_RAY_PORT:-6380}
mkdir -p "$LOG_DIR"
if [ -f "$ENV_FILE" ]; then
  set -a
  # shellcheck disable=SC1090
  . "$ENV_FILE"
  set +a
else
  echo "error: $ENV_FILE is missing (copy deploy/ringlab.env.example and fill it in)" >&2
  exit 1
fi
: "${RINGLAB_DATABASE_URL:?set RINGLAB_DATABASE_URL (postgresql://...) in $ENV_FILE}"
if grep -Eq '^[A-Z_]+=change-me' "$ENV_FILE"; then
  echo "error: $ENV_FILE still has change-me values: replace them with secrets first" >&2
  exit 1
fi
TOKEN_FILE=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
if [ -n "${RAY_AUTH_TOKEN:-}" ] && [ -f "$TOKEN_FILE" ] && [ "$RAY_AUTH_TOKEN" != "$(cat "$TOKEN_FILE")" ]; then
  echo "error: RAY_AUTH_TOKEN in $ENV_FILE differs from $TOKEN_FILE, which the Ray nodes use;" \
    "remove it from $ENV_FILE" >&2
  exit 1
fi
export RINGLAB_RAY_ADDRESS=${RINGLAB_RAY_ADDRESS:-127.0.0.1:$RAY_PORT}

restart() {  # name, command...
  local name=$1 pidfile="$LOG_DIR/$1.pid"
  shift
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    kill "$(cat "$pidfile")"
    for _ in $(seq 30); do kill -0 "$(cat "$pidfile")" 2>/dev/null || break; sleep 1; done
  fi
  # setsid + nohup: the process outlives the SSH session of `ray up` that started it.
  setsid nohup "$@" >>"$LOG_DIR/$name.log" 2>&1 </dev/null &
  echo $! >"$pidfile"
  echo "started $name (pid $!, log $LOG_DIR/$name.log)"
}

# The API migrates the database before it listens (on RINGLAB_HOST, default 127.0.0.1); the
# scheduler starts once it answers.
restart api ringlab serve --no-scheduler
PORT=${RINGLAB_PORT:-8000}
for _ in $(seq 90); do
  if python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/api/v1/healthz', timeout=2)" \
    2>/dev/null; then
    restart scheduler ringlab scheduler
    exit 0
  fi
  sleep 2
done
echo "error: the API did not answer on port $PORT within 3 minutes; see $LOG_DIR/api.log" >&2
exit 1
