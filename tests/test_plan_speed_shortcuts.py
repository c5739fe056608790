"""The planner's tracing shortcuts change nothing it reads (issue 33: fit_trainer in seconds).

Each shortcut has a switch that turns it off; here a plan is made with the shortcut on and off, and
everything traced must be equal to the byte: every traced step's stretches (chain profiles, end
corrections, chunked-head parts, disk walks) and peak with its breakdown, every chain profile, and the
plan, its ranked candidates and its full-trace peak. Exact equality: both runs are the same fake-tensor
accounting of the same steps.

- UNTRACKED_WARMUP (MEMFIT_TRACKED_WARMUP=1 turns it off): the state-only warm-up runs before the tracker
  is entered;
- STATE_ONLY_ADAM (MEMFIT_WARMUP_UPDATE=1): torch Adam/AdamW warm up with their state made, not updated;
- UNTRACKED_DETACH (MEMFIT_TRACKED_DETACH=1): a saved tensor's detach skips the tracker's dispatch;
- WALKS_NO_UPDATE (MEMFIT_WALK_UPDATE=1): the disk walks' steps leave out the optimizer update (only their
  blocks' stretches are read, so only those are compared for them).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_family_configs
import memfit.core.tracker as tracker_mod
import memfit.measure.anymodel as anymodel
import memfit.measure.blocks as blocks_mod
import memfit.measure.compose as compose
import memfit.plan.disk_profile as disk_profile
import memfit.plan.loop_step as loop_step

SHORTCUTS = {"untracked-warmup": (anymodel, "UNTRACKED_WARMUP"), "state-only-adam": (loop_step, "STATE_ONLY_ADAM"),
             "untracked-detach": (tracker_mod, "UNTRACKED_DETACH"), "walks-no-update": (disk_profile, "WALKS_NO_UPDATE")}


def _read(t, update: bool):
    """What the planner reads of a trace: all of it, or of a walk traced without its update its blocks' stretches."""
    return t if update else (t.fwd, t.bwd)


def _planned(monkeypatch, shortcut: str, on: bool, make_plan):
    import memfit.plan.head as head

    monkeypatch.setattr(*SHORTCUTS[shortcut], on)
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    for memo in (blocks_mod._CACHE, head._CHUNKABLE, head._SIZES, disk_profile._WALKS, disk_profile._CACHE):
        memo.clear()  # each run traces everything it reads, so the two runs trace the same steps
    peaks, traces, profiles, walking = [], [], [], []
    run_steps, trace, profile_chain = anymodel.run_steps, compose._trace, blocks_mod.profile_chain
    walk_trace = disk_profile._walk_trace

    def recording_run(*a, **k):
        r = run_steps(*a, **k)  # (a walk's peak is not read: without its update it is another)
        peaks.append("walk" if walking else (r.tracker.peak_bytes, dict(r.tracker.breakdown)))
        return r

    def recording_walk(*a, **k):
        walking.append(1)
        try:
            return walk_trace(*a, **k)
        finally:
            walking.pop()

    def recording_trace(*a, **k):
        got = trace(*a, **k)
        traces.append(_read(got, k.get("update", True)))
        return got

    def recording_profile(*a, **k):
        p = profile_chain(*a, **k)
        profiles.append({f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in ("seconds", "plain")})
        return p

    monkeypatch.setattr(anymodel, "run_steps", recording_run)
    monkeypatch.setattr(compose, "_trace", recording_trace)
    monkeypatch.setattr(blocks_mod, "profile_chain", recording_profile)
    monkeypatch.setattr(disk_profile, "_walk_trace", recording_walk)
    plan = make_plan()
    monkeypatch.undo()
    return plan, peaks, traces, profiles


def _compare(monkeypatch, shortcut: str, make_model, example, budget, **kw):
    from memfit.plan.fit import fit

    _compare_plans(monkeypatch, shortcut, lambda: fit(make_model(), example, budget=budget, **kw, keep_output=False,
                                                      allow="recompute,selective,offload-disk,chunked-head,accumulate"))


