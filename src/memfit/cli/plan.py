"""`memfit plan`: the fastest configuration that fits a byte budget, ranked candidates and the chosen plan."""
from __future__ import annotations

import argparse
import json

from memfit.cli.options import add, add_model, model_of
from memfit.core.units import format_bytes, format_seconds
from memfit.plan.costs import PlanError
from memfit.train.config import DEFAULT_BATCH, DEFAULT_SEQ


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="find the fastest configuration that fits a memory budget",
                       description="Choose per-block activation actions (keep / selective / recompute / segments), "
                       "micro-batch x accumulation and optimizer offload so the predicted peak fits --budget; "
                       "prints the ranked configurations and the chosen plan. Exit code 2 when nothing fits.")
    add_model(p)
    p.add_argument("--budget", metavar="SIZE", help="device memory budget, e.g. 8GiB or 300MiB (default with a named "
                   "GPU in --device: its capacity less the CUDA context)")
    add(p, "batch", default=None, shown=f"{DEFAULT_BATCH} (memfit train's); 256 with --gpus",
        help="global batch per step (as memfit train's --batch x --accum)")
    add(p, "seq", default=None, shown=f"{DEFAULT_SEQ} (memfit train's), at most the model's; with --gpus the "
        "model's, at most 4096")
    p.add_argument("--drop-output", dest="keep_output", action="store_false",
                   help="the training loop drops the model's output (logits) before backward, as memfit train does "
                   "(default: budget for `out = model(...)` held through backward)")
    add(p, "precision", default=None, shown="32-true; bf16-master for a named GPU or with --gpus (not --device cpu)")
    add(p, "optimizer", default="adamw")
    add(p, "device", default=None, shown="cuda when available", help="where the model will train: cpu, cuda, or a "
        "GPU to plan for from any machine (h100, h200, a100-80gb, a100-40gb, l40s, rtx4090, ...)")
    p.add_argument("--allow", metavar="LIST", help="comma list of what the plan may use (default: recompute, selective, "
                   "offload-cpu, offload-disk, accumulate, chunked-head, optimizer-offload; on a CPU device without "
                   "offload-cpu and optimizer-offload, which save no physical memory there; also: compress, precision, "
                   "step-in-backward, which change the numbers a run computes)")
    p.add_argument("--profile", action="store_true",
                   help="time blocks on this machine (memfit profile, cached) instead of the FLOP time model")
    p.add_argument("--host-memory", metavar="SIZE", help="host RAM a node has for the plan (optimizer and "
                   "activation offload live there; on a CPU device the whole step does); default: this machine's "
                   "RAM; a GPU this machine lacks 256GiB; with --gpus on GPUs 2TiB per node of 8 (a DGX H100's)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip checking the chosen plan with a full trace of the step")
    p.add_argument("--lora", metavar="r=R,targets=NAME[,NAME...]",
                   help="plan a LoRA fine-tune of the frozen model (e.g. r=16,targets=q_proj,v_proj; one device)")
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA: the --lora fine-tune's frozen linear weights (all but the head) in NF4 "
                   "(docs/finetune.md)")
    add(p, "json", help="print one JSON object with a `plan` field (for memfit train --plan)")
    from memfit.cli import plan_cluster, plan_emit

    plan_cluster.add_flags(p)
    plan_emit.add_flags(p)
    return p


