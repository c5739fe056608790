"""`memfit train`: options that do not apply to the chosen strategy are refused, never ignored.

Each strategy option names the strategies it changes; given with another, it is a ConfigError of
one line (exit 2) before anything is built or launched. `--nproc N` without `--strategy` trains
data-parallel (ddp) and says so once: the common case needs no second flag, and the choice is
visible (docs/distributed.md, "Launching").
"""
from __future__ import annotations

import sys
from typing import Any

from memfit.core.errors import ConfigError

APPLIES_TO: dict[str, tuple[str, ...]] = {
    "microbatches": ("pipeline",),
    "schedule": ("pipeline",),
    "virtual_stages": ("pipeline",),
    "dp": ("pipeline",),
    "pp": ("pipeline",),
    "tp": ("tensor",),
    "engine": ("zero2", "zero3", "pipeline"),
}
"""option (TrainConfig field) -> the strategies it changes. (--compress: TrainConfig.validate says why
each other strategy cannot carry it.)"""
DEFAULT_WITH_NPROC = "ddp"
STRATEGIES = ("ddp", "ps", "zero1", "zero2", "zero3", "pipeline", "tensor")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_strategy_options(given: dict[str, Any], strategy: str, engine: str | None = None) -> None:
    """Refuse the first option the user gave that `strategy` (on `engine`, default the given one) would not use."""
    mesh3d = strategy == "pipeline" and (engine or given.get("engine")) == "fsdp2"  # 3-D: --tp is its degree
    for name, strategies in APPLIES_TO.items():
        if name not in given or strategy in strategies or (mesh3d and name == "tp"):
            continue
        if (name, given[name]) in (("dp", 1), ("engine", "memfit"), ("engine", "auto")):
            continue  # the default value, harmless anywhere
        where = " or ".join(f"--strategy {s}" for s in strategies)
        raise ConfigError(f"{_flag(name)} applies to {where}, not --strategy {strategy}; leave it out or "
                          f"choose {where}")


def default_strategy(given: dict[str, Any], strategy: str) -> str:
    """The strategy of a run with `--nproc N`: the one given, or ddp with a note when none was."""
    if given.get("nproc", 1) < 2 or strategy not in (None, "none"):
        return strategy
    if given.get("strategy") == "none":
        raise ConfigError(f"--strategy none runs one process; with --nproc {given['nproc']} choose one of "
                          f"{', '.join(STRATEGIES)}, or leave out --nproc")
    print(f"memfit train: --nproc {given['nproc']} without --strategy: training data-parallel with "
          f"--strategy {DEFAULT_WITH_NPROC} (others: {', '.join(s for s in STRATEGIES if s != DEFAULT_WITH_NPROC)})",
          file=sys.stderr, flush=True)
    return DEFAULT_WITH_NPROC


def checked(given: dict[str, Any]) -> dict[str, Any]:
    """`given` with the strategy `--nproc N` implies (a resumed run keeps its checkpoint's)."""
    if "resume" in given or "nproc" not in given:
        return given
    strategy = default_strategy(given, given.get("strategy", "none"))
    return {**given, "strategy": strategy} if strategy != given.get("strategy", "none") else given
