"""Optimizers side by side: state bytes per parameter, step time and final validation loss on the
default training job, the state of Adafactor and the 8-/4-bit formats on the GPT-2-small shape, and
the largest model that trains in the 32 MiB budget of bench/precision_offload.py with 8-bit AdamW.

    .venv/bin/python bench/optimizers.py --optimizers adamw,adamw8bit,adamw4bit,adafactor,lion
    .venv/bin/python bench/optimizers.py            # every optimizer: ~2x longer

The first command took 908 s on 2 cores at load average ~17 (bench/results/optimizers.json).

1. Training. The default `memfit train` job (TrainConfig(): its model, data, batch, sequence
   length, warm-up + cosine schedule, clipping at 1.0, 32-true on CPU), a fixed number of steps per
   optimizer through the library API (memfit.train.loop's pieces). Every optimizer starts from the
   same weights and sees the same batches. The steps run in ROUNDS rounds; in each round every
   optimizer takes its next block of steps, in a freshly shuffled order, and the machine's load
   average is recorded. Step time: median over all timed steps (the first step of each optimizer,
   which creates its state, is left out), spread = the range of the per-round medians. State bytes
   per parameter: the optimizer's state tensors (memfit's TrainingOptimizer.state_tensors) after
   training, over the parameter count. Final validation loss on the job's fixed validation windows.
   Learning rates: the job's 2e-3 for the Adam family, and common defaults for the others (LR);
   they are not tuned here, so only the Adam-family rows compare trajectories.
2. GPT-2-small shape: optimizer state bytes per parameter measured by memfit's tracker on one
   training step traced under FakeTensorMode (nothing allocated), for Adafactor; the formulas'
   figure beside it for every optimizer.
3. The largest model under 32 MiB: bench/precision_offload.py's search (its model family, batch and
   budget, imported, not copied) with a probe for bf16-master + full activation checkpointing and
   no offload, with AdamW and with adamw8bit.
Every contender runs with one intra-op thread (a busy 2-core machine makes OpenMP barriers slow).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import fmt_bytes, save  # noqa: E402

from memfit.apply import optimizers  # noqa: E402
from memfit.apply.optimizer import TrainingOptimizer  # noqa: E402
from memfit.measure.formulas import optimizer_state_bytes, param_shapes  # noqa: E402
from memfit.train import data as data_mod  # noqa: E402
from memfit.train.loop import TrainConfig, accumulate_step, build_model, evaluate, lr_at  # noqa: E402

NAME = "optimizers"
STEPS = 30
ROUNDS = 5
LR = {"sgd": 0.3, "momentum": 0.05, "adagrad": 1e-2, "rmsprop": 5e-4, "lion": 2e-4, "adafactor": 1e-2}
PNG = ROOT / "docs" / "optimizers_loss.png"


# ---------------------------------------------------------------- 1. the default job, per optimizer
class Contender:
    def __init__(self, name: str, cfg: TrainConfig, corpus) -> None:
        torch.manual_seed(cfg.seed)
        self.name, self.cfg = name, cfg
        self.lr = LR.get(name, cfg.lr)
        self.model = build_model(cfg)
        self.opt = TrainingOptimizer(self.model, name, lr=self.lr, weight_decay=cfg.weight_decay, clip=cfg.clip)
        self.sampler = data_mod.WindowSampler(corpus.train, cfg.batch, cfg.seq, cfg.seed)
        self.step, self.losses, self.val, self.times = 0, [], [], []
        self.round_medians: list[float] = []

    def run(self, n: int, horizon: int) -> None:
        times = []
        for _ in range(n):
            for group in self.opt.param_groups:
                group["lr"] = lr_at(self.step, self.lr, self.cfg.warmup, horizon, self.cfg.min_lr_ratio)
            t0 = time.perf_counter()
            out = accumulate_step(self.model, self.opt, [self.sampler.next()])
            dt = time.perf_counter() - t0
            if self.step > 0:  # the first step also creates the optimizer state
                times.append(dt)
            self.step += 1
            self.losses.append(out.loss)
        self.times += times
        if times:
            self.round_medians.append(statistics.median(times))


def train_side_by_side(steps: int, rounds: int, which: list[str]) -> dict:
    cfg = TrainConfig(steps=steps)
    corpus = data_mod.load_corpus(cfg.data, min_split_bytes=cfg.seq + 1)
    val = data_mod.fixed_windows(corpus.val, cfg.eval_batches, cfg.batch, cfg.seq, cfg.seed + 1)
    names = [n for n in which if not optimizers.info(n).extra or _available(n)]
    runs = {n: Contender(n, cfg, corpus) for n in names}
    n_params = sum(p.numel() for p in runs[names[0]].model.parameters())
    rng = random.Random(0)
    per_round, loads = -(-steps // rounds), []
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        loads.append(os.getloadavg()[0])
        for n in order:
            c = runs[n]
            c.run(min(per_round, steps - c.step), steps)
            c.val.append((c.step, evaluate(c.model, c.opt, val, torch.device("cpu"))))
        print(f"  round {r + 1}/{rounds}: load {loads[-1]:.1f}, "
              + ", ".join(f"{n} {runs[n].val[-1][1]:.3f}" for n in names), flush=True)
    rows = []
    ref = runs["adamw"].val[-1][1]
    for n, c in runs.items():
        state = sum(t.numel() * t.element_size() for t in c.opt.state_tensors())
        c.opt.close()
        spec = optimizers.info(n)
        rows.append({
            "optimizer": n, "lr": c.lr, "lossless": spec.lossless,
            "state_bytes": state, "state_bytes_per_param": state / n_params,
            "formula_state_bytes": optimizer_state_bytes(n, param_shapes(c.model)),
            "step_seconds": statistics.median(c.times),
            "step_seconds_spread": [min(c.round_medians), max(c.round_medians)],
            "final_val_loss": c.val[-1][1], "val_vs_adamw_pct": 100 * (c.val[-1][1] / ref - 1),
            "train_loss": c.losses, "val": c.val,
        })
    return {"model": cfg.model, "params": n_params, "steps": steps, "rounds": rounds, "batch": cfg.batch,
            "seq": cfg.seq, "corpus": corpus.name, "load_avg_per_round": loads, "rows": rows}


def _available(name: str) -> bool:
    try:
        optimizers.check_available(name)
    except Exception:
        print(f"  {name}: skipped (torchao not installed: pip install 'memfit[lowbit]')")
        return False
    return True


# ---------------------------------------------------------------- 2. GPT-2-small shape
def gpt2_shape() -> dict:
    from memfit.measure.trace import trace_step
    from memfit.models.spec import parse_model

    spec = parse_model("gpt2")
    shapes = param_shapes(spec)
    n = sum(torch.Size(s).numel() for s in shapes)
    traced = trace_step(spec, batch=1, seq=64, optimizer="adafactor")
    return {"model": "gpt2", "params": n, "adafactor_traced_bytes": traced.optimizer,
            "adafactor_traced_per_param": traced.optimizer / n,
            "formula_per_param": {o: optimizer_state_bytes(o, shapes) / n for o in optimizers.NAMES}}


# ---------------------------------------------------------------- 3. largest model under 32 MiB
def largest_under_budget() -> dict:
    import precision_offload as po
    from memfit.apply.checkpoint import checkpoint
    from memfit.core.tracker import track
    from memfit.models.gpt import GPT, GPTConfig

    def probe(kind: str, layers: int) -> dict:
        torch.manual_seed(0)
        model = GPT(GPTConfig(layers=layers, **po.FIT_SHAPE))
        x, y = po.batch(po.FIT_BATCH, po.FIT_SHAPE["seq"])
        checkpoint(model, "full")
        opt = TrainingOptimizer(model, kind, lr=1e-3, precision="bf16-master")
        with track(model, opt) as t:
            for _ in range(2):
                po.memfit_step(model, opt, x, y)
        opt.close()
        print(f"  {kind:>10} bf16-master+ckpt {layers:>3} layers: peak {fmt_bytes(t.peak_bytes)}", flush=True)
        return {"layers": layers, "params": model.num_params(), "peak": t.peak_bytes, "host_peak": t.host_peak_bytes,
                "breakdown": t.breakdown}

    po.fit_probe = probe  # the search calls the module's probe: same search, our contenders
    out = {"budget": po.BUDGET, "fit_shape": po.FIT_SHAPE, "fit_batch": po.FIT_BATCH, "rows": []}
    for kind in ("adamw", "adamw8bit"):
        if optimizers.info(kind).extra and not _available(kind):
            continue
        row = po.largest_under_budget(kind)
        row["setup"] = f"memfit {kind} bf16-master+ckpt, no offload"
        out["rows"].append(row)
    return out


def plot(train: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for row in train["rows"]:
        xs, ys = zip(*row["val"])
        style = "-" if row["optimizer"].startswith("adam") else "--"
        ax.plot(xs, ys, style, marker="o", ms=3, label=f"{row['optimizer']} (lr {row['lr']:g})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title(f"{train['model']}: {train['steps']} steps per optimizer")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--optimizers", default=",".join(optimizers.NAMES),
                    help="comma-separated optimizers to train (adamw is always included: the reference)")
    args = ap.parse_args()
    which = [optimizers.info(n).name for n in args.optimizers.split(",")]
    which = which if "adamw" in which else ["adamw", *which]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]
    print("1. the default training job, per optimizer", flush=True)
    train = train_side_by_side(args.steps, args.rounds, which)
    print("2. GPT-2-small shape", flush=True)
    shape = gpt2_shape()
    print("3. largest model under the 32 MiB budget", flush=True)
    fit = largest_under_budget()
    load.append(os.getloadavg()[0])
    plot(train, PNG)
    payload = {"train": train, "gpt2_shape": shape, "fit": fit, "threads": 1, "load_avg": load,
               "seconds": time.perf_counter() - t0}
    path = save(NAME, payload)
    print(render({"bench": NAME, **payload}))
    print(f"wrote {path} and {PNG.relative_to(ROOT)} in {payload['seconds']:.0f} s")


def render(result: dict) -> str:
    from render import machine_line

    tr, shape, fit = result["train"], result["gpt2_shape"], result["fit"]
    lines = [
        "## optimizers: state bytes, step time and loss per optimizer",
        "",
        "`.venv/bin/python bench/optimizers.py` (see docs/optimizers.md; loss curves in docs/optimizers_loss.png)",
        "",
        machine_line(result) + f" One thread; load average {result['load_avg'][0]:.1f} -> {result['load_avg'][1]:.1f} "
        f"(per round: {', '.join(f'{x:.1f}' for x in tr['load_avg_per_round'])}); whole run {result['seconds']:.0f} s.",
        "",
        f"Default training job `{tr['model']}` ({tr['params'] / 1e6:.2f}M parameters, {tr['corpus']}, batch {tr['batch']} x "
        f"{tr['seq']}, 32-true, clip 1.0), {tr['steps']} steps per optimizer in {tr['rounds']} shuffled interleaved rounds. "
        "State bytes measured from the optimizer's state tensors (equal to the formula in every row: "
        "formula column). Learning rates are common defaults, untuned, except the Adam family's (the job's).",
        "",
        "| optimizer | lr | state B/param | formula B | step ms (median, round range) | final val loss | vs AdamW |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in tr["rows"]:
        lo, hi = r["step_seconds_spread"]
        lines.append(
            f"| {r['optimizer']}{'' if r['lossless'] else ' (lossy)'} | {r['lr']:g} | {r['state_bytes_per_param']:.3f} | "
            f"{r['formula_state_bytes']:,} | {1e3 * r['step_seconds']:.0f} ({1e3 * lo:.0f}-{1e3 * hi:.0f}) | "
            f"{r['final_val_loss']:.4f} | {r['val_vs_adamw_pct']:+.2f}% |")
    lines += [
        "",
        f"GPT-2-small shape ({shape['params'] / 1e6:.1f}M parameters): Adafactor's state measured by the tracker on a "
        f"FakeTensorMode training step, {fmt_bytes(shape['adafactor_traced_bytes'])} = "
        f"{shape['adafactor_traced_per_param']:.4f} B/param. Formulas, B/param: "
        + ", ".join(f"{o} {v:.3f}" for o, v in shape["formula_per_param"].items()) + ".",
        "",
        f"Largest model (bench/precision_offload.py's family: {fit['fit_shape']}, batch {fit['fit_batch']}) whose two "
        f"training steps peak under {fmt_bytes(fit['budget'])} by the tracker; bf16-master, full activation "
        "checkpointing, no offload:",
        "",
        "| setup | layers | parameters | peak | next depth's peak |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in fit["rows"]:
        lines.append(f"| {r['setup']} | {r['layers']} | {r['params'] / 1e6:.2f}M | {fmt_bytes(r['peak'])} | "
                     f"{r['next']['layers']} layers: {fmt_bytes(r['next']['peak'])} |")
    lines.append("")
    lines.append("On this CPU-only machine the device is host RAM: these are tracker figures (device-resident "
                 "tensor bytes), not a GPU's allocator.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
