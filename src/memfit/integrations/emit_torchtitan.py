"""A memfit plan as a torchtitan job config: the train-config TOML that torchtitan's ConfigManager loads
with `--job.config_file` (its JobConfig layout through 0.2; memfit's `estimate --torchtitan` reads it too).

What it carries: data parallelism (ddp: data_parallel_replicate_degree; zero3: FSDP2 over
data_parallel_shard_degree; zero1/zero2: FSDP2 with fsdp_reshard_after_forward = "never"),
tensor_parallel_degree, pipeline_parallel_degree with its schedule and micro-batch size,
local/global batch (the global batch larger than local x data-parallel ranks is torchtitan's gradient
accumulation), seq_len, FSDP's mixed precision, optimizer offload (enable_cpu_offload: FSDP2's
CPUOffloadPolicy), activation checkpointing (none, full, selective "op", or every N-th block).

torchtitan 0.3 configures jobs in Python (`--module llama3 --config NAME` plus `--section.key value`
flags); the same training and parallelism settings are printed as those flags.
"""
from __future__ import annotations

from memfit.integrations.emit_plan import Emitted, PlanView, block_list, common_unexpressed

# memfit names -> torchtitan llama3 flavors (memfit.integrations.torchtitan.FLAVORS are the same shapes)
_FLAVORS = {"llama-3-8b": "8B", "llama-3.1-8b": "8B", "llama-3-70b": "70B", "llama-3.1-70b": "70B",
            "llama-3.1-405b": "405B"}
_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B", "interleaved1f1b": "Interleaved1F1B"}


def _data_parallel(view: PlanView, missing: list[str]) -> tuple[int, int, str]:
    """(replicate, shard, fsdp_reshard_after_forward)."""
    if view.dp == 1:
        return 1, 1, "default"
    if view.strategy == "ddp":
        return view.dp, 1, "default"
    if view.zero == 3:
        return 1, view.dp, "default"
    if view.zero in (1, 2):
        missing.append(f"zero{view.zero}: torchtitan shards with FSDP2 only; emitted as FSDP2 without resharding "
                       "after forward (whole weights from forward to backward as in ZeRO-1/2, gradients and "
                       "optimizer state sharded: no more memory than the plan, one all-gather more per step)")
        return 1, view.dp, "never"
    missing.append(f"{view.strategy} with {view.dp} data-parallel replicas: torchtitan runs DDP only without tensor "
                   "or pipeline parallelism; emitted as FSDP2 over the replicas (less memory than the plan)")
    return 1, view.dp, "never"


def _checkpoint(view: PlanView, missing: list[str]) -> dict:
    n, r = len(view.actions), view.recomputed
    kind = view.checkpoint
    if kind in ("none", "full"):
        return {"mode": kind}
    if kind == "selective":
        if any(a.ops != "torchtitan" for a in view.actions):
            missing.append("memfit's selective policy: emitted as torchtitan's op-level selective AC, which keeps "
                           "other ops (memfit's `selective:torchtitan` estimates that one)")
        return {"mode": "selective", "selective_ac_option": "op"}
    every = max(1, n // r)
    missing.append(f"per-block checkpointing: the plan recomputes blocks {block_list(view)} ({r} of {n}); "
                   + ("torchtitan recomputes every block (full)" if every == 1 else
                      f"torchtitan's every-{every}th block recomputes {n // every} of {n}")
                   + ("; selective blocks recompute whole" if any(a.mode == "selective" for a in view.actions)
                      else ""))
    return {"mode": "full"} if every == 1 else {"mode": "selective", "selective_ac_option": str(every)}


def tables_of(view: PlanView) -> tuple[dict, list[str]]:
    """({table: {key: value}}, what of the plan the job config cannot carry)."""
    missing = common_unexpressed(view, "torchtitan")
    replicate, shard, reshard = _data_parallel(view, missing)
    local = view.micro_batch * view.accumulation if view.pp > 1 else view.micro_batch
    training = {"local_batch_size": local, "global_batch_size": local * replicate * shard
                * (1 if view.pp > 1 else view.accumulation), "seq_len": view.seq or 2048}
    p = view.precision
    training["mixed_precision_param"] = "float32" if p == "32-true" else "bfloat16"
    training["mixed_precision_reduce"] = "float32"
    if p.startswith("16-") or p.startswith("fp16"):
        missing.append(f"{p}: torchtitan's mixed precision is bf16 or fp32; emitted as bfloat16")
    if view.offload_optimizer:
        training["enable_cpu_offload"] = True
        missing.append("optimizer offload: torchtitan's enable_cpu_offload (FSDP2's CPUOffloadPolicy) moves the "
                       "parameters and gradients to host memory too" + ("; to host memory, not disk"
                                                                        if view.offload_optimizer == "disk" else ""))
    par: dict = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
                 "fsdp_reshard_after_forward": reshard, "tensor_parallel_degree": view.tp,
                 "pipeline_parallel_degree": view.pp, "context_parallel_degree": 1}
    if view.pp > 1:
        par["pipeline_parallel_schedule"] = _SCHEDULES.get(view.schedule.lower(), view.schedule)
        par["pipeline_parallel_microbatch_size"] = view.micro_batch
        if view.schedule.lower().startswith("interleaved"):  # memfit's even cut: V stages per rank, no
            # lighter first or last stage (torchtitan's default takes a block off each for the embeddings and head)
            par["pipeline_parallel_layers_per_stage"] = len(view.actions) // (view.pp * view.virtual_stages)
            par["pipeline_parallel_first_stage_less_layers"] = par["pipeline_parallel_last_stage_less_layers"] = 0
    model = {"name": "llama3", "flavor": _FLAVORS.get(view.model.lower(), "debugmodel")}
    if view.model.lower() not in _FLAVORS:
        missing.append(f"model {view.model}: torchtitan builds its own registered models; [model] is llama3 "
                       "debugmodel, a placeholder: name yours (a registered model with the same shapes)")
    opt = {"adamw": "AdamW", "adam": "Adam"}.get(view.optimizer)
    if opt is None:
        missing.append(f"optimizer {view.optimizer}: torchtitan builds AdamW or Adam; emitted as AdamW")
    tables = {"job": {"description": f"memfit plan for {view.model}"}, "model": model,
              "optimizer": {"name": opt or "AdamW"}, "training": training, "parallelism": par,
              "activation_checkpoint": _checkpoint(view, missing)}
    return tables, missing


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(v)


def to_toml(tables: dict) -> str:
    out = []
    for name, table in tables.items():
        out.append(f"[{name}]")
        out += [f"{k} = {_value(v)}" for k, v in table.items()]
        out.append("")
    return "\n".join(out)


def emit(view: PlanView) -> Emitted:
    tables, missing = tables_of(view)
    flags = " ".join(f"--{t}.{k} {v if not isinstance(v, bool) else str(v).lower()}"
                     for t in ("training", "parallelism") for k, v in tables[t].items())
    return Emitted("# torchtitan job config written by `memfit plan --emit torchtitan`\n" + to_toml(tables), ".toml",
                   missing, extra=[f"launch: torchrun --nproc-per-node {view.world} -m torchtitan.train "
                                   "--job.config_file JOB.toml",
                                   f"torchtitan 0.3 (Python configs): --module llama3 --config NAME {flags}"])
