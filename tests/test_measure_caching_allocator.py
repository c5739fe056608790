"""The caching-allocator replay follows PyTorch's default rules (memfit.measure.caching_allocator)."""
from hypothesis import given, settings, strategies as st

from memfit.measure.caching_allocator import CachingAllocatorModel, replay, round_size, segment_size

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(4096) == 4096
    assert segment_size(1024) == 2 * MiB and segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == 20 * MiB and segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(12 * MiB + 512) == 14 * MiB


def test_small_request_takes_a_two_mib_segment():
    r = replay([(1, 1000)])
    assert (r.peak_allocated, r.peak_reserved, r.segments) == (1024, 2 * MiB, 1)


def test_large_block_is_split_only_when_over_one_mib_remains():
    r = replay([(1, 12 * MiB + 1)])  # 14 MiB segment, ~2 MiB left over: split
    assert (r.peak_allocated, r.peak_reserved) == (12 * MiB + 512, 14 * MiB)
    r = replay([(1, 11 * MiB + MiB // 2)])  # 12 MiB segment, 0.5 MiB left: handed out whole
    assert (r.peak_allocated, r.peak_reserved) == (12 * MiB, 12 * MiB)


def test_freed_block_merges_and_serves_a_later_request_whole():
    r = replay([(1, 4 * MiB), (1, 0), (2, 19 * MiB + MiB // 2)])
    assert r.peak_reserved == 20 * MiB  # the merged 20 MiB block served the second request
    assert r.allocated == 20 * MiB      # with its 0.5 MiB tail: not split off


def test_best_fit_takes_the_smallest_block_that_holds_the_request():
    m = CachingAllocatorModel()
    m.malloc(1, 12 * MiB)   # segment A: 12 MiB exactly
    m.malloc(2, 16 * MiB)   # segment B: 16 MiB exactly
    m.free(1)
    m.free(2)
    m.malloc(3, 11 * MiB + MiB // 2)  # fits both: takes A (12 MiB), whole
    assert (m.allocated, m.reserved) == (12 * MiB, 28 * MiB)
    m.malloc(4, 15 * MiB)  # takes B whole (1 MiB left is not over 1 MiB)
    assert (m.allocated, m.reserved, m.segments) == (28 * MiB, 28 * MiB, 2)


def test_a_request_larger_than_any_free_block_grows_the_reserve():
    r = replay([(1, 2 * MiB), (1, 0), (2, 21 * MiB)])
    assert r.peak_reserved == 20 * MiB + 22 * MiB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40 * MiB)), min_size=1, max_size=60), st.randoms())
def test_accounting_invariants(ops, rnd):
    """allocated <= reserved always; when everything is freed, nothing is allocated and each
    segment is one free block again (splits merged back)."""
    m = CachingAllocatorModel()
    live = []
    for key, (alloc, n) in enumerate(ops):
        if alloc or not live:
            m.malloc(key, n)
            live.append(key)
            assert m.allocated >= round_size(n)
        else:
            m.free(live.pop(rnd.randrange(len(live))))
        assert m.allocated <= m.reserved
    for key in live:
        m.free(key)
    assert m.allocated == 0
    free_blocks = [b for pool in m._pools.values() for _, _, b in pool]
    assert len(free_blocks) == m.segments and sum(b.size for b in free_blocks) == m.reserved


def test_cublas_workspace_size_follows_torchs_rule():
    from memfit.measure.caching_allocator import cublas_workspace_bytes, workspace_events

    assert cublas_workspace_bytes((9, 0), "") == 32 * MiB
    assert cublas_workspace_bytes((8, 0), "") == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((9, 0), ":4096:8") == 32 * MiB
    assert cublas_workspace_bytes((8, 6), ":4096:2:16:8") == 8 * MiB + 128 * 1024
    r = replay(workspace_events((9, 0)) + [(1, 4 * MiB)])
    assert r.peak_reserved == 2 * 32 * MiB + 20 * MiB  # each workspace is a segment of its own


def test_replays_real_h100_allocator_traces():
    """Twelve training runs' allocator snapshots from an H100 (torch 2.11; bench/gpu_estimate.py
    --collect): fed the real requests and the real segment addresses, the model's peak reserve is the
    allocator's to the byte; with its own addresses (a prediction's case) within 3.5%."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from gpu_allocator_check import KEPT, check, traces

    runs = traces(KEPT)
    assert len(runs) == 12
    for name, trace in runs.items():
        real, own, with_addresses = check(trace)
        assert with_addresses == real, name
        assert abs(own - real) <= 0.035 * real, name
