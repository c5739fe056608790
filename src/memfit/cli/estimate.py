"""`memfit estimate`: will training fit, and where does the memory go? Nothing is allocated."""
from __future__ import annotations

import argparse
import json
import re

from memfit.cli.args import integer
from memfit.cli.estimate_inputs import INPUT_HELP, is_factory, load_factory, parse_inputs
from memfit.cli.options import add, add_model, model_of
from memfit.core.errors import ConfigError
from memfit.core.gpus import NAMES as GPU_NAMES
from memfit.core.units import format_bytes, parse_bytes, parse_count


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "estimate",
        help="predict per-device training memory without allocating",
        description="Predict the per-device memory of one training step (steady state, after the optimizer "
        "state exists) without allocating: model states from closed-form formulas, activations and "
        "temporaries by tracing the real model under FakeTensorMode.",
    )
    add_model(p)
    p.add_argument("--torchtitan", metavar="JOB.toml",
                   help="estimate a torchtitan job as its train-config TOML sets it up (model flavor, local batch, "
                   "seq_len, mixed precision, parallel degrees, activation checkpointing) on --world ranks; "
                   "the other shape and strategy options come from the file")
    p.add_argument("--deepspeed", metavar="DS_CONFIG.json",
                   help="estimate MODEL under a DeepSpeed config: ZeRO stage, optimizer offload, bf16/fp16, "
                   "micro-batch, gradient accumulation and activation checkpointing from the file, per rank on --world "
                   "ranks (docs/integrations.md)")
    p.add_argument("--params", type=str, help="parameter count (e.g. 7B) for a model-states-only estimate")
    add(p, "batch", default=1)
    add(p, "seq", default=None, shown="the model's, at most 4096")
    add(p, "precision", default=None, shown="32-true; bf16-master on a named GPU")
    add(p, "optimizer", default="adamw")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage (default 0); with --world N the same as --strategy zeroS")
    p.add_argument("--world", type=integer(1), default=1, help="ranks (default 1)")
    p.add_argument("--strategy", choices=("ddp", "ps", "zero1", "zero2", "zero3", "pipeline", "tensor"),
                   help="distributed strategy: print each rank's figures for --world ranks (docs/distributed.md)")
    p.add_argument("--engine", choices=("auto", "memfit", "fsdp2", "zero-redundancy"), default="auto",
                   help="who runs the strategy: auto (default: FSDP2 for zero2/zero3 where memfit train would run "
                   "it, else memfit's flat engine, named on stderr); memfit; torch's FSDP2 for zero2/zero3, or "
                   "with --strategy tensor FSDP2 over dp x the tensor plan over tp (2-D, a Hugging Face config); "
                   "zero-redundancy: zero1 on DDP with ZeroRedundancyOptimizer (docs/distributed.md)")
    p.add_argument("--microbatches", type=integer(1), help="--strategy pipeline: micro-batches (default --world)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b",
                   help="--strategy pipeline (default 1f1b; interleaved: torch's interleaved 1F1B)")
    p.add_argument("--virtual-stages", type=integer(1), metavar="V", help="--schedule interleaved: stages per rank (default 2)")
    p.add_argument("--pp", type=integer(1), help="--strategy pipeline --engine fsdp2: pipeline stages of the 3-D "
                   "(pp, dp, tp) mesh (default --world / --tp); dp = world / (pp x tp)")
    p.add_argument("--tp", type=integer(1), help="--strategy tensor: tensor-parallel degree (default --world); "
                   "--batch stays per process, so each TP group runs tp x batch rows")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="--strategy tensor: Megatron-LM's sequence parallelism (norms, dropouts and saved inputs "
                   "sharded over tp); estimated only, memfit train does not run it")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="--strategy tensor: the embedding and the head (and the loss over the logits) split over tp "
                   "by vocabulary, as Megatron-LM and torchtitan do; estimated only, memfit train does not run it")
    p.add_argument("--accum", type=integer(1), default=1, metavar="K",
                   help="micro-batches per optimizer step (default 1): the gradients of the earlier ones are held "
                   "through the later ones (ZeRO-2/3: each rank's reduced slices)")
    p.add_argument("--reshard-after-forward", metavar="true|false|N",
                   help="--engine fsdp2: FSDP2's reshard_after_forward (default true; false with --strategy zero2, "
                   "i.e. shard_grad_op; N: keep a 1/N shard of each block from forward to backward)")
    add(p, "checkpoint", default="none")
    add(p, "offload_optimizer", default="none")
    add(p, "step_in_backward", default=False)
    add(p, "device", default=None, help="cpu (default), or a GPU to estimate for from any machine: "
        f"{GPU_NAMES} (its kernels, its caching allocator's reserve, its memory); cuda: this machine's GPU")
    p.add_argument("--device-memory", metavar="SIZE", help="device budget, e.g. 24GiB or 80GB: says if it fits "
                   "(default with a named GPU: its capacity)")
    add(p, "modules", default=8)
    add(p, "json")
    p.add_argument("--input", action="append", default=[], metavar="SPEC",
                   help=f"one input of a model factory MODULE:FUNCTION: {INPUT_HELP}; repeat for each")
    p.add_argument("--lora", metavar="r=R,targets=NAME[,NAME...]",
                   help="fine-tune LoRA adapters on a frozen base (e.g. r=8,targets=q_proj,v_proj; alpha=A optional; "
                   "base=nf4: the base in 4 bits, as --qlora)")
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA: the --lora fine-tune's frozen linear weights (all but the head) in torchao's NF4, "
                   "double-quantized (docs/finetune.md)")
    p.add_argument("--task", choices=("causal-lm", "seq2seq", "masked-lm", "image-classification"),
                   help="for a config.json: the model family to build (default: from the config's architectures)")
    p.add_argument("--image-size", type=integer(1), metavar="N",
                   help="for an image model's config.json: N x N pixel inputs (default: the config's image_size)")
    p.add_argument("--routing", choices=("balanced", "worst"), default="balanced",
                   help="mixture-of-experts layers: tokens spread evenly over the experts, or the most one expert can "
                   "receive (default balanced)")
    p.add_argument("--loss", metavar="MODULE:FUNCTION",
                   help="for a model factory: loss = FUNCTION(output, inputs) (default: output.loss, output[1], "
                   "or the output itself when it is one number)")
    return p