def run(args: argparse.Namespace) -> int:
    from memfit.cli.plan_emit import check_flags, emit_doc, read_plan
    from memfit.plan.fit import fit

    check_flags(args)
    if args.from_plan:
        return emit_doc(read_plan(args.from_plan), args, args.from_plan)
    args.model = model_of(args)
    device, gpu_note = _target(args)
    if args.qlora or args.lora:
        from memfit.models.lora import parse_lora, with_nf4_base

        args.lora = with_nf4_base(args.lora, "--qlora") if args.qlora else parse_lora(args.lora)
        if args.gpus is not None or args.profile:
            from memfit.core.errors import ConfigError

            raise ConfigError("--lora and --qlora plan one device on the FLOP time model; drop --gpus and --profile")
    if args.gpus is not None:  # several devices: memfit.plan.cluster_fit
        from memfit.cli.plan_cluster import run_cluster

        if gpu_note and not args.json:
            print(gpu_note)
        return run_cluster(args, args.model, "cuda" if args.device is None or device != "cpu" else device,
                           emit_doc if args.emit else None)
    if args.seq is None:
        args.seq = default_seq(args.model)
    batch = single_device_batch(args)
    costs = None
    if args.profile:
        from memfit.plan.costs import parse_budget
        from memfit.plan.plan import parse_allow
        from memfit.profile.measure import profile

        parse_budget(args.budget), parse_allow(args.allow)  # fail on bad input before measuring
        costs = profile(args.model, batch=batch, seq=args.seq, precision=args.precision,
                        optimizer=args.optimizer).blocks
    try:
        plan = fit(args.model, budget=args.budget, optimizer=args.optimizer, precision=args.precision,
                   allow=args.allow, batch=batch, seq=args.seq, verify=args.verify, costs=costs,
                   device=device, keep_output=args.keep_output, host_memory=args.host_memory, lora=args.lora)
    except PlanError as exc:  # name the smallest cluster that would fit
        from memfit.cli.plan_cluster import smallest_cluster_hint

        if args.lora:  # LoRA plans are for one device: a 4-bit base is the next step, not more devices
            hint = "" if args.lora.base == "nf4" else "; --qlora (the frozen base in 4 bits) may fit"
            raise PlanError(str(exc) + hint) from None

        hint = smallest_cluster_hint(args, args.model, "cuda" if args.device is None else device)
        raise PlanError(str(exc) + hint) from None
    if args.json:
        print(json.dumps({"plan": plan.to_json()}, indent=1))
        return 0
    if args.emit and not args.emit_to:  # stdout is the config
        return emit_doc({"plan": plan.to_json()}, args)
    print("\n".join(table(plan)))
    print()
    print(plan.summary())
    if gpu_note:
        print(gpu_note)
    if args.emit:
        print()
        return emit_doc({"plan": plan.to_json()}, args)
    return 0


def _target(args: argparse.Namespace) -> tuple[str, str]:
    """The device the plan is for (cpu, cuda or a named GPU such as h100) and, where a GPU's defaults were
    taken (precision, budget), the line that says so; fills args.precision and args.budget."""
    from memfit.core.device import estimate_device, resolve_device
    from memfit.core.errors import ConfigError

    traced_on, gpu = estimate_device(args.device) if args.device is not None else ("", None)
    device = gpu.name if gpu is not None else resolve_device(args.device).type
    said = []
    if args.budget is None:
        if gpu is None:
            raise ConfigError("give --budget SIZE (e.g. 8GiB), or name the GPU with --device (e.g. h100): its "
                              "capacity less the CUDA context is the budget")
        room = (gpu.memory - gpu.context) * 100 // 2**30 / 100  # GiB, rounded down to the hundredth
        args.budget = f"{room:.2f}GiB"
        said.append(f"budget {args.budget}: {gpu.label}'s capacity less the CUDA context")
    if args.precision is None:
        # --gpus plans GPUs unless --device cpu says the ranks are this machine's CPU processes
        on_gpu = gpu is not None or device == "cuda" or (args.gpus is not None and args.device != "cpu")
        args.precision = (gpu.default_precision if gpu is not None else "bf16-master") if on_gpu else "32-true"
        if on_gpu:
            said.append(f"precision {args.precision}: the default on a GPU (16-bit weights and activations, fp32 "
                        "master weights and optimizer state); --precision to change")
    return device, "\n".join(f"note: {s}" for s in said)


def single_device_batch(args: argparse.Namespace) -> int:
    """The global batch a one-device plan is for: --batch, else memfit train's default."""
    return args.batch or DEFAULT_BATCH


def default_seq(model: str) -> int:
    """memfit train's default sequence length, at most the model's own."""
    from memfit.models.spec import parse_model

    own = parse_model(model).seq
    return min(DEFAULT_SEQ, own) if own else DEFAULT_SEQ


def table(plan) -> list[str]:
    """The ranked configurations, one per line, columns padded to their widest cell (two spaces apart).
    Times are seconds only when measured costs priced them (--profile); otherwise the FLOP model's
    figure relative to the chosen plan, which ranks but does not predict."""
    timed = plan.time_basis == "profile"
    best = plan.predicted_time or 1e-12
    rows = [["micro x accum", "offload", "precision", "head", "peak", "step time" if timed else "rel. time", "actions"]]
    for c in plan.ranked:
        peak = "refused" if c.refused else format_bytes(c.peak) if c.feasible else "does not fit"
        time = "" if not c.feasible else format_seconds(c.time) if timed else f"{c.time / best:.2f}x"
        rows.append([f"{c.micro_batch} x {c.accumulation}", c.offload_optimizer or "-", c.precision,
                     str(c.head_chunks or "-"), peak, time, c.actions])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    right = {3, 4, 5}  # numbers line up on the right
    out = []
    for r in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))]
        out.append("  " + "  ".join(cells + [r[-1]]).rstrip())
    if not timed:
        out.append("  (rel. time: the uncalibrated FLOP model, 1.00x = the chosen plan; --profile times this machine)")
    return out
