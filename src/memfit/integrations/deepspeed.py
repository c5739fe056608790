"""A DeepSpeed ZeRO config (its JSON) estimated per rank with memfit's ZeRO-1/2/3 per-rank figures.

    read_config("ds_config.json")                                   # DeepSpeedJob: what was read
    est = estimate_config("ds_config.json", "gpt2", world=8)       # memfit.estimate of that job's ranks
    memfit estimate --deepspeed ds_config.json gpt2 --world 8 --seq 1024

What is read (DeepSpeed is not needed: the JSON, with DeepSpeed's own defaults for what is absent):

- zero_optimization.stage (0: DDP on several ranks), offload_optimizer.device (cpu; nvme: memfit's disk);
  offload_param is refused (memfit estimates no parameter offload);
- bf16.enabled: 16-bit weights with fp32 master weights in the optimizer (memfit's bf16-master);
  fp16.enabled likewise (16-master); torch_autocast (bfloat16 or float16 over fp32 weights:
  bf16-mixed, 16-mixed); none of them: 32-true;
- train_micro_batch_size_per_gpu (else train_batch_size / (accumulation x world)) and
  gradient_accumulation_steps;
- optimizer.type (Adam, AdamW, SGD, Lion, Adagrad; else --optimizer);
- activation_checkpointing: the section configures deepspeed.checkpointing.checkpoint, which the
  model calls per block; with the section present the estimate recomputes every block (full) unless
  --checkpoint says otherwise.

Stages 1 and 2 add DeepSpeed's own buffers to memfit's per-rank figures (_buffers: its gradient bucket and
the fp32 copy of the partition when the weights are fp32); stage 3 turns memfit's ZeRO-3 rows into
DeepSpeed's (_zero3, with memfit.integrations.deepspeed_zero3: its gradient partition buffer, IPG bucket,
fp32 partition copy, and the weights its reuse-distance and prefetch rules hold whole).
Tensor parallelism (tensor_parallel.autotp_size > 1) and pipeline stages are refused: estimate them
with --strategy tensor / pipeline.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from memfit.core.errors import ConfigError
from memfit.integrations.deepspeed_zero3 import Zero3Settings, read_zero3

_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "lion": "lion", "adagrad": "adagrad",
               "fusedadam": "adamw", "cpuadam": "adamw", "deepspeedcpuadam": "adamw"}


@dataclass
class DeepSpeedJob:
    path: str
    stage: int
    precision: str
    micro_batch: int
    accumulation: int
    offload_optimizer: str | None
    optimizer: str | None
    checkpointing: bool
    bucket: int = int(5e8)
    """zero_optimization.reduce_bucket_size (elements), DeepSpeed's default 5e8."""
    contiguous: bool = True
    """zero_optimization.contiguous_gradients (default true): the bucket is allocated whole."""
    overlap: bool = False
    """zero_optimization.overlap_comm (stage 1/2 default false): a second bucket."""
    zero3: Zero3Settings | None = None
    """Stage 3's settings (memfit.integrations.deepspeed_zero3)."""


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed {path}: no such file; give a DeepSpeed config JSON") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--deepspeed {path} is not a JSON file ({type(exc).__name__}: {exc}); give a DeepSpeed "
                          "config (ds_config.json)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed {path}: expected a JSON object (DeepSpeed's config), got {type(data).__name__}")
    return data


def _section(path: str, cfg: dict, key: str) -> dict:
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"--deepspeed {path}: {key} must be an object, got {value!r}")
    return value


def _int(path: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"--deepspeed {path}: {key} = {value!r} must be an integer >= 1 (memfit does not read "
                          "DeepSpeed's \"auto\": give the number)")
    return value


def _precision(path: str, cfg: dict) -> str:
    on = {k: bool(_section(path, cfg, k).get("enabled", False)) for k in ("bf16", "fp16", "torch_autocast")}
    if on["bf16"] and on["fp16"]:
        raise ConfigError(f"--deepspeed {path}: bf16 and fp16 both enabled; DeepSpeed takes one")
    if on["bf16"]:
        return "bf16-master"
    if on["fp16"]:
        return "16-master"
    if on["torch_autocast"]:
        dtype = str(_section(path, cfg, "torch_autocast").get("dtype", "bfloat16")).replace("torch.", "")
        return "16-mixed" if dtype in ("float16", "fp16", "half") else "bf16-mixed"
    return "32-true"


