"""A plan that offloads the optimizer state is checked by a full trace too, and holds for real."""
import copy

import torch

import memfit
from memfit.models.spec import parse_model
from memfit.apply.optimizer import TrainingOptimizer

SPEC = "gpt:layers=2,hidden=256,heads=4,vocab=4096,seq=32"
BUDGET = 30 << 20  # the state (8 bytes a parameter, 2.4M parameters) must leave the device


def test_optimizer_offload_plan_is_traced_and_fits_for_real():
    plan = memfit.fit(SPEC, budget=BUDGET, batch=1, seq=32, device="cpu", allow="recompute,optimizer-offload",
                      keep_output=False)  # the loop below keeps only the loss
    assert plan.offload_optimizer == "cpu"
    assert plan.measured_peak is not None and plan.measured_peak <= BUDGET  # the full trace ran
    assert any("checked by a full trace with the state on the host" in n for n in plan.notes)
    torch.manual_seed(0)
    plain = parse_model(SPEC).build()
    model = copy.deepcopy(plain)
    x = torch.randint(0, 4096, (1, 32))

    def steps(m, opt, track=False):
        with memfit.track(m, opt) if track else memfit.track(None) as tr:
            for _ in range(2):  # the second step holds optimizer state: the steady-state peak
                with opt.autocast():
                    loss = m(x, x)[1]
                opt.backward(loss)
                opt.step()
        opt.close()
        return tr.peak_bytes

    steps(plain, TrainingOptimizer(plain, "adamw", lr=3e-4))
    peak = steps(model, plan.apply(model), track=True)
    assert peak <= BUDGET
    # What the full trace predicted is what the tracker counts, less the step's tokens and targets (int64,
    # 1 x 32 each), which the trace makes inside the step and this loop before tracking.
    assert plan.measured_peak - 2 * 32 * 8 <= peak <= plan.measured_peak
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)  # the same updates, from the host
