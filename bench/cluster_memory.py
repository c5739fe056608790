"""Cluster planner: each data-parallel rank's composed peak against the full trace of that rank.

    PYTHONPATH=src python bench/cluster_memory.py

For one process, ddp and zero1-3 on 2 ranks (the tiny llama of bench/cluster_rank.py, 4 sequences
of 64 a rank, every block kept, AdamW, 32-true), without and with accumulation (4 micro-batches of
1): the planner's composed per-rank peak (memfit.plan.cluster_memory, from one-block traces) and
the check's full trace of the rank (memfit.plan.cluster_verify: memfit.estimate's moments put on
the rank's shards). Both are estimates made here (no run): the table says how far the composition
stands above or below the trace it is checked by. Nothing is timed.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load, machine, save  # noqa: E402

MODEL = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=768,vocab=256"
SEQ, ROWS = 64, 4
STRATEGIES = ("none", "ddp", "zero1", "zero2", "zero3")


def main() -> None:
    from memfit.plan.cluster_fit import actions_of, problem_of
    from memfit.plan.cluster_memory import Layout
    from memfit.plan.cluster_search import evaluate
    from memfit.plan.cluster_verify import traced_peak

    p = problem_of(MODEL, "1GiB", "2", None, 2 * ROWS, SEQ, "32-true", "adamw", "recompute", "cuda", 1e12)
    layers = p.spec.config.layers
    rows = []
    for strategy in STRATEGIES:
        for rows_mb, accum in ((ROWS, 1), (1, ROWS)):
            lay = Layout(strategy, dp=1 if strategy == "none" else 2, rows=rows_mb, accum=accum,
                         counts=[(layers, 0, 0)])
            composed = evaluate(p, lay).peak
            traced = traced_peak(p.spec, lay, SEQ, actions_of(lay, layers))
            rows.append({"strategy": strategy, "micro_batch": rows_mb, "accumulation": accum, "composed": composed,
                         "traced": traced, "ratio": composed / traced})
    save("cluster_memory", {"load": load(), "model": MODEL, "seq": SEQ, "rows_per_rank": ROWS, "ranks": 2,
                            "machine": machine(), "rows": rows})


def render(result: dict) -> str:
    out = ["| strategy (2 ranks) | micro-batch x accumulation | composed peak | full trace of the rank | composed / traced |",
           "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        out.append(f"| {r['strategy']} | {r['micro_batch']} x {r['accumulation']} | {r['composed'] / 2**20:.2f} MiB | "
                   f"{r['traced'] / 2**20:.2f} MiB | {r['ratio']:.2f} |")
    return (f"`PYTHONPATH=src python bench/cluster_memory.py` — {result['model']}, seq {result['seq']}, "
            f"{result['rows_per_rank']} sequences a rank per step, AdamW, 32-true, every block kept.\n\n"
            + "\n".join(out) + "\n")


def snippets(result: dict) -> dict[str, str]:
    return {"cluster_memory": render(result)}


if __name__ == "__main__":
    main()
