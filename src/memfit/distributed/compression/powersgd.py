"""PowerSGD: torch's per-matrix powerSGD_hook, and a working batched variant.

torch's `batched_powerSGD_hook` fails in this torch version: it passes 2-D P and Q matrices to
`_orthogonalize`, which now asserts a 3-D batch (`AssertionError` on the first compressed step).
`BatchedPowerSGD` below is the same algorithm (Vogels et al. 2019, one power iteration per step,
warm-started Q, error feedback): the whole flat buffer is padded to a side x side matrix M and

    P = M Q; all_reduce(P); P = orth(P); Q = M^T P; all_reduce(Q) / N; approx = P Q^T

Orthogonalization is torch.linalg.qr. The error feedback follows torch's hook: the residual is
the local corrected gradient minus the *averaged* approximation. It works on any flat buffer, so
it also serves ZeRO's reduce-scatter (torch's hook needs a DDP GradBucket).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _torch_psgd

from memfit.distributed.compression.exchange import Traffic, all_reduce_sum, allreduce_bytes
from memfit.distributed.compression.feedback import ErrorFeedback


def square_side(numel: int) -> int:
    return math.ceil(math.sqrt(numel))


def worth_compressing(numel: int, rank: int) -> bool:
    """P and Q together must be smaller than the buffer (torch's min_compression_rate = 1)."""
    return 2 * square_side(numel) * rank < numel


class BatchedPowerSGD:
    def __init__(self, rank: int, start: int = 2, seed: int = 0) -> None:
        self.rank, self.start, self.seed = rank, start, seed
        self.feedback = ErrorFeedback()
        self.q: dict = {}

    def _initial_q(self, side: int) -> torch.Tensor:
        gen = torch.Generator()
        gen.manual_seed(self.seed)  # the same Q on every rank
        return torch.randn(side, self.rank, generator=gen)

    def exchange(self, flat: torch.Tensor, key, step: int, group, traffic: Traffic) -> torch.Tensor:
        """The average over ranks of `flat` (approximated after `start` steps), as fp32."""
        world = dist.get_world_size(group)
        n = flat.numel()
        if step < self.start or not worth_compressing(n, self.rank):
            return all_reduce_sum(flat.detach().float() / world, group, traffic)
        x = self.feedback.corrected(key, flat)
        side = square_side(n)
        m = torch.nn.functional.pad(x, (0, side * side - n)).view(side, side)
        q = self.q.get(key)
        if q is None or q.shape[0] != side:
            q = self._initial_q(side).to(x.device)
        p = all_reduce_sum(m @ q, group, traffic)
        p = torch.linalg.qr(p).Q
        q = all_reduce_sum(m.T @ p, group, traffic).div_(world)
        self.q[key] = q
        approx = (p @ q.T).view(-1)[:n]
        self.feedback.update(key, x, approx)
        return approx

    def state_dict(self) -> dict:
        return {"feedback": self.feedback.state_dict(), "q": {k: v.clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state["feedback"])
        self.q = {k: v.clone() for k, v in state["q"].items()}


def torch_powersgd_state(rank: int, start: int, group=None) -> _torch_psgd.PowerSGDState:
    """torch's PowerSGDState with error feedback and warm start on."""
    return _torch_psgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                     start_powerSGD_iter=max(2, start), min_compression_rate=1,
                                     use_error_feedback=True, warm_start=True,
                                     orthogonalization_epsilon=1e-8)


def torch_powersgd_bytes(state: _torch_psgd.PowerSGDState, gradients: list[torch.Tensor], world: int) -> int:
    """Bytes one rank sends in torch's powerSGD_hook for one bucket, mirroring its own split.

    torch's hook issues its collectives inside its futures, where memfit cannot count them; this
    follows its code step by step: vanilla all-reduce of the bucket before start_powerSGD_iter,
    then one all-reduce of the tensors not worth compressing and one each of all Ps and all Qs."""
    size = gradients[0].element_size() if gradients else 4
    if state.iter < state.start_powerSGD_iter:
        return allreduce_bytes(sum(g.numel() for g in gradients) * size, world)
    plain = ps = qs = 0
    for g in gradients:
        n = g.shape[0] if g.dim() else 1
        m = g.numel() // max(n, 1)
        r = min(n, m, state.matrix_approximation_rank)
        if _torch_psgd._should_compress(n, m, r, state.min_compression_rate)[0]:
            ps, qs = ps + n * r, qs + m * r
        else:
            plain += g.numel()
    return sum(allreduce_bytes(k * size, world) for k in (plain, ps, qs))
