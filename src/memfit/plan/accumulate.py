"""Gradient accumulation in the composed estimate: the profile of a later micro-batch.

A step of k micro-batches runs k forward/backward passes and one optimizer update. The first pass is
the one-micro-batch step without its update. From the second on, the gradients of the earlier passes
are held from the pass's start, and each gradient backward makes is a temporary added into the held
one (autograd accumulates in place), so at every moment of a later pass the device holds what the
first pass held at that moment plus the gradients the first pass had not yet made. The update then
starts from the same state as a one-micro-batch step's.

`accumulating(prof, extra)` is that later pass as a ChainProfile (or DiskProfile) the solver and
`compose` take unchanged: the gradients at the optimizer step are moved into the start, and every
stretch before the update keeps its peak but makes no gradient bytes (net). Its peaks are an upper
bound that is exact when a stretch's gradients appear at its end; a trace of two micro-batches checks
the chosen plan (memfit.plan.loop_step). `extra` adds bytes held through the step, e.g. the step's
other micro-batches that memfit train moves to the device with the first.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from memfit.apply.policy import BlockAction
from memfit.measure.compose import ChainProfile
from memfit.measure.timeline import Stretch, Vec

GRADS = 1
"""The gradients' index in a profile's category vectors (core.tracker.CATEGORIES order)."""
TEMPORARIES = 4
UPDATE = "opt"
"""The stretch that is the optimizer update: run once per step, after the last micro-batch."""


def _no_grads(v: Vec) -> Vec:
    return v[:GRADS] + (0,) + v[GRADS + 1:]


def _pass(s: Stretch) -> Stretch:
    """A stretch as a later micro-batch runs it: the same excursion, no gradient bytes made."""
    return Stretch(s.peak, _no_grads(s.net))


def _pairs(d: dict) -> dict:
    return {k: (_pass(f), _pass(b)) for k, (f, b) in d.items()}


def _around(d: dict) -> dict:
    return {k: {name: s if name == UPDATE else _pass(s) for name, s in parts.items()} for k, parts in d.items()}


def held_grads(prof: ChainProfile, n: int) -> int:
    """Gradient bytes made by one pass of `n` blocks (at the optimizer step, less any at the start)."""
    keep = [BlockAction("keep")] * n
    start = prof.start[GRADS] + (n - prof.traced_blocks) * prof.start_per_block[GRADS]
    return prof.at_optimizer(keep)[GRADS] - start


def accumulating(prof: Any, extra: int = 0) -> Any:
    """The profile of a later micro-batch of an accumulating step (see the module doc); `prof` itself
    stays as `per_micro` (the time model reads a block's gradient bytes from it)."""
    if vars(prof).get("per_micro") is not None:
        return prof  # already a later micro-batch's (a DiskProfile's base answers for itself)
    from memfit.plan.disk_profile import DiskProfile

    if isinstance(prof, DiskProfile):
        out = replace(prof, base=accumulating(prof.base, extra), fwd={k: _pass(s) for k, s in prof.fwd.items()},
                      bwd={k: _pass(s) for k, s in prof.bwd.items()}, first=_pairs(prof.first),
                      last=_pairs(prof.last), first_around=_around(prof.first_around),
                      last_around=_around(prof.last_around))
        out.per_micro = prof
        return out
    k = prof.traced_blocks
    g_k, g_more = held_grads(prof, k), held_grads(prof, k + 1)
    start = list(prof.start)
    start[GRADS] += g_k
    start[TEMPORARIES] += extra
    per_block = list(prof.start_per_block)
    per_block[GRADS] += g_more - g_k
    out = replace(
        prof, start=tuple(start), start_per_block=tuple(per_block),
        pre_fwd=_pass(prof.pre_fwd), post_fwd=_pass(prof.post_fwd), post_bwd=_pass(prof.post_bwd),
        pre_bwd=_pass(prof.pre_bwd),
        per_block={name: s if name == UPDATE else _pass(s) for name, s in prof.per_block.items()},
        fwd={key: _pass(s) for key, s in prof.fwd.items()}, bwd={key: _pass(s) for key, s in prof.bwd.items()},
        seg_extra={key: _pass(s) for key, s in prof.seg_extra.items()},
        deferred={name: d if name == UPDATE else {kind: _no_grads(v) for kind, v in d.items()}
                  for name, d in prof.deferred.items()},
        first=_pairs(prof.first), last=_pairs(prof.last),
        first_around=_around(prof.first_around), last_around=_around(prof.last_around),
        first_ckpt=None if prof.first_ckpt is None else (_pass(prof.first_ckpt[0]), _pass(prof.first_ckpt[1])),
        plain=None if prof.plain is None else accumulating(prof.plain, extra))
    out.per_micro = prof
    if getattr(prof, "unchunked", None) is not None:
        out.unchunked = prof.unchunked
    return out
