#!/usr/bin/env bash
# The device check (issue 35, docs/device.md): ONE command on a lent GPU machine that proves the
# kernels and the real engine (Ray GPU actors, the scheduler, SQLite, the report) in < 10 min.
#
#   scripts/device_check.sh OUTDIR          # on the GPU machine, after scripts/device_wheelhouse.sh
#   scripts/device_check.sh --cpu OUTDIR    # the rehearsal here: device cpu, tiny sizes, the venv
#   scripts/device_check.sh --plan          # here: the GPU run's predicted time, step by step
#                                           # (scripts/device_plan.py); exit 1 over the budget
#
# Steps, each under its own `timeout` (clamped to what is left of DEVICE_CHECK_BUDGET_S), each
# writing its own file in OUTDIR; a failing step does not stop the next; the exit code is 0 only
# when every step passed. OUTDIR holds 8 files at most (the device tool brings back 8):
#   summary.txt      one line per step: PASS/FAIL, exit code, seconds
#   facts.txt        nvidia-smi, torch/CUDA/cuDNN/NCCL, the SDPA backend of a bf16 call, memory
#   install.log      pip install of .whl/ into a --target folder (skipped with --cpu)
#   cuda-tests.log   the primitive's and the protocol's CUDA tests, pytest --noconftest
#   protocol.log     run_case without Ray: gated kernels, ring kernels at W = 1, a deliberate OOM
#   engine.log       ringlab db upgrade, serve (local Ray), submit --watch, then serve's own log
#   engine-report.md ringlab results and ringlab report of every sweep submitted (its own step,
#                    so a watch that runs out of time still leaves what finished)
#   bench-gpu.md     python -m bench.gpu's output, its results.md and results.jsonl
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CPU=0 PLAN=0
if [[ ${1:-} == --cpu ]]; then CPU=1; shift; elif [[ ${1:-} == --plan ]]; then PLAN=1; shift; fi
[[ $# -eq $((1 - PLAN)) ]] || { echo "usage: $0 [--cpu] OUTDIR | $0 --plan" >&2; exit 2; }
BUDGET_S=${DEVICE_CHECK_BUDGET_S:-530}  # 600 s less the stop of serve (30 s) and a kill grace (15 s)
# Each step's timeout (clamped to what is left of the budget), and what --plan predicts against
declare -A CAP=([facts]=60 [install]=120 [cuda-tests]=120 [protocol]=150 [engine]=300 [report]=60
                [bench]=240)
export PYTHONUNBUFFERED=1 COLUMNS=200 RAY_memory_monitor_refresh_ms=0

if ((CPU)); then
  PY=${DEVICE_CHECK_PYTHON:-$REPO/.venv/bin/python}  # the venv's (tests: the running one)
  export PY RINGLAB=$(dirname "$PY")/ringlab DEVICE=cpu
  export EXAMPLE=examples/cpu-gpu-proof.yaml PROTO_ARGS="--seq 128 --dtype float32"
  export BENCH_ARGS="--device cpu --seq 128 --check-seq 64 --repeats 1 --no-search"
  export TESTS_K="cuda"  # the CUDA tests only (skipped here): the rehearsal proves they import
else
  export SITE=/tmp/ringlab-site PY=python3 DEVICE=cuda
  export RINGLAB=$SITE/bin/ringlab PYTHONPATH=$SITE  # the ringlab wheel: entry points, migrations
  export EXAMPLE=examples/gpu-proof.yaml PROTO_ARGS="--seq 16384 --dtype bfloat16"
  export BENCH_ARGS="--seq 32768 --check-seq 8192 --dtypes bfloat16 --repeats 2 --no-search"
  export TESTS_K=""
fi
if ((PLAN)); then  # the GPU run's steps and arguments, predicted here with the venv
  PY=${DEVICE_CHECK_PYTHON:-$REPO/.venv/bin/python}
  caps=$(for step in "${!CAP[@]}"; do printf '%s=%s ' "$step" "${CAP[$step]}"; done)
  exec env PYTHONPATH="$REPO" "$PY" scripts/device_plan.py --budget "$BUDGET_S" --caps "$caps" \
    --proto-args "$PROTO_ARGS" --bench-args "$BENCH_ARGS" --example "$EXAMPLE"
fi
mkdir -p "$1" && OUT=$(cd "$1" && pwd)
WORK=$(mktemp -d /tmp/device-check.XXXXXX)
export CPU OUT WORK REPO
# shellcheck source=scripts/device_steps.sh
source scripts/device_steps.sh

START=$SECONDS
FAILED=0
run_step() {  # NAME LOG FUNCTION [RESERVE_S]: the function under timeout (CAP[NAME], clamped),
  # into OUTDIR/LOG, leaving RESERVE_S of the budget to the steps after it
  local name=$1 cap=${CAP[$1]} log=$2 fn=$3 reserve=${4:-0} left t rc begin
  left=$((BUDGET_S - (SECONDS - START) - reserve))
  t=$((cap < left ? cap : left))
  if ((t < 5)); then
    printf '%-10s SKIP  no time left of %ss\n' "$name" "$BUDGET_S" | tee -a "$OUT/summary.txt"
    FAILED=1
    return
  fi
  begin=$SECONDS
  echo "## $name: $(date -u +%FT%TZ), timeout ${t}s" >>"$OUT/$log"
  timeout -k 15 "$t" bash -c "source scripts/device_steps.sh && $fn" >>"$OUT/$log" 2>&1
  rc=$?
  if ((rc == 0)); then word=PASS; else word=FAIL; FAILED=1; fi
  ((rc == 124 || rc == 137)) && word="FAIL (timed out)"  # 137: killed after the grace
  printf '%-10s %s  rc %s  %ss\n' "$name" "$word" "$rc" "$((SECONDS - begin))" \
    | tee -a "$OUT/summary.txt"
}

: >"$OUT/summary.txt"
run_step facts facts.txt step_facts
if ((CPU)); then
  echo "skipped with --cpu: the venv is used" >"$OUT/install.log"
  printf '%-10s SKIP  --cpu uses the venv\n' install | tee -a "$OUT/summary.txt"
else
  run_step install install.log step_install
fi
run_step cuda-tests cuda-tests.log step_cuda_tests
run_step protocol protocol.log step_protocol
export RINGLAB_DATABASE_URL=sqlite:///$WORK/ringlab.db RINGLAB_ARTIFACT_ROOT=$WORK/artifacts
run_step engine engine.log step_engine 45  # 45 s kept for the report of what finished
run_step report engine-report.md step_report
stop_serve >>"$OUT/engine.log" 2>&1  # whatever the steps' end (a timeout too): serve and its Ray
run_step bench bench-gpu.md step_bench
collect_bench >>"$OUT/bench-gpu.md" 2>&1
echo "total ${SECONDS}s of ${BUDGET_S}s; $(ls "$OUT" | wc -l) files in $OUT" | tee -a "$OUT/summary.txt"
rm -rf "$WORK"
exit "$FAILED"