def _estimate(args: argparse.Namespace):
    from memfit.measure.estimate import estimate
    from memfit.models.spec import parse_model

    model = model_of(args, required=False)
    if args.engine == "auto":
        from memfit.cli.estimate_inputs import auto_engine

        args.engine = auto_engine(args, model)
    if args.torchtitan:
        return _torchtitan(args, model)
    if args.deepspeed:
        return _deepspeed(args, model)
    if args.engine == "fsdp2" and args.strategy not in ("tensor", "pipeline") or args.reshard_after_forward is not None:
        return _fsdp2(args, model)  # (tensor and pipeline on fsdp2, the 2-D and 3-D layouts: estimate() below)
    if model is None and args.params is None:
        raise ConfigError("give a model (e.g. gpt2, a gpt:... spec, a config.json, my_pkg.models:build) or --params N")
    params = parse_count(args.params) if args.params is not None else None
    budget = parse_bytes(args.device_memory) if args.device_memory else None
    common = dict(precision=args.precision, optimizer=args.optimizer, zero=args.zero, world=args.world,
                  checkpoint=args.checkpoint, offload_optimizer=args.offload_optimizer, device_memory=budget,
                  routing=args.routing, strategy=args.strategy, microbatches=args.microbatches,
                  schedule=args.schedule, tp=args.tp, accum=args.accum, device=_device(args.device),
                  engine=args.engine, pp=args.pp, virtual_stages=args.virtual_stages)
    if args.step_in_backward:
        common["step_in_backward"] = True
    for flag in ("sequence_parallel", "vocab_parallel"):
        if getattr(args, flag):
            common[flag] = True
    if is_factory(model):  # any nn.Module: a factory and its example batch
        if not args.input:
            raise ConfigError(f"the model factory {model} needs its example batch: --input {INPUT_HELP}")
        example = parse_inputs(args.input)
        if args.lora or args.qlora:
            raise ConfigError("--lora and --qlora apply to a named model or config.json; a factory adds its own adapters "
                              "(e.g. peft.get_peft_model)")
        loss_fn = load_factory(args.loss) if args.loss else None
        est = estimate(load_factory(model), example, params=params, loss_fn=loss_fn, **common)
        est.model = model
        return est
    if args.lora and model is None:
        raise ConfigError("--lora needs a model (name, spec or config.json), not --params alone")
    if args.input or args.loss:
        raise ConfigError("--input and --loss are for a model factory (MODULE:FUNCTION), "
                          f"not of {model or '--params'}; use --batch and --seq")
    spec = None
    if model is not None:
        spec = parse_model(model, task=args.task, image_size=args.image_size, families=True)
        spec.check_shape(args.batch, args.seq)  # what `memfit train` would refuse, refused here too
    from memfit.models.lora import with_nf4_base

    lora = with_nf4_base(args.lora, "--qlora") if args.qlora else args.lora
    return estimate(spec, params=params, batch=args.batch, seq=args.seq, lora=lora, **common)


