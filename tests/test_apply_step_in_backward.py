"""The optimizer step in backward (memfit.apply.step_in_backward): same numbers as the plain step,
less memory, the estimate equal to the measured step, and one-line refusals for what it cannot run."""
import pytest
import torch

import memfit
from memfit.apply.optimizer import TrainingOptimizer
from memfit.core.errors import ConfigError
from memfit.models.spec import parse_model

SPEC = "gpt:layers=2,hidden=32,heads=4,vocab=64"


def _train(step_in_backward: bool, precision: str, optimizer: str, lora: str | None = None, steps: int = 3):
    torch.manual_seed(0)
    model = memfit.GPT(memfit.GPTConfig(layers=2, hidden=32, heads=4, vocab=64, seq=16))
    if lora is not None:
        from memfit.models.lora import apply_lora, parse_lora

        model = apply_lora(model, parse_lora(lora))
    opt = TrainingOptimizer(model, optimizer, lr=1e-2, precision=precision, step_in_backward=step_in_backward)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # lr changes every step
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 16), generator=gen)
        with opt.autocast():
            _, loss_sum, n = model(x, x)
        loss = loss_sum / n
        opt.backward(loss)
        assert not step_in_backward or all(p.grad is None for p in model.parameters())  # freed as they arrived
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("precision,optimizer,lora", [
    ("32-true", "adamw", None), ("bf16-true", "momentum", None), ("bf16-mixed", "adamw", "r=4,targets=qkv,proj"),
])
def test_same_losses_and_weights_as_the_plain_step(precision, optimizer, lora):
    # Bit-identical, not close: on the CPU torch's optimizers update tensor by tensor, and the step in
    # backward runs the same optimizer's step() on each parameter, so every operation is the same.
    plain_losses, plain = _train(False, precision, optimizer, lora)
    losses, weights = _train(True, precision, optimizer, lora)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(plain, weights))


@pytest.mark.slow  # every optimizer in every precision the step in backward runs with (30 short runs)
def test_every_optimizer_bit_identical():
    from memfit.apply import lowbit, optimizers

    names = [n for n in optimizers.NAMES if not optimizers.info(n).extra or lowbit.available()]
    for precision in ("32-true", "bf16-true", "bf16-mixed"):
        for name in names:
            plain_losses, plain = _train(False, precision, name)
            losses, weights = _train(True, precision, name)
            assert losses == plain_losses, (precision, name)
            assert all(torch.equal(a, b) for a, b in zip(plain, weights)), (precision, name)


def test_estimate_equals_the_measured_step_and_is_lower():
    from memfit.measure.trace import measure_step, trace_step

    spec = parse_model(SPEC)
    figures = {}
    for sib in (False, True):
        est = trace_step(spec, batch=2, seq=16, precision="32-true", optimizer="adamw", step_in_backward=sib)
        real = measure_step(spec, batch=2, seq=16, precision="32-true", optimizer="adamw", allocator=False,
                            step_in_backward=sib)
        assert est.breakdown() == real.breakdown()  # to the byte: the same step, traced and run
        figures[sib] = real.breakdown()
    sizes = [p.numel() * 4 for p in spec.build(seq=16).parameters()]
    assert figures[False]["grads"] == sum(sizes)  # the plain step's peak holds every gradient
    assert figures[True]["grads"] <= max(sizes)  # one parameter's gradient at a time
    assert figures[True]["total"] < figures[False]["total"]


def test_composed_estimate_equals_the_whole_trace():
    from memfit.measure.blocks import composed_step
    from memfit.measure.trace import trace_step

    spec = parse_model("gpt:layers=3,hidden=32,heads=4,vocab=64")
    for ckpt in ("none", "full"):
        whole = trace_step(spec, batch=2, seq=16, precision="bf16-true", optimizer="adamw", checkpoint=ckpt,
                           step_in_backward=True)
        composed = composed_step(spec, 2, 16, "bf16-true", "adamw", ckpt, min_blocks=1, step_in_backward=True)
        assert composed.peak == whole.peak


def test_refusals_are_one_line():
    model = memfit.GPT(memfit.GPTConfig(layers=1, hidden=16, heads=2, vocab=32, seq=8))
    for kwargs in (dict(clip=1.0), dict(precision="16-mixed"), dict(precision="bf16-master"), dict(offload="cpu")):
        with pytest.raises(ConfigError, match="step in backward"):
            TrainingOptimizer(model, "adamw", step_in_backward=True, **kwargs)
    opt = TrainingOptimizer(model, "sgd", lr=0.1, step_in_backward=True)
    x = torch.randint(0, 32, (1, 8))
    with pytest.raises(ConfigError, match="accumulation"):
        opt.backward(model(x, x)[1], final=False)
    opt.backward(model(x, x)[1])
    with pytest.raises(ConfigError, match=r"call step\(\) after each backward"):
        opt.backward(model(x, x)[1])
    assert opt.step().stepped


def test_cli_refuses_accumulation_and_clipping(capsys):
    from memfit.cli import main

    assert main(["estimate", SPEC, "--step-in-backward", "--accum", "2"]) == 2
    assert main(["estimate", SPEC, "--step-in-backward", "--precision", "bf16-master"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("step in backward" in line for line in err)
    from memfit.cli.train import config_of

    cfg, _ = config_of({"step_in_backward": True})
    assert cfg.clip is None  # the default clip is dropped, an explicit one refused
    with pytest.raises(ConfigError, match="--clip"):
        config_of({"step_in_backward": True, "clip": 1.0})[0].validate()


def test_planner_takes_the_step_in_backward_only_when_allowed():
    # 1.2 MB: the plain step's gradients and state alone overrun it, the
    # step in backward's do not. The planner takes it only when allowed, and says what it gives up.
    from memfit.plan.costs import PlanError
    from memfit.plan.fit import fit
    from memfit.plan.plan import Plan

    with pytest.raises(PlanError, match="allow step-in-backward"):
        fit(SPEC, budget="1.2MB", batch=2, seq=16, allow=(), device="cpu")
    plan = fit(SPEC, budget="1.2MB", batch=2, seq=16, allow=("step-in-backward",), device="cpu")
    assert plan.step_in_backward and plan.accumulation == 1
    assert plan.measured_peak == plan.predicted_peak <= plan.budget  # the composed figure, checked by a full trace
    assert any("step in backward: no global clipping" in n for n in plan.notes)
    assert Plan.from_json(plan.to_json()).step_in_backward
