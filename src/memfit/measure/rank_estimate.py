"""Each rank's figures under a distributed strategy, and the one schema every estimate reports them in.

    rows = rank_rows(spec, one_device_estimate, "zero3", world=64)
    distinct(rows)  # [{"rank_ids": [0, ..., 63], "params": ..., ..., "total": ...}]

Data parallel (ddp, ps, zero1-3): model states from the strategy's shard layout
(memfit.distributed.rank_memory), activations and temporaries from the one-device trace of the
per-rank micro-batch, whole or composed (both name the bytes each block saves for backward). Model
parallel (pipeline, tensor): memfit.measure.parallel_estimate. Each row's categories are the ones
at that rank's peak moment: they add up to its total.
"""
from __future__ import annotations

from typing import Any

from memfit.core.errors import ConfigError
from memfit.distributed.rank_memory import RANK_CATEGORIES

DATA_PARALLEL = ("ddp", "ps", "zero1", "zero2", "zero3")
MODEL_PARALLEL = ("pipeline", "tensor")


def strategy_of(strategy: str | None, zero: int, world: int) -> str | None:
    """The strategy an estimate's arguments name: `zero=Z, world=N` is `strategy="zeroZ"` (one
    computation for both spellings); a strategy with a contradicting zero stage is refused."""
    if strategy is None:
        return f"zero{zero}" if zero and world > 1 else None
    if strategy not in DATA_PARALLEL + MODEL_PARALLEL:
        raise ConfigError(f"unknown strategy {strategy!r}; accepted: {', '.join(DATA_PARALLEL + MODEL_PARALLEL)}")
    if zero and strategy != f"zero{zero}":
        raise ConfigError(f"zero={zero} contradicts strategy {strategy!r}; give one of them (zero={zero} is "
                          f"strategy 'zero{zero}')")
    return strategy


def rank_rows(spec: Any, one: Any, strategy: str, world: int, *, microbatches: int | None = None,
              schedule: str = "1f1b", tp: int | None = None, accum: int = 1,
              sequence_parallel: bool = False, vocab_parallel: bool = False, engine: str = "memfit",
              post_forward: int = 0, kept_whole: bool = False, pp: int | None = None,
              virtual_stages: int | None = None) -> list[dict]:
    """Every rank's row (see the module docstring); `one` is the one-device Estimate of the per-rank
    micro-batch (model states unsharded); `accum` micro-batches per step (the gradients of the earlier
    ones are held through the later ones); `sequence_parallel`, `vocab_parallel`: tensor only (estimated,
    not run); `engine`: who runs a data-parallel strategy (memfit.distributed.strategy.ENGINES; memfit's
    and FSDP2's are estimated alike, zero-redundancy by torch's assignment of whole tensors);
    `post_forward`, `kept_whole`: zero3 only, a block's bytes kept from its forward to its backward and
    whether that is the whole block (memfit.distributed.rank_memory; torch FSDP2's reshard_after_forward,
    memfit.measure.fsdp2_estimate); `pp`: pipeline on fsdp2 only, its stages (memfit.measure.mesh3d_estimate);
    `virtual_stages`: pipeline's interleaved schedule, stages per rank."""
    from memfit.distributed.rank_memory import rank_model_state, rank_totals

    from memfit.distributed.strategy import ENGINE_STRATEGIES, engine_strategies

    if engine != "memfit" and strategy not in ENGINE_STRATEGIES.get(engine, ()):
        raise ConfigError(f"engine {engine} carries out {engine_strategies(engine)}, not "
                          f"{strategy} (fsdp2 also --strategy tensor of a Hugging Face config: 2-D); leave out "
                          "--engine otherwise")
    if pp is not None and (strategy, engine) != ("pipeline", "fsdp2"):
        raise ConfigError("pp (pipeline stages) is the 3-D layout's: give --strategy pipeline --engine fsdp2")
    if virtual_stages not in (None, 1) and strategy != "pipeline":
        raise ConfigError(f"virtual stages are the pipeline's interleaved schedule's; they need --strategy pipeline "
                          f"--schedule interleaved, not {strategy}")
    if (sequence_parallel or vocab_parallel) and strategy != "tensor":
        raise ConfigError(f"sequence and vocabulary parallelism shard more of tensor parallelism's layout; they "
                          f"need --strategy tensor, not {strategy}")
    if strategy in MODEL_PARALLEL:
        from memfit.measure.parallel_estimate import pipeline_ranks, tensor_ranks

        if spec.config is None and spec.task not in (None, "causal-lm"):
            raise ConfigError(f"strategy {strategy} cuts a causal LM; this config is a {spec.task} model: use a "
                              "data-parallel strategy (ddp, zero1-3)")
        common = dict(precision=one.precision, optimizer=one.optimizer, checkpoint=one.checkpoint)
        if strategy == "pipeline" and engine == "fsdp2":  # 3-D: FSDP2 over dp x the tensor plan x stages
            from memfit.measure.mesh3d_estimate import mesh3d_ranks

            if virtual_stages not in (None, 1):
                raise ConfigError("the 3-D layout (--engine fsdp2) runs 1f1b or gpipe; --schedule interleaved runs "
                                  "on memfit's pipeline engine (--engine memfit)")
            rows = mesh3d_ranks(spec, one.batch, one.seq, world, pp, tp, microbatches, schedule, accum=accum, **common)
        elif strategy == "pipeline":
            rows = pipeline_ranks(spec, one.batch, one.seq, world, microbatches, schedule, accum=accum,
                                  virtual_stages=virtual_stages, **common)
        elif accum > 1:
            raise ConfigError("--accum with --strategy tensor is not estimated; estimate one micro-batch "
                              "(--accum 1) or use pipeline or a data-parallel strategy")
        else:
            rows = tensor_ranks(spec, one.batch, one.seq, world, tp, sequence_parallel=sequence_parallel,
                                vocab_parallel=vocab_parallel, **common)
    else:
        states = rank_model_state(spec.on_meta(one.seq), strategy, world, one.precision, one.optimizer,
                                  engine=engine)
        if post_forward:
            if strategy != "zero3":
                raise ConfigError(f"weights kept after forward are a zero3 layout's choice, not {strategy}'s")
            for row in states:
                row["post_forward"], row["kept_whole"] = post_forward, kept_whole
        rows = rank_totals(states, one.per_device, one.module_activations, one.batch * (one.seq or 1),
                           peak_block=_peak_block(one.modules), moments=one.moments, accum=accum)
    for r in rows:
        r.pop("embeddings", None)
        for k in ("rest", "one_block", "n_blocks", "blocks_n", "spare", "full_grads", "runs_as", "post_forward",
                  "kept_whole"):
            r.pop(k, None)
        r["total"] = sum(r[c] for c in RANK_CATEGORIES)
    return rows


