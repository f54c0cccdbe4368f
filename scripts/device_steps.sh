# The device check's steps (sourced by scripts/device_check.sh, which runs each under `timeout`
# in a `bash -c`). They read what device_check.sh exports: CPU, OUT, WORK, REPO, PY, RINGLAB,
# DEVICE, SITE (GPU), EXAMPLE, PROTO_ARGS, BENCH_ARGS, TESTS_K. Each returns non-zero on failure.

step_facts() {  # the machine before anything runs on it
  local rc=0
  if ((CPU)); then
    "$PY" scripts/device_facts.py --cpu || rc=1
  else
    nvidia-smi || rc=1
    "$PY" scripts/device_facts.py || rc=1
    # every package's version there: what scripts/device_packages.txt records (`unknown` lines)
    echo "## pip list"
    "$PY" -m pip list --format=freeze 2>/dev/null | tr '\n' ' '
    echo
  fi
  grep -E '^(MemTotal|MemAvailable)' /proc/meminfo
  df -h /dev/shm
  echo "cpus $(nproc)"
  return "$rc"
}

step_install() {  # the wheelhouse into a --target folder, then what must import from it
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    .whl/*.whl || return 1
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|numpy|typer|rich|httpx|jinja2|pyyaml|fsspec|anyio|click|protobuf|requests|msgpack) '
  (cd "$WORK" && "$PY" - <<'EOF'
from importlib.metadata import entry_points, version

import alembic, fastapi, plotly, pydantic, ray, sqlalchemy, sse_starlette, uvicorn  # noqa: F401
import service.migrations  # noqa: F401  (the wheel's: `ringlab db upgrade` needs it)

names = sorted(ep.name for ep in entry_points(group="ringlab.kernels"))
print("ringlab.kernels entry points:", ", ".join(names))
print({n: version(n) for n in ("ray", "fastapi", "SQLAlchemy", "pydantic", "ringlab")})
assert "sdpa" in names, "the ringlab wheel's entry points are not visible"
EOF
  )
}

step_cuda_tests() {  # the primitive's and the protocol's CUDA tests, no conftest, no service
  # -o filterwarnings: pyproject's filters name beartype, which the GPU machine lacks (an older
  # pytest stops at a filter whose module it cannot import)
  "$PY" -m pytest -q -p no:cacheprovider --noconftest -o filterwarnings=default \
    ${TESTS_K:+-k "$TESTS_K"} tests/attention/test_primitive.py tests/workers/test_cuda.py
}

step_protocol() {  # workers.protocol.run_case in this process: no Ray
  # shellcheck disable=SC2086  # PROTO_ARGS is a list of words
  PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} "$PY" scripts/device_protocol.py \
    --device "$DEVICE" $PROTO_ARGS
}

serve_up() {  # ringlab serve on SQLite in WORK, its local Ray included; wait for /healthz
  local port
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  export RINGLAB_URL=http://127.0.0.1:$port
  "$RINGLAB" db upgrade || return 1
  # its own session: the step's timeout (which signals its process group) leaves it serving
  # for the report step; stop_serve ends it and its Ray
  setsid "$RINGLAB" serve --port "$port" >"$WORK/serve.log" 2>&1 &
  echo $! >"$WORK/serve.pid"
  echo "$RINGLAB_URL" >"$WORK/serve.url"
  for _ in $(seq 240); do
    "$PY" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1] + '/api/v1/healthz', timeout=2)" \
      "$RINGLAB_URL" 2>/dev/null && { echo "serve answers at $RINGLAB_URL"; return 0; }
    kill -0 "$(cat "$WORK/serve.pid")" 2>/dev/null || { echo "serve died"; return 1; }
    sleep 0.5
  done
  echo "serve did not answer in 120 s"
  return 1
}

step_engine() {  # the real engine: db upgrade, serve + Ray, submit --watch
  cd "$WORK" || return 1  # not the source tree: the ringlab wheel's service (its migrations)
  serve_up || return 1
  "$RINGLAB" submit "$REPO/$EXAMPLE" --watch | tee "$WORK/submit.out"
}

step_report() {  # ringlab results and report of every sweep submitted (even if the watch ran out)
  local rc=0 id ids
  cd "$WORK" || return 1
  [[ -f $WORK/serve.url ]] || { echo "serve never started"; return 1; }
  export RINGLAB_URL
  RINGLAB_URL=$(cat "$WORK/serve.url")
  ids=$(grep -oE '^sweep [0-9]+ \(' "$WORK/submit.out" 2>/dev/null | grep -oE '[0-9]+')
  [[ -n $ids ]] || { echo "no sweep was submitted"; return 1; }
  for id in $ids; do
    echo "# sweep $id"
    echo '```'
    "$RINGLAB" results "$id" || rc=1
    echo '```'
    "$RINGLAB" report "$id" || rc=1
  done
  return "$rc"
}

stop_serve() {  # SIGTERM (the service stops its local Ray), then SIGKILL to what is left of
  # its session (serve and the Ray processes it started) after 30 s; then its log
  [[ -f $WORK/serve.pid ]] || return 0
  local pid
  pid=$(cat "$WORK/serve.pid")
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 60); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  kill -0 "$pid" 2>/dev/null && echo "serve ignored SIGTERM for 30 s: SIGKILL"
  kill -KILL -- "-$pid" 2>/dev/null  # its process group (setsid made serve its leader)
  echo "## serve's log (last 200 lines)"
  tail -n 200 "$WORK/serve.log"
}

step_bench() {  # bench.gpu, writing its results after each phase into WORK/bench
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
  "$PY" -m bench.gpu $BENCH_ARGS --out "$WORK/bench"
}

collect_bench() {  # what bench.gpu wrote, even when its step timed out
  if [[ -f $WORK/bench/results.md ]]; then
    echo "## results.md"
    cat "$WORK/bench/results.md"
    echo "## results.jsonl"
    echo '```'
    cat "$WORK/bench/results.jsonl"
    echo '```'
  else
    echo "bench.gpu wrote no results"
  fi
}
