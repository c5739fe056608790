"""Where the time of one activation-offload step goes on CUDA: the profiler's copy kinds.

    PYTHONPATH=src python3 bench/gpu_offload_profile.py [--batch 8]

memfit's GPT (16 x 2048, the model of bench/gpu_offload.py) in bf16 autocast, every block's saved
tensors offloaded to pinned CPU memory (`none+offload:cpu`). Prints forward and backward seconds
against keeping the activations, then the profiler's rows for one step: a "Memcpy DtoH (Device ->
Pageable)" row means some saved tensors went through pageable memory (synchronous, slow), which is
what memfit's flat pinned copies (memfit.apply.saved_copies.to_pinned) avoid.
"""
from __future__ import annotations

import argparse
import time

import torch

import memfit
from memfit.models.gpt import GPT, GPTConfig


def step(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss, n = model(x, x)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    (loss / n).backward()
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    cfg = GPTConfig(layers=16, hidden=2048, heads=16, vocab=32768, seq=1024, dropout=0.0)
    x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device="cuda")
    for policy in ("none", "none+offload:cpu"):
        torch.manual_seed(0)
        model = GPT(cfg).cuda()
        memfit.checkpoint(model, policy)
        for _ in range(3):
            step(model, x)
        times = [step(model, x) for _ in range(3)]
        print(policy, "forward / backward s:", [(round(f, 3), round(b, 3)) for f, b in times], flush=True)
        if policy != "none":
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(model, x)
            rows = [e for e in prof.key_averages() if e.key.startswith("Memcpy") or e.key == "cudaMemcpyAsync"]
            for e in rows:
                print(f"  {e.key:40s} calls {e.count:5d}  device {e.device_time_total / 1e3:9.1f} ms  "
                      f"host {e.self_cpu_time_total / 1e3:9.1f} ms")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
