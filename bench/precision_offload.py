"""Precision and optimizer offload: how large a model trains under a fixed device budget, what CPU
and disk optimizer offload cost per step (and the disk throughput they reach), and memfit against
torch.amp and DeepSpeed ZeRO-Offload on CPU.

    .venv/bin/python bench/precision_offload.py

1. Largest model under a device budget. A GPT family (hidden 128, 2 heads, byte vocabulary, 8 x
   256 tokens per step) grown in layers; device bytes are the peak of memfit's tracker over two
   real training steps. Plain fp32 AdamW against memfit bf16-master + CPU optimizer offload + full
   activation checkpointing. The per-layer cost is fitted from 1 and 2 layers, then the largest
   fitting depth is confirmed by measuring it and the next depth (which must not fit).
2. Offload overhead. A 4-layer, hidden-256 GPT (3.3M parameters, 4 x 128 tokens), AdamW without
   clipping; in-memory, CPU and disk offload with the default 16 MiB chunks (one chunk here: it is
   updated after backward), with 4 MiB chunks updated during backward, and with the gradient files
   kept between steps (see OFFLOADS), in 32-true and bf16-master, alternating within each round
   after a warm-up; median step time. Disk throughput = spill bytes / seconds inside read and write calls, against
   a plain sequential write + read of the same number of bytes in the same folder, in the same
   rounds (both go through the page cache; neither fsyncs, spill files are scratch data).
3. Side by side (one torchrun process, world size 1, gloo, DS_ACCELERATOR=cpu): memfit bf16-master +
   CPU offload, torch.amp (bf16 autocast, GradScaler, AdamW) and DeepSpeed ZeRO-2 with the
   optimizer offloaded to the CPU (bf16, DeepSpeedCPUAdam), all with clipping at 1.0, same model
   and data, alternating. Peak memory per contender from a fresh process each: the growth of peak
   RSS over the process's size before the model is built, and memfit's tracker peak of
   device-resident bytes (offloaded copies excluded via mark_host).
Contenders that are not installed are skipped with a note. Every contender runs with one intra-op
thread (see THREADS).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import fmt_bytes, save  # noqa: E402

from memfit.apply.checkpoint import checkpoint  # noqa: E402
from memfit.apply.host_io import read_at as _read_at, write_at as _write_at  # noqa: E402
from memfit.apply.optimizer import TrainingOptimizer  # noqa: E402
from memfit.core.tracker import track  # noqa: E402
from memfit.models.gpt import GPT, GPTConfig  # noqa: E402

NAME = "precision_offload"
BUDGET = 32 * 2**20
FIT_SHAPE = dict(hidden=128, heads=2, vocab=256, seq=256)
FIT_BATCH = 4
CMP_SHAPE = dict(layers=4, hidden=256, heads=4, vocab=256, seq=128)
CMP_BATCH = 4
REPEATS = 7
CMP_REPEATS = 15  # the side-by-side steps are short: more rounds for a steadier median


def batch(n: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def memfit_step(model, opt, x, y) -> None:
    with opt.autocast():
        _, loss, n = model(x, y)
    opt.backward(loss / n, final=True)  # one micro-batch: offloaded updates may overlap backward
    opt.step()


# ---------------------------------------------------------------- 1. largest model under a budget
def fit_probe(kind: str, layers: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers, **FIT_SHAPE))
    x, y = batch(FIT_BATCH, FIT_SHAPE["seq"])
    if kind == "fp32-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            _, loss, n = model(x, y)
            (loss / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        checkpoint(model, "full")
        opt = TrainingOptimizer(model, "adamw", lr=1e-3, precision="bf16-master", offload="cpu")

        def step():
            memfit_step(model, opt, x, y)
    t0 = time.perf_counter()
    with track(model, opt) as t:
        for _ in range(2):
            step()
    out = {"layers": layers, "params": model.num_params(), "peak": t.peak_bytes, "host_peak": t.host_peak_bytes,
           "breakdown": t.breakdown, "seconds": time.perf_counter() - t0}
    if isinstance(opt, TrainingOptimizer):
        opt.close()
    print(f"  {kind:>22} {layers:>3} layers {out['params'] / 1e6:6.2f}M params: peak {fmt_bytes(out['peak'])}"
          f" ({out['seconds']:.1f}s)", flush=True)
    return out


def largest_under_budget(kind: str) -> dict:
    probes = {n: fit_probe(kind, n) for n in (1, 2)}
    per_layer = probes[2]["peak"] - probes[1]["peak"]
    guess = max(1, int((BUDGET - probes[1]["peak"]) // per_layer) + 1)
    probe = lambda n: probes.setdefault(n, fit_probe(kind, n)) if n not in probes else probes[n]  # noqa: E731
    layers = guess
    while layers > 1 and probe(layers)["peak"] > BUDGET:
        layers -= 1
    while probe(layers + 1)["peak"] <= BUDGET:
        layers += 1
    best, nxt = probes[layers], probes[layers + 1]
    return {"kind": kind, "layers": layers, "params": best["params"], "peak": best["peak"],
            "host_peak": best["host_peak"], "breakdown": best["breakdown"],
            "next": {"layers": layers + 1, "params": nxt["params"], "peak": nxt["peak"]}}


# ---------------------------------------------------------------- 2. offload overhead and disk throughput
def raw_disk(path: str, nbytes: int) -> tuple[int, float]:
    """Sequential overwrite then read of nbytes of an existing file in 16 MiB calls (the size of a
    spill chunk): (bytes moved, seconds). The file is created untimed on first use, as the spill
    files are created before the steps that rewrite them."""
    block = torch.empty(16 << 20, dtype=torch.uint8).random_(0, 255)

    def sweep(fd: int, op) -> None:
        off = 0
        while off < nbytes:
            n = min(len(block), nbytes - off)
            op(fd, block[:n], off)
            off += n

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < nbytes:
            sweep(fd, _write_at)
        t0 = time.perf_counter()
        sweep(fd, _write_at)
        sweep(fd, _read_at)
        return 2 * nbytes, time.perf_counter() - t0
    finally:
        os.close(fd)


# (label, offload target, chunk bytes): default 16 MiB chunks (one chunk here: it is complete only
# when backward ends, so the spill I/O runs alone and its throughput is the I/O path's), and 4 MiB
# chunks, the later ones updated on the worker thread while backward goes on.
# The last row keeps the gradient files between steps instead of deleting them after each one.
OFFLOADS = [("none", None, None, False), ("cpu", "cpu", None, False), ("disk", "disk", None, False),
            ("cpu, 4 MiB chunks during backward", "cpu", 4 << 20, False),
            ("disk, 4 MiB chunks during backward", "disk", 4 << 20, False),
            ("disk, gradient files kept", "disk", None, True)]


def overhead() -> dict:
    x, y = batch(CMP_BATCH, CMP_SHAPE["seq"])
    spill_root = tempfile.mkdtemp(prefix="memfit-bench-")
    runs = {}
    for precision in ("32-true", "bf16-master"):
        for label, offload, chunk, keep in OFFLOADS:
            torch.manual_seed(0)
            model = GPT(GPTConfig(**CMP_SHAPE))
            opt = TrainingOptimizer(model, "adamw", lr=1e-3, precision=precision, offload=offload,
                                    spill_dir=spill_root if offload == "disk" else None, chunk_bytes=chunk,
                                    keep_grad_files=keep)
            memfit_step(model, opt, x, y)  # warm-up; creates the optimizer state
            runs[(precision, label)] = {"model": model, "opt": opt, "times": [], "io": []}
    try:
        for _ in range(REPEATS):
            for (precision, label), r in runs.items():
                io = r["opt"].io_stats
                before = (io.bytes_read + io.bytes_written, io.read_s + io.write_s) if io else None
                t0 = time.perf_counter()
                memfit_step(r["model"], r["opt"], x, y)
                r["times"].append(time.perf_counter() - t0)
                if io:
                    moved = io.bytes_read + io.bytes_written - before[0]
                    # raw right after, so each spill figure is paired with a raw one taken under the
                    # same machine load (the machine may be shared)
                    raw_moved, raw_s = raw_disk(os.path.join(spill_root, "raw.bin"), moved // 2)
                    r["io"].append((moved, io.read_s + io.write_s - before[1], raw_moved / raw_s))
    finally:
        for r in runs.values():
            r["opt"].close()
        if os.path.exists(os.path.join(spill_root, "raw.bin")):
            os.unlink(os.path.join(spill_root, "raw.bin"))
        os.rmdir(spill_root)
    rows = []
    for (precision, label), r in runs.items():
        sec = statistics.median(r["times"])
        base = statistics.median(runs[(precision, "none")]["times"])
        streamed = r["opt"].streamed
        row = {"precision": precision, "offload": label, "step_seconds": sec, "overhead_pct": 100 * (sec / base - 1),
               "chunks": len(streamed.chunks) if streamed else 0,
               "chunk_updates_during_backward": streamed.early_updates if streamed else 0}
        if r["io"]:
            row["spill_bytes_per_step"] = int(statistics.median(m for m, _, _ in r["io"]))
            row["spill_throughput"] = statistics.median(m / s for m, s, _ in r["io"])
            row["raw_throughput"] = statistics.median(raw_tp for _, _, raw_tp in r["io"])
            row["throughput_pct_of_raw"] = statistics.median(100 * m / s / raw_tp for m, s, raw_tp in r["io"])
        rows.append(row)
        print(f"  {precision:>11} offload={label:<36} {sec * 1e3:7.1f} ms  ({row['overhead_pct']:+.0f}%)", flush=True)
    return {"model": CMP_SHAPE, "batch": CMP_BATCH, "params": GPT(GPTConfig(**CMP_SHAPE)).num_params(), "rows": rows}


# ---------------------------------------------------------------- 3. memfit vs torch.amp vs DeepSpeed
def have_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def make_contender(name: str):
    """(model, step function, optimizer object for the tracker, closer) for one contender."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CMP_SHAPE))
    if name == "memfit bf16-master + cpu offload":
        opt = TrainingOptimizer(model, "adamw", lr=1e-3, precision="bf16-master", clip=1.0, offload="cpu")
        return model, lambda x, y: memfit_step(model, opt, x, y), opt, opt.close
    if name == "torch.amp bf16 + GradScaler + AdamW":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        scaler = torch.amp.GradScaler("cpu")

        def step(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss, n = model(x, y)
            scaler.scale(loss / n).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return model, step, opt, lambda: None
    if name == "DeepSpeed ZeRO-2 + cpu offload (bf16)":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": CMP_BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
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


CONTENDERS = ["memfit bf16-master + cpu offload", "torch.amp bf16 + GradScaler + AdamW", "DeepSpeed ZeRO-2 + cpu offload (bf16)"]


def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) in bytes, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS
    except OSError:
        pass


