"""Offload and compression in the composed estimate and the planner: exact against full traces; a plan
that offloads runs under its budget for real, with the plain run's gradients (offload is lossless)."""
from __future__ import annotations

import copy

import pytest
import torch

from memfit.apply.policy import BlockAction as A, resolve_policy
from memfit.measure.blocks import chain_profile, spec_source
from memfit.measure.trace import trace_step
from memfit.models.gpt import GPT, GPTConfig
from memfit.models.spec import parse_model
from memfit.plan.costs import HOOK_S, _bases, _cost
from memfit.plan.fit import fit
from planned_run import tracked_steps_match_plain

SPEC = "gpt:layers=6,hidden=64,heads=4,vocab=256,seq=128"
POLICIES = ["none+offload:cpu", "none+compress:int8", "full+offload:cpu",
            "keep+offload:cpu,keep,recompute+offload:cpu,keep+compress:int8,selective,keep+compress:fp8",
            "keep+compress:fp8,keep+offload:cpu*2,recompute+offload:cpu+seg=0,recompute+offload:cpu+seg=0,keep"]


@pytest.mark.slow
def test_composed_offload_and_compression_equal_the_full_trace():
    spec = parse_model(SPEC)
    src = spec_source(spec, batch=8, seq=128)  # activations, not the optimizer, set the peak
    bases = _bases(("recompute", "selective", "offload-cpu", "compress"))
    prof = chain_profile(src, "32-true", "adamw", bases=bases)
    keep = trace_step(spec, batch=8, seq=128, checkpoint="none").peak
    for policy in POLICIES:
        full = trace_step(spec, batch=8, seq=128, checkpoint=policy)
        got = prof.compose(resolve_policy(policy, 6))
        assert got.peak == full.peak, (policy, got.where)
        assert full.peak < keep, policy  # each policy saves memory, so its peak lies in the activations


def test_offload_and_compression_costs_come_from_traced_bytes():
    spec = parse_model("gpt:layers=3,hidden=32,heads=2,vocab=64,seq=64")
    prof = chain_profile(spec_source(spec, 2, 32), "32-true", "adamw",
                         bases=[A("keep"), A("keep", offload="cpu"), A("keep", compress="int8")], with_segments=False)
    moved = prof.fwd["keep"].net_bytes - prof.fwd["keep+offload:cpu"].net_bytes
    freed = prof.fwd["keep"].net_bytes - prof.fwd["keep+compress:int8"].net_bytes
    assert 0 < freed < moved
    cost = _cost(1.0, None, prof, {"cpu": 1e6, "int8": 1e5})
    assert cost(A("keep", offload="cpu"), 1) == pytest.approx(2 * moved / 1e6 + HOOK_S)
    assert cost(A("keep", compress="int8"), 1) == pytest.approx(freed / 1e5 + HOOK_S)
    assert cost(A("recompute"), 1) == 1.0 and cost(A("keep"), 1) == 0.0


def test_disk_and_compression_follow_allow():
    assert all(b.offload != "disk" for b in _bases(("offload-disk", "offload-cpu", "recompute")))
    assert not any(b.compress for b in _bases(("offload-cpu", "recompute", "selective")))
    assert {b.compress for b in _bases(("compress",))} == {None, "int8", "fp8"}
    assert A("recompute", offload="cpu") not in _bases(("offload-cpu",))


@pytest.mark.slow
def test_a_plan_that_offloads_fits_for_real_with_the_plain_gradients():
    torch.manual_seed(0)
    cfg = GPTConfig(layers=4, hidden=64, heads=4, vocab=256, seq=128)
    model = GPT(cfg)
    plain = copy.deepcopy(model)
    x = torch.randint(0, 256, (8, 128))
    keep = trace_step(lambda: GPT(cfg), 8, 128, checkpoint="none").peak
    off = trace_step(lambda: GPT(cfg), 8, 128, checkpoint="none+offload:cpu").peak
    budget = (keep + off) // 2
    plan = fit(model, (x, x), budget=budget, allow=("offload-cpu",))
    assert any(a.offload == "cpu" for a in plan.actions) and plan.measured_peak <= budget
    opt = plan.apply(model, lr=1e-3)
    assert tracked_steps_match_plain(model, plain, opt, x) <= budget < keep