def read_config(path: str, world: int = 1) -> DeepSpeedJob:
    cfg = _load(path)
    zero = _section(path, cfg, "zero_optimization")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"--deepspeed {path}: zero_optimization.stage = {stage!r}; DeepSpeed's stages are 0-3")
    if (_section(path, zero, "offload_param").get("device") or "none") != "none":
        raise ConfigError(f"--deepspeed {path}: offload_param (ZeRO-3 parameter offload) is not estimated by memfit; "
                          "remove it to estimate the rest")
    if int(_section(path, cfg, "tensor_parallel").get("autotp_size", 0) or 0) > 1 or "pipeline" in cfg:
        raise ConfigError(f"--deepspeed {path}: tensor_parallel / pipeline sections are not read; estimate those "
                          "layouts with --strategy tensor or --strategy pipeline")
    device = _section(path, zero, "offload_optimizer").get("device") or "none"
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"--deepspeed {path}: offload_optimizer.device = {device!r}; accepted: none, cpu, nvme")
    accum = _int(path, "gradient_accumulation_steps", cfg.get("gradient_accumulation_steps", 1))
    if "train_micro_batch_size_per_gpu" in cfg:
        micro = _int(path, "train_micro_batch_size_per_gpu", cfg["train_micro_batch_size_per_gpu"])
    elif "train_batch_size" in cfg:
        total = _int(path, "train_batch_size", cfg["train_batch_size"])
        if total % (accum * world):
            raise ConfigError(f"--deepspeed {path}: train_batch_size {total} is not gradient_accumulation_steps "
                              f"{accum} x --world {world} x a micro-batch")
        micro = total // (accum * world)
    else:
        micro = 1
    kind = str(_section(path, cfg, "optimizer").get("type", "")).lower()
    bucket = zero.get("reduce_bucket_size", int(5e8))
    if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or bucket < 1:
        raise ConfigError(f"--deepspeed {path}: reduce_bucket_size = {bucket!r} must be a number of elements >= 1")
    return DeepSpeedJob(path=path, stage=stage, precision=_precision(path, cfg), micro_batch=micro,
                        accumulation=accum, offload_optimizer={"none": None, "cpu": "cpu", "nvme": "disk"}[device],
                        optimizer=_OPTIMIZERS.get(kind), checkpointing="activation_checkpointing" in cfg,
                        bucket=int(bucket), contiguous=bool(zero.get("contiguous_gradients", True)),
                        overlap=bool(zero.get("overlap_comm", stage == 3)),
                        zero3=read_zero3(path, zero, _section(path, cfg, "data_types")) if stage == 3 else None)


