"""ZeRO stages 1-3 over the flat layout (memfit.distributed.layout): who holds which bytes, and when
gradients and weights travel.

    stage 1  full weights on every rank, and full gradients from backward to the step (autograd's
             own tensors, none between steps); at the step each bucket's gradients are copied into
             one flat buffer and reduce-scattered, the rank updates its slice, and the slices are
             all-gathered back into the weights.
    stage 2  as 1, but each bucket's gradients are reduce-scattered as soon as backward has
             produced all of them and then dropped: a rank keeps only its slice (plus one bucket
             in flight).
    stage 3  as 2, and the weights are sharded too: a block's bucket is all-gathered just before
             the block runs (the next block's gather is started at the same time: prefetch) and
             its storage is released right after, in forward and again in backward. The rest
             (embeddings, head, final norm) is gathered at the start of forward and released once
             its gradients have been reduced.

Stage 3 releases a gathered bucket by resizing its storage to 0 bytes, as FSDP does: every view
of it (the parameters, and whatever autograd saved) stays valid and sees the regathered values.
The memory tracker is told about each resize (it only sees storages that ops return).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from memfit.apply.checkpoint import applied
from memfit.apply.policy import segments
from memfit.core import tracker as tracker_mod
from memfit.distributed import comm
from memfit.distributed.compression.reduce_scatter import compressed_reduce_scatter
from memfit.distributed.layout import Bucket, FlatLayout


class ShardModule(nn.Module):
    """This rank's slices, one parameter per bucket: what the rank's optimizer updates."""

    def __init__(self, slices: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.slices = nn.ParameterList(nn.Parameter(s, requires_grad=True) for s in slices)


def _retrack(t: torch.Tensor, category: int = tracker_mod.PARAMS) -> None:
    """Tell active memory trackers what `t` is, or that its storage changed size (a resize is no
    op they see; a gradient slice made inside a hook is not a parameter's .grad for them yet)."""
    for tr in tracker_mod._ACTIVE:
        if tr._register(t, category):
            tr._check_peak()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class ZeroEngine:
    def __init__(self, model: nn.Module, stage: int, group=None, prefetch: bool = True) -> None:
        self.model, self.stage, self.group, self.prefetch = model, stage, group, prefetch
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.layout = FlatLayout(model, self.world)
        first = self.layout.buckets[0].params[0]
        self.dtype, self.device = first.dtype, first.device
        with torch.no_grad():
            for p in model.parameters():  # every rank starts from rank 0's weights (setup, not counted)
                dist.broadcast(p.data, 0, group=group)
        self.flat: list[torch.Tensor] = []
        slices = []
        for b in self.layout.buckets:
            flat = b.flatten([p.detach() for p in b.params], self.dtype, self.device)
            for p, v in zip(b.params, b.views(flat)):
                p.data = v
            own = b.part(flat, self.rank)
            slices.append(own if stage < 3 else own.clone())
            self.flat.append(flat)
        self.shard_module = ShardModule(slices)
        self.shards = list(self.shard_module.slices)
        # A bucket's gradients are autograd's own tensors until the bucket is reduce-scattered (at
        # its last gradient in stages 2-3, at the step in stage 1): then they are copied into one
        # flat buffer, freed one by one as they are copied, and the buffer is summed in place.
        # A slice's gradient exists from its bucket's reduce-scatter to the step.
        self.grads: list[torch.Tensor | None] = [None] * len(self.layout.buckets)
        self._arrived = [0] * len(self.layout.buckets)
        self._spare: torch.Tensor | None = None
        self._hooks = []
        self._pending: dict[int, object] = {}
        self._gathered: set[int] = set()
        self.compression = None
        """A CompressionState (memfit.distributed.compression.register_compression), stages 1-2 only."""
        for p in model.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if stage == 3:
            for i in range(len(self.flat)):
                self._release(i)
            self._install_gather_hooks()
        self.attach_shard_grads()

    # ------------------------------------------------------------------ gradients
    def attach_shard_grads(self) -> None:
        """The shard gradients are the shard parameters' .grad (the memory tracker counts them as grads)."""
        for s, g in zip(self.shards, self.grads):
            s.grad = g  # None until the slice's reduce-scatter

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.stage == 1:
            return  # stage 1 keeps full gradients to the step
        b = self.layout.by_param[id(p)]
        self._arrived[b.index] += 1
        if self._arrived[b.index] == len(b.params):
            self._reduce_bucket(b)

    def _flat_grads(self, b: Bucket) -> torch.Tensor:
        """b's gradients in one padded flat buffer; each .grad is freed once copied."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == b.padded:
            flat = spare.zero_()  # the previous bucket's buffer (blocks are the same size)
        else:
            flat = torch.zeros(b.padded, dtype=self.dtype, device=self.device)
        del spare
        for p, v in zip(b.params, b.views(flat)):
            if p.grad is not None:
                v.copy_(p.grad)
                p.grad = None
        return flat

    def _take_slice(self, b: Bucket) -> torch.Tensor:
        """Reduce-scatter the bucket's gradients and drop them: the rank's summed slice."""
        gflat = self._flat_grads(b)
        part = self._reduce_scatter(b, gflat)
        # on gloo `part` is a view into the flat buffer: keep the slice, not the bucket
        part = part.clone() if _shares(part, gflat) and self.grads[b.index] is None else part
        # The buffer is kept for the next bucket (or until the step): gloo's worker thread holds
        # it a moment after the collective returns, and it would otherwise be freed there, where
        # an allocator profile does not see it; reusing it also saves an allocation per bucket.
        self._spare = gflat
        return part

    def _reduce_bucket(self, b: Bucket) -> None:
        """Reduce-scatter this bucket's gradients into the rank's slice; drop the full ones."""
        part = self._take_slice(b)
        if self.grads[b.index] is None:
            self.grads[b.index] = part
            _retrack(part, tracker_mod.GRADS)
        else:
            self.grads[b.index].add_(part)
        del part
        self._arrived[b.index] = 0
        if self.stage == 3:
            self._release(b.index)

    def finish_backward(self) -> None:
        """After each backward: buckets some of whose parameters got no gradient are reduced now
        (every rank runs the same graph, so they agree), and stage 3 releases what is still gathered."""
        if self.stage == 1:
            return
        for b in self.layout.buckets:
            if self._arrived[b.index]:
                self._reduce_bucket(b)
        if self.stage == 3:
            for i in list(self._gathered):
                self._release(i)

    def reduce_for_step(self) -> list[torch.Tensor]:
        """The rank's summed gradient slices (stage 1 reduce-scatters them here)."""
        if self.stage == 1:
            for b in self.layout.buckets:
                if any(p.grad is not None for p in b.params):
                    self.grads[b.index] = self._take_slice(b)
                    _retrack(self.grads[b.index], tracker_mod.GRADS)
        for b in self.layout.buckets:  # a bucket no parameter of which got a gradient
            if self.grads[b.index] is None:
                self.grads[b.index] = torch.zeros(b.slice, dtype=self.dtype, device=self.device)
        if self.compression is not None:
            self.compression.end_step()
        return self.grads

    def _reduce_scatter(self, b: Bucket, full: torch.Tensor) -> torch.Tensor:
        """The rank's slice of the sum over ranks of `full` (b's padded flat gradient, which this
        may overwrite: on gloo the slice is a view into it)."""
        if self.compression is not None:  # top-k budgets and scales per parameter, padding apart
            sizes = [p.numel() for p in b.params] + ([b.padded - b.numel] if b.padded > b.numel else [])
            return compressed_reduce_scatter(full, self.group, self.compression, key=b.index, sizes=sizes)
        return comm.reduce_scatter_(full, group=self.group)

    def zero_grads(self) -> None:
        """Drop the gradients and the gradient slices."""
        self.grads = [None] * len(self.layout.buckets)
        self._spare = None
        self._arrived = [0] * len(self.layout.buckets)
        for p in self.model.parameters():
            p.grad = None
        self.attach_shard_grads()

    def after_step(self) -> None:
        """Stages 1-2: all-gather the updated slices into the full weights; then zero the gradients."""
        if self.stage < 3:
            with torch.no_grad():
                for b, flat, s in zip(self.layout.buckets, self.flat, self.shards):
                    own = b.part(flat, self.rank)
                    if own.data_ptr() != s.data_ptr():  # the slice is normally a view of `flat`
                        own.copy_(s.detach())
                    comm.all_gather_(flat, group=self.group)
        self.zero_grads()

    # ------------------------------------------------------------------ stage 3: weights
    def _release(self, i: int) -> None:
        self._gathered.discard(i)
        st = self.flat[i].untyped_storage()
        if st.nbytes():
            st.resize_(0)
            _retrack(self.flat[i])

    def gather(self, i: int, wait: bool = True) -> None:
        if i in self._gathered:
            return
        work = self._pending.pop(i, None)
        if work is None:
            flat = self.flat[i]
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            _retrack(flat)
            with torch.no_grad():
                self.layout.buckets[i].part(flat, self.rank).copy_(self.shards[i].detach())
            work = comm.all_gather_(flat, group=self.group, async_op=True)
        if wait:
            work.wait()
            self._gathered.add(i)
        else:
            self._pending[i] = work

    def _prefetch(self, i: int) -> None:
        if self.prefetch and 0 <= i < len(self.flat) and i not in self._gathered and i not in self._pending:
            if self.layout.buckets[i].block is not None:
                self.gather(i, wait=False)

    def _install_gather_hooks(self) -> None:
        rest = self.layout.rest
        self._hooks.append(self.model.register_forward_pre_hook(lambda m, a: rest and self.gather(rest.index)))
        self._hooks.append(self.model.register_forward_hook(self._after_root))
        for b in self.layout.buckets:
            if b.block is not None:
                self._hooks.append(b.block.register_forward_pre_hook(self._before_block(b.index)))
                self._hooks.append(b.block.register_forward_hook(self._after_block(b.index)))

    def _after_root(self, module, args, out) -> None:
        if not torch.is_grad_enabled():
            for i in list(self._gathered):
                self._release(i)

    def _before_block(self, i: int):
        def hook(module, args):
            self.gather(i)
            self._prefetch(i + 1)
        return hook

    def _after_block(self, i: int):
        def hook(module, args, out):
            self._release(i)
            t = out[0] if isinstance(out, (tuple, list)) else out
            if torch.is_grad_enabled() and isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._before_block_backward(i))
        return hook

    def _before_block_backward(self, i: int):
        def hook(grad):
            for j in self._segment_of(i):  # a recomputed segment runs all its blocks again
                self.gather(j)
            self._prefetch(min(self._segment_of(i)) - 1)
        return hook

    def _segment_of(self, i: int) -> list[int]:
        b = self.layout.buckets[i]
        blocks = [x.block for x in self.layout.buckets if x.block is not None]
        try:
            info = applied(self.model)
        except Exception:
            info = None
        if info is not None and len(info.actions) == len(blocks):
            pos = blocks.index(b.block)
            for seg in segments(info.actions):
                if pos in seg and info.actions[seg[0]].mode != "keep":
                    return [self.layout.block_bucket[id(blocks[k])].index for k in seg]
        return [i]

    # ------------------------------------------------------------------ state
    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
