"""`memfit train --nproc 2` against torchrun starting the same two ranks: median step time.

    .venv/bin/python bench/launcher.py [--rounds 5] [--steps 15] [--strategy zero3]

Contenders (the same training, default model, --steps S, no evaluation in between, no tracker):
  nproc     memfit train --nproc 2 --strategy S ...            (memfit's launcher, OMP_NUM_THREADS unset:
                                                                it sets one thread per rank itself)
  torchrun  torchrun --nproc-per-node 2 -m memfit train --strategy S ...   (torchrun sets the same)
Each launch is one sample: the median of its steps' times from metrics.json (the first two steps,
which build buffers, left out). Rounds run both contenders in a fresh shuffled order; the figure
is the median over rounds with min/max, and the ratio nproc / torchrun per round. The machine's
load is recorded before and after. Target: nproc within 10% of torchrun.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, load, save, spread  # noqa: E402

NAME = "launcher"
TARGET = 1.10
"""nproc's median step time at most this times torchrun's."""


def _command(kind: str, strategy: str, steps: int, out: str) -> list[str]:
    py = sys.executable
    train = ["train", "--strategy", strategy, "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1",
             "--save-every", "0", "--no-track", "--quiet", "--device", "cpu", "--out", out]
    if kind == "nproc":
        return [py, "-m", "memfit", *train, "--nproc", "2"]
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "memfit", *train]


def _launch(kind: str, strategy: str, steps: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("OMP_NUM_THREADS", None)  # what a user's shell has: each launcher decides the threads
    with tempfile.TemporaryDirectory(prefix="memfit-bench-launcher-") as tmp:
        env["TMPDIR"] = tmp  # torchrun's log folder (torchelastic_*), which torchrun never removes
        out = str(Path(tmp) / "run")
        done = subprocess.run(_command(kind, strategy, steps, out), env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{kind} exited {done.returncode}: {done.stderr[-2000:]}")
        seconds = json.loads((Path(out) / "metrics.json").read_text())["steps"]["seconds"]
    return statistics.median(seconds[2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--keep", action="store_true", help="add these rounds to those in results/launcher.json "
                    "(same strategy and steps): more rounds on a loaded machine, each session under ten minutes")
    args = ap.parse_args()
    names = ["nproc", "torchrun"]
    old = RESULTS / f"{NAME}.json"
    prev = json.loads(old.read_text()) if args.keep and old.exists() else None
    if prev is not None and (prev["strategy"], prev["steps"]) != (args.strategy, args.steps):
        raise SystemExit("--keep: results/launcher.json has another strategy or step count")
    times: dict[str, list[float]] = {n: list(prev["step_s"][n]["times"]) if prev else [] for n in names}
    orders = list(prev["orders"]) if prev else []
    session = load()
    before = prev["load_before"] if prev else session
    rng, t0 = random.Random(len(orders)), time.perf_counter() - (prev["wall_s"] if prev else 0.0)
    for r in range(len(orders), len(orders) + args.rounds):
        order = names[:]
        rng.shuffle(order)
        orders.append(order)
        for name in order:
            times[name].append(_launch(name, args.strategy, args.steps))
        print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in order), flush=True)
    ratios = [a / b for a, b in zip(times["nproc"], times["torchrun"])]
    sessions = (prev.get("sessions", [[prev["load_before"], prev["load_after"]]]) if prev else []) + [[session, load()]]
    result = {"script": NAME, "command": f"bench/launcher.py --rounds {args.rounds} --steps {args.steps} "
              f"--strategy {args.strategy}" + (f" (then --keep: {len(orders)} rounds in all)" if prev else ""),
              "strategy": args.strategy, "steps": args.steps, "world": 2, "rounds": len(orders), "orders": orders,
              "load_before": before, "load_after": load(), "sessions": sessions,
              "wall_s": time.perf_counter() - t0, "step_s": {n: spread(times[n]) for n in names},
              "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "all": ratios},
              "target": TARGET}
    result["met"] = result["ratio"]["median"] <= TARGET
    print(f"wrote {save(NAME, result)}: nproc / torchrun median {result['ratio']['median']:.3f}")


def _table(result: dict) -> str:
    s, r = result["step_s"], result["ratio"]
    rows = ["| launcher | median step s | min | max |", "|---|---:|---:|---:|"]
    rows += [f"| {'`memfit train --nproc 2`' if n == 'nproc' else '`torchrun --nproc-per-node 2 -m memfit train`'} | "
             f"{s[n]['median']:.3f} | {s[n]['min']:.3f} | {s[n]['max']:.3f} |" for n in ("nproc", "torchrun")]
    sessions = result.get("sessions", [[result["load_before"], result["load_after"]]])
    loads = "; ".join(f"{a[0]:.1f} before, {b[0]:.1f} after" for a, b in sessions)
    return "\n".join(rows) + (
        f"\n\n--nproc / torchrun, per round: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}) over "
        f"{result['rounds']} interleaved rounds in shuffled order, --strategy {result['strategy']}, "
        f"{result['steps']} steps per launch; target <= {result['target']:.2f}: "
        f"{'met' if result['met'] else 'NOT met'}. Load average (1 min) per session: {loads}, on a shared "
        f"{result['machine']['cores']}-core machine (`{result['command']}`).")


def render(result: dict) -> str:
    from render import machine_line

    return "\n".join([f"## launcher: `memfit train --nproc 2` against torchrun ({result['strategy']})", "",
                      f"`.venv/bin/python {result['command']}`", "", machine_line(result), "", _table(result)])


def snippets(result: dict) -> dict[str, str]:
    return {NAME: _table(result)}


if __name__ == "__main__":
    main()
