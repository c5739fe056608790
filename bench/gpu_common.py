"""Shared helpers for the GPU benches (bench/gpu_*.py): a result file at any path, the device's
description, a measured bf16 matmul peak, and a per-case guard that records an error and goes on.

The GPU benches run on a borrowed machine and write their JSON wherever `--out` says; the file has
the same fields as bench/common.py's save() (bench, machine, date, run), so bench/render.py reads it
once it is copied to bench/results/.
"""
from __future__ import annotations

import datetime as _dt
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from common import RESULTS, _START, load, machine


def device_info() -> dict:
    """The accelerator as torch sees it (or the CPU), with torch's own version and CUDA's."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(name=torch.cuda.get_device_name(), total_memory=props.total_memory,
                    multiprocessors=props.multi_processor_count)
    else:
        info["name"] = "cpu"
    return info


def save_to(out: str | None, name: str, payload: dict) -> Path:
    """Write the result JSON to `out` (default bench/results/<name>.json), with bench/common.py's
    machine, date, whole-script wall time and load-average fields."""
    run = {"wall_seconds": round(time.perf_counter() - _START[0], 1),
           "load_start": [round(x, 2) for x in _START[1]], "load_end": load()}
    payload = {"bench": name, "machine": machine(), "device_info": device_info(),
               "date": _dt.date.today().isoformat(), "run": run, **payload}
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return path


def guarded(fn: Callable[[], Any]) -> Any:
    """fn()'s result, or {"error": "<type>: <message>", "trace": <last lines>} when it raises: one failing
    case is recorded in the JSON and the script goes on."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - any failure is a result here, recorded as text
        tail = traceback.format_exc().strip().splitlines()[-6:]
        print(f"  error: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return {"error": f"{type(exc).__name__}: {str(exc)[:500]}", "trace": tail}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_peak(n: int = 8192, reps: int = 10, warmup: int = 3, device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """The measured peak of an n x n x n matmul on random data: median FLOP/s of `reps` timed products
    after `warmup` untimed ones (CUDA events on a GPU, the wall clock on a CPU)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(warmup):
        torch.matmul(a, b)
    sync(device)
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
    flops = 2 * n ** 3
    med = statistics.median(times)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "reps": reps, "warmup": warmup, "seconds": times,
            "median_seconds": med, "flops_per_s": flops / med, "data": "random normal"}
