"""Everything `train` builds before its first step: device, precision, model, optimizer, tracker."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from memfit.core.device import resolve_device  # noqa: F401  (the one device check; part of this module's API)
from memfit.core.errors import ConfigError, MemfitError
from memfit.train import data as data_mod
from memfit.train import report
from memfit.train.config import TrainConfig, optimizer_extra
from memfit.train.model_build import build_model  # noqa: F401  (part of this module's API)
from memfit.train.resume import restore
from memfit.train.rundir import prepare_run_dir
from memfit.train.saver import Saver


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def build_optimizer(cfg: TrainConfig, model: nn.Module, precision: str) -> Any:
    """The TrainingOptimizer of the run. `--spill-dir` serves every disk offload, so the optimizer
    gets it only when its own state goes to disk (activations get it from memfit.checkpoint)."""
    from memfit.apply.optimizer import TrainingOptimizer

    disk = cfg.offload_optimizer == "disk"
    return TrainingOptimizer(
        model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, precision=precision, clip=cfg.clip,
        offload=None if cfg.offload_optimizer == "none" else cfg.offload_optimizer,
        spill_dir=cfg.spill_dir if disk else None, step_in_backward=cfg.step_in_backward, **optimizer_extra(cfg),
    )


_OOM_WORDS = ("out of memory", "can't allocate memory", "Storage size calculation overflowed")


@contextlib.contextmanager
def memory_errors(what: Callable[[], str]) -> Iterator[None]:
    """An allocation that fails (the run does not fit) becomes one line saying so, not a traceback.

    `what` says where the run was (e.g. "at step 12"), read only when an allocation fails."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise MemfitError(f"out of memory {what()}: {str(exc).splitlines()[0]}; try a smaller --batch or --seq, "
                          "--checkpoint full or an offload (memfit estimate shows where the memory goes)") from None
    except RuntimeError as exc:
        if not any(w in str(exc) for w in _OOM_WORDS):
            raise
        raise MemfitError(f"out of memory {what()}: the model and batch need more memory than this machine has; "
                          "try a smaller --batch or --seq (memfit estimate shows where the memory goes)") from None


def live_memory(device: torch.device) -> int:
    """Bytes in use now: the CUDA allocator's peak since the last reset, or this process's RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:  # Linux: resident pages now (ru_maxrss below is a peak)
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return 0
    # The peak RSS: in bytes on macOS, in KiB elsewhere.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def enter_tracker(model: nn.Module, opt, device: torch.device, log: Callable[[str], None]):
    """memfit's live tracker, entered; None when it is unavailable (training does not need it)."""
    try:
        from memfit.core.tracker import track
    except ImportError:
        return None
    optimizer = opt if hasattr(opt, "state_tensors") else getattr(opt, "optimizer", opt)
    try:
        tracker = _fsdp2_tracker(opt, device) or track(model, optimizer, device=device)
        tracker.__enter__()
    except Exception as exc:  # a measurement failing to start must not cost the user the run
        log(f"memfit train: memory breakdown unavailable ({type(exc).__name__}: {exc})")
        return None
    return tracker


def _fsdp2_tracker(opt, device: torch.device):
    """torch's MemTracker for an FSDP2 rank, 3-D ones too (memfit.train.fsdp2_run.TorchTracker says why), else None."""
    fsdp2, mesh3d = sys.modules.get("memfit.distributed.fsdp2"), sys.modules.get("memfit.distributed.mesh3d")
    stage = mesh3d is not None and isinstance(opt, mesh3d.Mesh3DOptimizer)
    if not (stage or (fsdp2 and isinstance(opt, fsdp2.FSDP2Optimizer))):
        return None
    from memfit.train.fsdp2_run import TorchTracker

    return TorchTracker(opt.tracked_module, opt.inner, device, stage=stage)


@dataclass
class Run:
    """Everything the loop works on, built by `setup`; step/horizon/history/breakdown go into every checkpoint."""

    cfg: TrainConfig
    device: torch.device
    model: nn.Module
    opt: Any
    sampler: data_mod.WindowSampler
    val_batches: list
    run_dir: Path
    saver: Saver
    info: dict[str, Any]
    """device, precision, params, corpus, tokens per step: the `run` part of metrics.json."""
    step: int = 0
    horizon: int | None = None
    history: dict[str, Any] = field(default_factory=report.new_history)
    breakdown: dict[str, Any] | None = None
    auto_horizon: bool = False
    """No --steps: the schedule length is fitted to the time limit (a resume keeps the fitted one)."""
    track_at: int = 1
    """The step measured with the tracker: steady state, once the optimizer state exists."""
    ctx: Any = None
    """Several processes (memfit.train.distributed.DistContext), or None for one."""


