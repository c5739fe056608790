"""Shared pieces of the planner: the budget argument, the relative time model, errors."""
from __future__ import annotations

from typing import Any, Callable

from memfit.apply.policy import BlockAction
from memfit.core.errors import ConfigError
from memfit.core.units import parse_bytes
from memfit.measure.compose import ChainProfile

FLOPS = 5e10
"""Assumed sustained FLOP/s for the relative time model when no profile is given."""
SELECTIVE_SHARE = 0.15
"""Share of a block's forward that selective recomputation runs again (the elementwise ops)."""
HOST_BW = 1e10
"""Bytes/s assumed for optimizer offload transfers."""


class PlanError(ConfigError):
    """No configuration fits the budget."""


def parse_budget(budget: Any) -> int:
    try:
        value = parse_bytes(budget)
    except ConfigError:
        raise
    except Exception:
        raise ConfigError(f"budget {budget!r} is not a size; use e.g. 8GiB, 300MiB or a byte count") from None
    if value <= 0:
        raise ConfigError(f"budget must be positive, got {budget!r}")
    return value


def _bases(allow: tuple[str, ...]) -> list[BlockAction]:
    out = [BlockAction("keep")]
    if "selective" in allow:
        out.append(BlockAction("selective"))
    if "recompute" in allow:
        out.append(BlockAction("recompute"))
    return out


def _block_seconds(prof: ChainProfile, tokens: int) -> float:
    # Gradients of one block (bytes) / 4 ~ its parameters; forward ~ 2 FLOPs per parameter per token.
    g = prof.fwd["keep"].net_bytes + prof.bwd["keep"].net_bytes
    return 2 * max(g, 1) / 4 * tokens / FLOPS


def _cost(t_fwd: float, t_selective: float | None = None) -> Callable[[BlockAction, int], float]:
    """Extra seconds per block: a recomputed block reruns its forward; selective reruns part of it
    (measured when a profile is given, else SELECTIVE_SHARE of a forward)."""
    sel = SELECTIVE_SHARE * t_fwd if t_selective is None else t_selective

    def cost(b: BlockAction, k: int) -> float:
        return {"keep": 0.0, "selective": sel, "recompute": t_fwd}[b.mode]

    return cost


