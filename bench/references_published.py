"""Published training runs that report their per-GPU peak with their whole configuration, estimated as
configured. Rows for bench/references.py (imported; never run alone):

    from references_published import published_rows, not_estimated
    rows = published_rows()      # [{name, reference, predicted, ratio, tolerance, note}, ...]

Each run is written as the torchtitan job file it ran (the file at the commit the page names, with the
page's overrides), and estimated through `memfit estimate --torchtitan` (memfit.integrations.torchtitan),
on the run's GPU where memfit.estimate takes device= (the predicted reserved peak, `per_device.reserved`,
when it reports one), else on this CPU's kernels (the allocated peak). torchtitan's "Memory(GiB)" is
torch.cuda.max_memory_reserved: the caching allocator's segments, above the allocated peak by its
rounding and fragmentation. Runs memfit does not model (torch.compile's fusions, float8 linears) keep
their rows with the reason in the note; runs the reader refuses (pipeline parallelism) are
listed by not_estimated().
"""
from __future__ import annotations

import inspect
import tempfile
from pathlib import Path

GIB = 2**30
MEASURED_TOLERANCE = 0.05  # the bound for measured references
TT_2024 = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
TT_TRAINY = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"

# train_configs/llama3_8b.toml at torchtitan 9dec370 (the commit the 2024-12 page names), local batch 2
LLAMA3_8B_2024 = """
[model]
name = "llama3"
flavor = "8B"
[optimizer]
name = "AdamW"
[training]
batch_size = 2
seq_len = 8192
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
compile = {compile}
[experimental]
context_parallel_degree = 1
pipeline_parallel_degree = 1
[activation_checkpoint]
mode = 'selective'
selective_ac_option = 'op'
[float8]
enable_float8_linear = {float8}
"""
# torchtitan/models/llama3/train_configs/llama3_8b.toml at e7c0cae, with the page's overrides
# (--training.local_batch_size=2 --training.compile --model.converters="float8")
LLAMA3_8B_TRAINY = """
[model]
name = "llama3"
flavor = "8B"
converters = ["float8"]
[optimizer]
name = "AdamW"
[training]
local_batch_size = 2
seq_len = 8192
compile = true
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""

# Table 2: llama3_8b.toml at 9dec370 with local batch 1, full AC, torch.compile and float8 linears
LLAMA3_8B_CP_2024 = """
[model]
name = "llama3"
flavor = "8B"
[optimizer]
name = "AdamW"
[training]
batch_size = 1
seq_len = {seq}
data_parallel_replicate_degree = 1
data_parallel_shard_degree = {shard}
tensor_parallel_degree = 1
compile = true
[experimental]
context_parallel_degree = {cp}
pipeline_parallel_degree = 1
[activation_checkpoint]
mode = 'full'
[float8]
enable_float8_linear = true
"""
CP_ROWS = [(8, 1, 32768, 83.9), (4, 2, 65536, 84.2), (2, 4, 131072, 84.0), (1, 8, 262144, 84.5)]

# (name, GiB published, job text, world, device, source, quoted configuration, why it may be off)
RUNS = [
    ("torchtitan Llama 3.1 8B, FSDP 8 x H100", 82.4, LLAMA3_8B_2024.format(compile="false", float8="false"), 8,
     "h100", TT_2024, "Table 1: 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch "
     "size 16. Selective activation checkpointing. (FSDP row)", ""),
    ("torchtitan Llama 3.1 8B, FSDP 128 x H100", 67.0, LLAMA3_8B_2024.format(compile="false", float8="false"), 128,
     "h100", TT_2024, "Table 3: 1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch size 2, global "
     "batch size 256. Selective activation checkpointing. (FSDP row)", ""),
    ("torchtitan Llama 3.1 8B, FSDP + compile 8 x H100", 77.0, LLAMA3_8B_2024.format(compile="true", float8="false"),
     8, "h100", TT_2024, "Table 1, FSDP + torch.compile row", "torch.compile fuses each block's element-wise ops "
     "and changes what it saves; memfit traces the eager step"),
    ("torchtitan Llama 3.1 8B, FSDP + compile 128 x H100", 62.0,
     LLAMA3_8B_2024.format(compile="true", float8="false"), 128, "h100", TT_2024,
     "Table 3, FSDP + torch.compile row", "torch.compile not modelled (the eager step is traced)"),
    ("torchtitan Llama 3.1 8B, FSDP + compile + float8 8 x H100", 76.8,
     LLAMA3_8B_2024.format(compile="true", float8="true"), 8, "h100", TT_2024,
     "Table 1, FSDP + torch.compile + Float8 row", "torch.compile and float8 linears not modelled"),
    ("torchtitan Llama 3.1 8B, FSDP + compile + float8 128 x H100", 61.8,
     LLAMA3_8B_2024.format(compile="true", float8="true"), 128, "h100", TT_2024,
     "Table 3, FSDP + torch.compile + Float8 row", "torch.compile and float8 linears not modelled"),
    ("Trainy Llama 3.1 8B, FSDP 32 x H200 (compile, float8)", 47.96, LLAMA3_8B_TRAINY, 32, "h200", TT_TRAINY,
     "NUM_NODES 4 x 8 H200, llama3_8b.toml with --training.local_batch_size=2 --training.compile "
     "--model.converters=float8 (FSDP float8 all-gather, fp8 weights recomputed in backward)",
     "torch.compile not modelled: at e7c0cae it compiles the loss too (torchtitan/components/loss.py), which "
     "then keeps no fp32 copy of the 16384 x 128256 logits (7.8 GiB each) that memfit's eager trace holds; "
     "float8 linears not modelled"),
    ("Trainy Llama 3.1 8B, FSDP 64 x H200 (compile, float8)", 46.97, LLAMA3_8B_TRAINY, 64, "h200", TT_TRAINY,
     "NUM_NODES 8 x 8 H200, the same job", "torch.compile (of the loss too) and float8 linears not modelled, "
     "as the row above"),
]

# Table 4: train_configs/llama3_70b.toml at 9dec370 (TP 8, full AC), local batch 16, compile and float8
LLAMA3_70B_2D_2024 = """
[model]
name = "llama3"
flavor = "70B"
[optimizer]
name = "AdamW"
[training]
batch_size = 16
seq_len = 8192
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
compile = true
[experimental]
context_parallel_degree = 1
pipeline_parallel_degree = 1
[activation_checkpoint]
mode = 'full'
[float8]
enable_float8_linear = true
"""
RUNS += [(f"torchtitan Llama 3.1 70B, FSDP 32 x TP 8 on 256 H100 (compile, float8{extra})", gib, LLAMA3_70B_2D_2024,
          256, "h100", TT_2024, f"Table 4: 2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. "
          f"256 GPUs (FSDP 32, TP 8). Local batch size 16, global batch size 512. Full activation checkpointing. "
          f"({row} row)", "no reserve predicted for a TP rank: the caching allocator's reserve memfit replays is the "
          "one-device step's (the whole model's blocks at the per-process batch, with all of its states), "
          "not a TP rank's, so the allocated peak is compared (memfit.measure.rank_estimate."
          "with_ranks); torch.compile, float8 linears and async TP not modelled; FSDP over each TP rank's model "
          "is memfit's approximation (memfit.integrations.torchtitan._fsdp_over_tp), and its sequence parallelism "
          "is Megatron-LM's (torch's keeps the all-gathered inputs of the column-parallel projections)")
         for extra, gib, row in (("", 71.9, "2D"), (", async TP", 67.6, "2D + AsyncTP"))]
RUNS += [(f"torchtitan Llama 3.1 8B, FSDP {shard} x CP {cp}, seq {seq}, 8 x H100 (compile, float8)", gib,
          LLAMA3_8B_CP_2024.format(seq=seq, shard=shard, cp=cp), 8, "h100", TT_2024,
          f"Table 2: FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local batch size 1. Full "
          f"activation checkpointing. (FSDP {shard}, CP {cp}, sequence length {seq})",
          "torch.compile and float8 linears not modelled; the ring's key/value chunks in flight not counted")
         for shard, cp, seq, gib in CP_ROWS]

NOT_ESTIMATED = [
    ("torchtitan Llama 3.1 405B, FSDP 8 x TP 8 x PP 8 on 512 H100 (Tables 5, 6)", TT_2024,
     "pipeline parallelism in torchtitan's schedules is not estimated by memfit's torchtitan reader"),
]


def _estimate(text: str, world: int, device: str) -> tuple[int, str]:
    """(predicted bytes, which figure): the reserved peak on the GPU where memfit predicts it."""
    import memfit
    from memfit.integrations.torchtitan import estimate_job

    kw = {"device": device} if "device" in inspect.signature(memfit.estimate).parameters else {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "job.toml"
        path.write_text(text)
        est = estimate_job(str(path), world, **kw)
    reserved = est.per_device.get("reserved")
    if reserved:
        return reserved, f"predicted max_memory_reserved on {device}"
    where = f"on {device}" if kw else "traced with this CPU's kernels (no GPU target in this memfit)"
    return est.per_device["total"], f"predicted allocated peak, {where}; the page reports max_memory_reserved"


def published_rows(runs=RUNS) -> list[dict]:
    rows, seen = [], {}
    for name, gib, text, world, device, source, quoted, why in runs:
        key = (text, world, device)
        if key not in seen:
            seen[key] = _estimate(text, world, device)
        predicted, figure = seen[key]
        reference = gib * GIB
        note = f"{source}; {quoted}; {figure}" + (f"; {why}" if why else "")
        rows.append({"name": name, "reference": reference, "predicted": predicted, "ratio": predicted / reference,
                     "tolerance": MEASURED_TOLERANCE, "note": note})
    return rows


def not_estimated() -> list[dict]:
    return [{"name": n, "source": s, "why": w} for n, s, w in NOT_ESTIMATED]


if __name__ == "__main__":
    import json

    print(json.dumps(published_rows(), indent=1))