def _torchtitan(args: argparse.Namespace, model: str | None):
    from memfit.integrations.torchtitan import estimate_job

    if model is not None or args.params is not None:
        raise ConfigError("--torchtitan reads the model from the job file; drop the model / --params")
    if args.strategy or args.tp or args.zero or args.lora or args.qlora or args.input:
        raise ConfigError("--torchtitan takes the strategy and its degrees from the job file; drop --strategy, "
                          "--tp, --zero, --lora and --input")
    kw = {"device_memory": parse_bytes(args.device_memory)} if args.device_memory else {}
    if getattr(args, "device", None) is not None:  # a GPU target, where estimate takes one
        kw["device"] = _device(args.device)
    return estimate_job(args.torchtitan, args.world, **kw)


def _deepspeed(args: argparse.Namespace, model: str | None):
    from memfit.integrations.deepspeed import estimate_config
    from memfit.models.spec import parse_model

    if model is None:
        raise ConfigError("--deepspeed needs the model it trains (a name, gpt:... spec or config.json)")
    if args.strategy or args.zero or args.tp or args.input or args.accum != 1 or args.batch != 1:
        raise ConfigError("--deepspeed takes the ZeRO stage, micro-batch and accumulation from the file; drop "
                          "--strategy, --zero, --tp, --batch, --accum and --input")
    if args.precision is not None or args.offload_optimizer not in (None, "none"):
        raise ConfigError("--deepspeed takes precision and optimizer offload from the file (bf16 / fp16 / "
                          "torch_autocast, zero_optimization.offload_optimizer); drop --precision and --offload-optimizer")
    kw = {"device_memory": parse_bytes(args.device_memory)} if args.device_memory else {}
    if args.device is not None:
        kw["device"] = _device(args.device)
    spec = parse_model(model, task=args.task, families=True)
    checkpoint = None if args.checkpoint in (None, "none") else args.checkpoint
    return estimate_config(args.deepspeed, spec, args.world, checkpoint=checkpoint, optimizer=args.optimizer,
                           seq=args.seq, lora=args.lora, **kw)


def _fsdp2(args: argparse.Namespace, model: str | None):
    from memfit.measure.estimate import estimate
    from memfit.measure.fsdp2_estimate import fsdp2_estimate
    from memfit.models.spec import parse_model

    if args.engine != "fsdp2":
        raise ConfigError("--reshard-after-forward is FSDP2's option: add --engine fsdp2")
    if args.pp is not None:
        raise ConfigError("--pp (pipeline stages) is the 3-D layout's: give --strategy pipeline --engine fsdp2")
    if model is None or is_factory(model):
        raise ConfigError("--engine fsdp2 traces a model name, gpt:... spec or config.json (give one)")
    if args.strategy not in (None, "zero3", "zero2") or args.zero not in (0, 2, 3):
        raise ConfigError(f"--engine fsdp2 shards like zero3 (zero2: weights kept from forward to backward; tensor: "
                          f"2-D with --tp), not {args.strategy or f'zero{args.zero}'}; use --engine memfit for the "
                          "other strategies")
    unsupported = [f for f, on in (("--tp", args.tp), ("--microbatches", args.microbatches), ("--accum", args.accum != 1),
                                   ("--offload-optimizer", args.offload_optimizer not in (None, "none")),
                                   ("--lora/--qlora", args.lora or args.qlora), ("--input", args.input),
                                   ("--step-in-backward", args.step_in_backward), ("--params", args.params)) if on]
    if unsupported:
        raise ConfigError(f"--engine fsdp2 is estimated for one micro-batch of a fully trained model on the device; "
                          f"drop {', '.join(unsupported)} (or use --engine memfit)")
    zero2 = args.strategy == "zero2" or args.zero == 2
    reshard = _reshard_value(args.reshard_after_forward, default=not zero2)
    spec = parse_model(model, task=args.task, families=True)
    spec.check_shape(args.batch, args.seq)
    kw = {"device_memory": parse_bytes(args.device_memory)} if args.device_memory else {}
    if args.device is not None:
        kw["device"] = _device(args.device)
    gpu = kw.get("device") not in (None, "cpu", "cuda")
    precision = args.precision or ("bf16-mixed" if gpu else "32-true")  # what FSDP2 runs on a GPU by default
    return fsdp2_estimate(estimate, spec, args.batch, args.seq, args.world, precision=precision,
                          optimizer=args.optimizer, checkpoint=args.checkpoint, reshard=reshard, **kw)


def _reshard_value(text: str | None, default: bool) -> bool | int:
    if text is None:
        return default
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low.isdigit() and int(low) >= 1:
        return int(low)
    raise ConfigError(f"--reshard-after-forward {text!r}: give true, false or a number of ranks N (a divisor "
                      "of --world)")


def _device(name: str | None) -> str | None:
    """A named GPU passes through; cpu or cuda must be usable here (resolve_device's one-line refusals)."""
    from memfit.core.device import estimate_device

    if name is None:
        return None
    _, gpu = estimate_device(name)  # cuda without CUDA: one line naming the GPUs it could estimate for
    return gpu.name if gpu is not None else name


