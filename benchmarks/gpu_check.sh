#!/usr/bin/env bash
# GPU check (issue 10, item 4): on a machine with a GPU and its own preinstalled jax (CUDA),
# flax, optax and orbax, and no network:
#   0. detect the GPU (jax.devices('gpu')); none: say so and exit 0
#   1. install what is missing: the project's dependencies from a wheel directory
#      (pip --no-index --find-links), then the project (pip install --no-deps -e .)
#   2. the backend contract tests on the GPU (tests/test_contract.py, JAX_PLATFORMS=cuda;
#      tests whose mesh needs more devices than the machine has are reported as skipped)
#   3. train dlrm_kaggle, ttrec_kaggle and cdlrm_kaggle STEPS steps each with --profile_steps
#   4. write benchmarks/results/gpu_check_<device kind>.{json,md}: device, jax version,
#      samples/s, offload transfer stats (pinned host <-> device), trace paths, test summary
#
#   bash benchmarks/gpu_check.sh                      # from anywhere; exit 0 without a GPU
#   RECGNN_WHEELS=/path/to/wheels bash benchmarks/gpu_check.sh
#   RECGNN_GPU_CHECK_ALLOW_CPU=1 bash benchmarks/gpu_check.sh   # (or --allow-cpu) test mode:
#       the same stages on CPU, 20 steps, a small contract subset, results in /tmp
#
# Environment (defaults in brackets; GPU mode / CPU test mode):
#   RECGNN_WHEELS                 wheel dir [shared/wheels, else benchmarks/wheels]
#   RECGNN_GPU_CHECK_EXTRA_DEPS   more distributions to install from it when missing [none]
#   RECGNN_GPU_CHECK_WORK         logs and workdirs (traces) [/tmp/recgnn_gpu_check]
#   RECGNN_GPU_CHECK_RESULTS      results dir [benchmarks/results / $WORK/results]
#   RECGNN_GPU_CHECK_STEPS        train steps [300 / 20]
#   RECGNN_GPU_CHECK_LOG_EVERY    log interval [50 / 5]
#   RECGNN_GPU_CHECK_PROFILE      profiled steps [100:110 / 5:8]
#   RECGNN_GPU_CHECK_ROWS         synthetic dataset rows, 0 = experiment default [1000000 / 20000]
#   RECGNN_GPU_CHECK_BATCH        train batch [2048 / 512]
#   RECGNN_GPU_CHECK_EXPERIMENTS  [dlrm_kaggle ttrec_kaggle cdlrm_kaggle]
#   RECGNN_GPU_CHECK_PYTEST_ARGS  extra pytest args [none / -k "matches_dense and 1x1 and sgd"]
#   RECGNN_GPU_CHECK_SKIP         stages to skip, comma-separated: install,tests,train
#   RECGNN_GPU_CHECK_TIMEOUT_INSTALL / _TESTS / _TRAIN   seconds per stage [300 / 1200 / 900]
#   PYTHON                        interpreter [python3]
#
# Exit status: 0 when every stage that ran passed (or no GPU), 1 when one failed (the results
# are still written, naming the failed stage), 2 on bad usage.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
HELPER="$ROOT/benchmarks/gpu_check.py"

ALLOW_CPU="${RECGNN_GPU_CHECK_ALLOW_CPU:-0}"
for arg in "$@"; do
  case "$arg" in
    --allow-cpu|--force-cpu) ALLOW_CPU=1 ;;
    -h|--help) sed -n '2,34p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

say() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
skipped() { [[ ",${RECGNN_GPU_CHECK_SKIP:-}," == *",$1,"* ]]; }

WORK="${RECGNN_GPU_CHECK_WORK:-/tmp/recgnn_gpu_check}"
mkdir -p "$WORK"
# The checkout first on the path: run.py, tests and experiments work even if the editable
# install cannot be made (e.g. no setuptools and no network for build isolation).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ----------------------------------------------------------------------------- 0. detect
say "stage detect: looking for a GPU (jax.devices('gpu'))"
DEVICE_JSON="$WORK/device.json"
detect_rc=0
# JAX_PLATFORMS unset: jax picks the GPU plugin when there is one.
env -u JAX_PLATFORMS timeout 300 "$PY" "$HELPER" detect >"$DEVICE_JSON" 2>"$WORK/detect.err" \
  || detect_rc=$?
if [[ $detect_rc -eq 3 ]] && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  # A GPU the driver sees but jax does not: a broken jax/CUDA install, not a CPU machine.
  say "FAILED stage detect: nvidia-smi lists $(nvidia-smi -L | head -n 1) but jax sees no GPU:"
  cat "$DEVICE_JSON" "$WORK/detect.err" >&2
  exit 1
fi
if [[ $detect_rc -eq 3 ]]; then
  if [[ "$ALLOW_CPU" != "1" ]]; then
    say "no GPU found: $(cat "$DEVICE_JSON")"
    say "nothing to check on this machine; stopping (exit 0). Test mode: --allow-cpu"
    exit 0
  fi
  say "no GPU found; CPU test mode (--allow-cpu): the same stages on CPU, small sizes"
  env -u JAX_PLATFORMS "$PY" "$HELPER" detect --allow-cpu >"$DEVICE_JSON" 2>>"$WORK/detect.err"
