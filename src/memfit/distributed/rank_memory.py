"""Each rank's model-state bytes under a strategy, from the same flat layout the strategies use.

    rank_model_state(model, "zero3", world=2, precision="32-true", optimizer="adamw")
    -> [{"rank": 0, "params": ..., "grads": ..., "optimizer": ..., "gathered": ..., "in_flight": ...}, ...]

Figures are the bytes held at the step's peak (plain data, so a planner can rank strategies):

    params     ddp/ps/zero1/zero2: every weight. zero3: the rank's slices, plus `gathered`: the rest
               (embeddings, head, norms: held from forward to their backward) and two blocks (the
               running one and the prefetched one).
    grads      ddp/ps/zero1: every gradient (zero1: from backward to the step). zero2/zero3: the
               rank's slices (they exist from their bucket's first reduce-scatter to the step).
    in_flight  zero*: one bucket's flat copy of its full gradients for the reduce-scatter (a block
               in zero2/3, during backward; the largest bucket in zero1, at the step).
    optimizer  ddp, and ps's rank 0: all the state; ps's other ranks none; zero*: the rank's slices'
               state (master weights included in -master modes), plus torch's per-tensor step counters.
    post_forward zero3 rows may carry it (0 when absent): the bytes of one block's weights that stay
               after its forward until its backward, beyond the rank's slice (torch FSDP2's
               reshard_after_forward False: the whole block, with `kept_whole`; an int N: its 1/N
               shard; memfit.measure.fsdp2_estimate sets them).
    head_grads zero2/zero3: gradients of the rest bucket that exist when the last block's bucket is
               reduce-scattered (final norm and head; a tied embedding's pending head contribution).
    grad_per_token  bytes per token of the gradient that flows between blocks (hidden x weight bytes).
    embeddings names of the embedding modules (their saved inputs live until the end of backward).

The model may live on the meta device (nothing is allocated). Ranks differ only for ps.
"""
from __future__ import annotations

import re

import torch.nn as nn

from memfit.apply.precision import precision_mode
from memfit.core.errors import ConfigError
from memfit.distributed.layout import FlatLayout

_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
_STEP_COUNTER = {"adam", "adamw"}


def rank_model_state(model: nn.Module, strategy: str, world: int, precision: str = "32-true",
                     optimizer: str = "adamw", engine: str = "memfit") -> list[dict]:
    from memfit.distributed.strategy import check_strategy

    check_strategy(strategy)
    if engine == "zero-redundancy":
        return _zero_redundancy(model, strategy, world, precision, optimizer)
    mode = precision_mode(precision)
    w = mode.param_dtype.itemsize if hasattr(mode.param_dtype, "itemsize") else 4
    state_bytes = mode.state_dtype.itemsize * _STATES.get(optimizer.lower(), 2)
    per_elem_opt = state_bytes + (4 if mode.master_dtype is not None else 0)
    layout = FlatLayout(model, world if strategy.startswith("zero") else 1)
    full = layout.numel
    counters = 4 if optimizer.lower() in _STEP_COUNTER else 0
    # step counters: one per flat bucket in memfit's engine, one per parameter under FSDP2
    per_bucket = strategy.startswith("zero") and engine != "fsdp2"
    tensors = len(layout.buckets) if per_bucket else sum(len(b.params) for b in layout.buckets)
    blocks = [b.padded for b in layout.buckets if b.block is not None]
    rest = layout.rest.padded if layout.rest is not None else 0
    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    head_grads = 0
    if strategy in ("zero2", "zero3") and layout.rest is not None:
        linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        lookup = {id(m.weight) for m in embeddings.values()}
        head_grads = w * sum(p.numel() for p in layout.rest.params if id(p) not in lookup or id(p) in linear)
    hidden = max((m.embedding_dim for m in embeddings.values()), default=0)
    out = []
    for rank in range(world):
        row = {"rank": rank, "strategy": strategy, "world": world, "gathered": 0, "in_flight": 0, "full_grads": w * full,
               "head_grads": head_grads, "grad_per_token": w * hidden, "embeddings": sorted(embeddings)}
        if engine != "memfit":
            row["engine"] = engine
        if strategy.startswith("zero"):
            stage, shard = int(strategy[-1]), layout.shard_numel
            row["params"] = w * (shard if stage == 3 else sum(b.padded for b in layout.buckets))
            if stage == 3:
                row["gathered"] = w * (rest + sum(sorted(blocks)[-2:]))
                row["rest"] = w * rest  # gathered alone between the blocks (the head and loss)
                row["one_block"], row["n_blocks"] = w * max(blocks or [0]), len(blocks)
            row["grads"] = w * (shard if stage >= 2 else sum(b.padded for b in layout.buckets))
            row["blocks_n"] = len(blocks)  # (buckets of blocks are reduced from the last one down)
            # the bucket whose full gradients are copied into a flat buffer for the collective
            row["in_flight"] = w * (max(blocks or [0]) if stage >= 2 else max(b.padded for b in layout.buckets))
            # the flat buffer the last reduce-scatter of a micro-batch leaves (the rest's: the
            # embeddings' gradients come last), kept into the next micro-batch
            row["spare"] = w * (rest or max(blocks or [0]))
            row["optimizer"] = per_elem_opt * shard + counters * tensors
        else:
            holds = strategy == "ddp" or rank == 0
            row["params"], row["grads"] = w * full, w * full
            row["optimizer"] = (per_elem_opt * full + counters * tensors) if holds else 0
        out.append(row)
    return out


