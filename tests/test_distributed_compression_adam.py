"""Compressed Adam (spec adam=W, onebit.py): the step's arithmetic, the local Adam direction, the
error-feedback invariant on it, spec refusals, and (2 gloo ranks) each lossy compressor
in adam mode under torch DDP, memfit's ddp and memfit's ZeRO-2."""
from __future__ import annotations

import math

import pytest
import torch

from memfit.core.errors import ConfigError
from memfit.distributed.compression import CompressionState, parse_compression
from memfit.distributed.compression.onebit import WIRE_SCALE, CompressedAdamStep, LocalAdam, attach

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16"


def _adamw(seed: int = 0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(6, 5)
    return lin, torch.optim.AdamW(lin.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)


def _grads(lin, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in lin.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_warm_up_steps_are_plain_adamw_and_then_the_step_applies_the_exchanged_update():
    lin, opt = _adamw()
    ref_lin, ref = _adamw()
    state = CompressionState("sign:adam=2")
    attach(state, opt)
    assert state.local_adam.betas == (0.9, 0.95) and state.local_adam.eps == 1e-8  # the optimizer's
    for step in range(2):  # warm-up: the optimizer's own step, bitwise
        _grads(lin, step), _grads(ref_lin, step)
        opt.step(), ref.step()
    assert all(torch.equal(a, b) for a, b in zip(lin.parameters(), ref_lin.parameters()))
    state.update_phase = True
    g = torch.Generator().manual_seed(7)
    updates = {p: torch.randn(p.shape, generator=g) for p in lin.parameters()}
    before = {p: p.detach().clone() for p in lin.parameters()}
    for p in lin.parameters():
        p.grad = updates[p] * WIRE_SCALE  # what the exchange hands over
    assert float(torch.nn.utils.clip_grad_norm_(list(lin.parameters()), 1.0)) < 1e-4  # a clip of 1 cannot bind
    opt.step()
    for p in lin.parameters():
        assert torch.allclose(p.detach(), before[p] * (1 - 0.01 * 0.1) - 0.01 * updates[p], rtol=0, atol=1e-7)


def test_local_adam_direction_is_torch_adams_step():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(50))
    adam = torch.optim.Adam([w], lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    local = LocalAdam((0.9, 0.95), 1e-8)
    for step in range(5):
        grad = torch.randn(50, generator=torch.Generator().manual_seed(step))
        before = w.detach().clone()
        w.grad = grad.clone()
        adam.step()
        assert torch.allclose(before - w.detach(), local.direction("k", grad), rtol=1e-5, atol=1e-6)


def test_error_feedback_invariant_on_the_adam_direction_is_exact():
    """adam mode: x = y + old residual (y the rank's Adam direction); sent + new residual == x
    bitwise for top-k (it sends x or 0; bf16 rounding is exact by Sterbenz's lemma)."""
    state = CompressionState("topk:0.1,adam=0")
    fb, codec, local = state.feedback, state.codec, state.local_adam
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        y = local.direction("k", torch.randn(1000, generator=g))
        old = fb.residual.get("k", torch.zeros(1000))
        x = fb.corrected("k", y)
        assert torch.equal(x, y + old)
        sent = codec.decode(codec.encode(x, step), 1000)
        residual = fb.update("k", x, sent)
        assert torch.equal(sent + residual, x)
        assert int((sent != 0).sum()) == 100


@pytest.mark.parametrize("spec, message", [
    ("int8:adam=5", "applies to topk and sign"),
    ("sign:adam=-1", "0 or more"),
    ("sign:adam=5,momentum=0.9", "leave out momentum"),
    ("sign:adam=5,warm=bf16", "warm='bf16'"),
    ("topk:0.01,clip=-1", "positive gradient norm"),
    ("sign:adam=2,ef=0", "applies to topk and sign"),
    ("topk:0.01,adam=5,select=largest", "accepted: agree, gain, x"),
    ("topk:0.01,select=x", "add adam=W"),
    ("sign:adam=5,select=agree", "sign sends every element"),
    ("sign:adam=5,var=global", "accepted: batch, rank"),
    ("topk:0.01,var=rank", "add adam=W"),
    ("int8,var=batch", "add adam=W"),
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
                      CompressedAdamStep)


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
        opt = distribute(model, kind, "adamw", engine="memfit", lr=1e-2, clip=1.0)
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
        phases.append(state.update_phase if state is not None else None)
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
