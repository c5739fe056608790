"""A model too big for one process at the budget: the cluster plan trains on 2 and on 4 gloo
processes (`memfit train --plan FILE` starts them), and every rank's tracked step peak is within
the budget."""
from __future__ import annotations

import pytest

from cluster_plan_run import train_cluster_plan
from memfit.plan.cluster_fit import plan_cluster
from memfit.plan.cluster_search import candidates

TINY = "llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn=384,vocab=256"

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # ~2-4 min on 2 busy cores


@pytest.mark.parametrize("budget,gpus", [("8MiB", 2), ("6MiB", 4)])
def test_cluster_plan_trains_within_the_budget_on_every_rank(tmp_path, budget, gpus):
    cp = plan_cluster(TINY, budget, "auto", batch=4, seq=32, device="cpu")
    assert cp.gpus == gpus
    from memfit.plan.cluster_fit import problem_of

    p = problem_of(TINY, budget, None, None, 4, 32, "32-true", "adamw", None, "cpu", None)
    assert not any(r.feasible for r in candidates(p, 1))  # too big for one process at this budget
    stderr, step = train_cluster_plan(TINY, cp, tmp_path)
    assert f"the plan runs {gpus} processes" in stderr and "torchrun --nproc-per-node" in stderr
    assert step["world"] == gpus and step["strategy"] == cp.layout["strategy"]
