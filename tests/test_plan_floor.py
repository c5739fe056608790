"""The search's shortcuts leave the plan as it was: configurations whose floor (parameters, gradients
and optimizer state as the optimizer step begins) exceeds the budget are not traced, and with cpu
offload allowed the disk kinds are traced only when nothing fits without them."""
import pytest

import memfit
from memfit.apply.policy import BlockAction as A
from memfit.measure.blocks import chain_profile, spec_source
from memfit.models.spec import parse_model
from memfit.plan import disk_plan
from memfit.plan import search as search_mod
from memfit.plan.costs import _bases
from memfit.plan.head import head_profile

SPEC = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq=32"
ALLOW = "recompute,selective,offload-cpu,offload-disk,accumulate,chunked-head,optimizer-offload,precision"


@pytest.mark.slow  # the floor's other tests stay in the default tier
def test_the_floor_does_not_depend_on_actions_micro_batch_or_head_chunks():
    spec = parse_model(SPEC)
    lists = [[A("keep")] * 4, [A("recompute")] * 4,
             [A("keep"), A("recompute", segment=0), A("recompute", segment=0), A("recompute")]]
    floors = []
    for micro in (4, 1):
        keep = chain_profile(spec_source(spec, micro, 32), "bf16-master", "adamw", bases=[A("keep")],
                             with_segments=False)
        floors.append(keep.at_optimizer([A("keep")] * 4)[:3])
    floor = floors[0]
    assert floors[1] == floor and floor[1] > 0  # the gradients are all there as the step begins
    src = spec_source(spec, 4, 32)
    full = chain_profile(src, "bf16-master", "adamw", bases=_bases(("recompute",)))
    assert search_mod._opt_bytes(keep, 4) == search_mod._opt_bytes(full, 4)
    for prof in (full, head_profile(src, full, 4, "bf16-master", "adamw")):
        for acts in lists:
            at = prof.at_optimizer(acts)
            assert at[:3] == floor
            assert prof.peak_of(acts) >= sum(at)


@pytest.mark.slow
def test_the_plan_is_the_same_without_the_shortcuts(monkeypatch):
    def fit():
        return memfit.fit(SPEC, budget="1MiB", batch=4, seq=32, device="cpu", allow=ALLOW)

    plan = fit()
    # 32-true and bf16-master without optimizer offload are over their floor at 1 MiB: set aside untraced
    assert plan.precision == "bf16-master" and plan.offload_optimizer == "cpu"
    assert any(c.precision == "32-true" and not c.feasible for c in plan.ranked)
    monkeypatch.setattr(search_mod, "_over_floor", lambda *a: False)
    monkeypatch.setattr(disk_plan, "CPU_BEFORE_DISK", False)
    slow = fit()
    for field in ("actions", "micro_batch", "accumulation", "precision", "offload_optimizer", "head_chunks",
                  "predicted_peak", "predicted_time"):
        assert getattr(plan, field) == getattr(slow, field), field


def test_nothing_fits_still_names_the_smallest_need():
    """Configurations set aside over their floor are traced when nothing fits, for the error."""
    with pytest.raises(memfit.plan.costs.PlanError, match="smallest plan needs"):
        memfit.fit(SPEC, budget="1MiB", batch=2, seq=32, device="cpu", allow="accumulate,optimizer-offload")


def test_only_configurations_no_other_undercuts_are_traced_for_the_error():
    below = [(p, m, o) for p in ("32-true", "bf16-master") for m in (4, 2, 1) for o in (None, "cpu")]
    assert search_mod._minimal(below) == [("32-true", 1, "cpu"), ("bf16-master", 1, "cpu")]
    assert search_mod._minimal([("32-true", 4, None), ("32-true", 2, None)]) == [("32-true", 2, None)]


def test_weights_and_gradients_alone_over_the_budget_say_shard_them():
    """bf16-master with optimizer offload already allowed: only sharding or a smaller model is left."""
    with pytest.raises(memfit.plan.costs.PlanError) as err:
        # No recompute: the floor (parameters, gradients, optimizer state) does not depend on the
        # activations' actions, and its traces were most of this test's time.
        memfit.fit(SPEC, budget="600KiB", batch=2, seq=32, device="cpu", precision="bf16-master",
                   allow="accumulate,optimizer-offload")
    msg = str(err.value)
    assert "parameters, gradients and optimizer state alone need" in msg and "--strategy zero3" in msg
    assert "bf16-master micro-batch 1 x 2, optimizer offload" in msg
