"""What does the default `memfit train` (no options) achieve on this machine in its two minutes?

    .venv/bin/python bench/train_default.py

Runs exactly the configuration of `memfit train` with no arguments (TrainConfig()), in a
temporary run folder, and records its summary: loss at the start and end (train and validation),
steps, tokens/s, the tracked step's memory breakdown and the process's peak RSS, and the summary
`memfit train` prints, which bench/render.py also pastes into docs/train.md.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt_bytes, run_line, save  # noqa: E402

from memfit.train.loop import TrainConfig, train  # noqa: E402
from memfit.train.report import format_summary  # noqa: E402

NAME = "train_default"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(out=str(Path(tmp) / "run"))
        result = train(cfg, progress=True)
    m = result.metrics
    text = format_summary(m, Path("runs/<timestamp>"), result.stopped)  # what `memfit train` prints at the end
    print(text)
    payload = {"config": {k: v for k, v in m["config"].items() if k != "out"}, "train_run": m["run"],
               "summary": m["summary"], "stopped": result.stopped, "memory": m["memory"],
               "val": m["val"], "summary_text": text}
    path = save(NAME, payload)
    s = m["summary"]
    print(f"loss {s['start_loss']:.3f} -> {s['end_loss']:.3f}, val {s['start_val_loss']:.3f} -> "
          f"{s['end_val_loss']:.3f}, {s['steps']} steps, {s['tokens_per_s']:,.0f} tok/s; wrote {path}")


def render(result: dict) -> str:
    from render import machine_line

    s, bd = result["summary"], result["memory"]["step_breakdown"]
    run = result.get("train_run") or result["run"]
    lines = [
        "## train_default: the default `memfit train` run",
        "",
        "`.venv/bin/python bench/train_default.py` (the same run as `./scripts/train.sh`)",
        "",
        machine_line(result) + " " + run_line(result),
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
        "how busy the machine's cores were during the run (the load average above); the schedule length is "
        "fitted to the measured speed, so on idle cores more steps fit in the same time and the loss ends lower.",
    ]
    if "summary_text" in result:
        lines += ["", "What `memfit train` printed at the end:", "", "```", result["summary_text"], "```"]
    return "\n".join(lines)


def snippets(result: dict) -> dict[str, str]:
    """Blocks bench/render.py pastes into docs/*.md between <!-- bench:NAME --> and <!-- /bench:NAME -->."""
    if "summary_text" not in result:
        return {}
    r, m = result.get("run", {}), result["machine"]
    load = (f", 1-minute load average {r['load_start'][0]:.1f} at the start and {r['load_end'][0]:.1f} at the end"
            if "load_start" in r else "")
    return {"train_default.summary": "\n".join([
        "```", result["summary_text"], "```", "",
        f"That is `bench/train_default.py` (the same run), pasted by `python bench/render.py` from "
        f"`bench/results/train_default.json`: run {result['date']} on {m['cpu']}, {m['cores']} cores{load}; "
        "see [BENCHMARKS.md](BENCHMARKS.md#train_default-the-default-memfit-train-run)."])}


if __name__ == "__main__":
    main()
