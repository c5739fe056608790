"""What a training run reports: per-step history, metrics.json, a PNG plot, progress and a summary.

The history is plain lists (columns) so it can ride inside a weights_only checkpoint and carry
across a resume; metrics.json is that history plus the config, a summary and one step's memory
breakdown measured by memfit's tracker.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from memfit.core.units import format_bytes

METRICS = "metrics.json"
PLOT = "plot.png"
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")


def new_history() -> dict[str, Any]:
    return {
        "steps": {k: [] for k in ("step", "loss", "lr", "tokens", "seconds", "tokens_per_s", "memory_bytes", "grad_norm")},
        "val": {"step": [], "loss": []},
        "seconds": 0.0,
    }


def record_step(history: dict[str, Any], *, step: int, loss: float, lr: float, tokens: int, seconds: float,
                memory: int, grad_norm: float | None) -> None:
    cols = history["steps"]
    cols["step"].append(step)
    cols["loss"].append(loss)
    cols["lr"].append(lr)
    cols["tokens"].append(tokens)
    cols["seconds"].append(seconds)
    cols["tokens_per_s"].append(tokens / seconds if seconds > 0 else 0.0)
    cols["memory_bytes"].append(memory)
    cols["grad_norm"].append(grad_norm)


def tracker_breakdown(tracker: Any, step: int) -> dict[str, Any]:
    """One step's peak and its split by category (at the peak moment), from a MemoryTracker."""
    parts = {k: int(v) for k, v in dict(tracker.breakdown).items()}
    modules = dict(getattr(tracker, "module_activations", {}) or {})
    top = sorted(modules.items(), key=lambda kv: -kv[1])[:8]
    return {"step": step, "peak_bytes": int(tracker.peak_bytes), "breakdown": parts,
            "module_activations": {k: int(v) for k, v in top}}


def _tail_mean(values: list[float], frac: float = 0.05, cap: int = 20) -> float:
    """End-of-run loss as the mean of the last few steps: one random batch is too noisy to quote."""
    k = max(1, min(cap, int(len(values) * frac)))
    return sum(values[-k:]) / k


def summarize(history: dict[str, Any], breakdown: dict[str, Any] | None) -> dict[str, Any]:
    cols, val = history["steps"], history["val"]
    if not cols["step"]:
        return {"steps": 0, "tokens": 0, "seconds": history["seconds"]}
    timed = cols["tokens_per_s"][1:] or cols["tokens_per_s"]  # the first step pays for warm-up
    return {
        "steps": cols["step"][-1],
        "tokens": sum(cols["tokens"]),
        "seconds": round(history["seconds"], 3),
        "start_loss": cols["loss"][0],
        "end_loss": _tail_mean(cols["loss"]),
        "start_val_loss": val["loss"][0] if val["loss"] else None,
        "end_val_loss": val["loss"][-1] if val["loss"] else None,
        "tokens_per_s": statistics.median(timed),
        "peak_memory_bytes": max(cols["memory_bytes"]),
        "step_peak_bytes": breakdown["peak_bytes"] if breakdown else None,
    }


def metrics_payload(config: dict[str, Any], run: dict[str, Any], history: dict[str, Any],
                    breakdown: dict[str, Any] | None) -> dict[str, Any]:
    from memfit import __version__

    memory_kind = "cuda_max_allocated" if str(run.get("device", "cpu")).startswith("cuda") else "cpu_rss"
    return {
        "memfit": __version__,
        "config": config,
        "run": run,
        "summary": summarize(history, breakdown),
        "steps": history["steps"],
        "val": history["val"],
        "memory": {"per_step": memory_kind, "step_breakdown": breakdown},
    }


