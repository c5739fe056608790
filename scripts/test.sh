#!/usr/bin/env bash
# The test suite: set up .venv if needed, then pytest. Extra arguments go to pytest
# (--runslow adds the slow tests, -m multiproc the multi-process ones).
# MEMFIT_VENV / MEMFIT_TORCH test another torch in its own venv (scripts/setup.sh), e.g.
#   MEMFIT_VENV=.venv-torch2.14 MEMFIT_TORCH=torch==2.14.1 ./scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${MEMFIT_VENV:-.venv}/bin/python" -m pytest "$@"
