"""Cluster plans on paper: llama-2-70b and a llama-3-405b-class model on 80 GiB GPUs, beside the
published training configurations, by memfit's own composed per-rank memory and time model.

    PYTHONPATH=src python bench/cluster_paper.py

For each model: memfit's `--gpus auto` answer (its time to answer recorded), and the published
configuration evaluated by the same model: per-rank peak (all blocks kept, and with the block
counts memfit would choose for that layout) and predicted tokens/s per device. The published layout
is 3-D (TP x PP x DP), which memfit's trainer does not run (it runs dp x tp or dp x pp); the
composition handles it all the same. Time figures are the FLOP model (400 TFLOP/s per device
assumed), not measurements. Published figures are typed in PUBLISHED with their source; where a
figure is not in the source it is None.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load, machine, save  # noqa: E402

LLAMA_405B = "llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,seq=8192"
PUBLISHED = {
    "llama-2-70b": {
        "source": "Touvron et al. 2023, Llama 2 (arXiv:2307.09288), sec. 2.2 and Table 2",
        "gpus": None, "tp": None, "pp": None, "dp": None, "device": "A100 80GB", "seq": 4096,
        "global_batch_tokens": 4 * 2**20,
        "note": "the paper gives 4M-token batches at seq 4096 and A100-80GB GPUs, not the parallel layout",
    },
    LLAMA_405B: {
        "source": "Llama Team 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4 (recalled; check)",
        "gpus": 16384, "tp": 8, "pp": 16, "dp": 128, "device": "H100 80GB", "seq": 8192,
        "global_batch_tokens": 16 * 2**20, "microbatch_rows": 1, "dp_shard": 2,
        "note": "126 layers over 16 stages (the paper balances the first and last stage differently, and uses an "
                "interleaved schedule and context parallelism for long sequences, which memfit does not model); "
                "its data parallelism shards optimizer state and gradients (FSDP, taken here as ZeRO-2 over dp: "
                "uncertain), which memfit's dp x pp does not",
    },
}


def _auto(model: str, seq: int, batch: int) -> dict:
    from memfit.plan.cluster_fit import plan_cluster

    t0, c0 = time.perf_counter(), time.process_time()
    cp = plan_cluster(model, "80GiB", "auto", batch=batch, seq=seq, precision="bf16-master", device="cuda",
                      verify=model == "llama-2-70b")
    return {"gpus": cp.gpus, "strategy": cp.layout["strategy"], "degrees": cp.ranked[0]["degrees"],
            "peak": cp.peak, "traced_peak": cp.traced_peak, "tokens_per_s": cp.tokens_per_s,
            "tokens_per_s_per_device": cp.tokens_per_s / cp.gpus, "step_s": cp.time["total"], "time": cp.time,
            "offload_optimizer": cp.layout["offload_optimizer"], "counts": cp.layout["counts"][:1],
            "by_count": cp.by_count, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def _published(model: str, pub: dict, batch: int) -> dict | None:
    if pub["gpus"] is None:
        return None
    from memfit.plan.cluster_fit import problem_of
    from memfit.plan.cluster_memory import Layout, stage_sizes
    from memfit.plan.cluster_search import _solve, evaluate

    p = problem_of(model, "80GiB", None, None, batch, pub["seq"], "bf16-master", "adamw", None, "cuda", None)
    per_replica = batch // pub["dp"]
    m = per_replica // pub["microbatch_rows"]
    out = {}
    for shard, tag in ((0, "memfit"), (pub.get("dp_shard", 0), "as_published")):
        lay = Layout("pipeline", dp=pub["dp"], tp=pub["tp"], pp=pub["pp"], rows=pub["microbatch_rows"], accum=m,
                     schedule="1f1b", precision="bf16-master", dp_shard=shard)
        keep = evaluate(p, replace(lay, counts=[(k, 0, 0) for k in stage_sizes(p.spec.config.layers, lay.pp)]))
        got = {"peak_all_kept": keep.peak, "tokens_per_s_per_device_all_kept": keep.tokens_per_s / lay.gpus,
               "time_all_kept": keep.time}
        solved = _solve(p, lay)
        if solved is not None:
            row = evaluate(p, solved)
            got.update(peak_planned=row.peak, counts_planned=solved.counts[:1],
                       tokens_per_s_per_device_planned=row.tokens_per_s / lay.gpus, time_planned=row.time)
        out[tag] = got
    return out


def main() -> None:
    before = load()
    results = {}
    for model, pub in PUBLISHED.items():
        batch = pub["global_batch_tokens"] // pub["seq"]
        results[model] = {"published": pub, "global_batch": batch, "memfit_auto": _auto(model, pub["seq"], batch),
                          "memfit_on_published": _published(model, pub, batch)}
    save("cluster_paper", {"bench": "cluster_paper", "machine": machine(), "load_before": before, "load_after": load(),
                           "budget": "80GiB", "precision": "bf16-master", "optimizer": "adamw", "models": results})


def render(result: dict) -> str:
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    rows = ["| model | published (source) | memfit on the published layout | memfit --gpus auto | answered in |",
            "|---|---|---|---|---|"]
    for model, r in result["models"].items():
        pub, a, on = r["published"], r["memfit_auto"], r["memfit_on_published"]
        layout = (f"{pub['gpus']} x {pub['device']}, TP {pub['tp']} x PP {pub['pp']} x DP {pub['dp']}"
                  if pub["gpus"] else f"{pub['device']}; layout not given")
        left = (f"{layout}, seq {pub['seq']}, {pub['global_batch_tokens'] // 2**20}M tokens/step "
                f"({pub['source']}; {pub['note']})")
        if on:
            mid = "; ".join(_on(on[tag], label) for tag, label in (("as_published", "optimizer and gradients sharded "
                                                                     "over DP as published"),
                                                                    ("memfit", "as memfit's dp x pp runs it")))
        else:
            mid = "n/a (layout not published)"
        auto = (f"{a['gpus']} GPUs, {a['strategy']} ({a['degrees']}), peak {gib(a['peak'])}"
                + (f" (traced {gib(a['traced_peak'])})" if a["traced_peak"] else "")
                + (", optimizer offloaded" if a["offload_optimizer"] else "")
                + f", {a['tokens_per_s_per_device']:,.0f} tokens/s per device")
        pub_rate = (on or {}).get("as_published", {}).get("tokens_per_s_per_device_planned")
        if pub_rate:
            auto += (f"; {'at least as fast as' if a['tokens_per_s_per_device'] >= pub_rate else 'slower than'} the "
                     f"published layout per device by memfit's model")
        rows.append(f"| {model.split(',')[0] if model.startswith('llama-') else 'llama-3-405b-class'} | {left} | {mid} "
                    f"| {auto} | {a['wall_s']:.0f} s wall, {a['cpu_s']:.0f} s CPU |")
    return ("`PYTHONPATH=src python bench/cluster_paper.py` — 80 GiB per GPU, bf16-master, AdamW; times by the "
            "FLOP model (400 TFLOP/s per device assumed, NVLink in nodes of 8, InfiniBand between), not measured; "
            f"load {result['load_before']} before, {result['load_after']} after.\n\n" + "\n".join(rows) + "\n")


def _on(r: dict, label: str) -> str:
    gib = r["peak_all_kept"] / 2**30
    text = f"{label}: all blocks kept {gib:.1f} GiB per rank"
    if "peak_planned" in r:
        k, s, c = r["counts_planned"][0]
        return (text + f"; memfit's counts (stage 0: {k} keep, {s} selective, {c} recompute) "
                f"{r['peak_planned'] / 2**30:.1f} GiB, {r['tokens_per_s_per_device_planned']:,.0f} tokens/s per device")
    return text + "; no block counts fit 80 GiB"


def snippets(result: dict) -> dict[str, str]:
    return {"cluster_paper": render(result)}


if __name__ == "__main__":
    main()
