"""What `memfit train` runs for a Hugging Face model under pipeline (targets aligned with the inputs, the
later stage's receive buffers) is what its estimates count: the cluster plan's closed form for a 1f1b last
stage against the full trace of that stage, and a plan near its budget trained with `memfit train --plan`
(slow, multiproc: every rank within the budget, the largest at the plan's peak to the byte)."""
from __future__ import annotations

import json

import pytest

from hf_family_configs import write_config
from memfit.cli import main

SEQ = 32
ONE_F_ONE_B = dict(strategy="pipeline", pp=2, rows=1, accum=4, schedule="1f1b", counts=[(1, 0, 0), (1, 0, 0)])


def test_the_closed_form_counts_a_later_stages_receive_buffers(tmp_path):
    """The search's figure for the last stage of 4 micro-batches of 1 under 1f1b within 0.5% of its traced
    step (which memfit train's runs match to the byte: tests/test_hf_train_model_parallel.py). It read
    3.3% under when it held one receive buffer of the four torch keeps, and not the sent input gradient;
    what it still leaves out (the micro-batches' targets, the loss scalars) is 0.16%."""
    from memfit.measure.pipeline_trace import trace_stage
    from memfit.models.spec import parse_model
    from memfit.plan.cluster_memory import Layout, rank_peaks
    from memfit.plan.cluster_unit import unit_profile

    spec = parse_model(write_config(tmp_path, "llama"))
    unit = unit_profile(spec, SEQ, 1, "32-true", "adamw")
    closed = rank_peaks(Layout(**ONE_F_ONE_B), unit, layers=2)[1]["total"]
    traced = trace_stage(spec, 1, 2, 4, 1, SEQ, "1f1b", aligned_targets=True)["total"]  # as pipeline_ranks
    assert abs(closed - traced) <= 0.005 * traced, (closed, traced)


def _plan(config: str, budget: str, capsys) -> tuple[int, dict | None]:
    capsys.readouterr()
    code = main(["plan", config, "--budget", budget, "--gpus", "2", "--batch", "4", "--seq", str(SEQ), "--device",
                 "cpu", "--json"])
    return code, json.loads(capsys.readouterr().out) if code == 0 else None


def _main(rank: int, world: int, argv: list) -> int:
    return main(argv)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_plan_near_its_budget_trains_within_it(tmp_path, capsys):
    from memfit.distributed.spawn import run_world

    config = write_config(tmp_path, "llama")
    # 500 KiB: the 1f1b layout's last stage needs 513,504 B; the plan used to put it at 496,320 B (its trace
    # at 510,432 B, transformers' shifted loss), chose it, and the run went 1.5 KB over
    code, _ = _plan(config, "500KiB", capsys)
    assert code == 2
    code, data = _plan(config, "505KiB", capsys)
    assert code == 0
    cluster = data["cluster"]
    assert cluster["layout"]["strategy"] == "pipeline" and cluster["peak"] <= 505 * 1024
    (tmp_path / "plan.json").write_text(json.dumps(data))
    out = tmp_path / "run"
    argv = ["train", "--plan", str(tmp_path / "plan.json"), "--steps", "2", "--warmup", "1", "--eval-batches", "1",
            "--device", "cpu", "--quiet", "--out", str(out)]
    assert run_world(_main, 2, args=(argv,), timeout_s=300) == [0, 0]
    ranks = json.loads((out / "metrics.json").read_text())["memory"]["step_breakdown"]["ranks"]
    peaks = [r["peak_bytes"] for r in ranks]
    assert max(peaks) <= 505 * 1024, peaks
    assert max(peaks) == cluster["peak"] == cluster["traced_peak"], (peaks, cluster["peak"])
