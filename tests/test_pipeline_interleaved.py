"""--strategy pipeline --schedule interleaved (torch's ScheduleInterleaved1F1B, V stages per rank):
refusals and torch's order (default tier); on 2 gloo processes the losses of one process for memfit's
GPT and a Hugging Face Llama, each rank's estimate against its tracked peak, and checkpoints (slow)."""
from __future__ import annotations

import json

import pytest
import torch

import hf_family_configs as fam
from memfit.cli import main
from memfit.core.errors import ConfigError
from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig
from reference_run import global_batches, single_losses, train_rank

CFG = dict(layers=4, hidden=32, heads=4, vocab=64, seq=16)  # 2 ranks x 2 virtual stages, a block each
GLOBAL_BATCH, STEPS = 4, 3
# fp32: the stages compute one process's sums per micro-batch and add them (reassociation, ~1e-7
# relative per op); seen within 7e-6 over 3 AdamW steps at lr 1e-2, as for GPipe and 1F1B
# (tests/test_distributed_pipeline.py), so their 1e-5; a wrong scale or a lost micro-batch is > 1e-3.
RTOL = 1e-5
# Each rank's estimate against its tracked peak: the bound (seen: 0.00% on every case below).
PER_RANK = 0.03


def interleaved_plan() -> dict:
    """A cluster plan of a 2-rank interleaved pipeline, 2 stages per rank (4 blocks: one per stage)."""
    from test_emit import plan_doc

    doc = plan_doc(strategy="pipeline", dp=1, pp=2, rows=1, accum=4, schedule="interleaved", actions="keep*4")
    doc["cluster"]["layout"]["virtual_stages"] = 2
    return doc


def test_refusals_torch_order_and_emitted_job():
    from memfit.distributed.interleaved import peak_held, rank_order
    from memfit.integrations.emit_plan import emit, plan_view
    from memfit.distributed.pipeline import check_pipeline

    with pytest.raises(ConfigError, match="do not split evenly into 2 ranks x 2 virtual stages"):
        check_pipeline(6, 2, 4, 4, "interleaved", 2)
    with pytest.raises(ConfigError, match="rounds"):  # torch: max(1, 5 // 2) = 2 rounds must divide 5
        check_pipeline(8, 2, 5, 5, "interleaved", 2)
    with pytest.raises(ConfigError, match="needs --schedule interleaved"):
        check_pipeline(8, 2, 4, 4, "1f1b", 2)
    check_pipeline(8, 4, 10, 10, "interleaved", 2)  # torch's own example: 10 micro-batches on 4 ranks
    # each (stage, micro-batch) of the rank runs forward once, then backward once, in torch's order
    order = rank_order(pp=2, virtual=2, microbatches=4, rank=0)
    assert sorted(order) == sorted((k, s, m) for k in "FB" for s in (0, 2) for m in range(4))
    assert all(order.index(("F", s, m)) < order.index(("B", s, m)) for _, s, m in order)
    # torch's warm-up, (V - 1) x M / rounds + 2 (pp - 1 - r) forwards, and one more before the first backward
    assert [peak_held(rank_order(2, 2, 4, r)) for r in (0, 1)] == [5, 3]
    # torchtitan cuts V x pp stages of layers_per_stage blocks, none taken off the first and last
    job = emit(plan_view(interleaved_plan()), "torchtitan").text
    assert 'pipeline_parallel_schedule = "Interleaved1F1B"' in job and "pipeline_parallel_layers_per_stage = 1" in job
    assert "pipeline_parallel_first_stage_less_layers = 0" in job and "pipeline_parallel_last_stage_less_layers = 0" in job
    uneven = interleaved_plan()
    uneven["cluster"]["layout"]["virtual_stages"] = 3
    with pytest.raises(ConfigError, match="4 blocks do not split evenly into 2 x 3"):
        plan_view(uneven)


