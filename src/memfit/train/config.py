"""What a training run is asked to do (TrainConfig) and the checks that refuse a bad request up front."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from memfit.core.errors import ConfigError

DEFAULT_MODEL = "gpt:layers=4,hidden=192,heads=6,vocab=256,seq=256"
"""A byte-level GPT (1.9M parameters) that learns visible Shakespeare in two minutes on two cores."""
DEFAULT_BATCH = 16
"""Sequences per optimizer step when none is given: `memfit train` and `memfit plan` alike."""
DEFAULT_SEQ = 128
"""Tokens per sequence when none is given (`memfit plan`: at most the model's own)."""
DEFAULT_TIME_LIMIT = 120.0
"""Seconds for `memfit train` with neither --steps nor --time-limit."""
MAX_COUNT = 2**31 - 1
"""Largest batch, sequence, step or interval count: beyond it a count is a typo, not a request."""
MAX_SEED = 2**64 - 1
"""torch's generators take 64-bit seeds."""
ADAMW_BETAS = (0.9, 0.95)
"""`memfit train`'s AdamW betas (nanoGPT's), passed explicitly so the library's default may differ."""
RESUMABLE = ("steps", "time_limit", "eval_every", "eval_batches", "save_every", "out", "device", "track", "data",
             "spill_dir")
"""Options a resumed run may change: they decide how long and how it reports, not what it computes
(--data may name the same bytes another way: the corpus digest decides)."""


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
    batch: int = DEFAULT_BATCH
    """Sequences per micro-batch."""
    seq: int = DEFAULT_SEQ
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
    step_in_backward: bool = False
    """Update each parameter during backward, its gradient freed at once (memfit.apply.step_in_backward):
    no clipping, accumulation 1, one process."""
    head_chunks: int | None = None
    """LM head + cross-entropy in this many chunks (memfit.apply.head_swap; set by a plan); None = plain."""
    spill_dir: str | None = None
    """Folder for every disk offload of the run: activations (+offload:disk) and optimizer state."""
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
    dropout: float | None = None
    """Dropout of memfit's GPT; None = the model spec's own (0 unless the spec sets dropout=)."""
    lora: str | None = None
    """LoRA adapters on the frozen model (memfit.models.lora: r=16,targets=q_proj,v_proj[,base=nf4]); None: all train."""
    track: bool = True
    """Measure one step's memory breakdown with memfit's tracker (params, grads, optimizer, activations)."""
    strategy: str = "none"
    """Strategy over the processes torchrun started: none, ddp, ps, zero1, zero2, zero3, pipeline, tensor."""
    microbatches: int | None = None
    """--strategy pipeline: micro-batches the global batch is split into per schedule step (default: world)."""
    schedule: str = "1f1b"
    """--strategy pipeline: gpipe (all forwards, then all backwards), 1f1b (fewer micro-batches in flight) or
    interleaved (torch's interleaved 1F1B: --virtual-stages stages per rank, a smaller bubble)."""
    virtual_stages: int | None = None
    """--schedule interleaved: stages per rank (default 2; the blocks cut evenly into processes x V stages)."""
    tp: int | None = None
    """--strategy tensor: tensor-parallel degree (default: world, so dp = world / tp = 1)."""
    dp: int = 1
    """--strategy pipeline: data-parallel replicas of the pipeline (stages = world / dp)."""
    pp: int | None = None
    """--strategy pipeline --engine fsdp2: pipeline stages of the 3-D ("pp", "dp", "tp") mesh (default:
    world / tp, so dp = world / (pp x tp) = 1); --tp is its tensor-parallel degree (default 1)."""
    engine: str = "auto"
    """Who carries out zero2/zero3: memfit's flat engine, or torch's FSDP2 (fully_shard per block; checkpoints
    through torch.distributed.checkpoint). memfit.distributed.strategy.ENGINES; "auto": FSDP2 unless the run
    needs memfit's (memfit.train.distributed.resolve_engine writes the choice here when the run starts)."""
    compress: str = "none"
    """Gradient compression on the wire (ddp, zero1, zero2): topk:0.01, int8, sign, bf16, powersgd:4, ...
    (memfit.distributed.compression; docs/compression.md)."""

    def validate(self) -> None:
        """Raise ConfigError for the first option that cannot work, naming it as the command line does."""
        counts = {"batch": 1, "seq": 1, "accum": 1, "eval_batches": 1, "eval_every": 0, "save_every": 0, "warmup": 0}
        if self.steps is not None:
            counts["steps"] = 1
        for name, low in counts.items():
            _check_int(name, getattr(self, name), low, MAX_COUNT)
        _check_int("seed", self.seed, 0, MAX_SEED)
        if self.time_limit is not None:
            _check_float("time_limit", self.time_limit, "a positive number of seconds", lambda v: v > 0)
        _check_float("lr", self.lr, "a positive number", lambda v: v > 0)
        _check_float("min_lr_ratio", self.min_lr_ratio, "in [0, 1]", lambda v: 0 <= v <= 1)
        _check_float("weight_decay", self.weight_decay, ">= 0", lambda v: v >= 0)
        if self.clip is not None:
            _check_float("clip", self.clip, "positive (0 on the command line turns clipping off)", lambda v: v > 0)
        if self.dropout is not None:
            _check_float("dropout", self.dropout, "in [0, 1)", lambda v: 0 <= v < 1)
        if self.head_chunks is not None:
            _check_int("head_chunks", self.head_chunks, 1, MAX_COUNT)
        if self.lora is not None:
            from memfit.models.lora import parse_lora

            parse_lora(self.lora)  # a bad spec: one line
            if self.strategy != "none":
                raise ConfigError(f"--lora trains on one process; drop --strategy {self.strategy}")
        if self.offload_optimizer not in ("none", "cpu", "disk"):
            raise ConfigError(f"--offload-optimizer {self.offload_optimizer!r}; accepted: none, cpu, disk")
        if self.step_in_backward:
            self._check_step_in_backward()
        if self.engine not in ("memfit", "auto"):
            from memfit.train.fsdp2_run import check_engine

            check_engine(self)  # an engine the strategy or an option cannot run on: one line
        if self.compress not in (None, "none"):
            from memfit.distributed.compression.spec import check_compression_strategy

            check_compression_strategy(self.strategy, self.compress, self.optimizer)  # a bad spec or strategy: one line
        if not isinstance(self.data, (list, tuple)) or not all(isinstance(d, str) for d in self.data):
            raise ConfigError(f"data must be a list of paths, got {self.data!r}")

    def _check_step_in_backward(self) -> None:
        if self.accum != 1:
            raise ConfigError(f"--step-in-backward updates in every backward: --accum must be 1, got {self.accum}")
        if self.strategy not in (None, "none"):
            raise ConfigError(f"--step-in-backward runs in one process, not with --strategy {self.strategy}")
        if self.clip is not None:
            raise ConfigError("--step-in-backward cannot clip by the global gradient norm (the gradients are freed "
                              "as they arrive): leave out --clip or give --clip 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def flag(name: str) -> str:
    """The command-line spelling of a TrainConfig field."""
    return "--no-track" if name == "track" else "--" + name.replace("_", "-")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ConfigError(f"{flag(name)} must be {what} (at most {high}), got {value!r}")


def _check_float(name: str, value: Any, what: str, ok: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ConfigError(f"{flag(name)} must be {what}, got {value!r}")


def optimizer_extra(cfg: TrainConfig) -> dict[str, Any]:
    """What `memfit train` sets beyond torch's defaults: AdamW's betas (0.9, 0.95), as GPT training does."""
    return {"betas": ADAMW_BETAS} if cfg.optimizer.lower() == "adamw" else {}
