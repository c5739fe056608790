"""The planner's chunked-head choice: which chunk counts to try, their profiles, their time.

A chunked LM head (memfit.apply.chunked_head) changes only the head-and-loss stretches of a chain
profile (forward and backward; memfit.measure.compose). So the profile for k chunks is the plain
profile with those two stretches (and the bytes relabelled at backward start) moved by what the
chunked head changes in a short all-keep chain: two short traces per chunk count, plus two of the
plain model shared by all counts, instead of tracing every action again. The chosen plan is checked
with a full trace of the step with its head installed (memfit.plan.trace_check.verify).

Time (head_seconds): in fp32 without a bias, the chunked head sums the weight gradient in its forward
(memfit.apply.chunked_head.early_weight_grad_block) and runs the plain head's three GEMMs; otherwise
backward's vocabulary pass recomputes the logits: one head GEMM more (EXTRA_GEMMS) plus the softmax work
once more. Both save the plain head's fresh N x vocab allocations. Each token chunk streams the whole
head weight through two GEMMs again: CHUNK_TOKENS tokens' worth of a head GEMM per chunk, which ranks
fewer chunks first among plans that are otherwise the same. Both constants are fitted to the process
CPU times of bench/chunked_head.py (docs/planner.md), counted in head GEMMs at the rate the plain head's
GEMMs ran there; the FLOP model gives a head GEMM's seconds, scaled to this machine by `speed` when a
profile is given. A profile that times the chunked head itself anchors the figure at its measurement
(this model then gives the difference between counts).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from memfit.apply.chunked_head import MIN_CHUNK, early_weight_grad_block, spans
from memfit.apply.head_swap import chunk_head, head_weight
from memfit.apply.policy import BlockAction
from memfit.measure.blocks import ChainSource, chain_profile
from memfit.measure.compose import ChainProfile
from memfit.plan.costs import FLOPS

HEAD_CHUNKS = (2, 4, 8, 16, 32, 64)
"""Chunk counts the search tries, fewest first."""
EXTRA_GEMMS = 0.69
"""Head GEMMs' worth of time the chunked head adds over the plain one, apart from its chunk count, when
backward computes the weight gradient (none when the forward sums it). Fitted by
bench/chunked_head.py's fit_constants; a test holds the two equal."""
CHUNK_TOKENS = 1
"""Tokens' worth of one head GEMM that each chunk adds (two more passes of the head weight): the fit is
below noise, so this is the floor that still ranks fewer chunks first among otherwise equal plans."""


def head_source(src: ChainSource, chunks: int | None) -> ChainSource:
    """The chain source with the LM head in `chunks` chunks (the source itself for None)."""
    if not chunks:
        return src

    def build_k(k: int):
        return chunk_head(src.build_k(k), chunks)

    return replace(src, build_k=build_k, key=src.key + (("head-chunks", chunks),))


def head_counts(src: ChainSource) -> list[int]:
    """The chunk counts worth trying: each chunk keeps at least MIN_CHUNK vocabulary columns."""
    if not chunkable(src):
        return []
    vocab = head_size(src)[0]
    return [k for k in HEAD_CHUNKS if k * MIN_CHUNK <= vocab]


_CHUNKABLE: dict[tuple, bool] = {}


def chunkable(src: ChainSource) -> bool:
    """Whether the model's head can run in chunks at all (Gemma-2's soft-capped logits cannot): a model
    that cannot is planned with its plain head, whatever --allow says, as with any other action the
    model cannot take."""
    from memfit.core.errors import ConfigError

    if src.key not in _CHUNKABLE:
        try:
            with torch.device("meta"):
                chunk_head(src.build_k(1), HEAD_CHUNKS[0])
            _CHUNKABLE[src.key] = True
        except ConfigError:
            _CHUNKABLE[src.key] = False
    return _CHUNKABLE[src.key]


_SIZES: dict[tuple, tuple[int, int, bool]] = {}


def head_size(src: ChainSource) -> tuple[int, int]:
    """(vocab, hidden) of the model's LM head, from a one-block build on the meta device (cached with
    whether the head has a bias)."""
    if src.key not in _SIZES:
        with torch.device("meta"):
            model = src.build_k(1)
        w = head_weight(model)
        bias = any(getattr(m, "weight", None) is w and getattr(m, "bias", None) is not None for m in model.modules())
        _SIZES[src.key] = (int(w.shape[0]), int(w.shape[1]), bias)
    return _SIZES[src.key][:2]


