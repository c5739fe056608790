"""Precision modes: dtypes on the device, every mode trains, master weights track fp32, exact bytes."""
import copy
import math

import pytest
import torch

from memfit.apply.optimizer import TrainingOptimizer
from memfit.apply.precision import MODES, PRECISIONS, cast_model, precision_mode
from memfit.core import tracker
from memfit.core.errors import ConfigError
from memfit.measure import formulas, trace
from memfit.models.gpt import GPT, GPTConfig

CFG = GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=32)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def pattern_batch(batch: int = 4, seq: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable stream (each token is the previous + 1 mod 17, from random starts)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 17, (batch, 1), generator=g)
    seq_ = (start + torch.arange(seq + 1)) % 17
    return seq_[:, :-1].contiguous(), seq_[:, 1:].contiguous()


def train_losses(model, precision, steps, offload=None, lr=1e-2, **kw) -> list[float]:
    opt = TrainingOptimizer(model, "adamw", lr=lr, precision=precision, clip=1.0, offload=offload, **kw)
    losses = []
    try:
        for s in range(steps):
            x, y = pattern_batch(seed=s)
            with opt.autocast():
                _, loss, n = model(x, y)
            opt.backward(loss / n)
            losses.append(float(loss.detach()) / int(n))
            opt.step()
    finally:
        opt.close()
    return losses


def test_mode_table_dtypes():
    assert set(PRECISIONS) == {"32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16-master", "16-master"}
    assert MODES["32-true"].param_dtype == torch.float32 and MODES["32-true"].autocast_dtype is None
    assert MODES["bf16-mixed"].param_dtype == torch.float32 and MODES["bf16-mixed"].autocast_dtype == torch.bfloat16
    assert MODES["bf16-true"].state_dtype == torch.bfloat16 and MODES["bf16-true"].master_dtype is None
    assert MODES["16-master"].param_dtype == torch.float16 and MODES["16-master"].master_dtype == torch.float32
    assert [m for m in PRECISIONS if MODES[m].loss_scaling] == ["16-mixed", "16-true", "16-master"]


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="accepted: 32-true"):
        precision_mode("fp8")
    with pytest.raises(ConfigError, match="unknown precision"):
        TrainingOptimizer(tiny_gpt(), precision="half")


def test_cast_model_keeps_parameter_objects_and_integer_buffers():
    model = tiny_gpt()
    model.register_buffer("counter", torch.zeros(3, dtype=torch.int64))
    params = list(model.parameters())
    cast_model(model, "bf16-master")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert model.counter.dtype == torch.int64


OFFLOADED = ("32-true", "bf16-true", "bf16-master", "16-master")  # the rest share these code paths


@pytest.mark.parametrize(
    "precision,offload",
    [(p, None) for p in PRECISIONS] + [(p, o) for p in OFFLOADED for o in ("cpu", "disk")],
)
def test_every_mode_trains(precision, offload, tmp_path):
    model = tiny_gpt()
    spill = str(tmp_path) if offload == "disk" else None
    losses = train_losses(model, precision, steps=8, offload=offload, spill_dir=spill)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3, losses  # the pattern is learnable: loss must drop
    assert all(p.dtype == MODES[precision].param_dtype for p in model.parameters())


def test_master_weights_track_fp32_loss():
    """bf16 weights with fp32 master weights and fp32 Adam state follow the fp32 run's loss curve.

    Tolerance: 2% relative per step over 40 steps; bf16 rounding of weights and activations (8-bit
    mantissa) moves the loss by well under that on this model, while a run whose update were lost
    in bf16 rounding (no master weights) drifts further (checked below against bf16-true)."""
    ref = train_losses(tiny_gpt(), "32-true", steps=40, lr=3e-3)
    master = train_losses(tiny_gpt(), "bf16-master", steps=40, lr=3e-3)
    rel = [abs(a - b) / a for a, b in zip(ref, master)]
    assert max(rel) < 0.02, max(rel)
    assert ref[-1] < ref[0] * 0.6


def test_master_weights_keep_updates_bf16_weights_would_lose():
    """An update far below bf16's resolution: bf16-true loses it, bf16-master accumulates it."""
    def run(precision):
        lin = torch.nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            lin.weight.fill_(1.0)
        opt = TrainingOptimizer(lin, "sgd", lr=1e-4, precision=precision)
        for _ in range(100):
            with opt.autocast():
                out = lin(torch.ones(1, 4)).sum()
            opt.backward(out)  # d out / d w = 1 everywhere: each step subtracts lr = 1e-4
            opt.step()
        return float(lin.weight.detach().float().mean())

    assert run("bf16-true") == 1.0  # 1 - 1e-4 rounds back to 1 in bf16 (spacing 2**-7 near 1)
    assert run("bf16-master") == pytest.approx(0.99, abs=0.004)  # 100 * 1e-4 held by the fp32 master