def run(args: argparse.Namespace) -> int:
    from memfit.measure.estimate import CATEGORIES

    est = _estimate(args)
    if (args.torchtitan or args.deepspeed or args.engine == "fsdp2") and not args.json:
        print(est.note + "\n")
    if args.json:
        engine = {"engine": args.engine} if est.strategy and not (args.torchtitan or args.deepspeed) else {}
        text = json.dumps({**est.to_json(), **engine}, indent=1)
        # a list of rank ids on one line (world 1024 stays a few lines)
        print(re.sub(r"\[\n\s*(\d+(?:,\n\s*\d+)*)\n\s*\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text))
        return 0
    if est.ranks:  # per-rank figures (memfit.measure.rank_estimate)
        from memfit.cli.ranks import print_per_rank

        return print_per_rank(args, est)
    shape = f"batch {est.batch} x seq {est.seq}, " if est.traced and est.batch else ""
    name = f"{est.model}: " if est.traced else ""
    precision = est.precision + (f" (the default on {est.device}: bf16 weights and activations, fp32 master "
                                 "weights and optimizer state; --precision to change)" if est.precision_default else "")
    print(f"{name}{est.n_params / 1e6:,.1f}M parameters, {shape}{precision}, {est.optimizer}, "
          f"ZeRO-{est.zero} on {est.world} device(s), checkpoint {est.checkpoint}"
          + (f", optimizer offloaded to {est.offload_optimizer}" if est.offload_optimizer else "")
          + (", optimizer step in backward (no gradient buffer)" if est.step_in_backward else ""))
    if args.lora or args.qlora:
        from memfit.models.lora import parse_lora

        cfg = parse_lora(args.lora)
        base = "NF4 (4-bit, QLoRA)" if args.qlora or cfg.base == "nf4" else "in the precision mode's dtype"
        print(f"LoRA r={cfg.r} on {', '.join(cfg.targets)}; base weights: {base}")
    if est.device:
        from memfit.core.gpus import target

        attn = ", ".join(f"{k} x{v}" for k, v in est.attention.items()) or "none"
        print(f"traced as {target(est.device).label} runs it (attention: {attn})")
    print(f"\n  {'per device':<14}{'bytes':>16}{'':>12}")
    for cat in CATEGORIES:
        value = est.per_device[cat]
        share = f"{100 * value / est.total:5.1f}%" if est.total else ""
        print(f"  {cat:<14}{format_bytes(value):>16}{share:>12}")
    print(f"  {'total (peak)':<14}{format_bytes(est.total):>16}   allocated tensors")
    if "reserved" in est.per_device:
        from memfit.measure.caching_allocator import expandable_from_env

        conf = ("expandable segments" if expandable_from_env() else
                "default allocator settings; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set, those")
        print(f"  {'reserved':<14}{format_bytes(est.per_device['reserved']):>16}   the caching allocator's "
              f"max_memory_reserved ({conf}): what runs out")
        print(f"  {'+ CUDA context':<14}{format_bytes(est.context):>16}   outside the allocator")
    if est.offloaded:
        print(f"  {'(off device)':<14}{format_bytes(est.offloaded):>16}")
    if est.note:
        print(f"\n  {est.note}")
    if not est.traced:
        print("\n  activations and temporaries not estimated: give a model to trace them")
    if est.modules and args.modules > 0:
        print(f"\n  {'module (peak while it runs)':<40}{'peak':>14}{'saved for bwd':>16}")
        shown = list(est.modules.items())[: args.modules]
        shown += [(n, v) for n, v in est.modules.items() if n.endswith(".experts") and (n, v) not in shown]
        acts = est.module_activations
        root = max(acts, key=acts.get) if acts else None  # the model itself (its class name) saves the most
        for name, peak in shown:  # mixture-of-experts layers always get their rows
            label = f"{name} (whole model: {est.model})" if name == root else name or "(model)"
            print(f"  {label[:39]:<40}{format_bytes(peak):>14}{format_bytes(acts.get(name, 0)):>16}")
    if est.device_memory is not None:
        what = " (reserve + CUDA context)" if "reserved" in est.per_device else ""
        verdict = (f"fits{what}, {format_bytes(est.headroom)} to spare" if est.fits
                   else f"does NOT fit{what}: {format_bytes(-est.headroom)} over")
        print(f"\n  device memory {format_bytes(est.device_memory)}: {verdict}")
    if est.traced and est.device:
        print(f"\n  estimated in {est.trace_seconds:.1f} s without allocating (the whole step traced under "
              f"FakeTensorMode as {est.device} runs it)")
    elif est.traced:
        print(f"\n  estimated in {est.trace_seconds:.1f} s without allocating (FakeTensorMode traces; per-block "
              "traces of model specs are cached on disk, MEMFIT_NO_CACHE=1 traces again)")
    return 0
