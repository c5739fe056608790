"""FSDP2 x tensor parallel x pipeline on one ("pp", "dp", "tp") DeviceMesh (memfit.distributed.mesh3d) and its
per-rank estimate (`memfit estimate --strategy pipeline --engine fsdp2 --pp P --tp T`,
memfit.measure.mesh3d_estimate). Default tier: the estimate's shards and the refusals; slow, multiproc:
4 gloo processes (pp2 x dp2, pp2 x tp2) against one process and against the estimate."""
from __future__ import annotations

import json

import pytest

import hf_family_configs as fam
import mesh3d_worker as w
from memfit.cli import main
from memfit.distributed.spawn import run_world

# fp32: the replicas' gradients summed by FSDP2's reduce-scatter, the row-parallel projections' partial sums
# added over tp, the clipping norm summed over the world: reassociation only (seen: at most 1.2e-6 relative
# after three clipped AdamW steps), so 1e-5.
RTOL = 1e-5
# bf16-mixed (FSDP2's MixedPrecisionPolicy: bf16 compute over fp32 shards, fp32 reduction) against the fp32
# one-process run: bf16 rounding of every matmul (seen: 6e-5 relative over three steps), so 2e-3, the bound
# tests/test_distributed_pipeline.py holds memfit's own bf16 pipeline to.
RTOL_BF16 = 2e-3
# Each rank's estimate against torch's MemTracker peak: the bound. Seen: -0.60% to +0.69%
# (bench/results/mesh3d.json).
PER_RANK = 0.03
LAYOUTS = (w.Layout("llama", pp=2, tp=1), w.Layout("qwen3", pp=2, tp=2),
           w.Layout("llama", pp=2, tp=1, schedule="gpipe", checkpoint=True, tied=True),
           w.Layout("gpt", pp=2, tp=1, schedule="gpipe", checkpoint=True),
           w.Layout("llama", pp=2, tp=1, precision="bf16-mixed"))
"""pp2 x dp2 (FSDP2 x PP) with 1F1B; pp2 x tp2 with Qwen3's per-head q/k norms summed over tp; pp2 x dp2 with
GPipe under Hugging Face's own checkpointing, the embedding tied to the head (its gradient summed between the
first and the last stage of each dp place); memfit's GPT (tied) on pp2 x dp2 under memfit's policy "full"
(re-applied to each stage's blocks); pp2 x dp2 under bf16-mixed (its loss only: the estimate is fp32's)."""


def _args(path: str, layout: w.Layout, world: int) -> list[str]:
    seq = w.SEQ - (layout.family == "gpt")  # memfit's GPT: inputs and next-token targets of SEQ tokens
    return ["estimate", path, "--strategy", "pipeline", "--engine", "fsdp2", "--pp", str(layout.pp), "--tp",
            str(layout.tp), "--world", str(world), "--batch", str(w.ROWS // world), "--seq", str(seq),
            "--microbatches", str(w.MICRO), "--schedule", layout.schedule, "--json",
            *(["--checkpoint", "full"] if layout.checkpoint else [])]


def test_each_rank_holds_its_stage_whole_beside_its_shards(tmp_path, capsys):
    """pp2 x dp2: stage 0's ranks are 0 and 1, stage 1's 2 and 3; each holds its stage's weights whole
    (gathered for the whole schedule) beside a half shard of them and AdamW's two moments of that half and
    one step counter per tensor."""
    from memfit.distributed.hf_stages import cut_hf_to_stage
    from memfit.measure.fake_mode import fake_mode

    path = fam.write_config(tmp_path, "llama")
    assert main(_args(path, w.Layout("llama", 2, 1), 4)) == 0
    rows = sorted(json.loads(capsys.readouterr().out)["ranks"], key=lambda r: r["stage"])
    assert [r["rank_ids"] for r in rows] == [[0, 1], [2, 3]] and {r["dp"] for r in rows} == {2}
    for stage, row in enumerate(rows):
        with fake_mode():
            shapes = [p.shape for p in cut_hf_to_stage(fam.model("llama"), stage, 2).parameters()]
        whole = sum(4 * s.numel() for s in shapes)
        assert row["gathered"] == whole
        assert row["optimizer"] == whole + 4 * len(shapes)  # every first dimension here is even
        assert row["total"] > whole * 3 // 2 + row["optimizer"]


def test_a_layout_that_does_not_divide_the_world_is_refused_in_one_line(tmp_path, capsys):
    path = fam.write_config(tmp_path, "llama")
    assert main(_args(path, w.Layout("llama", 3, 1), 4)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "divides 4" in err
    assert main(["estimate", path, "--strategy", "zero3", "--pp", "2", "--world", "4"]) == 2
    assert "--strategy pipeline --engine fsdp2" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiproc
def test_3d_trains_as_one_process_within_3_percent_of_its_estimate(tmp_path, capsys):
    ranks = run_world(w.runs, 4, args=(list(LAYOUTS),), timeout_s=900)
    for lay in LAYOUTS:
        runs = [r[lay] for r in ranks]
        want = lay.one_process_losses()
        for r in runs:  # every rank reports the global mean loss
            assert r["losses"] == pytest.approx(want, rel=RTOL if lay.precision == "32-true" else RTOL_BF16), lay.name
        if lay.precision != "32-true":
            continue
        assert main(_args(lay.write(tmp_path), lay, 4)) == 0
        est = {i: row["total"] for row in json.loads(capsys.readouterr().out)["ranks"] for i in row["rank_ids"]}
        for i, r in enumerate(runs):
            assert abs(est[i] - r["total"]) <= PER_RANK * r["total"], (lay.name, i, est[i], r["total"])
