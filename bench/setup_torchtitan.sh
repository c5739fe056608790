#!/usr/bin/env bash
# An environment with torchtitan's config classes, to check configs that `memfit plan --emit torchtitan`
# writes (tests/test_emit_validate.py uses it when present). torchtitan is never a dependency of memfit:
# like bench/setup_deepspeed.sh, a venv that sees the main venv's packages (torch included) and installs
# only torchtitan and the small pure-Python packages its config manager imports, all with --no-deps, so
# pip never touches torch. torchtitan 0.2.2: the last release whose jobs are TOML files
# (`--job.config_file`); 0.3 configures jobs in Python.
#
#   bash bench/setup_torchtitan.sh [VENV_DIR]        # default /work/ttvenv, from ./.venv's interpreter
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-${MEMFIT_TT_VENV:-/work/ttvenv}}"
base="${MEMFIT_BASE_PYTHON:-$here/.venv/bin/python}"
[ -x "$base" ] || base="$(command -v python3)"
"$base" -m venv --system-site-packages "$venv"
# A venv made from a venv's interpreter sees only the system's packages: name the base venv's too.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# Real paths: a base venv reached through a link (a worktree's .venv) would otherwise be named by the link.
"$base" -c 'import os, site; print("\n".join(os.path.realpath(p) for p in site.getsitepackages()))' > "$site/memfit-base.pth"
"$venv/bin/python" -m pip install --quiet --no-deps torchtitan==0.2.2 tyro docstring-parser shtab typeguard
# torchtitan's package __init__ imports its MoE kernels (triton, a GPU compiler); the check loads
# torchtitan.config alone (tests/emit_checks.py), which needs tyro and the standard library.
(cd /tmp && "$venv/bin/python" - <<'PY'
import importlib.util, sys, types
spec = importlib.util.find_spec("torchtitan")
pkg = types.ModuleType("torchtitan"); pkg.__path__ = list(spec.submodule_search_locations); sys.modules["torchtitan"] = pkg
from torchtitan.config import ConfigManager, JobConfig
print("torchtitan config manager ok:", ConfigManager.__module__)
PY
)
