"""The tracker's counts stay exact when offload worker threads mark host copies and free storages
while the training thread allocates."""
from __future__ import annotations

import sys
import threading

import pytest
import torch

from memfit.apply.optimizer import TrainingOptimizer
from memfit.core.tracker import mark_host, track
from memfit.models.gpt import GPT, GPTConfig

CFG = GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq=32)


@pytest.fixture
def fast_switching():
    """Switch threads every microsecond so unsynchronised read-modify-writes would interleave."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def recount(t) -> tuple[int, int]:
    """Device and host bytes recomputed from the live entries: what the running counters must say."""
    with t._lock:
        entries = list(t._live.values())
    device = sum(e.nbytes for e in entries if e.device and not e.host)
    host = sum(e.nbytes for e in entries if e.host)
    return device, host


def test_hammer_host_marks_and_frees_from_threads(fast_switching):
    n_threads, rounds, size = 4, 400, 256
    with track(device="cpu") as t:
        def worker():
            for _ in range(rounds):
                h = torch.empty(size)   # not seen by the tracker: dispatch modes are per thread
                mark_host(h)            # registered from this thread
                del h                   # freed from this thread (weakref callback here)

        threads = [threading.Thread(target=worker) for _ in range(n_threads)]
        for th in threads:
            th.start()
        kept = []
        for i in range(rounds):           # the training thread allocates and frees meanwhile
            kept.append(torch.empty(64))
            if i % 3 == 0:
                kept.pop(0)
        for th in threads:
            th.join()
        assert t._host_cur == 0 and t.host_peak_bytes >= size * 4
        assert recount(t) == (t.current_bytes, t._host_cur)
        assert t.current_bytes == sum(k.untyped_storage().nbytes() for k in kept)
        assert t.current_bytes == sum(t._cur)
    del kept


def test_hammer_marking_the_same_storages_from_many_threads(fast_switching):
    """The training thread re-marks optimizer state (state_tensors()) while the worker marks the
    chunk it just updated: concurrent marks of one storage move its bytes to host exactly once."""
    n_threads, count, size = 8, 300, 128
    with track(device="cpu") as t:
        for _ in range(5):
            tensors = [torch.empty(size) for _ in range(count)]  # device temporaries, as born
            assert t.current_bytes == count * size * 4
            barrier = threading.Barrier(n_threads)

            def worker():
                barrier.wait()
                for x in tensors:
                    mark_host(x)

            threads = [threading.Thread(target=worker) for _ in range(n_threads)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert (t.current_bytes, t._host_cur) == (0, count * size * 4)
            assert recount(t) == (0, count * size * 4)
            del tensors
            assert (t.current_bytes, t._host_cur) == (0, 0)


def _run(offload: str, final: bool, steps: int, tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = TrainingOptimizer(model, "adamw", offload=offload, chunk_bytes=4096,
                            spill_dir=str(tmp_path) if offload == "disk" else None)
    peaks = []
    try:
        with track(model, opt) as t:
            for _ in range(steps):
                t.reset_peak()
                x = torch.randint(0, CFG.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
                with opt.autocast():
                    logits, loss, n = model(x, x)
                opt.backward(loss / n, final=final)
                opt.step()
                del logits, loss, n, x  # nothing of the step outlives it
                peaks.append((t.peak_bytes, t.breakdown))
            early = opt.streamed.early_updates
            counted = recount(t)
            running = (t.current_bytes, t._host_cur)
            snapshot = t.snapshot()
        with track(model, opt) as fresh:  # counts the same state from scratch
            again = fresh.snapshot()
    finally:
        opt.close()
    weights = [p.detach().clone() for p in model.parameters()]
    return peaks, early, counted, running, snapshot, again, weights


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_early_chunk_updates_on_the_worker_lose_nothing(offload, tmp_path, fast_switching):
    """final=True: each of 19 small chunks is updated on the worker thread during backward, which
    marks host copies and frees storages there. The device figures equal a run whose updates all
    happen on the training thread, and the running counters equal a recount."""
    steps = 4
    threaded = _run(offload, True, steps, tmp_path)
    single = _run(offload, False, steps, tmp_path)
    assert threaded[1] >= 15 * steps and single[1] == 0  # chunk updates overlapped with backward
    assert threaded[0] == single[0]            # every step's device peak and breakdown
    for run in (threaded, single):
        _, _, counted, running, snapshot, again, _ = run
        assert counted == running               # no lost or doubled updates of the counters
        assert snapshot == again                # a fresh tracker agrees with the long-running one
    assert all(torch.equal(a, b) for a, b in zip(threaded[6], single[6]))  # same training
