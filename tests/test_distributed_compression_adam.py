"""Frozen-variance Adam (spec adam=W, onebit.py): the step's arithmetic, the error-feedback
invariant on the preconditioned momentum, spec refusals, and (2 gloo ranks) each lossy compressor
in adam mode under torch DDP, memfit's ddp and memfit's ZeRO-2."""
from __future__ import annotations

import math

import pytest
import torch

from memfit.core.errors import ConfigError
from memfit.distributed.compression import CompressionState, ErrorFeedback, parse_compression
from memfit.distributed.compression.onebit import FrozenVarianceAdam, attach
from memfit.distributed.compression.registry import make_codec

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16"


def _adamw(seed: int = 0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(6, 5)
    return lin, torch.optim.AdamW(lin.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)


def _grads(lin, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in lin.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_warm_up_steps_are_plain_adamw_and_then_the_update_uses_frozen_v():
    lin, opt = _adamw()
    ref_lin, ref = _adamw()
    state = CompressionState("sign:adam=2")
    frozen = attach(state, opt)
    for step in range(2):  # warm-up: the optimizer's own step, bitwise
        _grads(lin, step), _grads(ref_lin, step)
        opt.step(), ref.step()
    assert all(torch.equal(a, b) for a, b in zip(lin.parameters(), ref_lin.parameters()))
    v = {p: opt.state[p]["exp_avg_sq"].clone() for p in lin.parameters()}
    state.momentum_phase = True
    _grads(lin, 7)
    before = {p: p.detach().clone() for p in lin.parameters()}
    opt.step()
    for p in lin.parameters():
        d = (v[p].sqrt() / math.sqrt(1 - 0.95 ** 2)).add_(1e-8)
        expect = before[p] * (1 - 0.01 * 0.1) - 0.01 / (1 - 0.9 ** 3) * (p.grad / d)
        assert torch.allclose(p.detach(), expect, rtol=0, atol=1e-7)
        assert torch.equal(opt.state[p]["exp_avg_sq"], v[p])  # frozen
        assert torch.equal(frozen.denominator(p), d)


def test_error_feedback_invariant_on_the_preconditioned_momentum_is_exact():
    fb = ErrorFeedback(0.9, mask=True, dampened=True)
    codec = make_codec(parse_compression("topk:0.1"))
    g = torch.Generator().manual_seed(0)
    d = torch.rand(1000, generator=g) + 1e-3
    for step in range(4):
        grad = torch.randn(1000, generator=g)
        old = fb.residual.get("k", torch.zeros(1000))
        u_before = fb.velocity.get("k")
        x = fb.corrected("k", grad, d, step=step)
        u = fb.velocity["k"]
        assert torch.equal(x, (u / d).clamp(-1, 1) + old)
        if u_before is None:
            assert torch.equal(u, grad * (1 - 0.9))
        sent = codec.decode(codec.encode(x, step), 1000)
        residual = fb.update("k", x, sent)
        assert torch.equal(sent + residual, x)  # bitwise: top-k sends x or 0, bf16 rounding exact (Sterbenz)
        assert torch.all(u[sent != 0] == 0)  # DGC's momentum masking


def test_a_second_micro_batch_in_one_step_adds_its_share_without_decaying_again():
    fb = ErrorFeedback(0.9, mask=False, dampened=True)
    a, b = torch.ones(4), torch.full((4,), 2.0)
    fb.accumulate("k", a, step=0)
    share = fb.accumulate("k", b, step=0)
    assert torch.equal(share, b * (1 - 0.9))
    assert torch.allclose(fb.velocity["k"], (a + b) * (1 - 0.9))
    fb.accumulate("k", a, step=1)
    assert torch.allclose(fb.velocity["k"], 0.9 * (a + b) * 0.1 + 0.1 * a)


@pytest.mark.parametrize("spec, message", [
    ("int8:adam=5", "applies to topk and sign"),
    ("sign:adam=0", "at least 1"),
    ("sign:adam=5,momentum=0.9", "leave out momentum"),
    ("sign:adam=5,warm=bf16", "warm='bf16'"),
    ("topk:0.01,clip=-1", "positive gradient norm"),
    ("sign:adam=2,ef=0", "applies to topk and sign"),
])
def test_bad_adam_specs_raise_one_line(spec, message):
    with pytest.raises(ConfigError) as info:
        parse_compression(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_adam_mode_refuses_optimizers_it_cannot_drive():
    lin = torch.nn.Linear(3, 3)
    with pytest.raises(ConfigError, match="adam and adamw"):
        attach(CompressionState("sign:adam=2"), torch.optim.SGD(lin.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="needs the optimizer"):
        attach(CompressionState("sign:adam=2"), None)
    assert isinstance(attach(CompressionState("topk:0.01,adam=2"), torch.optim.Adam(lin.parameters())),
                      FrozenVarianceAdam)


# ---------------------------------------------------------------- 2 gloo ranks
ADAM_SPECS = ["sign:adam=2", "topk:0.05,adam=2"]
STEPS = 4


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _train(rank: int, kind: str, spec: str | None) -> dict:
    """STEPS of AdamW on the rank's own batches: torch DDP + TrainingOptimizer ("torch"), or
    memfit's ddp / zero2 (gradients summed: each rank divides by the global token count)."""
    from memfit.apply.optimizer import TrainingOptimizer
    from memfit.distributed import distribute
    from memfit.distributed.compression import register_compression
    from memfit.models.spec import parse_model

    torch.manual_seed(0)
    model = parse_model(TINY).build(seq=16)
    if kind == "torch":
        opt = TrainingOptimizer(model, "adamw", lr=1e-2, clip=1.0)
        run = torch.nn.parallel.DistributedDataParallel(model)
        state = register_compression(run, spec, optimizer=opt) if spec else None
        divisor = 1
    else:
        opt = distribute(model, kind, "adamw", lr=1e-2, clip=1.0)
        run, state, divisor = opt.model, (register_compression(opt, spec) if spec else None), 2
    losses, phases, start = [], [], _params(model)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 256, (4, 16), generator=g)
        y = torch.randint(0, 256, (4, 16), generator=g)
        _, loss, n = run(x, y)
        opt.backward(loss / (n * divisor), final=True)
        opt.step()
        losses.append(float(loss.detach()) / int(n))
        phases.append(state.momentum_phase if state is not None else None)
    return {"params": _params(model), "update": _params(model) - start, "losses": losses, "phases": phases,
            "summary": state.summary() if state is not None else None}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for kind in ("torch", "ddp", "zero2"):
        out[(kind, None)] = _train(rank, kind, None)
        for spec in ADAM_SPECS + [f"sign:adam={STEPS},warm=fp32"]:
            out[(kind, spec)] = _train(rank, kind, spec)
    return out


@pytest.fixture(scope="module")
def ranks():
    from memfit.distributed.spawn import run_world

    return run_world(_worker, 2, timeout_s=300)


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["torch", "ddp", "zero2"])
def test_fp32_warm_up_is_bitwise_the_uncompressed_run(ranks, kind):
    # adam=STEPS with warm=fp32: every step is a plain fp32 all-reduce and plain AdamW
    assert torch.equal(ranks[0][(kind, f"sign:adam={STEPS},warm=fp32")]["params"], ranks[0][(kind, None)]["params"])


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["torch", "ddp", "zero2"])
@pytest.mark.parametrize("spec", ADAM_SPECS)
def test_adam_mode_keeps_replicas_identical_and_trains(ranks, kind, spec):
    r0, r1 = ranks[0][(kind, spec)], ranks[1][(kind, spec)]
    assert torch.equal(r0["params"], r1["params"])
    assert r0["phases"] == [False, False, True, True]
    assert all(math.isfinite(v) for v in r0["losses"])
    plain = ranks[0][(kind, None)]["update"]
    cos = float(torch.nn.functional.cosine_similarity(r0["update"], plain, dim=0))
    assert cos > 0.8  # 2 compressed steps after 2 plain ones: the update still points the same way
    s = r0["summary"]
    assert s["steps"] == STEPS and s["ratio"] > 1.5  # 2 int8 steps, then 1-bit / 5% (+ ZeRO's one d gather)
