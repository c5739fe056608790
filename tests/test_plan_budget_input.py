"""Budgets are read by one rule (core/units.py) and refused before any trace when they cannot work."""
import time

import pytest
import torch

import memfit
from memfit.cli import main
from memfit.core.errors import ConfigError
from memfit.plan.costs import PlanError

SPEC = "gpt:layers=4,hidden=192,heads=6,vocab=256,seq=256"


@pytest.mark.parametrize("budget", [8, "8", 8000.0, "1000"])
def test_a_plain_number_under_a_mib_is_a_forgotten_unit(budget):
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="give a unit"):
        memfit.fit(SPEC, budget=budget)
    assert time.perf_counter() - t0 < 2  # refused before any trace (a trace of this model takes seconds)


def test_a_budget_below_the_weights_is_refused_before_tracing(monkeypatch):
    from memfit.plan import search

    monkeypatch.setattr(search, "search", lambda *a, **k: pytest.fail("the search ran"))
    with pytest.raises(PlanError, match=r"weights alone need 7\.16 MiB \(1,878,144 parameters\)"):
        memfit.fit(SPEC, budget="2MiB")
    model = torch.nn.Sequential(torch.nn.Linear(512, 512))
    with pytest.raises(PlanError, match="weights alone"):
        memfit.fit(model, torch.zeros(2, 512), budget="512KiB", loss_fn=lambda out, ex: out.sum())


class Searched(Exception):
    pass


def test_bf16_master_allowed_lowers_the_weights_bound(monkeypatch):
    from memfit.plan import search

    def stub(*a, **k):
        raise Searched
    monkeypatch.setattr(search, "search", stub)
    # 1,878,144 parameters: 7.16 MiB in fp32, 3.58 MiB as bf16 weights
    with pytest.raises(PlanError, match="weights alone"):
        memfit.fit(SPEC, budget="5MiB")
    with pytest.raises(Searched):  # past the check, into the search
        memfit.fit(SPEC, budget="5MiB", allow="recompute,precision")


def test_cli_bare_unit_exits_2_with_one_line(capsys):
    assert main(["plan", "gpt2", "--budget", "80G"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "80GiB" in err and "80GB" in err
