"""CompressionState: one compressor, its error feedback, and what it sent, for one process group.

`exchange(flat, key)` is the whole compressed all-reduce of one buffer: add the residual, encode,
keep the new residual, exchange, decode, average. DDP hooks and compressed_reduce_scatter both
call it, so both have the same error-feedback semantics. Counters:

    state.traffic.sent            bytes this rank sent (counted at each collective call)
    state.traffic.uncompressed    what plain fp32 all-reduce of the same buffers would send
    state.encode_s, decode_s      seconds spent encoding (incl. error feedback) and decoding
    state.steps                   completed steps (DDP: last bucket seen; ZeRO: end_step())

In adam mode (spec adam=W, see onebit.py) each rank keeps Adam's moments of its own gradients;
the first W steps send the gradient through the warm-up codec (int8 or fp32), after them each
rank's Adam direction plus residual is compressed, and `update_phase` tells the optimizer that
what arrived is the averaged update, not a gradient. state_dict() holds everything that changes what is sent (residuals, momenta, counters,
the int8 rounding generator), so a resumed run sends the same bits.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist

from memfit.core.errors import ConfigError
from memfit.distributed.compression.exchange import (
    Traffic, all_reduce_sum, allreduce_bytes, gather_parts, scatter_parts,
)
from memfit.distributed.compression.feedback import ErrorFeedback
from memfit.distributed.compression.layout import sizes_or_whole, split_segments
from memfit.distributed.compression.onebit import WIRE_SCALE, LocalAdam, agreement
from memfit.distributed.compression.powersgd import BatchedPowerSGD
from memfit.distributed.compression.quant8 import Int8
from memfit.distributed.compression.registry import make_codec
from memfit.distributed.compression.spec import CompressionSpec, parse_compression


class CompressionState:
    def __init__(self, spec: str | CompressionSpec | None, group=None, average: bool = True) -> None:
        self.spec = parse_compression(spec)
        self.group = group
        self.average = average
        """True: exchange() returns the mean over ranks (torch DDP's convention); False: the sum
        (memfit's strategies, whose ranks divide their losses by the global token count)."""
        self.traffic = Traffic()
        self.encode_s = self.decode_s = 0.0
        self.steps = 0
        self.calls: dict = defaultdict(int)
        self.seen: dict = {}
        """adam mode: key -> the step of its last exchange."""
        self.per_call_steps = True
        """Count a buffer's calls as steps (DDP); ZeRO turns this off: with gradient accumulation
        it reduces each micro-batch, and its end_step() counts the optimizer steps."""
        self.powersgd = self.codec = self.feedback = self.warm_codec = None
        self.shard: int | None = None
        """The slice a reduce-scatter in progress returns (exchange(shard=))."""
        self.update_phase = False
        """adam mode: the last exchange delivered the averaged Adam update (x 2^-20), not a gradient."""
        self.param_index: dict[int, int] | None = None
        """id(parameter) -> its position in the model: stable DDP bucket keys across processes."""
        self.params: list | None = None
        """The model's parameters by position (DDP keys are tuples of positions)."""
        self.local_adam: LocalAdam | None = None
        self.clip = self.spec.clip
        self.lr_of = None
        """adam mode: the optimizer's current learning rate (set by onebit.attach), for owe=step."""
        """Local gradient clip norm (adam mode without clip=: the optimizer's, set by onebit.attach)."""
        if self.spec.name == "powersgd":
            self.powersgd = BatchedPowerSGD(self.spec.rank, self.spec.dense_steps, self.spec.seed)
        else:
            self.codec = make_codec(self.spec, dist.get_rank(group) if dist.is_initialized() else 0)
            if self.spec.adam is not None:  # betas and eps come from the optimizer (onebit.attach)
                self.local_adam = LocalAdam(batch_variance=self.spec.variance == "batch")
                self.feedback = ErrorFeedback()
                self.warm_codec = Int8(1024) if self.spec.warm == "int8" else None
            elif self.spec.error_feedback:
                self.feedback = ErrorFeedback(self.spec.momentum, mask=self.spec.name == "topk")

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def end_step(self) -> None:
        self.steps += 1

    def exchange(self, flat: torch.Tensor, key=0, sizes=None, shard: int | None = None) -> torch.Tensor:
        """The mean over ranks of every rank's `flat` (1-D), compressed on the wire; flat's dtype.

        sizes: lengths of the tensors concatenated in `flat` (top-k budgets and int8/sign scales
        stay within one tensor); None = one tensor. Every rank must call it with buffers of the
        same length and sizes in the same order (it is a collective).
        shard: a reduce-scatter: return only slice `shard` of N equal slices; the gathered
        codecs (top-k, int8, sign) then send each slice's payload to its rank alone (all_to_all)."""
        self.shard = shard
        out = self._exchange(flat, key, sizes)
        if shard is not None and out.numel() == flat.numel():  # the paths that reduce the whole buffer
            out = out.chunk(self.world)[shard]
        return out

    def _exchange(self, flat: torch.Tensor, key, sizes) -> torch.Tensor:
        world, n = self.world, flat.numel()
        self.traffic.uncompressed += allreduce_bytes(n * flat.element_size(), world)
        # Steps seen by this buffer, or completed steps when the caller reports them (DDP renames its
        # buckets once, when it rebuilds them after step 1, which restarts a per-buffer count).
        step = max(self.calls[key], self.steps) if self.per_call_steps else self.steps
        self.calls[key] += 1
        if self.powersgd is not None:
            t0 = time.perf_counter()
            out = self.powersgd.exchange(flat, key, step, self.group, self.traffic)
            self.encode_s += time.perf_counter() - t0  # includes its two all-reduces
            return (out if self.average else out * world).to(flat.dtype)
        if self.spec.adam is not None:
            return self._adam(flat, key, step, world, sizes)
        if self.clip is not None:  # DGC's local gradient clipping, before momentum and compression
            flat = self._clipped(flat.detach().float())
        if step < self.spec.dense_steps:  # uncompressed warm-up: plain fp32, residuals untouched
            out = all_reduce_sum(flat.detach().float().clone(), self.group, self.traffic)
            return (out / world if self.average else out).to(flat.dtype)
        if self.codec.exchange == "allreduce":
            return self._allreduce(flat, key, step, world)
        return self._gather(flat, key, step, world, sizes)

    def _encode(self, x: torch.Tensor, key, step: int, scale: float = 1.0, sizes=None, codec=None,
                weight: torch.Tensor | None = None) -> list[torch.Tensor]:
        codec = codec or self.codec
        extra = {} if weight is None else {"weight": weight}
        parts = codec.encode(x if scale == 1.0 else x / scale, step, sizes, **extra)
        if self.feedback is not None:
            sent = codec.decode(parts, x.numel(), sizes)
            self.feedback.update(key, x, sent if scale == 1.0 else sent * scale)
        return parts

    def _corrected(self, flat: torch.Tensor, key) -> torch.Tensor:
        if self.feedback is not None:
            return self.feedback.corrected(key, flat)
        return flat.detach().float()

    def _adam(self, flat: torch.Tensor, key, step: int, world: int, sizes) -> torch.Tensor:
        if self.seen.get(key) == step and not self.per_call_steps:
            raise ConfigError("adam= under ZeRO-2 takes one micro-batch per step (the local Adam moments "
                              "move once per step); use --accum 1, or zero1, which reduces once per step")
        self.seen[key] = step
        # the rank's mean gradient: memfit's strategies hand over 1/N of it (summed over ranks)
        g = flat.detach().float() if self.average else flat.detach().float() * world
        # the local moments see the clipped gradient; the warm-up exchange leaves clipping to the optimizer
        y = self.local_adam.direction(key, self._clipped(g) if self.clip is not None else g, world)
        self.update_phase = step >= self.spec.adam
        if not self.update_phase:  # warm-up: plain Adam on the exchanged gradient
            return self._warm(flat, world, sizes)
        # top-k ranks x = y + residual by x * y (onebit.agreement) unless select=x: plain |x|
        weight = self._selection_weight(key, y)
        lr = self._step_lr()  # owe=step: the residual holds lr-scaled steps, applied at their own lr
        out = self._gather(y * lr if lr != 1.0 else y, key, step, world, sizes, weight=weight)
        out = out if self.average else out / world  # the update is the mean of the ranks' directions
        return (out * (WIRE_SCALE / lr)).to(flat.dtype)

    def _selection_weight(self, key, y: torch.Tensor):
        """adam-mode top-k's ranking weight of x (None: |x|): agreement with the direction y
        (select=agree) or with the momentum m (select=gain: x m estimates the loss decrease that
        sending x buys, to first order)."""
        if self.spec.name != "topk" or self.spec.selection == "x":
            return None
        toward = y if self.spec.selection == "agree" else self.local_adam.m[key]
        return lambda x: agreement(x, toward)

    def _step_lr(self) -> float:
        if self.spec.owed != "step" or self.lr_of is None:
            return 1.0
        lr = float(self.lr_of())
        return lr if lr > 0 else 1.0

    def _clipped(self, g: torch.Tensor) -> torch.Tensor:
        return g * min(1.0, self.clip / (float(g.norm()) + 1e-6))

    def _warm(self, flat: torch.Tensor, world: int, sizes) -> torch.Tensor:
        """adam mode's warm-up exchange of the plain gradient: int8 (no error feedback) or fp32."""
        if self.warm_codec is None:
            out = all_reduce_sum(flat.detach().float().clone(), self.group, self.traffic)
            return (out / world if self.average else out).to(flat.dtype)
        return self._gather(flat, None, 0, world, sizes, self.warm_codec, feedback=False)

    def _gather(self, flat: torch.Tensor, key, step: int, world: int, sizes, codec=None,
                feedback: bool = True, weight=None) -> torch.Tensor:
        """feedback=False: a codec without error feedback (adam mode's warm-up). weight: top-k ranks
        the error-corrected x by |x| * weight(x) instead of |x| (what it sends is still x)."""
        t0 = time.perf_counter()
        codec = codec or self.codec
        x = self._corrected(flat, key) if feedback else flat.detach().float()
        weight = weight(x) if weight is not None else None
        if self.shard is not None:
            return self._scatter(x, key, step, world, sizes, codec, t0, feedback, weight).to(flat.dtype)
        parts = (self._encode(x, key, step, sizes=sizes, codec=codec, weight=weight) if feedback
                 else codec.encode(x, step, sizes))
        t1 = time.perf_counter()
        gathered = gather_parts(parts, self.group, self.traffic)
        t2 = time.perf_counter()
        total = codec.decode(gathered[0], flat.numel(), sizes).clone()
        for p in gathered[1:]:  # rank order, so every rank computes the same bits
            total += codec.decode(p, flat.numel(), sizes)
        out = (total / world if self.average else total).to(flat.dtype)
        self.encode_s += t1 - t0
        self.decode_s += time.perf_counter() - t2
        return out

    def _scatter(self, x: torch.Tensor, key, step: int, world: int, sizes, codec, t0: float,
                 feedback: bool, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed reduce-scatter: slice j of x is encoded on its own and sent to rank j only."""
        n = x.numel()
        pieces = split_segments(sizes_or_whole(sizes, n), n, world)
        slices = x.chunk(world)
        weights = [{}] * world if weight is None else [{"weight": w} for w in weight.chunk(world)]
        chunks = [codec.encode(s, step, p, **w) for s, p, w in zip(slices, pieces, weights)]
        if feedback and self.feedback is not None:
            sent = torch.cat([codec.decode(c, s.numel(), p) for c, s, p in zip(chunks, slices, pieces)])
            self.feedback.update(key, x, sent)
        t1 = time.perf_counter()
        received = scatter_parts(chunks, self.group, self.traffic, self.shard)
        t2 = time.perf_counter()
        m, mine = n // world, pieces[self.shard]
        total = codec.decode(received[0], m, mine).clone()
        for p in received[1:]:  # rank order, so the result does not depend on arrival
            total += codec.decode(p, m, mine)
        self.encode_s += t1 - t0
        self.decode_s += time.perf_counter() - t2
        return total / world if self.average else total

    def _allreduce(self, flat: torch.Tensor, key, step: int, world: int) -> torch.Tensor:
        # Linear casts: divide first (as torch's fp16 hook does) and sum in the wire dtype.
        t0 = time.perf_counter()
        parts = self._encode(self._corrected(flat, key), key, step, scale=world if self.average else 1.0)
        t1 = time.perf_counter()
        wire = all_reduce_sum(parts[0], self.group, self.traffic)
        t2 = time.perf_counter()
        out = self.codec.decode([wire], flat.numel()).to(flat.dtype)
        self.encode_s += t1 - t0
        self.decode_s += time.perf_counter() - t2
        return out

    def state_dict(self) -> dict:
        """This rank's compressor state (residuals and momenta differ between ranks)."""
        out = {"spec": str(self.spec), "steps": self.steps, "calls": dict(self.calls),
               "update_phase": self.update_phase,
               "traffic": {"sent": self.traffic.sent, "uncompressed": self.traffic.uncompressed,
                           "calls": self.traffic.calls, "by_collective": dict(self.traffic.by_collective)},
               "encode_s": self.encode_s, "decode_s": self.decode_s}
        if self.feedback is not None:
            out["feedback"] = self.feedback.state_dict()
        if self.local_adam is not None:
            out["local_adam"], out["seen"] = self.local_adam.state_dict(), dict(self.seen)
        generator = getattr(self.codec, "generator", None)
        if generator is not None:
            out["generator"] = generator.get_state()
        if self.powersgd is not None:
            out["powersgd"] = self.powersgd.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        if state["spec"] != str(self.spec):
            raise ValueError(f"the saved compressor state is for {state['spec']}, this run compresses with {self.spec}")
        self.steps, self.update_phase = state["steps"], state["update_phase"]
        self.calls = defaultdict(int, state["calls"])
        t = state["traffic"]
        self.traffic.sent, self.traffic.uncompressed, self.traffic.calls = t["sent"], t["uncompressed"], t["calls"]
        self.traffic.by_collective = dict(t["by_collective"])
        self.encode_s, self.decode_s = state["encode_s"], state["decode_s"]
        if self.feedback is not None:
            self.feedback.load_state_dict(state["feedback"])
        if self.local_adam is not None:
            self.local_adam.load_state_dict(state["local_adam"])
            self.seen = dict(state["seen"])
        if "generator" in state:  # int8 stochastic rounding: the same noise as the run would have drawn
            if self.codec.generator is None:
                self.codec.generator = torch.Generator()
            self.codec.generator.set_state(state["generator"])
        if self.powersgd is not None:
            self.powersgd.load_state_dict(state["powersgd"])

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        return {"compression": str(self.spec), "steps": self.steps,
                "bytes_sent_per_step": self.traffic.sent / steps,
                "uncompressed_bytes_per_step": self.traffic.uncompressed / steps,
                "ratio": self.traffic.ratio, "encode_s": self.encode_s, "decode_s": self.decode_s}