def head_profile(src: ChainSource, prof: ChainProfile, chunks: int, precision: str, optimizer: str,
                 step_in_backward: bool = False) -> ChainProfile:
    """`prof` (the plain head's) with the head stretches of the head in `chunks` chunks."""
    plain = head_parts(src, None, precision, optimizer, step_in_backward=step_in_backward)
    chunked = head_parts(src, chunks, precision, optimizer, step_in_backward=step_in_backward)
    return _graft(prof, plain, chunked)


def head_parts(src: ChainSource, chunks: int | None, precision: str, optimizer: str,
               device: str = "cpu", step_in_backward: bool = False) -> ChainProfile:
    """The stretches around the blocks of a one-block chain (all kept) with the head in `chunks` chunks
    (None: plain). Only the differences between two of these are used (`_graft`): what the head
    changes does not depend on how many blocks precede it, so one trace of one block is enough, where
    a whole chain profile costs two traces of three and four blocks. Cached as chain profiles are
    (in this process, and on disk for model specs: memfit.measure.chain_cache)."""
    from memfit.measure import chain_cache
    from memfit.measure.blocks import _CACHE
    from memfit.measure.chain_ends import fwd_kinds
    from memfit.measure.compose import _trace, _without_deferred
    from memfit.measure.timeline import ZERO, Stretch

    hs = head_source(src, chunks)
    key = hs.key + (precision, optimizer, device, ("head-parts",)) + (("step-in-backward",) if step_in_backward else ())
    got = _CACHE.get(key) or chain_cache.load(key)
    if got is None:
        keep = [BlockAction("keep")]
        st = _trace(hs.build_k, 1, hs.step, keep, precision, optimizer, device, step_in_backward)
        parts, deferred = _without_deferred(st, fwd_kinds(keep))
        none = Stretch(ZERO, ZERO)
        got = ChainProfile(n_blocks=1, start=st.start, start_per_block=ZERO, **parts, per_block={}, fwd={"keep": none},
                           bwd={"keep": none}, seg_extra={}, deferred=deferred, traced_blocks=1, bw_temps=st.bw_temps)
        chain_cache.store(key, got)
    _CACHE[key] = got
    return got


def _graft(prof: ChainProfile, plain: ChainProfile, chunked: ChainProfile) -> ChainProfile:
    # Every stretch around the blocks moves by what the head changes: the head's own (forward, backward)
    # and, for a loop that keeps its output, the output the step begins with (the previous step's,
    # `start`) and holds through the update (`opt`); a chunked head's output holds no full logits.
    moved = {k: getattr(prof, k) + (getattr(chunked, k) - getattr(plain, k))
             for k in ("pre_fwd", "post_fwd", "post_bwd", "pre_bwd", "opt")}
    start = tuple(a + c - b for a, b, c in zip(prof.start, plain.start, chunked.start))
    out = replace(prof, start=start, bw_temps=prof.bw_temps + chunked.bw_temps - plain.bw_temps, **moved)
    if prof.plain is not None:
        out.plain = _graft(prof.plain, plain, chunked)
    out.unchunked = getattr(prof, "unchunked", prof)  # what corrections traced on the plain head refer to
    return out


def sums_weight_grad(src: ChainSource, tokens: int, precision: str = "32-true", device: str = "cpu") -> bool:
    """Whether the chunked head will sum its weight gradient in the forward (the plain head's GEMMs)."""
    head_size(src)
    return early_weight_grad_block(tokens, device, precision == "32-true", _SIZES[src.key][2]) is not None


def head_seconds(src: ChainSource, tokens: int, chunks: int, speed: float = 1.0, precision: str = "32-true",
                 device: str = "cpu") -> float:
    """Extra seconds of a chunked head over the plain one in the time model (`speed` scales the FLOP
    model to measured block times when a profile is given)."""
    vocab, hidden = head_size(src)
    per_token = 2 * vocab * hidden / FLOPS  # one head GEMM, per token
    block = early_weight_grad_block(tokens, device, precision == "32-true", _SIZES[src.key][2])
    extra = 0.0 if block is not None else EXTRA_GEMMS
    passes = len(spans(tokens, chunks, align=block or 1))  # token chunks actually run
    return (extra * tokens + passes * CHUNK_TOKENS) * per_token * speed
