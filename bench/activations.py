"""What does each activation policy save, and what does it cost?

    .venv/bin/python bench/activations.py            # full size: GPT-2 small's shape (~30 min on 2 idle cores)
    .venv/bin/python bench/activations.py --quick    # small shapes (~20 min on 2 busy cores)

Per model: every memfit policy, plain PyTorch `torch.utils.checkpoint` on every block (what Hugging
Face's gradient checkpointing does) and `torch.autograd.graph.save_on_cpu`. For each contender:

- block activations: device bytes the repeated blocks keep alive from their forward to backward
  (memfit's tracker, read just before the first block and just after the last one, minus the last
  block's output);
- peak: the tracker's peak over one training step (forward, backward, SGD update), and the
  prediction of that peak by `memfit.measure.trace.trace_step` (FakeTensorMode, nothing allocated);
- peak RSS growth over that step, the physical figure (memory is measured in a fresh process per
  contender, so one contender's freed memory held by the C allocator never lowers another's);
- forward+backward time, side by side in one process on one model instance (bench/common.py:
  shuffled order each round, >= 5 rounds, median and spread, load average), as wall time and as CPU
  time of the process (all threads), which other processes on a shared machine disturb less.

Plus: the int8 gradient error and the default `memfit train` run's final loss with and without int8
compression; disk throughput reached by the spill threads next to the disk's raw throughput.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.checkpoint import checkpoint as torch_checkpoint  # noqa: E402

import memfit  # noqa: E402
from common import PeakRSS, fmt_bytes, interleaved, run_fresh, save  # noqa: E402
from memfit.apply.checkpoint import applied, find_blocks, remove  # noqa: E402
from memfit.apply.optimizer import TrainingOptimizer  # noqa: E402
from memfit.core.tracker import MemoryTracker  # noqa: E402
from memfit.models.gpt import GPT, GPTConfig  # noqa: E402

NAME = "activations"
COMMAND = ".venv/bin/python bench/activations.py"

TORCH_CKPT, SAVE_ON_CPU = "torch checkpoint (every block)", "torch save_on_cpu"
MAIN = ["none", "full", "sqrt", "selective", "none+compress:int8", "none+offload:cpu", "full+offload:disk",
        "none+offload:disk", TORCH_CKPT, SAVE_ON_CPU]
UNTIMED = {"none+offload:disk"}  # memory and disk throughput only: it writes every saved tensor
HF = ["none", "full", "selective", "none+compress:int8", TORCH_CKPT, SAVE_ON_CPU]


# ---------------------------------------------------------------------------- models
def gpt2_small(quick: bool):
    cfg = GPTConfig(layers=4, hidden=256, heads=4, vocab=8192, seq=256) if quick else \
        GPTConfig(layers=12, hidden=768, heads=12, vocab=50257, seq=512)
    return lambda: GPT(cfg)


def hf_gpt2(quick: bool):
    import transformers

    kw = dict(n_layer=2, n_embd=256, n_head=4, vocab_size=8192, n_positions=256) if quick else \
        dict(n_layer=4, n_embd=768, n_head=12, vocab_size=50257, n_positions=512)

    def build():
        m = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(**kw, attn_implementation="sdpa"))
        m.config.use_cache = False  # a KV cache in training would cost memory in the baseline only
        return m

    return build


def hf_llama(quick: bool):
    import transformers

    kw = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=688, vocab_size=8192, max_position_embeddings=256) if quick else \
        dict(num_hidden_layers=4, hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=32000, max_position_embeddings=512)

    def build():
        m = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**kw, attn_implementation="sdpa"))
        m.config.use_cache = False
        return m

    return build


def seq_of(quick: bool) -> int:
    return 256 if quick else 512


def models(quick: bool) -> list:
    """(label, builder, contenders) per model, in the order of the tables."""
    if quick:
        return [
            ("memfit GPT (4 layers, d=256, 4 heads, vocab 8192)", gpt2_small(quick), MAIN),
            ("HF GPT-2 from config (2 layers, d=256, 4 heads, vocab 8192)", hf_gpt2(quick), HF),
            ("HF Llama from config (2 layers, d=256, 4 heads / 2 kv heads, ffn 688, vocab 8192)", hf_llama(quick), HF),
        ]
    return [
        ("GPT-2 small shape (memfit GPT: 12 layers, d=768, 12 heads, vocab 50257)", gpt2_small(quick), MAIN),
        ("HF GPT-2 from config (4 layers of GPT-2 small's shape)", hf_gpt2(quick), HF),
        ("HF Llama from config (4 layers, d=768, 12 heads / 4 kv heads, ffn 2048, vocab 32000)", hf_llama(quick), HF),
    ]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(model, GPT):
        _, loss_sum, n = model(x, x)
        return loss_sum / n
    return model(input_ids=x, labels=x).loss


def vocab_of(model: nn.Module) -> int:
    return model.cfg.vocab if isinstance(model, GPT) else model.config.vocab_size


# ---------------------------------------------------------------------------- contenders
def _wrap_torch_checkpoint(model: nn.Module) -> None:
    for block in find_blocks(model):
        fwd = type(block).forward.__get__(block)
        block.forward = lambda *a, _f=fwd, **k: torch_checkpoint(_f, *a, use_reentrant=False, **k)


def _unwrap_torch_checkpoint(model: nn.Module) -> None:
    for block in find_blocks(model):
        block.__dict__.pop("forward", None)


def apply(model: nn.Module, contender: str, spill_dir: str) -> contextlib.AbstractContextManager:
    """Set the model up for `contender`; returns the context each step runs in."""
    remove(model)
    _unwrap_torch_checkpoint(model)
    if contender == TORCH_CKPT:
        _wrap_torch_checkpoint(model)
        return contextlib.nullcontext()
    if contender == SAVE_ON_CPU:
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    memfit.checkpoint(model, contender, spill_dir=spill_dir)
    return contextlib.nullcontext()


def fwd_bwd(model: nn.Module, x: torch.Tensor, ctx) -> None:
    with ctx:
        loss = loss_of(model, x)
        loss.backward()
    model.zero_grad(set_to_none=True)


def measure_memory(model: nn.Module, contender: str, x: torch.Tensor, spill_dir: str) -> dict:
    """One training step (SGD) under the tracker, as trace_step(optimizer='sgd', steps=1) predicts it."""
    ctx = apply(model, contender, spill_dir)
    opt = TrainingOptimizer(model, "sgd", lr=1e-6)
    blocks = find_blocks(model)
    marks: dict[str, int] = {}
    with MemoryTracker(model, opt) as tr:
        hooks = [
            blocks[0].register_forward_pre_hook(lambda m, a: (marks.setdefault("start", tr.current_bytes), None)[1]),
            blocks[-1].register_forward_hook(lambda m, a, o: (marks.setdefault("end", tr.current_bytes),
                                                              marks.setdefault("out", _nbytes(o)), None)[2]),
        ]
        tr.reset_peak()
        with ctx:
            loss = loss_of(model, x)
            opt.backward(loss)
        opt.step()
    for h in hooks:
        h.remove()
    opt.close() if hasattr(opt, "close") else None
    # What the blocks keep for backward: the bytes they leave alive, minus their output (the model's
    # next input, alive under any policy).
    out = {"block_activations": marks["end"] - marks["start"] - marks["out"], "peak": tr.peak_bytes,
           "tracker_activations": tr.breakdown["activations"], "host_peak": tr.host_peak_bytes}
    state = applied(model) if contender not in (TORCH_CKPT, SAVE_ON_CPU) else None
    if state is not None and state.store is not None:
        s = state.store.stats
        out["offload"] = {"host_bytes": s.host_bytes, "spilled_bytes": s.spilled_bytes,
                          "write_seconds": s.write_seconds, "read_bytes": s.read_bytes,
                          "read_seconds": s.read_seconds, "files": s.files}
    return out


def _nbytes(o) -> int:
    t = o[0] if isinstance(o, (tuple, list)) else o
    return t.numel() * t.element_size()


def predict(build, contender: str, batch: int, seq: int) -> int | None:
    if contender in (TORCH_CKPT, SAVE_ON_CPU):
        return None
    from memfit.measure.trace import trace_step

    try:
        return trace_step(build, batch, seq, optimizer="sgd", checkpoint=contender, steps=1).peak
    except Exception as exc:  # report, do not hide: a policy the trace cannot follow
        print(f"  trace failed for {contender}: {type(exc).__name__}: {exc}")
        return None


def _trim() -> None:
    """Give freed heap memory back to the OS (glibc), so the next peak RSS starts from live bytes."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_worker(model_index: int, contender: str, quick: bool, spill_dir: str) -> dict:
    """In a fresh process: the tracker's figures and the growth of peak RSS over one training step
    (from after the model and batch exist). contender "ALL" measures every contender of the model
    one after another, trimming the heap between them (quick mode: one process start per model)."""
    _, build, contenders = models(quick)[model_index]
    torch.manual_seed(0)
    model = build()
    model.train()
    x = torch.randint(0, vocab_of(model), (1, seq_of(quick)))
    out = {}
    for c in (contenders if contender == "ALL" else [contender]):
        measure_memory(model, c, x[:, :8], spill_dir)  # imports and one-time set-up, at a negligible size
        model.zero_grad(set_to_none=True)
        _trim()
        with PeakRSS() as r:
            out[c] = measure_memory(model, c, x, spill_dir)
        model.zero_grad(set_to_none=True)
        out[c]["rss_growth"], out[c]["rss_reset"] = r.growth, r.reset
    remove(model)
    _unwrap_torch_checkpoint(model)
    return out if contender == "ALL" else out[contender]