def worker_mem(name: str) -> dict:
    """Fresh process: peak RSS growth and tracker peak over 3 steps of one contender."""
    x, y = batch(CMP_BATCH, CMP_SHAPE["seq"])
    if name.startswith("DeepSpeed"):
        import deepspeed  # noqa: F401  (imported before the baseline, like torch for the others)
    _reset_peak_rss()
    base, _ = _rss()
    model, step, opt, close = make_contender(name)
    step(x, y)
    module = model.module if hasattr(model, "module") else model
    with track(module, opt) as t:
        for _ in range(2):
            step(x, y)
    _, peak = _rss()
    close()
    return {"rss_growth": peak - base, "tracker_peak": t.peak_bytes, "tracker_host_peak": t.host_peak_bytes}


def worker_compare() -> dict:
    x, y = batch(CMP_BATCH, CMP_SHAPE["seq"])
    names = [n for n in CONTENDERS if not n.startswith("DeepSpeed") or have_deepspeed()]
    runs, errors = {}, {}
    for name in names:
        try:
            model, step, _, close = make_contender(name)
            step(x, y)  # warm-up
            runs[name] = {"step": step, "close": close, "times": [], "losses": []}
        except Exception as e:  # a contender that cannot run here is reported, not fatal
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    for _ in range(CMP_REPEATS):
        for name, r in runs.items():
            t0 = time.perf_counter()
            r["step"](x, y)
            r["times"].append(time.perf_counter() - t0)
    for r in runs.values():
        r["close"]()
    return {"step_seconds": {n: statistics.median(r["times"]) for n, r in runs.items()}, "errors": errors}


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
        if name.startswith("DeepSpeed") and not have_deepspeed():
            continue
        mem[name] = _torchrun(["--worker", "mem", "--contender", name], 29612 + i)
        print(f"  {name}: {mem[name]}", flush=True)
    print(f"  step seconds: {result}", flush=True)
    return {"model": CMP_SHAPE, "batch": CMP_BATCH, "params": GPT(GPTConfig(**CMP_SHAPE)).num_params(),
            "step_seconds": result.get("step_seconds", {}), "errors": result.get("errors", {"all": result.get("error")}),
            "memory": mem, "notes": notes}


