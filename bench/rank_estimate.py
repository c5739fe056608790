"""Per-rank estimate against the tracker: `memfit estimate ... --strategy S --world N` next to each
rank's tracked step peak, for ddp and zero1-3, 32-true and bf16-master, N=2 and N=4 gloo ranks.

    PYTHONPATH=src python bench/rank_estimate.py [--worlds 2 4]

Memory figures are exact byte counts (no timing), so one run is enough; the model, configurations
and measurement are tests/test_distributed_rank_estimate.py's own.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import save  # noqa: E402
# The test's model, configurations and per-rank measurement: the bench records what the test asserts.
from test_distributed_rank_estimate import BATCH, PRECISIONS, SPEC, STRATEGIES, _tracked_peaks  # noqa: E402


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
        measured = run_world(_tracked_peaks, world, timeout_s=900)
        for precision in PRECISIONS:
            for strategy in STRATEGIES:
                est = _estimate(strategy, world, precision)
                got = [m[precision, strategy]["total"] for m in measured]
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
