"""The chunked head in the estimate and the planner: traced exactly, lowers a head-bound peak, makes a
head-bound budget feasible, and survives the plan's JSON round trip into `memfit train --plan`."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from memfit.apply.head_swap import chunk_head, head_chunks
from memfit.apply.optimizer import TrainingOptimizer
from memfit.core.tracker import MemoryTracker
from memfit.measure.trace import measure_step, trace_step
from memfit.models.gpt import GPT, GPTConfig
from memfit.plan.costs import PlanError
from memfit.plan.fit import fit
from memfit.plan.plan import Plan
from memfit.plan.verify import measure

# At batch 1 the head sets the peak when the vocabulary is large next to the width (as GPT-2 small's
# 50257 x 768 logits at seq 1024 outweigh its blocks' activations).
CFG = GPTConfig(layers=2, hidden=64, heads=4, vocab=8192, seq=256)
SPEC = "gpt:layers=2,hidden=64,heads=4,vocab=8192,seq=256"
BUDGET = 24 * 2**20


def test_estimate_equals_the_measured_step_and_chunks_lower_the_peak():
    peaks = {}
    for chunks in (None, 4):
        build = lambda: chunk_head(GPT(CFG), chunks)  # noqa: E731
        traced = trace_step(build, batch=1, seq=256)
        measured = measure_step(build, batch=1, seq=256, allocator=False)
        assert traced.peak == measured.peak and traced.breakdown() == measured.breakdown()
        peaks[chunks] = measured.peak
    assert peaks[4] < 0.6 * peaks[None], peaks


def test_module_estimate_of_a_hugging_face_model_with_a_chunked_head_equals_the_tracker():
    transformers = pytest.importorskip("transformers")
    import memfit

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=4096, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = chunk_head(transformers.AutoModelForCausalLM.from_config(cfg), 4)
    x = torch.randint(0, 4096, (1, 128))
    example = {"input_ids": x, "labels": x}
    est = memfit.estimate(model, example)
    opt = TrainingOptimizer(model, "adamw")
    with MemoryTracker(model, opt) as t:
        for i in range(2):
            if i == 1:
                t.reset_peak()
            batch = {k: v.clone() for k, v in example.items()}
            loss = model(**batch).loss
            opt.backward(loss)
            opt.step()
    assert est.per_device["total"] == t.peak_bytes


def _real_peak(model: torch.nn.Module, opt) -> int:
    def step() -> None:
        x = torch.randint(0, CFG.vocab, (1, 256))
        with opt.autocast():
            _, loss, n = model(x, x)
        opt.backward(loss / n)
        opt.step()

    return measure(model, opt, step)


@pytest.mark.slow
def test_a_head_bound_budget_fits_only_with_chunked_head_and_the_applied_plan_fits_for_real(tmp_path):
    with pytest.raises(PlanError, match="allow chunked-head"):
        fit(SPEC, budget=BUDGET, batch=1, seq=256, allow=("recompute", "selective"))
    plan = fit(SPEC, budget=BUDGET, batch=1, seq=256, allow=("recompute", "selective", "chunked-head"))
    assert plan.head_chunks and plan.measured_peak <= BUDGET and plan.predicted_peak <= BUDGET
    assert f"head chunks: {plan.head_chunks}" in plan.summary()

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan": plan.to_json()}))
    from memfit.train.budget import load_plan, plan_config
    from memfit.train.config import TrainConfig

    again = load_plan(str(path))
    assert again.head_chunks == plan.head_chunks and again.ranked == plan.ranked
    cfg, _ = plan_config(TrainConfig(model=SPEC, batch=1, seq=256), plan_file=str(path))
    assert cfg.head_chunks == plan.head_chunks

    torch.manual_seed(0)
    model = GPT(CFG)
    plain = copy.deepcopy(model)
    opt = again.apply(model, lr=1e-3)
    assert head_chunks(model) == plan.head_chunks
    assert _real_peak(model, opt) <= BUDGET < _real_peak(plain, TrainingOptimizer(plain, "adamw", lr=1e-3))


def test_plan_json_without_head_chunks_still_loads():
    d = {"model": "m", "budget": 1, "actions": "keep*2", "micro_batch": 1, "accumulation": 1, "optimizer": "adamw",
         "precision": "32-true", "offload_optimizer": None, "predicted_peak": 1, "predicted_time": 0.0, "n_blocks": 2,
         "ranked": [{"micro_batch": 1, "accumulation": 1, "offload_optimizer": None, "precision": "32-true",
                     "peak": 1, "time": 0.0, "actions": "keep*2", "feasible": True}]}
    plan = Plan.from_json(d)
    assert plan.head_chunks is None and plan.ranked[0].head_chunks is None


@pytest.mark.slow
def test_grafted_head_profile_equals_the_profile_of_the_chunked_model():
    from memfit.measure.blocks import chain_profile, spec_source
    from memfit.models.spec import ModelSpec
    from memfit.plan.head import head_profile, head_source

    src = spec_source(ModelSpec("g", config=GPTConfig(layers=6, hidden=64, heads=4, vocab=4096, seq=128)), 2, 128)
    plain = chain_profile(src, "32-true", "adamw")
    grafted = head_profile(src, plain, 4, "32-true", "adamw")
    traced = chain_profile(head_source(src, 4), "32-true", "adamw")
    assert grafted.post_fwd != plain.post_fwd  # the head's stretches did change
    assert dataclasses.replace(grafted, seconds=0.0) == dataclasses.replace(traced, seconds=0.0)


@pytest.mark.slow
def test_memfit_train_runs_a_saved_plan_with_its_head_chunks_within_budget(tmp_path):
    from memfit.cli import main

    plan = fit(SPEC, budget=BUDGET, batch=1, seq=256, allow=("recompute", "selective", "chunked-head"))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan": plan.to_json()}))
    out = tmp_path / "run"
    assert main(["train", "--model", SPEC, "--plan", str(path), "--seq", "256", "--steps", "2", "--eval-batches", "1",
                 "--out", str(out)]) == 0
    budget = json.loads((out / "metrics.json").read_text())["budget"]
    assert budget["plan"]["head_chunks"] == plan.head_chunks
    assert budget["measured_peak_bytes"] <= BUDGET


def test_time_model_prices_the_forward_summed_weight_gradient_as_no_extra_gemm():
    """In fp32 the chunked head runs the plain head's three GEMMs (the weight gradient summed in the forward),
    so the model adds only the per-chunk term; in bf16 it adds one head GEMM more."""
    from memfit.apply.gemm_blocking import cpu_k_block
    from memfit.measure.blocks import spec_source
    from memfit.models.spec import parse_model
    from memfit.plan.costs import FLOPS
    from memfit.plan.head import head_seconds

    if cpu_k_block() is None:
        pytest.skip("no bitwise GEMM reduction block on this BLAS: the forward does not sum the weight gradient")
    src = spec_source(parse_model("gpt:layers=2,hidden=64,heads=4,vocab=8192,seq=512"), 2, 512)
    fp32, bf16 = (head_seconds(src, 1024, 4, precision=p) for p in ("32-true", "bf16-mixed"))
    one_gemm = 2 * 8192 * 64 * 1024 / FLOPS
    assert bf16 - fp32 == pytest.approx(one_gemm, rel=0.5)
    assert fp32 < 0.5 * one_gemm


def test_head_time_constants_are_the_fit_to_the_recorded_bench():
    """plan/head.py's constants are what bench/chunked_head.py's fit makes of its recorded run: rerunning
    the bench without refitting (or editing a constant by hand) fails here."""
    import json
    import sys
    from pathlib import Path

    from memfit.plan import head

    bench = Path(__file__).resolve().parent.parent / "bench"
    sys.path.insert(0, str(bench))
    import chunked_head

    fit = chunked_head.fit_constants(json.loads((bench / "results" / "chunked_head.json").read_text()))
    assert (head.EXTRA_GEMMS, head.CHUNK_TOKENS) == (fit["EXTRA_GEMMS"], fit["CHUNK_TOKENS"])


def test_a_loop_that_keeps_its_output_is_priced_exactly_with_a_chunked_head():
    """keep_output: the output the step begins with and holds through the update moves with the head
    (a chunked head's holds no full logits), so the composed figure is the traced step's (it was the
    plain head's logits over)."""
    plan = fit(SPEC, budget=BUDGET, batch=1, seq=256, allow=("recompute", "selective", "chunked-head"),
               keep_output=True)
    assert plan.head_chunks and plan.keep_output and plan.predicted_peak == plan.measured_peak <= BUDGET
