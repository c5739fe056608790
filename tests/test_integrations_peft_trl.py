"""A peft LoRA model and trl's SFTTrainer through memfit.integrations.hf.fit_trainer (tiny Llama from a config)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tiny_llama as tl  # noqa: E402
from memfit.integrations.hf import fit_trainer  # noqa: E402
from memfit.integrations.hf_callback import MemfitCallback  # noqa: E402
from test_integrations_hf import losses, make_trainer  # noqa: E402


def lora_model():
    peft = pytest.importorskip("peft")
    m = tl.model()
    m = peft.prepare_model_for_kbit_training(m, use_gradient_checkpointing=True)
    # On a model not loaded in k-bit, peft leaves checkpointing off; switch it on as it does for a k-bit one.
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(1)
    return peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


@pytest.mark.slow
def test_lora_model_checkpointing_replaced_by_the_plan_within_budget(tmp_path):
    import memfit

    b = tl.batch(4)
    keep = memfit.estimate(lora_model().get_base_model(), b, checkpoint="none").per_device["total"]
    full = memfit.estimate(lora_model().get_base_model(), b, checkpoint="full").per_device["total"]
    budget = (keep + full) // 2
    cb = MemfitCallback(budget=budget, check_steps=3)
    trainer = make_trainer(lora_model(), tmp_path, callbacks=[cb])
    with pytest.warns(UserWarning, match="gradient checkpointing is turned off"):
        plan = fit_trainer(trainer, budget, allow="recompute")
    assert not any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())
    assert any(a.mode != "keep" for a in plan.actions)
    trainer.train()
    assert max(cb.peaks) <= budget
    plain = make_trainer(lora_model(), tmp_path)  # peft's own checkpointing: the same losses, recomputed
    plain.train()
    assert losses(trainer) == pytest.approx(losses(plain), rel=1e-6)


def sft_trainer(tmp_path, steps=3, callbacks=None, **kw):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in tl.rows()]})
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, use_cpu=True,
                         report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, learning_rate=1e-3,
                         train_sampling_strategy="sequential", **kw)
    return trl.SFTTrainer(model=tl.model(), args=args, train_dataset=ds, processing_class=tl.tokenizer(),
                          callbacks=callbacks)


def test_trl_fused_head_is_priced_by_the_plan(tmp_path):
    """fit_trainer plans the call trl's compute_loss makes (fused_lm_head=True): its tile buffer and fp32
    gradient accumulators are in the prediction, which the measured steps match."""
    trainer = sft_trainer(tmp_path, steps=2)
    with pytest.warns(UserWarning, match="activation_checkpointing=True is turned off"):
        plan = fit_trainer(trainer, "1GiB", allow="")
    assert plan.head_chunks is None  # trl's own fused LM head stays
    cb = MemfitCallback(plan=plan, check_steps=2)
    trainer.add_callback(cb)
    trainer.train()
    assert len(cb.peaks) == 2
    assert plan.predicted_peak * 0.98 <= max(cb.peaks) <= plan.predicted_peak * 1.01
    # The plain head (what the plan priced before) is a fraction of it: trl's tile is 32768 columns wide.
    plain = tl.peaks(tl.model(), tl.batch(4))[0]
    assert max(cb.peaks) > 2 * plain


@pytest.mark.slow
def test_trl_sft_trainer_halfway_budget_each_step_within_it(tmp_path):
    import memfit
    from memfit.integrations.hf import collated_batch
    from memfit.plan.costs import PlanError

    plain = sft_trainer(tmp_path)
    plain.train()
    probe = sft_trainer(tmp_path)
    b = {**collated_batch(probe, 4), "fused_lm_head": True}  # as trl's compute_loss calls it
    keep, full = (memfit.estimate(probe.model, b, precision="bf16-mixed", checkpoint=c).per_device["total"]
                  for c in ("none", "full"))
    budget = (keep + full) // 2
    cb = MemfitCallback(budget=budget, check_steps=3)
    trainer = sft_trainer(tmp_path, callbacks=[cb])
    with pytest.warns(UserWarning, match="activation_checkpointing=True is turned off"):  # SFTConfig's default
        plan = fit_trainer(trainer, budget, allow="recompute")
    assert any(a.mode != "keep" for a in plan.actions) and plan.predicted_peak <= budget
    trainer.train()
    assert len(cb.peaks) == 3 and max(cb.peaks) <= budget
    assert losses(trainer) == pytest.approx(losses(plain), rel=1e-6)
    with pytest.raises(PlanError, match="nothing fits before step 0"):  # below trl's head: refused, not run over
        fit_trainer(sft_trainer(tmp_path), full // 2, allow="recompute")


def test_trl_two_forward_settings_are_refused(tmp_path):
    from memfit.core.errors import ConfigError

    trainer = sft_trainer(tmp_path, label_smoothing_factor=0.1)
    with pytest.raises(ConfigError, match="label_smoothing_factor"):
        fit_trainer(trainer, "1GiB")
