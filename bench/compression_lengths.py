"""Plain `--compress topk:0.01` and `sign` under the default job's AdamW, at several run lengths.

    .venv/bin/python bench/compression_lengths.py [--lengths 150 300 1000]

The specs name no mode, so they run in the one memfit picks for AdamW (adam mode, adam=5;
src/memfit/distributed/compression/defaults.py); the row records the mode that ran. Each length
is its own run of bench/compression.py's two-rank DDP setup (every contender interleaved in a
shuffled order each step, same weights and data), against the uncompressed run of that length.
Targets: top-k 1% >= 50x fewer bytes within +2%, 1-bit >= 25x within +3% of the uncompressed
final validation loss, at every length. The JSON is written after each length, so a length that
did not fit in the time available is absent, never invented.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, save  # noqa: E402

import compression as bench  # noqa: E402

NAME = "compression_lengths"
SPECS = ["none", "topk:0.01", "sign"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[150, 300, 1000])
    ap.add_argument("--keep", action="store_true", help="keep the other lengths already in the JSON (runs taken "
                    "one length at a time, or side by side, each under its own load)")
    args = ap.parse_args()
    mine: list[dict] = []
    for steps in args.lengths:
        load_before, t0 = list(os.getloadavg()), time.perf_counter()
        rows = bench.measure(steps, bench.MODEL, SPECS, "adamw", bench.LR)
        for r in rows:
            r.pop("train_loss", None)  # the curves stay in compression.json; here the end points
        mine.append({"steps": steps, "rows": rows, "wall_s": time.perf_counter() - t0,
                     "load_avg": [load_before, list(os.getloadavg())], "date": time.strftime("%Y-%m-%d %H:%M")})
        runs = sorted(mine + (_kept(args.lengths) if args.keep else []), key=lambda r: r["steps"])
        asked = sorted({*args.lengths, *(r["steps"] for r in runs)})
        for r in rows:
            print(f"{steps:>5} {r['compressor']:>10} ({r['mode']}): {r['ratio']:.1f}x, val {r['final_val_loss']:.4f} "
                  f"({100 * r['val_vs_none']:+.2f}%)", flush=True)
        path = save(NAME, {"script": NAME, "command": "bench/compression_lengths.py --lengths 150 300 1000",
                           "model": bench.MODEL, "world": bench.WORLD, "batch_per_rank": bench.BATCH,
                           "seq": bench.SEQ, "threads_per_rank": 1, "lengths_asked": sorted({*asked, 150, 300, 1000}),
                           "runs": runs})
        print(f"wrote {path}", flush=True)


def _kept(lengths: list[int]) -> list[dict]:
    """The other lengths' runs in the JSON as it is now: read at each write, so runs of different
    lengths started side by side (each with --keep) do not drop each other's results."""
    old = RESULTS / f"{NAME}.json"
    return [r for r in json.loads(old.read_text())["runs"] if r["steps"] not in lengths] if old.exists() else []


def _table(result: dict) -> list[str]:
    lines = ["| steps | compressor | mode that ran | fewer bytes | final val loss | vs none | target | "
             "load before -> after | wall s |", "|---:|---|---|---:|---:|---:|---|---|---:|"]
    for run in result["runs"]:
        (a, _, _), (b, _, _) = run["load_avg"]
        for r in run["rows"]:
            t = r.get("target")
            target = (f">= {t['ratio_at_least']}x, <= +{100 * t['loss_within']:g}%: {'met' if t['met'] else 'NOT met'}"
                      if t else "-")
            lines.append(f"| {run['steps']} | `{r['compressor']}` | `{r['mode']}` | {r['ratio']:.1f}x | "
                         f"{r['final_val_loss']:.4f} | {100 * r['val_vs_none']:+.2f}% | {target} | "
                         f"{a:.1f} -> {b:.1f} | {run['wall_s']:.0f} |")
    return lines


def _missing(result: dict) -> str:
    done = {run["steps"] for run in result["runs"]}
    left = [n for n in result["lengths_asked"] if n not in done]
    return (f" Not run in the time available: {', '.join(map(str, left))} steps." if left else "")


def render(result: dict) -> str:
    from render import machine_line

    return "\n".join([
        "## compression_lengths: plain `topk:0.01` and `sign` under AdamW at several run lengths",
        "", f"`.venv/bin/python {result['command']}`", "", machine_line(result), "",
        f"Model `{result['model']}`, {result['world']} gloo ranks x {result['batch_per_rank']} sequences x "
        f"{result['seq']} bytes, one thread per rank, the setup of section compression; each length is its "
        f"own run with the three contenders interleaved. The machine was shared and loaded (load average "
        f"per run in the table, 2 cores).{_missing(result)}", "", *_table(result)])


def snippets(result: dict) -> dict[str, str]:
    return {NAME: "\n".join(_table(result)) + ("\n\n" + _missing(result).strip() if _missing(result) else "")}


if __name__ == "__main__":
    main()
