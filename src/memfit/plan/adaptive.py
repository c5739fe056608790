"""Plans per sequence-length bucket: a longer batch recomputes more instead of running out of memory.

    ap = AdaptivePlan("gpt2", budget="2GiB", bucket=128)
    for x in batches:                       # (batch, seq) varies
        ap.apply(model, *x.shape)           # solved once per bucket, cached; re-applied when it changes
        ...

Each bucket's plan is solved for the bucket's longest length (seq rounded up to a multiple of
`bucket`), so every batch in it fits the budget.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from memfit.plan.plan import Plan


class AdaptivePlan:
    def __init__(self, model: str, budget: Any, *, optimizer: str = "adamw", precision: str = "32-true",
                 allow: Any = ("recompute", "selective"), bucket: int = 128, verify: bool = False,
                 keep_output: bool = True) -> None:
        self.model, self.budget, self.optimizer, self.precision = model, budget, optimizer, precision
        self.keep_output = keep_output  # as memfit.fit: the loop holds the model's output through backward
        self.allow, self.bucket, self.verify = allow, bucket, verify
        self.plans: dict[tuple[int, int], Plan] = {}
        self._applied: dict[int, tuple[int, int]] = {}

    def key(self, batch: int, seq: int) -> tuple[int, int]:
        return batch, -(-seq // self.bucket) * self.bucket

    def for_shape(self, batch: int, seq: int) -> Plan:
        """The plan for batches of this shape (solved on first use, then cached)."""
        from memfit.plan.fit import fit

        k = self.key(batch, seq)
        if k not in self.plans:
            self.plans[k] = fit(self.model, budget=self.budget, optimizer=self.optimizer, precision=self.precision,
                                allow=self.allow, batch=k[0], seq=k[1], verify=self.verify,
                                keep_output=self.keep_output)
        return self.plans[k]

    def apply(self, model: nn.Module, batch: int, seq: int) -> Plan:
        """Switch `model`'s checkpoint policy (and head chunks) to this shape's plan (no-op when applied)."""
        plan = self.for_shape(batch, seq)
        k = self.key(batch, seq)
        if self._applied.get(id(model)) != k:
            plan.install(model)
            self._applied[id(model)] = k
        return plan
