#!/usr/bin/env bash
# The test suite: set up .venv if needed, then pytest. Extra arguments go to pytest
# (--runslow adds the slow tests, -m multiproc the multi-process ones).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
