"""memfit.estimate(): will a training step fit, and where does the memory go? Nothing is allocated.

Every figure comes from tracing whole training steps of the real model under FakeTensorMode
(memfit.measure.trace), through the same mechanisms a real run uses: checkpoint policy, precision
mode and optimizer offload (the offloaded step itself is traced, so on one device the estimate
equals the measured step to the byte). The trace runs one unsharded device. ZeRO then scales each
model-state category by the formulas' sharded/unsharded ratio, at the traced peak and at every
module's peak moment; the highest of these sharded moments is the per-device peak, so the five
figures add up to it and no module's figure exceeds it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from memfit.core.errors import ConfigError
from memfit.apply.optimizers import needs_shapes
from memfit.core.ledger import CATEGORIES
from memfit.core.units import parse_bytes
from memfit.measure.formulas import check_precision, model_state_bytes, optimizer_states, param_shapes
from memfit.models.spec import ModelSpec, parse_model

MODEL_STATES = ("params", "grads", "optimizer")


@dataclass
class Estimate:
    model: str
    n_params: int
    batch: int | None
    seq: int | None
    precision: str
    optimizer: str
    zero: int
    world: int
    checkpoint: str
    offload_optimizer: str | None
    per_device: dict[str, int]
    """params, grads, optimizer, activations, temporaries and total (the steady-state peak), bytes."""
    offloaded: int = 0
    """Bytes held off the device (offloaded optimizer state)."""
    device_memory: int | None = None
    traced: bool = False
    """False when only model states were estimated (no model given, just a parameter count)."""
    trace_seconds: float = 0.0
    modules: dict[str, int] = field(default_factory=dict)
    """Per-module peak bytes per device (model states sharded as in per_device: under a data-parallel
    strategy the largest rank's; under pipeline and tensor the one-device trace's), largest first."""
    module_activations: dict[str, int] = field(default_factory=dict)
    strategy: str | None = None
    """The distributed strategy (zero=Z with world=N is "zeroZ"); per_device is then its largest rank."""
    ranks: list[dict] = field(default_factory=list)
    """Under a strategy: each distinct rank's figures at its peak moment, with the `rank_ids` it covers
    (memfit.measure.rank_estimate); the categories add up to `total`."""
    accum: int = 1  # micro-batches per optimizer step: the peak counts the gradients held across them
    step_in_backward: bool = False  # each parameter updated, its gradient freed, in backward (apply.step_in_backward)
    moments: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    """The traced step's categories at each module's (or composed stretch's) highest moment, before
    any sharding: what the per-rank estimate transforms (not in the JSON)."""
    note: str = ""
    """Why a figure is less than the whole answer (e.g. ZeRO on a parameter count alone)."""
    device: str | None = None
    """A named GPU target (h100, ...): traced as that GPU runs the step; per_device then also holds
    "reserved", the caching allocator's predicted max_memory_reserved (what runs out)."""
    context: int = 0
    """GPU targets: bytes of the CUDA context, outside the allocator (counted by `fits`)."""
    precision_default: str | None = None
    """Set when the precision was not given and the device's default was taken (e.g. bf16-master on a GPU)."""
    attention: dict[str, int] = field(default_factory=dict)
    """GPU targets: attention calls per backend in the traced step (cudnn, flash, efficient, math)."""
    reserve_overhead: int | None = field(default=None, repr=False)
    """GPU targets: the traced step's reserve minus its tensors' peak (rounding, segments, cuBLAS workspaces)."""

    @property
    def total(self) -> int:
        return self.per_device["total"]

    @property
    def needed(self) -> int:
        """What the device must hold: on a GPU target the reserve plus the CUDA context, else the peak."""
        return self.per_device.get("reserved", self.total) + self.context

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.needed <= self.device_memory

    @property
    def headroom(self) -> int | None:
        """device_memory - needed: negative means over budget by that much."""
        return None if self.device_memory is None else self.device_memory - self.needed

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("moments")
        data.pop("reserve_overhead")
        data["fits"], data["headroom"] = self.fits, self.headroom
        return data


def _positive(name: str, value: int | None) -> int | None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def estimate(
    model: Any = None,
    example: Any = None,
    *,
    params: int | None = None,
    batch: int = 1,
    seq: int | None = None,
    precision: str | None = None,
    optimizer: str = "adamw",
    zero: int = 0,
    world: int = 1,
    checkpoint: str = "none",
    offload_optimizer: str | None = None,
    device_memory: int | str | None = None,
    loss_fn: Any = None,
    lora: Any = None,
    routing: str = "balanced",
    strategy: str | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    tp: int | None = None,
    accum: int = 1,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    device: str | None = None,
    qlora: bool = False,
    step_in_backward: bool = False, engine: str = "memfit", pp: int | None = None, virtual_stages: int | None = None,
) -> Estimate:
    """Predict per-device training memory for `model` (a name, spec string, config.json or ModelSpec).

    With `params=N` and no model, only model states (params, grads, optimizer) are estimated.
    `model` may also be any nn.Module (real or meta weights) or a zero-argument factory, with `example`
    one micro-batch (dict of keyword arguments, tuple of positional arguments or a tensor) and
    optionally `loss_fn(output, example)` (memfit.measure.anymodel).
    `lora` ("r=8,targets=q_proj,v_proj" or a LoraConfig) freezes the named model and adds LoRA adapters;
    `qlora=True` (or base=nf4 in `lora`) holds the frozen linear weights in NF4 (memfit.models.qlora).
    `routing` (mixture-of-experts layers): "balanced" or "worst" (memfit.measure.moe).
    `strategy` ("ddp", "ps", "zero1".."zero3", "pipeline", "tensor") on `world` ranks, `batch` rows each
    (pipeline and tensor: of the global batch world x batch; `microbatches`, `schedule`, `virtual_stages`, `tp`):
    per_device is the largest rank's figure and `ranks` lists each distinct rank. `zero=Z` with
    `world=N` is `strategy="zeroZ"`. `accum` micro-batches per optimizer step: a later micro-batch
    runs beside the gradients of the earlier ones (ZeRO-2/3: the rank's reduced slices).
    `sequence_parallel`, `vocab_parallel` (strategy "tensor"): Megatron-LM's sequence parallelism and
    vocabulary-parallel embedding and head, estimated only (memfit.measure.parallel_estimate; not run).
    `device`: a GPU to estimate for from any machine (h100, h200, a100-80gb, a100-40gb, l40s, rtx4090, ...;
    memfit.core.gpus): the step is traced with that GPU's attention, dropout and optimizer kernels,
    per_device["reserved"] predicts its max_memory_reserved, device_memory defaults to its capacity and
    precision to what people run there (bf16-master). None or cpu: this machine's CPU, 32-true.
    `step_in_backward`: each parameter updated, and its gradient freed, as soon as backward produced it
    (memfit.apply.step_in_backward; one device, accum 1, no master weights or optimizer offload).
    `engine`: who runs the strategy (memfit.distributed.strategy.ENGINES; rank_estimate.rank_rows; `pp`: see it)."""
    from memfit.core.device import estimate_device
    from memfit.core.gpus import local_gpu

    if qlora:
        from memfit.models.lora import with_nf4_base
        lora = with_nf4_base(lora)
    traced_on, gpu = estimate_device(device)
    if traced_on.startswith("cuda"):  # this machine's GPU, as a target like any named one
        gpu = local_gpu(torch_index(traced_on))
    default = None
    if precision is None:
        precision = default = gpu.default_precision if gpu is not None else "32-true"
    if gpu is not None and device_memory is None:
        device_memory = gpu.memory
    if step_in_backward:
        _check_step_in_backward(precision, offload_optimizer, accum, world, zero, strategy)
    est = _strategies(model, example, params=params, batch=batch, seq=seq, precision=precision, optimizer=optimizer,
                      zero=zero, world=world, checkpoint=checkpoint, offload_optimizer=offload_optimizer,
                      device_memory=device_memory, loss_fn=loss_fn, lora=lora, routing=routing, strategy=strategy,
                      microbatches=microbatches, schedule=schedule, tp=tp, accum=accum, gpu=gpu, engine=engine,
                      sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel, sib=step_in_backward, pp=pp,
                      virtual_stages=virtual_stages)
    est.step_in_backward = step_in_backward
    est.precision_default = default if gpu is not None else None
    if gpu is not None:
        est.device, est.context = gpu.name, gpu.context
        if est.reserve_overhead is not None:
            est.per_device["reserved"] = est.per_device["total"] + est.reserve_overhead
    return est


def _check_step_in_backward(precision: str, offload: str | None, accum: int, world: int, zero: int,
                            strategy: str | None) -> None:
    """ConfigError (one line) for what the step in backward does not run with (memfit.apply.step_in_backward)."""
    from memfit.apply.precision import precision_mode
    from memfit.apply.step_in_backward import check_step_in_backward

    check_step_in_backward(precision_mode(precision), None if offload in (None, "none") else offload, None)
    if accum != 1:
        raise ConfigError(f"step in backward updates in every backward: estimate accum 1, not {accum}")
    if world != 1 or zero or strategy:
        raise ConfigError("step in backward is estimated on one device: leave out --world, --zero and --strategy")


def torch_index(device: str) -> int | None:
    import torch

    return torch.device(device).index


def _strategies(model: Any, example: Any, *, params, batch, seq, precision, optimizer, zero, world, checkpoint,
                offload_optimizer, device_memory, loss_fn, lora, routing, strategy, microbatches, schedule, tp, accum,
                gpu, sequence_parallel=False, vocab_parallel=False, sib=False, engine="memfit", pp=None,
                virtual_stages=None) -> Estimate:
    """estimate() on one device or under a strategy, for a resolved precision and device."""
    from memfit.measure.moe import routing as moe_routing
    from memfit.measure.rank_estimate import strategy_of

    _positive("world", world)
    _positive("accum", accum)
    strategy = strategy_of(strategy, zero, world)
    if engine != "memfit" and strategy is None:
        raise ConfigError(f"engine {engine!r} runs a distributed strategy: give strategy (and world), or leave it out")
    with moe_routing(routing):
        lora_run = lora is not None or getattr(model, "lora", None) is not None
        if strategy is not None and isinstance(model, (str, ModelSpec)) and not lora_run:
            from memfit.measure.rank_estimate import with_ranks

            if strategy in ("zero2", "zero3") and engine == "fsdp2":  # zero2: reshard_after_forward False
                from memfit.measure.fsdp2_estimate import fsdp2_estimate
                return fsdp2_estimate(estimate, _spec_of(model, lora), batch, seq, world, precision=precision,
                                      optimizer=optimizer, checkpoint=checkpoint, reshard=strategy == "zero3",
                                      device=gpu and gpu.name, device_memory=device_memory)
            if strategy == "tensor" and engine == "fsdp2":  # 2-D: FSDP2 over dp x the tensor plan over tp
                from memfit.measure.fsdp_tp_estimate import fsdp_tp_estimate
                return fsdp_tp_estimate(estimate, _spec_of(model, lora), batch, seq, world, tp or world,
                                        precision=precision, optimizer=optimizer, checkpoint=checkpoint)
            one = _estimate(model, example, params=params, batch=batch, seq=seq, precision=precision,
                            optimizer=optimizer, zero=0, world=1, checkpoint=checkpoint,
                            offload_optimizer=offload_optimizer, device_memory=device_memory, loss_fn=loss_fn,
                            lora=lora, worst=routing == "worst", gpu=gpu)
            return with_ranks(one, _spec_of(model, lora), strategy, world, microbatches=microbatches, schedule=schedule,
                              tp=tp, accum=accum, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel,
                              engine=engine, pp=pp, **({"virtual_stages": virtual_stages} if virtual_stages else {}))
        if engine != "memfit":
            raise ConfigError(f"engine {engine!r} is estimated per rank for a model name, spec or config.json "
                              "(without LoRA adapters), not for a module")
        if sequence_parallel or vocab_parallel:
            raise ConfigError("sequence_parallel and vocab_parallel need strategy 'tensor' on a model name or "
                              "gpt:/llama: spec")
        if strategy in ("pipeline", "tensor"):
            raise ConfigError(f"strategy {strategy} cuts memfit's GPT or a Hugging Face causal LM: give a known "
                              "name, a gpt:/llama: spec or a config.json (without LoRA adapters), not a module")
        est = _estimate(model, example, params=params, batch=batch, seq=seq, precision=precision, optimizer=optimizer,
                        zero=zero, world=world, checkpoint=checkpoint, offload_optimizer=offload_optimizer,
                        device_memory=device_memory, loss_fn=loss_fn, lora=lora, worst=routing == "worst", gpu=gpu,
                        sib=sib)
        if accum > 1:
            if strategy is not None or not isinstance(model, (str, ModelSpec)) or lora_run:
                raise ConfigError("accum > 1 is estimated for a model name, spec or config.json (without LoRA "
                                  "adapters) on one device or under a strategy; estimate one micro-batch (accum=1)")
            from memfit.measure.rank_estimate import with_accumulation

            est = with_accumulation(est, _spec_of(model, lora), accum)
            est.accum = accum
    if strategy is not None:
        est.strategy = strategy
        est.note = (f"{strategy} on {world} ranks as the one-device figure with its model states sharded, "
                    "without ZeRO-3's gathered blocks or the gradient buckets in flight (per-rank figures are "
                    "estimated for a model name, spec or config.json without LoRA adapters)")
    return est


def _estimate(model: Any, example: Any, *, params: int | None, batch: int, seq: int | None, precision: str,
              optimizer: str, zero: int, world: int, checkpoint: str, offload_optimizer: str | None,
              device_memory: int | str | None, loss_fn: Any, lora: Any, worst: bool, gpu: Any = None,
              sib: bool = False) -> Estimate:
    check_precision(precision)
    optimizer_states(optimizer)
    _positive("batch", batch)
    _positive("seq", seq)
    _positive("world", world)
    if offload_optimizer == "none":
        offload_optimizer = None
    budget = parse_bytes(device_memory) if device_memory is not None else None
    if model is not None and not isinstance(model, (str, ModelSpec)):  # any nn.Module or factory + example
        if lora is not None:
            raise ConfigError("lora= applies to a named model or config; add the adapters to your module "
                              "(e.g. peft.get_peft_model) and pass it")
        from memfit.measure.anymodel_estimate import estimate_module

        return Estimate(**estimate_module(model, example, optimizer=optimizer, precision=precision, checkpoint=checkpoint,
                               loss_fn=loss_fn, zero=zero, world=world, offload_optimizer=offload_optimizer,
                               device_memory=budget, gpu=gpu, step_in_backward=sib))
    if model is None:
        if sib:
            raise ConfigError("step in backward is estimated for a model (name, spec or config.json), not --params")
        return _states_only(params, precision, optimizer, zero, world, offload_optimizer, budget)
    spec = _spec_of(model, lora)
    n, n_tensors = spec.counts()
    if params is not None and params != n:
        raise ConfigError(f"--params {params} contradicts {spec.name}, which has {n} parameters; give one of them")
    # Default: the model's context length, capped at 4096 (long-context models train mostly shorter).
    seq = seq or min(spec.seq or 1024, 4096)
    if spec.task not in (None, "causal-lm"):  # seq2seq, masked LM, image classifier: their own batches
        return _family(spec, batch, seq, precision, optimizer, zero, world, checkpoint, offload_optimizer, budget, gpu,
                       sib)
    common = dict(precision=precision, optimizer=optimizer, **_trainable(spec, optimizer, n_tensors))
    sharded = model_state_bytes(n, zero=zero, world=world, offload_optimizer=offload_optimizer, **common)
    single = model_state_bytes(n, offload_optimizer=offload_optimizer, **common)

    from memfit.measure.trace import trace_step  # heavy import (FakeTensorMode) only when tracing

    tr = None
    # identical blocks: composed, exact (a GPU target traces whole: its reserve replays the step's events)
    if offload_optimizer in (None, "none") and spec.lora is None and not worst and gpu is None:
        from memfit.measure.blocks import composed_step

        tr = composed_step(spec, batch, seq, precision, optimizer, checkpoint, step_in_backward=sib)
    if tr is None:
        tr = trace_step(spec, batch=batch, seq=seq, precision=precision, optimizer=optimizer, checkpoint=checkpoint,
                        offload_optimizer=offload_optimizer, device=gpu if gpu is not None else "cpu",
                        step_in_backward=sib)
    per, modules = _per_device(tr, {cat: (getattr(sharded, cat), getattr(single, cat)) for cat in MODEL_STATES})
    return Estimate(spec.name, n, batch, seq, precision, optimizer, zero, world, checkpoint, offload_optimizer,
                    per, sharded.offloaded, budget, traced=True, trace_seconds=tr.seconds, modules=modules,
                    module_activations=dict(tr.module_activations), moments=tr.module_categories | tr.other_moments,
                    attention=dict(tr.attention),
                    reserve_overhead=None if tr.cuda_reserved is None else tr.cuda_reserved - tr.peak)


def _states_only(params: int | None, precision: str, optimizer: str, zero: int, world: int,
                 offload_optimizer: str | None, budget: int | None) -> Estimate:
    """No model, a parameter count: model states only."""
    if params is None:
        raise ConfigError("give a model (name, spec or config.json) or --params N")
    ms = model_state_bytes(params, precision=precision, optimizer=optimizer, zero=zero, world=world,
                           offload_optimizer=offload_optimizer)
    per = {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer, "activations": 0, "temporaries": 0}
    per["total"] = sum(per.values())
    return Estimate(f"{params:,} parameters", params, None, None, precision, optimizer, zero, world, "none",
                    offload_optimizer, per, ms.offloaded, budget)


def _family(spec: ModelSpec, batch: int, seq: int | None, precision: str, optimizer: str, zero: int, world: int,
            checkpoint: str, offload_optimizer: str | None, budget: int | None, gpu: Any = None,
            sib: bool = False) -> Estimate:
    """A config family other than causal LMs, traced as any module on the family's own micro-batch."""
    from memfit.measure.anymodel_estimate import estimate_module

    seq = None if spec.task == "image-classification" else seq  # image models have no sequence
    fields = estimate_module(lambda: spec.build(seq=seq), spec.example(batch, seq), optimizer=optimizer,
                             precision=precision, checkpoint=checkpoint, zero=zero, world=world,
                             offload_optimizer=offload_optimizer, device_memory=budget, gpu=gpu, step_in_backward=sib)
    fields.update(model=f"{spec.name} ({spec.task})", batch=batch, seq=seq)
    return Estimate(**fields)


def _spec_of(model: Any, lora: Any) -> ModelSpec:
    spec = parse_model(model, families=True) if isinstance(model, str) else model
    if lora is not None:
        from dataclasses import replace

        from memfit.models.lora import parse_lora

        spec = replace(spec, lora=parse_lora(lora) if isinstance(lora, str) else lora)
    return spec


def _trainable(spec: ModelSpec, optimizer: str, n_tensors: int) -> dict[str, Any]:
    """model_state_bytes' arguments that describe what trains: every parameter, or a LoRA's adapters only."""
    if spec.lora is not None:  # a frozen base: only the adapters hold gradients and optimizer state
        shapes = spec.trainable_shapes()
        return dict(param_shapes=shapes, n_trainable=sum(math.prod(s) for s in shapes))
    if needs_shapes(optimizer):  # Adafactor, 8-/4-bit: state bytes per tensor shape
        return dict(param_shapes=param_shapes(spec))
    return dict(n_tensors=n_tensors)


def _per_device(tr: Any, ratios: dict[str, tuple[int, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """The per-device figures and module table of a traced step whose model states shrink by `ratios`."""
    per = _shard(tr.breakdown(), ratios)
    if tr.module_categories:
        modules = {name: _shard(cats, ratios) for name, cats in tr.module_categories.items()}
        for cats in modules.values():  # a module's moment may be the higher one once model states shrink
            if cats["total"] > per["total"]:
                per = cats
        return per, dict(sorted(((name, cats["total"]) for name, cats in modules.items()), key=lambda kv: -kv[1]))
    # Composed: per-block peaks traced unsharded; weights and optimizer state shrink alike.
    shrink = (tr.params - per["params"]) + (tr.optimizer - per["optimizer"])
    modules = {k: min(v - shrink, per["total"]) for k, v in tr.modules.items()}
    return per, dict(sorted(modules.items(), key=lambda kv: -kv[1]))


def _shard(cats: dict[str, int], ratios: dict[str, tuple[int, int]]) -> dict[str, int]:
    """One traced moment on one device: each model-state category times sharded/unsharded bytes."""
    out = {}
    for cat in CATEGORIES:
        mine, full = ratios.get(cat, (1, 1))
        out[cat] = round(cats[cat] * mine / full) if full else cats[cat]
    out["total"] = sum(out.values())
    return out