def _compare_plans(monkeypatch, shortcut: str, make_plan):
    fast = _planned(monkeypatch, shortcut, True, make_plan)
    full = _planned(monkeypatch, shortcut, False, make_plan)
    assert len(fast[1]) > 3 and fast[1] == full[1]  # each traced step's peak and breakdown, in order
    if shortcut == "walks-no-update":  # the walks without their update: what is read of them
        full = (full[0], full[1], [_read(t, isinstance(f, type(t))) for f, t in zip(fast[2], full[2])], full[3])
    assert fast[2] and fast[2] == full[2]  # each traced step's stretches
    assert fast[3] and fast[3] == full[3]  # each chain profile
    fields = lambda p: (p.actions, p.micro_batch, p.accumulation, p.head_chunks, p.predicted_peak,  # noqa: E731
                        p.predicted_time, p.measured_peak, [(c.actions, c.peak, c.time) for c in p.ranked])
    assert fields(fast[0]) == fields(full[0])
    assert fast[0].measured_peak is not None and fast[0].predicted_peak <= fast[0].budget


@pytest.mark.slow  # each case plans twice: 10-20 CPU-s
@pytest.mark.parametrize("shortcut", sorted(SHORTCUTS))
@pytest.mark.parametrize("family,budget", [("gpt2", "3MiB"), ("llama", "2MiB")])
def test_hf_models_plan_the_same(monkeypatch, shortcut, family, budget):
    ids = torch.randint(0, hf_family_configs.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    _compare(monkeypatch, shortcut, lambda: hf_family_configs.model(family), {"input_ids": ids, "labels": ids}, budget)


@pytest.mark.slow
@pytest.mark.parametrize("shortcut", sorted(SHORTCUTS))
def test_memfit_gpt_plans_the_same(monkeypatch, shortcut):
    spec = "gpt:layers=3,hidden=32,heads=4,vocab=128,seq=32"
    _compare(monkeypatch, shortcut, lambda: spec, None, "1MiB", batch=4, seq=32)


@pytest.mark.slow  # (about 20 CPU-s a case)
@pytest.mark.parametrize("shortcut", sorted(SHORTCUTS))
def test_fit_trainer_bench_case_plans_the_same(monkeypatch, shortcut, tmp_path):
    """bench/planner_targets.py's "HF model via fit_trainer" (its disk kinds ruled out by their walks)."""
    from memfit.integrations.hf import fit_trainer
    from test_plan_disk_restore_bound import _trainer

    _compare_plans(monkeypatch, shortcut, lambda: fit_trainer(_trainer(str(tmp_path)), "24MiB"))


def test_one_trace_is_the_same_with_every_shortcut_off(monkeypatch):
    """Default tier (about 2 CPU-s): one chain-profile trace of a tiny HF GPT-2 (kept ends, a selective and
    a checkpointed segment in between), all shortcuts on against all off."""
    from memfit.apply.policy import BlockAction
    from memfit.measure.blocks import module_source
    from memfit.plan.loop_step import loop_step as make_step

    ids = torch.randint(0, hf_family_configs.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    example = {"input_ids": ids, "labels": ids}
    src = module_source(hf_family_configs.model("gpt2"), example, None)
    problem = type("P", (), {"spec": None, "example": example, "example_for": lambda self, m: example,
                             "loss_fn": None})()
    step = make_step(problem, 2, 1, keep_output=False)
    seg = BlockAction("recompute", segment=0)
    pattern = [BlockAction("keep"), BlockAction("selective"), seg, seg, BlockAction("keep")]
    got = []
    for on in (True, False):
        for mod, name in SHORTCUTS.values():
            monkeypatch.setattr(mod, name, on)
        got.append(compose._trace(src.build_k, len(pattern), step, pattern, "32-true", "adamw", "cpu"))
    assert got[0] == got[1] and got[0].opt.peak_bytes > 0


def test_a_walk_without_its_update_has_the_same_block_stretches(monkeypatch):
    """Default tier (about 1 CPU-s): a disk walk (memfit.plan.disk_profile) traced with and without the
    optimizer update: the same forward and backward stretch for every block, and no optimizer stretch."""
    from memfit.measure.blocks import spec_source
    from memfit.models.spec import parse_model
    from memfit.plan.disk_profile import KEEP, _walk_trace
    from memfit.apply.policy import BlockAction

    src = spec_source(parse_model("gpt:layers=2,hidden=32,heads=4,vocab=128,seq=32"), 2, 32)
    walk = [BlockAction("keep", offload="disk")] * 2
    got = []
    for on in (True, False):
        monkeypatch.setattr(disk_profile, "WALKS_NO_UPDATE", on)
        monkeypatch.setattr(disk_profile, "_WALKS", {})
        got.append(_walk_trace(src, walk, ("32-true", "adamw", "cpu")))
    assert _read(got[0], False) == _read(got[1], False) and len(got[0].bwd) == 2 + len(walk) and KEEP.mode == "keep"
    assert got[0].opt.peak_bytes == 0 and got[1].opt.peak_bytes > 0
