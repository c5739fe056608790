"""The tighter disk bound (memfit.plan.disk_plan.cannot_beat with `must` and restore bytes, search's
BOUND_ROW_DISK): the solver's restricted optimum against brute force, and fit_trainer's plan the same
with the disk kinds traced and without."""
from __future__ import annotations

import tempfile

import pytest
from hypothesis import given, settings, strategies as st

from memfit.apply.policy import BlockAction
from memfit.plan.solve import solve
from test_plan_solve import COST, KEEP, REC, SEL, all_lists, synthetic


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), g=st.integers(0, 50), a_k=st.integers(50, 200), a_s=st.integers(20, 120),
       x=st.integers(5, 30), r=st.integers(-100, 100), peaks=st.lists(st.integers(0, 300), min_size=20, max_size=20),
       slack=st.integers(0, 2000), must=st.sampled_from([(KEEP,), (REC,), (KEEP, REC)]))
def test_must_is_the_fastest_list_with_a_lone_block_of_those_actions(n, g, a_k, a_s, x, r, peaks, slack, must):
    prof = synthetic(n, g, a_k, a_s, x, r, peaks)
    cost = lambda b, k: COST[b.mode]  # noqa: E731
    scored = [(prof.peak_of(acts), sum(COST[a.mode] for a in acts), acts) for acts in map(list, all_lists(n))]
    budget = min(p for p, _, _ in scored) + slack
    ok = [t for p, t, acts in scored if p <= budget and any(a in must for a in acts)]  # (a segment's blocks differ)
    got = solve(prof, budget, (KEEP, SEL, REC), cost, max_segment=n, must=must)
    if not ok:
        assert got is None
        return
    assert got is not None and got.peak <= budget and any(a in must for a in got.actions)
    assert abs(got.time - min(ok)) < 1e-9
    free = solve(prof, budget, (KEEP, SEL, REC), cost, max_segment=n)
    assert got.time >= free.time - 1e-12  # never below the unrestricted optimum (the bound's premise)


def _trainer(out: str):
    import torch
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=4096, n_positions=128, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    ids = torch.randint(0, 4096, (8, 128))
    args = transformers.TrainingArguments(output_dir=out, max_steps=1, use_cpu=True, report_to=[],
                                          per_device_train_batch_size=8, disable_tqdm=True, save_strategy="no")
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args,
                                train_dataset=[{"input_ids": r, "labels": r} for r in ids])


def _plan(monkeypatch, on: bool):
    """(what the plan is, disk profiles traced, restore-byte traces) with the disk shortcuts on or off."""
    from memfit.integrations.hf import fit_trainer
    from memfit.plan import disk_plan, disk_profile, search

    for mod, flag in ((disk_plan, "BOUND_DISK"), (disk_plan, "RESTORE_BOUND"), (search, "BOUND_ROW_DISK"),
                      (search, "DEFER_PLAIN_DISK")):
        monkeypatch.setattr(mod, flag, on)
    monkeypatch.setattr(disk_profile, "_CACHE", {})
    traced, real = [], disk_profile.trace_disk
    monkeypatch.setattr(disk_profile, "trace_disk", lambda *a, **k: traced.append(1) or real(*a, **k))
    with tempfile.TemporaryDirectory() as out:
        p = fit_trainer(_trainer(out), "24MiB")
    ranked = [(c.micro_batch, c.head_chunks, c.actions, c.peak, c.time, c.feasible) for c in p.ranked]
    return ([str(a) for a in p.actions], p.predicted_peak, p.measured_peak, p.head_chunks, p.micro_batch,
            p.accumulation, ranked), len(traced)


@pytest.mark.slow  # (about 30 CPU-s: the plan twice, once with the disk profile traced)
def test_fit_trainer_plan_is_the_same_without_the_disk_traces(monkeypatch):
    # The bench's case (bench/planner_targets.py, "HF model via fit_trainer"): the no-disk plan costs time,
    # and only the restore bytes and the row before show that no disk plan can be faster.
    fast, traced_fast = _plan(monkeypatch, True)
    full, traced_full = _plan(monkeypatch, False)
    assert fast == full
    assert traced_full >= 1 and traced_fast == 0
    assert fast[2] <= 24 * 2**20 and "recompute" in fast[0]  # checked within the budget, and recompute costs time


@pytest.mark.slow  # (about 10 CPU-s: a disk profile)
def test_restore_bytes_are_the_disk_profiles():
    from memfit.measure.blocks import chain_profile, spec_source
    from memfit.models.spec import parse_model
    from memfit.plan.costs import _bases
    from memfit.plan.disk_profile import disk_bases, restore_bytes, trace_disk

    allow = ("recompute", "selective", "offload-disk")
    src = spec_source(parse_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=512,seq=64"), 2, 64)
    prof = chain_profile(src, "bf16-mixed", "adamw", bases=_bases(allow))
    disk = disk_bases(allow)
    dp = trace_disk(src, prof, disk, "bf16-mixed", "adamw")
    # R: a lone block read lazily less the same block read ahead, whichever walk measured the latter
    assert restore_bytes(src, prof, disk, "bf16-mixed", "adamw") == dp.restore == {
        str(d): dp.bwd[(str(d), False, None)].net_bytes - dp.bwd[(str(d), True, None)].net_bytes for d in disk}
    assert all(v > 0 for v in dp.restore.values())
