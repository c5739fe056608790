"""The prediction made on a CPU machine for a named GPU, against that GPU's own max_memory_reserved.

    PYTHONPATH=src python3 bench/gpu_target.py --predict     # any machine: bench/data/gpu_target_predicted.json
    PYTHONPATH=src python3 bench/gpu_target.py               # on the GPU (about 5 min on an H100)

`--predict` runs `trace_step(..., device="h100")` for each configuration (nothing allocated: the
step traced as an H100 runs it, its storages replayed through the caching allocator's rules) and
saves the figures in the repository. On a machine with CUDA the script then runs each configuration
for real, in a fresh process (the allocator's cache is per process), and compares
torch.cuda.max_memory_reserved over the run with the saved prediction; it also records which
attention backend torch chose (torch._fused_sdp_choice) beside the one memfit predicted, and the
CUDA context (what the driver reports used beyond the reserve). Without CUDA it writes the
predictions with the measurement marked skipped. Target: reserved within 5%.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAME = "gpu_target"
PREDICTED = Path(__file__).resolve().parent / "data" / "gpu_target_predicted.json"
STEPS = 3
GPT2 = "gpt:layers=12,hidden=768,heads=12,vocab=50257,seq=1024"
CONFIGS = {  # name: (model, batch, seq, precision, checkpoint, head chunks)
    "GPT-2 small, dropout 0.1, bf16-master (fused attention with dropout)":
        (GPT2 + ",dropout=0.1", 8, 1024, "bf16-master", "none", None),
    "GPT-2 small, no dropout, bf16-master": (GPT2, 8, 1024, "bf16-master", "none", None),
    "GPT-2 small, no dropout, fp32 (memory-efficient attention)": (GPT2, 8, 1024, "32-true", "none", None),
    "GPT-2 small, bf16-master, chunked head (8 chunks)": (GPT2, 8, 1024, "bf16-master", "none", 8),
    "GPT-2 small, dropout 0.1, bf16-master, full checkpointing":
        (GPT2 + ",dropout=0.1", 8, 1024, "bf16-master", "full", None),
    "HF Llama 1.1B (22x2048, GQA 32/4), bf16-mixed": ("hf-llama-1b", 2, 2048, "bf16-mixed", "none", None),
    "GPT-2 small, dropout 0.1, bf16-master, expandable segments":
        (GPT2 + ",dropout=0.1", 8, 1024, "bf16-master", "none", None),
}
EXPANDABLE = {"GPT-2 small, dropout 0.1, bf16-master, expandable segments"}
"""Run (and replayed) with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."""


def hf_llama_1b():
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632,
                                   num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                   max_position_embeddings=2048, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg)


def builder(model: str, seq: int, chunks: int | None):
    """What trace_step and _run build: a spec string, or a function for HF Llama and a chunked head."""
    if model == "hf-llama-1b":
        return hf_llama_1b
    if chunks:
        from memfit.apply.head_swap import chunk_head
        from memfit.models.spec import parse_model

        spec = parse_model(model)
        return lambda: chunk_head(spec.build(seq=seq), chunks)
    return model


def predict(gpu: str) -> dict:
    from memfit.measure.trace import trace_step

    rows = {}
    for name, (model, batch, seq, precision, checkpoint, chunks) in CONFIGS.items():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True" if name in EXPANDABLE else ""
        r = trace_step(builder(model, seq, chunks), batch, seq, precision, checkpoint=checkpoint, device=gpu,
                       steps=STEPS)
        rows[name] = {"predicted_reserved": r.cuda_reserved, "predicted_allocated": r.cuda_allocated,
                      "tracker_peak": r.peak, "attention": r.attention, "breakdown": r.breakdown(),
                      "trace_seconds": round(r.seconds, 1)}
        print(f"{name}: reserved {r.cuda_reserved / 2**30:.3f} GiB, attention {r.attention}", flush=True)
    import torch

    return {"gpu": gpu, "torch": torch.__version__, "steps": STEPS, "rows": rows}


def measure_one(name: str) -> dict:
    """One configuration for real on this machine's GPU (run in a fresh process)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    from gpu_estimate import _LastStep
    from memfit.measure.trace import _builder, _run

    model, batch, seq, precision, checkpoint, chunks = CONFIGS[name]
    chosen: dict[str, int] = {}
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.requires_grad:
            qc, kc, vc = q, k, v
            if torch.is_autocast_enabled("cuda"):  # autocast casts SDPA's inputs before the choice
                low = torch.get_autocast_dtype("cuda")
                qc, kc, vc = (t.to(low) for t in (q, k, v))
            with torch.autocast("cuda", enabled=False):
                b = SDPBackend(torch._fused_sdp_choice(qc, kc, vc, attn_mask, dropout_p, is_causal, scale=scale,
                                                       enable_gqa=enable_gqa)).name
            chosen[b] = chosen.get(b, 0) + 1
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    torch.manual_seed(0)
    window = _LastStep()
    real = _run(_builder(builder(model, seq, chunks), seq), batch, seq, precision, "adamw", checkpoint, "cuda", STEPS,
                window=window)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = max(window.before[1], window.last[1])
    allocated = max(window.before[0], window.last[0])
    context = total - free - torch.cuda.memory_reserved()
    # Which kernels torch chose: one more step with a spy, after the figures are read (the spy's casts allocate).
    F.scaled_dot_product_attention = spy
    _run(_builder(builder(model, seq, chunks), seq), batch, seq, precision, "adamw", checkpoint, "cuda", 1, window=None)
    F.scaled_dot_product_attention = sdpa
    return {"measured_reserved": reserved, "measured_allocated": allocated, "tracker_peak": real.peak,
            "attention": chosen, "context_bytes": context, "total_memory": total}


