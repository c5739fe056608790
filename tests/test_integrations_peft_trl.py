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


@pytest.mark.slow
def test_trl_sft_trainer_through_fit_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in tl.rows()]})

    def sft(callbacks=None):
        args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, learning_rate=1e-3,
                             train_sampling_strategy="sequential")
        return trl.SFTTrainer(model=tl.model(), args=args, train_dataset=ds, processing_class=tl.tokenizer(),
                              callbacks=callbacks)

    plain = sft()
    plain.train()
    keep, full = tl.peaks(tl.model(), tl.batch(4))
    cb = MemfitCallback(budget=(keep + full) // 2, check_steps=2, on_exceed="warn")
    trainer = sft([cb])
    with pytest.warns(UserWarning, match="activation_checkpointing=True is turned off"):  # SFTConfig's default
        plan = fit_trainer(trainer, (keep + full) // 2, allow="recompute")
    assert plan.head_chunks is None  # trl's own fused LM head stays
    with pytest.warns(UserWarning, match="over the budget"):
        trainer.train()  # trl's fused head holds more than the plain head the plan priced (see docs/integrations.md)
    assert losses(trainer) == pytest.approx(losses(plain), rel=1e-6)
    assert len(cb.peaks) == 2
