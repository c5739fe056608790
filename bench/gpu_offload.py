"""Activation offload overlap on CUDA: does moving every saved activation to pinned host memory, on
a side stream with prefetch, hide behind compute?

    PYTHONPATH=src python3 bench/gpu_offload.py --out /tmp/gpu/          # an NVIDIA GPU, ~3 min
    PYTHONPATH=src python3 bench/gpu_offload.py --smoke --out /tmp/x.json  # any machine, tiny model

Model: memfit's GPT at a size where the saved activations are most of the step's peak, in bf16
autocast and in fp32. Contenders, side by side on one model (bench/common.py: warm-up, shuffled
order each round, median and spread, CUDA-synchronised wall time):

- keep: autograd keeps its saved tensors on the device (no offload);
- memfit none+offload:cpu: every block's saved tensors to pinned host memory on a side stream, the
  previous block's brought back (prefetch) while backward runs the current one;
- torch save_on_cpu: `torch.autograd.graph.save_on_cpu(pin_memory=True)` around forward and backward;
- memfit full+offload:cpu: recompute every block and offload only the block inputs (moves far fewer
  bytes; shown for scale).

Per contender: step time, overhead against keep (paired per round), `torch.cuda.max_memory_allocated`
of the step, bytes copied to the host per step (memfit's OffloadStats; for save_on_cpu its pack hook
counted), those bytes over the step time, and the transfer-bound time: the bytes moved each way over
the machine's host<->device bandwidth, measured here with 1 GiB pinned copies. Gradients of each
offload contender are compared with keep's (dropout 0), and keep with itself as the noise floor.
A contender that fails is recorded with its error; the others still run.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
import memfit  # noqa: E402
from common import interleaved, paired_ratio  # noqa: E402
from memfit.apply.checkpoint import applied  # noqa: E402
from memfit.models.gpt import GPT, GPTConfig  # noqa: E402

NAME = "gpu_offload"
COMMAND = "PYTHONPATH=src python3 bench/gpu_offload.py"
KEEP, MEMFIT, SAVE_ON_CPU, MEMFIT_FULL = "keep", "memfit none+offload:cpu", "torch save_on_cpu", "memfit full+offload:cpu"
CONTENDERS = [KEEP, MEMFIT, SAVE_ON_CPU, MEMFIT_FULL]
POLICY = {KEEP: "none", MEMFIT: "none+offload:cpu", SAVE_ON_CPU: "none", MEMFIT_FULL: "full+offload:cpu"}

MODEL = dict(layers=16, hidden=2048, heads=16, vocab=32768, seq=1024)
ROWS = [("bf16", 16), ("fp32", 4)]  # (precision, batch): fp32 keeps twice the bytes, runs without TF32
SMOKE_MODEL = dict(layers=2, hidden=64, heads=4, vocab=128, seq=32)
SMOKE_ROWS = [("bf16", 2), ("fp32", 2)]


def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


# ---------------------------------------------------------------------------- host <-> device bandwidth
def bandwidth(gib: float = 1.0, repeats: int = 5) -> dict:
    """Pinned host->device and device->host copies of `gib` GiB, CUDA-event timed: median GB/s."""
    if not cuda():
        return {"error": "no CUDA device: host and device are the same memory"}
    try:
        n = int(gib * 2**30)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        out = {"bytes": n}
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            secs = []
            for _ in range(repeats + 1):  # the first copy is a warm-up
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
                b.synchronize()
                secs.append(a.elapsed_time(b) / 1e3)
            secs = secs[1:]
            out[name] = {"GB_per_s": n / statistics.median(secs) / 1e9, "seconds": secs}
        del host, dev
        return out
    except Exception as exc:  # noqa: BLE001 - recorded, the rest of the bench still runs
        return {"error": err(exc)}


# ---------------------------------------------------------------------------- one training step
class Bench:
    """One model and input; `step(name)` runs forward and backward the way contender `name` does."""

    def __init__(self, cfg: GPTConfig, batch: int, precision: str) -> None:
        dev = "cuda" if cuda() else "cpu"
        torch.manual_seed(0)
        with torch.device(dev):  # initialised where it runs: a CPU init of ~1B parameters takes seconds
            self.model = GPT(cfg)
        self.precision, self.dev = precision, dev
        self.x = torch.randint(0, cfg.vocab, (batch, cfg.seq), device=dev)
        self.moved: dict[str, int] = {}  # bytes copied to host by the last step of each contender
        self.after_forward = 0

    def setup(self, name: str) -> None:
        """Untimed: apply the contender's policy, drop grads, reset the peak."""
        memfit.checkpoint(self.model, POLICY[name])
        self.model.zero_grad(set_to_none=True)
        sync()
        if cuda():
            torch.cuda.reset_peak_memory_stats()

    def _context(self, name: str):
        if name != SAVE_ON_CPU:
            return contextlib.nullcontext()
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
        pack = ctx.pack_hook

        def counting(t):  # the bytes save_on_cpu copies: every saved tensor, parameters included
            self.moved[name] = self.moved.get(name, 0) + t.numel() * t.element_size()
            return pack(t)

        ctx.pack_hook = counting
        return ctx

    def step(self, name: str, x: torch.Tensor | None = None) -> None:
        x = self.x if x is None else x
        self.moved[name] = 0
        auto = torch.autocast(self.dev, dtype=torch.bfloat16, enabled=self.precision == "bf16")
        with self._context(name):
            with auto:
                _, loss, _ = self.model(x, x)
            if cuda():
                self.after_forward = torch.cuda.memory_allocated()
            loss.backward()
        state = applied(self.model)
        if state is not None and state.store is not None:
            self.moved[name] = state.store.stats.host_bytes
        sync()


