"""`memfit profile`: what each block costs on this machine (time, bytes per action, offload), cached."""
from __future__ import annotations

import argparse
import json

from memfit.cli.args import integer
from memfit.cli.options import add, add_model, model_of
from memfit.core.units import format_bytes


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("profile", help="measure per-block time and memory costs on this machine (cached)",
                       description="Median warm step times with every block kept / recomputed / selective, "
                       "per-block bytes kept for backward under each action (exact, from the trace), and "
                       "host/disk bandwidth for offload. Cached in the user cache folder.")
    add_model(p)
    add(p, "batch", default=1)
    add(p, "seq", default=None, shown="the model's, at most 4096")
    add(p, "precision", default="32-true")
    p.add_argument("--rounds", type=integer(1, 1000), default=3, help="timed steps per policy (default 3)")
    p.add_argument("--no-cache", dest="cache", action="store_false", help="measure again, ignoring the cache")
    add(p, "json")
    return p


def run(args: argparse.Namespace) -> int:
    from memfit.profile.measure import profile

    prof = profile(model_of(args), batch=args.batch, seq=args.seq, precision=args.precision, rounds=args.rounds,
                   use_cache=args.cache)
    if args.json:
        print(json.dumps(prof.to_json(), indent=1))
        return 0
    b = prof.blocks
    print(f"{prof.key['model']}: batch {prof.key['batch']} x seq {prof.key['seq']}, {prof.key['precision']}"
          + (" (cached)" if prof.cached else ""))
    print("  step (median): " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in prof.step_s.items()))
    print(f"  per block: forward/recompute {b.fwd_s * 1000:.2f} ms, backward {b.bwd_s * 1000:.2f} ms, "
          f"selective extra {b.selective_s * 1000:.2f} ms")
    print("  kept for backward per block: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in b.saved.items())
          + f"; input {format_bytes(b.input_bytes)}")
    print("  bandwidth: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in prof.bandwidth.items())
          + "; offload per kept block: " + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in prof.offload_s.items()))
    return 0
