"""Hugging Face causal-LM families (tests/hf_family_configs.py: 21 of them, tiny) through memfit.estimate,
memfit.fit with a measured step, and fit_trainer with memfit's callback measuring each step: every plan's
measured peak within its budget.

The budget is halfway between the estimated peaks of keeping every block and recomputing every block,
so each plan must act (the block-chain truncation runs on every family, per-layer config lists such as
Gemma-2's alternating `layer_types` included). memfit.fit may use the per-block actions (ALLOW): the
grid is about every family's chain, not the outer search, which tests/test_plan_fit.py covers. The
default tier runs a covering subset, families with per-layer attention types (Gemma-2 through fit and a
measured step, Gemma-3 through the estimate); the whole grid, fit_trainer on nine families whose blocks
differ (FIT_TRAINER) and trl's SFTTrainer on Gemma-2 are slow (fit_trainer's default-tier tests:
tests/test_integrations_hf.py).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_configs as fam  # noqa: E402
import memfit  # noqa: E402

ALLOW = ("recompute", "selective")
ESTIMATE_TOLERANCE = 0.01
"""The estimate traces the same step that measure_module runs for real; 1% leaves room for the allocator's alignment of small tensors (64 bytes each)."""


def _grid(default: str | None) -> list:
    return [pytest.param(f, marks=[] if f == default else [pytest.mark.slow]) for f in fam.FAMILIES]


def _halfway(model, batch) -> int:
    keep = memfit.estimate(model, batch, checkpoint="none").per_device["total"]
    full = memfit.estimate(model, batch, checkpoint="full").per_device["total"]
    assert full < keep
    return (keep + full) // 2


@pytest.mark.parametrize("family", _grid("gemma3_text"))
def test_estimate_matches_the_measured_step(family):
    batch = fam.batch()
    from memfit.measure.anymodel_estimate import measure_module

    predicted = memfit.estimate(fam.model(family), batch, optimizer="adamw").per_device["total"]
    measured = measure_module(fam.model(family), batch, optimizer="adamw")["allocator"]
    assert abs(predicted - measured) <= ESTIMATE_TOLERANCE * measured, (family, predicted, measured)


@pytest.mark.parametrize("family", _grid("gemma2"))
def test_fit_plans_within_budget_and_the_measured_step_holds_it(family):
    batch = fam.batch()
    budget = _halfway(fam.model(family), batch)
    model = fam.model(family)
    plan = memfit.fit(model, batch, budget=f"{budget}B", allow=ALLOW)
    assert plan.predicted_peak <= budget and any(a.mode != "keep" for a in plan.actions), plan.summary()
    opt = plan.apply(model, lr=1e-3)
    with memfit.track(model, opt) as tr:
        for _ in range(2):  # the second step holds the optimizer state: the steady-state peak
            with opt.autocast():
                out = model(**batch)
            opt.backward(out.loss)  # `out` held through backward, as the plan budgets (keep_output=True)
            opt.step()
            del out
    assert tr.peak_bytes <= budget, (family, tr.peak_bytes, budget, plan.summary())


# fit_trainer's own part (the Trainer's batches and loss, the callback's measured steps) is the same for every
# family; each family's chain and plan are fit and measured above. So fit_trainer runs on the families that
# differ in the model it plans: GPT-2 (Conv1D, learned positions), Llama (the decoder most families copy),
# Mixtral and Qwen3-MoE (routed experts), Gemma-2 and Gemma-3 (per-layer attention types), Falcon, GPT-NeoX
# and Phi (their own block layouts: parallel attention, partial rotary). The twelve left out are rotary
# decoders whose blocks vary these (their norms, sliding windows), each through memfit.fit above.
FIT_TRAINER = ("gpt2", "llama", "mixtral", "qwen3_moe", "gemma2", "gemma3_text", "falcon", "gpt_neox", "phi")


@pytest.mark.slow
@pytest.mark.parametrize("family", FIT_TRAINER)
def test_fit_trainer_each_measured_step_within_budget(family, tmp_path):
    from memfit.integrations.hf import fit_trainer
    from memfit.integrations.hf_callback import MemfitCallback

    budget = _halfway(fam.model(family), fam.batch())
    rows = [{"input_ids": r, "labels": r.clone()} for r in fam.batch(rows=8)["input_ids"]]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                          use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                                          learning_rate=1e-3, seed=0)
    cb = MemfitCallback(budget=f"{budget}B", check_steps=2)  # (a plain number under a MiB reads as a typo)
    trainer = transformers.Trainer(model=fam.model(family), args=args, train_dataset=rows, callbacks=[cb])
    plan = fit_trainer(trainer, f"{budget}B")
    assert plan.predicted_peak <= budget
    trainer.train()
    assert len(cb.peaks) == 2 and max(cb.peaks) <= budget, (family, cb.peaks, budget, plan.summary())


def test_the_grid_covers_fifteen_families_the_installed_transformers_builds():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert len(fam.FAMILIES) >= 15 and all(f in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES for f in fam.FAMILIES)


@pytest.mark.slow
def test_trl_sft_trainer_plans_gemma2_within_budget(tmp_path):
    """trl's SFTTrainer on Gemma-2 (alternating sliding and full attention layers): planned and trained, each
    measured step within a budget below the plain step's peak."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import tiny_llama as tl
    from memfit.integrations.hf import fit_trainer
    from memfit.integrations.hf_callback import MemfitCallback

    ds = datasets.Dataset.from_dict({"input_ids": [r.tolist() for r in fam.batch(rows=8)["input_ids"]]})
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                         report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-3)

    def trainer():
        return trl.SFTTrainer(model=fam.model("gemma2"), args=args, train_dataset=ds, processing_class=tl.tokenizer())

    plain = fit_trainer(trainer(), "1GiB").predicted_peak
    budget = int(plain * 0.85)
    sft = trainer()
    plan = fit_trainer(sft, f"{budget}B")
    cb = MemfitCallback(budget=f"{budget}B", check_steps=2)
    sft.add_callback(cb)
    sft.train()
    assert plan.predicted_peak <= budget and len(cb.peaks) == 2 and max(cb.peaks) <= budget, (cb.peaks, budget)