elif [[ $detect_rc -ne 0 ]]; then
  say "FAILED stage detect: could not import jax or list devices (exit $detect_rc):"
  tail -n 20 "$WORK/detect.err" >&2
  exit 1
fi
PLATFORM="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["platform"])' "$DEVICE_JSON")"
say "found: $(cat "$DEVICE_JSON")"

if [[ "$PLATFORM" == "cpu" ]]; then
  MODE=cpu
  RESULTS="${RECGNN_GPU_CHECK_RESULTS:-$WORK/results}"
  STEPS="${RECGNN_GPU_CHECK_STEPS:-20}"
  LOG_EVERY="${RECGNN_GPU_CHECK_LOG_EVERY:-5}"
  PROFILE="${RECGNN_GPU_CHECK_PROFILE:-5:8}"
  ROWS="${RECGNN_GPU_CHECK_ROWS:-20000}"
  BATCH="${RECGNN_GPU_CHECK_BATCH:-512}"
  PYTEST_ARGS="${RECGNN_GPU_CHECK_PYTEST_ARGS--k 'matches_dense and 1x1 and sgd'}"
else
  MODE=gpu
  RESULTS="${RECGNN_GPU_CHECK_RESULTS:-$ROOT/benchmarks/results}"
  STEPS="${RECGNN_GPU_CHECK_STEPS:-300}"
  LOG_EVERY="${RECGNN_GPU_CHECK_LOG_EVERY:-50}"
  PROFILE="${RECGNN_GPU_CHECK_PROFILE:-100:110}"
  ROWS="${RECGNN_GPU_CHECK_ROWS:-1000000}"
  BATCH="${RECGNN_GPU_CHECK_BATCH:-2048}"
  PYTEST_ARGS="${RECGNN_GPU_CHECK_PYTEST_ARGS:-}"
fi
read -r -a EXPERIMENTS <<<"${RECGNN_GPU_CHECK_EXPERIMENTS:-dlrm_kaggle ttrec_kaggle cdlrm_kaggle}"
T_INSTALL="${RECGNN_GPU_CHECK_TIMEOUT_INSTALL:-300}"
T_TESTS="${RECGNN_GPU_CHECK_TIMEOUT_TESTS:-1200}"
T_TRAIN="${RECGNN_GPU_CHECK_TIMEOUT_TRAIN:-900}"
# Every later stage runs on the detected platform only ("cuda": never a silent CPU fallback).
export JAX_PLATFORMS="$PLATFORM"
FAILED=()

