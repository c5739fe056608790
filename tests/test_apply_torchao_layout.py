"""torchao's own AdamW8bit / AdamW4bit: the state formula (memfit.apply.torchao_layout) against the
storages their optimizers really allocate."""
import pytest
import torch

from memfit.apply import lowbit
from memfit.apply import torchao_layout as layout


def _storage_bytes(t: torch.Tensor, seen: set) -> int:
    """Bytes of the distinct storages under `t` (a tensor subclass: its inner tensors)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(_storage_bytes(getattr(t, n), seen) for n in names)
    key = t.untyped_storage().data_ptr()
    if key in seen:
        return 0
    seen.add(key)
    return t.untyped_storage().nbytes()


@pytest.mark.skipif(not lowbit.available(), reason="torchao (memfit[lowbit]) is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_formula_equals_torchaos_state(bits, dtype, monkeypatch):
    from torchao.optim import AdamW4bit, AdamW8bit

    # torchao compiles its per-parameter update (tens of seconds on two cores); eager here allocates
    # the same state, which is created before the update runs.
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    # quantized; >= 4096 elements with a partial last block (kept plain); at the threshold; small
    shapes = [(64, 128), (100, 50), (4096,), (32,), (128, 40)]
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
    opt = (AdamW8bit if bits == 8 else AdamW4bit)(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    seen: set = set()
    real = sum(_storage_bytes(v, seen) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    real += sum(_storage_bytes(g["lr"], seen) for g in opt.param_groups)
    assert real == layout.state_bytes(params, bits)
    # where memfit's own format differs: (100, 50) is quantized there, with a partial last block
    assert lowbit.quantized(5000) and not layout.quantized(5000, bits)
