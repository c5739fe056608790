"""The reduction block of this machine's fp32 GEMM, found by experiment.

A BLAS computes C = A @ B with a long reduction dimension K in blocks of K (MKL's AVX2 sgemm: 192
rows): each block's dot products are summed in registers and then added into C. So summing
`A[:, k0:k1] @ B[k0:k1]` into C over ranges that start at multiples of that block and span at most one
block performs the same additions in the same order as the single GEMM: the result is bit for bit the
same, when K is at least two blocks long (between one and two, MKL splits K in halves instead). The
chunked LM head uses this to sum its weight gradient over token chunks in the forward pass (three head
GEMMs instead of four) without giving up bitwise equality.

Nothing documents the block, so it is measured: the smallest candidate for which the chunked sum equals
the whole product on random inputs, on two shapes. None where no candidate does (another BLAS, other
kernels); callers then keep their exact fallback.
"""
from __future__ import annotations

import functools

import torch

CANDIDATES = (64, 96, 128, 144, 160, 192, 256, 288, 320, 384, 512)
_SHAPES = ((64, 48), (256, 96))  # (columns of A^T = rows of the result, columns of B)


def _chunked_equals(rows: int, cols: int, block: int, gen: torch.Generator) -> bool:
    k = 3 * block + 40  # three whole blocks and a short tail
    a = torch.randn(k, rows, generator=gen)
    b = torch.randn(k, cols, generator=gen)
    whole = torch.mm(a.t(), b)
    part = torch.empty(rows, cols)
    for i, k0 in enumerate(range(0, k, block)):
        k1 = min(k, k0 + block)
        if i == 0:
            torch.mm(a[k0:k1].t(), b[k0:k1], out=part)
        else:
            part.addmm_(a[k0:k1].t(), b[k0:k1])
    return torch.equal(part, whole)


@functools.lru_cache(maxsize=None)
def _measured(threads: int) -> int | None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    gen = torch.Generator().manual_seed(0)
    with unset_fake_temporarily(), torch.autocast("cpu", enabled=False), torch.no_grad():
        for block in CANDIDATES:
            if all(_chunked_equals(r, c, block, gen) for r, c in _SHAPES):
                return block
    return None


def cpu_k_block() -> int | None:
    """The CPU fp32 GEMM's reduction block under the current thread count (measured once per count),
    or None when no candidate reproduces the whole product."""
    return _measured(torch.get_num_threads())


def k_ranges(start: int, stop: int, block: int) -> list[tuple[int, int]]:
    """[start, stop) cut at multiples of `block`; with `start` a multiple of it, each range is one whole
    reduction block of the full GEMM (the last one possibly its short tail)."""
    if start % block:
        raise ValueError(f"start {start} is not a multiple of the block {block}")
    edges = list(range(start, stop, block)) + [stop]
    return list(zip(edges, edges[1:]))


@functools.lru_cache(maxsize=None)
def _rows_exact(rows: int, k: int, n: int, threads: int) -> bool:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    gen = torch.Generator().manual_seed(0)
    with unset_fake_temporarily(), torch.autocast("cpu", enabled=False), torch.no_grad():
        a, b = torch.randn(4 * rows, k, generator=gen), torch.randn(k, n, generator=gen)
        whole = a @ b
        return all(torch.equal(a[r:r + rows] @ b, whole[r:r + rows]) for r in range(0, 4 * rows, rows))


def cpu_rows_exact(rows: int, k: int, n: int) -> bool:
    """Whether this CPU's fp32 GEMM computes a block of `rows` rows of an (M, k) @ (k, n) product as
    the whole product computes them (measured once per shape and thread count). MKL's AVX2 sgemm does
    from a dozen rows on; its AVX-512 sgemm sends blocks under 256 rows of a wide product (n 768, k
    1000 and more) to kernels with another summation order."""
    return _rows_exact(rows, k, n, torch.get_num_threads())
