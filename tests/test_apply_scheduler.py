"""TrainingOptimizer is a torch.optim.Optimizer: torch's defaults, and torch.optim.lr_scheduler
schedulers drive it in every offload mode exactly as they drive a plain torch optimizer."""
import copy
import warnings

import pytest
import torch
from torch.optim import lr_scheduler

from memfit.apply.optimizer import TrainingOptimizer
from memfit.apply.precision import autocast, cast_model
from memfit.models.gpt import GPT, GPTConfig

CFG = GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=16)
STEPS = 6
SCHEDULERS = {
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-4),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS),  # cycles betas too
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.3),
}


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


def hyper(opt) -> list:
    return [(g["lr"], tuple(g.get("betas", ()))) for g in opt.param_groups]


def run_plain_torch(schedule: str) -> tuple[GPT, list]:
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = SCHEDULERS[schedule](opt)
    trajectory = []
    for s in range(STEPS):
        x, y = batch(s)
        _, loss, n = model(x, y)
        (loss / n).backward()
        trajectory.append(hyper(opt))
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, trajectory


def run_memfit(schedule: str, tmp_path, steps=range(STEPS), model=None, state=None, **kw):
    model = model if model is not None else tiny_gpt()
    opt = TrainingOptimizer(model, "adamw", lr=1e-2, spill_dir=str(tmp_path), chunk_bytes=8192, **kw)
    sched = SCHEDULERS[schedule](opt)
    if state is not None:
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    trajectory, saved = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for s in steps:
            x, y = batch(s)
            with opt.autocast():
                _, loss, n = model(x, y)
            opt.backward(loss / n, final=True)
            trajectory.append(hyper(opt))
            opt.step()
            sched.step()
            if s == 2:
                # a copy: a plain torch state_dict references the live state tensors
                saved = copy.deepcopy({"opt": opt.state_dict(), "sched": sched.state_dict()})
    opt.close()
    return model, trajectory, saved


@pytest.mark.parametrize("offload", [None, "cpu", "disk"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULERS))
def test_scheduler_matches_plain_torch_in_every_offload_mode(schedule, offload, tmp_path):
    ref, ref_traj = run_plain_torch(schedule)
    model, traj, _ = run_memfit(schedule, tmp_path, offload=offload)
    assert traj == ref_traj  # lr (and OneCycleLR's betas) at every step
    assert len({lr for (lr, _), in traj}) > 1  # the schedule really changed the lr
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name  # fp32: the scheduled update itself is bit-identical


@pytest.mark.parametrize("offload", [None, "disk"])
def test_scheduler_resumes_from_state_dicts(offload, tmp_path):
    """Optimizer + scheduler state_dicts saved after step 3 continue to the uninterrupted result."""
    ref, ref_traj, saved = run_memfit("OneCycleLR", tmp_path / "a", offload=offload)
    torch.save(saved, tmp_path / "ck.pt")
    state = torch.load(tmp_path / "ck.pt", weights_only=False)
    model = tiny_gpt()
    # the model weights at the save point: replay the first three steps, then drop that optimizer
    run_memfit("OneCycleLR", tmp_path / "b", steps=range(3), model=model, offload=offload)
    model2, traj, _ = run_memfit("OneCycleLR", tmp_path / "c", steps=range(3, STEPS), model=model,
                                 state=state, offload=offload)
    assert traj == ref_traj[3:]
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model2.parameters()))


def manual_master_adamw(schedule: str) -> GPT:
    """bf16 weights, fp32 masters and a torch AdamW over the masters, scheduled, written by hand."""
    model = cast_model(tiny_gpt(), "bf16-master")
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2)
    sched = SCHEDULERS[schedule](opt)
    for s in range(STEPS):
        x, y = batch(s)
        with autocast("bf16-master", "cpu"):
            _, loss, n = model(x, y)
        (loss / n).backward()
        for p, m in zip(params, masters):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        for p, m in zip(params, masters):
            p.data.copy_(m.detach())
        sched.step()
    return model


@pytest.mark.parametrize("offload", [None, "cpu", "disk"])
@pytest.mark.parametrize("schedule", ["OneCycleLR", "StepLR"])
def test_scheduler_reaches_master_weight_updates(schedule, offload, tmp_path):
    ref = manual_master_adamw(schedule)
    model, traj, _ = run_memfit(schedule, tmp_path, precision="bf16-master", offload=offload)
    _, plain_traj = run_plain_torch(schedule)
    assert traj == plain_traj
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize("name,cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam),
                                      ("sgd", torch.optim.SGD)])
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_defaults_are_torch_defaults(name, cls, offload):
    opt = TrainingOptimizer(tiny_gpt(), name, offload=offload)
    ref = cls(tiny_gpt().parameters())
    ours = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert ours == {k: v for k, v in ref.param_groups[0].items() if k != "params"}
    assert opt.defaults == ref.defaults
    assert isinstance(opt, torch.optim.Optimizer) and len(opt.param_groups) == 1
    opt.close()


def test_zero_grad_and_step_hooks_behave_like_torch():
    model = tiny_gpt()
    opt = TrainingOptimizer(model, "sgd", lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    x, y = batch(0)
    _, loss, n = model(x, y)
    opt.backward(loss / n)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.step().stepped and calls == ["pre", "post"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no gradient: no update
