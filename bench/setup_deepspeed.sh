#!/usr/bin/env bash
# The side-by-side benchmark's own environment for DeepSpeed (bench/distributed.py uses it when present).
# DeepSpeed is never a dependency of memfit: it goes into a separate venv that sees the main venv's
# packages (torch included) and installs only DeepSpeed and its small pure-Python dependencies,
# all with --no-deps so pip never touches torch.
#
#   bash bench/setup_deepspeed.sh [VENV_DIR]        # default /work/dsvenv, from ./.venv's interpreter
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-${MEMFIT_DS_VENV:-/work/dsvenv}}"
base="${MEMFIT_BASE_PYTHON:-$here/.venv/bin/python}"
[ -x "$base" ] || base="$(command -v python3)"
"$base" -m venv --system-site-packages "$venv"
# A venv made from a venv's interpreter sees only the system's packages: name the base venv's too.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# Real paths: a base venv reached through a link (a worktree's .venv) would otherwise be named by the link.
"$base" -c 'import os, site; print("\n".join(os.path.realpath(p) for p in site.getsitepackages()))' > "$site/memfit-base.pth"
"$venv/bin/python" -m pip install --quiet --no-deps deepspeed hjson py-cpuinfo msgpack ninja psutil einops
# pydantic 2 (and its core) only if the base environment lacks it; packaging, numpy, tqdm come from the base.
"$venv/bin/python" -c "import pydantic, sys; sys.exit(int(pydantic.VERSION.split('.')[0]) < 2)" 2>/dev/null || \
  "$venv/bin/python" -m pip install --quiet --no-deps pydantic pydantic-core annotated-types typing-inspection
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
DS_ACCELERATOR=cpu "$venv/bin/python" -c "import deepspeed; print('deepspeed', deepspeed.__version__)"
# DeepSpeed's CPU backend compiles its shared-memory collectives (g++) on first use; build them now,
# once, so that benchmark ranks do not wait on each other's compile lock.
DS_ACCELERATOR=cpu "$venv/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