def fit_batch(cfg: GPTConfig, batch: int, precision: str) -> tuple[Bench, dict]:
    """The bench at `batch`, halved until a keep step fits; with the keep step's activation share."""
    while True:
        try:
            return _keep_step(cfg, batch, precision)
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
        # outside the except block: its traceback no longer holds the failed step's tensors
        gc.collect()
        torch.cuda.empty_cache()
        batch //= 2
        print(f"  out of memory: batch {batch * 2} -> {batch}", flush=True)


def _keep_step(cfg: GPTConfig, batch: int, precision: str) -> tuple[Bench, dict]:
    bench = Bench(cfg, batch, precision)
    bench.setup(KEEP)
    before = torch.cuda.memory_allocated() if cuda() else 0
    bench.step(KEEP)
    info = {"batch": batch}
    if cuda():
        peak = torch.cuda.max_memory_allocated()
        # what forward leaves alive for backward (saved activations, logits) over the step's peak
        info.update(before_forward=before, after_forward=bench.after_forward, peak=peak,
                    activation_share=(bench.after_forward - before) / peak)
    return bench, info


# ---------------------------------------------------------------------------- gradients
def grads(bench: Bench, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    bench.setup(name)
    bench.step(name, x)
    return {k: p.grad.detach().clone() for k, p in bench.model.named_parameters() if p.grad is not None}


def compare(ref: dict, got: dict) -> dict:
    if set(ref) != set(got):
        return {"equal": False, "error": f"different parameters with grads: {sorted(set(ref) ^ set(got))[:5]}"}
    diff = max(((ref[k].float() - got[k].float()).abs().max().item() for k in ref), default=0.0)
    return {"equal": all(torch.equal(ref[k], got[k]) for k in ref), "max_abs_diff": diff}


def check_grads(bench: Bench, batch: int) -> dict:
    """One step per contender on a quarter of the batch, dropout 0: gradients against keep's."""
    x = bench.x[: max(1, batch // 4)]
    out: dict = {"batch": x.shape[0]}
    try:
        ref = grads(bench, KEEP, x)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"keep: {err(exc)}"}
    for name in CONTENDERS:  # keep against keep: the run-to-run noise floor
        try:
            out[name] = compare(ref, grads(bench, name, x))
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": err(exc)}
    del ref
    bench.setup(KEEP)
    return out


# ---------------------------------------------------------------------------- timing
def warm(bench: Bench, errors: dict) -> list[str]:
    """Each contender's warm-up step (first pinned allocations included); the ones that ran."""
    ok = []
    for name in CONTENDERS:
        try:
            bench.setup(name)
            bench.step(name)
            ok.append(name)
        except Exception as exc:  # noqa: BLE001 - one failing contender must not stop the others
            errors[name] = err(exc)
            print(f"  {name} failed: {errors[name]}", flush=True)
            traceback.print_exc(limit=2)
    return ok


def time_row(bench: Bench, rounds: int, errors: dict) -> dict:
    names = warm(bench, errors)
    peaks: dict[str, list[int]] = {n: [] for n in names}
    reserved: dict[str, list[int]] = {n: [] for n in names}
    moved: dict[str, list[int]] = {n: [] for n in names}

    def run(name):
        def call():
            if name in errors:
                return
            try:
                bench.step(name)
            except Exception as exc:  # noqa: BLE001
                errors[name] = err(exc)
        return call

    def after(name):
        moved[name].append(bench.moved.get(name, 0))
        if cuda():
            peaks[name].append(torch.cuda.max_memory_allocated())
            reserved[name].append(torch.cuda.max_memory_reserved())

    timing = interleaved({n: run(n) for n in names}, rounds=rounds, warmup=0, setup=bench.setup, after=after)
    return {"timing": timing, "peaks": peaks, "reserved": reserved, "moved": moved}


def summarize(raw: dict, bw: dict, errors: dict) -> dict:
    timing, out = raw["timing"], {}
    for name in CONTENDERS:
        if name in errors or name not in timing["wall"]:
            out[name] = {"error": errors.get(name, "did not run")}
            continue
        t = timing["wall"][name]["median"]
        moved = int(statistics.median(raw["moved"][name])) if raw["moved"][name] else 0
        s = {"step_s": timing["wall"][name], "bytes_to_host": moved, "bytes_per_s": moved / t}
        if KEEP in timing["wall"] and KEEP not in errors:
            s["vs_keep"] = paired_ratio(timing, name, KEEP)
        if raw["peaks"][name]:
            s["max_memory_allocated"] = max(raw["peaks"][name])
            s["max_memory_reserved"] = max(raw["reserved"][name])
        if moved and "d2h" in bw and "h2d" in bw:  # each byte goes out in forward and back in backward
            s["transfer_bound_s"] = moved / (bw["d2h"]["GB_per_s"] * 1e9) + moved / (bw["h2d"]["GB_per_s"] * 1e9)
        out[name] = s
    return out


def run_row(precision: str, model: dict, batch: int, rounds: int, bw: dict) -> dict:
    cfg = GPTConfig(**model, dropout=0.0)
    row: dict = {"precision": precision, "model": model, "batch_requested": batch,
                 "tf32": bool(cuda() and torch.backends.cuda.matmul.allow_tf32)}
    bench = None
    try:
        bench, fit = fit_batch(cfg, batch, precision)
        row.update(fit)
        row["params"] = bench.model.num_params()
        row["tokens_per_step"] = row["batch"] * cfg.seq
        row["grad_check"] = check_grads(bench, row["batch"])
        errors: dict = {}
        raw = time_row(bench, rounds, errors)
        row["contenders"] = summarize(raw, bw, errors)
        row["rounds"] = {k: raw["timing"][k] for k in ("rounds", "seed", "orders", "load_before", "load_after")}
    except Exception as exc:  # noqa: BLE001 - the next row still runs
        row["error"] = err(exc)
        traceback.print_exc(limit=3)
    finally:
        del bench
        gc.collect()
        if cuda():
            torch.cuda.empty_cache()
            with contextlib.suppress(Exception):
                torch._C._host_emptyCache()  # pinned blocks cached by this row's offload
    return row


# ---------------------------------------------------------------------------- output
def table(result: dict) -> str:
    from gpu_offload_render import summary

    return summary(result)


def write(payload: dict, out: str | None, smoke: bool) -> Path:
    """bench/results/gpu_offload.json, or `out` (a .json file, or a folder to write it in)."""
    if out is None and smoke:
        out = "/tmp/gpu_offload_smoke.json"  # a smoke run's numbers never land in bench/results
    if out is None:
        return common.save(NAME, payload)
    target = Path(out)
    folder = target.parent if target.suffix == ".json" else target
    common.RESULTS = folder
    path = common.save(NAME, payload)
    if target.suffix == ".json" and path != target:
        path = path.replace(target)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds: checks the script on any machine")
    ap.add_argument("--out", help="write the JSON here (a file or folder) instead of bench/results/")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; 2 with --smoke)")
    ap.add_argument("--rows", default=None, help="precisions to run, comma separated (default bf16,fp32)")
    args = ap.parse_args()
    if not cuda() and not args.smoke:
        sys.exit("bench/gpu_offload.py measures a CUDA device and finds none; --smoke runs a tiny model anywhere")
    rounds = args.rounds or (2 if args.smoke else common.MIN_ROUNDS)
    if args.smoke:
        common.MIN_ROUNDS = min(common.MIN_ROUNDS, rounds)  # a smoke run checks the code, not the numbers
    model, rows = (SMOKE_MODEL, SMOKE_ROWS) if args.smoke else (MODEL, ROWS)
    if args.rows:
        keep = args.rows.split(",")
        rows = [r for r in rows if r[0] in keep]
    t0 = time.perf_counter()
    bw = bandwidth(0.01 if args.smoke else 1.0)
    print(f"device {torch.cuda.get_device_name() if cuda() else 'cpu'}, torch {torch.__version__}; "
          f"bandwidth {bw}", flush=True)
    results = []
    for precision, batch in rows:
        print(f"== {precision}, batch {batch}", flush=True)
        results.append(run_row(precision, model, batch, rounds, bw))
    payload = {"command": COMMAND + (" --smoke" if args.smoke else ""), "smoke": args.smoke,
               "device_name": torch.cuda.get_device_name() if cuda() else "cpu", "torch": torch.__version__,
               "cuda": torch.version.cuda, "bandwidth": bw, "rows": results,
               "seconds": time.perf_counter() - t0}
    path = write(payload, args.out, args.smoke)
    print(f"wrote {path}")
    print(table(payload))


def render(result: dict) -> str:
    from gpu_offload_render import render as _render

    return _render(result)


if __name__ == "__main__":
    main()
