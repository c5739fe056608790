"""Hugging Face Trainer planned by memfit (memfit.integrations.hf) on a tiny Llama built from a config."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tiny_llama as tl  # noqa: E402
from memfit.core.errors import ConfigError  # noqa: E402
from memfit.integrations.hf import fit_trainer  # noqa: E402
from memfit.integrations.hf_callback import MemfitCallback  # noqa: E402
from memfit.plan.costs import PlanError  # noqa: E402


def make_trainer(model, tmp_path, steps=3, callbacks=None, optimizers=(None, None), **kw):
    kw = {"per_device_train_batch_size": 4, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
          "save_strategy": "no", **kw}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=steps, use_cpu=True, report_to=[],
                                          logging_steps=1, seed=0, disable_tqdm=True,
                                          train_sampling_strategy="sequential", **kw)
    return transformers.Trainer(model=model, args=args, train_dataset=tl.rows(), callbacks=callbacks,
                                optimizers=optimizers)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_chunked_head_keeps_the_forward_signature_for_trainers_column_filter(tmp_path):
    from memfit.apply.head_swap import chunk_head

    plain = make_trainer(tl.model(), tmp_path)
    plain.train()
    m = chunk_head(tl.model(), 4)
    assert "input_ids" in __import__("inspect").signature(m.forward).parameters
    chunked = make_trainer(m, tmp_path)  # remove_unused_columns=True (the default) drops "text" only
    chunked.train()
    assert losses(chunked) == pytest.approx(losses(plain), rel=1e-6)


@pytest.mark.slow
def test_fit_trainer_halfway_budget_each_step_within_it_and_losses_equal_the_plain_run(tmp_path):
    keep, full = tl.peaks(tl.model(), tl.batch(4))
    budget = (keep + full) // 2
    plain = make_trainer(tl.model(), tmp_path)
    plain.train()
    cb = MemfitCallback(budget=budget, check_steps=3)
    trainer = make_trainer(tl.model(), tmp_path, callbacks=[cb], activation_checkpointing=True)
    with pytest.warns(UserWarning, match="activation_checkpointing=True is turned off"):
        plan = fit_trainer(trainer, budget, allow="recompute")
    assert not trainer.args.activation_checkpointing
    assert any(a.mode != "keep" for a in plan.actions) and any(a.mode == "keep" for a in plan.actions)
    trainer.train()
    assert len(cb.peaks) == 3 and max(cb.peaks) <= budget
    assert max(cb.peaks) > full  # the tracker saw the whole step (with the optimizer state after step 1)
    assert losses(trainer) == losses(plain)  # recompute is exact


@pytest.mark.slow
def test_accumulation_keeps_per_device_batch_times_accumulation(tmp_path):
    m = tl.model()
    _, full4 = tl.peaks(m, tl.batch(4))
    _, full2 = tl.peaks(m, tl.batch(2))
    budget = (full4 + full2) // 2  # batch 4 cannot fit even all recomputed; a smaller micro-batch can
    plain = make_trainer(tl.model(), tmp_path, gradient_accumulation_steps=2)
    plain.train()
    cb = MemfitCallback(budget=budget, check_steps=2)
    trainer = make_trainer(tl.model(), tmp_path, callbacks=[cb], gradient_accumulation_steps=2)
    plan = fit_trainer(trainer, budget, allow="recompute,accumulate")
    # the plan is made for the whole optimizer step (2 x 4 rows), the gradients held between micro-batches in it
    assert plan.micro_batch < 4 and plan.micro_batch * plan.accumulation == 8
    a = trainer.args
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps) == (plan.micro_batch, plan.accumulation)
    trainer.train()
    assert len(cb.peaks) == 2 and max(cb.peaks) <= budget
    assert losses(trainer) == pytest.approx(losses(plain), rel=1e-5)


@pytest.mark.slow
def test_a_budget_below_the_floor_raises_before_step_0(tmp_path):
    trainer = make_trainer(tl.model(), tmp_path)
    with pytest.raises(PlanError, match="nothing fits before step 0.*need"):
        fit_trainer(trainer, "200KiB")
    assert trainer.state.global_step == 0


def test_refusals_are_one_line(tmp_path):
    trainer = make_trainer(tl.model(), tmp_path, auto_find_batch_size=True)
    with pytest.raises(ConfigError, match="auto_find_batch_size"):
        fit_trainer(trainer, "1GiB")
    trainer = make_trainer(tl.model(), tmp_path, optim="lomo")
    with pytest.raises(ConfigError, match="optim='lomo'"):
        fit_trainer(trainer, "1GiB")


def _offload_budget():
    import memfit

    e = memfit.estimate(tl.model(), tl.batch(4), precision="bf16-master", offload_optimizer="cpu")
    return int(e.per_device["total"] * 1.03)  # bf16-master with the optimizer on the host, all kept


def memfit_loop(plan, steps, clip, lr=1e-3, wd=0.0):
    """memfit's own loop on the same batches (sequential order), the reference for Trainer's run."""
    from memfit.integrations.common import training_optimizer

    m = tl.model()
    plan.install(m)
    no_decay = [n for n, p in m.named_parameters() if "norm" in n or n.endswith("bias")]
    opt = training_optimizer(plan, m, lr=lr, weight_decay=wd, clip=clip, no_decay=no_decay, betas=(0.9, 0.999),
                             eps=1e-8)
    data, out, norms = tl.rows(), [], []
    for s in range(steps):
        rows = data[4 * s: 4 * s + 4]
        b = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}
        with opt.autocast():
            loss = m(**b).loss
        opt.backward(loss)
        out.append(loss.item())
        norms.append(opt.step().grad_norm)
    return out, norms


@pytest.mark.slow
def test_optimizer_offload_bf16_master_clips_and_logs_through_memfits_optimizer(tmp_path):
    budget = _offload_budget()
    trainer = make_trainer(tl.model(), tmp_path, max_grad_norm=0.05)
    plan = fit_trainer(trainer, budget, allow="optimizer-offload,precision")
    assert (plan.precision, plan.offload_optimizer) == ("bf16-master", "cpu")
    trainer.train()
    ref, ref_norms = memfit_loop(plan, 3, clip=0.05)
    assert losses(trainer) == pytest.approx(ref, rel=1e-6)
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert all(n > 0.05 for n in norms)  # non-zero, and above max_grad_norm: clipping was applied
    assert norms == pytest.approx(ref_norms, rel=1e-4)
    # The broken setup: memfit's offloading optimizer handed to a plain Trainer. Gradients leave the device
    # during backward only through memfit's backward, so Trainer's own backward keeps them on the device,
    # its clipping goes to the device copies and the update reads none of them: the logged norm is right
    # only by accident and the run is not the reference one.
    from memfit.integrations.common import training_optimizer

    m = tl.model()
    plan.install(m)
    opt = training_optimizer(plan, m, lr=1e-3, weight_decay=0.0, clip=None)
    broken = make_trainer(m, tmp_path, max_grad_norm=0.05, optimizers=(opt, None))
    broken.train()
    assert losses(broken)[1:] != pytest.approx(ref[1:], rel=1e-6)


@pytest.mark.slow
def test_save_and_resume_through_trainer_are_bitwise(tmp_path):
    budget = _offload_budget()

    def run(out, resume=None):
        trainer = make_trainer(tl.model(), out, steps=4, save_strategy="steps", save_steps=2)
        fit_trainer(trainer, budget, allow="optimizer-offload,precision")
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "a")
    resumed = run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-2"))
    for (n, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n
    assert losses(resumed) == losses(whole)  # steps 1-2 from the checkpoint's history, 3-4 run again


def test_fit_trainer_plans_a_named_gpu_from_this_machine(tmp_path):
    """device="h100" plans the GPU run on a CPU machine: the check traces that GPU's caching allocator,
    whose reserved peak is whole 2 MiB segments (a CPU trace counts bytes); a name that is neither a GPU
    nor a device of this machine is one line."""
    trainer = make_trainer(tl.model(), tmp_path)
    with pytest.raises(ConfigError, match="h1000"):
        fit_trainer(trainer, "1GiB", device="h1000")
    plan = fit_trainer(trainer, "1GiB", device="h100", allow="recompute")
    assert plan.device == "h100"
    assert plan.measured_peak > plan.predicted_peak and plan.measured_peak % (2 << 20) == 0
    assert "H100" in plan.host_source
