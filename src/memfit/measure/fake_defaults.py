"""Fake tensors take the kernels that real tensors would.

torch.optim and torch.nn.utils pick their implementation from the tensors' type: on CUDA, plain
tensors get the foreach kernels (one temporary per list, e.g. AdamW's `exp_avg_sq.sqrt()` for all
parameters at once), any subclass gets the per-tensor loop (one small temporary at a time). A
FakeTensor is a subclass, so a fake trace would run the loop and miss the real step's optimizer
peak, by gigabytes on a large model (seen on an H100: a 0.67B Llama's full-checkpoint step read
8.9% low). Inside `real_tensor_defaults()` FakeTensor counts as a plain tensor for that choice.
On CPU nothing changes: foreach is not the default there for any tensor type.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def real_tensor_defaults() -> Iterator[None]:
    import torch.optim.optimizer as optim_mod
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _foreach_utils

    lists = [getattr(m, "_foreach_supported_types", None) for m in (optim_mod, _foreach_utils)]
    added = [ls for ls in lists if isinstance(ls, list) and FakeTensor not in ls]
    for ls in added:
        ls.append(FakeTensor)
    try:
        yield
    finally:
        for ls in added:
            ls.remove(FakeTensor)
