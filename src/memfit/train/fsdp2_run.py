"""`memfit train --strategy zero2|zero3 --engine fsdp2`: what the run may ask of torch's FSDP2.

The engine itself is memfit.distributed.fsdp2 (fully_shard per block, then the root); its
checkpoints are memfit.distributed.fsdp2_checkpoint (torch.distributed.checkpoint). Here: the
options FSDP2 cannot carry out yet, each refused with one line before any process starts.
"""
from __future__ import annotations

from typing import Any

from memfit.core.errors import ConfigError

FSDP2_STRATEGIES = ("zero2", "zero3")
_FP16 = ("16-mixed", "16-true", "16-master")


def check_engine(cfg: Any) -> None:
    """Raise ConfigError for the first option of `cfg` (a TrainConfig) that --engine cannot run."""
    from memfit.distributed.strategy import ENGINES

    if cfg.engine not in ENGINES:
        raise ConfigError(f"--engine {cfg.engine!r}; accepted: {', '.join(ENGINES)}")
    if cfg.engine == "memfit":
        return
    if cfg.strategy not in FSDP2_STRATEGIES + ("pipeline",):
        raise ConfigError(f"--engine fsdp2 carries out --strategy zero2, zero3 or pipeline (the 3-D layout), not "
                          f"{cfg.strategy}; choose one of them, or leave out --engine")
    if cfg.compress not in (None, "none"):
        raise ConfigError("--compress with --engine fsdp2 is not supported yet (FSDP2 runs its own reduce-scatter); "
                          "leave out --compress, or use --engine memfit")
    if cfg.offload_optimizer == "disk" or (cfg.offload_optimizer == "cpu" and not _cuda(cfg.device)):
        raise ConfigError(f"--offload-optimizer {cfg.offload_optimizer} with --engine fsdp2: only cpu on CUDA ranks "
                          "(FSDP2's CPUOffloadPolicy); leave it out, or use --engine memfit")
    if cfg.precision in _FP16:
        raise ConfigError(f"--precision {cfg.precision} with --engine fsdp2: fp16 needs a loss scaler FSDP2 does not "
                          "have here; use 32-true, bf16-mixed, bf16-master or bf16-true, or --engine memfit")
    _check_optimizer(cfg.optimizer)


def _cuda(device: str | None) -> bool:
    import torch

    if device is None:
        return torch.cuda.is_available()
    return str(device).startswith("cuda")


def _check_optimizer(name: str) -> None:
    """DCP saves the optimizer states as DTensors of their parameter's shape: quantized (8/4-bit) and
    factored (Adafactor) states are not that."""
    from memfit.apply.optimizers import info

    spec = info(name)
    if spec.bits or (spec.states == 0 and spec.name != "sgd"):
        raise ConfigError(f"--optimizer {spec.name} with --engine fsdp2: its state is not of the parameters' shape, "
                          "so its checkpoints cannot be written; use adamw, adam, sgd, momentum, lion, adagrad or "
                          "rmsprop, or --engine memfit")


_CATEGORIES = {"Parameter": "params", "Buffer": "params", "Gradient": "grads", "Optstate": "optimizer",
               "Activation": "activations", "Temp": "temporaries", "Other": "temporaries"}


class TorchTracker:
    """The tracked step of an FSDP2 rank, measured by torch's MemTracker, with memfit's tracker's
    interface (breakdown, peak_bytes) for memfit.train.report. FSDP2 frees a block's gathered weights by
    resizing their storage to zero, which memfit's tracker does not see (it counted all 4 blocks of a
    GPT as still gathered: +0.8 MB, +7% of the rank's peak); torch's tracker follows those resizes.
    `stage`: a pipeline stage (the 3-D layout), which runs forward once per micro-batch (_stage_tracker)."""

    def __init__(self, model, optimizer, device, stage: bool = False) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self.device = device
        self.inner = _stage_tracker() if stage else MemTracker()
        self.inner.track_external(model, optimizer)
        self.breakdown: dict[str, int] = {}
        self.peak_bytes = 0
        self.module_activations: dict[str, int] = {}

    def __enter__(self) -> "TorchTracker":
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)
        peaks = self.inner.get_tracker_snapshot("peak")
        mine = peaks.get(self.device) or max(peaks.values(), key=lambda p: p.get("Total", 0), default={})
        parts = dict.fromkeys(("params", "grads", "optimizer", "activations", "temporaries"), 0)
        for key, value in mine.items():
            name = _CATEGORIES.get(getattr(key, "value", str(key)))
            if name is not None:
                parts[name] += int(value)
        self.peak_bytes = int(mine.get("Total", sum(parts.values())))
        self.breakdown = {**parts, "total": self.peak_bytes}


def _stage_tracker():
    """torch's MemTracker over a pipeline stage: MemTracker takes a module's second forward for the next
    iteration and refuses it; here a stage's later micro-batches keep the first one's per-module statistics
    (the peak and its categories come from every allocation either way)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StageTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                return
            super()._pre_fw_hook(module, inputs)

    return StageTracker()
