#!/usr/bin/env bash
# Rerun every benchmark in sequence at full settings, then regenerate docs/BENCHMARKS.md (and the
# samples pasted into docs/*.md). Run on a quiet machine: each bench records its load average.
#   bash bench/run_all.sh            # every bench/*.py that writes a result
#   bash bench/run_all.sh activations train_accum   # only these
#   QUICK=1 bash bench/run_all.sh    # --quick for the benches that have it (smaller shapes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ $# -gt 0 ]; then
  names=("$@")
else
  names=()
  for f in bench/*.py; do
    n=$(basename "$f" .py)
    # a bench script defines render(); the harness, the renderer and render helpers do not run
    case "$n" in common|render|*_render) continue ;; esac
    grep -q '^def render(' "$f" && names+=("$n")
  done
fi
for n in "${names[@]}"; do
  echo "== bench/$n.py  ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  start=$(date +%s)
  args=()
  if [ -n "${QUICK:-}" ] && grep -q -- '"--quick"' "bench/$n.py"; then args=(--quick); fi
  "$PY" "bench/$n.py" "${args[@]}"
  # compression runs twice: the default job's AdamW, and momentum SGD (DGC's setting)
  if [ "$n" = compression ]; then "$PY" bench/compression.py --optimizer momentum; fi
  echo "== bench/$n.py done in $(( $(date +%s) - start )) s"
done
"$PY" bench/render.py
