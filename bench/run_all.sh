#!/usr/bin/env bash
# Rerun every bench listed in bench/benches.txt, each with the arguments its JSON was made with, then
# regenerate docs/BENCHMARKS.md (and the samples pasted into docs/*.md). Run on a quiet machine: each
# bench records its load average. GPU benches are skipped with a note where CUDA is absent. A failing
# bench is reported and the others still run; the exit status is 1 if any failed.
#   bash bench/run_all.sh                        # every bench
#   bash bench/run_all.sh activations planner    # only these results (or checks, by script name)
#   bash bench/run_all.sh --list                 # print what would run (KIND RESULT COMMAND), run nothing
#   QUICK=1 bash bench/run_all.sh                # --quick for the benches that have it (smaller shapes)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
list=""
if [ "${1:-}" = "--list" ]; then list=1; shift; fi
only=" $* "
cuda=0
[ -z "$list" ] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && cuda=1
failed=()
# the manifest is read on fd 3, so that a bench reading its standard input cannot swallow it
while read -r result kind script args <&3; do
  case "$result" in ''|'#'*|helper) continue ;; esac
  name=$result; [ "$name" = - ] && name=${script%.py}
  if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then continue; fi
  extra=""
  if [ -n "${QUICK:-}" ] && [[ " $args " != *" --quick "* ]] && grep -q -- '"--quick"' "bench/$script"; then extra=" --quick"; fi
  if [ -n "$list" ]; then echo "$kind $name bench/$script${args:+ $args}$extra"; continue; fi
  if [ "$kind" = gpu ] && [ "$cuda" = 0 ]; then
    echo "== bench/$script skipped: needs CUDA (no CUDA device here; bench/results/$name.json kept as it is)"
    continue
  fi
  echo "== bench/$script $args$extra  ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  start=$(date +%s)
  # shellcheck disable=SC2086  # the manifest's arguments are words
  if "$PY" "bench/$script" $args $extra; then
    echo "== $name done in $(( $(date +%s) - start )) s"
  else
    echo "== $name FAILED (exit $?) after $(( $(date +%s) - start )) s"
    failed+=("$name")
  fi
done 3< bench/benches.txt
[ -n "$list" ] && exit 0
"$PY" bench/render.py || failed+=(render)
if [ ${#failed[@]} -gt 0 ]; then echo "failed: ${failed[*]}"; exit 1; fi
