"""Per-rank estimate against the tracker, the grid: `memfit estimate ... --strategy S --world N` next to
each rank's tracked step peak (tests/rank_grid.py: the cases, the measurement and the CLI call).

    PYTHONPATH=src python bench/rank_estimate.py [--depths 1 2 11 12 13 24 48] [--worlds 2 4] [--hf]
    PYTHONPATH=src python bench/rank_estimate.py --interleaved --name rank_estimate_interleaved

memfit's GPT (hidden 32, 4 heads, vocab 128, seq 32, batch 2 per rank) at each depth under none,
ddp, ps, zero1-3, pipeline (1F1B and GPipe, one micro-batch per stage) and tensor, in 32-true and
bf16-master, without and with full checkpointing, on 2 gloo ranks; `--worlds 2 4` adds 4 ranks for
`--world4-depths`. `--hf`: Llama (tied, untied, GQA), GPT-2 and Mixtral configs under each
data-parallel strategy, and the Llama configs under tensor (their tensor plan, tp 2) and pipeline
(1F1B and GPipe, cut at decoder layers, pp 2). `--interleaved`: the pipeline's interleaved 1F1B schedule
alone (tests/rank_grid.py's interleaved_cases: V stages per rank, GPT and Llama, 2 and 4 ranks), written
to bench/results/NAME.json. Memory figures are exact byte counts (no timing): one run is enough.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import save  # noqa: E402
import rank_grid as grid  # noqa: E402

NAME = ["rank_estimate"]
"""The result this run writes (--name): bench/results/NAME.json."""


def _run(cases: list, world: int, done: list[dict], command: str) -> list[dict]:
    """Track and estimate `cases` a dozen at a time, saving after each dozen (a part lost is small)."""
    from memfit.distributed.spawn import run_world

    rows = []
    for i in range(0, len(cases), 12):
        chunk = cases[i:i + 12]
        measured = run_world(grid.tracked, world, (chunk,), timeout_s=1800)
        rows += grid.errors(chunk, world, measured)
        _save(done + rows, command)
        print(f"{len(rows)}/{len(cases)} at world {world}", file=sys.stderr, flush=True)
    return rows


def _save(rows: list[dict], command: str) -> Path:
    result = Path(__file__).resolve().parent / "results" / f"{NAME[0]}.json"
    old = json.loads(result.read_text()) if result.exists() else {}
    mine = {(r["case"], r["world"]) for r in rows}
    kept = [r for r in old.get("rows", []) if (r["case"], r["world"]) not in mine] if "seq" in old else []
    # the earlier commands stand beside this one only while rows of theirs are kept
    commands = ([c for c in old.get("commands", []) if c != command] if kept else []) + [command]
    for r in rows:
        if r["model"].endswith(".json"):
            r["model"] = Path(r["model"]).parent.name
    return save(NAME[0], {"script": "rank_estimate", "command": " ; ".join(commands), "commands": commands,
                                  "batch_per_rank": grid.BATCH, "seq": grid.SEQ, "rows": kept + rows})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=list(grid.DEPTHS))
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--world4-depths", type=int, nargs="+", default=[2, 12, 13])
    ap.add_argument("--hf", action="store_true", help="add the Hugging Face families")
    ap.add_argument("--hf-only", action="store_true", help="the Hugging Face families alone")
    ap.add_argument("--interleaved", action="store_true", help="the interleaved pipeline schedule's cases alone")
    ap.add_argument("--name", default="rank_estimate", help="the result's name (default rank_estimate)")
    ap.add_argument("--strategies", nargs="+", help="only these strategies (e.g. pipeline zero3); the other "
                    "cases' rows are kept from the earlier runs")
    args = ap.parse_args()
    NAME[0] = args.name
    if args.interleaved:
        return _interleaved(args)
    keep = (lambda cases: [c for c in cases if c.strategy in args.strategies]) if args.strategies else (lambda c: c)
    if args.hf_only:
        args.hf, args.worlds = True, []
    command = "PYTHONPATH=src python bench/rank_estimate.py " + ("--hf-only" if args.hf_only else (
        "--depths " + " ".join(map(str, args.depths)) + " --worlds " + " ".join(map(str, args.worlds))
        + (" --world4-depths " + " ".join(map(str, args.world4_depths)) if 4 in args.worlds else "")
        + (" --hf" if args.hf else ""))) + (" --strategies " + " ".join(args.strategies) if args.strategies else "")
    # Each run replaces its own cases in bench/results/rank_estimate.json and keeps the others: the
    # grid may be run in parts.
    rows = _run(keep(grid.gpt_cases(args.depths)), 2, [], command) if 2 in args.worlds else []
    if 4 in args.worlds:
        rows += _run(keep(grid.gpt_cases(args.world4_depths, 4, precisions=("32-true",))), 4, rows, command)
    if args.hf:
        with tempfile.TemporaryDirectory() as d:
            rows += _run(keep(grid.hf_cases(grid.hf_configs(Path(d)))), 2, rows, command)
    print(render(json.loads(_save(rows, command).read_text())))


def _interleaved(args) -> None:
    command = f"PYTHONPATH=src python bench/rank_estimate.py --interleaved --name {args.name}"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        for world, cases in grid.interleaved_cases(grid.hf_configs(Path(d), layers=4)).items():
            rows += _run(cases, world, rows, command)
    print(render(json.loads(_save(rows, command).read_text())))


def _strategy(r: dict) -> str:
    """strategy, schedule and (interleaved) the stages per rank, as the tables name them."""
    return r["strategy"] + (f" {r['schedule']}" if r.get("schedule") else "") \
        + (f" x{r['virtual_stages']}" if r.get("virtual_stages") else "")


def _worst(rows: list[dict]) -> float:
    return max((abs(e) for r in rows for e in r["error"]), default=0.0)


def _table(result: dict) -> str:
    lines = ["| model | N | precision | checkpoint | strategy | estimate (largest rank) | tracked | error per rank |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s = _strategy(r) + (f", {r['microbatches']} micro-batches" if r.get("microbatches") else "")
        err = " / ".join(f"{e:+.2%}" for e in r["error"]) if len(set(r["error"])) > 1 else f"{r['error'][0]:+.2%}"
        lines.append(f"| {r['model']} | {r['world']} | {r['precision']} | {r['checkpoint']} | {s} | "
                     f"{max(r['estimate']):,} | {max(r['measured']):,} | {err} |")
    return "\n".join(lines)


def _summary(result: dict) -> str:
    rows = result["rows"]
    by: dict[str, list] = {}
    for r in rows:
        by.setdefault(_strategy(r), []).append(r)
    lines = ["| strategy | cases | ranks | worst error | within 3% | within 1% |", "|---|---|---|---|---|---|"]
    for s, rs in by.items():
        errs = [abs(e) for r in rs for e in r["error"]]
        lines.append(f"| {s} | {len(rs)} | {len(errs)} | {max(errs):.2%} | {sum(e <= 0.03 for e in errs)} | "
                     f"{sum(e <= 0.01 for e in errs)} |")
    lines.append(f"\n{len(rows)} cases, worst error {_worst(rows):.2%}; `{result['command']}`.")
    return "\n".join(lines)


def render(result: dict) -> str:
    from render import machine_line  # bench/render.py

    if "seq" not in result:  # the earlier single-model form
        return ""
    what = " (interleaved 1F1B)" if result["bench"] != "rank_estimate" else " (the grid)"
    return "\n".join([
        f"## Per-rank estimate against the tracker{what}", "",
        f"`{result['command']}`", "",
        f"Batch {result['batch_per_rank']} x seq {result['seq']} per rank, AdamW; each rank's tracked peak at the third "
        "step on gloo against `memfit estimate --strategy S --world N` (docs/estimate.md).", "",
        _summary(result), "", _table(result), "", machine_line(result), ""])


def snippets(result: dict) -> dict[str, str]:
    if "seq" not in result:
        return {}
    if result["bench"] != "rank_estimate":  # --interleaved
        return {result["bench"]: _summary(result)}
    return {"rank_estimate_grid": _summary(result), "rank_estimate": _summary(result)}


if __name__ == "__main__":
    main()
