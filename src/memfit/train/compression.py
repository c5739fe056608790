"""`memfit train --compress SPEC`: gradient compression on the run's strategy, and its report.

The compressor is registered on what memfit.distributed.distribute returned (DDP's comm hook, or
ZeRO-1/2's reduce-scatter), so its counters see every collective that carries gradients. The
report is rank 0's (every rank sends the same number of bytes): bytes per step, the ratio
against the uncompressed reduction, and encode+decode time as a share of the run's step time.

Checkpoints: the compressor's state differs between ranks (each keeps its own residuals and local
momentum), so every rank writes run_dir/compression-<step>/rank<r>.pt (atomically, before rank 0
writes the checkpoint.pt that names the step) and reads its own back on --resume; the resumed run
sends the same bits as an uninterrupted one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

FOLDER = "compression"


def attach(opt: Any, spec: str | None, cfg: Any = None) -> Any:
    """Register `spec` on the strategy's optimizer; the CompressionState (None when off).

    Plain topk / sign take the mode measured best for the optimizer (distributed/compression/
    defaults.py); under zero2 with --accum > 1, where adam mode cannot run (its local moments move
    once per step, ZeRO-2 reduces every micro-batch), they keep plain error feedback."""
    if spec in (None, "none"):
        return None
    import dataclasses

    from memfit.distributed.compression import parse_compression, register_compression
    from memfit.distributed.compression.defaults import names_no_mode

    parsed = parse_compression(spec)
    if cfg is not None and cfg.strategy == "zero2" and cfg.accum > 1 and names_no_mode(parsed):
        parsed = dataclasses.replace(parsed, adam_off=True)
    return register_compression(opt, parsed)


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


def _file(run_dir: Path, step: int, rank: int) -> Path:
    return Path(run_dir) / f"{FOLDER}-{step}" / f"rank{rank}.pt"


def save_state(opt: Any, run_dir: Path, step: int) -> None:
    """Every rank: write this rank's compressor state for `step`; returns once all ranks have."""
    state = getattr(opt, "compression", None)
    if state is None or not hasattr(state, "state_dict"):
        return
    import torch.distributed as dist

    from memfit.train.state import save_checkpoint

    path = _file(run_dir, step, dist.get_rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, state.state_dict(), sealed=True)  # checksummed: checked by load_checkpoint
    dist.barrier()  # checkpoint.pt (rank 0, next) may name this step only once every rank's file exists


def load_state(opt: Any, run_dir: Path, step: int) -> None:
    """Every rank, on --resume: this rank's compressor state of `step` (none saved: start from zero)."""
    state = getattr(opt, "compression", None)
    if state is None or not hasattr(state, "load_state_dict"):
        return
    import torch.distributed as dist

    from memfit.train.state import load_checkpoint

    path = _file(run_dir, step, dist.get_rank())
    if path.exists():
        state.load_state_dict(load_checkpoint(path))


def prune(run_dir: Path, steps: int | list[int]) -> None:
    """Rank 0, after checkpoint.pt names a step: remove the compressor states of other steps than
    `steps` (checkpoint.pt's, and checkpoint.prev.pt's)."""
    import shutil

    keep = {f"{FOLDER}-{s}" for s in ([steps] if isinstance(steps, int) else steps)}
    for old in Path(run_dir).glob(f"{FOLDER}-*"):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
