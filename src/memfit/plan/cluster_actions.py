"""Per-block actions on one rank: how many of its identical blocks to keep, recompute selectively or
recompute in full, for the least extra time within the bytes left for activations.

    counts(blocks=20, room=30e9, keep=2e9, selective=6e8, recompute=7e7, working=2e9,
           t_recompute=1.0, t_selective=0.15, allowed=("recompute", "selective"))  -> (8, 12, 0)

The blocks of a rank are identical, so a plan is three counts, and the bytes are linear in them
(memfit.plan.cluster_memory): for each number of recomputed blocks the fewest selective ones that
fit follow in closed form, so the exact optimum is one pass over the block count. `working`: the
bytes of one block's forward rerun in backward, held once any block is not kept.
"""
from __future__ import annotations

import math


def counts(blocks: int, room: float, keep: float, selective: float, recompute: float, working: float,
           t_recompute: float, t_selective: float, allowed: tuple[str, ...]) -> tuple[int, int, int] | None:
    """(keep, selective, recompute) with the least t_recompute x rec + t_selective x sel, or None."""
    if blocks * keep <= room:
        return blocks, 0, 0
    room -= working
    best = None
    top = blocks if "recompute" in allowed else 0
    for rec in range(top + 1):
        left = blocks - rec
        need = left * keep + rec * recompute - room  # bytes still to save by selective blocks
        if need <= 0:
            sel = 0
        elif "selective" in allowed and keep > selective:
            sel = math.ceil(need / (keep - selective))
            if sel > left:
                continue
        else:
            continue
        t = rec * t_recompute + sel * t_selective
        if best is None or t < best[0]:
            best = (t, (left - sel, sel, rec))
    return None if best is None else best[1]


def uniform(blocks: int, room: float, bytes_of: dict, working: float, allowed: tuple[str, ...]) -> tuple | None:
    """The cheapest single action for every block that fits (a pipeline plan's stages run one action)."""
    for name, i in (("keep", 0), ("selective", 1), ("recompute", 2)):
        if name != "keep" and name not in allowed:
            continue
        extra = 0 if name == "keep" else working
        if blocks * bytes_of[name] + extra <= room:
            out = [0, 0, 0]
            out[i] = blocks
            return tuple(out)
    return None
