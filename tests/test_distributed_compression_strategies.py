"""Compression inside memfit's own strategies on 2 gloo ranks: register_compression on what
distribute() returns for ddp, zero1 and zero2 (memfit sums gradients over ranks). One spawn runs
every scenario; the tests assert on what each rank returned."""
from __future__ import annotations

import pytest
import torch

from memfit.core.errors import ConfigError

pytestmark = pytest.mark.multiproc
TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16"
STEPS, LR = 3, 0.5
LOSSY = ["topk:0.01", "int8", "sign", "bf16", "fp16", "powersgd:2,batched"]
RUNS = ([("ddp", s) for s in [None, "none", "topk:1.0,values=fp32", "powersgd:2", *LOSSY]]
        + [("zero2", s) for s in [None, "none", "topk:1.0,values=fp32", *LOSSY]]
        + [("zero1", s) for s in [None, "none", "topk:0.01", "int8"]])
ADAM_RUNS = [None, "sign:chunk=256", "topk:0.05"]
"""DDP with AdamW, the default job's optimizer."""


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _train(rank: int, strategy: str, spec: str | None, optimizer: str = "sgd", accum: int = 1) -> dict:
    """STEPS of plain SGD on the rank's own batches (accum micro-batches of 4/accum sequences each);
    the first step's update and the final weights."""
    from memfit.distributed import distribute, global_count
    from memfit.distributed.compression import register_compression
    from memfit.models.spec import parse_model

    torch.manual_seed(0)
    model = parse_model(TINY).build(seq=16)
    opt = distribute(model, strategy, optimizer, engine="memfit", lr=LR if optimizer == "sgd" else 1e-2)
    state = register_compression(opt, spec) if spec is not None else None
    start, first, losses = _params(model), None, []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 256, (4, 16), generator=g)
        y = torch.randint(0, 256, (4, 16), generator=g)
        total = global_count(y.numel())
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            with opt.micro_batch(i == accum - 1):
                _, loss, _ = opt.model(xm, ym)
            opt.backward(loss / total, final=i == accum - 1)
        opt.step()
        losses.append(float(loss.detach()) / y.numel())
        if first is None:
            first = _params(model) - start
    out = {"params": _params(model), "first_update": first, "losses": losses,
           "summary": state.summary() if state is not None else None}
    if hasattr(opt, "close"):
        opt.close()
    return out


def _refusals() -> dict:
    from memfit.distributed import distribute
    from memfit.distributed.compression import register_compression
    from memfit.models.spec import parse_model

    out = {}
    for strategy in ("zero3", "ps"):
        model = parse_model(TINY).build(seq=16)
        opt = distribute(model, strategy, "sgd", engine="memfit", lr=LR)
        try:
            register_compression(opt, "topk:0.01")
        except ConfigError as exc:
            out[strategy] = str(exc)
        if hasattr(opt, "close"):
            opt.close()
    return out


def _worker(rank: int, world: int) -> dict:
    results = {(strategy, spec): _train(rank, strategy, spec) for strategy, spec in RUNS}
    results.update({("adamw", spec): _train(rank, "ddp", spec, "adamw") for spec in ADAM_RUNS})
    results.update({("accum", spec): _train(rank, "zero2", spec, accum=2) for spec in (None, f"int8,start={STEPS}")})
    results["refusals"] = _refusals()
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from memfit.distributed.spawn import run_world

    return run_world(_worker, 2, timeout_s=300)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_compression_off_is_bitwise_the_uncompressed_strategy(ranks, strategy):
    """"none" goes through the compressed path (an fp32 sum); top-k of everything in fp32 sends every
    element: both give exactly the weights of the strategy without compression."""
    for r in ranks:
        plain = r[(strategy, None)]["params"]
        assert torch.equal(r[(strategy, "none")]["params"], plain)
        if (strategy, "topk:1.0,values=fp32") in r:
            assert torch.equal(r[(strategy, "topk:1.0,values=fp32")]["params"], plain)


@pytest.mark.parametrize("strategy, spec", [(s, c) for s, c in RUNS if c not in (None, "none")])
def test_replicas_stay_identical_and_training_goes_on(ranks, strategy, spec):
    a, b = ranks[0][(strategy, spec)], ranks[1][(strategy, spec)]
    assert torch.equal(a["params"], b["params"])
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (a, b))
    assert not torch.equal(a["params"], ranks[0][(strategy, None)]["params"]) or spec.startswith("topk:1.0")


