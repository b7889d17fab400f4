#!/usr/bin/env bash
# GPU check (issue 29): stages that each end within 9 minutes and write their results under
# --out as they finish (one device command per stage on a lent GPU machine: benchmarks/GPU.md).
#
#   bash tools/gpu_check.sh --stage=env --out=DIR           # install + environment report
#   bash tools/gpu_check.sh --stage=contract --out=DIR      # one stage (or a,b,c / all)
#   bash tools/gpu_check.sh --allow-cpu --stage=train --out=DIR   # CPU test mode
#
# Stages: env contract trainer train trace calibrate tiers perf (or all). Each writes
# DIR/STAGE.json, DIR/STAGE.md, DIR/STAGE.log; trace and tiers also
# DIR/trace_EXPERIMENT[_SETTING].trace.json.gz. Full logs,
# workdirs and the dataset stay in --work (/tmp/recgnn_gpu_check).
#
# Options: --stage=S (required), --out=DIR (required), --allow-cpu (no GPU: the same stages
# on CPU at small sizes, instead of exiting 0), --wheels=DIR (the carried wheels; default
# .gpu-wheels/ in the checkout, else shared/gpu-wheels), --work=DIR, --experiments=A,B.
# Environment: PYTHON (interpreter, default python3), RECGNN_GPU_CHECK_STAGE_SECONDS (a
# stage's budget, default 510). Details: tools/gpu_check.py's docstring.
#
# Exit status: 0 when every stage run passed (or no GPU and no --allow-cpu), 1 when one
# failed (its files are still written), 2 on bad usage.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
args=()
for arg in "$@"; do
  case "$arg" in
    --allow-cpu|--force-cpu) args+=(--allow-cpu) ;;
    --stage=*|--out=*|--wheels=*|--work=*) args+=("$arg") ;;
    --experiments=*) IFS=, read -r -a exps <<<"${arg#--experiments=}"; args+=(--experiments "${exps[@]}") ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done
if [[ " ${args[*]:-} " != *" --stage="* || " ${args[*]:-} " != *" --out="* ]]; then
  echo "gpu_check: --stage=S and --out=DIR are required (try --help)" >&2
  exit 2
fi
# The checkout on the path: run.py, tests and experiments work even without the editable
# install; .gpu-site holds wheels installed with --target where site-packages refuse them.
export PYTHONPATH="$ROOT${ROOT:+:$ROOT/.gpu-site}${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
exec "$PY" "$ROOT/tools/gpu_check.py" stage "${args[@]}"
