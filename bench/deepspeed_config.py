"""DeepSpeed configs that `memfit plan --emit deepspeed` writes, run by DeepSpeed on 2 gloo ranks (CPU),
against `memfit estimate --deepspeed` of the same file.

    PYTHONPATH=src python bench/deepspeed_config.py [--rounds 3] [--steps 3] [--stages 3]

For ZeRO stage 1, 2 and 3: a plan of bench/distributed.py's model (2 ranks, batch 4 per rank, fp32,
AdamW, no checkpointing) is emitted as DeepSpeed's JSON; DeepSpeedConfig parses and validates the file;
memfit.integrations.deepspeed estimates each rank from the file; DeepSpeed trains with it
(`deepspeed.initialize(config=...)`, DeepSpeed building the optimizer the file names) and the allocator's
peak per rank over a step is measured as bench/distributed.py measures it. Two settings are added to each
emitted file for this tiny model, as bench/distributed.py sets them (recorded in the JSON): buckets of one
block's elements and ZeRO-3's persistence threshold 0 (DeepSpeed's defaults, 5e8-element buffers and
tensors under 1e5 elements left whole, are sized for billion-parameter models: at these sizes every
tensor would stay unsharded), and `torch_adam` (DeepSpeed's fused Adam is a compiled GPU kernel).
ZeRO-3 runs three times (CASES): as emitted, with stage3_max_reuse_distance 0, and with no prefetch
either, so that DeepSpeed's rules for holding weights whole are checked where they hold different weights. `--stages 3` runs only ZeRO-3's cases and prints them without saving.
Needs the bench's DeepSpeed venv (bash bench/setup_deepspeed.sh); this script re-runs itself under it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt_bytes, save  # noqa: E402
from distributed import BATCH, MODEL, _deepspeed_ready, _reexec_in_deepspeed_venv  # noqa: E402

STAGES = (1, 2, 3)
CASES = {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_reuse0": 3, "zero3_reuse0_noprefetch": 3}
"""ZeRO-3 as emitted (stage3_max_reuse_distance 1e9: this model keeps every weight gathered for backward);
with stage3_max_reuse_distance 0 (a module's weights released after it runs, but each module prefetches
another bucket while stage3_max_live_parameters allows, so they are gathered again ahead of backward); and
with no prefetch either (only the running module's weights held)."""
_CASE_KEYS = {"zero3_reuse0": {"stage3_max_reuse_distance": 0},
              "zero3_reuse0_noprefetch": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}
SPEC = "gpt:" + ",".join(f"{k}={v}" for k, v in MODEL.items())


def emitted(stage: int) -> dict:
    """The DeepSpeed config memfit emits for a zero{stage} plan on 2 ranks of this model."""
    from memfit.integrations.emit_deepspeed import config_of
    from memfit.integrations.emit_plan import PlanView
    from memfit.apply.policy import resolve_policy

    view = PlanView(model=SPEC, strategy=f"zero{stage}", world=2, dp=2, tp=1, pp=1, zero=stage, micro_batch=BATCH,
                    accumulation=1, seq=MODEL["seq"], precision="32-true", optimizer="adamw", offload_optimizer=None,
                    actions=resolve_policy("none", MODEL["layers"]))
    return config_of(view)[0]


def overrides(block: int, case: str) -> dict:
    zero = {"reduce_bucket_size": block, "allgather_bucket_size": block}
    if CASES[case] == 3:
        zero.update(stage3_prefetch_bucket_size=block, stage3_param_persistence_threshold=0)
    zero.update(_CASE_KEYS.get(case, {}))
    return {"zero_optimization": zero, "optimizer": {"params": {"torch_adam": True, "lr": 1e-3}}}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def _run(path: str, steps: int, rank: int, world: int) -> int:
    """DeepSpeed trains from the file; the allocator's peak over the steps after the first."""
    import deepspeed

    from memfit.measure.allocator import AllocatorProfile
    from memfit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, MODEL["vocab"], (BATCH * world, MODEL["seq"] + 1), generator=g) for _ in range(steps)]
    with AllocatorProfile() as prof:
        engine, _, _, _ = deepspeed.initialize(model=model, config=path, model_parameters=model.parameters())
        for s, b in enumerate(batches):
            b = b[rank * BATCH:(rank + 1) * BATCH]
            with prof.window(f"step{s}"):
                _, loss, n = engine(b[:, :-1].contiguous(), b[:, 1:].contiguous())
                engine.backward(loss / (n * world))
                engine.step()
    return max(prof.peak(f"step{s}") for s in range(1, steps))


