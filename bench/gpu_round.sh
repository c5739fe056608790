#!/usr/bin/env bash
# One GPU round in at most 10 minutes (docs/gpu.md, "A GPU round"): each step time-boxed with `timeout`,
# its results written as soon as it ends, and skipped (with a line saying so) where CUDA is absent.
#
#   bash bench/gpu_round.sh            # from the repository root; PYTHON=python3 by default
#
# 1. predicted on a CPU machine (bench/data/gpu_target_predicted.json) vs max_memory_reserved: bench/gpu_target.py
# 2. the CUDA tests (pytest -m gpu), their report kept for docs/compatibility.md
# 3. the planner's step-time overhead on a ~1B Llama: bench/gpu_planner_overhead.py
# 4. if time is left: the Trainer path on one GPU (bench/gpu_train.py)
# Results: bench/results/<name>.json as each bench saves it, a copy and every step's log under $OUT
# (default $TMPDIR/gpu_round/), and $OUT/gpu_round.log with one line per step.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-${TMPDIR:-/tmp}/gpu_round}"
TOTAL_S="${GPU_ROUND_SECONDS:-570}"  # 10 minutes less the machine's own start and the copies back
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" MEMFIT_PROGRESS=0
START=$(date +%s)
LOG="$OUT/gpu_round.log"
: > "$LOG"

say() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
left() { echo $((TOTAL_S - ($(date +%s) - START))); }

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  CUDA=1
  say "device: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(), "torch", torch.__version__)')"
else
  CUDA=0
  say "no CUDA (or no torch) for $PY: every step is skipped after its CPU-only check"
fi

# step NAME SECONDS RESULT CMD...: run CMD under `timeout` (at most what is left of the round), log it,
# copy RESULT (a bench/results JSON) into $OUT as soon as it exists.
step() {
  local name=$1 box=$2 result=$3; shift 3
  local budget; budget=$(left)
  [ "$box" -lt "$budget" ] && budget=$box
  if [ "$budget" -le 10 ]; then say "$name: skipped, no time left in the round"; return 0; fi
  say "$name: start (at most ${budget} s)"
  timeout -k 10 "$budget" "$@" > "$OUT/$name.out" 2>&1
  local rc=$?
  [ -n "$result" ] && [ -f "$result" ] && cp "$result" "$OUT/"
  case $rc in
    0) say "$name: done" ;;
    124|137) say "$name: timed out after ${budget} s (partial output in $OUT/$name.out)" ;;
    *) say "$name: exit $rc (see $OUT/$name.out)" ;;
  esac
  return 0
}

# A CPU-only check per step: the scripts import and parse their arguments (no GPU, nothing written).
cpu_check() {
  local name=$1; shift
  if timeout 60 "$@" > "$OUT/$name.cpu-check.out" 2>&1; then say "$name: skipped (no CUDA); CPU check passed"
  else say "$name: skipped (no CUDA); CPU check FAILED (see $OUT/$name.cpu-check.out)"; fi
}

if [ "$CUDA" = 1 ]; then
  step 1-gpu_target 270 bench/results/gpu_target.json "$PY" bench/gpu_target.py
  if "$PY" -c "import pytest" 2>/dev/null; then
    step 2-pytest_gpu 90 "" "$PY" -m pytest -m gpu tests -q -p no:cacheprovider -o addopts="-ra" \
      --junitxml="$OUT/pytest_gpu.xml"
  else
    say "2-pytest_gpu: skipped, pytest is not installed for $PY"
  fi
  step 3-planner_overhead 210 bench/results/gpu_planner_overhead.json "$PY" bench/gpu_planner_overhead.py
  step 4-gpu_train 60 bench/results/gpu_train.json "$PY" bench/gpu_train.py
else
  cpu_check 1-gpu_target "$PY" bench/gpu_target.py --help
  cpu_check 2-pytest_gpu "$PY" -c "import pytest"
  cpu_check 3-planner_overhead "$PY" bench/gpu_planner_overhead.py --help
  cpu_check 4-gpu_train "$PY" -c "import ast, sys; ast.parse(open('bench/gpu_train.py').read())"
fi
say "round over in $(( $(date +%s) - START )) s; results in $OUT"
exit 0
