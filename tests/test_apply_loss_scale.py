"""Dynamic loss scaling: the state machine, skipped steps on injected inf/NaN, the overflow report."""
import math
import warnings

import pytest
import torch
import torch.nn as nn

from memfit.apply.loss_scale import InfNanLocator, LossScaler, OverflowWarning
from memfit.apply.optimizer import TrainingOptimizer
from memfit.core.errors import ConfigError


# ---------------------------------------------------------------- the state machine alone
def test_defaults_start_at_2_16_and_double_after_2000_clean_steps():
    s = LossScaler()
    assert s.scale == 2.0**16
    for _ in range(1999):
        assert s.update(found_inf=False)
    assert s.scale == 2.0**16
    assert s.update(found_inf=False)
    assert s.scale == 2.0**17 and s.clean_steps == 0


def test_overflow_skips_and_halves_and_resets_the_growth_count():
    s = LossScaler(growth_interval=3)
    s.update(False)
    s.update(False)
    assert s.update(True) is False
    assert s.scale == 2.0**15 and s.clean_steps == 0 and s.skipped_steps == 1
    s.update(False)
    s.update(False)
    assert s.scale == 2.0**15  # only 2 clean steps since the overflow
    s.update(False)
    assert s.scale == 2.0**16


def test_hysteresis_tolerates_overflows_before_cutting():
    s = LossScaler(hysteresis=3)
    assert [s.update(True) for _ in range(3)] == [False, False, False]  # every overflow is skipped
    assert s.scale == 2.0**15  # but only the third cut the scale
    assert s.update(True) is False and s.scale == 2.0**15
    s.update(False)
    assert s.hysteresis_left == 2  # not refilled by a clean step, only by growth


def test_never_exits_at_minimum_scale():
    s = LossScaler(init_scale=4.0, min_scale=1.0)
    for _ in range(50):
        assert s.update(True) is False
    assert s.scale == 1.0 and s.overflows_in_a_row == 50 and s.persistent
    assert s.update(False) is True  # and training resumes when the overflow goes away


def test_state_dict_roundtrip_and_bad_settings():
    s = LossScaler(growth_interval=5)
    for inf in (False, True, False, False):
        s.update(inf)
    t = LossScaler(growth_interval=5)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    with pytest.raises(ConfigError, match="init_scale"):
        LossScaler(init_scale=float("inf"))
    with pytest.raises(ConfigError, match="backoff_factor"):
        LossScaler(backoff_factor=2.0)
    with pytest.raises(ConfigError, match="hysteresis"):
        LossScaler(hysteresis=0)


# ---------------------------------------------------------------- inside TrainingOptimizer
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 1)
        self.poison = False  # when set, fc1's output gets an inf (an injected overflow)
        self.fc1.register_forward_hook(lambda m, a, out: out * torch.where(
            torch.arange(out.shape[-1]) == 0, torch.tensor(float("inf")), torch.tensor(1.0)) if self.poison else None)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def one_step(net, opt, x):
    with opt.autocast():
        loss = net(x).float().pow(2).mean()
    opt.backward(loss)
    return opt.step()


@pytest.mark.parametrize("precision", ["16-mixed", "16-true", "16-master"])
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_injected_overflow_skips_the_step_and_training_goes_on(precision, offload):
    torch.manual_seed(0)
    net = Net()
    opt = TrainingOptimizer(net, "adamw", lr=1e-2, precision=precision, offload=offload)
    x = torch.randn(4, 8)
    assert one_step(net, opt, x).stepped
    before = [p.detach().clone() for p in net.parameters()]
    net.poison = True
    r = one_step(net, opt, x)
    assert not r.stepped and r.loss_scale == 2.0**16
    assert opt.scaler.scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # the update was skipped
    assert all(p.grad is None for p in net.parameters())  # and the bad grads discarded
    net.poison = False
    r = one_step(net, opt, x)
    assert r.stepped and r.loss_scale == 2.0**15
    assert not all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    opt.close()


def test_nan_gradient_is_an_overflow_too():
    net = Net()
    opt = TrainingOptimizer(net, "sgd", lr=0.1, precision="16-mixed")
    net.fc2.bias.register_hook(lambda g: g * float("nan"))
    r = one_step(net, opt, torch.randn(4, 8))
    assert not r.stepped and opt.scaler.skipped_steps == 1


def test_persistent_overflow_names_the_first_module_and_suggests_bf16():
    torch.manual_seed(0)
    net = Net()
    opt = TrainingOptimizer(net, "adamw", precision="16-mixed", loss_scale={"warn_after": 3, "init_scale": 4.0})
    net.poison = True
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [one_step(net, opt, x) for _ in range(6)]
    assert not any(r.stepped for r in results)
    assert [r.message is not None for r in results] == [False, False, True, False, False, True]
    msgs = [str(w.message) for w in caught if issubclass(w.category, OverflowWarning)]
    assert len(msgs) == 2
    assert "forward output of 'fc1'" in msgs[0]  # the injected inf, not the modules it spread to
    assert "bf16" in msgs[0] and "3 steps in a row" in msgs[0]
    assert opt.scaler.scale == 1.0  # clamped at the minimum, still running
    net.poison = False
    assert one_step(net, opt, x).stepped
    assert opt._locator is None  # the hooks are gone once the overflow stops


class _BlowUpInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


class BlowUp(nn.Module):
    def forward(self, x):
        return _BlowUpInBackward.apply(x)


def test_locator_finds_the_module_whose_backward_made_inf():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(BlowUp(), nn.Linear(16, 16)), nn.Linear(16, 1))
    loc = InfNanLocator(net)
    net(torch.randn(2, 8)).sum().backward()
    loc.remove()
    assert loc.first_forward is None
    assert loc.first_backward == "2.0"  # the BlowUp inside the inner Sequential, not the Sequential


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_clipping_sees_unscaled_gradients(offload):
    """grad_norm is the norm of the true gradients (not x 2**16), and matches fp32 closely."""
    torch.manual_seed(0)
    ref = Net()
    net = Net()
    net.load_state_dict(ref.state_dict())
    x = torch.randn(16, 8)
    ref_opt = TrainingOptimizer(ref, "sgd", lr=0.1, clip=1e9)
    opt = TrainingOptimizer(net, "sgd", lr=0.1, clip=1e9, precision="16-master", offload=offload)
    r_ref, r = one_step(ref, ref_opt, x), one_step(net, opt, x)
    ref_opt.close(), opt.close()
    assert r.loss_scale == 2.0**16
    assert math.isclose(r.grad_norm, r_ref.grad_norm, rel_tol=2e-2)
    # a tight clip: the applied update is lr * clip in norm, as in fp32
    clip_ref = TrainingOptimizer(ref, "sgd", lr=1.0, clip=1e-3)
    clip_16 = TrainingOptimizer(net, "sgd", lr=1.0, clip=1e-3, precision="16-master", offload=offload)
    masters = [m.detach().clone() for m in clip_16.streamed.masters]
    one_step(net, clip_16, x)
    delta = torch.cat([(m - b).flatten() for m, b in zip(clip_16.streamed.masters, masters)]).norm()
    assert float(delta.detach()) == pytest.approx(1e-3, rel=1e-3)
    clip_ref.close(), clip_16.close()
