"""The training loop behind `memfit train`, top to bottom.

    cfg = TrainConfig(steps=200)                     # or TrainConfig() for ~2 minutes on the default corpus
    result = train(cfg)                              # writes runs/<timestamp>/{metrics.json, plot.png, checkpoint.pt}
    result = train(*resume_config("runs/...", {}))   # continues the same loss trajectory

Each optimizer step: `accum` micro-batches from a seeded window sampler, summed losses divided
by the token count of the whole accumulated batch (accumulate_grads), one TrainingOptimizer step
(precision, loss scaling, clipping and optimizer offload live there), a cosine learning rate
with linear warm-up. Every `save_every` steps, at the end, on the time limit and on Ctrl-C the
whole state (model, optimizer, step, sampler and torch RNG) goes into an atomic checkpoint, so a
resumed run is the uninterrupted run, bit for bit on CPU in fp32.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from memfit.core.errors import ConfigError, MemfitError
from memfit.train import data as data_mod
from memfit.train import report, state as state_mod

DEFAULT_MODEL = "gpt:layers=4,hidden=192,heads=6,vocab=256,seq=256"
"""A byte-level GPT (1.9M parameters) that learns visible Shakespeare in two minutes on two cores."""
DEFAULT_TIME_LIMIT = 120.0
"""Seconds for `memfit train` with neither --steps nor --time-limit."""
CALIBRATION_STEPS = 6
"""Steps timed before a time-limited run first fits its schedule length (the first is warm-up)."""
RECENT = 30
"""A time-limited run refits its schedule length after every step from the last RECENT step times."""
RESUMABLE = ("steps", "time_limit", "eval_every", "eval_batches", "save_every", "out", "device", "track")
"""Options a resumed run may change: they decide how long and how it reports, not what it computes."""


@dataclass
class TrainConfig:
    model: str = DEFAULT_MODEL
    """Known architecture, gpt:/llama: spec or config.json path (memfit.models.spec.parse_model); vocab >= 256."""
    data: list[str] = field(default_factory=list)
    """Text files, folders or globs; empty = the default corpus (Shakespeare, else Python's stdlib)."""
    steps: int | None = None
    """Optimizer steps; None with no time_limit means DEFAULT_TIME_LIMIT seconds."""
    time_limit: float | None = None
    """Seconds of training; without `steps` the schedule length is fitted to it after a few timed steps."""
    batch: int = 16
    """Sequences per micro-batch."""
    seq: int = 128
    accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation): tokens/step = batch * seq * accum."""
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    warmup: int = 20
    """Linear warm-up steps, at most a fifth of the run (the first step's learning rate is lr / warmup)."""
    weight_decay: float = 0.0
    precision: str = "auto"
    """A TrainingOptimizer precision; auto = bf16-mixed on a CUDA device with bf16, else 32-true."""
    optimizer: str = "adamw"
    checkpoint: str = "none"
    """Activation checkpoint policy, passed to memfit.checkpoint unchanged."""
    offload_optimizer: str = "none"
    spill_dir: str | None = None
    clip: float | None = 1.0
    """Max total gradient norm; None turns clipping off."""
    eval_every: int = 50
    """Validation every N steps (and at the start and the end); 0 = only start and end."""
    eval_batches: int = 8
    save_every: int = 100
    """Checkpoint every N steps (and always at the end); 0 = only at the end."""
    seed: int = 0
    out: str | None = None
    """Run folder; None = runs/<timestamp> (or the resumed run's folder)."""
    device: str | None = None
    """cpu or cuda[:N]; None = cuda when available."""
    dropout: float = 0.0
    track: bool = True
    """Measure one step's memory breakdown with memfit's tracker (params, grads, optimizer, activations)."""
    strategy: str = "none"
    """Data-parallel strategy over the processes torchrun started: none, ddp, ps, zero1, zero2, zero3."""

    def validate(self) -> None:
        positive = {"batch": self.batch, "seq": self.seq, "accum": self.accum, "eval_batches": self.eval_batches}
        if self.steps is not None:
            positive["steps"] = self.steps
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("eval_every", "save_every", "warmup", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ConfigError(f"--time-limit must be a positive number of seconds, got {self.time_limit!r}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ConfigError(f"--lr must be a positive number, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        if self.clip is not None and not self.clip > 0:
            raise ConfigError(f"--clip must be positive (0 on the command line turns clipping off), got {self.clip!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout!r}")
        if self.offload_optimizer not in ("none", "cpu", "disk"):
            raise ConfigError(f"--offload-optimizer {self.offload_optimizer!r}; accepted: none, cpu, disk")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- the step


class StepOutput(NamedTuple):
    loss: float
    """Mean loss per target token over the whole accumulated batch."""
    ntokens: int
    result: Any
    """The TrainingOptimizer's StepResult (stepped, grad_norm, loss_scale)."""


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, counted targets) for memfit's GPT or a Hugging Face causal LM; -1 = padding."""
    from memfit.models.gpt import GPT

    if isinstance(model, GPT):
        _, loss, n = model(x, y)
        return loss, n
    logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), ignore_index=-1, reduction="sum")
    return loss, (y != -1).sum()