def _zero_redundancy(model: nn.Module, strategy: str, world: int, precision: str, optimizer: str) -> list[dict]:
    """zero1 on DDP with torch's ZeroRedundancyOptimizer: DDP's rows (every weight, every gradient in
    DDP's buckets), each rank's optimizer state that of the whole tensors torch assigns it
    (memfit.distributed.zero_redundancy.assignment), step counters included."""
    from memfit.distributed.zero_redundancy import assignment

    if strategy != "zero1":
        raise ConfigError(f"the zero-redundancy engine carries out zero1, not {strategy}")
    rows = rank_model_state(model, "ddp", world, precision, optimizer)
    mode = precision_mode(precision)
    if mode.master_dtype is not None:
        raise ConfigError(f"precision {precision!r} on the zero-redundancy engine: it keeps no master copy; "
                          "use 32-true, bf16-mixed or bf16-true, or the memfit engine")
    per_elem = mode.state_dtype.itemsize * _STATES.get(optimizer.lower(), 2)
    counters = 4 if optimizer.lower() in _STEP_COUNTER else 0
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    owner = assignment(sizes, world)
    for r in rows:
        mine = [n for n, o in zip(sizes, owner) if o == r["rank"]]
        r.update(strategy=strategy, runs_as="ddp", engine="zero-redundancy",
                 optimizer=per_elem * sum(mine) + counters * len(mine), owned_tensors=len(mine))
    return rows


_BLOCK = re.compile(r"(?:[A-Za-z_][\w.]*\.)?\d+")
"""A repeated block's name in module_activations: a ModuleList's child (blocks.3, model.layers.3)."""


BUSIEST = "(most activations and temporaries)"
"""The one-device moment a module ran with the most activations + temporaries (memfit.measure.trace)."""


def busiest_name(mods: tuple[str, ...]) -> str:
    """That moment's name among a trace's moments: inside a repeated block its name under the block's
    (so that rank_totals places it in that block), else BUSIEST alone (between the blocks)."""
    block = min((m for m in mods if _BLOCK.fullmatch(m)), key=len, default=None)
    return f"{block}.{BUSIEST}" if block is not None else BUSIEST


RANK_CATEGORIES = ("params", "gathered", "grads", "in_flight", "optimizer", "activations", "temporaries")
"""A rank's figures at its peak moment; they add up to its total."""