def plot(metrics: dict[str, Any], path: str | Path) -> Path:
    """Loss (train and validation) and memory over steps, plus the tracked step's breakdown, as a PNG.

    Uses matplotlib's Agg canvas directly (no pyplot) so it needs no display and leaves the
    caller's global backend alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps, val = metrics["steps"], metrics["val"]
    bd = metrics["memory"].get("step_breakdown")
    fig = Figure(figsize=(15 if bd else 11, 4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3 if bd else 2, gridspec_kw={"width_ratios": [3, 3, 2] if bd else [1, 1]})
    ax_loss, ax_mem = axes[0], axes[1]
    ax_loss.plot(steps["step"], steps["loss"], lw=0.8, alpha=0.6, label="train (per step)")
    if val["step"]:
        ax_loss.plot(val["step"], val["loss"], "o-", ms=3, label="validation")
    ax_loss.set(xlabel="step", ylabel="loss (nats per byte)", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    mib = [m / 2**20 for m in steps["memory_bytes"]]
    label = {"cpu_rss": "process RSS", "cuda_max_allocated": "CUDA peak allocated"}[metrics["memory"]["per_step"]]
    ax_mem.plot(steps["step"], mib, lw=1.0, label=label)
    if bd:
        ax_mem.axhline(bd["peak_bytes"] / 2**20, color="C3", ls="--", lw=1.0,
                       label=f"tracked step peak ({format_bytes(bd['peak_bytes'])})")
    ax_mem.set(xlabel="step", ylabel="MiB", title="memory per step")
    ax_mem.set_ylim(bottom=0)
    ax_mem.grid(alpha=0.3)
    ax_mem.legend()
    if bd:
        ax_bd = axes[2]
        values = [bd["breakdown"].get(k, 0) / 2**20 for k in CATEGORIES]
        bars = ax_bd.barh(CATEGORIES, values, color=[f"C{i}" for i in range(len(CATEGORIES))])
        ax_bd.bar_label(bars, labels=[format_bytes(v * 2**20) for v in values], padding=2, fontsize=8)
        ax_bd.invert_yaxis()
        ax_bd.set(xlabel="MiB", title=f"step {bd['step']} at its peak (tracker)")
        ax_bd.set_xlim(right=max(values + [1e-9]) * 1.35)
        ax_bd.grid(alpha=0.3, axis="x")
    fig.suptitle(f"memfit train: {metrics['config']['model']} ({metrics['run']['device']}, {metrics['run']['precision']})",
                 fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def _count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


def format_summary(metrics: dict[str, Any], run_dir: Path, stopped: str) -> str:
    """The few lines printed when a run ends: did it learn, how fast, how much memory, where it is."""
    s = metrics["summary"]
    if not s["steps"]:
        return f"memfit train: no steps run; run folder {run_dir}"
    why = {"steps": "", "time_limit": " (time limit)", "stop_at": " (stopped early)", "interrupted": " (interrupted)",
           "terminated": " (SIGTERM)"}.get(stopped, f" ({stopped})")
    cfg = metrics.get("config", {})
    on = f", {cfg['strategy']} on {cfg.get('engine')}" if cfg.get("strategy") in ("zero1", "zero2", "zero3") else ""
    lines = [f"memfit train: {s['steps']} steps, {_count(s['tokens'])} tokens in {s['seconds']:.0f} s{on}{why}"]
    val = f"   val {s['start_val_loss']:.3f} -> {s['end_val_loss']:.3f}" if s.get("end_val_loss") is not None else ""
    lines.append(f"  loss     {s['start_loss']:.3f} -> {s['end_loss']:.3f}{val}   (nats per byte)")
    lines.append(f"  speed    {s['tokens_per_s']:,.0f} tokens/s (median step)")
    kind = metrics["memory"]["per_step"]
    peak = f"{format_bytes(s['peak_memory_bytes'])} {'process RSS' if kind == 'cpu_rss' else 'CUDA peak allocated'}"
    bd = metrics["memory"].get("step_breakdown")
    if bd:
        parts = ", ".join(f"{k} {format_bytes(bd['breakdown'].get(k, 0))}" for k in CATEGORIES)
        lines.append(f"  memory   step peak {format_bytes(bd['peak_bytes'])} ({parts}); {peak}")
    else:
        lines.append(f"  memory   {peak}")
    if metrics["run"].get("compression"):
        from memfit.train.compression import summary_line

        lines.append(summary_line(metrics["run"]["compression"]))
    lines.append(f"  run      {run_dir}/  ({METRICS}, {PLOT}, checkpoint.pt)")
    if s["steps"] < (metrics["run"].get("horizon") or 0):
        lines.append(f"  resume   memfit train --resume {run_dir}")
    return "\n".join(lines)


class Progress:
    """A tqdm bar on a terminal; elsewhere (logs, CI) one plain line every `every` seconds."""

    def __init__(self, step: int, total: int | None, enabled: bool = True, log: Callable[[str], None] | None = None,
                 every: float = 5.0) -> None:
        self.enabled, self.total, self.every = enabled, total, every
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.bar = None
        self.last = time.monotonic()
        if enabled and sys.stderr.isatty() and _has_tqdm():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=step, unit="step", file=sys.stderr, dynamic_ncols=True,
                            desc="train", leave=True)

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def update(self, step: int, loss: float, tokens_per_s: float, memory: int) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f}  {tokens_per_s:,.0f} tok/s  mem {format_bytes(memory)}", refresh=False)
            self.bar.update(step - self.bar.n)  # redraws (at most every 0.1 s) with the postfix above
            return
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            total = f"/{self.total}" if self.total else ""
            self.log(f"step {step}{total}  loss {loss:.3f}  {tokens_per_s:,.0f} tok/s  mem {format_bytes(memory)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _has_tqdm() -> bool:
    """tqdm is optional: without it the report prints its plain lines on a terminal too."""
    import importlib.util

    return importlib.util.find_spec("tqdm") is not None
