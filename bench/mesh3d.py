"""FSDP2 x tensor parallel x pipeline on one ("pp", "dp", "tp") DeviceMesh, per rank, against
`memfit estimate --strategy pipeline --engine fsdp2 --pp P --tp T`: tests/test_mesh3d.py's layouts on 4
gloo ranks (pp2 x dp2, pp2 x tp2) and 2 x 2 x 2 on 8.

    PYTHONPATH=src python bench/mesh3d.py        # writes bench/results/mesh3d.json

Tiny Llama and Qwen3 configs (tests/hf_family_configs.py: two decoder layers, one per stage; 4 heads, 2
key/value heads: one per TP rank) and memfit's GPT of that size (tp 1) run tests/mesh3d_worker.py's three
clipped AdamW steps (8 rows x 16 tokens per step, each replica's rows in 2 micro-batches), the third tracked
by torch's MemTracker on every rank.
Each row also records whether every rank's loss equals one process's on the whole batch (1e-5 relative).
Memory figures are byte counts (the same on every run): one run. The rows render into docs/distributed.md's
layout table (bench/torch_engines.py's columns).
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import save  # noqa: E402

COMMAND = "PYTHONPATH=src python bench/mesh3d.py"
WORLD = 8
RTOL = 1e-5  # as tests/test_mesh3d.py: fp32 reassociation only


def _estimate(path: str, layout, world: int) -> dict[int, int]:
    from test_mesh3d import _args

    from memfit.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(_args(path, layout, world)) == 0
    return {i: row["total"] for row in json.loads(buf.getvalue())["ranks"] for i in row["rank_ids"]}


def _rows(world: int, layouts: list, folder: Path) -> list[dict]:
    """Each layout on `world` gloo ranks: every rank's tracked peak against its estimate."""
    import mesh3d_worker as w

    from memfit.distributed.spawn import run_world

    ranks = run_world(w.runs, world, args=(layouts,), timeout_s=900)
    rows = []
    for lay in layouts:
        want = lay.one_process_losses()
        same = all(abs(a - b) <= RTOL * abs(b) for r in ranks for a, b in zip(r[lay]["losses"], want))
        est = _estimate(lay.write(folder), lay, world)
        got = [r[lay]["total"] for r in ranks]
        want_est = [est[i] for i in range(world)]
        dp = world // (lay.pp * lay.tp)
        name = "memfit GPT (tied embeddings)" if lay.family == "gpt" else f"HF {lay.family}" + (
            " (tied embeddings)" if lay.tied else "")
        rows.append({"model": name, "world": world,
                     "layout": f"pipeline (pp {lay.pp}, {lay.schedule}) x FSDP2 (dp {dp})"
                               + (f" x tensor plan (tp {lay.tp})" if lay.tp > 1 else ""),
                     "checkpoint": ("none" if not lay.checkpoint else "memfit full" if lay.family == "gpt"
                                    else "HF gradient_checkpointing_enable"),
                     "estimated_as": f"--strategy pipeline --pp {lay.pp} --tp {lay.tp} --engine fsdp2"
                                     + (" --checkpoint full" if lay.checkpoint else ""),
                     "estimate": want_est, "measured": got, "error": [(e - m) / m for e, m in zip(want_est, got)],
                     "losses_equal_one_process": same})
    return rows


def main() -> None:
    import mesh3d_worker as w
    from test_mesh3d import LAYOUTS

    with tempfile.TemporaryDirectory() as tmp:
        fp32 = [lay for lay in LAYOUTS if lay.precision == "32-true"]  # (the estimate is fp32's)
        rows = _rows(4, fp32, Path(tmp)) + _rows(WORLD, [w.Layout("qwen3", pp=2, tp=2)], Path(tmp))
    save("mesh3d", {"command": COMMAND, "rows": rows})


def render(result: dict) -> str:
    from render import machine_line  # bench/render.py
    from torch_engines import _table

    return "\n".join(["## FSDP2 x TP x PP (3-D) per rank against the estimate", "", f"`{result['command']}`", "",
                      "Each row: the rank furthest from its estimate.", "", _table(result), "",
                      machine_line(result), ""])


def snippets(result: dict) -> dict[str, str]:
    from torch_engines import _table

    same = all(r["losses_equal_one_process"] for r in result["rows"])
    return {"mesh3d": _table(result) + f"\n\n`{result['command']}` (each row: the rank furthest from its estimate; "
            f"every rank's loss {'equals' if same else 'does NOT equal'} one process's within 1e-5)"}


if __name__ == "__main__":
    main()
