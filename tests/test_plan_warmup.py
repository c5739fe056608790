"""The optimizer-state-only warm-up (plan/loop_step.warmup_state) changes nothing the planner reads.

Every trace runs two steps and measures the second; for a loop that drops its output the first step
leaves only the optimizer's state behind, which warmup_state makes without the forward and backward.
Here each planning run is made twice, with that warm-up and with a full first step, and everything it
traced must be equal to the byte: every traced step's peak (chain, end corrections, chunked head, disk
restore bytes, the final full-trace check), every chain profile, and so the plan, its predicted peak,
its full-trace peak and its cost. Exact equality because both are the same fake-tensor accounting.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_family_configs
import memfit.measure.anymodel as anymodel
import memfit.measure.blocks as blocks_mod

pytestmark = pytest.mark.slow  # each case plans twice: 15-25 CPU-s


def _planned(monkeypatch, quick: bool, make_model, example, budget: str, **kw):
    from memfit.plan.fit import fit

    monkeypatch.setattr(anymodel, "QUICK_WARMUP", quick)
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    import memfit.plan.disk_profile as disk_profile
    import memfit.plan.head as head

    for memo in (blocks_mod._CACHE, head._CHUNKABLE, head._SIZES, disk_profile._WALKS, disk_profile._CACHE):
        memo.clear()  # each run traces everything it reads, so the two runs trace the same steps
    peaks, profiles = [], []
    run_steps, profile_chain = anymodel.run_steps, blocks_mod.profile_chain

    def recording_run(*a, **k):
        r = run_steps(*a, **k)
        peaks.append((r.tracker.peak_bytes, dict(r.tracker.breakdown)))
        return r

    def recording_profile(*a, **k):
        p = profile_chain(*a, **k)
        profiles.append({f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in ("seconds", "plain")})
        return p

    monkeypatch.setattr(anymodel, "run_steps", recording_run)
    monkeypatch.setattr(blocks_mod, "profile_chain", recording_profile)
    plan = fit(make_model(), example, budget=budget, **kw, keep_output=False, allow="recompute,selective,offload-disk,"
               "chunked-head,accumulate")
    monkeypatch.undo()
    return plan, peaks, profiles


def _compare(monkeypatch, make_model, example, budget, **kw):
    quick = _planned(monkeypatch, True, make_model, example, budget, **kw)
    full = _planned(monkeypatch, False, make_model, example, budget, **kw)
    assert len(quick[1]) > 3 and quick[1] == full[1]  # each traced step's peak, in order
    assert quick[2] and quick[2] == full[2]
    qp, fp = quick[0], full[0]
    fields = lambda p: (p.actions, p.micro_batch, p.accumulation, p.head_chunks, p.predicted_peak,  # noqa: E731
                        p.predicted_time, p.measured_peak, [(c.actions, c.peak, c.time) for c in p.ranked])
    assert fields(qp) == fields(fp)
    assert qp.measured_peak is not None and qp.predicted_peak <= qp.budget


@pytest.mark.parametrize("family,budget", [("gpt2", "3MiB"), ("llama", "2MiB")])
def test_hf_models_plan_the_same(monkeypatch, family, budget):
    ids = torch.randint(0, hf_family_configs.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    _compare(monkeypatch, lambda: hf_family_configs.model(family), {"input_ids": ids, "labels": ids}, budget)


def test_memfit_gpt_plans_the_same(monkeypatch):
    spec = "gpt:layers=3,hidden=32,heads=4,vocab=128,seq=32"
    _compare(monkeypatch, lambda: spec, None, "1MiB", batch=4, seq=32)
