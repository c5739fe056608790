"""torch.optim.Adafactor, made traceable: memfit estimates memory by running a training step under
FakeTensorMode, where tensors have no values, and torch's Adafactor reads a few scalars with
`.item()` (the parameter and update RMS that scale its step). Under FakeTensorMode those reads
return 1.0: the scalars change no tensor's shape or lifetime, so the traced step allocates exactly
what the real one does. Outside FakeTensorMode this is torch's Adafactor unchanged.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, is_fake

_lock = threading.Lock()


@contextlib.contextmanager
def _fake_scalars():
    original = torch.Tensor.item

    def item(self):
        try:
            return original(self)
        except DataDependentOutputException:
            return 1.0

    with _lock:
        torch.Tensor.item = item
        try:
            yield
        finally:
            torch.Tensor.item = original


class Adafactor(torch.optim.Adafactor):
    def step(self, closure=None):
        if any(is_fake(p) for g in self.param_groups for p in g["params"]):
            with _fake_scalars():
                return super().step(closure)
        return super().step(closure)
