"""The cluster planner on a Hugging Face config: it searches data-parallel, tensor and pipeline layouts for
a family that ships both plans (qwen3) and says what a family without them (gpt2) gets; on 2 gloo
processes each rank of the chosen layout, and of the best tensor and pipeline layouts, runs at its
predicted peak (slow, multiproc)."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch

import hf_family_configs as fam
from memfit.cli import main
from memfit.distributed.spawn import run_world

BATCH, SEQ = 4, 32  # global batch (sequences) and sequence length of every plan here
# The largest rank's tracked step peak against the plan's figures: the bound.
PER_RANK = 0.03


def _write(tmp_path, family: str) -> str:
    return fam.write_config(tmp_path, family)


def _problem(path: str, budget: str = "6MiB"):
    from memfit.plan.cluster_fit import problem_of

    return problem_of(path, budget, None, None, BATCH, SEQ, "32-true", "adamw", None, "cpu", None)


def test_a_hugging_face_config_gets_every_layout_its_family_runs(tmp_path, capsys):
    from memfit.plan.cluster_search import layouts

    kinds = {lay.strategy for lay in layouts(_problem(_write(tmp_path, "qwen3")), 2)}
    assert kinds == {"ddp", "zero1", "zero2", "zero3", "tensor", "pipeline"}
    gpt2 = _problem(_write(tmp_path, "gpt2"))
    assert {lay.strategy for lay in layouts(gpt2, 2)} == {"ddp", "zero1", "zero2", "zero3"}
    assert "no tensor layouts" in gpt2.cfg.why_not and "no pipeline layouts" in gpt2.cfg.why_not
    capsys.readouterr()
    assert main(["plan", _write(tmp_path, "qwen3"), "--budget", "6MiB", "--gpus", "2", "--device", "cpu",
                 "--batch", str(BATCH), "--seq", str(SEQ), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cluster = data["cluster"]
    assert cluster["gpus"] == 2 and cluster["model"].endswith("config.json") and cluster["peak"] <= 6 * 2**20
    from memfit.plan.fit import model_digest

    assert data["plan"]["model_digest"] == model_digest(cluster["model"])  # what memfit train --plan checks


def _tracked(rank: int, world: int, path: str, layouts: list[dict]) -> list[int]:
    """Each layout's tracked step peak on this rank (the third step: optimizer state exists)."""
    return [_one(rank, world, path, lay) for lay in layouts]


def _one(rank: int, world: int, path: str, lay: dict) -> int:
    from memfit.apply.checkpoint import checkpoint
    from memfit.core.tracker import track
    from memfit.distributed import distribute
    from memfit.models.spec import parse_model

    torch.manual_seed(0)
    model = parse_model(path).build(seq=SEQ)
    model.train()
    checkpoint(model, lay["checkpoint"])
    kw = {"microbatches": lay["accum"], "schedule": lay["schedule"]} if lay["strategy"] == "pipeline" else {}
    g = torch.Generator().manual_seed(1)
    with distribute(model, lay["strategy"], "adamw", lr=1e-3, **kw) as opt:
        for step in range(3):
            tracker = track(opt.tracked_module, opt, device="cpu") if step == 2 else None
            with tracker if tracker is not None else contextlib.nullcontext():
                _step(opt, lay, g, rank)
    return tracker.peak_bytes


def _step(opt, lay: dict, g, rank: int) -> None:
    draw = lambda rows: torch.randint(0, fam.VOCAB, (rows, SEQ), generator=g)  # noqa: E731
    if lay["strategy"] == "pipeline":  # one schedule run of `accum` micro-batches
        x = draw(lay["rows"] * lay["accum"])
        opt.accumulate_step([(x, x)])
    elif lay["strategy"] == "tensor":  # the TP group's rows, every rank the same
        opt.accumulate_step([(x, x) for x in (draw(lay["rows"]) for _ in range(lay["accum"]))])
    else:
        xs = [draw(lay["rows"] * 2)[rank * lay["rows"]:(rank + 1) * lay["rows"]] for _ in range(lay["accum"])]
        for i, x in enumerate(xs):
            with opt.micro_batch(i == len(xs) - 1), opt.autocast():
                loss = opt.model(input_ids=x, labels=x).loss
            opt.backward(loss / (2 * len(xs)), final=i == len(xs) - 1)
        opt.step()


def _spec(p, row) -> dict:
    from memfit.apply.policy import to_string
    from memfit.plan.cluster_fit import actions_of
    from memfit.plan.cluster_verify import traced_peak

    lay, actions = row.layout, actions_of(row.layout, p.cfg.layers)
    return {"strategy": lay.strategy, "rows": lay.rows, "accum": lay.accum, "schedule": lay.schedule,
            "checkpoint": to_string(actions), "composed": max(r["total"] for r in row.ranks),
            "traced": traced_peak(p.spec, lay, p.seq, actions)}


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_chosen_tensor_and_pipeline_layouts_run_at_their_predictions(tmp_path):
    """The plan's largest rank: its full trace (the figure a plan reports and is checked by) within 3% of
    the tracked peak, for the chosen layout and the fastest tensor and pipeline ones; the search's composed
    figure within 3% for the chosen one (ddp) and never below the tracked peak for the others (a bound for
    the search: under tensor it holds the head's and a block's gradients at backward's peak, where the
    trace holds none, +6% at this size)."""
    from memfit.plan.cluster_fit import plan_cluster
    from memfit.plan.cluster_search import candidates

    path = _write(tmp_path, "qwen3")
    p = _problem(path)
    rows = [r for r in candidates(p, 2) if r.feasible]
    chosen = plan_cluster(path, "6MiB", 2, batch=BATCH, seq=SEQ, device="cpu")
    first = next(r for r in rows if r.layout.__dict__ == {**chosen.layout, "counts": r.layout.counts})
    picks = [first] + [next(r for r in rows if r.layout.strategy == s) for s in ("tensor", "pipeline")]
    specs = [_spec(p, r) for r in picks]
    measured = run_world(_tracked, 2, (path, specs), timeout_s=600)
    for i, s in enumerate(specs):
        got = max(measured[rank][i] for rank in range(2))
        assert abs(got - s["traced"]) <= PER_RANK * got, (s, got)
        if i == 0:
            assert abs(got - s["composed"]) <= PER_RANK * got, (s, got)
        assert s["composed"] >= (1 - PER_RANK) * got, (s, got)