def accumulate_grads(model: nn.Module, opt, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
    """Backward over all micro-batches into one set of grads; returns (mean loss per token, tokens).

    Each micro-batch's *summed* loss is divided by the target-token count of the whole accumulated
    batch, so the grads equal one large batch's mean-loss grads even when padding (-1) makes the
    micro-batches unequal. Dividing by the number of micro-batches instead would weight a token in
    a short micro-batch more than one in a long one.
    """
    micro_batches = list(micro_batches)
    total = int(sum((y != -1).sum() for _, y in micro_batches))  # one host sync, not one per micro-batch
    denom = max(total, 1)  # an all-padding batch has zero loss and zero grads, not NaN
    running = None
    last = len(micro_batches) - 1
    for i, (x, y) in enumerate(micro_batches):
        with opt.autocast():
            loss, _ = loss_sum(model, x, y)
        # final: with optimizer offload, updates may start while the last backward still runs.
        opt.backward(loss / denom, final=i == last)
        running = loss.detach().float() if running is None else running + loss.detach().float()
    mean = float(running) / denom if running is not None else 0.0  # one host sync per step
    return mean, total


def accumulate_step(model: nn.Module, opt, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> StepOutput:
    """accumulate_grads, then one optimizer step (which also zeroes the grads)."""
    loss, ntokens = accumulate_grads(model, opt, micro_batches)
    return StepOutput(loss, ntokens, opt.step())


def lr_at(step: int, base: float, warmup: int, horizon: int | None, min_ratio: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then a cosine from `base` to `base * min_ratio` at `horizon`.

    The warm-up is at most a fifth of the run, so a short run (a time limit on a slow machine)
    does not spend itself warming up. `horizon` None (a time-limited run still timing its first
    steps) holds `base` after warm-up.
    """
    if horizon is not None:
        warmup = min(warmup, horizon // 5)
    if step < warmup:
        return base * (step + 1) / warmup
    if horizon is None:
        return base
    progress = min(1.0, max(0.0, (step - warmup) / max(1, horizon - warmup)))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: nn.Module, opt, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean loss per token over fixed validation batches (dropout off)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for x, y in batches:
            with opt.autocast():
                loss, n = loss_sum(model, x.to(device), y.to(device))
            total += float(loss)
            count += int(n)
    finally:
        model.train(was_training)
    return total / max(count, 1)


# ---------------------------------------------------------------- setup


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; accepted: cpu, cuda, cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {name!r}; accepted: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def build_model(cfg: TrainConfig) -> nn.Module:
    """The model of `cfg.model` with `cfg.dropout`, checked to take byte tokens and `cfg.seq` positions."""
    from memfit.models.spec import parse_model

    spec = parse_model(cfg.model)
    if spec.config is not None:
        if spec.config.vocab < data_mod.VOCAB:
            raise ConfigError(f"model {cfg.model!r} has vocab={spec.config.vocab}; byte-level data needs vocab >= 256")
        spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, dropout=cfg.dropout))
        return spec.build(seq=cfg.seq)
    if cfg.dropout:
        raise ConfigError("--dropout applies to memfit's GPT models; set dropout in the Hugging Face config.json")
    model = spec.build()
    hf = model.config
    if getattr(hf, "vocab_size", 0) < data_mod.VOCAB:
        raise ConfigError(f"model {cfg.model!r} has vocab_size={hf.vocab_size}; byte-level data needs >= 256")
    positions = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", None)
    if positions is not None and cfg.seq > positions:
        raise ConfigError(f"--seq {cfg.seq} exceeds the model's {positions} positions")
    return model


def _flag(name: str) -> str:
    return "--no-track" if name == "track" else "--" + name.replace("_", "-")


def resume_config(run_dir: str | Path, overrides: dict[str, Any]) -> tuple[TrainConfig, dict[str, Any]]:
    """The saved config of `run_dir` with `overrides`, and the loaded checkpoint.

    Only RESUMABLE options may differ from the saved ones; repeating a saved value is fine.
    """
    ckpt = state_mod.load_checkpoint(run_dir)
    saved = dict(ckpt["config"])
    bad = sorted(k for k, v in overrides.items() if k not in RESUMABLE and saved.get(k) != v)
    if bad:
        raise ConfigError(f"cannot change {', '.join(map(_flag, bad))} when resuming (the run would not continue "
                          f"the same trajectory); allowed with --resume: {', '.join(map(_flag, RESUMABLE))}")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in known})
    # The run continues where it is now (the folder may have moved since it was saved) unless --out says otherwise.
    cfg = dataclasses.replace(cfg, **{"out": str(run_dir), **overrides})
    return cfg, ckpt


def _new_run_dir() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / stamp
    i = 1
    while path.exists():
        path, i = Path("runs") / f"{stamp}-{i}", i + 1
    return path


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


def _enter_tracker(model: nn.Module, opt, device: torch.device, log: Callable[[str], None]):
    """memfit's live tracker, entered; None when it is unavailable (training does not need it)."""
    try:
        from memfit.core.tracker import track
    except ImportError:
        return None
    optimizer = opt if hasattr(opt, "state_tensors") else getattr(opt, "optimizer", opt)
    try:
        tracker = track(model, optimizer, device=device)
        tracker.__enter__()
    except Exception as exc:  # a measurement failing to start must not cost the user the run
        log(f"memfit train: memory breakdown unavailable ({type(exc).__name__}: {exc})")
        return None
    return tracker


# ---------------------------------------------------------------- the loop


@dataclass
class TrainResult:
    run_dir: Path
    metrics: dict[str, Any]
    step: int
    """Optimizer steps done in total (across resumes)."""
    stopped: str
    """Why the loop ended: "steps", "time_limit", "stop_at" or "interrupted"."""


def train(
    cfg: TrainConfig,
    checkpoint: dict[str, Any] | None = None,
    *,
    stop_at: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train per `cfg` (from `checkpoint` when resuming) and write the run folder.

    `stop_at` ends this run after that many total steps without changing the schedule (a resume
    then continues it); `progress` shows a tqdm bar on a terminal, else a line every few seconds.
    """
    from memfit.apply.checkpoint import checkpoint as apply_checkpoint
    from memfit.apply.optimizer import TrainingOptimizer

    cfg = dataclasses.replace(cfg, data=list(cfg.data))
    if cfg.steps is None and cfg.time_limit is None:
        cfg.time_limit = DEFAULT_TIME_LIMIT
    cfg.validate()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    from memfit.train import distributed as dist_train  # several processes: memfit.distributed

    ctx = dist_train.setup(cfg, device, resuming=checkpoint is not None)
    if ctx is not None and not ctx.main:  # rank 0 reports and writes the run folder
        log, progress = (lambda msg: None), False
    # The seed fixes the initial weights; a resume overwrites them and the RNG state below.
    torch.manual_seed(cfg.seed)

    corpus = data_mod.load_corpus(cfg.data, min_split_bytes=cfg.seq + 1)
    if checkpoint is not None and checkpoint["corpus"]["digest"] != corpus.digest:
        raise ConfigError(f"the data of {cfg.out!r} changed since its checkpoint ({corpus.name}); "
                          "resume with the same files or start a new run")
    model = build_model(cfg).to(device)
    apply_checkpoint(model, cfg.checkpoint, spill_dir=cfg.spill_dir)
    opt = dist_train.make_optimizer(ctx, model, cfg, precision) if ctx else TrainingOptimizer(
        model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, precision=precision, clip=cfg.clip,
        offload=None if cfg.offload_optimizer == "none" else cfg.offload_optimizer, spill_dir=cfg.spill_dir,
    )
    sampler = dist_train.RankSampler(corpus.train, cfg.batch, cfg.seq, cfg.seed, ctx.rank, ctx.world) if ctx \
        else data_mod.WindowSampler(corpus.train, cfg.batch, cfg.seq, cfg.seed)
    val_batches = data_mod.fixed_windows(corpus.val, cfg.eval_batches, cfg.batch, cfg.seq, cfg.seed + 1)
    run_dir = Path(cfg.out) if cfg.out else _new_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)

    history = report.new_history()
    step, horizon, breakdown = 0, cfg.steps, None
    # Without --steps the schedule length is fitted to the time limit: first after a few timed steps,
    # then refitted after every step from the recent speed (a shared machine's speed drifts) until
    # 90% of the time is spent. A resumed run keeps the length its checkpoint fixed.
    auto_horizon = cfg.steps is None and (checkpoint is None or checkpoint["horizon"] is None)
    if checkpoint is not None:
        if ctx is not None:  # ZeRO's optimizer state comes from its sharded checkpoint
            dist_train.restore(opt, model, checkpoint, Path(cfg.out))
        else:
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
        sampler.load_state_dict(checkpoint["sampler"])
        step, history, breakdown = checkpoint["step"], checkpoint["history"], checkpoint.get("breakdown")
        horizon = cfg.steps if cfg.steps is not None else checkpoint["horizon"]
        state_mod.set_rng_state(checkpoint["rng"])
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    run_info = {
        "device": str(device), "precision": precision, "params": n_params,
        "corpus": {"name": corpus.name, "files": len(corpus.files), "bytes": corpus.num_bytes, "digest": corpus.digest},
        "tokens_per_step": cfg.batch * cfg.seq * cfg.accum * (ctx.world if ctx else 1),
    }
    log(f"memfit train: {n_params / 1e6:.2f}M-parameter model {cfg.model} on {device} ({precision}), "
        f"data {corpus.name} ({corpus.num_bytes / 1e6:.1f} MB, {len(corpus.files)} files), "
        f"{run_info['tokens_per_step']} tokens/step" + (f", resuming at step {step}" if step else ""))

    def save() -> dict[str, Any]:
        history["seconds"] = base_seconds + time.perf_counter() - started
        model_state = dist_train.save_states(opt, model, run_dir, step) if ctx else model.state_dict()
        if ctx is not None and not ctx.main:
            return write_metrics()  # computed, not written
        state_mod.save_checkpoint(run_dir / state_mod.CHECKPOINT, {
            "format": 1, "step": step, "horizon": horizon, "config": cfg.to_dict(),
            "model": model_state, "optimizer": opt.state_dict(), "sampler": sampler.state_dict(),
            "rng": state_mod.rng_state(), "history": history, "breakdown": breakdown,
            "corpus": run_info["corpus"],
        })
        if ctx is not None:
            dist_train.prune_sharded(run_dir, step)
        return write_metrics()

    def write_metrics() -> dict[str, Any]:
        history["seconds"] = base_seconds + time.perf_counter() - started
        metrics = report.metrics_payload(cfg.to_dict(), {**run_info, "horizon": horizon}, history, breakdown)
        if ctx is None or ctx.main:
            state_mod.save_json(run_dir / report.METRICS, metrics)
        return metrics

    def run_eval() -> None:
        t0 = time.perf_counter()
        loss = evaluate(model, opt, val_batches, device)
        history["val"]["step"].append(step)
        history["val"]["loss"].append(loss)
        eval_seconds.append(time.perf_counter() - t0)

    eval_seconds: list[float] = []
    step_seconds: list[float] = []
    base_seconds, started = history["seconds"], time.perf_counter()
    track_at = max(step, 1)  # steady state: the optimizer state exists from the second step on
    bar = report.Progress(step, horizon, enabled=progress, log=log)
    stopped = "steps"
    # Leaving the block closes the bar and opt (spill files, hooks), also when a step raises.
    with opt, bar, _StopOnInterrupt(log) as interrupt:
        if not history["val"]["step"] or history["val"]["step"][-1] != step:
            run_eval()
        while horizon is None or step < horizon:
            if stop_at is not None and step >= stop_at:
                stopped = "stop_at"
                break
            if interrupt.requested:
                stopped = "interrupted"
                break
            if cfg.time_limit is not None and time.perf_counter() - started >= cfg.time_limit:
                stopped = "time_limit"
                break
            lr = lr_at(step, cfg.lr, cfg.warmup, horizon, cfg.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            micro = [tuple(t.to(device, non_blocking=True) for t in sampler.next()) for _ in range(cfg.accum)]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            tracked = getattr(opt, "tracked_module", model)  # ZeRO: the model and this rank's shard
            tracker = _enter_tracker(tracked, opt, device, log) if cfg.track and step == track_at else None
            t0 = time.perf_counter()
            if ctx is not None:
                dist_train.TRAFFIC.reset()
            one_step = (lambda: StepOutput(*dist_train.accumulate_step(opt, micro, loss_sum))) if ctx \
                else (lambda: accumulate_step(model, opt, micro))
            if tracker is not None:
                try:
                    out = one_step()
                finally:
                    tracker.__exit__(None, None, None)
                breakdown = report.tracker_breakdown(tracker, step + 1)  # steps count from 1 in the history
                if ctx is not None:
                    breakdown = dist_train.gather_breakdown(ctx, breakdown)
            else:
                out = one_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            if not math.isfinite(out.loss):
                raise MemfitError(f"loss became {out.loss} at step {step + 1}; the last good state is the previous "
                                  "checkpoint. Try a lower --lr, a smaller --clip or --precision 32-true")
            step += 1
            report.record_step(history, step=step, loss=out.loss, lr=lr, tokens=out.ntokens, seconds=seconds,
                               memory=live_memory(device), grad_norm=getattr(out.result, "grad_norm", None))
            if tracker is None:  # the tracked step runs slower; keep it out of the speed estimate
                step_seconds.append(seconds)
            if auto_horizon and len(step_seconds) >= CALIBRATION_STEPS:
                elapsed = time.perf_counter() - started
                if horizon is None or elapsed < 0.9 * cfg.time_limit:  # type: ignore[operator]
                    horizon = _fit_horizon(step, cfg, elapsed, step_seconds, eval_seconds)
                    bar.set_total(horizon)
            bar.update(step, out.loss, history["steps"]["tokens_per_s"][-1], history["steps"]["memory_bytes"][-1])
            if cfg.eval_every and step % cfg.eval_every == 0:
                run_eval()
            if cfg.save_every and step % cfg.save_every == 0:
                save()
        bar.close()
        if history["val"]["step"][-1] != step:
            run_eval()
        metrics = save()
    if ctx is not None and not ctx.main:
        return TrainResult(run_dir=run_dir, metrics=metrics, step=step, stopped=stopped)
    report.plot(metrics, run_dir / report.PLOT)
    return TrainResult(run_dir=run_dir, metrics=metrics, step=step, stopped=stopped)


class _StopOnInterrupt:
    """The first Ctrl-C ends the run after the current step (final eval, checkpoint, metrics, plot);
    a second one aborts at once. Stopping between steps keeps the checkpoint consistent: an
    interrupt inside the optimizer step would leave some parameters updated and others not."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self.requested, self.previous = log, False, None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.log("\nmemfit train: stopping after this step (Ctrl-C again to abort without saving)")

    def __enter__(self) -> "_StopOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.default_int_handler)


def _fit_horizon(step: int, cfg: TrainConfig, elapsed: float, step_seconds: list[float], eval_seconds: list[float]) -> int:
    """Steps that fit in the time limit, from the step and evaluation times measured so far.

    Time still to spend = remaining steps * (mean recent step time + amortised evaluation) + one
    final evaluation and a step's worth of slack for the last checkpoint. The mean (not the median)
    of recent steps, because slow phases on a shared machine cost real seconds and pass.
    """
    timed = (step_seconds[1:] or step_seconds)[-RECENT:]  # the first step pays one-off warm-up costs
    per_step = sum(timed) / len(timed)
    per_eval = max(eval_seconds) if eval_seconds else 0.0
    amortised = per_step + (per_eval / cfg.eval_every if cfg.eval_every else 0.0)
    remaining = cfg.time_limit - elapsed - per_eval - per_step  # type: ignore[operator]
    return step + max(1, int(remaining / amortised))
