"""state_dict / load_state_dict of the streamed optimizer: masters and every chunk's optimizer state
gathered into plain CPU containers (loads with torch.load(weights_only=True)), and put back.
`opt` is a memfit.apply.optim_offload.StreamedOptimizer (not imported: it imports this module)."""
from __future__ import annotations

from typing import Any

import torch

from memfit.apply import chunk_layout as layout
from memfit.core.errors import ConfigError
from memfit.core.tracker import mark_host


def _cpu_copy(v: object) -> object:
    return v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v


def streamed_state_dict(opt: Any) -> dict:
    masters, chunks = [], []
    for k, c in enumerate(opt.chunks):
        state = opt.files.load_state(k, c.nbytes) if opt.files is not None else None
        if state is not None:
            layout.attach(c, opt.masters, state)
        masters.extend(opt.masters[i].detach().to("cpu", copy=True) for i in c.idx)
        sd = c.optimizer.state_dict()
        sd["state"] = {n: {key: _cpu_copy(v) for key, v in s.items()} for n, s in sd["state"].items()}
        chunks.append(sd)
        if state is not None:
            opt.buffers.release(layout.detach(c, opt.masters, state))
    return {"masters": masters, "chunks": chunks, "chunk_sizes": [len(c.idx) for c in opt.chunks]}


def load_streamed_state(opt: Any, state: dict) -> None:
    sizes = [len(c.idx) for c in opt.chunks]
    if list(state["chunk_sizes"]) != sizes or len(state["masters"]) != len(opt.params):
        raise ConfigError(
            "optimizer checkpoint was written for a different model or chunking "
            f"(chunks of {list(state['chunk_sizes'])} parameters, here {sizes})"
        )
    for k, c in enumerate(opt.chunks):
        if opt.files is not None:
            for i in c.idx:
                opt.masters[i].data = torch.empty(opt.params[i].shape, dtype=opt.master_dtype)
        for i in c.idx:
            opt.masters[i].data.copy_(state["masters"][i])
            opt.params[i].data.copy_(opt.masters[i].detach())
        c.optimizer.load_state_dict(state["chunks"][k])
        if opt.files is not None:
            c.masters_only(opt.masters)
            opt.files.save_state(k, layout.detach(c, opt.masters, layout.pack(c, opt.masters)))
    if opt.where == "cpu":
        for t in opt.state_tensors():
            mark_host(t)