def _work(rank: int, world: int, paths: dict, rounds: int, steps: int) -> dict:
    out: dict = {k: [] for k in paths}
    for r in range(rounds):
        order = list(paths)
        random.Random(r).shuffle(order)  # the same order on both ranks
        for k in order:
            out[k].append(_run(paths[k], steps, rank, world))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="+", choices=STAGES, default=list(STAGES),
                    help="run only these ZeRO stages (printed, not saved: the JSON holds all three)")
    args = ap.parse_args()
    _reexec_in_deepspeed_venv()
    skipped = _deepspeed_ready()
    if skipped:
        sys.exit(f"bench/deepspeed_config.py: {skipped}")
    from deepspeed.runtime.config import DeepSpeedConfig

    from memfit.distributed.spawn import run_world
    from memfit.integrations.deepspeed import bytes_per_rank, estimate_config
    from memfit.models.gpt import GPT, GPTConfig

    block = sum(p.numel() for p in GPT(GPTConfig(**MODEL)).blocks[0].parameters())
    scratch = tempfile.TemporaryDirectory(prefix="memfit-ds-")  # the configs: removed as main() ends, also on an error
    folder = Path(scratch.name)
    rows, paths = {}, {}
    for case in (c for c, stage in CASES.items() if stage in args.stages):
        config = emitted(CASES[case])
        run_config = _merge(config, overrides(block, case))
        path = folder / f"{case}.json"
        path.write_text(json.dumps(run_config))
        DeepSpeedConfig(str(path))  # DeepSpeed's own parse and validation of the file it will train with
        est = estimate_config(str(path), SPEC, world=2, seq=MODEL["seq"])
        rows[case] = {"emitted": config, "overrides": overrides(block, case), "estimate": bytes_per_rank(est)}
        paths[case] = str(path)
    load0 = os.getloadavg()
    ranks = run_world(_work, 2, args=(paths, args.rounds, args.steps), timeout_s=3000)
    for k, row in rows.items():
        row["measured"] = [statistics.median(r[k]) for r in ranks]
        row["measured_range"] = [[min(r[k]), max(r[k])] for r in ranks]
        row["ratio"] = row["estimate"] / max(row["measured"])
    if sorted(args.stages) != list(STAGES):
        print(table({"results": rows}))
        return
    path = save("deepspeed_config", {
        "command": f"PYTHONPATH=src python bench/deepspeed_config.py --rounds {args.rounds} --steps {args.steps}",
        "deepspeed": __import__("deepspeed").__version__, "model": MODEL, "batch_per_rank": BATCH, "world": 2,
        "rounds": args.rounds, "steps": args.steps, "load_before": load0, "load_after": os.getloadavg(),
        "results": rows})
    print(render(json.loads(path.read_text())))


def table(result: dict) -> str:
    lines = ["| emitted config | memfit estimate --deepspeed (per rank) | DeepSpeed measured peak (rank 0 / rank 1) "
             "| estimate / measured |", "|---|---|---|---|"]
    for k, r in result["results"].items():
        label = f"ZeRO-{CASES.get(k, k[-1])}" + "".join(f", {key} {v}" for key, v in _CASE_KEYS.get(k, {}).items())
        lines.append(f"| {label} | {fmt_bytes(r['estimate'])} | {fmt_bytes(r['measured'][0])} / "
                     f"{fmt_bytes(r['measured'][1])} | {r['ratio']:.3f} |")
    return "\n".join(lines)


def render(result: dict) -> str:
    from render import machine_line  # bench/render.py

    return "\n".join([
        "## DeepSpeed configs emitted by memfit, run by DeepSpeed (2 gloo ranks, CPU)", "",
        f"`{result['command']}`", "",
        f"GPT {result['model']}, AdamW, fp32, batch {result['batch_per_rank']} per rank, DeepSpeed "
        f"{result['deepspeed']} (DS_ACCELERATOR=cpu). Measured: the allocator's peak over a step (after the "
        f"first), median of {result['rounds']} rounds. Load average before/after: {result['load_before'][0]:.1f} / "
        f"{result['load_after'][0]:.1f}.", "", table(result), "", machine_line(result), ""])


def snippets(result: dict) -> dict[str, str]:
    return {"deepspeed_config": f"`{result['command']}` (DeepSpeed {result['deepspeed']}, 2 gloo ranks, batch "
            f"{result['batch_per_rank']} per rank, fp32; allocator peak over a step, median of {result['rounds']} "
            "rounds):\n\n" + table(result)}


if __name__ == "__main__":
    main()
