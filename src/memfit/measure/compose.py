"""The composed estimate: a step's exact peak for any per-block action list, from a few short traces.

Repeated blocks have the same memory behaviour, and memory is additive along a chain: live bytes
at any moment are what the step started with plus the net change of every stretch that ran before,
plus the current stretch's excursion (memfit.measure.timeline). So a model with L identical blocks
is traced once with a *short* chain (one block per action, two per recompute segment) and once with
one more block (which gives what each further block adds to the weights, optimizer state and the
optimizer step). `ChainProfile.compose(actions)` then walks

    pre-fwd, fwd of each block, head fwd + loss, head bwd, bwd of each block (reversed), pre bwd, optimizer

adding each stretch's excursion to the running total. A recomputed segment of n blocks does its
recomputation in its last block's backward: that stretch is the single-block one plus (n - 1) times
what one more block adds (traced with a segment of two). Tests compare the result to the byte with
a full trace of the whole model.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch.nn as nn

from memfit.apply.policy import BlockAction, segments
from memfit.measure.chain_ends import base_of, end_corrections, fwd_kinds, own_end_corrections
from memfit.measure.timeline import (ZERO, Stretch, StepStretches, TimelineTracker, Vec, stretches, vadd,
                                     vscale, vsub)

AROUND = ("pre_fwd", "post_fwd", "post_bwd", "pre_bwd", "opt")
BASE_ACTIONS = (BlockAction("keep"), BlockAction("selective"), BlockAction("recompute"))


@dataclass
class Composed:
    peak: int
    at_peak: Vec
    """Bytes per category (tracker order) at the peak moment; they sum to `peak`."""
    block_peaks: list[int] = field(default_factory=list)
    where: str = ""
    """Which stretch holds the peak (e.g. "block 3 backward", "head backward")."""


def walk(start: Sequence[int], seq: Sequence[Stretch], n: int) -> tuple[int, int, list[int]]:
    """The step's walk over its stretches (around the blocks, n forward, around, n backward, around) on
    totals only, the hot loop of the planner: (peak, index of the stretch it is in or -1 for the start,
    each block's highest point in forward or backward). Categories are rebuilt for the peak only."""
    total = sum(start)
    best, best_j = total, -1
    block_peaks = [0] * n
    for j, st in enumerate(seq):
        cand = total + st.peak_bytes
        if cand > best:
            best, best_j = cand, j
        if 0 < j <= n:
            block_peaks[j - 1] = cand
        elif n + 2 < j < 2 * n + 3:
            i = 2 * n + 2 - j
            if cand > block_peaks[i]:
                block_peaks[i] = cand
        total += st.net_bytes
    return best, best_j, block_peaks


@dataclass
class ChainProfile:
    """Per-stretch memory of one model shape, batch, precision and optimizer (bytes, exact)."""

    n_blocks: int
    start: Vec
    start_per_block: Vec
    pre_fwd: Stretch
    post_fwd: Stretch
    post_bwd: Stretch
    pre_bwd: Stretch
    opt: Stretch
    per_block: dict[str, Stretch]
    """What each further block adds to the stretches around the blocks (e.g. autocast's cached weight
    casts, freed when the forward's autocast region ends; the optimizer's per-tensor temporaries)."""
    fwd: dict[str, Stretch]
    bwd: dict[str, Stretch]
    seg_extra: dict[str, Stretch]
    deferred: dict[str, dict[str, Vec]]
    """Per stretch around the blocks, per forward kind: bytes a block of that kind made in its forward
    and that stretch frees (autocast's cached casts of recomputed blocks). `pre_fwd` etc. exclude them."""
    traced_blocks: int
    first: dict[str, tuple[Stretch, Stretch]] = field(default_factory=dict)
    """Per forward kind: what the first block's forward and backward stretches differ by from a middle block's."""
    last: dict[str, tuple[Stretch, Stretch]] = field(default_factory=dict)
    first_around: dict[str, dict[str, Stretch]] = field(default_factory=dict)
    """Per kind of the first block: what the stretches around the blocks differ by from a kept first
    block's (e.g. the embedding output a checkpointed first block holds); `last_around` likewise
    (the head's stretches after a recomputed last block)."""
    last_around: dict[str, dict[str, Stretch]] = field(default_factory=dict)
    first_ckpt: tuple[Stretch, Stretch] | None = None
    """What the first checkpointed block's forward and backward differ by from another one of its kind
    when a kept block precedes it: the inputs every checkpointed block captures from the model (HF
    position ids) are freed in the lowest one's backward."""
    bw_temps: int = 0
    plain: "ChainProfile | None" = None
    """For models that change behaviour once any block is checkpointed (Hugging Face models switch
    their KV cache off): the profile of the untouched model, used when every block is plain."""
    seconds: float = 0.0
    grad_bytes: int | None = None
    """Step-in-backward profiles: bytes of one block's gradients, which their traces free as they arrive
    (a plain profile's block leaves them: fwd + bwd net bytes); the planner's time model reads it."""
    block_params: int | None = None
    """Elements of one repeated block's parameters, frozen ones included: the planner's time model counts
    a block's FLOPs from them (its gradients undercount a LoRA block's, whose base weights are frozen)."""

    def actions(self) -> list[BlockAction]:
        return [a for a in (_parse_key(k) for k in self.fwd if "|" not in k)]

    def supports(self, actions: Sequence[BlockAction]) -> bool:
        for region in segments(actions):
            key = str(base_of(actions[region[0]]))
            if key not in self.fwd or (len(region) > 1 and key not in self.seg_extra):
                return False
        return True

    def keys(self, actions: Sequence[BlockAction]) -> tuple[list[str], list[Stretch], list[Stretch]]:
        """Forward kind, forward stretch and backward stretch of every block under `actions`."""
        kinds = fwd_kinds(actions)
        fwd = [self.fwd[k] for k in kinds]
        bwd: list[Stretch] = [None] * len(actions)  # type: ignore[list-item]
        for region in segments(actions):
            key = str(base_of(actions[region[0]]))
            n = len(region)
            if n == 1:
                bwd[region[0]] = self.bwd[key]
                continue
            for i in region[:-1]:
                bwd[i] = self.bwd[key + "|rest"]
            bwd[region[-1]] = self.bwd[key] + self.seg_extra[key].scaled(n - 1)
        return kinds, fwd, bwd

    def compose(self, actions: Sequence[BlockAction]) -> Composed:
        """The step's peak (and its breakdown) with `actions` on this profile's blocks."""
        if self.plain is not None and all(a.is_plain for a in actions):
            return self.plain.compose(actions)
        n = len(actions)
        start, seq = self._walk_seq(actions)
        best, best_j, block_peaks = walk(start, seq, n)
        return Composed(best, self._at(start, seq, best_j, n), block_peaks, _where(best_j, n))

    def at_optimizer(self, actions: Sequence[BlockAction]) -> Vec:
        """Bytes per category as the optimizer step begins (parameters, gradients and optimizer state
        then do not depend on the block actions or the micro-batch: the planner's lower bound)."""
        if self.plain is not None and all(a.is_plain for a in actions):
            return self.plain.at_optimizer(actions)
        start, seq = self._walk_seq(actions)
        return vsub(self._at(start, seq, len(seq) - 1, len(actions)), seq[-1].peak)

    def _walk_seq(self, actions: Sequence[BlockAction]) -> tuple[Vec, list[Stretch]]:
        """The step's start and its stretches in the order they run, for `actions`."""
        n = len(actions)
        kinds, fwd, bwd = self.keys(actions)
        f, b = self.first[kinds[0]]
        fwd[0], bwd[0] = fwd[0] + f, bwd[0] + b
        f, b = self.last[kinds[-1]]
        fwd[-1], bwd[-1] = fwd[-1] + f, bwd[-1] + b
        if self.first_ckpt is not None:
            i = next((j for j, a in enumerate(actions) if a.mode != "keep"), 0)
            if i > 0:
                fwd[i], bwd[i] = fwd[i] + self.first_ckpt[0], bwd[i] + self.first_ckpt[1]
        extra = n - self.traced_blocks
        start = vadd(self.start, vscale(self.start_per_block, extra))
        counts: dict[str, int] = {}
        for k in kinds:
            counts[k] = counts.get(k, 0) + 1
        fa, la = self.first_around.get(kinds[0]), self.last_around.get(kinds[-1])
        seq = [self._part("pre_fwd", extra, counts, fa, la), *fwd, self._part("post_fwd", extra, counts, fa, la),
               self._part("post_bwd", extra, counts, fa, la), *bwd[::-1],
               self._part("pre_bwd", extra, counts, fa, la), self._part("opt", extra, counts, fa, la)]
        return start, seq

    def _part(self, name: str, extra: int, counts: dict[str, int], fa: dict | None = None,
              la: dict | None = None) -> Stretch:
        """A stretch around the blocks for this chain length, less the deferred frees of its blocks'
        kinds, plus what the end blocks' kinds change in it."""
        s = getattr(self, name) + self.per_block[name].scaled(extra)
        for corr in (fa, la):
            if corr and name in corr:
                s = s + corr[name]
        d = self.deferred.get(name)
        if d:
            freed = ZERO
            for k, c in counts.items():
                if k in d:
                    freed = vadd(freed, vscale(d[k], c))
            s = s.with_net(vsub(s.net, freed))
        return s

    def _at(self, start: Vec, seq: list[Stretch], upto: int, n: int) -> Vec:
        """Bytes per category at the peak inside stretch `upto` (-1: the step's start)."""
        cur = start
        for j in range(upto):
            cur = vadd(cur, seq[j].net)
            if j == n + 1:  # backward starts: the tracker relabels (see timeline.StepStretches)
                cur = cur[:3] + (cur[3] + cur[4] - self.bw_temps, self.bw_temps)
        return cur if upto < 0 else vadd(cur, seq[upto].peak)

    def moments(self, actions: Sequence[BlockAction], busy: bool = False) -> dict[str, Vec]:
        """Bytes per category at each stretch's highest point (`busy`: its Stretch.busy point), by the
        stretch's name (a block's forward and backward both under "block i": the higher of the two)."""
        if self.plain is not None and all(a.is_plain for a in actions):
            return self.plain.moments(actions, busy)
        n = len(actions)
        start, seq = self._walk_seq(actions)
        out: dict[str, Vec] = {}
        cur, rank = start, (lambda v: v[3] + v[4]) if busy else sum
        for j, st in enumerate(seq):
            at = vadd(cur, st.busy if busy else st.peak)
            name = _where(j, n).replace(" forward", "").replace(" backward", "") if 0 < j <= n or n + 2 < j < 2 * n + 3 \
                else _where(j, n)
            if name not in out or rank(at) > rank(out[name]):
                out[name] = at
            cur = vadd(cur, st.net)
            if j == n + 1:  # backward starts: the tracker relabels (see timeline.StepStretches)
                cur = cur[:3] + (cur[3] + cur[4] - self.bw_temps, self.bw_temps)
        return out

    def saved(self, actions: Sequence[BlockAction]) -> tuple[int, list[int], int]:
        """Activation bytes each part of the forward leaves for backward under `actions`: before the
        blocks (embeddings), each block, and after them (final norm, head, loss)."""
        n = len(actions)
        _, seq = self._walk_seq(actions)
        return seq[0].net[3], [seq[1 + i].net[3] for i in range(n)], seq[n + 1].net[3]

    def peak_of(self, actions: Sequence[BlockAction]) -> int:
        return self.compose(actions).peak


def _where(j: int, n: int) -> str:
    """The name of stretch j of the walk in ChainProfile.compose."""
    if j < 0:
        return "step start"
    if 0 < j <= n:
        return f"block {j - 1} forward"
    if n + 2 < j < 2 * n + 3:
        return f"block {2 * n + 2 - j} backward"
    return {0: "before the blocks", n + 1: "head and loss", n + 2: "head backward",
            2 * n + 3: "backward before the blocks", 2 * n + 4: "optimizer step"}[j]


def _without_deferred(st: StepStretches, kinds: list[str]) -> tuple[dict[str, Stretch], dict[str, dict[str, Vec]]]:
    """The stretches around the blocks with the middle blocks' deferred frees added back, and those
    frees per forward kind. The first and last block's frees beyond their kind's (the last block's
    output, freed by the head's backward) belong to the position and stay in the stretch."""
    parts, per_kind = {}, {}
    last = len(kinds) - 1
    for name in AROUND:
        s = getattr(st, name)
        d = st.deferred.get(name, {})
        kd: dict[str, Vec] = {}
        for i, v in sorted(d.items()):
            if 0 < i < last:
                kd.setdefault(kinds[i], v)
        back = ZERO
        for i, v in d.items():
            back = vadd(back, v if 0 < i < last else kd.get(kinds[i], ZERO))
        parts[name] = s.with_net(vadd(s.net, back))
        per_kind[name] = kd
    return parts, per_kind


def _parse_key(key: str) -> BlockAction:
    from memfit.apply.policy import parse_items

    return parse_items(key)[0]


def pattern_for(bases: Sequence[BlockAction], with_segments: bool = True) -> list[BlockAction]:
    """One block per action, plus a two-block segment per recompute action (to see what each added
    block of a segment costs)."""
    out: list[BlockAction] = []
    seg = 0
    for b in bases:
        out.append(b)
        if b.mode == "recompute" and with_segments:
            out += [replace(b, segment=seg)] * 2
            seg += 1
    return out


def _tracker_factory(holder: dict) -> Callable[..., TimelineTracker]:
    def make(model: nn.Module, opt: Any, dev: Any) -> TimelineTracker:
        from memfit.apply.checkpoint import find_blocks

        blocks = find_blocks(model)
        ids = {id(b): i for i, b in enumerate(blocks)}
        names = {name: ids[id(m)] for name, m in model.named_modules() if id(m) in ids}
        t = TimelineTracker(model, opt, dev, names)
        holder["t"] = t
        return t

    return make


def _trace(build_k: Callable[[int], nn.Module], k: int, step, pattern, precision, optimizer, device,
           sib: bool = False, update: bool = True) -> StepStretches:
    from memfit.measure.anymodel import run_steps
    from memfit.measure.fake_mode import fake_mode

    holder, update = {}, update or sib  # (update=False: see run_steps; an update in backward is in the blocks')
    with fake_mode():
        run_steps(lambda: build_k(k), step, precision, optimizer, list(pattern), device,
                  tracker=_tracker_factory(holder), step_in_backward=sib, update=update)
    return stretches(holder["t"], k, update)


def profile_chain(build_k: Callable[[int], nn.Module], n_blocks: int, step, precision: str, optimizer: str,
                  device: str = "cpu", bases: Sequence[BlockAction] = BASE_ACTIONS,
                  with_segments: bool = True, plain_differs: bool = False,
                  ends: tuple[list[BlockAction], list[BlockAction]] | None = None,
                  step_in_backward: bool = False) -> ChainProfile:
    """Trace a short chain covering `bases` (and one block more) and reduce it to a ChainProfile.

    build_k(k) builds the model with k repeated blocks (inside FakeTensorMode). `ends`: the first and
    last region of the one action list to be composed (then only those end positions are measured, in
    the same traces); without it every base is measured at both ends (for the planner).
    step_in_backward: the optimizer updates each parameter in backward (its stretch is then in the
    block's backward; the optimizer stretch at the end holds nothing left to update)."""
    t0 = time.perf_counter()
    keep = BlockAction("keep")
    plain = None
    if plain_differs and any(not b.is_plain for b in bases):
        plain = profile_chain(build_k, n_blocks, step, precision, optimizer, device, [keep], False,
                              step_in_backward=step_in_backward)
    if keep not in bases and ends is None:
        bases = [keep, *bases]
    # The kinds sit between two end blocks: the first and last block of a chain differ a little
    # (what the embedding hands over, what the head takes), which the end blocks measure.
    head, tail = ends if ends is not None else ([keep], [keep])
    head = [replace(a, segment=1000) if a.segment is not None else a for a in head]
    tail = [replace(a, segment=1001) if a.segment is not None else a for a in tail]
    # After a kept first block, one checkpointed block more: the lowest checkpointed block frees what
    # all of them captured (measured here once), so the kinds after it are measured without it.
    ckpt = next((replace(b, segment=None) for b in bases if b.mode != "keep"), None)
    lead = [ckpt] if ckpt is not None and head[0].mode == "keep" else []
    pattern = head + lead + pattern_for(bases, with_segments) + tail
    k = len(pattern)
    a = _trace(build_k, k, step, pattern, precision, optimizer, device, step_in_backward)
    more = pattern + pattern[-1:]
    b = _trace(build_k, k + 1, step, more, precision, optimizer, device, step_in_backward)
    fwd: dict[str, Stretch] = {}
    bwd: dict[str, Stretch] = {}
    seg_extra: dict[str, Stretch] = {}
    for region in segments(pattern)[1 + len(lead):-1]:
        key = str(base_of(pattern[region[0]]))
        if len(region) == 1:
            fwd[key], bwd[key] = a.fwd[region[0]], a.bwd[region[0]]
        else:
            fwd[key + "|first"], fwd[key + "|rest"] = a.fwd[region[0]], a.fwd[region[1]]
            bwd[key + "|rest"] = a.bwd[region[0]]
            seg_extra[key] = a.bwd[region[1]] - a.bwd[region[0] - 1]  # the single-block stretch precedes it
    first_ckpt = None
    if lead:
        i = len(head)
        first_ckpt = (a.fwd[i] - fwd[str(ckpt)], a.bwd[i] - bwd[str(ckpt)])
    pa, deferred = _without_deferred(a, fwd_kinds(pattern))
    pb, _ = _without_deferred(b, fwd_kinds(more))
    per_block = {p: pb[p] - pa[p] for p in AROUND}
    fa: dict = {}
    la: dict = {}
    if ends is None:
        ctx = dict(fwd=fwd, bwd=bwd, seg_extra=seg_extra, parts=pa, per_block=per_block, deferred=deferred, traced=k)
        trace = lambda p: _trace(build_k, len(p), step, p, precision, optimizer, device, step_in_backward)  # noqa: E731
        first, last, fa, la = end_corrections(trace, bases, with_segments, ctx, a)
    else:
        first, last = own_end_corrections(pattern, a, fwd, bwd, seg_extra, len(head), len(tail))
    return ChainProfile(
        n_blocks=n_blocks, start=a.start, start_per_block=vsub(b.start, a.start), **pa,
        per_block=per_block, deferred=deferred, fwd=fwd, bwd=bwd, seg_extra=seg_extra, traced_blocks=k,
        first=first, last=last, first_around=fa, last_around=la, first_ckpt=first_ckpt, bw_temps=a.bw_temps, plain=plain,
        seconds=time.perf_counter() - t0, grad_bytes=_block_grad_bytes(build_k, precision) if step_in_backward else None,
        block_params=_block_params(build_k),
    )


def _block_params(build_k: Callable[[int], nn.Module]) -> int:
    """Elements of one repeated block's parameters, trainable or not (an NF4 weight counts its logical shape)."""
    from memfit.apply.checkpoint import find_blocks
    from memfit.measure.fake_mode import fake_mode

    with fake_mode():
        return sum(p.numel() for p in find_blocks(build_k(1))[0].parameters())


def _block_grad_bytes(build_k: Callable[[int], nn.Module], precision: str) -> int:
    """Bytes of one repeated block's gradients (its trainable parameters, cast as the optimizer casts them)."""
    from memfit.apply.checkpoint import find_blocks
    from memfit.apply.precision import cast_model, precision_mode
    from memfit.measure.fake_mode import fake_mode

    with fake_mode():
        model = build_k(1)
        cast_model(model, precision_mode(precision))
        return sum(p.numel() * p.element_size() for p in find_blocks(model)[0].parameters() if p.requires_grad)
