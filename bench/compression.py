"""Gradient compression on the wire: bytes each rank sends, encode+decode cost, and convergence.

    .venv/bin/python bench/compression.py [--steps 150] [--model SPEC] [--optimizer adamw|momentum]
                                          [--compressors SPEC ...] [--lr LR] [--name NAME]

Two gloo ranks on 127.0.0.1 train memfit's GPT (models/gpt.py) on the default corpus
(train/data.py) with torch DDP and TrainingOptimizer (a contender "zero2 SPEC": memfit's ZeRO-2,
whose reduce-scatter carries the compressor), one model per compressor, all in the same
two processes: AdamW with the default job's betas, lr schedule and clipping (results/compression.json),
or with --optimizer momentum SGD with momentum 0.9 (results/compression_sgd.json), the setting of
DGC and EF-SignSGD, where a spec with momentum= moves the momentum before compression and the
optimizer is plain SGD. Every step visits the compressors in a
fresh shuffled order (the same on both ranks), so machine load hits them alike; step times are
the median and quartiles over all steps. Bytes are counted where the hooks call their
collectives (ring volumes: all_gather B * (N - 1), all_reduce 2B (N - 1) / N per rank, all_to_all
what goes to other ranks); the ratio is against fp32 all-reduce of the same buckets (ZeRO-2: its
fp32 reduce-scatter), over the whole run, warm-up steps included. Final validation loss is over fixed
validation windows, against the uncompressed run that saw the same data.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt_bytes, save  # noqa: E402

from memfit.apply.optimizer import TrainingOptimizer  # noqa: E402
from memfit.distributed.compression import register_compression  # noqa: E402
from memfit.distributed.strategy import distribute  # noqa: E402
from memfit.models.spec import parse_model  # noqa: E402
from memfit.train.data import WindowSampler, fixed_windows, load_corpus  # noqa: E402
from memfit.train.loop import evaluate, lr_at  # noqa: E402

NAME = "compression"
MODEL = "gpt:layers=2,hidden=128,heads=4,vocab=256,seq=64"
BATCH, SEQ, LR, WARMUP, CLIP, WORLD = 8, 64, 2e-3, 20, 1.0, 2  # lr, warm-up, clip: the default job's
COMPRESSORS = {
    # the default job's optimizer: every compressor; top-k and sign with plain error feedback and in
    # adam mode (each rank's Adam direction compressed, after 5 int8 warm-up steps that count in the
    # bytes), each with the other second-moment choice (var=), top-k keeping the largest |x| instead
    # of the largest max(0, x y) (select=x), sign without the local clip (clip=inf), and the lossy
    # ones with targets also under memfit's ZeRO-2
    "adamw": ["none", "topk:0.01,adam=off", "topk:0.01,adam=5", "topk:0.01,adam=5,select=x", "topk:0.01,adam=5,var=rank",
              "sign:adam=off", "sign:adam=5",
              "sign:adam=5,var=rank", "sign:adam=5,clip=inf", "int8", "powersgd:4",
              "zero2 topk:0.01,adam=5", "zero2 sign:adam=5", "zero2 int8"],
    # DGC's and EF-SignSGD's setting: momentum SGD, with the momentum moved before compression
    # (momentum=, plain SGD) against error feedback alone under momentum SGD
    "momentum": ["none", "topk:0.01,momentum=0.9,warmup=5", "topk:0.01", "sign:chunk=256,momentum=0.9", "int8"],
}
LRS = {"adamw": LR, "momentum": 0.5}
NAMES = {"adamw": NAME, "momentum": "compression_sgd"}
TARGETS = {"topk:0.01": (50, 0.02), "sign": (25, 0.03), "int8": (3.5, 0.005)}
"""compressor (and its variants with options): (at least this many times fewer bytes, final val loss within)."""
DOCS = Path(__file__).resolve().parent.parent / "docs"
ADAM_DEFAULTS, ADAM_DEFAULTS_SINCE = "owe=step,select=gain,var=batch", "2026-11-25"
"""adam mode's defaults since that date; a result written before it ran owe=direction, select=agree
and var=rank for sign (what an adam-mode spec without those options meant then)."""
ZERO2 = "zero2 "
"""A contender named "zero2 SPEC" trains with memfit's ZeRO-2 (compressed reduce-scatter) instead of DDP."""