def bench_model(index: int, quick: bool, rounds: int, spill_dir: str) -> dict:
    label, build, contenders = models(quick)[index]
    seq = seq_of(quick)
    print(f"== {label}: batch 1 x seq {seq}", flush=True)
    rows = {c: {"contender": c} for c in contenders}
    common = ["--spill-dir", spill_dir, "--threads", str(torch.get_num_threads())] + (["--quick"] if quick else [])
    if quick:  # one process for the model's contenders, no predictions: the quick run's time goes to timing
        t0 = time.perf_counter()
        got = run_fresh(Path(__file__), ["--worker-mem", str(index), "ALL"] + common)
        if "error" in got:
            raise RuntimeError(f"{label}: {got['error']}")
        for c in contenders:
            rows[c].update(got[c], predicted_peak=None)
        print(f"  memory of {len(contenders)} contenders in {time.perf_counter() - t0:.0f} s", flush=True)
    for c in contenders if not quick else []:
        t0 = time.perf_counter()
        rows[c].update(run_fresh(Path(__file__), ["--worker-mem", str(index), c] + common))
        if "error" in rows[c]:
            raise RuntimeError(f"{label} / {c}: {rows[c]['error']}")
        rows[c]["predicted_peak"] = predict(build, c, 1, seq)
        print(f"  {c:32s} blocks {fmt_bytes(rows[c]['block_activations']):>10}  peak {fmt_bytes(rows[c]['peak']):>10}"
              f"  RSS +{fmt_bytes(rows[c]['rss_growth']):>10}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    torch.manual_seed(0)
    model = build()
    model.train()
    n_blocks = len(find_blocks(model))
    x = torch.randint(0, vocab_of(model), (1, seq))
    timed = [c for c in contenders if c not in UNTIMED]
    ctx: dict[str, object] = {}
    timing = interleaved({c: (lambda c=c: fwd_bwd(model, x, ctx[c])) for c in timed}, rounds=rounds,
                         setup=lambda c: ctx.__setitem__(c, apply(model, c, spill_dir)))
    remove(model)
    _unwrap_torch_checkpoint(model)
    return {"model": label, "batch": 1, "seq": seq, "blocks": n_blocks, "rows": list(rows.values()), "timing": timing}


# ---------------------------------------------------------------------------- int8 quality
def int8_grad_error(build, batch: int, seq: int) -> dict:
    """Relative gradient error of compressed saved activations against exact ones (same weights, same batch)."""
    torch.manual_seed(0)
    model = build()
    x = torch.randint(0, vocab_of(model), (batch, seq))
    out = {}
    ref = None
    for policy in ("none", "none+compress:int8", "none+compress:int8-channel", "none+compress:fp8", "none+compress:bf16"):
        memfit.checkpoint(model, policy)
        loss_of(model, x).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        if ref is None:
            ref = grads
            continue
        out[policy.split(":")[1]] = ((grads - ref).norm() / ref.norm()).item()
    remove(model)
    return out


def default_training_loss(quick: bool, out_dir: str) -> dict:
    """The default `memfit train` run (fixed number of steps, same seed) with and without int8 compression."""
    from memfit.train.loop import TrainConfig, train

    steps = 20 if quick else 60
    res = {}
    for policy in ("none", "none+compress:int8"):
        cfg = TrainConfig(steps=steps, checkpoint=policy, track=False, eval_every=0, save_every=0, seed=0,
                          out=os.path.join(out_dir, policy.replace(":", "_").replace("+", "_")))
        t0 = time.perf_counter()
        result = train(cfg, progress=False, log=lambda *a: None)
        val = result.metrics["val"]["loss"]
        res[policy] = {"final_val_loss": val[-1], "final_train_loss": result.metrics["steps"]["loss"][-1],
                       "seconds": time.perf_counter() - t0}
        print(f"  train {policy}: final val loss {val[-1]:.4f} ({res[policy]['seconds']:.0f} s)")
    a, b = res["none"]["final_val_loss"], res["none+compress:int8"]["final_val_loss"]
    return {"steps": steps, "runs": res, "rel_diff": abs(b - a) / a}


# ---------------------------------------------------------------------------- raw disk
def raw_disk(folder: str, mib: int) -> dict:
    """Sequential write (buffered, then fsync'd) and read (page cache dropped) of one file in `folder`."""
    chunk = os.urandom(8 * 2**20)
    path = os.path.join(tempfile.mkdtemp(prefix="memfit-rawdisk-", dir=folder), "probe.bin")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        t0 = time.perf_counter()
        for _ in range(mib // 8):
            os.write(fd, chunk)
        buffered = time.perf_counter() - t0
        os.fsync(fd)
        synced = time.perf_counter() - t0
        os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the device, not the page cache
        t0 = time.perf_counter()
        while os.read(fd, 8 * 2**20):
            pass
        read = time.perf_counter() - t0
        os.close(fd)
    finally:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
    nbytes = mib * 2**20
    return {"mib": mib, "write_buffered_Bps": nbytes / buffered, "write_fsync_Bps": nbytes / synced,
            "read_uncached_Bps": nbytes / read}


# ---------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small shapes (4-layer d=256 GPT, 2-layer d=256 HF models, seq 256): ~20 min on a busy 2-core machine")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds per model (at least 5)")
    ap.add_argument("--spill-dir", default=tempfile.gettempdir())
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1: on a shared machine, OpenMP threads that lose their core stall)")
    ap.add_argument("--worker-mem", nargs=2, metavar=("MODEL", "CONTENDER"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker_mem:
        res = memory_worker(int(args.worker_mem[0]), args.worker_mem[1], args.quick, args.spill_dir)
        Path(args.out).write_text(json.dumps(res))
        return
    results = [bench_model(i, args.quick, args.rounds, args.spill_dir) for i in range(len(models(args.quick)))]
    seq = seq_of(args.quick)
    print("== int8 gradient error (first model, one batch)")
    grad_err = int8_grad_error(gpt2_small(args.quick), 1, seq)
    print("  ", grad_err)
    print("== default training run with and without int8")
    with tempfile.TemporaryDirectory() as out_dir:
        loss = default_training_loss(args.quick, out_dir)
    print("== raw disk throughput")
    disk = raw_disk(args.spill_dir, 64 if args.quick else 512)
    print("  ", {k: (f"{v / 2**20:.0f} MiB/s" if k.endswith("Bps") else v) for k, v in disk.items()})
    payload = {"command": COMMAND + (" --quick" if args.quick else ""), "quick": args.quick, "rounds": args.rounds,
               "spill_dir": args.spill_dir, "threads": args.threads, "models": results, "grad_error": grad_err, "train_loss": loss,
               "raw_disk": disk}
    path = save(NAME, payload)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------- render
def render(result: dict) -> str:
    from activations_render import render as _render

    return _render(result)


if __name__ == "__main__":
    main()
