"""The end corrections of a chain profile: how the first and last block of a chain differ from a middle one.

The first block gets the embedding's output, the last block's output goes to the head, and the lowest
checkpointed block's backward frees what every checkpointed block captured from the model. Each kind
is traced at both ends of a short chain [kind, keep, kind]; what its stretches differ by from the
middle-block figures is the kind's end correction. The stretches around the blocks change too (with
a checkpointed first block in bf16, the head holds one hidden state more): what they differ by from
the main trace's (kept ends), net of the per-kind deferred frees, is split between the two ends by a
third chain [kind, keep, keep] with the kind first only.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from memfit.apply.policy import BlockAction, segments
from memfit.measure.timeline import ZERO, Stretch, StepStretches, vadd, vscale, vsub


def base_of(a: BlockAction) -> BlockAction:
    return replace(a, segment=None)


def fwd_kinds(actions: Sequence[BlockAction]) -> list[str]:
    kinds: list[str] = [""] * len(actions)
    for region in segments(actions):
        key = str(base_of(actions[region[0]]))
        if len(region) == 1:
            kinds[region[0]] = key
        else:
            kinds[region[0]] = key + "|first"
            for i in region[1:]:
                kinds[i] = key + "|rest"
    return kinds


BEFORE = ("pre_fwd", "pre_bwd")
AROUND = ("pre_fwd", "post_fwd", "post_bwd", "pre_bwd", "opt")


def end_corrections(trace: Callable[[list[BlockAction]], StepStretches], bases, with_segments: bool,
                    ctx: dict[str, Any], a: StepStretches) -> tuple[dict, dict, dict, dict]:
    """first, last (per kind: forward and backward stretch differences) and first_around, last_around
    (per kind: differences of the stretches around the blocks). `ctx` holds the profile's fwd, bwd,
    seg_extra, around parts, per-block slope, per-kind deferred frees and traced length."""
    fwd, bwd, seg_extra = ctx["fwd"], ctx["bwd"], ctx["seg_extra"]
    first = {"keep": (a.fwd[0] - fwd["keep"], a.bwd[0] - bwd["keep"])}
    last = {"keep": (a.fwd[-1] - fwd["keep"], a.bwd[-1] - bwd["keep"])}
    fa: dict[str, dict[str, Stretch]] = {}
    la: dict[str, dict[str, Stretch]] = {}
    keep = BlockAction("keep")
    for b in bases:
        if b == keep:
            continue
        ends = [[b]]
        if b.mode == "recompute" and with_segments:
            ends.append([replace(b, segment=0)] * 2)
        for end in ends:
            tail = [replace(x, segment=1) if x.segment is not None else x for x in end]
            pattern = end + [keep] + tail
            t = trace(pattern)
            kinds = fwd_kinds(pattern)
            kf, kl = kinds[0], kinds[-1]
            key = str(b)
            bw_first = bwd[key] if len(end) == 1 else bwd[key + "|rest"]
            bw_last = bwd[key] if len(end) == 1 else bwd[key] + seg_extra[key]
            first[kf] = (t.fwd[0] - fwd[kf], t.bwd[0] - bw_first)
            last[kl] = (t.fwd[-1] - fwd[kl], t.bwd[-1] - bw_last)
            # Around the blocks, a first block's kind may change the head's stretches too (and a last
            # one's the embedding's): the same kind first in front of kept blocks separates the two.
            lone = end + [keep, keep]
            fa[kf] = _merged(*around_corrections(trace(lone), fwd_kinds(lone), a, ctx))
            both = _merged(*around_corrections(t, kinds, a, ctx))
            la[kl] = {n: s for n in AROUND if (s := both.get(n, NONE) - fa[kf].get(n, NONE)) != NONE}
    return first, last, fa, la


NONE = Stretch(ZERO, ZERO)


def _merged(x: dict[str, Stretch], y: dict[str, Stretch]) -> dict[str, Stretch]:
    return {n: x.get(n, NONE) + y.get(n, NONE) for n in AROUND if n in x or n in y}


def around_corrections(t: StepStretches, kinds: list[str], a: StepStretches,
                       ctx: dict[str, Any]) -> tuple[dict[str, Stretch], dict[str, Stretch]]:
    """What trace t's stretches around the blocks differ by from the composition with kept ends, split
    between its first and its last block's kind."""
    parts, slope, deferred, k = ctx["parts"], ctx["per_block"], ctx["deferred"], ctx["traced"]
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    last = len(kinds) - 1
    fa: dict[str, Stretch] = {}
    la: dict[str, Stretch] = {}
    for name in AROUND:
        d = deferred.get(name, {})
        freed = ZERO
        for kind, c in counts.items():
            freed = vadd(freed, vscale(d.get(kind, ZERO), c))
        exp = parts[name] + slope[name].scaled(len(kinds) - k)
        exp = exp.with_net(vsub(exp.net, freed))
        diff = getattr(t, name) - exp
        # Frees of what an end block made: in the composition they are its kind's typical frees plus
        # the kept end's own (in `parts`); here they are this end block's.
        ends = []
        for i in (0, last):
            own = t.deferred.get(name, {}).get(i, ZERO)
            kept = a.deferred.get(name, {}).get(0 if i == 0 else len(a.fwd) - 1, ZERO)
            typical = vsub(d.get(kinds[i], ZERO), d.get("keep", ZERO))
            ends.append(Stretch(ZERO, vadd(vsub(kept, own), typical)))
        rest = diff - ends[0] - ends[1]
        f, l = (rest + ends[0], ends[1]) if name in BEFORE else (ends[0], rest + ends[1])
        if f != Stretch(ZERO, ZERO):
            fa[name] = f
        if l != Stretch(ZERO, ZERO):
            la[name] = l
    return fa, la


def own_end_corrections(pattern, a: StepStretches, fwd, bwd, seg_extra, n_head: int, n_tail: int) -> tuple[dict, dict]:
    """First and last corrections when the main trace's ends are the composed list's own end regions."""
    kinds = fwd_kinds(pattern)
    key_h, key_t = str(base_of(pattern[0])), str(base_of(pattern[-1]))
    bw_first = bwd[key_h] if n_head == 1 else bwd[key_h + "|rest"]
    bw_last = bwd[key_t] if n_tail == 1 else bwd[key_t] + seg_extra[key_t].scaled(n_tail - 1)
    first = {kinds[0]: (a.fwd[0] - fwd[kinds[0]], a.bwd[0] - bw_first)}
    last = {kinds[-1]: (a.fwd[-1] - fwd[kinds[-1]], a.bwd[-1] - bw_last)}
    return first, last