def _peak_block(modules: dict[str, int]) -> int | None:
    """The repeated block the one-device peak is in (a block whose peak is the model's), else None."""
    from memfit.distributed.rank_memory import _BLOCK, _block_index

    if not modules:
        return -1
    top = max(modules.values())
    return next((_block_index(k) for k, v in modules.items() if v == top and _BLOCK.fullmatch(k)), None)


def distinct(rows: list[dict]) -> list[dict]:
    """One entry per distinct rank (equal figures), with the rank ids it covers, largest first."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = tuple((k, v) for k, v in r.items() if k != "rank" and not isinstance(v, (list, dict)))
        g = groups.get(key)
        if g is None:
            groups[key] = g = {"rank_ids": [], **{k: v for k, v in r.items() if k != "rank"}}
        g["rank_ids"].append(r["rank"])
    return sorted(groups.values(), key=lambda g: (-g["total"], g["rank_ids"][0]))


def per_device(row: dict) -> dict[str, int]:
    """A rank's row in the five categories of a one-device estimate (ZeRO-3's gathered weights are
    parameters; the gradient buckets in flight, gradients)."""
    out = {"params": row["params"] + row["gathered"], "grads": row["grads"] + row["in_flight"],
           "optimizer": row["optimizer"], "activations": row["activations"], "temporaries": row["temporaries"]}
    out["total"] = sum(out.values())
    return out


def with_ranks(one: Any, spec: Any, strategy: str, world: int, **kw: Any) -> Any:
    """The one-device Estimate `one` of the model `spec` turned into the strategy's: per_device the
    largest rank's figure, `ranks` each distinct rank, zero/world/strategy filled in."""
    if not one.traced:
        raise ConfigError(f"strategy {strategy} needs a model to trace (not a parameter count alone)")
    rows = rank_rows(spec, one, strategy, world, **kw)
    modules = [r.pop("modules", None) for r in rows]
    top = max(range(len(rows)), key=lambda i: rows[i]["total"])
    if modules[top]:  # data parallel: the module table of the largest rank
        one.modules = dict(sorted(modules[top].items(), key=lambda kv: -kv[1]))
    one.ranks = distinct(rows)
    top = one.ranks[0]
    one.per_device, one.strategy, one.world = per_device(top), strategy, world
    one.accum = kw.get("accum", 1)
    one.zero = int(strategy[-1]) if strategy.startswith("zero") else 0
    if strategy in ("tensor", "pipeline") and one.reserve_overhead is not None:
        # The caching allocator's reserve was replayed on the one-device step (the whole model's blocks at
        # the per-process batch); a TP rank (1/tp of each block, tp x the rows) or a pipeline stage (its
        # micro-batches in flight) allocates a different sequence, so that reserve is not this rank's:
        # none is predicted (docs/estimate.md, "References": torchtitan's Llama 70B FSDP x TP rows).
        # Data-parallel ranks run the one-device step itself, with their states sharded, and keep it.
        one.reserve_overhead = None
    return one


def with_accumulation(one: Any, spec: Any, accum: int) -> Any:
    """The one-device Estimate `one` of a micro-batch turned into the peak of a step of `accum`
    micro-batches: a later micro-batch runs beside the earlier ones' gradients (autograd accumulates
    in place), the moments of memfit.distributed.rank_memory.rank_totals on one process."""
    from memfit.distributed.rank_memory import rank_model_state, rank_totals

    if accum <= 1 or not one.traced:
        return one
    row = rank_model_state(spec.on_meta(one.seq), "ps", 1, one.precision, one.optimizer)[0]
    row.update(params=one.per_device["params"], optimizer=one.per_device["optimizer"])
    top = rank_totals([row], one.per_device, one.module_activations, one.batch * (one.seq or 1),
                      peak_block=_peak_block(one.modules), moments=one.moments, accum=accum)[0]
    if top["total"] > one.per_device["total"]:
        one.per_device = {c: top[c] for c in ("params", "grads", "optimizer", "activations", "temporaries")}
        one.per_device["total"] = sum(one.per_device.values())
    return one
