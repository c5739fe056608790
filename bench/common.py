"""Shared helpers for bench scripts: machine description and load, side-by-side timing, peak RSS in
a fresh process, result files.

Timing rule for every bench: contenders run side by side in one process, warm-up first, then at
least 5 rounds; each round runs every contender once in a freshly shuffled order (seeded, and the
orders are recorded), so no contender always runs first or right after another. A figure is the
median over rounds, with its spread (min, max, interquartile range) and every raw time in the JSON;
the machine's load average is recorded before and after.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
MIN_ROUNDS = 5
_START = (time.perf_counter(), os.getloadavg())  # the script's start: wall time and load go in its JSON


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "device": device}


def load() -> list[float]:
    """The 1, 5 and 15-minute load averages (runnable processes; compare with the core count)."""
    return [round(x, 2) for x in os.getloadavg()]


def save(name: str, payload: dict) -> Path:
    """Write bench/results/<name>.json with the machine, the date, the script's wall time and the
    load average when it started and when it ended."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    run = {"wall_seconds": round(time.perf_counter() - _START[0], 1),
           "load_start": [round(x, 2) for x in _START[1]], "load_end": load()}
    # argv: the arguments this JSON was made with; tests/test_bench_manifest.py holds bench/benches.txt
    # (what bench/run_all.sh reruns) to them, so a rerun reproduces this file.
    run["argv"] = sys.argv[1:]
    payload = {"bench": name, "machine": machine(), "date": _dt.date.today().isoformat(), "run": run, **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, sort_keys=False))
    return path


# ---------------------------------------------------------------- side-by-side timing
def spread(times: list[float]) -> dict:
    """Median, min, max and interquartile range of `times`, and the times themselves."""
    s = sorted(times)
    q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else (s[0], s[0], s[0])
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "q1": q1, "q3": q3, "iqr": q3 - q1,
            "times": list(times)}


def interleaved(contenders: dict[str, Callable[[], object]], rounds: int = MIN_ROUNDS, warmup: int = 1,
                seed: int = 0, setup: Callable[[str], object] | None = None,
                after: Callable[[str], object] | None = None) -> dict:
    """Time each contender side by side: `warmup` untimed calls each, then `rounds` rounds, each
    running every contender once in a freshly shuffled order (random.Random(seed)).

    setup(name) runs untimed before each call (e.g. switching a shared model to that contender);
    after(name) runs untimed after each timed call (e.g. reading I/O counters).
    Returns {"rounds", "seed", "orders", "load_before", "load_after", "wall": {name: spread},
    "cpu": {name: spread of process CPU seconds, all threads}}."""
    if rounds < MIN_ROUNDS:
        raise ValueError(f"at least {MIN_ROUNDS} rounds, got {rounds}")
    names = list(contenders)
    rng = random.Random(seed)
    before = load()
    for name in names:
        for _ in range(warmup):
            if setup:
                setup(name)
            contenders[name]()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    orders = []
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        orders.append(order)
        for name in order:
            if setup:
                setup(name)
            t0, c0 = time.perf_counter(), time.process_time()
            contenders[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if after:
                after(name)
        print(f"    round {r + 1}/{rounds}: " + ", ".join(f"{n[:14]} {wall[n][-1]:.3f}s" for n in order), flush=True)
    return {"rounds": rounds, "seed": seed, "orders": orders, "load_before": before, "load_after": load(),
            "wall": {n: spread(wall[n]) for n in names}, "cpu": {n: spread(cpu[n]) for n in names}}


def paired_ratio(timing: dict, name: str, base: str, kind: str = "wall") -> dict:
    """Each round's time of `name` over `base`'s in the same round: median and min/max over rounds."""
    ratios = [t / b for t, b in zip(timing[kind][name]["times"], timing[kind][base]["times"])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


# ---------------------------------------------------------------- physical memory
def rss() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) of this process in bytes, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak_rss() -> bool:
    """Reset the peak RSS (VmHWM) to the current RSS (Linux /proc/self/clear_refs); False if refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Growth of the process's peak RSS over a region: `with PeakRSS() as r: ...; r.growth`."""

    def __enter__(self) -> "PeakRSS":
        self.reset = reset_peak_rss()
        self.base, _ = rss()
        return self

    def __exit__(self, *exc: object) -> None:
        _, peak = rss()
        self.growth = peak - self.base


def run_fresh(script: Path, args: list[str], timeout: float = 900, env: dict | None = None) -> dict:
    """Run `python script *args --out FILE` in a fresh interpreter and return the JSON it wrote to
    FILE (or {"error": ...}). A fresh process per contender keeps one contender's freed memory,
    still held by the C allocator, out of the next one's peak RSS."""
    fd, out = tempfile.mkstemp(suffix=".json", prefix="memfit-bench-")
    os.close(fd)
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run([sys.executable, str(script), *args, "--out", out], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"exit {proc.returncode}: " + " | ".join(tail)[:400]}
        return json.loads(Path(out).read_text())
    finally:
        os.unlink(out)


# ---------------------------------------------------------------- formatting
def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def fmt_spread(s: dict, scale: float = 1.0, unit: str = "s", digits: int = 2) -> str:
    """'median (min–max)' of a spread(), times `scale` (e.g. 1e3 for ms)."""
    f = lambda v: f"{v * scale:.{digits}f}"  # noqa: E731
    return f"{f(s['median'])} {unit} ({f(s['min'])}–{f(s['max'])})"


def fmt_pct(r: float) -> str:
    return f"{(r - 1) * 100:+.0f}%"


def fmt_ratio(p: dict) -> str:
    """A paired_ratio() as '+6% (+2…+9%)': median over rounds, then the rounds' range."""
    return f"{fmt_pct(p['median'])} ({fmt_pct(p['min'])}…{fmt_pct(p['max'])})"


def load_line(timing: dict, cores: int | None = None) -> str:
    b, a = timing["load_before"], timing["load_after"]
    tail = f" on {cores} cores" if cores else ""
    return (f"{timing['rounds']} rounds, order shuffled each round (seed {timing['seed']}); 1-minute load average "
            f"{b[0]:.1f} before and {a[0]:.1f} after the timed rounds{tail}.")


def run_line(result: dict) -> str:
    """The whole script's wall time and load average, from save()."""
    r = result.get("run")
    if not r:
        return ""
    return (f"Whole script: {r['wall_seconds']:.0f} s wall; 1-minute load average {r['load_start'][0]:.1f} at the "
            f"start and {r['load_end'][0]:.1f} at the end ({result['machine']['cores']} cores).")
