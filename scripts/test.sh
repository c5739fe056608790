#!/usr/bin/env bash
# The test suite: set up .venv if needed, then pytest on 2 workers (pytest-xdist; each test runs on one
# thread, so two workers use both cores of a 2-core machine). Extra arguments go to pytest
# (--runslow adds the slow tests, -m multiproc the multi-process ones, -n 0 runs in one process).
# MEMFIT_TEST_WORKERS sets the worker count; MEMFIT_VENV / MEMFIT_TORCH test another torch in its own
# venv (scripts/setup.sh), e.g.
#   MEMFIT_VENV=.venv-torch2.14 MEMFIT_TORCH=torch==2.14.1 ./scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# --dist loadgroup --no-loadscope-reorder: each worker takes the next test (or group) in collection
# order as it nears the end of its queue (xdist's plain load hands each a quarter of the list up
# front); tests/conftest.py groups the default-tier tests of a file that share traces, and under
# --runslow puts the slow ones first, so both workers end on short tests together
exec "${MEMFIT_VENV:-.venv}/bin/python" -m pytest -n "${MEMFIT_TEST_WORKERS:-2}" --dist loadgroup \
  --no-loadscope-reorder "$@"