@pytest.mark.parametrize("precision", PRECISIONS)
def test_model_state_bytes_match_formulas(precision):
    """Tracker-measured params / grads / optimizer bytes equal memfit.measure.formulas exactly.

    Adam also keeps a 4-byte `step` counter per parameter tensor (torch.optim's implementation); the
    formulas count per-element bytes, so the counters are added here explicitly."""
    model = tiny_gpt()
    opt = TrainingOptimizer(model, "adamw", precision=precision)
    n_tensors = len(list(model.parameters()))
    x, y = pattern_batch()
    with tracker.track(model, opt) as t:
        for _ in range(2):
            with opt.autocast():
                _, loss, n = model(x, y)
            opt.backward(loss / n)
            after_backward = t.snapshot()
            opt.step()
        after_step = t.snapshot()
    f = formulas.model_state_bytes(model.num_params(), precision, "adamw")
    assert after_step["params"] == f.params
    assert after_backward["grads"] == f.grads
    assert after_step["optimizer"] == f.optimizer + 4 * n_tensors


def test_state_dict_loads_weights_only_and_resumes_exactly(tmp_path):
    """A checkpoint of a bf16-master optimizer (masters + fp32 state + nothing else) resumes bit-exactly."""
    def steps(model, opt, seeds):
        for s in seeds:
            x, y = pattern_batch(seed=s)
            with opt.autocast():
                _, loss, n = model(x, y)
            opt.backward(loss / n)
            opt.step()

    a = tiny_gpt()
    opt_a = TrainingOptimizer(a, "adamw", lr=1e-2, precision="bf16-master", clip=1.0)
    steps(a, opt_a, range(3))
    path = tmp_path / "opt.pt"
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, path)
    steps(a, opt_a, range(3, 6))

    ck = torch.load(path, weights_only=True)
    b = tiny_gpt(seed=1)
    opt_b = TrainingOptimizer(b, "adamw", lr=1e-2, precision="bf16-master", clip=1.0)
    b.load_state_dict(ck["model"])
    opt_b.load_state_dict(ck["opt"])
    steps(b, opt_b, range(3, 6))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

    with pytest.raises(ConfigError, match="precision"):
        TrainingOptimizer(tiny_gpt(), precision="32-true").load_state_dict(ck["opt"])


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="clip"):
        TrainingOptimizer(tiny_gpt(), clip=0.0)
    with pytest.raises(ConfigError, match="accepted: none, cpu, disk"):
        TrainingOptimizer(tiny_gpt(), offload="nvme")
    with pytest.raises(ConfigError, match="accepted: sgd"):
        TrainingOptimizer(tiny_gpt(), "lamb")
    with pytest.raises(ConfigError, match="takes no betas; accepted: lr, momentum"):
        TrainingOptimizer(tiny_gpt(), "sgd", betas=(0.9, 0.95))


def test_spill_dir_is_accepted_whatever_the_optimizer_offload(tmp_path):
    """One spill folder serves activation and optimizer offload: without optimizer disk offload it
    is simply not used (nothing is created in it)."""
    for offload in (None, "cpu"):
        TrainingOptimizer(tiny_gpt(), offload=offload, spill_dir=str(tmp_path / "spill")).close()
    assert not (tmp_path / "spill").exists()


def test_master_mode_has_no_persistent_fp32_grads():
    """Between steps a bf16-master optimizer holds masters + state only: grads are gone and nothing
    else of parameter size lives in it (the fp32 gradient copies exist only inside step)."""
    model = tiny_gpt()
    opt = TrainingOptimizer(model, "adamw", precision="bf16-master")
    ref = copy.deepcopy(model)
    x, y = pattern_batch()
    with opt.autocast():
        _, loss, n = model(x, y)
    opt.backward(loss / n)
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    held = sum(t.numel() * t.element_size() for t in opt.state_tensors())
    n_params = sum(p.numel() for p in ref.parameters())
    assert held == 12 * n_params + 4 * len(list(ref.parameters()))  # master 4 + Adam 8 (+ step counters)
    assert all(m.grad is None for m in opt.streamed.masters)


@pytest.mark.slow
def test_master_weights_track_fp32_on_the_default_run(tmp_path):
    """`memfit train`'s default model and data, 80 steps: bf16-master's loss curve stays within 2%
    (relative, per step, after the first 5) of 32-true's, and both end well below the start."""
    from memfit.train.loop import TrainConfig, train

    curves = {}
    for precision in ("32-true", "bf16-master"):
        cfg = TrainConfig(steps=80, precision=precision, out=str(tmp_path / precision), track=False,
                          eval_every=0, save_every=0, device="cpu")
        curves[precision] = train(cfg, progress=False, log=lambda *_: None).metrics["steps"]["loss"]
    ref, master = curves["32-true"], curves["bf16-master"]
    assert len(ref) == len(master) == 80
    rel = [abs(a - b) / a for a, b in zip(ref[5:], master[5:])]
    assert max(rel) < 0.02, max(rel)
    assert master[-1] < master[0] - 1.0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_no_allocation_trace_predicts_every_mode(precision):
    """The estimator's FakeTensorMode trace runs every mode (fp16's overflow check has no values
    there and is taken as clean) and predicts the real run's model-state bytes exactly and its
    peak within 3%."""
    from memfit.models.spec import parse_model

    spec = parse_model("gpt:layers=2,hidden=64,heads=2,vocab=256,seq=64")
    predicted = trace.trace_step(spec, 2, 32, precision=precision)
    measured = trace.measure_step(spec, 2, 32, precision=precision)
    assert (predicted.params, predicted.optimizer) == (measured.params, measured.optimizer)
    assert abs(predicted.peak - measured.peak) <= 0.03 * measured.peak
