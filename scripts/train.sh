#!/usr/bin/env bash
# The main job: set up .venv if needed, then `memfit train` (defaults: a small GPT on Shakespeare, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/memfit train "$@"
