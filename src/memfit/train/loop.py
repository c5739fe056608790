"""The training loop behind `memfit train`, top to bottom: setup, the loop, save.

    cfg = TrainConfig(steps=200)                     # or TrainConfig() for ~2 minutes on the default corpus
    result = train(cfg)                              # writes runs/<timestamp>/{metrics.json, plot.png, checkpoint.pt}
    result = train(*resume_config("runs/...", {}))   # continues the same loss trajectory

Each optimizer step: `accum` micro-batches from a seeded window sampler, summed losses divided
by the token count of the whole accumulated batch (accumulate_grads), one TrainingOptimizer step
(precision, loss scaling, clipping and optimizer offload live there), a cosine learning rate
with linear warm-up. Every `save_every` steps, at the end, on the time limit, on Ctrl-C and on
SIGTERM the whole state (model, optimizer, step, sampler and torch RNG) goes into an atomic
checkpoint, so a resumed run is the uninterrupted run, bit for bit on CPU in fp32.

The pieces: config (TrainConfig, its checks), setup (everything built before step 1, the run
folder checked), step (the arithmetic), schedule (learning rate, time limit), signals (Ctrl-C,
SIGTERM), saver (checkpoints and a full disk), resume (a checkpoint checked and restored).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from memfit.core.errors import MemfitError
from memfit.train import distributed as dist_train, full_disk, report, state as state_mod
from memfit.train.config import DEFAULT_MODEL, DEFAULT_TIME_LIMIT, RESUMABLE, TrainConfig
from memfit.train.data import absolute
from memfit.train.resume import check_checkpoint, check_steps, resume_config
from memfit.train.rundir import check_fresh, check_out, check_resume_into
from memfit.train.schedule import CALIBRATION_STEPS, RECENT, Clock, fit_horizon, lr_at
from memfit.train.setup import (Run, build_model, enter_tracker, live_memory, memory_errors, resolve_device,
                                resolve_precision, setup)
from memfit.train.signals import StopSignals
from memfit.train.step import StepOutput, accumulate_grads, accumulate_step, evaluate, loss_sum

__all__ = [
    "DEFAULT_MODEL", "DEFAULT_TIME_LIMIT", "RESUMABLE", "CALIBRATION_STEPS", "RECENT", "TrainConfig", "TrainResult",
    "train", "resume_config", "StepOutput", "accumulate_grads", "accumulate_step", "evaluate", "loss_sum", "lr_at",
    "fit_horizon", "build_model", "resolve_device", "resolve_precision", "live_memory",
]


@dataclass
class TrainResult:
    run_dir: Path
    metrics: dict[str, Any]
    step: int
    """Optimizer steps done in total (across resumes)."""
    stopped: str
    """Why the loop ended: "steps", "time_limit", "stop_at", "interrupted" (Ctrl-C) or "terminated" (SIGTERM)."""


def train(
    cfg: TrainConfig,
    checkpoint: dict[str, Any] | None = None,
    *,
    stop_at: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> TrainResult:
    """Train per `cfg` (from `checkpoint` when resuming) and write the run folder.

    `stop_at` ends this run after that many total steps without changing the schedule (a resume
    then continues it); `progress` shows a tqdm bar on a terminal, else a line every few seconds.
    A fresh run into a folder that holds a checkpoint is refused unless `overwrite` (which removes
    the earlier run's checkpoints); a folder another run is using is refused (memfit.train.runlock).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cfg = _checked(cfg, checkpoint, overwrite)
    if cfg.strategy not in (None, "none"):  # several processes: one GPU each, or the CPU
        cfg.device, note = dist_train.rank_device(cfg.device)
        if note and os.environ.get("RANK", "0") == "0":
            log(note)
    ctx = dist_train.setup(cfg, resolve_device(cfg.device), resuming=checkpoint is not None)
    if ctx is not None and not ctx.main:  # several processes: rank 0 reports and writes the run folder
        log, progress = (lambda msg: None), False
    # Leaving the block closes the bar and the optimizer (spill files, hooks), removes the activation
    # hooks and restores the signal handlers, also when a step raises.
    with contextlib.ExitStack() as cleanup:
        signals = cleanup.enter_context(StopSignals(log))
        run = setup(cfg, checkpoint, cleanup, log, ctx, overwrite=overwrite)
        clock = Clock(cfg.time_limit, cfg.eval_every, run.auto_horizon)
        base_seconds = run.history["seconds"]
        bar = cleanup.enter_context(report.Progress(run.step, run.horizon, enabled=progress, log=log))
        if not run.history["val"]["step"] or run.history["val"]["step"][-1] != run.step:
            _evaluate(run, clock)

        while (stopped := _why_stop(run, clock, signals.check(), stop_at)) is None:
            out = train_step(run, clock, log)
            horizon = clock.refit(run.step, run.horizon)
            if run.ctx is not None and clock.auto_horizon:  # each rank timed its own steps: one length for all
                horizon = dist_train.agree_horizon(horizon)
            if horizon != run.horizon:
                run.horizon = horizon
                bar.set_total(horizon)
            cols = run.history["steps"]
            bar.update(run.step, out.loss, cols["tokens_per_s"][-1], cols["memory_bytes"][-1])
            if cfg.eval_every and run.step % cfg.eval_every == 0:
                _evaluate(run, clock)
            if cfg.save_every and run.step % cfg.save_every == 0 and run.step != run.horizon:  # the last: below
                _save(run, base_seconds + clock.elapsed(), last=False)

        bar.close()
        signals.check()  # says a second signal that came during the last step
        hurry = signals.hurry if ctx is None else dist_train.agree_flag(signals.hurry)  # evaluation: collectives
        if run.history["val"]["step"][-1] != run.step and not hurry:
            _evaluate(run, clock)
        metrics = _save(run, base_seconds + clock.elapsed(), last=True)
        hurry = hurry or signals.hurry  # one that came during the save: no plot either (rank 0 alone plots)
        if (ctx is None or ctx.main) and not hurry:  # still inside: the run holds its folder's lock until the plot
            _plot(metrics, run.run_dir, log)
    return TrainResult(run_dir=run.run_dir, metrics=metrics, step=run.step, stopped=stopped)


def _checked(cfg: TrainConfig, checkpoint: dict[str, Any] | None, overwrite: bool = False) -> TrainConfig:
    """A validated copy of `cfg` with the default time limit and data paths that hold from any folder."""
    cfg = dataclasses.replace(cfg, data=list(cfg.data) if isinstance(cfg.data, (list, tuple)) else cfg.data)
    if cfg.steps is None and cfg.time_limit is None:
        cfg.time_limit = DEFAULT_TIME_LIMIT
    cfg.validate()
    cfg.data = [absolute(d) for d in cfg.data]
    check_out(cfg.out)
    if checkpoint is None:  # early, before anything is built; checked again under the folder's lock
        check_fresh(cfg.out, overwrite)
    else:
        check_checkpoint(checkpoint, repr(cfg.out))
        check_steps(cfg, checkpoint)
        check_resume_into(cfg.out, checkpoint.get("_source"))
    return cfg


def _why_stop(run: Run, clock: Clock, signalled: str | None, stop_at: int | None) -> str | None:
    """Why the loop ends before the next step, or None to go on (several processes: the same for all)."""
    reason = _local_stop(run, clock, signalled, stop_at)
    return reason if run.ctx is None else dist_train.agree_stop(reason)


def _local_stop(run: Run, clock: Clock, signalled: str | None, stop_at: int | None) -> str | None:
    if run.horizon is not None and run.step >= run.horizon:
        return "steps"
    if stop_at is not None and run.step >= stop_at:
        return "stop_at"
    if signalled is not None:
        return signalled
    if clock.out_of_time():
        return "time_limit"
    return None


def train_step(run: Run, clock: Clock, log: Callable[[str], None]) -> StepOutput:
    """One optimizer step at the scheduled learning rate, recorded in the run's history."""
    cfg, device = run.cfg, run.device
    lr = lr_at(run.step, cfg.lr, cfg.warmup, run.horizon, cfg.min_lr_ratio)
    for group in run.opt.param_groups:
        group["lr"] = lr
    before = full_disk.Before.take(run)  # put back if a full spill folder fails the step
    micro = [tuple(t.to(device, non_blocking=True) for t in run.sampler.next()) for _ in range(cfg.accum)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tracked = getattr(run.opt, "tracked_module", run.model)  # ZeRO: the model and this rank's shard
    tracker = enter_tracker(tracked, run.opt, device, log) if cfg.track and run.step == run.track_at else None
    t0 = time.perf_counter()
    if run.ctx is not None:
        dist_train.TRAFFIC.reset()
    one_step = (lambda: StepOutput(*dist_train.accumulate_step(run.opt, micro, loss_sum))) if run.ctx \
        else (lambda: accumulate_step(run.model, run.opt, micro))
    with memory_errors(lambda: f"at step {run.step + 1}"), _spill_full(run, before):
        if tracker is not None:
            try:
                out = one_step()
            finally:
                tracker.__exit__(None, None, None)
            run.breakdown = report.tracker_breakdown(tracker, run.step + 1)  # steps count from 1 in the history
            if run.ctx is not None:
                run.breakdown = dist_train.gather_breakdown(run.ctx, run.breakdown)
        else:
            out = one_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    if not math.isfinite(out.loss):
        raise MemfitError(_not_finite(run, out.loss))
    run.step += 1
    report.record_step(run.history, step=run.step, loss=out.loss, lr=lr, tokens=out.ntokens, seconds=seconds,
                       memory=live_memory(device), grad_norm=getattr(out.result, "grad_norm", None))
    if tracker is None:  # the tracked step runs slower; keep it out of the speed estimate
        clock.step_seconds.append(seconds)
    return out


FP16 = ("16-mixed", "16-true", "16-master")


def _not_finite(run: Run, loss: float) -> str:
    """Why the run stopped on a loss that is not finite: what is kept (the truth: there may be no
    checkpoint yet) and what to change."""
    saved, out = run.saver.saved_step, run.run_dir
    kept = ("no checkpoint was saved yet, nothing to resume" if saved is None else
            f"the last checkpoint is step {saved} in {out} (memfit train --resume {out} continues from it)")
    precision = run.info.get("precision")
    if precision in FP16:  # fp16 ends at 65504: an overflow is the usual cause
        change = (f"float16 overflows above 65504: train with --precision bf{precision} (the same memory, with "
                  "float32's range) or 32-true, or a lower --lr")
    else:
        change = "try a lower --lr, a smaller --clip or --precision 32-true"
    return f"loss became {loss} at step {run.step + 1}; {kept}; {change}"


@contextlib.contextmanager
def _spill_full(run: Run, before: "full_disk.Before"):
    """A spill folder that fills up during the step: save the previous step's state when the step
    changed nothing yet (one process), then stop with one line (memfit.train.full_disk)."""
    try:
        yield
    except (OSError, MemfitError) as exc:
        if not full_disk.is_full(exc):
            raise
        if run.ctx is None and full_disk.untouched(run, before):
            full_disk.put_back(run, before)
            _save(run, run.history["seconds"], last=True)  # a save that fails too says so itself (SaveError)
            kept = f"step {run.step} is saved in {run.run_dir}"
        elif run.saver.saved_step is not None:
            kept = f"the last checkpoint is step {run.saver.saved_step} in {run.run_dir}"
        else:
            kept = "no checkpoint was saved yet"
        raise full_disk.SpillFull(full_disk.message(exc, run.cfg.spill_dir, run.step, kept, run.run_dir)) from None


def _evaluate(run: Run, clock: Clock) -> None:
    t0 = time.perf_counter()
    with memory_errors(lambda: f"evaluating at step {run.step}"):
        loss = (run.opt.evaluate(run.val_batches) if hasattr(run.opt, "evaluate")  # pipeline: stage to stage
                else evaluate(run.model, run.opt, run.val_batches, run.device))
    run.history["val"]["step"].append(run.step)
    run.history["val"]["loss"].append(loss)
    clock.eval_seconds.append(time.perf_counter() - t0)


def _save(run: Run, seconds: float, *, last: bool) -> dict[str, Any]:
    """Checkpoint and metrics.json (see Saver for a disk that refuses); returns the metrics."""
    from memfit.train import compression

    run.history["seconds"] = seconds
    comp = compression.summary(getattr(run.opt, "compression", None), run.history["steps"]["seconds"])
    metrics = report.metrics_payload(run.cfg.to_dict(), {**run.info, "horizon": run.horizon, "compression": comp},
                                     run.history, run.breakdown)
    ctx = run.ctx
    model_state, shards = (dist_train.save_states(run.opt, run.model, run.run_dir, run.step) if ctx
                           else (run.model.state_dict(), None))
    if ctx is not None and not ctx.main:  # rank 0 writes checkpoint.pt and metrics.json
        return metrics
    run.saver.save(run.step, {
        "format": 1, "step": run.step, "horizon": run.horizon, "config": run.cfg.to_dict(),
        "model": model_state, "optimizer": run.opt.state_dict(), "sampler": run.sampler.state_dict(),
        "rng": state_mod.rng_state(), "history": run.history, "breakdown": run.breakdown,
        "corpus": run.info["corpus"], "world": ctx.world if ctx else 1,
        **({"shards": shards} if shards is not None else {}),
    }, metrics, last=last)
    if ctx is not None:
        dist_train.prune_sharded(run.run_dir, run.step, run.saver.previous)
    return metrics


def _plot(metrics: dict[str, Any], run_dir: Path, log: Callable[[str], None]) -> None:
    try:
        report.plot(metrics, run_dir / report.PLOT)
    except OSError as exc:  # the checkpoint and metrics are saved; a missing picture costs nothing
        log(f"memfit train: cannot write {run_dir / report.PLOT} ({exc.strerror or exc})")
