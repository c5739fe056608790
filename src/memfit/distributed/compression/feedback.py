"""Error feedback and DGC momentum correction: what a lossy compressor did not send is kept and
added to the next gradient, so every gradient element is eventually applied.

Per buffer (a DDP bucket, or a ZeRO flat gradient), keyed by the caller:

    x = grad + residual                         (momentum off)
    u = m * u + grad; x = u + residual          (DGC momentum correction, m > 0)
    u = m * u + (1 - m) * grad                  (adam mode: Adam's first moment, dampened)
    sent = decode(encode(x)); residual = x - sent
    u[sent != 0] = 0                            (DGC momentum factor masking; top-k only:
                                                 sign sends every element, so it keeps u)

so sent + residual == x: the invariant the tests check. residual is computed as one fp32
subtraction, so the identity is bitwise whenever x - sent is exact (top-k: sent is x or 0 at each
element; bf16 values: Sterbenz's lemma); for int8 and sign the subtraction rounds once, and the
identity holds to half an ulp of x.
"""
from __future__ import annotations

import torch


class ErrorFeedback:
    def __init__(self, momentum: float = 0.0, mask: bool = True, dampened: bool = False) -> None:
        self.momentum, self.mask = momentum, mask
        self.dampening = momentum if dampened else 0.0
        self.residual: dict = {}
        self.velocity: dict = {}
        self.seen: dict = {}
        """key -> the step of its last accumulate (a later call in that step adds, not decays)."""

    def accumulate(self, key, grad: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """Fold grad into the momentum kept for `key` (u = m u + (1 - dampening) g); returns what
        this call adds to the sent stream: u, or only (1 - dampening) g for a later call in the
        same `step` (ZeRO reduces every micro-batch: u decays once per step and is sent once)."""
        g = grad.detach().float()
        u = self.velocity.get(key)
        if u is None or u.shape != g.shape:
            u = g * (1 - self.dampening) if self.dampening else g.clone()
        elif step is not None and self.seen.get(key) == step:
            u.add_(g, alpha=1 - self.dampening)
            self.velocity[key] = u
            return g * (1 - self.dampening) if self.dampening else g
        else:
            u.mul_(self.momentum).add_(g, alpha=1 - self.dampening)
        self.velocity[key] = u
        self.seen[key] = step
        return u

    def corrected(self, key, grad: torch.Tensor, divide: torch.Tensor | None = None,
                  bound: float = 1.0, step: int | None = None) -> torch.Tensor:
        """grad (+ momentum) + the residual kept for `key`, as a new fp32 tensor. divide: frozen
        Adam's denominator; the quotient u / d is then clamped to [-bound, bound] (see onebit.py)."""
        base = self.accumulate(key, grad, step) if self.momentum else grad.detach().float()
        if divide is not None:
            base = (base / divide).clamp_(-bound, bound)
        r = self.residual.get(key)
        if r is None or r.shape != base.shape:  # a new buffer, or DDP rebuilt its buckets
            return base.clone()
        return base + r

    def update(self, key, corrected: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        """Keep corrected - sent for the next step; returns the new residual."""
        residual = corrected - sent
        self.residual[key] = residual
        if self.momentum and self.mask:
            self.velocity[key].masked_fill_(sent != 0, 0.0)
        return residual

    def state_dict(self) -> dict:
        return {"residual": {k: v.clone() for k, v in self.residual.items()},
                "velocity": {k: v.clone() for k, v in self.velocity.items()}, "seen": dict(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.residual = {k: v.clone() for k, v in state["residual"].items()}
        self.velocity = {k: v.clone() for k, v in state["velocity"].items()}
        self.seen = dict(state.get("seen", {}))