def target_of(spec: str) -> tuple[float, float] | None:
    head = spec.removeprefix(ZERO2).split(",")[0]
    return TARGETS.get(head) or TARGETS.get(head.split(":")[0] if head.startswith(("sign", "int8")) else head)


def optimizer_for(spec: str, optimizer: str) -> str:
    """DGC's momentum correction (momentum= in the spec) replaces the optimizer's momentum: plain SGD."""
    return "sgd" if optimizer == "momentum" and "momentum=" in spec else optimizer


class Contender:
    def __init__(self, spec: str, model_spec: str, corpus, rank: int, optimizer: str, lr: float) -> None:
        torch.manual_seed(0)  # same initial weights for every compressor and rank
        self.spec, self.lr = spec, lr
        self.model = parse_model(model_spec).build(seq=SEQ)
        extra = {"betas": (0.9, 0.95)} if optimizer == "adamw" else {}  # the default job's AdamW
        self.zero = spec.startswith(ZERO2)
        if self.zero:  # memfit's strategies sum gradients: each rank divides by the global token count
            codec = spec[len(ZERO2):]
            self.opt = distribute(self.model, "zero2", optimizer_for(codec, optimizer), lr=lr, clip=CLIP, engine="memfit",
                                  **extra)
            self.ddp = self.model
            self.state = register_compression(self.opt, codec)
        else:
            self.opt = TrainingOptimizer(self.model, optimizer_for(spec, optimizer), lr=lr, clip=CLIP, **extra)
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
            self.state = register_compression(self.ddp, spec, optimizer=self.opt)
        self.sampler = WindowSampler(corpus.train, BATCH, SEQ, seed=1 + rank)  # same data per compressor
        self.losses, self.times, self.val = [], [], []

    def step(self, step: int, horizon: int) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, self.lr, WARMUP, horizon)
        x, y = self.sampler.next()
        t0 = time.perf_counter()
        _, loss, n = self.ddp(x, y)  # memfit GPT: (logits, summed loss, tokens)
        self.opt.backward(loss / (n * WORLD if self.zero else n), final=True)
        self.opt.step()
        self.times.append(time.perf_counter() - t0)
        self.losses.append(float(loss.detach()) / int(n))