# ---------------------------------------------------------------- main and render
THREADS = 1
"""Intra-op threads for every contender. On a small shared machine, OpenMP threads that lose their
core to another process stall at barriers (a 2-thread step measured 60x slower than usual here);
one thread each keeps the side-by-side comparison steady. DeepSpeed's CPU Adam gets the same
OMP_NUM_THREADS."""


def main() -> None:
    torch.set_num_threads(THREADS)
    t0 = time.perf_counter()
    print("1. largest model under the budget", flush=True)
    fit = [largest_under_budget(k) for k in ("fp32-adamw", "memfit bf16-master+offload+ckpt")]
    print("2. offload overhead", flush=True)
    over = overhead()
    print("3. memfit vs torch.amp vs DeepSpeed", flush=True)
    cmp_ = compare()
    payload = {"budget": BUDGET, "fit_shape": FIT_SHAPE, "fit_batch": FIT_BATCH, "fit": fit,
               "ratio": fit[1]["params"] / fit[0]["params"], "overhead": over, "compare": cmp_,
               "threads": torch.get_num_threads(), "repeats": REPEATS, "compare_repeats": CMP_REPEATS, "seconds": time.perf_counter() - t0}
    path = save(NAME, payload)
    print(render(json.loads(path.read_text())))
    print(f"wrote {path.relative_to(ROOT)}")


