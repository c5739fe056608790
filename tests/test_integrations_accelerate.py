"""accelerate's loop planned by memfit (memfit.integrations.accelerate) on a tiny Llama from a config."""
from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import tiny_llama as tl  # noqa: E402
import memfit  # noqa: E402
from memfit.core.errors import DoesNotFitError  # noqa: E402
from memfit.integrations.accelerate import find_batch_size, prepare  # noqa: E402
from memfit.plan.costs import PlanError  # noqa: E402


def loop(accelerator, model, opt, micro, steps=3, clip=None, tracker=None, rows=4):
    """The loop as accelerate's docs write it, on the same `rows`-row steps split into `micro`-row batches;
    `peaks`: the tracker's peak over each optimizer step."""
    out, peaks = [], []
    data = tl.batch(rows * steps)
    for s in range(steps):
        if tracker is not None:
            tracker.reset_peak()
        for k in range(0, rows, micro):
            b = {key: v[rows * s + k: rows * s + k + micro] for key, v in data.items()}
            with accelerator.accumulate(model):
                loss = model(**b).loss
                accelerator.backward(loss)
                if clip is not None and accelerator.sync_gradients:
                    out.append(("norm", float(accelerator.clip_grad_norm_(model.parameters(), clip))))
                opt.step()
                opt.zero_grad()
            out.append(loss.item())
        if tracker is not None:
            peaks.append(tracker.peak_bytes)
    return out, peaks


def fresh_accelerator(**kw):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, **kw)


@pytest.mark.slow
def test_prepare_halfway_budget_within_it_and_losses_equal_the_plain_loop():
    keep, full = tl.peaks(tl.model(), tl.batch(4))
    budget = (keep + full) // 2
    acc = fresh_accelerator()
    m = tl.model()
    model, opt = acc.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-3))
    plain, _ = loop(acc, model, opt, 4)
    acc = fresh_accelerator()
    model, opt, plan = prepare(acc, tl.model(), budget, example=tl.batch(4), lr=1e-3, allow="recompute",
                               no_decay=None)
    assert any(a.mode != "keep" for a in plan.actions)
    with memfit.track(model, opt) as tr:
        mine, peaks = loop(acc, model, opt, plan.micro_batch, tracker=tr)
    assert max(peaks) <= budget and max(peaks) > full
    assert mine == plain


@pytest.mark.slow
def test_accumulation_each_step_within_the_budget_and_the_step_rows_kept():
    budget = tl.accumulation_budget()
    acc = fresh_accelerator(gradient_accumulation_steps=2)
    m = tl.model()
    model, opt = acc.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-3))
    plain, _ = loop(acc, model, opt, 4, rows=8)
    acc = fresh_accelerator(gradient_accumulation_steps=2)  # 2 x 4 rows per optimizer step
    model, opt, plan = prepare(acc, tl.model(), budget, example=tl.batch(4), lr=1e-3,
                               allow="recompute,accumulate", no_decay=None)
    # the plan is made for the whole step, so it counts the gradients held between its micro-batches
    assert plan.micro_batch < 4 and plan.micro_batch * plan.accumulation == 8
    assert acc.gradient_accumulation_steps == plan.accumulation
    with memfit.track(model, opt) as tr:
        mine, peaks = loop(acc, model, opt, plan.micro_batch, tracker=tr, rows=8)
    assert len(peaks) == 3 and max(peaks) <= budget
    step_loss = lambda out, n: [sum(out[i:i + n]) / n for i in range(0, len(out), n)]  # noqa: E731
    assert step_loss(mine, plan.accumulation) == pytest.approx(step_loss(plain, 2), rel=1e-5)


@pytest.mark.slow
def test_offload_plan_clips_through_memfits_optimizer_and_keeps_the_effective_batch():
    e = memfit.estimate(tl.model(), tl.batch(4), offload_optimizer="cpu")
    budget = int(e.per_device["total"] * 1.03)  # all kept, the optimizer state on the host
    acc = fresh_accelerator()
    model, opt, plan = prepare(acc, tl.model(), budget, example=tl.batch(4), lr=1e-3,
                               allow="recompute,accumulate,optimizer-offload")
    assert plan.offload_optimizer == "cpu" and plan.micro_batch * plan.accumulation == 4
    assert acc.gradient_accumulation_steps == plan.accumulation
    out, _ = loop(acc, model, opt, plan.micro_batch, clip=0.05)
    norms = [v for k, v in (o for o in out if isinstance(o, tuple))]
    assert len(norms) == 3 and all(n > 0.05 for n in norms)  # offloaded gradients measured, then clipped
    assert [p.grad for p in model.parameters()] == [None] * len(list(model.parameters()))


def test_fp16_runs_with_memfits_loss_scaler_in_place_of_accelerates():
    e = memfit.estimate(tl.model(), tl.batch(4), precision="16-mixed")
    budget = int(e.per_device["total"] * 1.05)  # all kept, fp16 autocast
    acc = fresh_accelerator(mixed_precision="fp16")
    model, opt, plan = prepare(acc, tl.model(), budget, example=tl.batch(4), lr=1e-3, allow="", no_decay=None)
    assert plan.precision == "16-mixed" and acc.scaler is None and opt.optimizer.scaler is not None
    with memfit.track(model, opt) as tr:
        mine, peaks = loop(acc, model, opt, plan.micro_batch, tracker=tr)
    assert max(peaks) <= budget
    # memfit's own fp16 loop (its autocast, loss scaling and step) on the same batches is the reference
    from memfit.integrations.common import training_optimizer

    m = tl.model()
    ref_opt = training_optimizer(plan, m, lr=1e-3, weight_decay=None, clip=None)
    ref, data = [], tl.batch(12)
    for s in range(3):
        with ref_opt.autocast():
            loss = m(**{k: v[4 * s: 4 * s + 4] for k, v in data.items()}).loss
        ref_opt.backward(loss)
        ref_opt.step()
        ref.append(loss.item())
    assert mine == ref
    with torch.no_grad():
        fp32 = tl.model()(**{k: v[:4] for k, v in data.items()}).loss.item()
    assert mine[0] != fp32 and mine[0] == pytest.approx(fp32, rel=1e-2)  # fp16 autocast ran (accelerate's does not on a CPU)
    assert opt.optimizer.scaler.scale > 1  # and the loss was scaled, by memfit's scaler alone


@pytest.mark.slow
def test_a_budget_below_the_floor_raises_before_step_0():
    acc = fresh_accelerator()
    # above the weights alone (545 KiB), below what training needs: the fit report says what dominates
    with pytest.raises(PlanError, match="nothing fits before step 0: .*smallest plan needs .*alone need"):
        prepare(acc, tl.model(), "1MiB", example=tl.batch(4))


def test_find_batch_size_keeps_the_effective_batch():
    calls = []

    @find_batch_size(effective_batch=8)
    def train(micro, accumulation):
        calls.append((micro, accumulation))
        if micro > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return micro * accumulation

    assert train() == 8 and calls == [(8, 1), (4, 2), (2, 4)]

    @find_batch_size(effective_batch=3)
    def never(micro, accumulation):
        raise DoesNotFitError("over budget")

    with pytest.raises(DoesNotFitError, match=r"tried \[3, 1\]"):
        never()

    @find_batch_size(effective_batch=4)
    def other(micro, accumulation):
        raise ValueError("not memory")

    with pytest.raises(ValueError):
        other()