def _run(rank: int, port: int, steps: int, model_spec: str, out: str, specs: list[str], optimizer: str,
         lr: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        corpus = load_corpus(min_split_bytes=SEQ + 1)
        val = fixed_windows(corpus.val, 4, 16, SEQ, seed=1234)
        contenders = [Contender(s, model_spec, corpus, rank, optimizer, lr) for s in specs]
        order = list(contenders)
        for step in range(steps):
            random.Random(step).shuffle(order)  # same seed on both ranks: same collective order
            for c in order:
                c.step(step, steps)
            if (step + 1) % max(1, steps // 4) == 0 or step + 1 == steps:
                for c in contenders:
                    c.val.append((step + 1, evaluate(c.model, c.opt, val, torch.device("cpu"))))
        rows = [{"compressor": c.spec, "losses": c.losses, "times": c.times, "val": c.val,
                 "summary": c.state.summary(), "mode": str(c.state.spec)} for c in contenders]
        torch.save(rows, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def summarize(ranks: list[list[dict]]) -> list[dict]:
    """One row per compressor: bytes and ratio (rank 0's counters; both ranks send the same),
    step time quartiles over both ranks, encode+decode share, and losses averaged over ranks."""
    rows = []
    base_val = ranks[0][0]["val"][-1][1]
    for i, r0 in enumerate(ranks[0]):
        times = [t for r in ranks for t in r[i]["times"][1:]]  # step 0 builds DDP's buckets
        s = r0["summary"]
        coding = sum(r[i]["summary"]["encode_s"] + r[i]["summary"]["decode_s"] for r in ranks)
        total = sum(sum(r[i]["times"]) for r in ranks)
        losses = [statistics.fmean(v) for v in zip(*(r[i]["losses"] for r in ranks))]
        final = r0["val"][-1][1]
        row = {"compressor": r0["compressor"], "mode": r0.get("mode", r0["compressor"]),
               "bytes_sent_per_step": s["bytes_sent_per_step"],
               "uncompressed_bytes_per_step": s["uncompressed_bytes_per_step"], "ratio": s["ratio"],
               "step_s_quartiles": _quartiles(times), "coding_share": coding / total,
               "coding_includes_collectives": r0["compressor"].startswith("powersgd"),
               "final_val_loss": final, "val_vs_none": final / base_val - 1,
               "val_curve": r0["val"], "train_loss": losses}
        if target_of(row["compressor"]) is not None:
            fewer, within = target_of(row["compressor"])
            row["target"] = {"ratio_at_least": fewer, "loss_within": within,
                             # one-sided: a lower loss than uncompressed is within any margin
                             "met": bool(row["ratio"] >= fewer and row["val_vs_none"] <= within)}
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path, optimizer: str = "adamw") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        xs = r["train_loss"]
        k = 10  # moving average: single steps of 16 sequences are noisy
        smooth = [statistics.fmean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]
        line, = ax.plot(range(1, len(xs) + 1), smooth, label=r["compressor"], linewidth=1)
        vx, vy = zip(*r["val_curve"])
        ax.plot(vx, vy, "o", color=line.get_color(), markersize=3)
    # a diverging run would flatten every other curve: clip the axis just above the starting loss
    ax.set_ylim(top=max(r["train_loss"][0] for r in rows) + 0.3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte): lines train (10-step mean), dots validation")
    ax.set_title(f"2 gloo ranks, compressed gradient exchange (DDP hooks, ZeRO-2), {optimizer}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def measure(steps: int, model: str, specs: list[str], optimizer: str, lr: float) -> list[dict]:
    """Train every spec on two spawned ranks, interleaved; one summarized row per spec."""
    out = f"/tmp/memfit_bench_compression_{os.getpid()}"
    run_args = (_free_port(), steps, model, out, specs, optimizer, lr)
    ctx = mp.start_processes(_run, args=run_args, nprocs=WORLD, join=False, start_method="spawn")
    while not ctx.join(timeout=30):
        pass
    ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    for r in range(WORLD):
        os.remove(f"{out}.{r}")
    return summarize(ranks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "momentum"),
                    help="adamw: the default job's; momentum: SGD with momentum 0.9, DGC's setting")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: 0.002 for adamw, 0.5 for momentum)")
    ap.add_argument("--compressors", nargs="+", help="specs, the first is the baseline (default: per optimizer); "
                    "'zero2 SPEC' or zero2/SPEC trains SPEC under memfit's ZeRO-2")
    ap.add_argument("--name", help="results/<name>.json and docs/<name>_loss.png (default: compression, "
                    "compression_sgd for momentum)")
    args = ap.parse_args()
    args.lr = args.lr or LRS[args.optimizer]
    args.compressors = args.compressors or COMPRESSORS[args.optimizer]
    # "zero2/SPEC" is "zero2 SPEC" without the space (bench/benches.txt splits its arguments on spaces)
    args.compressors = [ZERO2 + c[len("zero2/"):] if c.startswith("zero2/") else c for c in args.compressors]
    args.name = args.name or NAMES[args.optimizer]
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    rows = measure(args.steps, args.model, args.compressors, args.optimizer, args.lr)
    png = DOCS / f"{args.name}_loss.png"
    plot(rows, png, args.optimizer)
    wall = time.perf_counter() - t0
    for r in rows:
        print(f"{r['compressor']:>20}: {fmt_bytes(r['bytes_sent_per_step'])}/step ({r['ratio']:.1f}x fewer), "
              f"coding {100 * r['coding_share']:.1f}% of step, val {r['final_val_loss']:.4f} "
              f"({100 * r['val_vs_none']:+.2f}%)")
    opt = (f"AdamW betas (0.9, 0.95)" if args.optimizer == "adamw" else
           "SGD momentum 0.9 (plain SGD where the spec has DGC's momentum=)")
    command = " ".join(["bench/compression.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    path = save(args.name, {"script": NAME, "name": args.name, "command": command, "model": args.model, "png": png.name, "optimizer_name": args.optimizer, "batch_per_rank": BATCH, "seq": SEQ, "world": WORLD, "steps": args.steps,
                       "optimizer": f"{opt} lr {args.lr:g} (warm-up {WARMUP}, cosine), clip {CLIP}",
                       "threads_per_rank": 1,
                       "load_avg": [load_before, os.getloadavg()[0]], "wall_s": wall, "rows": rows})
    print(f"wrote {path} and {png} in {wall:.0f} s")


def render(result: dict) -> str:
    from render import machine_line

    a, b = result["load_avg"]
    png = result.get("png", "compression_loss.png")
    command = result.get("command", f"bench/compression.py --steps {result['steps']}")
    lines = [
        f"## {result.get('name', NAME)}: gradient bytes on the wire vs convergence (2 gloo ranks, DDP comm hooks"
        f"{' and ZeRO-2' if any(r['compressor'].startswith(ZERO2) for r in result['rows']) else ''}, "
        f"{result.get('optimizer_name', 'adamw')})",
        "",
        f"`.venv/bin/python {command}`",
        "",
        machine_line(result),
        "",
        f"Model `{result['model']}`, {result['world']} ranks x {result['batch_per_rank']} sequences x "
        f"{result['seq']} bytes, {result['steps']} steps, {result['optimizer']}; every compressor trains "
        f"its own model from the same weights on the same data, all interleaved in one run (shuffled order "
        f"each step). Bytes = what each rank sends per step, counted at the collective calls (ring "
        f"volumes; all_to_all: what goes to the other rank), averaged over all steps, warm-up steps included; "
        f"ratio vs fp32 all-reduce (rows `zero2 ...`: memfit's ZeRO-2, whose compressed reduce-scatter "
        f"replaces an fp32 reduce-scatter, the ratio's baseline there; its weight all-gather is not "
        f"gradient traffic and is left out). Coding = encode+decode time as a share of step time "
        f"(PowerSGD: its collectives are inside that time). Step time: median [quartiles] over all steps "
        f"of both ranks. Load average {a:.1f} before, {b:.1f} after, on {result['machine']['cores']} cores; "
        f"run took {result['wall_s']:.0f} s. Loss curves: [{png}]({png}).",
        "",
        *(["Rows `topk:0.01` and `sign` of this run ran before plain specs chose their mode from the optimizer: "
            "they are plain error feedback (today's `topk:0.01,adam=off`, `sign:adam=off`).", ""]
          if result.get("optimizer_name", "adamw") == "adamw"
          and any(r["compressor"] in ("topk:0.01", "sign") and "mode" not in r
                  for r in result["rows"]) else []),
        *([f"Measured before `{ADAM_DEFAULTS}` became adam mode's defaults: an adam-mode row ran with "
           "`owe=direction`, `select=agree` and, for sign, `var=rank` wherever its spec does not name them.", ""]
          if result.get("date", "") < ADAM_DEFAULTS_SINCE and any("adam=" in r.get("mode", r["compressor"])
                                                   and "adam=off" not in r.get("mode", r["compressor"])
                                                   for r in result["rows"]) else []),
        "| compressor | bytes/step/rank | fewer bytes | coding share | step s (median [q1, q3]) | final val loss | vs none | target |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        q1, med, q3 = r["step_s_quartiles"]
        t = r.get("target")
        target = (f">= {t['ratio_at_least']}x, <= +{100 * t['loss_within']:g}%: {'met' if t['met'] else 'NOT met'}"
                  if t else "reported")
        lines.append(f"| `{r['compressor']}` | {fmt_bytes(r['bytes_sent_per_step'])} | {r['ratio']:.1f}x | "
                     f"{100 * r['coding_share']:.1f}% | {med:.3f} [{q1:.3f}, {q3:.3f}] | "
                     f"{r['final_val_loss']:.4f} | {100 * r['val_vs_none']:+.2f}% | {target} |")
    return "\n".join(lines)


def snippets(result: dict) -> dict[str, str]:
    """A compact table per result name, for docs/compression.md (<!-- bench:NAME -->)."""
    lines = [f"`.venv/bin/python {result.get('command', NAME)}` ({result['steps']} steps, load "
             f"{result['load_avg'][0]:.1f} -> {result['load_avg'][1]:.1f}, {result['wall_s']:.0f} s):", "",
             "| compressor | fewer bytes | final val loss | vs none |", "|---|---:|---:|---:|"]
    lines += [f"| `{r['compressor']}` | {r['ratio']:.1f}x | {r['final_val_loss']:.4f} | {100 * r['val_vs_none']:+.2f}% |"
              for r in result["rows"]]
    return {f"{result.get('name', NAME)}_table": "\n".join(lines)}


if __name__ == "__main__":
    main()