def render(r: dict) -> str:
    from render import machine_line

    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    lines = ["## Precision and optimizer offload", "",
             "Command: `.venv/bin/python bench/precision_offload.py`", "",
             machine_line(r) + f" {r.get('threads', '?')} intra-op thread(s) per contender.", "",
             f"### Largest model that trains under a {mib(r['budget'])} device budget", "",
             f"GPT (hidden {r['fit_shape']['hidden']}, {r['fit_shape']['heads']} heads, byte vocabulary), "
             f"{r['fit_batch']} x {r['fit_shape']['seq']} tokens per step; device bytes = memfit tracker peak over two "
             "real steps (host-resident optimizer copies excluded).", "",
             "| configuration | layers | parameters | device peak | next depth's peak |", "|---|---|---|---|---|"]
    for f in r["fit"]:
        lines.append(f"| {f['kind']} | {f['layers']} | {f['params'] / 1e6:.2f}M | {mib(f['peak'])} | "
                     f"{mib(f['next']['peak'])} ({f['next']['layers']} layers) |")
    lines += ["", f"memfit trains a **{r['ratio']:.1f}x** larger model in the same device budget "
              f"(N = {r['fit'][0]['params'] / 1e6:.2f}M parameters with plain fp32 AdamW).", ""]

    o = r["overhead"]
    lines += [f"### Offload step-time overhead ({o['params'] / 1e6:.1f}M parameters, {o['batch']} x "
              f"{o['model']['seq']} tokens, AdamW, no clipping)", "",
              "| precision | optimizer offload | chunks | step time | overhead vs in-memory | "
              "spill I/O per step | spill throughput | raw throughput | % of raw |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in o["rows"]:
        io = (f"{mib(row['spill_bytes_per_step'])} | {row['spill_throughput'] / 2**30:.2f} GiB/s | "
              f"{row['raw_throughput'] / 2**30:.2f} GiB/s | {row['throughput_pct_of_raw']:.0f}%"
              ) if "spill_throughput" in row else "- | - | - | -"
        lines.append(f"| {row['precision']} | {row['offload']} | {row['chunks'] or '-'} | {row['step_seconds'] * 1e3:.1f} ms | "
                     f"{row['overhead_pct']:+.0f}% | {io} |")
    by = {(row["precision"], row["offload"]): row for row in o["rows"]}
    parts = [f"{prec} {off} {by[(prec, off)]['overhead_pct']:+.0f}%" for prec in ("32-true", "bf16-master")
             for off in ("cpu", "disk") if (prec, off) in by]
    disk = [by[(p, "disk")]["throughput_pct_of_raw"] for p in ("32-true", "bf16-master") if (p, "disk") in by]
    kept = [by[(p, "disk, gradient files kept")]["throughput_pct_of_raw"] for p in ("32-true", "bf16-master")
            if (p, "disk, gradient files kept") in by]
    if parts:
        lines += ["", "Offloading the optimizer costs " + ", ".join(parts) + " per step against keeping it in memory"
                  + (f"; with the update after backward the spill I/O runs at {min(disk):.0f}-{max(disk):.0f}% of the "
                     "raw throughput" if disk else "")
                  + (f", and at {min(kept):.0f}-{max(kept):.0f}% when the gradient files are kept between steps." if kept
                     else ".")
                  + " With 4 MiB chunks the later chunks are updated on the worker thread while backward runs, "
                  "competing with it for this machine's cores; the seconds inside that thread's read and write calls "
                  "then include waiting for a core and for the interpreter lock, so their throughput is not a measure "
                  "of the I/O path. Deleting the gradient files after every step (the default) means new file pages "
                  "on every write; the last row keeps them (`keep_grad_files=True`)."]
    lines += ["", "Spill throughput: bytes moved to and from the spill files per step over the seconds spent inside "
              "the read and write calls. Raw: a sequential overwrite + read of the same number of bytes of one file in "
              "the same folder, in 16 MiB calls, taken right after each step; % of raw is the median of the per-step "
              "ratios. Both go through the page cache (no fsync on either side: spill files are scratch data), so at "
              "this size both are memory-copy speeds through the kernel, not the disk device's. Gradient files are "
              "written on a worker thread while backward computes, which the raw copy does not compete with."]

    c = r["compare"]
    lines += ["", f"### memfit vs torch.amp vs DeepSpeed ZeRO-Offload on CPU ({c['params'] / 1e6:.1f}M parameters, "
              f"{c['batch']} x {c['model']['seq']} tokens)", "",
              "| configuration | step time | peak RSS growth | tracker device peak |", "|---|---|---|---|"]
    for name in CONTENDERS:
        sec = c["step_seconds"].get(name)
        mem = c["memory"].get(name, {})
        err = c["errors"].get(name) or mem.get("error")
        if sec is None and not mem:
            lines.append(f"| {name} | skipped: {err or 'not installed'} | | |")
            continue
        lines.append(f"| {name} | {f'{sec * 1e3:.1f} ms' if sec else 'failed: ' + str(err)} | "
                     f"{mib(mem['rss_growth']) if 'rss_growth' in mem else '-'} | "
                     f"{mib(mem['tracker_peak']) if 'tracker_peak' in mem else '-'} |")
    for note in c.get("notes", []):
        lines += ["", note]
    steps, mem = c["step_seconds"], c["memory"]
    ours, amp = CONTENDERS[0], CONTENDERS[1]
    if ours in steps and amp in steps and "tracker_peak" in mem.get(ours, {}) and "tracker_peak" in mem.get(amp, {}):
        lines += ["", f"memfit's step takes {steps[ours] / steps[amp]:.2f}x torch.amp's time and keeps "
                  f"{mem[amp]['tracker_peak'] / mem[ours]['tracker_peak']:.1f}x fewer bytes resident on the device"
                  + (f"; DeepSpeed's step takes {steps[CONTENDERS[2]] / steps[amp]:.2f}x torch.amp's time."
                     if CONTENDERS[2] in steps else ".")]
    lines += ["", "The tracker's device peak counts what stays resident on the training device; on this CPU-only "
              "machine host and device are the same RAM, so RSS growth (which includes offloaded state and "
              "library workspaces) is the like-for-like total. DeepSpeed's offloaded fp32 partitions are plain CPU "
              "tensors, which the tracker cannot tell from device tensors here."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["compare", "mem"])
    ap.add_argument("--contender")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.worker:
        torch.set_num_threads(THREADS)
        res = worker_compare() if a.worker == "compare" else worker_mem(a.contender)
        Path(a.out).write_text(json.dumps(res))
    else:
        main()
