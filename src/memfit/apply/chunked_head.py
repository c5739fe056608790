"""A chunked LM head with cross-entropy: batch x seq x vocab logits are never all held at once.

    loss = chunked_cross_entropy(hidden, head.weight, targets, chunks=8)     # hidden (N, H), targets (N,)

equals `F.cross_entropy(hidden @ weight.T (+ bias), targets)` and, in fp32 on CPU, so do its
gradients, bit for bit (tests/test_apply_chunked_head.py checks with torch.equal). How:

* Everything per token (logits, log-softmax, the loss picked at the target, the softmax backward)
  is computed by the same aten kernels on a chunk of rows; those kernels work row by row, so a row's
  figures do not depend on which rows share its call.
* The GEMMs are sliced, never split along their reduction except at the BLAS's own reduction blocks:
  logits and grad wrt hidden over token rows (a row block of A @ B is the same dot products as the full
  product's rows), the weight gradient over reduction blocks of tokens (below) or over vocabulary
  columns (dW[v0:v1] sums over *all* tokens, as the unchunked GEMM does).
  MKL may take another kernel for blocks under 12 rows or columns, with another summation order: every
  chunk here has at least MIN_CHUNK rows/columns (or is the whole). MKL's AVX-512 sgemm does so for
  row blocks under 256 rows of a wide product too (gemm_blocking.cpu_rows_exact measures it): there the
  gradient wrt the hidden states differs from the unchunked head's by summation order (within
  2 gamma_K of its dot products), the loss and the weight gradient stay bitwise.
* The weight gradient's vocabulary slice needs the softmax of every token on those columns. The
  forward keeps per token the row max m and the log-sum-exp term l (2 floats per token): the kernel
  computes log_softmax as (x - m) - l, so at the argmax it returns exactly -l, and any column's value
  is rebuilt as (x - m) - l bit for bit.
* The bias gradient is a column sum over tokens; its kernel groups columns in vectors counted from
  the first, so vocabulary chunks start at multiples of VOCAB_ALIGN.
* The loss sum runs through nll_loss on an (N, 1) tensor of the picked log-probabilities, so the
  kernel's cascade summation adds the same numbers in the same order as on (N, vocab).
* The gradient wrt the hidden states is a row block of g @ w per token chunk. The forward computes it
  in its own token pass, with the upstream gradient it expects (`expect_grad`: 1.0 for a mean loss,
  1/count for a summed loss divided by its token count, as memfit's training step does); backward
  uses it only if the gradient it receives equals that one bit for bit, and otherwise recomputes it
  over token chunks (as exact, one pass more).
* The weight gradient, when nothing stands in the way (fp32, no bias, a known GEMM reduction block),
  is summed in the forward's token pass too: dW = sum over token chunks of g_c.T @ h_c, one GEMM per
  reduction block of the BLAS (`gemm_blocking`: 192 tokens for MKL's AVX2 sgemm, measured at first use),
  with chunks starting at multiples of it. The single GEMM adds the same block sums into dW in the same
  order, so this is bitwise too. Otherwise backward computes it over vocabulary chunks: every token's
  softmax on the chunk's columns, rebuilt from m and l (one more pass over the logits).

Cost: with the weight gradient summed in the forward, three head GEMMs, as the unchunked head; else
four (five when the upstream gradient was not the expected one). Scratch buffers are allocated once per
pass and reused by every chunk (the kernels write into them), so no chunk allocates (and page-faults)
fresh N x vocab memory, as the unchunked head does for each of its logits, log-probabilities and their
gradients (bench/chunked_head.py times both).
Memory: about 2 x (N / chunks) x vocab floats at once plus N x hidden for the early gradient (and, when
summed early, the weight gradient, which the unchunked head allocates at backward's start anyway),
instead of several N x vocab. With autocast (bf16) the GEMMs run in the autocast dtype as an unchunked
head's would; bitwise equality is then not claimed (oneDNN's bf16 kernels are not checked slice by
slice), nor on CUDA.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.nn.functional as F

MIN_CHUNK = 32
"""Fewest rows (tokens) or columns (vocabulary) per chunk; MKL sends smaller GEMM blocks to kernels
with another summation order (most blocks under 12 rows differ on this project's AVX2 machine)."""
VOCAB_ALIGN = 64
"""Vocabulary chunks start at multiples of this: the column-sum kernel (the bias gradient) handles
columns in vector groups counted from the first, 4 x 8 floats on AVX2, 4 x 16 on AVX-512."""

_REDUCTIONS = {"mean": 1, "sum": 2}
_DIVISOR: ContextVar = ContextVar("memfit_summed_loss_divisor", default=None)


@contextmanager
def summed_loss_divisor(count) -> Iterator[None]:
    """Summed chunked losses computed inside will be divided by `count` (an int or a tensor) before
    backward, as gradient accumulation divides each micro-batch's sum by the whole batch's token count:
    expect_grad="auto" then expects 1/count instead of 1/(the loss's own count)."""
    token = _DIVISOR.set(count)
    try:
        yield
    finally:
        _DIVISOR.reset(token)


def spans(n: int, chunks: int, min_size: int = MIN_CHUNK, align: int = 1) -> list[tuple[int, int]]:
    """At most `chunks` [start, end) ranges covering n, each starting at a multiple of `align` and at
    least `min_size` long (fewer ranges when n is too small for that)."""
    k = max(1, min(chunks, n // max(min_size, 1)))
    step = -(-n // k)
    step = max(-(-step // align) * align, -(-min_size // align) * align)
    starts = list(range(0, n, step))
    if len(starts) > 1 and n - starts[-1] < min_size:
        starts.pop()  # a short tail joins the range before it
    return list(zip(starts, starts[1:] + [n]))


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return h.dtype


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """h @ w.T (+ b) into `out` (fp32), as F.linear computes an unchunked head's logits (addmm with a bias).
    MKL writes a row-strided `out` in place: the same dot products as into a fresh tensor."""
    if h.dtype == out.dtype:
        return torch.mm(h, w.t(), out=out) if b is None else torch.addmm(b, h, w.t(), out=out)
    return out.copy_(torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t()))


def _view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous (rows, cols) tensor on the front of the flat scratch buffer `buf`."""
    return buf[: rows * cols].view(rows, cols)


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or t.device.type == "meta"


class ChunkedCrossEntropy(torch.autograd.Function):
    """cross_entropy(h @ w.T + b, y) in token chunks; grad wrt h during the forward's token pass (when the
    upstream gradient will be `expect`), grad wrt w and b in vocabulary chunks. See the module docstring."""

    @staticmethod
    def forward(ctx, h, w, b, y, ignore_index: int, reduction: str, chunks: int, expect, early_dw: bool = True):
        dt = _compute_dtype(h)
        red = _REDUCTIONS[reduction]
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dt), w.to(dt)
            bc = None if b is None else b.to(dt)
            n = h.shape[0]
            one = torch.where(y == ignore_index, ignore_index, 0)
            # total first (the same kernel on zeros): the forward's grad wrt h needs it.
            zeros = torch.zeros(n, 1, dtype=torch.float32, device=h.device)
            total = torch.ops.aten.nll_loss_forward(zeros, one, None, red, ignore_index)[1]
            if expect is not None:  # "auto", sum: 1 / count in fp32, as `loss / count` hands backward
                unit = torch.ones((), dtype=torch.float32, device=h.device)
                if expect == "auto":
                    div = _DIVISOR.get()
                    div = total if div is None else torch.as_tensor(div, device=h.device).to(torch.float32)
                    expect = unit if red == 1 else unit / div
                else:
                    expect = unit * expect
            dh = None if expect is None else torch.empty_like(hc)
            block = _fused_block(hc, w, b, expect, ctx.needs_input_grad[1] and early_dw)
            dw = None if block is None else torch.empty(w.shape, dtype=w.dtype, device=w.device)
            m, lse, picked = _token_pass(hc, wc, bc, y, ignore_index, red, chunks, total, expect, dh, dw, block)
            loss, total = torch.ops.aten.nll_loss_forward(picked, one, None, red, ignore_index)
        ctx.save_for_backward(h, w, b, y, m, lse, total, expect, dh, dw)
        ctx.opts = (ignore_index, red, chunks, dt)
        return loss

    @staticmethod
    def backward(ctx, grad):
        h, w, b, y, m, lse, total, expect, dh, dw = ctx.saved_tensors
        ignore_index, red, chunks, dt = ctx.opts
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dt), w.to(dt)
            bc = None if b is None else b.to(dt)
            expected = expect is not None and (_fake(grad) or torch.equal(grad.float(), expect))
            if need_h and (dh is None or not expected):
                dh = _grad_hidden(hc, wc, bc, y, grad, total, ignore_index, red, chunks)  # unexpected grad: recompute
            db = None
            if dw is not None and not expected:
                dw = None  # computed under another upstream gradient: the vocabulary pass below redoes it
            if dw is None and (need_w or (need_b and b is not None)):
                dw, db = _grad_weight(hc, wc, bc, y, m, lse, grad, total, ignore_index, red, chunks)
        dh = None if dh is None or not need_h else dh.to(h.dtype)
        dw = None if dw is None or not need_w else dw.to(w.dtype)
        db = None if db is None or not need_b else db.to(b.dtype)
        return dh, dw, db, None, None, None, None, None, None


def early_weight_grad_block(tokens: int, device_type: str, fp32: bool, bias: bool) -> int | None:
    """The token alignment under which the forward also sums the weight gradient over its token chunks
    (None: backward's vocabulary pass computes it). On CPU that is the GEMM's measured reduction block,
    which keeps the sum bitwise the single GEMM's, given at least two blocks of tokens (MKL halves a
    reduction between one and two blocks long); fp32 only (a 16-bit sum over chunks would round at every
    chunk), no bias (its column sum over chunks would add in another order). Other devices sum over
    chunks unaligned (1): bitwise equality is not claimed there."""
    if not fp32 or bias:
        return None
    if device_type in ("cpu", "meta"):
        from memfit.apply.gemm_blocking import cpu_k_block

        block = cpu_k_block()
        return block if block is not None and tokens >= 2 * block else None
    return 1


def _fused_block(hc, w, b, expect, need_w: bool) -> int | None:
    if expect is None or not need_w:
        return None
    fp32 = hc.dtype == torch.float32 and w.dtype == torch.float32
    return early_weight_grad_block(hc.shape[0], hc.device.type, fp32, b is not None)


def _token_pass(hc, wc, bc, y, ignore_index: int, red: int, chunks: int, total, expect, dh, dw=None,
                block: int | None = None):
    """Over token chunks: logits, per-token max m and log-sum-exp l, the log-probability at the target and,
    with `expect`, the softmax backward under that upstream gradient and g @ w into dh; with `dw`, also
    g.T @ h summed into dw over reduction blocks of `block` tokens (chunks then start at its multiples)."""
    n, vocab = hc.shape[0], wc.shape[0]
    parts = spans(n, chunks, align=block or 1)
    rows = max(r1 - r0 for r0, r1 in parts)
    bufs = [torch.empty(rows * vocab, dtype=torch.float32, device=hc.device) for _ in range(1 if dh is None else 2)]
    m = torch.empty(n, dtype=torch.float32, device=hc.device)
    lse, picked = torch.empty_like(m), torch.empty(n, 1, dtype=torch.float32, device=hc.device)
    safe = torch.where(y == ignore_index, 0, y)
    for r0, r1 in parts:
        x = _logits(hc[r0:r1], wc, bc, _view(bufs[0], r1 - r0, vocab))
        top = torch.max(x, dim=1, out=(m[r0:r1], torch.empty(r1 - r0, dtype=torch.long, device=hc.device)))[1]
        logp = torch.ops.aten._log_softmax.out(x, 1, False, out=x)  # row by row: in place is the same arithmetic
        torch.neg(logp.gather(1, top[:, None]).squeeze(1), out=lse[r0:r1])  # logp at the argmax is exactly -l
        torch.gather(logp, 1, safe[r0:r1, None], out=picked[r0:r1])
        if dh is not None:
            g = torch.ops.aten.nll_loss_backward.grad_input(expect, logp, y[r0:r1], None, red, ignore_index, total,
                                                            grad_input=_view(bufs[1], r1 - r0, vocab))
            g = torch.ops.aten._log_softmax_backward_data.out(g, logp, 1, torch.float32, out=logp)
            torch.mm(g.to(dh.dtype), wc, out=dh[r0:r1])
            if dw is not None:
                _sum_weight_grad(dw, g, hc, r0, r1, block)
    return m, lse, picked


def _sum_weight_grad(dw, g, hc, r0: int, r1: int, block: int) -> None:
    """dw (+)= g.T @ h[r0:r1], one GEMM per reduction block (the first one writes, the rest add)."""
    from memfit.apply.gemm_blocking import k_ranges

    for k0, k1 in k_ranges(r0, r1, block) if block > 1 else [(r0, r1)]:
        if k0 == 0:
            torch.mm(g[k0 - r0:k1 - r0].t(), hc[k0:k1], out=dw)
        else:
            dw.addmm_(g[k0 - r0:k1 - r0].t(), hc[k0:k1])


def _grad_hidden(hc, wc, bc, y, grad, total, ignore_index: int, red: int, chunks: int) -> torch.Tensor:
    """Over token chunks: recompute the chunk's logits, the aten softmax backward, g @ w (the backward's
    path when the upstream gradient is not the one the forward expected)."""
    dh = torch.empty_like(hc)
    n, vocab = hc.shape[0], wc.shape[0]
    parts = spans(n, chunks)
    rows = max(r1 - r0 for r0, r1 in parts)
    a, b = (torch.empty(rows * vocab, dtype=torch.float32, device=hc.device) for _ in range(2))
    for r0, r1 in parts:
        x = _logits(hc[r0:r1], wc, bc, _view(a, r1 - r0, vocab))
        logp = torch.ops.aten._log_softmax.out(x, 1, False, out=x)
        g = torch.ops.aten.nll_loss_backward.grad_input(grad, logp, y[r0:r1], None, red, ignore_index, total,
                                                        grad_input=_view(b, r1 - r0, vocab))
        g = torch.ops.aten._log_softmax_backward_data.out(g, logp, 1, torch.float32, out=logp)
        torch.mm(g.to(dh.dtype), wc, out=dh[r0:r1])
    return dh


def _grad_weight(hc, wc, bc, y, m, lse, grad, total, ignore_index: int, red: int, chunks: int):
    """Over vocabulary chunks: every token's softmax on the chunk's columns, rebuilt from the saved m and l,
    then dW[v0:v1] = g[:, v0:v1].T @ h over all tokens (and db = the column sums).

    The aten backward kernels run on the chunk's columns plus one spare column: a token whose target
    lies outside the chunk puts its -grad/N there, so each row sums to what the full row sums to and
    every element is computed by the same formula as in the unchunked kernel."""
    n, vocab = hc.shape[0], wc.shape[0]
    dw = torch.empty(vocab, wc.shape[1], dtype=wc.dtype, device=wc.device)
    db = None if bc is None else torch.empty(vocab, dtype=bc.dtype, device=bc.device)
    ignored = y == ignore_index
    mcol, lcol = m[:, None], lse[:, None]
    parts = spans(vocab, chunks, align=VOCAB_ALIGN)
    cols = max(v1 - v0 for v0, v1 in parts) + 1
    a, b = (torch.empty(n * cols, dtype=torch.float32, device=hc.device) for _ in range(2))
    for v0, v1 in parts:
        logp = _view(a, n, v1 - v0 + 1)
        x = _logits(hc, wc[v0:v1], None if bc is None else bc[v0:v1], logp[:, : v1 - v0])
        x.sub_(mcol).sub_(lcol)  # (x - m) - l, as the log_softmax kernel computes it
        logp[:, v1 - v0].zero_()
        inside = (y >= v0) & (y < v1)
        local = torch.where(ignored, ignore_index, torch.where(inside, y - v0, v1 - v0))
        g = torch.ops.aten.nll_loss_backward.grad_input(grad, logp, local, None, red, ignore_index, total,
                                                        grad_input=_view(b, n, v1 - v0 + 1))
        g = torch.ops.aten._log_softmax_backward_data.out(g, logp, 1, torch.float32, out=logp)[:, : v1 - v0]
        if g.dtype == wc.dtype:
            torch.mm(g.t(), hc, out=dw[v0:v1])
        else:
            dw[v0:v1] = torch.mm(g.t().to(wc.dtype), hc)
        if db is not None:
            db[v0:v1] = g.sum(0)
    return dw, db


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          bias: torch.Tensor | None = None, *, chunks: int = 8, ignore_index: int = -100,
                          reduction: str = "mean", expect_grad: "float | str | None" = "auto",
                          early_weight_grad: bool = True) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T + bias, target, ...) computed in `chunks` chunks.

    hidden: (..., H), flattened to (N, H); target: N class indices (`ignore_index` marks padding).
    reduction: "mean" (over non-ignored tokens) or "sum".
    expect_grad: the gradient backward will receive for the loss. The forward then computes the gradient
    wrt `hidden` as well (one pass over the logits fewer); if backward receives another, it recomputes it
    (slower, as exact). "auto": 1.0 for "mean" and 1/(counted tokens) for "sum" (the loss divided by its
    token count, as memfit's training step does; inside `summed_loss_divisor(count)`, 1/count); None:
    always recompute.
    early_weight_grad: sum the weight gradient in the forward where that stays exact (fp32, no bias, a
    known GEMM reduction block; `early_weight_grad_block`); False leaves it to backward's vocabulary pass
    (one head GEMM more)."""
    from memfit.core.errors import ConfigError

    if reduction not in _REDUCTIONS:
        raise ConfigError(f"reduction={reduction!r}; accepted: mean, sum")
    if not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"chunks must be a positive integer, got {chunks!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = target.reshape(-1)
    if y.shape[0] != h.shape[0]:
        raise ConfigError(f"{y.shape[0]} targets for {h.shape[0]} hidden states; they must match")
    if expect_grad is not None and expect_grad != "auto" and not isinstance(expect_grad, (int, float)):
        raise ConfigError(f"expect_grad must be a number, 'auto' or None, got {expect_grad!r}")
    expect = expect_grad if torch.is_grad_enabled() and hidden.requires_grad else None
    return ChunkedCrossEntropy.apply(h, weight, bias, y, ignore_index, reduction, chunks, expect, early_weight_grad)


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                            bias: torch.Tensor | None = None, ignore_index: int = -100,
                            reduction: str = "mean") -> torch.Tensor:
    """The unchunked head the chunked one reproduces (for tests and comparisons)."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    return F.cross_entropy(logits.float(), target.reshape(-1), ignore_index=ignore_index, reduction=reduction)
