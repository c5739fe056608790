"""Disk kinds are traced only where they could give a faster plan (memfit.plan.disk_plan.cannot_beat,
search.DEFER_PLAIN_DISK): the plan is the same as with the shortcut off, with fewer traces."""
import pytest

import memfit
from memfit.plan import disk_plan, disk_profile, search


def _plan(monkeypatch, on: bool, spec: str, **kw):
    """(the plan's actions, predicted peak, head chunks, micro-batch, accumulation; disk-trace count)."""
    monkeypatch.setattr(disk_plan, "BOUND_DISK", on)
    monkeypatch.setattr(search, "DEFER_PLAIN_DISK", on)
    monkeypatch.setattr(disk_profile, "_CACHE", {})
    calls, real = [], disk_profile.trace_disk
    monkeypatch.setattr(disk_profile, "trace_disk", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = memfit.fit(spec, device="cpu", **kw)
    return ([str(a) for a in p.actions], p.predicted_peak, p.head_chunks, p.micro_batch, p.accumulation), len(calls)


@pytest.mark.slow  # (about 10 CPU-s: two plans, one of them tracing the disk kinds)
def test_the_bound_skips_disk_traces_and_keeps_the_plan(monkeypatch):
    # Attention scores (seq 128, hidden 32) make recomputing a block cheap beside moving its bytes to disk:
    # the no-disk solver at larger budgets shows no disk plan can be faster, so none is traced.
    spec, kw = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=128", dict(budget="1500KiB", batch=2, seq=128,
                                                                        allow="recompute,offload-disk")
    fast, traced_fast = _plan(monkeypatch, True, spec, **kw)
    plain, traced_plain = _plan(monkeypatch, False, spec, **kw)
    assert fast == plain and "recompute" in fast[0]  # the control: the plan costs time, so disk is a rival
    assert traced_plain == 1 and traced_fast == 0


@pytest.mark.slow
def test_the_plain_head_set_aside_keeps_the_plan(monkeypatch):
    # The plain head fits only with disk kinds; a chunked head fits without them and is faster than any
    # plain-head disk plan could be, so the plain head's disk kinds are not traced.
    spec, kw = "gpt:layers=2,hidden=32,heads=2,vocab=2048,seq=128", dict(budget="6MiB", batch=4, seq=128,
                                                                          allow="recompute,offload-disk,chunked-head")
    fast, traced_fast = _plan(monkeypatch, True, spec, **kw)
    plain, traced_plain = _plan(monkeypatch, False, spec, **kw)
    assert fast == plain and fast[2]  # the control: the head is chunked
    assert traced_fast < traced_plain
