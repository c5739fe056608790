"""Per-rank estimate against the tracker: `memfit estimate ... --strategy S --world N` next to each
rank's tracked step peak, for ddp and zero1-3, 32-true and bf16-master, N=2 and N=4 gloo ranks.

    PYTHONPATH=src python bench/rank_estimate.py [--worlds 2 4]

Memory figures are exact byte counts (no timing), so one run is enough; the same model and checks
as tests/test_distributed_rank_estimate.py.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

CFG = dict(layers=6, hidden=32, heads=4, vocab=64, seq=16)
SPEC = "gpt:layers={layers},hidden={hidden},heads={heads},vocab={vocab},seq={seq}".format(**CFG)
BATCH = 2
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
PRECISIONS = ("32-true", "bf16-master")


def _tracked(rank: int, world: int) -> dict:
    from memfit.core.tracker import track
    from memfit.distributed import distribute, global_count
    from memfit.models.gpt import GPT, GPTConfig

    g = torch.Generator().manual_seed(1)
    out = {}
    for precision in PRECISIONS:
        for strategy in STRATEGIES:
            torch.manual_seed(0)
            with distribute(GPT(GPTConfig(**CFG)), strategy, "adamw", lr=1e-2, precision=precision, clip=1.0) as opt:
                for step in range(3):  # tracked at the third: DDP rebuilds its buckets during the second
                    x = torch.randint(0, CFG["vocab"], (BATCH * world, CFG["seq"] + 1), generator=g)
                    x = x[rank * BATCH:(rank + 1) * BATCH]
                    tokens = global_count(x[:, 1:].numel())
                    tracker = track(opt.tracked_module, opt, device="cpu") if step == 2 else None
                    if tracker is not None:
                        tracker.__enter__()
                    with opt.micro_batch(True), opt.autocast():
                        _, loss, _ = opt.model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
                    opt.backward(loss / tokens, final=True)
                    opt.step()
                    if tracker is not None:
                        tracker.__exit__(None, None, None)
                        out[f"{precision} {strategy}"] = tracker.breakdown["total"]
    return out


def _estimate(strategy: str, world: int, precision: str) -> list[int]:
    from memfit.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["estimate", SPEC, "--batch", str(BATCH), "--strategy", strategy, "--world", str(world),
              "--precision", precision, "--optimizer", "adamw", "--json"])
    return [r["total"] for r in json.loads(buf.getvalue())["ranks"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    from memfit.distributed.spawn import run_world

    rows = []
    for world in args.worlds:
        measured = run_world(_tracked, world, timeout_s=900)
        for precision in PRECISIONS:
            for strategy in STRATEGIES:
                est = _estimate(strategy, world, precision)
                got = [m[f"{precision} {strategy}"] for m in measured]
                rows.append({"world": world, "precision": precision, "strategy": strategy, "estimate": est,
                             "measured": got})
    path = save("rank_estimate", {"command": "PYTHONPATH=src python bench/rank_estimate.py --worlds "
                                  + " ".join(map(str, args.worlds)), "model": SPEC, "batch_per_rank": BATCH,
                                  "rows": rows})
    print(render(json.loads(path.read_text())))


def _table(result: dict) -> str:
    lines = ["| N | precision | strategy | estimate | measured (tracker) | error |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        errors = [(e - m) / m for e, m in zip(r["estimate"], r["measured"])]
        same = len(set(r["measured"])) == 1 and len(set(r["estimate"])) == 1
        measured = f"{r['measured'][0]:,}" if same else " / ".join(f"{m:,}" for m in r["measured"])
        err = f"{errors[0]:+.2%}" if same else f"{min(errors):+.2%} .. {max(errors):+.2%}"
        lines.append(f"| {r['world']} | {r['precision']} | {r['strategy']} | {r['estimate'][0]:,} | {measured} | {err} |")
    return "\n".join(lines)


def render(result: dict) -> str:
    from render import machine_line  # bench/render.py

    return "\n".join([
        "## Per-rank estimate against the tracker", "",
        f"`{result['command']}`", "",
        f"{result['model']}, batch {result['batch_per_rank']} per rank, AdamW, clip 1.0; bytes at the third step "
        "(every rank of a row agrees unless listed).", "",
        _table(result), "", machine_line(result), ""])


def snippets(result: dict) -> dict[str, str]:
    return {"rank_estimate": _table(result)}


if __name__ == "__main__":
    main()
