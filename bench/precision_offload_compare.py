"""Part 4 of bench/precision_offload.py: memfit against torch.amp and DeepSpeed ZeRO-Offload on CPU, side by
side under torchrun (world size 1, gloo, DS_ACCELERATOR=cpu), each memory figure from a fresh process."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import PeakRSS, interleaved  # noqa: E402
from precision_offload_setup import CMP_BATCH, CMP_REPEATS, CMP_SHAPE, THREADS, batch, memfit_step  # noqa: E402

from memfit.apply.optimizer import TrainingOptimizer  # noqa: E402
from memfit.core.tracker import track  # noqa: E402
from memfit.models.gpt import GPT, GPTConfig  # noqa: E402


def have_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


MEMFIT_OFFLOAD, MEMFIT_MIXED = "memfit bf16-master + cpu offload", "memfit bf16-mixed"
AMP_BF16, AMP_FP16 = "torch.amp bf16 autocast + AdamW", "torch.amp fp16 autocast + GradScaler + AdamW"
DEEPSPEED = "DeepSpeed ZeRO-2 + cpu offload (bf16)"
CONTENDERS = [MEMFIT_OFFLOAD, MEMFIT_MIXED, AMP_BF16, AMP_FP16, DEEPSPEED]


def _amp_step(model, opt, dtype: torch.dtype, scaler: torch.amp.GradScaler | None):
    def step(x, y):
        with torch.autocast("cpu", dtype=dtype):
            _, loss, n = model(x, y)
        if scaler is None:  # bf16: fp32's exponent range, nothing to scale
            (loss / n).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            scaler.scale(loss / n).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
    return step


def make_contender(name: str, layers: int | None = None):
    """(model, step function, optimizer object for the tracker, closer) for one contender."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CMP_SHAPE, "layers": layers or CMP_SHAPE["layers"]}))
    if name in (MEMFIT_OFFLOAD, MEMFIT_MIXED):
        opt = TrainingOptimizer(model, "adamw", lr=1e-3, precision=name.split()[1], clip=1.0,
                                offload="cpu" if name == MEMFIT_OFFLOAD else None)
        return model, lambda x, y: memfit_step(model, opt, x, y), opt, opt.close
    if name in (AMP_BF16, AMP_FP16):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu") if name == AMP_FP16 else None
        return model, _amp_step(model, opt, torch.bfloat16 if name == AMP_BF16 else torch.float16, scaler), opt, \
            lambda: None
    if name == DEEPSPEED:
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": CMP_BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
            "bf16": {"enabled": True}, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "steps_per_print": 10**9,
        }
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step(x, y):
            _, loss, n = engine(x, y)
            engine.backward(loss / n)
            engine.step()
        return engine, step, opt, lambda: None
    raise ValueError(name)


def worker_mem(name: str) -> dict:
    """Fresh process: growth of peak RSS over building the model and 3 steps (after a 1-layer warm-up
    run of the same contender pays the libraries' one-time set-up), and the tracker peak of the last 2."""
    x, y = batch(CMP_BATCH, CMP_SHAPE["seq"])
    if name != DEEPSPEED:  # DeepSpeed's engine is initialised once per process
        _, warm, _, wclose = make_contender(name, layers=1)
        warm(x, y)
        wclose()
        del warm, wclose
    with PeakRSS() as r:
        model, step, opt, close = make_contender(name)
        step(x, y)
        module = model.module if hasattr(model, "module") else model
        with track(module, opt) as t:
            for _ in range(2):
                step(x, y)
    close()
    return {"rss_growth": r.growth, "tracker_peak": t.peak_bytes, "tracker_host_peak": t.host_peak_bytes}


def worker_compare() -> dict:
    x, y = batch(CMP_BATCH, CMP_SHAPE["seq"])
    names = [n for n in CONTENDERS if n != DEEPSPEED or have_deepspeed()]
    runs, errors = {}, {}
    for name in names:
        try:
            model, step, _, close = make_contender(name)
            step(x, y)  # first step: creates the optimizer state
            runs[name] = {"step": step, "close": close}
        except Exception as e:  # a contender that cannot run here is reported, not fatal
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    timing = interleaved({n: (lambda r=r: r["step"](x, y)) for n, r in runs.items()}, rounds=CMP_REPEATS)
    for r in runs.values():
        r["close"]()
    return {"timing": timing, "errors": errors}


def _torchrun(args: list[str], port: int) -> dict:
    out = tempfile.mktemp(suffix=".json", prefix="memfit-bench-")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(THREADS))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=1", f"--master_port={port}", __file__, *args, "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480)
    try:
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"exit {proc.returncode}: " + " | ".join(tail)[:400]}
        return json.loads(Path(out).read_text())
    finally:
        if os.path.exists(out):
            os.unlink(out)


def compare() -> dict:
    notes = []
    if not have_deepspeed():
        notes.append("DeepSpeed is not installed: compared against torch.amp only.")
    result = _torchrun(["--worker", "compare"], 29611)
    mem = {}
    for i, name in enumerate(CONTENDERS):
        if name == DEEPSPEED and not have_deepspeed():
            continue
        mem[name] = _torchrun(["--worker", "mem", "--contender", name], 29612 + i)
        print(f"  {name}: {mem[name]}", flush=True)
    return {"model": CMP_SHAPE, "batch": CMP_BATCH, "params": GPT(GPTConfig(**CMP_SHAPE)).num_params(),
            "timing": result.get("timing"), "errors": result.get("errors", {"all": result.get("error")}),
            "memory": mem, "notes": notes}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["compare", "mem"], required=True)
    ap.add_argument("--contender")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(THREADS)
    res = worker_compare() if a.worker == "compare" else worker_mem(a.contender)
    Path(a.out).write_text(json.dumps(res))
