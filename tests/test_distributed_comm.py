"""memfit.distributed.comm on gloo: results, and buffers freed where the caller drops them."""
from __future__ import annotations

import weakref

import pytest

from memfit.distributed.spawn import run_world

CALLS = 40  # per collective: without the wait, gloo still held 2 to 10 of each 40 here (about 1 call in 7)


def _freed_where_dropped(rank: int, world: int) -> dict:
    """Per collective: how many of its buffers outlived the caller's last reference, and the results."""
    import torch

    from memfit.distributed import comm

    ops = {
        "reduce_scatter_": lambda t: comm.reduce_scatter_(t).clone(),
        "all_reduce": lambda t: (comm.all_reduce(t), t.clone())[1],
        "reduce": lambda t: (comm.reduce(t, 0), t.clone())[1],
        "broadcast": lambda t: (comm.broadcast(t, 1), t.clone())[1],
        "control_sum": lambda t: torch.tensor(comm.control_sum(t[:2].tolist())),
    }
    out = {}
    for name, op in ops.items():
        late, result = 0, None
        for _ in range(CALLS):
            t = torch.full((4096,), float(rank + 1))
            result = op(t)
            ref = weakref.ref(t.untyped_storage())
            del t
            late += ref() is not None  # still alive: held by the backend, freed later on its thread
        out[name] = (late, result[:2].tolist())
    return out


@pytest.mark.multiproc
def test_gloo_collectives_leave_no_reference_behind_and_sum():
    got = run_world(_freed_where_dropped, 2, timeout_s=120)
    for rank, res in enumerate(got):
        assert {k: late for k, (late, _) in res.items()} == dict.fromkeys(res, 0), (rank, res)
        assert res["reduce_scatter_"][1] == [3.0, 3.0] and res["all_reduce"][1] == [3.0, 3.0]
        assert res["broadcast"][1] == [2.0, 2.0] and res["control_sum"][1] == [3.0, 3.0]
    assert got[0]["reduce"][1] == [3.0, 3.0]  # the root has the sum
