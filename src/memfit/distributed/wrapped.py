"""What a model-parallel strategy's optimizer forwards to the TrainingOptimizer it wraps (`inner`)."""
from __future__ import annotations

import contextlib

import torch


class WrapsTrainingOptimizer:
    """TrainingOptimizer's interface, forwarded to `self.inner`; state_dict nests the inner one."""

    inner: object

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.inner.autocast()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def state_tensors(self) -> list[torch.Tensor]:
        return self.inner.state_tensors()

    def state_dict(self) -> dict:
        """This rank's part of the optimizer state ("stage": None: not a ZeRO shard)."""
        return {"stage": None, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])

    def close(self) -> None:
        self.inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
