"""The measured GEMM reduction block: summing a product over whole blocks of its reduction reproduces
the single GEMM bit for bit (what lets the chunked head sum its weight gradient in the forward)."""
from __future__ import annotations

import pytest
import torch

from memfit.apply.chunked_head import early_weight_grad_block
from memfit.apply.gemm_blocking import cpu_k_block, k_ranges


def test_k_ranges_cut_at_block_multiples():
    assert k_ranges(0, 500, 192) == [(0, 192), (192, 384), (384, 500)]
    assert k_ranges(384, 400, 192) == [(384, 400)]
    with pytest.raises(ValueError):
        k_ranges(10, 400, 192)


@pytest.mark.parametrize("k,rows,cols", [(1000, 3000, 96), (2 * 192 + 7, 501, 33)])
def test_summing_over_measured_blocks_equals_the_whole_product(k, rows, cols):
    block = cpu_k_block()
    if block is None:
        pytest.skip("this BLAS showed no reduction block that reproduces its whole product")
    if k < 2 * block:
        pytest.skip(f"reduction {k} under two blocks of {block}")
    torch.manual_seed(k)
    a, b = torch.randn(k, rows), torch.randn(k, cols)
    part = torch.empty(rows, cols)
    for k0, k1 in k_ranges(0, k, block):
        if k0 == 0:
            torch.mm(a[k0:k1].t(), b[k0:k1], out=part)
        else:
            part.addmm_(a[k0:k1].t(), b[k0:k1])
    assert torch.equal(part, torch.mm(a.t(), b))
    # and a cut off the blocks does not (the property is the blocks', not any split's)
    off = torch.mm(a[: block // 2].t(), b[: block // 2]).addmm_(a[block // 2:].t(), b[block // 2:])
    assert not torch.equal(off, torch.mm(a.t(), b))


def test_early_weight_gradient_only_where_it_stays_exact():
    block = cpu_k_block()
    assert early_weight_grad_block(4096, "cpu", fp32=False, bias=False) is None  # 16-bit: rounds per chunk
    assert early_weight_grad_block(4096, "cpu", fp32=True, bias=True) is None    # bias: column sums reorder
    assert early_weight_grad_block(4096, "cuda", fp32=True, bias=False) == 1
    if block is not None:
        assert early_weight_grad_block(2 * block, "cpu", True, False) == block
        assert early_weight_grad_block(2 * block - 1, "cpu", True, False) is None