def run_folder(cfg: TrainConfig, fresh: bool, overwrite: bool, cleanup: contextlib.ExitStack,
               log: Callable[[str], None], ctx: Any = None) -> Path:
    """prepare_run_dir for this process: one process holds the run lock (rank 0 of several), and
    every rank raises the refusal rank 0 meets (none waits in a collective for a peer that left)."""
    main = ctx is None or ctx.main
    try:
        path, failed = prepare_run_dir(cfg.out, log, cleanup.enter_context if main else None, fresh=fresh,
                                       overwrite=overwrite), None
    except ConfigError as exc:
        if ctx is None:
            raise
        path, failed = None, str(exc)
    if ctx is not None:
        import torch.distributed as dist

        said: list[Any] = [None] * ctx.world
        dist.all_gather_object(said, failed)
        failed = next((f for f in said if f is not None), None)
        if failed is not None:
            raise ConfigError(failed)
    return path


def setup(cfg: TrainConfig, checkpoint: dict[str, Any] | None, cleanup: contextlib.ExitStack,
          log: Callable[[str], None], ctx: Any = None, overwrite: bool = False) -> Run:
    """Build the run of `cfg` (from `checkpoint` when resuming); what needs releasing goes on `cleanup`.

    Every refusal comes before the first step; the run folder is created last, so a bad request
    leaves no empty folder behind (and `cleanup` removes any spill folder already made)."""
    from memfit.apply.checkpoint import checkpoint as apply_checkpoint, remove
    from memfit.train import distributed as dist_train

    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    torch.manual_seed(cfg.seed)  # the initial weights; a resume overwrites them and the RNG state below
    corpus = data_mod.load_run_corpus(cfg.data, cfg.seq, checkpoint)
    with memory_errors(lambda: "while building the model"):
        model = build_model(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())  # the whole model: pipeline ranks keep one stage's
    apply_checkpoint(model, cfg.checkpoint, spill_dir=cfg.spill_dir)
    if cfg.head_chunks:
        from memfit.apply.head_swap import chunk_head

        chunk_head(model, cfg.head_chunks)
    cleanup.callback(remove, model)  # removes an activation spill folder with the hooks
    sampler = (dist_train.rank_sampler(ctx, corpus.train, cfg) if ctx
               else data_mod.WindowSampler(corpus.train, cfg.batch, cfg.seq, cfg.seed))
    val_batches = data_mod.fixed_windows(corpus.val, cfg.eval_batches, cfg.batch, cfg.seq, (cfg.seed + 1) % 2**64)
    opt = cleanup.enter_context(dist_train.make_optimizer(ctx, model, cfg, precision) if ctx
                                else build_optimizer(cfg, model, precision))
    # The last refusal (a bad request leaves no empty run folder); from here the run holds the folder.
    run_dir = run_folder(cfg, checkpoint is None, overwrite, cleanup, log, ctx)
    info = {"device": str(device), "precision": precision, "params": n_params,
            # The resolved files beside their digest: a resume reads the same bytes from any folder.
            "corpus": {"name": corpus.name, "files": len(corpus.files), "bytes": corpus.num_bytes,
                       "digest": corpus.digest, "paths": corpus.files},
            "tokens_per_step": cfg.batch * cfg.seq * cfg.accum * (ctx.world if ctx else 1)}
    run = Run(cfg, device, model, opt, sampler, val_batches, run_dir, Saver(run_dir, log), info, horizon=cfg.steps,
              auto_horizon=cfg.steps is None and (checkpoint is None or checkpoint["horizon"] is None), ctx=ctx)
    if checkpoint is not None:
        # The layout's own files, or another layout's resharded (memfit.train.reshard).
        from memfit.train.reshard import restorer

        restore(checkpoint, repr(str(run_dir)), model, opt, sampler, restorer(opt, model, checkpoint, run_dir, ctx))
        run.step, run.history, run.breakdown = checkpoint["step"], checkpoint["history"], checkpoint.get("breakdown")
        run.horizon = cfg.steps if cfg.steps is not None else checkpoint["horizon"]
        run.saver.resumed(checkpoint)
        if gone := dist_train.remove_torn(run_dir, checkpoint, ctx):
            log(f"memfit train: removed {', '.join(gone)} in {run_dir}: what an interrupted save left; resuming from "
                f"step {run.step}")
    run.track_at = max(run.step, 1)
    model.train()
    log(f"memfit train: {n_params / 1e6:.2f}M-parameter model {cfg.model} on {device} ({precision}), "
        f"data {corpus.name} ({corpus.num_bytes / 1e6:.1f} MB, {len(corpus.files)} files), "
        f"{info['tokens_per_step']} tokens/step" + (f", resuming at step {run.step}" if run.step else ""))
    return run