# Seeded data: each cosine is fixed up to the gradient kernels' summation order (~1e-6 relative),
# which can only swap near-tied elements of a top-k; 0.05 below the measured 0.462 (top-k 1%,
# torch 2.13.0) covers that many times over.
@pytest.mark.parametrize("strategy, spec, min_cos", [
    ("ddp", "topk:0.01", 0.41), ("zero2", "topk:0.01", 0.41), ("zero1", "topk:0.01", 0.41),
    ("ddp", "int8", 0.999), ("zero2", "int8", 0.999), ("zero1", "int8", 0.999),
    ("ddp", "sign", 0.5), ("zero2", "sign", 0.5), ("ddp", "bf16", 0.9999), ("zero2", "bf16", 0.9999),
    ("ddp", "fp16", 0.9999), ("zero2", "fp16", 0.9999),
    # PowerSGD all-reduces uncompressed for its first 2 steps: the step-1 update is the exact sum
    ("ddp", "powersgd:2", 0.9999), ("ddp", "powersgd:2,batched", 0.9999), ("zero2", "powersgd:2,batched", 0.9999),
])
def test_first_update_approximates_the_summed_gradient(ranks, strategy, spec, min_cos):
    """Step 1 starts from the same weights: its plain-SGD update is -lr x the reduced gradient, so
    it approximates the uncompressed update in direction and (the sum, not the mean) in scale."""
    got, exact = ranks[0][(strategy, spec)]["first_update"], ranks[0][(strategy, None)]["first_update"]
    assert float(torch.nn.functional.cosine_similarity(got, exact, dim=0)) >= min_cos
    if spec in ("int8", "bf16", "fp16") or spec.startswith("powersgd"):  # the norm of the sum, not the mean
        assert float(got.norm() / exact.norm()) == pytest.approx(1.0, rel=0.02)


# Bytes follow from the shapes and the spec alone, so each ratio is the same on every run; PowerSGD
# rank 2 measured 1.425 over 3 steps (its first 2 are uncompressed all-reduces): +-3% leaves room
# for a header's size, not for another rank or warm-up.
@pytest.mark.parametrize("strategy, spec, at_least, at_most", [
    ("ddp", "none", 1.0, 1.0), ("ddp", "topk:0.01", 50, 100), ("ddp", "int8", 3.5, 4.0), ("ddp", "sign", 20, 32),
    ("ddp", "bf16", 2.0, 2.0), ("ddp", "powersgd:2", 1.38, 1.47),
    # ZeRO's uncompressed baseline is a reduce-scatter, half an all-reduce's bytes; the gathered
    # codecs send each shard's payload to its rank alone (all_to_all), half a gathered payload
    ("zero2", "none", 0.5, 0.5), ("zero2", "topk:0.01", 50, 100), ("zero2", "int8", 3.5, 4.0),
    ("zero2", "sign", 20, 32), ("zero2", "bf16", 1.0, 1.0), ("zero1", "topk:0.01", 50, 100),
])
def test_bytes_are_counted_where_the_collectives_run(ranks, strategy, spec, at_least, at_most):
    s = ranks[0][(strategy, spec)]["summary"]
    assert s["steps"] == STEPS and s["bytes_sent_per_step"] > 0
    assert at_least <= s["ratio"] <= at_most, s


def test_strategies_without_a_gradient_reduction_refuse(ranks):
    refused = ranks[0]["refusals"]
    assert "zero3" in refused["zero3"] and "use ddp, zero1 or zero2" in refused["zero3"]
    assert "DistributedDataParallel" in refused["ps"]



@pytest.mark.parametrize("spec", ADAM_RUNS[1:])
def test_compressed_adamw_keeps_replicas_identical(ranks, spec):
    a, b = ranks[0][("adamw", spec)], ranks[1][("adamw", spec)]
    assert torch.equal(a["params"], b["params"])
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (a, b))


def test_zero2_counts_optimizer_steps_not_micro_batches(ranks):
    """start=STEPS keeps every optimizer step uncompressed even though ZeRO-2 reduces each of the 2
    micro-batches: the weights are exactly those of the uncompressed run."""
    for r in ranks:
        assert torch.equal(r[("accum", f"int8,start={STEPS}")]["params"], r[("accum", None)]["params"])
        assert r[("accum", f"int8,start={STEPS}")]["summary"]["steps"] == STEPS