# Clear what a previous check left (its status files would be read as this run's).
rm -f "$WORK"/*.status "$WORK"/*.log "$WORK"/contract.xml "$WORK"/install.txt
for e in "${EXPERIMENTS[@]}"; do rm -rf "${WORK:?}/$e"; done

# Write NAME.status: {"status", "exit_code", "seconds"} for the collector.
write_status() {  # name rc seconds
  local st=ok
  if [[ $2 -eq 124 || $2 -eq 137 ]]; then st=timeout; elif [[ $2 -ne 0 ]]; then st=failed; fi
  printf '{"status": "%s", "exit_code": %d, "seconds": %d}\n' "$st" "$2" "$3" >"$WORK/$1.status"
  echo "$st"
}

# ---------------------------------------------------------------------------- 1. install
install_stage() {
  local wheels="${RECGNN_WHEELS:-}" missing note=""
  if [[ -z "$wheels" ]]; then
    for d in "$ROOT/shared/wheels" "$ROOT/benchmarks/wheels"; do
      if [[ -d "$d" ]]; then wheels="$d"; break; fi
    done
  fi
  missing="$("$PY" "$HELPER" deps --extra pytest ${RECGNN_GPU_CHECK_EXTRA_DEPS:-})"
  if [[ -n "$missing" ]]; then
    if [[ -n "$wheels" && -d "$wheels" ]]; then
      say "installing from $wheels (no index): $missing"
      for pkg in $missing; do  # one at a time: a missing wheel (say pymetis) blocks no other
        if timeout "$T_INSTALL" "$PY" -m pip install -q --no-index --find-links "$wheels" "$pkg"; then
          note+="installed $pkg from $wheels; "
        else
          say "WARNING: no usable wheel for $pkg in $wheels"
        fi
      done
    else
      say "WARNING: missing $missing and no wheel dir (set RECGNN_WHEELS)"
    fi
    missing="$("$PY" "$HELPER" deps --extra pytest ${RECGNN_GPU_CHECK_EXTRA_DEPS:-})"
    [[ -n "$missing" ]] && note+="still missing: $missing; "
  fi
  if ! "$PY" -m pip show -q recgnn >/dev/null 2>&1; then
    say "pip install --no-deps -e . (no build isolation: no network here)"
    if timeout "$T_INSTALL" "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"; then
      note+="project installed editable; "
    elif [[ -n "$wheels" && -d "$wheels" ]] && timeout "$T_INSTALL" "$PY" -m pip install -q \
        --no-deps --no-index --find-links "$wheels" -e "$ROOT"; then
      # (old setuptools or no `wheel` here: the build env from the wheel dir's setuptools)
      note+="project installed editable (build env from $wheels); "
    else
      say "WARNING: editable install failed; running from the checkout (PYTHONPATH)"
      note+="editable install failed (running from the checkout); "
    fi
  fi
  # What run.py and the tests import: fail here, with the names, rather than in every stage.
  if ! "$PY" -c "import absl, ml_collections, flax, optax, orbax.checkpoint, numpy, scipy, recgnn" \
      2>"$WORK/install.err"; then
    say "FAILED stage install: $(tail -n 1 "$WORK/install.err")"
    say "  put wheels for the missing packages in a directory and set RECGNN_WHEELS (on a" \
      "machine with network and the same Python: pip download -d DIR --only-binary=:all:" \
      "ml-collections tensorboardX absl-py pytest)"
    echo "${note}FAILED: $(tail -n 1 "$WORK/install.err")" >"$WORK/install.txt"
    return 1
  fi
  echo "${note:-nothing to install}" >"$WORK/install.txt"
  say "install ok: $(cat "$WORK/install.txt")"
}

if skipped install; then
  say "stage install: skipped (RECGNN_GPU_CHECK_SKIP)"
elif ! install_stage; then
  FAILED+=(install)
fi

# ------------------------------------------------------------------------------ 2. tests
if skipped tests || [[ " ${FAILED[*]} " == *" install "* ]]; then
  say "stage tests: skipped"
else
  say "stage tests: python -m pytest tests/test_contract.py on $PLATFORM $PYTEST_ARGS" \
    "(limit ${T_TESTS}s; log $WORK/contract.log)"
  t0=$SECONDS
  rc=0
  # JAX_PLATFORMS is exported, so tests/conftest.py's setdefault("JAX_PLATFORMS", "cpu") keeps
  # it; the plugin checks the platform and skips meshes larger than the device count.
  eval "set -- $PYTEST_ARGS"
  RECGNN_GPU_CHECK_EXPECT_PLATFORM="$( [[ $MODE == gpu ]] && echo gpu || echo cpu )" \
    PYTHONPATH="$ROOT/benchmarks:$PYTHONPATH" \
    timeout --kill-after=30 "$T_TESTS" "$PY" -m pytest tests/test_contract.py -rfEs \
    -p gpu_check --junitxml="$WORK/contract.xml" "$@" >"$WORK/contract.log" 2>&1 || rc=$?
  set --
  st="$(write_status contract $rc $((SECONDS - t0)))"
  tail -n 5 "$WORK/contract.log"
  if [[ $st != ok ]]; then
    say "FAILED stage tests: contract tests $st (exit $rc); see $WORK/contract.log"
    FAILED+=(tests)
  else
    say "stage tests: ok"
  fi
fi

# ------------------------------------------------------------------------------ 3. train
if skipped train || [[ " ${FAILED[*]} " == *" install "* ]]; then
  say "stage train: skipped"
else
  for exp in "${EXPERIMENTS[@]}"; do
    args=(--experiment="$exp" --workdir="$WORK/$exp" --config.train.steps="$STEPS"
      --config.train.log_every="$LOG_EVERY" --config.train.batch_size="$BATCH"
      --profile_steps="$PROFILE")
    [[ "$ROWS" != 0 ]] && args+=(--config.data.synthetic.rows="$ROWS")
    say "stage train $exp: python run.py ${args[*]} (limit ${T_TRAIN}s; log $WORK/$exp.log)"
    t0=$SECONDS
    rc=0
    # SIGTERM first: the trainer saves a checkpoint and stops; SIGKILL 60 s later.
    timeout --kill-after=60 "$T_TRAIN" "$PY" run.py "${args[@]}" >"$WORK/$exp.log" 2>&1 || rc=$?
    st="$(write_status "$exp" $rc $((SECONDS - t0)))"
    grep -E "samples/s|^.*eval |Profile of" "$WORK/$exp.log" | tail -n 4 || true
    if [[ $st != ok ]]; then
      say "FAILED stage train $exp: $st (exit $rc); last lines of $WORK/$exp.log:"
      tail -n 8 "$WORK/$exp.log"
      FAILED+=("train:$exp")
    else
      say "stage train $exp: ok ($((SECONDS - t0)) s)"
    fi
  done
fi

# ---------------------------------------------------------------------------- 4. results
say "stage results: writing to $RESULTS"
if ! "$PY" "$HELPER" collect --work "$WORK" --out "$RESULTS" --device-json "$DEVICE_JSON" \
    --mode "$MODE" --experiments "${EXPERIMENTS[@]}" --steps "$STEPS" --log-every "$LOG_EVERY" \
    --profile-steps "$PROFILE" --rows "$ROWS" --batch-size "$BATCH"; then
  say "FAILED stage results: the collector failed (logs and workdirs are in $WORK)"
  FAILED+=(results)
fi

if [[ ${#FAILED[@]} -gt 0 ]]; then
  say "done with failures: ${FAILED[*]} (logs in $WORK)"
  exit 1
fi
say "done: every stage passed"
