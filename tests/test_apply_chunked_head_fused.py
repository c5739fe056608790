"""The chunked head's fused weight gradient (summed over token chunks in the forward) checked on any CPU.

Its bitwise claim rests on two things: the BLAS adds each reduction block's dot products into the
result in order (gemm_blocking measures the block; a CPU without one, such as an AVX-512 MKL, skips
tests/test_apply_chunked_head.py's fused cases), and the fused path's own algebra: chunks starting at
block multiples, each block's slice of the logits' gradient against the same tokens' hidden states,
the first block written and the rest added, every token counted once. Here torch.mm and addmm_ are a
GEMM whose summation order is known (each block's products summed one after another, the block sums
added into the result in order, the way a blocked BLAS does), so the algebra is checked to the bit
against the unchunked head computed with that same GEMM, whatever this CPU's BLAS does.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memfit.apply.chunked_head as ch
from memfit.apply import gemm_blocking

BLOCK = 64  # the known GEMM's reduction block (one of gemm_blocking.CANDIDATES)


def _block_sums(a: torch.Tensor, b: torch.Tensor, block: int):
    """a @ b's partial products per reduction block, each summed over k in order (fp32, elementwise
    multiply and add: every rounding is fixed, nothing depends on the CPU's vector width)."""
    k = a.shape[1]
    for k0 in range(0, k, block):
        p = a[:, k0, None] * b[k0, None, :]
        for i in range(k0 + 1, min(k, k0 + block)):
            p = p + a[:, i, None] * b[i, None, :]
        yield p


def known_mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None, block: int = BLOCK):
    c = None
    for p in _block_sums(a, b, block):
        c = p if c is None else c + p
    return c if out is None else out.copy_(c)


def known_addmm_(self: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    for p in _block_sums(a, b, block):
        self.copy_(self + p)
    return self


@pytest.fixture
def known_gemm(monkeypatch):
    """torch.mm / Tensor.addmm_ (what the chunked head calls) as the known GEMM, and its block as the
    machine's measured one. The unchunked reference below calls known_mm itself (F.linear and autograd
    call the BLAS from C++, not through these names)."""
    monkeypatch.setattr(torch, "mm", known_mm)
    monkeypatch.setattr(torch.Tensor, "addmm_", known_addmm_)
    monkeypatch.setattr(gemm_blocking, "cpu_k_block", lambda: BLOCK)
    calls = {"fused": 0, "vocab": 0}

    def counted(key, real):
        def call(*a):
            calls[key] += 1
            return real(*a)
        return call

    monkeypatch.setattr(ch, "_sum_weight_grad", counted("fused", ch._sum_weight_grad))  # the forward's dW sum
    monkeypatch.setattr(ch, "_grad_weight", counted("vocab", ch._grad_weight))  # backward's vocabulary pass
    return calls


def _reference(x, w, y, ignore, reduction, scale):
    """The unchunked head's loss and gradients with the known GEMM: logits, then autograd's
    cross-entropy backward for the logits' gradient g, then dh = g @ w and dW = g.T @ h."""
    logits = known_mm(x.detach(), w.detach().t()).requires_grad_()
    loss = F.cross_entropy(logits, y, ignore_index=ignore, reduction=reduction)
    (g,) = torch.autograd.grad(loss * scale, logits)
    return loss.detach(), known_mm(g, w.detach()), known_mm(g.t(), x.detach())


@pytest.mark.parametrize("n,h,v", [(200, 16, 257), (333, 8, 130)])
@pytest.mark.parametrize("reduction,ignore", [("mean", -100), ("sum", -1)])
def test_fused_weight_gradient_is_the_unchunked_product_bit_for_bit(known_gemm, n, h, v, reduction, ignore):
    torch.manual_seed(n + v)
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) * 0.05).requires_grad_()
    y = torch.randint(0, v, (n,))
    y[torch.rand(n) < 0.2] = ignore
    count = (y != ignore).sum() if reduction == "sum" else 1  # a summed loss is divided by its count
    ref_loss, ref_dh, ref_dw = _reference(x, w, y, ignore, reduction, 1 / count if reduction == "sum" else 1)
    for chunks in (1, 2, 3, 8):  # 8: more chunks than blocks, so spans' alignment sets their size
        known_gemm["fused"] = 0
        loss = ch.chunked_cross_entropy(x, w, y, chunks=chunks, ignore_index=ignore, reduction=reduction)
        dh, dw = torch.autograd.grad(loss / count, [x, w])
        assert known_gemm["fused"] == len(ch.spans(n, chunks, align=BLOCK))  # summed in the forward
        assert torch.equal(loss, ref_loss), chunks
        assert torch.equal(dh, ref_dh), chunks
        assert torch.equal(dw, ref_dw), (chunks, (dw - ref_dw).abs().max())
    assert known_gemm["vocab"] == 0  # backward's vocabulary pass never ran


def test_the_known_gemm_tells_a_cut_off_the_blocks_from_one_on_them(known_gemm, monkeypatch):
    """The check above has teeth: with the machine's block misread (chunks cut at 48 where the GEMM
    blocks at 64) the fused sum adds other partial sums and the weight gradient differs."""
    torch.manual_seed(0)
    n, h, v = 200, 16, 257
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) * 0.05).requires_grad_()
    y = torch.randint(0, v, (n,))
    _, _, ref_dw = _reference(x, w, y, -100, "mean", 1)
    monkeypatch.setattr(gemm_blocking, "cpu_k_block", lambda: 48)
    loss = ch.chunked_cross_entropy(x, w, y, chunks=3)
    (dw,) = torch.autograd.grad(loss, [w])
    assert known_gemm["fused"] > 0 and not torch.equal(dw, ref_dw)
