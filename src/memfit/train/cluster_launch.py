"""`memfit train --plan FILE` with a cluster plan: the plan's process count and strategy become the run's.

A file written by `memfit plan ... --gpus N --json` holds a `cluster` field beside the per-block
`plan`. Its strategy flags (--nproc, --strategy, --tp, --dp, --microbatches, --schedule, and for
zero2/zero3 --engine: the layout's, memfit's in files written before it was recorded) fill in
what the command line did not give, and so does its --seq (the length every rank's figure was made
at); under torchrun (WORLD_SIZE set) the processes exist already, so --nproc is left out. The
torchrun line for users who start their own processes is printed once.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from memfit.core.errors import ConfigError

_FLAGS = {"--nproc": "nproc", "--strategy": "strategy", "--tp": "tp", "--dp": "dp", "--microbatches": "microbatches",
          "--schedule": "schedule", "--virtual-stages": "virtual_stages", "--engine": "engine"}


def cluster_options(path: str) -> dict | None:
    """The strategy options of a cluster plan file (None for a one-device plan)."""
    from memfit.plan.cluster_memory import Layout
    from memfit.plan.cluster_plan import train_flags

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None  # memfit.train.budget reports an unreadable plan file
    cluster = data.get("cluster") if isinstance(data, dict) else None
    if not isinstance(cluster, dict):
        return None
    try:
        flags = train_flags(Layout(**cluster["layout"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"plan file {path} has a malformed cluster field ({exc}); write it again with "
                          "`memfit plan ... --gpus N --json`") from None
    out = {}
    for flag, value in zip(flags[::2], flags[1::2]):
        key = _FLAGS[flag]
        out[key] = value if key in ("strategy", "schedule", "engine") else int(value)
    if "engine" in cluster:  # who carries out zero2/zero3 (memfit train --engine); absent: the layout's
        from memfit.distributed.strategy import ENGINES

        if cluster["engine"] not in ENGINES:
            raise ConfigError(f"plan file {path}: cluster engine {cluster['engine']!r}; accepted: {', '.join(ENGINES)}")
        out["engine"] = cluster["engine"]
    if isinstance(cluster.get("seq"), int):  # every rank's figure was made at this length (older files' plans lack it)
        out["seq"] = cluster["seq"]
    out["_torchrun"] = cluster.get("torchrun", "")
    return out


def apply_cluster_plan(given: dict) -> dict:
    """`given` (memfit train's options) with a cluster plan's strategy options added where absent."""
    if "plan" not in given:
        return given
    opts = cluster_options(given["plan"])
    if not opts:
        return given
    torchrun = opts.pop("_torchrun")
    if os.environ.get("WORLD_SIZE"):  # started by torchrun (or by memfit's own launch): no second launch
        opts.pop("nproc", None)
    elif "nproc" in opts and "nproc" not in given:
        print(f"memfit train: the plan runs {opts['nproc']} processes ({opts['strategy']}); to start them yourself: "
              f"{torchrun}", file=sys.stderr, flush=True)
    return {**opts, **given}
