"""Tiny configs of any Hugging Face causal-LM architecture the installed transformers builds, and one
architecture's checks (estimate, fit, repeated blocks, model-parallel refusals) for bench/hf_families_sweep.py.

    .venv/bin/python bench/hf_family_tiny.py plan llama     # one architecture's row (ROW {json})
    .venv/bin/python bench/hf_family_tiny.py checks llama   # the same without memfit.fit

The tiny config starts from the architecture's default config and shrinks every size field it has (2
layers, width 64, 4 heads, vocabulary 1024, 4 experts): the same rule for every family, so the sweep
brings each one as a user would who shrinks a config by its usual field names.
"""
from __future__ import annotations

import json
import sys
import traceback
from typing import Any

LAYERS, HIDDEN, HEADS, KV, FFN, VOCAB, HEAD_DIM = 2, 64, 4, 2, 128, 1024, 16
BATCH, SEQ = 8, 64
BUDGET_SHARE = 0.6
_SIZES = (
    (LAYERS, ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
             "encoder_layers", "num_encoder_layers")),
    (HIDDEN, ("hidden_size", "n_embd", "d_model", "dim", "n_embed", "embed_dim", "word_embed_proj_dim")),
    (HEADS, ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
            "encoder_attention_heads", "num_attention_heads_per_layer")),
    (KV, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "n_head_kv")),
    (FFN, ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "decoder_ffn_dim", "encoder_ffn_dim",
          "ffn_hidden_size", "inner_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
          "expert_intermediate_size", "intermediate_size_mlp")),
    (VOCAB, ("vocab_size",)),
    (128, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")),
    (HEAD_DIM, ("head_dim", "d_kv", "qk_nope_head_dim", "v_head_dim", "qk_head_dim", "linear_key_head_dim",
               "linear_value_head_dim", "attention_head_dim", "qk_rope_head_dim", "rotary_dim")),
    (32, ("kv_lora_rank", "q_lora_rank", "state_size", "ssm_state_size", "mamba_d_state")),
    (4, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "linear_num_value_heads",
        "linear_num_key_heads")),
    (2, ("num_experts_per_tok", "moe_topk", "top_k", "n_group", "topk_group", "moe_k")),
)
_FIELD = {name: value for value, names in _SIZES for name in names}
_LAYER_KEYS, _HEAD_KEYS = _SIZES[0][1], _SIZES[2][1] + _SIZES[3][1]


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    """The config dict with every size field set small; per-layer lists cut to the first LAYERS entries;
    sub-configs (a text config inside a multimodal one) shrunk the same way."""
    old_layers = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    keep = _layers_kept(d, old_layers)
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and "model_type" in v:
            out[k] = _shrink(v)
        elif k in _LAYER_KEYS and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[k] = min(v, keep)
        elif k in _FIELD and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[k] = min(v, _FIELD[k]) if k not in _HEAD_KEYS else _FIELD[k]
        elif k.endswith("token_id") and isinstance(v, int) and v >= VOCAB:
            out[k] = VOCAB - 1  # special tokens stay inside the smaller vocabulary
        elif isinstance(v, list) and old_layers and len(v) == old_layers and old_layers > keep:
            out[k] = v[:keep]
        else:
            out[k] = v
    if "sliding_window" in out and isinstance(out["sliding_window"], int):
        out["sliding_window"] = 16
    for key in ("first_k_dense_replace", "num_dense_layers"):
        if isinstance(out.get(key), int):
            out[key] = min(out[key], 1)
    return out


def _layers_kept(d: dict[str, Any], old_layers: int | None) -> int:
    """LAYERS, or as many as it takes for a per-layer kind list (layer_types: sliding and full attention,
    linear attention, ...) to keep every kind it names."""
    kinds = d.get("layer_types")
    if not (isinstance(kinds, list) and old_layers and len(kinds) == old_layers):
        return LAYERS
    first = {}
    for i, kind in enumerate(kinds):
        first.setdefault(str(kind), i)
    return max(LAYERS, max(first.values()) + 1)


def tiny_config(model_type: str):
    import transformers

    base = transformers.AutoConfig.for_model(model_type)
    d = _shrink(base.to_dict())
    for k in ("model_type", "transformers_version", "architectures"):
        d.pop(k, None)
    return transformers.AutoConfig.for_model(model_type, **d)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _refusal(check) -> str:
    """'accepts', or memfit's one-line refusal, or 'traceback: ...' (a failure: not one line from memfit)."""
    from memfit.core.errors import ConfigError

    try:
        check()
        return "accepts"
    except ConfigError as exc:
        return "refuses: " + str(exc).splitlines()[0]
    except Exception as exc:  # noqa: BLE001 - the row records what escaped
        return "traceback: " + _one_line(exc)


