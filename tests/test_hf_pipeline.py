"""--strategy pipeline for Hugging Face causal LMs cut at decoder layers: each stage's estimated weights
and the refusal of a family memfit does not cut (default tier); on 2 gloo processes the losses of one
process and each rank's tracked peak against its estimate (slow, multiproc)."""
from __future__ import annotations

import pytest
import torch

import hf_family_configs as fam
from memfit.cli import main
from memfit.distributed.spawn import run_world

STEPS, ROWS, SEQ = 3, 4, 16
# fp32, the same arithmetic split over two processes (the hidden states sent between them unchanged):
# losses agree to ~1e-6 relative over 3 AdamW steps (seen), so 1e-5.
RTOL = 1e-5
# Each rank's estimate against its tracked peak: the bound. Seen: 0.00% to +0.43% on qwen3 and
# llama (tied, untied), 1F1B and GPipe, with and without full checkpointing.
PER_RANK = 0.03


def _write(tmp_path, family: str, **extra) -> str:
    d = tmp_path / family
    d.mkdir(exist_ok=True)
    cfg = fam.config(family)
    for k, v in extra.items():
        setattr(cfg, k, v)
    (d / "config.json").write_text(cfg.to_json_string())
    return str(d / "config.json")


def test_each_stage_holds_its_layers_and_ends(tmp_path):
    """Stage 0: the embeddings and layer 0; stage 1: layer 1, the final norm and the head (untied),
    to the byte of the weights (one-process trace of each stage)."""
    from memfit.measure.parallel_estimate import pipeline_ranks
    from memfit.models.spec import parse_model

    spec = parse_model(_write(tmp_path, "qwen3"))
    full = spec.on_meta()
    size = lambda prefix: sum(p.numel() for n, p in full.named_parameters() if n.startswith(prefix))  # noqa: E731
    buffers = sum(b.numel() for b in full.buffers())  # the rotary table: on every stage
    rows = pipeline_ranks(spec, batch=1, seq=SEQ, world=2, microbatches=2, schedule="1f1b")
    assert [r["blocks"] for r in rows] == [1, 1]
    assert rows[0]["params"] == 4 * (size("model.embed_tokens") + size("model.layers.0.") + buffers)
    assert rows[1]["params"] == 4 * (size("model.layers.1.") + size("model.norm") + size("lm_head") + buffers)


def test_a_family_memfit_does_not_cut_is_refused_in_one_line(tmp_path, capsys):
    assert main(["estimate", _write(tmp_path, "gemma"), "--strategy", "pipeline", "--world", "2", "--seq", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "decoder layers" in err and "ddp" in err


def _batches():
    return fam.token_batches(STEPS, ROWS, SEQ)


def _single(family: str, policy: str, tied: bool) -> list[float]:
    from memfit.apply.checkpoint import checkpoint

    model = _model(family, tied)
    checkpoint(model, policy)
    return fam.one_process_losses(model, _batches())


def _model(family: str, tied: bool):
    import transformers

    torch.manual_seed(0)
    cfg = fam.config(family)
    cfg.tie_word_embeddings = tied
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _pipeline(rank: int, world: int, family: str, schedule: str, policy: str, tied: bool) -> list[float]:
    from memfit.apply.checkpoint import checkpoint
    from memfit.distributed import distribute

    model = _model(family, tied)
    checkpoint(model, policy)
    with distribute(model, "pipeline", "adamw", lr=1e-2, clip=1.0, microbatches=2, schedule=schedule) as opt:
        return [opt.accumulate_step([(x, x)])[0] for x in _batches()]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("family,schedule,policy,tied", [("qwen3", "1f1b", "none", False),
                                                         ("llama", "gpipe", "full", True),
                                                         ("qwen2", "1f1b", "none", False),
                                                         ("mistral", "gpipe", "none", False)])
def test_pipeline_matches_one_process(family, schedule, policy, tied):
    # tied: the embedding's and the head's gradients summed between the first and the last stage
    ranks = run_world(_pipeline, 2, args=(family, schedule, policy, tied), timeout_s=300)
    want = _single(family, policy, tied)
    for losses in ranks:
        assert losses == pytest.approx(want, rel=RTOL)


@pytest.mark.slow
@pytest.mark.multiproc
def test_each_rank_within_3_percent_of_its_estimate(tmp_path):
    import rank_grid as grid

    qwen3, llama = _write(tmp_path, "qwen3"), _write(tmp_path, "llama", tie_word_embeddings=True)
    cases = [grid.Case(qwen3, "pipeline", schedule="1f1b"), grid.Case(qwen3, "pipeline", checkpoint="full", schedule="1f1b"),
             grid.Case(llama, "pipeline", schedule="gpipe"), grid.Case(llama, "pipeline", checkpoint="full", schedule="gpipe")]
    measured = run_world(grid.tracked, 2, (cases,), timeout_s=600)
    bad = [(r["case"], r["error"]) for r in grid.errors(cases, 2, measured)
           if max(abs(e) for e in r["error"]) > PER_RANK]
    assert not bad, bad
