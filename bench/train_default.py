"""What does the default `memfit train` (no options) achieve on this machine in its two minutes?

    .venv/bin/python bench/train_default.py

Runs exactly the configuration of `memfit train` with no arguments (TrainConfig()), in a
temporary run folder, and records its summary: loss at the start and end (train and validation),
steps, tokens/s, the tracked step's memory breakdown and the process's peak RSS.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt_bytes, save  # noqa: E402

from memfit.train.loop import TrainConfig, train  # noqa: E402
from memfit.train.report import format_summary  # noqa: E402

NAME = "train_default"


def main() -> None:
    load_before = os.getloadavg()[0]  # other jobs on the machine slow the run; say how busy it was
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(out=str(Path(tmp) / "run"))
        result = train(cfg, progress=True)
    m = result.metrics
    print(format_summary(m, Path("runs/<timestamp>"), result.stopped))  # what `memfit train` prints at the end
    payload = {"config": {k: v for k, v in m["config"].items() if k != "out"}, "run": m["run"],
               "summary": m["summary"], "stopped": result.stopped, "memory": m["memory"],
               "val": m["val"], "load_avg": [load_before, os.getloadavg()[0]]}
    path = save(NAME, payload)
    s = m["summary"]
    print(f"loss {s['start_loss']:.3f} -> {s['end_loss']:.3f}, val {s['start_val_loss']:.3f} -> "
          f"{s['end_val_loss']:.3f}, {s['steps']} steps, {s['tokens_per_s']:,.0f} tok/s; wrote {path}")


def render(result: dict) -> str:
    from render import machine_line

    s, run, bd = result["summary"], result["run"], result["memory"]["step_breakdown"]
    lines = [
        "## train_default: the default `memfit train` run",
        "",
        "`.venv/bin/python bench/train_default.py` (the same run as `./scripts/train.sh`)",
        "",
        machine_line(result),
        "",
        f"Model `{result['config']['model']}` ({run['params'] / 1e6:.2f}M parameters), {run['corpus']['name']} "
        f"({run['corpus']['bytes'] / 1e6:.1f} MB), {run['tokens_per_step']} tokens/step, {run['precision']} on "
        f"{run['device']}, time limit {result['config']['time_limit'] or 120:.0f} s.",
        "",
        "| steps | tokens | seconds | train loss start -> end | val loss start -> end | tokens/s (median) | step peak (tracker) | process RSS peak |",
        "|---:|---:|---:|---|---|---:|---:|---:|",
        f"| {s['steps']} | {s['tokens']:,} | {s['seconds']:.0f} | {s['start_loss']:.3f} -> {s['end_loss']:.3f} | "
        f"{s['start_val_loss']:.3f} -> {s['end_val_loss']:.3f} | {s['tokens_per_s']:,.0f} | "
        f"{fmt_bytes(bd['peak_bytes']) if bd else 'n/a'} | {fmt_bytes(s['peak_memory_bytes'])} |",
    ]
    if bd:
        parts = ", ".join(f"{k} {fmt_bytes(bd['breakdown'][k])}" for k in
                          ("params", "grads", "optimizer", "activations", "temporaries"))
        lines += ["", f"Tracked step {bd['step']} at its peak: {parts}."]
    lines += [
        "",
        f"Loss is cross-entropy in nats per byte (ln 256 = 5.55 untrained); the validation loss falls from "
        f"{s['start_val_loss']:.2f} to {s['end_val_loss']:.2f} in {s['seconds']:.0f} seconds. Speed depends on "
        "how busy the machine's cores were during the run" + (
            f" (1-minute load average {result['load_avg'][0]:.1f} before and {result['load_avg'][1]:.1f} after, on "
            f"{result['machine']['cores']} cores)." if "load_avg" in result else "."),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