def _parallel(model) -> dict[str, str]:
    """--strategy tensor / pipeline on 2 processes, checked as the launcher checks them (no process group)."""
    from memfit.distributed.hf_stages import check_hf_pipeline
    from memfit.distributed.hf_tensor import heads_of, hf_layers, hf_tp_plan
    from memfit.distributed.pipeline import check_pipeline
    from memfit.distributed.tensor_parallel import check_tensor

    def tensor():
        hf_tp_plan(model)
        check_tensor(*heads_of(model.config), 2, 2)

    def pipeline():
        check_hf_pipeline(model.config)
        check_pipeline(len(hf_layers(model)[1]), 2, BATCH * 2, 2, "gpipe", None)

    return {"tensor": _refusal(tensor), "pipeline": _refusal(pipeline)}


def _applied_peak(model, plan, batch) -> int:
    import memfit

    opt = plan.apply(model, lr=1e-3)
    # The plan's loop: its micro-batches (plan.accumulation of plan.micro_batch rows), the output held as
    # `out = model(...)` holds it, one update per step
    micro = [{k: v[i:i + plan.micro_batch] for k, v in batch.items()}
             for i in range(0, plan.micro_batch * plan.accumulation, plan.micro_batch)]
    with memfit.track(model, opt) as tr:
        for _ in range(2):  # the second step holds the optimizer state: the steady-state peak
            for i, mb in enumerate(micro):
                with opt.autocast():
                    out = model(**mb)
                opt.backward(out.loss, final=i == len(micro) - 1)
            opt.step()
            del out
    return tr.peak_bytes


def _step(row: dict, name: str, fn) -> Any:
    """fn()'s value, or None with row[name] saying what escaped (memfit's one line, or a traceback's last)."""
    from memfit.core.errors import ConfigError

    try:
        return fn()
    except ConfigError as exc:
        row[name] = "refuses: " + str(exc).splitlines()[0]
    except Exception as exc:  # noqa: BLE001 - the row records what escaped
        row[name] = "traceback: " + _one_line(exc)
        row.setdefault("tracebacks", {})[name] = traceback.format_exc()[-1500:]
    return None


def _build_or_skip(model_type: str, row: dict):
    """(a zero-argument builder, the batch), or None with row['status'] 'skipped' and why."""
    import torch
    import transformers

    try:
        cfg = tiny_config(model_type)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal to build it: not memfit's to handle
        row.update(status="skipped", reason="transformers builds no model from the tiny config: " + _one_line(exc))
        return None

    def build():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg)

    vocab = min(getattr(cfg.get_text_config(), "vocab_size", None) or VOCAB, VOCAB)
    x = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x.clone()}
    try:
        with torch.no_grad():
            build()(**batch)
    except Exception as exc:  # noqa: BLE001 - the model's own forward fails on the tiny config, memfit aside
        row.update(status="skipped", reason="the model's own forward fails on the tiny config: " + _one_line(exc))
        return None
    row["params"] = sum(p.numel() for p in build().parameters())
    return build, batch


def run_one(model_type: str, plan: bool = True) -> dict:
    """The architecture's row; `plan` False: the estimate and the checks only (memfit.fit is the slow part)."""
    import memfit
    from memfit.apply.checkpoint import find_blocks
    from memfit.measure.anymodel_estimate import measure_module

    row: dict[str, Any] = {"arch": model_type, "status": "ok"}
    built = _build_or_skip(model_type, row)
    if built is None:
        return row
    build, batch = built
    blocks = _step(row, "blocks", lambda: find_blocks(build()))
    if blocks is not None:
        row["blocks"] = f"{len(blocks)} x {type(blocks[0]).__name__}"
    row.update(_parallel(build()))
    real = _step(row, "measured", lambda: measure_module(build(), batch, optimizer="adamw"))
    est = _step(row, "estimate", lambda: memfit.estimate(build(), batch, optimizer="adamw").per_device["total"])
    if real is not None:
        row.update(tracker=real["peak"], allocator=real["allocator"])
    if real is not None and est is not None:
        row.update(estimate=est, err_pct=100.0 * (est - real["allocator"]) / real["allocator"])
    if plan and real is not None and est is not None:
        row["planned"] = True
        row["budget"] = budget = int(BUDGET_SHARE * real["peak"])
        model = build()
        plan = _step(row, "fit", lambda: memfit.fit(model, batch, budget=f"{budget}B"))
        if plan is not None:
            row.update(fit=plan.summary().splitlines()[0][:200], predicted=plan.predicted_peak)
            row["applied"] = _step(row, "applied_error", lambda: _applied_peak(model, plan, batch))
    bad = [k for k in ("blocks", "measured", "estimate", "fit", "applied_error", "tensor", "pipeline")
           if str(row.get(k, "")).startswith("traceback")]
    if bad or (row.get("applied") is not None and row["applied"] > row["budget"]):
        row["status"] = "fails"
    return row


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
    import torch

    torch.set_num_threads(1)
    for arch in sys.argv[2:]:  # one line a row, flushed: a parent that stops this process keeps the rows before
        print("ROW " + json.dumps(run_one(arch, plan=sys.argv[1] == "plan")), flush=True)