def _buffers(est: Any, job: DeepSpeedJob, world: int) -> str:
    """DeepSpeed ZeRO-1/2's own device buffers beside memfit's figures (deepspeed/runtime/zero/stage_1_and_2.py):
    the gradient bucket (reduce_bucket_size elements, allocated whole with contiguous_gradients, twice with
    overlap_comm; fp32 under ZeRO-1 or fp32 gradients, else 16-bit) and, when the weights are fp32, the
    fp32 copy of the rank's partition the optimizer steps (16-bit weights: that copy is the master weights
    memfit already counts; offloaded: it lives in host memory). ZeRO-3's are not modelled."""
    from memfit.measure.rank_estimate import per_device

    if job.stage not in (1, 2):
        return ""
    fp32_weights = job.precision in ("32-true", "bf16-mixed", "16-mixed")
    grad_bytes = 4 if (job.stage == 1 or fp32_weights) else 2
    bucket = job.bucket * grad_bytes * (2 if job.overlap else 1) if job.contiguous else 0
    copy = -(-est.n_params // world) * 4 if fp32_weights and not job.offload_optimizer else 0
    rows = est.ranks or []
    for row in rows:
        row["in_flight"] += bucket
        row["optimizer"] += copy
        row["total"] += bucket + copy
    if rows:
        est.per_device = per_device(max(rows, key=lambda r: r["total"]))
    else:
        est.per_device["grads"] += bucket
        est.per_device["optimizer"] += copy
        est.per_device["total"] += bucket + copy
    return (f"DeepSpeed's buffers added: gradient bucket {bucket:,} B (reduce_bucket_size {job.bucket:,} elements)"
            + (f", fp32 copy of the partition {copy:,} B" if copy else ""))


def _zero3(est: Any, job: DeepSpeedJob, world: int, model: Any) -> str:
    """memfit's ZeRO-3 rank rows turned into DeepSpeed's (memfit.integrations.deepspeed_zero3). Forward and
    backward: the weights DeepSpeed holds whole at forward's end replace memfit's two gathered blocks, so
    the peak is the one-device moment with the most activations and temporaries (memfit's ZeRO-3 row may
    pick a lower one where it gathers less); its gradient partition buffer (allocated whole for good)
    replaces the slices reduced so far (DeepSpeed copies each gradient into the bucket as backward makes
    it), the IPG bucket joins the gradients in flight and an fp32 weights' partition copy the optimizer.
    The step (no activations: persistent weights whole, the flat fp32 gradient of the largest sub-group)
    may be higher."""
    from memfit.integrations.deepspeed_zero3 import (gathered_numel, module_params, partitions, persistent,
                                                     zero3_buffers)
    from memfit.measure.rank_estimate import per_device
    from memfit.models.spec import parse_model

    s = job.zero3 or Zero3Settings()
    if hasattr(model, "named_parameters"):  # a module: its own weights (only their shapes are read)
        meta = model
    else:
        meta = (parse_model(model, families=True) if isinstance(model, str) else model).on_meta(est.seq)
    numels = [(id(p), p.numel()) for p in meta.parameters()]
    w = 2 if job.precision in ("bf16-master", "16-master") else 4
    parts = partitions([n for _, n in numels], world)
    keep = persistent(numels, s)
    buf = zero3_buffers(s, parts, w, w == 4, bool(job.offload_optimizer))
    whole = w * gathered_numel(module_params(meta), s, keep)
    full = w * sum(n for _, n in numels)  # one process's gradients: a moment with them all is the step
    live = [(m["activations"], m["temporaries"]) for m in (est.moments or {}).values() if m["grads"] < full]
    rows = est.ranks or [dict(est.per_device, gathered=0, in_flight=0)]
    for row in rows:
        act, tmp = max([(row["activations"], row["temporaries"]), *live], key=sum)
        held = dict(params=w * sum(parts), grads=buf["grads"], optimizer=row["optimizer"] + buf["copy"])
        step = dict(held, gathered=w * sum(n for pid, n in numels if pid in keep), in_flight=buf["bucket"],
                    activations=0, temporaries=buf["step"])
        moving = dict(held, gathered=whole, in_flight=row["in_flight"] + buf["bucket"],
                      activations=act, temporaries=tmp)
        top = max((moving, step) if row["activations"] else (step,), key=lambda m: sum(m.values()))
        row.update(top, total=sum(top.values()))
    est.per_device = per_device(max(rows, key=lambda r: r["total"]))
    return (f"DeepSpeed ZeRO-3's buffers: gradient partition {buf['grads']:,} B, IPG bucket {buf['bucket']:,} B "
            f"(reduce_bucket_size {s.reduce_bucket:,})" + (f", fp32 partition copy {buf['copy']:,} B" if buf["copy"]
                                                           else "")
            + f"; whole weights held at forward's end {whole:,} B (stage3_max_reuse_distance {s.max_reuse:,}, "
            f"stage3_prefetch_bucket_size {s.prefetch_bucket:,}, {len(keep)} tensors under "
            f"stage3_param_persistence_threshold {s.persistence:,} kept whole)")


def describe(job: DeepSpeedJob, world: int, checkpoint: str) -> str:
    return (f"DeepSpeed config {job.path}: ZeRO stage {job.stage} on {world} rank(s), micro-batch "
            f"{job.micro_batch} x accumulation {job.accumulation}, {job.precision}"
            + (f", optimizer offloaded to {job.offload_optimizer}" if job.offload_optimizer else "")
            + f", checkpoint {checkpoint}"
            + (" (its activation_checkpointing section: every block, as deepspeed.checkpointing.checkpoint per "
               "block; --checkpoint to say otherwise)" if job.checkpointing and checkpoint == "full" else ""))


def estimate_config(path: str, model: Any, world: int = 1, *, checkpoint: str | None = None,
                    optimizer: str | None = None, **kw: Any):
    """memfit.estimate of the DeepSpeed job's ranks (`kw`: seq=, device=, device_memory=, ... passed through)."""
    from memfit.measure.estimate import estimate

    job = read_config(path, world)
    ckpt = checkpoint or ("full" if job.checkpointing else "none")
    strategy = f"zero{job.stage}" if job.stage else ("ddp" if world > 1 else None)
    zero_kw = {"strategy": strategy} if strategy else {}
    est = estimate(model, batch=job.micro_batch, accum=job.accumulation, precision=job.precision,
                   optimizer=job.optimizer or optimizer or "adamw", world=world, checkpoint=ckpt,
                   offload_optimizer=job.offload_optimizer, **zero_kw, **kw)
    added = _zero3(est, job, world, model) if job.stage == 3 else _buffers(est, job, world)
    est.note = "; ".join(x for x in (describe(job, world, ckpt), added, est.note) if x)
    return est


def bytes_per_rank(est: Any) -> int:
    """The largest rank's peak of an estimate (per-rank figures where there are ranks)."""
    return max((r["total"] for r in est.ranks), default=est.total) if getattr(est, "ranks", None) else est.total

