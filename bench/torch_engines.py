"""torch's other engines per rank against `memfit estimate --engine ...`: zero1 on DDP with
ZeroRedundancyOptimizer (2 gloo ranks) and FSDP2 over "dp" x a Hugging Face model's tensor plan over
"tp" on one 2x2 DeviceMesh (4 gloo ranks). FSDP2 alone is bench/fsdp2_layouts.py.

    PYTHONPATH=src python bench/torch_engines.py        # writes bench/results/torch_engines.json

ZeRO-R: memfit's GPT and a small Hugging Face Llama, 32-true, without and with `--checkpoint full`,
three AdamW steps, the third tracked by memfit's tracker (tests/rank_grid.py), against `memfit
estimate --strategy zero1 --engine zero-redundancy` (each rank its own: torch's assignment of whole
tensors). 2-D: tests/test_fsdp_tp_2d.py's cases (Llama with grouped key/value heads, Qwen3, Llama
under Hugging Face's checkpointing; 4 rows x 16 tokens per step), the third step tracked by torch's
MemTracker, against `memfit estimate --strategy tensor --tp 2 --world 4 --engine fsdp2`. Memory
figures are byte counts (the same on every run): one run.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import save  # noqa: E402

COMMAND = "PYTHONPATH=src python bench/torch_engines.py"
GPT = "gpt:layers=2,hidden=32,heads=4,vocab=128,seq=32"


def zero_redundancy(folder: Path) -> list[dict]:
    import hf_family_configs as fam
    import rank_grid as grid

    from memfit.distributed.spawn import run_world

    path = folder / "llama" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(fam.config("llama").to_json_string())
    models = {"memfit GPT": GPT, "HF llama": str(path)}
    cases = {(name, ckpt): grid.Case(model, "zero1", checkpoint=ckpt, engine="zero-redundancy")
             for name, model in models.items() for ckpt in ("none", "full")}
    measured = run_world(grid.tracked, 2, (list(cases.values()),), timeout_s=1200)
    rows = []
    for (name, ckpt), c in cases.items():
        est = [r["total"] for r in grid.estimated(c, 2)]
        got = [measured[r][c]["total"] for r in range(2)]
        rows.append({"model": name, "world": 2, "layout": "DDP + ZeroRedundancyOptimizer", "checkpoint": ckpt,
                     "estimated_as": f"--strategy zero1 --engine zero-redundancy --checkpoint {ckpt}",
                     "estimate": est, "measured": got, "error": [(e - m) / m for e, m in zip(est, got)]})
    return rows


def fsdp_tp(folder: Path) -> list[dict]:
    import test_fsdp_tp_2d as two_d

    from memfit.distributed.spawn import run_world
    from memfit.measure.estimate import estimate

    ranks = run_world(two_d._ranks, two_d.WORLD, timeout_s=1200)
    rows = []
    for family, ckpt in two_d.CASES:
        got = [r[(family, ckpt)]["total"] for r in ranks]
        est = estimate(two_d._write(folder / f"2d-{ckpt}", family), batch=two_d.ROWS // two_d.WORLD, seq=two_d.SEQ,
                       strategy="tensor", world=two_d.WORLD, tp=two_d.TP, engine="fsdp2",
                       checkpoint="full" if ckpt else "none")
        per_rank = {i: row["total"] for row in est.ranks for i in row["rank_ids"]}
        want = [per_rank[i] for i in range(two_d.WORLD)]
        rows.append({"model": f"HF {family}", "world": two_d.WORLD, "layout": f"FSDP2 (dp 2) x tensor plan (tp {two_d.TP})",
                     "checkpoint": "HF gradient_checkpointing_enable" if ckpt else "none",
                     "estimated_as": f"--strategy tensor --tp {two_d.TP} --engine fsdp2"
                                     + (" --checkpoint full" if ckpt else ""),
                     "estimate": want, "measured": got, "error": [(e - m) / m for e, m in zip(want, got)]})
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = zero_redundancy(Path(tmp)) + fsdp_tp(Path(tmp))
    save("torch_engines", {"command": COMMAND, "rows": rows})


def _table(result: dict) -> str:
    lines = ["| model | ranks | layout | checkpointing | estimated as | estimate (B/rank) | measured (B/rank) | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        worst = max(range(len(r["error"])), key=lambda i: abs(r["error"][i]))
        lines.append(f"| {r['model']} | {r['world']} | {r['layout']} | {r['checkpoint']} | `{r['estimated_as']}` | "
                     f"{r['estimate'][worst]:,} | {r['measured'][worst]:,} | {r['error'][worst]:+.2%} |")
    return "\n".join(lines)


def render(result: dict) -> str:
    from render import machine_line  # bench/render.py

    return "\n".join(["## torch's ZeroRedundancyOptimizer and FSDP2 x TP per rank against the estimate", "",
                      f"`{result['command']}`", "", "Each row: the rank furthest from its estimate.", "",
                      _table(result), "", machine_line(result), ""])


def snippets(result: dict) -> dict[str, str]:
    return {"torch_engines": _table(result) + f"\n\n`{result['command']}` (each row: the rank furthest from its estimate)"}


if __name__ == "__main__":
    main()
