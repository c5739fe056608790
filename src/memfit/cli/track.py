"""`memfit track`: run real training steps, measure their memory, and compare with the prediction."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from memfit.cli.options import add, add_model, model_of
from memfit.core.tracker import CATEGORIES
from memfit.core.units import format_bytes


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "track",
        help="measure real training steps' memory and compare it with the prediction",
        description="Build the model with random weights, run real training steps (forward, backward, "
        "optimizer step) and report the last step's peak as memfit's tracker sees it (by category and "
        "module) and as the allocator saw it (profiler memory events), next to the no-allocation "
        "prediction of `memfit estimate`. Allocates for real: use a size that fits.",
    )
    add_model(p)
    add(p, "batch", default=1)
    add(p, "seq", default=None, shown="min(model's, 1024)")
    add(p, "precision", default="32-true")
    add(p, "optimizer", default="adamw")
    add(p, "checkpoint", default="none")
    add(p, "device", default="cpu")
    add(p, "steps", default=2, help="steps to run; the last is reported")
    p.add_argument("--no-predict", action="store_true", help="skip the FakeTensorMode prediction")
    add(p, "modules", default=8)
    add(p, "json")
    return p


def run(args: argparse.Namespace) -> int:
    from memfit.measure.trace import measure_step, trace_step
    from memfit.models.spec import parse_model
    from memfit.core.device import resolve_device

    spec = parse_model(model_of(args))
    spec.check_shape(args.batch, args.seq)
    from memfit.models.host_fit import check_fits_host

    check_fits_host(spec, "measure")  # the step runs for real: its weights must fit in this machine
    seq = args.seq or min(spec.seq or 1024, 1024)
    device = resolve_device(args.device)
    common = dict(batch=args.batch, seq=seq, precision=args.precision, optimizer=args.optimizer,
                  checkpoint=args.checkpoint, device=str(device), steps=args.steps)
    real = measure_step(spec, **common)
    pred = None if args.no_predict else trace_step(spec, **common)
    if args.json:
        print(json.dumps({"model": spec.name, **common, "measured": asdict(real),
                          "predicted": asdict(pred) if pred else None}, indent=1))
        return 0
    print(f"{spec.name}: batch {args.batch} x seq {seq}, {args.precision}, {args.optimizer}, "
          f"checkpoint {args.checkpoint}, {device}; step {args.steps} of {args.steps}")
    head = f"  {'at the peak':<14}{'measured':>14}" + (f"{'predicted':>14}" if pred else "")
    print("\n" + head)
    for cat in (*CATEGORIES, "total"):
        m = real.breakdown()[cat]
        line = f"  {cat:<14}{format_bytes(m):>14}"
        if pred:
            line += f"{format_bytes(pred.breakdown()[cat]):>14}"
        print(line)
    if real.allocator_peak is not None:
        print(f"  {'allocator':<14}{format_bytes(real.allocator_peak):>14}   (profiler memory events: "
              "also counts kernel workspaces that are never tensors)")
    if real.host_peak:
        print(f"  {'host copies':<14}{format_bytes(real.host_peak):>14}   (offloaded, not in the total)")
    if pred:
        err = 100.0 * (pred.peak - real.peak) / real.peak
        print(f"\n  prediction error: {err:+.2f}% vs tracker"
              + (f", {100.0 * (pred.peak - real.allocator_peak) / real.allocator_peak:+.2f}% vs allocator"
                 if real.allocator_peak else ""))
    if real.modules and args.modules > 0:
        print(f"\n  {'module (peak while it runs)':<40}{'peak':>14}{'saved for bwd':>16}")
        for name, peak in list(real.modules.items())[: args.modules]:
            act = real.module_activations.get(name, 0)
            print(f"  {name:<40}{format_bytes(peak):>14}{format_bytes(act):>16}")
    return 0