def _child(name: str) -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True" if name in EXPANDABLE else "")
    p = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr or p.stdout)[-2000:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predict", action="store_true", help="trace every configuration for --gpu and save it")
    ap.add_argument("--gpu", default="h100", help="the named GPU the prediction is for (default h100)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one)))
        return
    if args.predict:
        PREDICTED.write_text(json.dumps(predict(args.gpu), indent=1))
        print(f"wrote {PREDICTED}")
        return
    import datetime

    import torch

    from common import save

    pred = json.loads(PREDICTED.read_text())
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else None
    rows = []
    for name, p in pred["rows"].items():
        row = {"name": name, "predicted_reserved": p["predicted_reserved"], "predicted_allocated": p["predicted_allocated"],
               "predicted_attention": p["attention"], "measured_reserved": None, "device": device,
               "torch": torch.__version__, "predicted_with": f"--device {pred['gpu']}, torch {pred['torch']}",
               "date": datetime.date.today().isoformat()}
        if cuda:
            m = _child(name)
            row.update(m, measured_attention=m.get("attention"))
            row.pop("attention", None)
            if m.get("measured_reserved"):
                row["ratio"] = round(p["predicted_reserved"] / m["measured_reserved"], 4)
        else:
            row["skipped"] = "no CUDA on this machine: predictions only"
        rows.append(row)
        print(name, {k: row.get(k) for k in ("predicted_reserved", "measured_reserved", "ratio")}, flush=True)
    save(NAME, {"gpu": pred["gpu"], "rows": rows, "tolerance": 0.05})


def render(result: dict) -> str:
    lines = [f"## GPU target: reserved predicted on a CPU for `--device {result['gpu']}` vs measured", "",
             "`PYTHONPATH=src python3 bench/gpu_target.py` (predictions: `--predict`, saved in "
             "bench/data/gpu_target_predicted.json).", "",
             "| configuration | predicted reserved | measured reserved | ratio | attention predicted | measured |",
             "|---|---:|---:|---:|---|---|"]
    for r in result["rows"]:
        meas = f"{r['measured_reserved'] / 2**30:.3f} GiB" if r.get("measured_reserved") else r.get("skipped", "error")
        lines.append(f"| {r['name']} | {r['predicted_reserved'] / 2**30:.3f} GiB | {meas} | {r.get('ratio', '')} | "
                     f"{r['predicted_attention']} | {r.get('measured_attention') or ''} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
