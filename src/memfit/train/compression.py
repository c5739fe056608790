"""`memfit train --compress SPEC`: gradient compression on the run's strategy, and its report.

The compressor is registered on what memfit.distributed.distribute returned (DDP's comm hook, or
ZeRO-1/2's reduce-scatter), so its counters see every collective that carries gradients. The
report is rank 0's (every rank sends the same number of bytes): bytes per step, the ratio
against the uncompressed reduction, and encode+decode time as a share of the run's step time.
Error-feedback residuals live in memory only: a resumed run starts them from zero.
"""
from __future__ import annotations

from typing import Any


def attach(opt: Any, spec: str | None) -> Any:
    """Register `spec` on the strategy's optimizer; the CompressionState (None when off)."""
    if spec in (None, "none"):
        return None
    from memfit.distributed.compression import register_compression

    return register_compression(opt, spec)


def summary(state: Any, step_seconds: list[float]) -> dict[str, Any] | None:
    """What metrics.json records under run.compression; None when the run is uncompressed."""
    if state is None:
        return None
    out = state.summary()
    total = sum(step_seconds[-state.steps:]) if state.steps else 0.0  # this process's steps (a resume restarts)
    out["coding_share_of_step"] = (out["encode_s"] + out["decode_s"]) / total if total > 0 else None
    return out


def summary_line(s: dict[str, Any]) -> str:
    """One line for the end-of-run summary."""
    from memfit.core.units import format_bytes

    share = s.get("coding_share_of_step")
    coding = f", encode+decode {100 * share:.1f}% of step time" if share is not None else ""
    return (f"  compress {s['compression']}: {format_bytes(s['bytes_sent_per_step'])}/step/rank sent, "
            f"{s['ratio']:.1f}x fewer than uncompressed{coding}")