@pytest.mark.slow
def test_cli_refuses_in_one_line(capsys):
    spec = "gpt:layers=6,hidden=32,heads=4,vocab=64,seq=16"
    for extra, message in ((["--schedule", "interleaved"], "6 blocks do not split evenly"),
                           (["--virtual-stages", "3"], "needs --schedule interleaved")):
        assert main(["estimate", spec, "--seq", "16", "--strategy", "pipeline", "--world", "2", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def _gpt_run(rank: int, world: int, cases: list[tuple]) -> dict:
    from memfit.apply.checkpoint import checkpoint
    from memfit.distributed import TRAFFIC, distribute

    out = {}
    for mbs, policy, precision in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        if policy:
            checkpoint(model, policy)
        losses = []
        with distribute(model, "pipeline", "adamw", lr=1e-2, clip=1.0, microbatches=mbs, schedule="interleaved",
                        virtual_stages=2, precision=precision) as opt:
            for micro in global_batches(CFG, GLOBAL_BATCH, STEPS, 1):
                TRAFFIC.reset()
                losses.append(opt.accumulate_step([(m[:, :-1].contiguous(), m[:, 1:].contiguous())
                                                   for m in micro])[0])
            out[mbs, policy, precision] = losses, TRAFFIC.as_dict()["sent"]["p2p_send"], len(opt.parts)
    return out


@pytest.mark.slow
@pytest.mark.multiproc
def test_gpt_matches_one_process():
    cases = [(2, None, "32-true"), (4, "full", "32-true")]
    ranks = run_world(_gpt_run, 2, args=(cases,), timeout_s=300)
    for case in cases:
        want = single_losses(CFG, global_batches(CFG, GLOBAL_BATCH, STEPS, 1), case[1], "adamw", case[2])
        for r in (0, 1):
            losses, sent, parts = ranks[r][case]
            assert losses == pytest.approx(want, rel=RTOL), (case, r)
            # stages 0, 2 on rank 0 and 1, 3 on rank 1: each rank sends the activations of its stages
            # but the last and the gradients of its stages but the first, 3 x (B x T x hidden x 4 bytes)
            assert parts == 2 and sent == 3 * GLOBAL_BATCH * CFG["seq"] * CFG["hidden"] * 4, (case, r, sent)


def _llama(tied: bool):
    import transformers

    torch.manual_seed(0)
    cfg = fam.config("llama")
    cfg.num_hidden_layers, cfg.tie_word_embeddings = 4, tied
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _hf_run(rank: int, world: int, policy: str, tied: bool) -> list[float]:
    from memfit.apply.checkpoint import checkpoint
    from memfit.distributed import distribute

    model = _llama(tied)
    checkpoint(model, policy)
    with distribute(model, "pipeline", "adamw", lr=1e-2, clip=1.0, microbatches=2, schedule="interleaved") as opt:
        return [opt.accumulate_step([(x, x)])[0] for x in fam.token_batches(STEPS, 4, 16)]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("policy,tied", [("full", True), ("none", False)])
def test_hf_llama_matches_one_process(policy, tied):
    """Each rank runs two stages of one model: a stage's forward runs only its own decoder layers."""
    from memfit.apply.checkpoint import checkpoint

    ranks = run_world(_hf_run, 2, args=(policy, tied), timeout_s=300)
    model = _llama(tied)
    checkpoint(model, policy)
    want = fam.one_process_losses(model, fam.token_batches(STEPS, 4, 16))
    for losses in ranks:
        assert losses == pytest.approx(want, rel=RTOL)


@pytest.mark.slow
@pytest.mark.multiproc
def test_each_rank_within_3_percent_of_its_estimate(tmp_path):
    import rank_grid as grid

    llama = _llama(True).config
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(llama.to_json_string())
    hf = str(tmp_path / "llama" / "config.json")
    cases = [grid.Case(grid.gpt(4), "pipeline", schedule="interleaved", microbatches=4),
             grid.Case(grid.gpt(8), "pipeline", "bf16-master", "full", "interleaved", 4, virtual_stages=4),
             grid.Case(hf, "pipeline", schedule="interleaved", microbatches=4),
             grid.Case(hf, "pipeline", checkpoint="full", schedule="interleaved", microbatches=2)]
    measured = run_world(grid.tracked, 2, (cases,), timeout_s=600)
    bad = [(r["case"], r["error"]) for r in grid.errors(cases, 2, measured) if max(abs(e) for e in r["error"]) > PER_RANK]
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_resumes_an_interleaved_run_exactly(tmp_path):
    """`memfit train --schedule interleaved` saves and resumes: the resumed losses are the uninterrupted
    run's, bitwise (the same arithmetic in the same order)."""
    cfg = dict(model="gpt:layers=4,hidden=32,heads=2,vocab=256,seq=32", seq=32, batch=2, steps=4, warmup=1,
               eval_batches=2, save_every=2, strategy="pipeline", schedule="interleaved", microbatches=2)
    whole = run_world(train_rank, 2, args=({**cfg, "out": str(tmp_path / "whole")}, None, None), timeout_s=300)
    part = tmp_path / "part"
    run_world(train_rank, 2, args=({**cfg, "out": str(part)}, 2, None), timeout_s=300)
    assert json.loads((part / "metrics.json").read_text())["steps"]["step"][-1] == 2
    resumed = run_world(train_rank, 2, args=(cfg, None, str(part)), timeout_s=300)
    assert len(resumed[0]) == 4 and resumed[0] == whole[0]


def _dp_pp(rank: int, world: int) -> list[float]:
    from memfit.distributed import distribute

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    with distribute(model, "pipeline", "adamw", lr=1e-2, clip=1.0, microbatches=2, schedule="interleaved", dp=2) as opt:
        rows = opt.data_rows(2 * GLOBAL_BATCH)
        return [opt.accumulate_step([(m[rows, :-1].contiguous(), m[rows, 1:].contiguous()) for m in micro])[0]
                for micro in global_batches(CFG, 2 * GLOBAL_BATCH, STEPS, 1)]


@pytest.mark.slow
@pytest.mark.multiproc
def test_dp_x_interleaved_pp_on_four_ranks():
    """2 replicas of a 2-rank interleaved pipeline (4 stages each): one process's losses (seen 3e-6)."""
    want = single_losses(CFG, global_batches(CFG, 2 * GLOBAL_BATCH, STEPS, 1))
    for losses in run_world(_dp_pp, 4, timeout_s=300):
        assert losses == pytest.approx(want, rel=RTOL)


def _save_or_load(rank: int, world: int, options: dict, path: str, load: bool) -> list[float]:
    """Steps 1-2 saved by one layout, or steps 3-4 continued by another from that checkpoint."""
    from memfit.distributed import distribute

    torch.manual_seed(123 if load else 0)  # a loaded run must not depend on its own initial weights
    batches = global_batches(CFG, GLOBAL_BATCH, 4, 1)
    with distribute(GPT(GPTConfig(**CFG)), "pipeline", "adamw", lr=1e-2, clip=1.0, **options) as opt:
        if load:
            opt.load_sharded(path)
        losses = [opt.accumulate_step([(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in micro])[0]
                  for micro in (batches[2:] if load else batches[:2])]
        if not load:
            opt.save_sharded(path)
    return losses


@pytest.mark.slow
@pytest.mark.multiproc
def test_interleaved_checkpoint_loads_into_1f1b(tmp_path):
    """An interleaved run's checkpoint (stages 0, 2 | 1, 3) read by a 1F1B layout (blocks 0-1 | 2-3):
    the continued losses are one uninterrupted process's (rel 5e-5 over 4 steps, as in
    tests/test_distributed_model_parallel_checkpoint.py)."""
    want = single_losses(CFG, global_batches(CFG, GLOBAL_BATCH, 4, 1))
    path = str(tmp_path / "ckpt")
    first = run_world(_save_or_load, 2, args=(dict(microbatches=2, schedule="interleaved"), path, False), timeout_s=300)
    after = run_world(_save_or_load, 2, args=(dict(microbatches=2, schedule="1f1b"), path, True), timeout_s=300)
    assert first[0] == pytest.approx(want[:2], rel=5e-5)
    for losses in after:
        assert losses == pytest.approx(want[2:], rel=5e-5)
