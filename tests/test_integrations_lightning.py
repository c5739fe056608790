"""Lightning 2.6 planned by memfit (memfit.integrations.lightning) on a tiny Llama from a config."""
from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

import tiny_llama as tl  # noqa: E402
from memfit.core.errors import ConfigError  # noqa: E402
from memfit.integrations.lightning import (MemfitCallback, MemfitPrecision, memfit_optimizer,  # noqa: E402
                                           plan_module)


class Lit(L.LightningModule):
    def __init__(self, plan=None, batch_size=4):
        super().__init__()
        self.model, self.plan, self.batch_size, self.losses = tl.model(), plan, batch_size, []

    def training_step(self, batch, idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        rows = [{k: r[k] for k in ("input_ids", "labels")} for r in tl.rows()]
        return torch.utils.data.DataLoader(rows, batch_size=self.batch_size)

    def configure_optimizers(self):
        if self.plan is None:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return memfit_optimizer(self.plan, self, lr=1e-3, no_decay=None)


def fit(lit, steps=3, accumulate=1, **kw):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate, **kw)
    trainer.fit(lit)
    return trainer


@pytest.mark.slow
def test_halfway_budget_within_it_and_losses_equal_the_plain_run():
    keep, full = tl.peaks(tl.model(), tl.batch(4))
    budget = (keep + full) // 2
    plain = Lit()
    fit(plain)
    plan = plan_module(tl.model(), tl.batch(4), budget, allow="recompute")
    assert any(a.mode != "keep" for a in plan.actions)
    lit, cb = Lit(plan), MemfitCallback(plan, check_steps=3)
    fit(lit, plugins=[MemfitPrecision(plan)], callbacks=[cb])
    assert len(cb.peaks) == 3 and max(cb.peaks) <= budget and max(cb.peaks) > full
    assert lit.losses == plain.losses


@pytest.mark.slow
def test_accumulation_each_step_within_the_budget_and_the_step_rows_kept():
    budget = tl.accumulation_budget()
    plain = Lit()
    fit(plain, accumulate=2)
    plan = plan_module(tl.model(), tl.batch(4), budget, allow="recompute,accumulate", accumulate_grad_batches=2)
    assert plan.micro_batch < 4 and plan.micro_batch * plan.accumulation == 8  # the whole step: 2 x 4 rows
    lit, cb = Lit(plan), MemfitCallback(plan, check_steps=3)
    trainer = fit(lit, accumulate=2, plugins=[MemfitPrecision(plan)], callbacks=[cb])
    assert trainer.accumulate_grad_batches == plan.accumulation and lit.batch_size == plan.micro_batch
    assert len(cb.peaks) == 3 and max(cb.peaks) <= budget
    step_loss = lambda out, n: [sum(out[i:i + n]) / n for i in range(0, len(out), n)]  # noqa: E731
    assert step_loss(lit.losses, plan.accumulation) == pytest.approx(step_loss(plain.losses, 2), rel=1e-5)


@pytest.mark.slow
def test_offload_plan_with_accumulation_and_clipping():
    import memfit

    e = memfit.estimate(tl.model(), tl.batch(4), offload_optimizer="cpu")
    plan = plan_module(tl.model(), tl.batch(4), int(e.per_device["total"] * 1.03),
                       allow="recompute,accumulate,optimizer-offload")
    assert plan.offload_optimizer == "cpu"
    lit = Lit(plan)
    norms = []

    class Norms(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            norms.append(getattr(optimizer, "_optimizer", optimizer).grad_norm())

    trainer = fit(lit, accumulate=2, plugins=[MemfitPrecision(plan)],
                  callbacks=[MemfitCallback(plan), Norms()], gradient_clip_val=0.05)
    assert trainer.accumulate_grad_batches == 2 * plan.accumulation
    assert lit.batch_size == plan.micro_batch
    assert norms and all(n > 0.05 for n in norms)  # offloaded gradients seen, above the clip value
    assert trainer.optimizers[0].clip == 0.05


def test_convert_module_chunks_the_head_of_the_planned_submodule():
    import dataclasses

    from memfit.apply.head_swap import head_chunks

    plan = dataclasses.replace(plan_module(tl.model(), tl.batch(4), "1GiB", allow=""), head_chunks=2)
    lit = Lit(plan)
    assert MemfitPrecision(plan).convert_module(lit) is lit
    assert head_chunks(lit.model) == 2  # lit.model: the LlamaForCausalLM plan_module planned
    with torch.no_grad():
        assert lit.model(**tl.batch(4)).loss.item() == pytest.approx(tl.model()(**tl.batch(4)).loss.item(), rel=1e-6)


@pytest.mark.slow
def test_chunked_head_is_installed_on_the_model_the_plan_was_made_for():
    import memfit
    from memfit.apply.head_swap import head_chunks

    keep = memfit.estimate(tl.model(), tl.batch(4), checkpoint="none").per_device["total"]
    plan = plan_module(tl.model(), tl.batch(4), int(keep * 0.95), allow="chunked-head")
    assert plan.head_chunks  # the plain head does not fit: the plan chunks it
    plain = Lit()
    fit(plain, steps=2)
    lit, cb = Lit(plan), MemfitCallback(plan, check_steps=2)
    fit(lit, steps=2, plugins=[MemfitPrecision(plan)], callbacks=[cb])
    assert head_chunks(lit.model) == plan.head_chunks  # on lit.model, the model plan_module planned
    assert len(cb.peaks) == 2 and max(cb.peaks) <= plan.budget
    assert lit.losses == pytest.approx(plain.losses, rel=1e-5)


def test_fp16_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="fp16"):
        plan_module(tl.model(), tl.batch(4), "1GiB", precision="16-mixed")