def rank_totals(rows: list[dict], one_device: dict[str, int], saved: dict[str, int] | None = None,
                tokens: int = 0, peak_block: int | None = -1, moments: dict[str, dict] | None = None,
                accum: int = 1) -> list[dict]:
    """Each rank's step peak from its model states and a one-device trace of the per-rank micro-batch
    (`one_device`: memfit.estimate(..., batch=B).per_device, categories and "total", at the peak;
    `moments`: the same at each module's highest moment and at BUSIEST; `saved`: bytes saved for
    backward per module; `tokens`: batch x seq per rank; `peak_block`: the block the one-device peak is
    in, -1 for one not known, None for none).

    Every one-device moment is turned into the rank's (its model states in place of the whole
    model's), and a few moments only a strategy has are added; the peak is the highest, and the
    row's categories are that moment's (they add up to its total).

    ddp holds its gradient buckets (the gradients, gradient_as_bucket_view) from the first backward
    on; ps holds the gradients as one process does, its optimizer state on rank 0 only. zero1: the
    gradients as one process, then the step (every gradient and the flat buffer of the bucket being
    reduce-scattered). zero2/3: the slices of the buckets reduced so far (in proportion to the
    gradients one process has made) and at most one bucket of full gradients; zero3 gathers two
    blocks' weights inside a block and its rest alone between them. They add the last block's
    backward beginning (everything saved but the head's, two blocks gathered), the first bucket's
    reduce-scatter (what is still saved is the other blocks' and the embeddings'; the bucket's
    gradients and their flat copy, 2 x `in_flight`; the head's gradients, `head_grads`; the gradient
    flowing into the next block, tokens x `grad_per_token`, a temporary) and the step.

    With `accum` > 1 micro-batches per step, every forward and backward moment recurs in a later
    micro-batch beside the gradients of the earlier ones: the whole gradients (ddp, ps, zero1: autograd
    accumulates in place) or, under zero2/3, the rank's reduced slices of every bucket plus the flat
    buffer the last reduce-scatter left (kept for the next bucket: `spare`)."""
    saved = saved or {}
    blocks = [v for k, v in saved.items() if _BLOCK.fullmatch(k)]
    root = max(saved, key=saved.get, default=None)  # the model itself saves the most
    # a module whose highest moment is the step's peak shares it: the peak is placed once (peak_block)
    same = {c: one_device[c] for c in ("params", "grads", "optimizer", "activations", "temporaries")}
    cands = [(one_device, peak_block)] + [(m, _block_index(k)) for k, m in (moments or {}).items()
                                          if {c: m[c] for c in same} != same]
    out = []
    for r in rows:
        held = dict(params=r["params"], gathered=r["gathered"], optimizer=r["optimizer"])
        zero = r.get("runs_as", r["strategy"]).startswith("zero")
        full = r["full_grads"]
        moments_r = [_moment(r, held, m, inside, full) for m, inside in cands if m["grads"] < full]
        steps = [_moment(r, held, m, inside, full) for m, inside in cands if m["grads"] >= full]
        if r.get("runs_as", r["strategy"]) == "zero1":
            steps.append(dict(held, grads=r["grads"], in_flight=r["in_flight"]))
        elif zero:
            before = (sum(blocks) - max(blocks) + sum(saved.get(e, 0) for e in r["embeddings"]) if blocks
                      else one_device["activations"])  # no per-block figures: everything saved stays
            # the last block's backward (its reduce-scatter; the block before it prefetched): the blocks
            # before those two still hold what their forward left (post_forward)
            kept = dict(held, gathered=held["gathered"] + _held_blocks(r, r.get("n_blocks", 2) - 2))
            moments_r.append(dict(kept, grads=r["head_grads"], in_flight=2 * r["in_flight"], activations=before,
                                  temporaries=tokens * r["grad_per_token"]))
            steps.append(dict(held, grads=r["grads"]))
            if blocks and root is not None:  # the head's backward done, the last block's beginning
                # (the head's temporaries, the logits and their gradient, are gone: what flows is the
                # gradient into the block)
                head = saved[root] - sum(blocks) - sum(saved.get(e, 0) for e in r["embeddings"])
                moments_r.append(dict(kept, grads=r["head_grads"], activations=saved[root] - head,
                                      temporaries=tokens * r["grad_per_token"]))
        if accum > 1:
            moments_r += [_later(r, m) for m in moments_r]
        cats = max((_filled(m) for m in moments_r + steps), key=lambda m: m["total"])
        # each module's peak on this rank (the module table), from its one-device moment
        modules = {k: _filled(_moment(r, held, m, _block_index(k), full))["total"] for k, m in (moments or {}).items()
                   if not k.endswith(BUSIEST)}
        out.append({**r, **cats, "modules": modules})
    return out


_IN_BLOCK = re.compile(r"(?:[A-Za-z_][\w.]*\.)?(\d+)(?:\..*)?")
"""A module inside a repeated block (blocks.3, blocks.3.mlp, model.layers.3.self_attn)."""


def _block_index(name: str) -> int | None:
    m = _IN_BLOCK.fullmatch(name)
    return int(m.group(1)) if m else None


