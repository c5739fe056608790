"""Error feedback and DGC momentum correction: what a lossy compressor did not send is kept and
added to the next gradient, so every gradient element is eventually applied.

Per buffer (a DDP bucket, or a ZeRO flat gradient), keyed by the caller:

    x = grad + residual                         (momentum off)
    u = m * u + grad; x = u + residual          (DGC momentum correction, m > 0)
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
    def __init__(self, momentum: float = 0.0, mask: bool = True) -> None:
        self.momentum, self.mask = momentum, mask
        self.residual: dict = {}
        self.velocity: dict = {}

    def corrected(self, key, grad: torch.Tensor) -> torch.Tensor:
        """grad (+ momentum) + the residual kept for `key`, as a new fp32 tensor."""
        g = grad.detach().float()
        base = g
        if self.momentum:
            u = self.velocity.get(key)
            u = g.clone() if u is None or u.shape != g.shape else u.mul_(self.momentum).add_(g)
            self.velocity[key] = u
            base = u
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
                "velocity": {k: v.clone() for k, v in self.velocity.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.residual = {k: v.clone() for k, v in state["residual"].items()}
        self.velocity = {k: v.clone() for k, v in state["velocity"].items()}
