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
"""Bytes/s assumed for host copies (optimizer offload, activation offload:cpu) without a profile."""
DISK_BW = 1e9
"""Bytes/s assumed for a spill file's write plus read without a profile."""
CODEC_BW = 2e9
"""Device bytes freed per second of compressing and restoring activations (int8/fp8) without a profile."""
HOOK_S = 1e-6
"""Seconds per block for running saved-tensor hooks at all: a modifier that moves nothing never ties."""
CODECS = ("int8", "fp8")
"""The codecs the planner considers when `compress` is allowed (lossy)."""


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
    """The per-block actions `allow` permits. Offload moves what a kept block saves, or a recomputed
    block's input, to host memory; compression (lossy, only when asked for) shrinks what a kept block saves.
    Disk offload is not planned: its read-ahead of the previous offloaded block in backward makes a block's
    bytes depend on its neighbours (see docs/planner.md)."""
    out = [BlockAction("keep")]
    if "selective" in allow:
        out.append(BlockAction("selective"))
    if "recompute" in allow:
        out.append(BlockAction("recompute"))
    if "offload-cpu" in allow:
        out += [BlockAction(m, offload="cpu") for m in ("keep", "recompute") if m == "keep" or "recompute" in allow]
    if "compress" in allow:
        out += [BlockAction("keep", compress=c) for c in CODECS]
    return out


def _block_seconds(prof: ChainProfile, tokens: int) -> float:
    # Gradients of one block (bytes) / 4 ~ its parameters; forward ~ 2 FLOPs per parameter per token.
    g = prof.fwd["keep"].net_bytes + prof.bwd["keep"].net_bytes
    return 2 * max(g, 1) / 4 * tokens / FLOPS


def _cost(t_fwd: float, t_selective: float | None = None, prof: ChainProfile | None = None,
          bandwidth: dict[str, float] | None = None) -> Callable[[BlockAction, int], float]:
    """Extra seconds per block: a recomputed block reruns its forward; selective reruns part of it
    (measured when a profile is given, else SELECTIVE_SHARE of a forward). Offload adds moving the bytes
    it takes off the device out and back at the host bandwidth; compression adds encoding and decoding
    them. Those bytes come from the traced profile (the block's saved bytes with and without the modifier),
    the rates from `bandwidth` (memfit.profile: "cpu", "int8", "fp8") or the defaults above."""
    sel = SELECTIVE_SHARE * t_fwd if t_selective is None else t_selective
    rates = {"cpu": HOST_BW, "disk": DISK_BW, **{c: CODEC_BW for c in CODECS}, **(bandwidth or {})}
    mode_s = {"keep": 0.0, "selective": sel, "recompute": t_fwd}
    memo: dict[tuple[BlockAction, int], float] = {}

    def moved(b: BlockAction, k: int) -> int:
        """Device bytes that `b`'s modifiers take off one block (of a segment of k)."""
        if prof is None:
            return 0
        plain, key = str(BlockAction(b.mode)), str(b)
        if k > 1:
            plain, key = plain + "|first", key + "|first"
        if plain not in prof.fwd or key not in prof.fwd:
            return 0
        return max(prof.fwd[plain].net_bytes - prof.fwd[key].net_bytes, 0) // k

    def cost(b: BlockAction, k: int) -> float:
        got = memo.get((b, k))
        if got is None:
            got = mode_s[b.mode]
            if b.offload or b.compress:
                n, got = moved(b, k), got + HOOK_S
                if b.offload:
                    got += 2 * n / rates[b.offload]  # out in forward, back in backward
                if b.compress:
                    got += n / rates.get(b.compress, CODEC_BW)
            memo[(b, k)] = got
        return got

    return cost