def _moment(r: dict, held: dict, m: dict, block: int | None, full: int) -> dict:
    """One-device moment `m` on rank `r` (`full`: one process's whole gradient bytes; `block`: the
    index of the block it is in, -1 for one not known, None between blocks)."""
    out = dict(held, activations=m["activations"], temporaries=m["temporaries"], grads=m["grads"])
    s = r.get("runs_as", r["strategy"])
    if s == "ddp" and m["grads"]:
        out["grads"] = max(m["grads"], r["grads"])  # the buckets exist from the first backward on
    elif s == "ddp":
        out["grads"] = r["grads"]  # ... and live between steps
    elif s in ("zero2", "zero3"):
        done = m["grads"] >= full  # the step: every bucket reduced
        out["grads"] = r["grads"] if done else round(r["grads"] * m["grads"] / full) if full else 0
        out["in_flight"] = 0 if done else min(m["grads"], r["in_flight"])
        # inside block i's backward the later blocks' buckets are reduced to slices; what else one
        # process holds (block i's gradients so far, the rest's: head, final norm) is not reduced yet
        later = r.get("blocks_n", 0) - 1 - block if block is not None and block >= 0 else -1
        if not done and m["grads"] and later >= 0 and m["grads"] >= later * r["in_flight"]:
            # (r["grads"] 0: optimizer offload, the slices go to the host as they are reduced)
            out["grads"] = min(r["grads"], later * (r["in_flight"] // r["world"]))
            out["in_flight"] = m["grads"] - later * r["in_flight"]
            if later:  # the flat buffer of the last reduce-scatter is kept for the next bucket
                out["in_flight"] += r["in_flight"]
                out["spare_kept"] = True
        if s == "zero3" and "rest" in r:
            # the running block and the prefetched next one, except where there is no next: the
            # first block's backward, the last block's forward
            ends = block == 0 and m["grads"] or block == r["n_blocks"] - 1 and not m["grads"]
            out["gathered"] = r["rest"] + (0 if block is None else r["one_block"] if ends else held["gathered"] - r["rest"])
            out["gathered"] += _held_blocks(r, _blocks_left_by_forward(r, m, block))
            if r.get("engine") == "fsdp2" and block is None and not r.get("kept_whole"):
                # FSDP2 all-gathers a block into one flat buffer, copied out into its parameters when
                # the block runs: between the blocks (the root's pre-backward prefetches the last block
                # before the head's backward) that buffer is held beside the gathered weights; with
                # reshard_after_forward False the last block is still whole and nothing is gathered
                out["in_flight"] = out.get("in_flight", 0) + r["one_block"]
    return out


def _blocks_left_by_forward(r: dict, m: dict, block: int | None) -> int:
    """How many blocks, besides the ones `gathered` counts (the running one and the prefetched one), hold
    what their forward left at one-device moment `m` (see post_forward): in block i's forward the i
    before it; in its backward the i - 1 before the prefetched one; between blocks all of them in the
    forward and the head's backward (its gradients at most the head's), none after the first block's
    backward; at a moment not placed (-1), all but two."""
    n = r.get("n_blocks", 0)
    if block is None:
        return n if not m["grads"] or m["grads"] <= r["head_grads"] else 0
    if block < 0:
        return max(n - 2, 0)
    return block if not m["grads"] else max(block - 1, 0)


def _held_blocks(r: dict, count: int) -> int:
    return max(count, 0) * r.get("post_forward", 0)


def _later(r: dict, m: dict) -> dict:
    """Moment `m` of the first micro-batch as a later micro-batch sees it (see rank_totals)."""
    if r.get("runs_as", r["strategy"]) in ("zero2", "zero3"):
        # the current micro-batch's reduce-scatters add into the slices (no new bytes); its unreduced
        # gradients (in_flight) are beside them and the flat buffer kept from the earlier one
        spare = 0 if m.get("spare_kept") else r["spare"]  # (replaced at this micro-batch's first reduce)
        return dict(m, grads=r["grads"], in_flight=m.get("in_flight", 0) + spare)
    return dict(m, grads=max(m.get("grads", 0), r["grads"]))


def _filled(moment: dict) -> dict:
    out = {c: int(moment.get(c, 0)) for c in RANK_CATEGORIES}
    out["total"] = sum(out.values())
    return out
