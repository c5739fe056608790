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


UNITLESS_MIN = 2**20
"""A budget given as a plain number below this many bytes is taken for a forgotten unit and refused."""


def parse_budget(budget: Any, what: str = "budget") -> int:
    """The budget in bytes (core/units.py's rule). A plain number under a MiB is refused: no model
    trains in a few bytes, and `budget=8` almost always meant 8GiB. `what` names it in errors."""
    try:
        value = parse_bytes(budget)
    except ConfigError:
        raise
    except Exception:
        raise ConfigError(f"{what} {budget!r} is not a size; use e.g. 8GiB, 300MiB or a byte count") from None
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {budget!r}")
    from memfit.plan.plan_schema import MAX_BUDGET

    if value > MAX_BUDGET:
        raise ConfigError(f"{what} {budget!r} is more than any machine holds (at most 2**60 bytes, 1 EiB); give the "
                          "device's memory, e.g. 80GiB")
    plain = isinstance(budget, (int, float)) or str(budget).strip().replace(".", "", 1).isdigit()
    if plain and value < UNITLESS_MIN:
        raise ConfigError(f"{what} {budget!r} reads as {value} bytes; give a unit, e.g. '{budget}GiB' or "
                          f"'{budget}MiB' (KiB/MiB/GiB binary, KB/MB/GB decimal)")
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
    # Forward ~ 2 FLOPs per parameter per token, frozen parameters included (a LoRA block computes with
    # its whole base: its gradients, the adapters', would price its recompute near zero).
    n = getattr(getattr(prof, "base", prof), "block_params", None)
    if n:
        return 2 * n * tokens / FLOPS
    # (a profile cached without the count) gradients of one block (bytes) / 4 ~ its parameters
    g = prof.fwd["keep"].net_bytes + prof.bwd["keep"].net_bytes
    if getattr(prof, "grad_bytes", None) is not None:  # the step in backward frees them in its trace
        g = prof.grad_bytes
    return 2 * max(g, 1) / 4 * tokens / FLOPS


def _segment_seconds(t_fwd: float, segment_s: dict[str, float] | None) -> Callable[[int], float]:
    """Per-block recompute seconds in a segment of k blocks: t_fwd at k = 1 and the measured figure at the
    measured length (memfit.profile times `sqrt`'s segments), linear between, flat beyond. Without a
    measurement every k costs t_fwd (recomputing k blocks runs k forwards)."""
    if not segment_s:
        return lambda k: t_fwd
    (length, at), = ((int(k), v) for k, v in list(segment_s.items())[:1])

    def per_block(k: int) -> float:
        if k <= 1 or length <= 1:
            return t_fwd
        return t_fwd + (at - t_fwd) * min(k - 1, length - 1) / (length - 1)

    return per_block


def measured(costs: Any, scale: float, flop_fwd: float) -> tuple[float, float | None, dict[str, float]]:
    """(recompute, selective, segment seconds by length) per block from a memfit.profile BlockCosts
    measured at the full batch, scaled to a micro-batch (`scale` = micro / batch).

    Recomputing adds work, so a figure at or below zero is the profile's noise, not a saving: recompute
    then falls back to `flop_fwd` (the FLOP model's forward), selective to None (its share of a forward),
    and such segment figures are dropped (priced from the one-block figure)."""
    seg = {k: v * scale for k, v in (getattr(costs, "segment_s", None) or {}).items() if v > 0}
    rec, sel = costs.recompute_s * scale, costs.selective_s * scale
    return (rec if rec > 0 else flop_fwd), (sel if sel > 0 else None), seg


def head_cost(costs: Any, scale: float, chunks: int, model: Callable[[int], float], same_gemms: bool = False) -> float:
    """Extra seconds of the LM head in `chunks` chunks: `model(chunks)` (the time model of plan/head.py),
    or, when the profile timed the head at one count k0, that measurement plus what the model adds from
    k0 to `chunks` (an offset, not a ratio: a measured figure at or below zero must not turn more chunks
    into a bigger saving). `same_gemms`: the chunked head runs the plain head's GEMMs (its weight
    gradient summed in the forward), so a measured saving is real (it reuses its scratch where the plain
    head faults in fresh logits): it is taken as no cost, never credited."""
    got = getattr(costs, "head_s", None) if costs is not None else None
    if not got:
        return model(chunks)
    k0, t0 = next((int(k), v) for k, v in got.items())
    if t0 <= 0:  # with an extra GEMM a measured saving is the profile's noise: use the model
        return max(model(chunks) - model(k0), 0.0) if same_gemms else model(chunks)
    return t0 * scale + model(chunks) - model(k0)


def predict_extra(actions: list[BlockAction], cost: Callable[[BlockAction, int], float]) -> float:
    """Predicted extra seconds of an action list under `cost` (as solve.py sums them: each block of a
    recomputed segment of k blocks costs cost(base, k))."""
    from dataclasses import replace

    total, i = 0.0, 0
    while i < len(actions):
        j = i + 1
        if actions[i].segment is not None:
            while j < len(actions) and actions[j].segment == actions[i].segment:
                j += 1
        base = replace(actions[i], segment=None)
        total += (j - i) * cost(base, j - i)
        i = j
    return total


def _cost(t_fwd: float, t_selective: float | None = None, prof: ChainProfile | None = None,
          bandwidth: dict[str, float] | None = None,
          segment_s: dict[str, float] | None = None) -> Callable[[BlockAction, int], float]:
    """Extra seconds per block: a recomputed block reruns its forward; selective reruns part of it
    (measured when a profile is given, else SELECTIVE_SHARE of a forward). Offload adds moving the bytes
    it takes off the device out and back at the host bandwidth; compression adds encoding and decoding
    them. Those bytes come from the traced profile (the block's saved bytes with and without the modifier),
    the rates from `bandwidth` (memfit.profile: "cpu", "int8", "fp8") or the defaults above."""
    sel = SELECTIVE_SHARE * t_fwd if t_selective is None else t_selective
    rates = {"cpu": HOST_BW, "disk": DISK_BW, **{c: CODEC_BW for c in CODECS}, **(bandwidth or {})}
    mode_s = {"keep": 0.0, "selective": sel, "recompute": t_fwd}
    memo: dict[tuple[BlockAction, int], float] = {}
    per_block = _segment_seconds(t_fwd, segment_s)

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
            got = per_block(k) if b.mode == "recompute" else mode_s[b.mode]
            if b.offload or b.compress:
                n, got = moved(b, k), got + HOOK_S
                if b.offload:
                    got += 2 * n / rates[b.offload]  # out in forward, back in backward
                if b.compress:
                    got += n / rates.get(b.compress, CODEC_BW)
            memo[(b, k)] = got
        return got

    return cost
