"""What the CUDA caching allocator will hold: a replay of its rounding, pooling and splitting rules.

`torch.cuda.max_memory_allocated` counts the blocks handed out; `max_memory_reserved` counts the
segments obtained from cudaMalloc, and that is what runs out. Neither equals the sum of tensor
sizes: requests are rounded, a block taken from the cache may be larger than asked for, and a
freed block can only serve a request that fits in it. Given the order of a step's storage
allocations and frees (memfit.core.ledger's event log, from a fake trace), `replay` applies
PyTorch's default rules (c10/cuda/CUDACachingAllocator.cpp, no PYTORCH_CUDA_ALLOC_CONF):

* a request is rounded up to 512 bytes; up to 1 MiB it is served from the small pool, else the large;
* a miss allocates a segment: 2 MiB for a small request, 20 MiB for a large one under 10 MiB,
  else the request rounded up to 2 MiB;
* a hit is the best fit: the smallest free block of the pool that holds the request (lowest
  address on a tie);
* the block is split when the rest is at least 512 bytes (small pool) or over 1 MiB (large pool);
  otherwise the whole block is handed out and counted as allocated;
* a freed block merges with free neighbours of its segment; segments are never returned (no
  memory pressure: the prediction is of a run that fits).

One stream is assumed (side-stream copies of activation offload are not replayed).

With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's default) each pool is one segment
per stream whose mapped size grows at its end in pages (20 MiB for the large pool, 2 MiB for the small
one) when no cached block fits: a request that misses extends the segment by what its free tail block
lacks, so a freed block at the end is reused and grown instead of left beside a new segment.
`CachingAllocatorModel(expandable=True)` replays that; nothing is unmapped (no empty_cache).

Beside the tensors, cuBLAS takes a workspace from the same allocator for each (handle, stream),
and handles are per thread: a training step's GEMMs run on two threads (the forward on the
caller's, the backward on the autograd engine's), so two workspaces stay allocated from the first
step on (seen on an H100 with torch 2.11: two 32 MiB blocks, the only non-tensor blocks alive).
"""
from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass
from typing import Iterable

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n: int) -> int:
    """The block size a request of n bytes is given at least."""
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def segment_size(n: int) -> int:
    """The cudaMalloc size when a rounded request of n bytes finds no cached block."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-n // ROUND_LARGE) * ROUND_LARGE


GEMM_THREADS = 2


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """The workspace torch gives each cuBLAS handle: CUBLAS_WORKSPACE_CONFIG (":KiB:count" pairs)
    when set, else 32 MiB on Hopper (compute capability 9.x) and 8 MiB + 128 KiB before it."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        return sum(int(kib) * 1024 * int(count) for kib, count in pairs)
    return 4096 * 8 * 1024 if capability[0] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def workspace_events(capability: tuple[int, int]) -> list[tuple[int, int]]:
    """The cuBLAS workspaces as allocation events (keys no storage can have), never freed."""
    size = cublas_workspace_bytes(capability)
    return [(-1 - i, size) for i in range(GEMM_THREADS)]


class _Block:
    __slots__ = ("addr", "size", "small", "prev", "next", "used")

    def __init__(self, addr: int, size: int, small: bool) -> None:
        self.addr, self.size, self.small = addr, size, small
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.used = False


@dataclass
class AllocatorReplay:
    """Peaks of one replay (bytes)."""

    peak_allocated: int
    peak_reserved: int
    allocated: int
    reserved: int
    segments: int


def expandable_from_env(conf: str | None = None) -> bool:
    """Whether PYTORCH_CUDA_ALLOC_CONF (or `conf`) turns expandable segments on."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if conf is None else conf
    return bool(re.search(r"expandable_segments\s*:\s*true", conf, re.I))


class CachingAllocatorModel:
    """The allocator's state; `malloc(key, n)` and `free(key)` move it as the real one would.
    expandable: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (one growing segment per pool)."""

    def __init__(self, expandable: bool = False) -> None:
        self._pools: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self._live: dict[int, _Block] = {}
        self._next_addr = 1 << 32
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = self.segments = 0
        self.expandable = expandable
        self._tails: dict[bool, _Block] = {}  # expandable: the last block of each pool's segment

    def malloc(self, key: int, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take(size, small)
        if block is None:
            block = self._grow(size, small) if self.expandable else self._new_segment(segment_size(size), small)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(block.addr + size, rest, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            if self._tails.get(small) is block:
                self._tails[small] = tail
            self._insert(tail)
        block.used = True
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.used = False
        for other in (block.prev, block.next):
            if other is not None and not other.used and other.size:
                if self._tails.get(block.small) is other:
                    self._tails[block.small] = block
                self._remove(other)
                if other is block.prev:
                    block.addr, block.prev = other.addr, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        self._insert(block)

    # ------------------------------------------------------------------ internals
    def _grow(self, size: int, small: bool) -> _Block:
        """Expandable segments: map pages at the end of the pool's one segment until its tail block holds `size`."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tails.get(small)
        if tail is None:
            self.segments += 1
            tail = _Block(self._next_addr + (0 if small else 1 << 40), 0, small)
            tail.used = True  # an empty placeholder: the first mapped pages follow it
            self._tails[small] = tail
        if tail.used:  # the new pages form a block of their own after the tail
            block = _Block(tail.addr + tail.size, 0, small)
            block.prev, tail.next = tail, block
        else:
            self._remove(tail)
            block = tail
        grow = -(-(size - block.size) // page) * page
        block.size += grow
        self._tails[small] = block
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _take(self, size: int, small: bool) -> _Block | None:
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1), key=lambda e: e[:2])
        if i == len(pool):
            return None
        return pool.pop(i)[2]

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.addr, block), key=lambda e: e[:2])

    def _remove(self, block: _Block) -> None:
        pool = self._pools[block.small]
        i = bisect.bisect_left(pool, (block.size, block.addr), key=lambda e: e[:2])
        del pool[i]

    def _new_segment(self, size: int, small: bool) -> _Block:
        block = _Block(self._next_addr, size, small)
        self._next_addr += size + ROUND_LARGE  # segments are not adjacent: never merged
        self.reserved += size
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block


def replay_step(events: list[tuple[int, int]], device: "str | object") -> AllocatorReplay:
    """A traced step's storage events on a CUDA device, with its cuBLAS workspaces, replayed."""
    import torch

    return replay(workspace_events(torch.cuda.get_device_capability(device)) + events)


def replay(events: Iterable[tuple[int, int]], model: CachingAllocatorModel | None = None,
           expandable: bool | None = None) -> AllocatorReplay:
    """Replay (key, bytes) allocations and (key, 0) frees, in order, through the allocator's rules
    (expandable: None reads PYTORCH_CUDA_ALLOC_CONF)."""
    if model is None:
        model = CachingAllocatorModel(expandable_from_env() if expandable is None else expandable)
    m = model
    for key, n in events:
        if n:
            m.malloc(key, n)
        else:
            m.free(key)
    return AllocatorReplay(m.peak_allocated, m.peak_reserved, m.allocated, m.reserved, m.segments)
