"""torch's FSDP2 layouts measured per rank, next to `memfit estimate --strategy zero3 --world N`.

A layout is FSDP2's `fully_shard` on every block and then the root (reshard_after_forward true or
false), optionally torch's `checkpoint_wrapper` on every block first (torchtitan's and accelerate's
order) or Hugging Face's own `gradient_checkpointing_enable`. `tracked(rank, world, cases)` runs
each case on the spawned gloo ranks (three AdamW steps, the third tracked by torch's MemTracker,
which sees FSDP2's storage resizes; memfit's tracker does not) and `estimated(case, world)` asks the
CLI as a user would. Shared by tests/test_fsdp2_layouts.py and bench/fsdp2_layouts.py.
"""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch

WRAPPERS = ("none", "checkpoint_wrapper", "hf")
"""How the blocks are checkpointed: not at all, torch's checkpoint_wrapper, Hugging Face's own."""
ESTIMATE_POLICY = {"none": "none", "checkpoint_wrapper": "wrapper", "hf": "full"}
"""The memfit policy that estimates each (measured: Hugging Face's own drops the KV cache, as full does)."""


@dataclass(frozen=True)
class Case:
    model: str
    reshard: bool = True
    wrapper: str = "none"
    batch: int = 2
    seq: int = 32

    @property
    def name(self) -> str:
        model = Path(self.model).parent.name if self.model.endswith(".json") else self.model.split(",")[0]
        return f"{model} reshard={self.reshard} ckpt={self.wrapper}"

    @property
    def strategy(self) -> str:
        # reshard_after_forward=False keeps each block's gathered weights from its forward to its
        # backward: at the backward's start every weight is whole on every rank, as in ZeRO-2.
        return "zero3" if self.reshard else "zero2"


def _build(case: Case, world: int):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memfit.apply.checkpoint import find_blocks
    from memfit.models.spec import parse_model

    spec = parse_model(case.model)
    model = spec.build(seq=case.seq)
    model.train()
    if case.wrapper == "hf":
        model.gradient_checkpointing_enable()
    blocks = find_blocks(model)
    if case.wrapper == "checkpoint_wrapper":
        for i in range(len(blocks)):
            blocks[i] = checkpoint_wrapper(blocks[i])
    mesh = init_device_mesh("cpu", (world,))
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=case.reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=case.reshard)
    vocab = spec.config.vocab if spec.config is not None else model.config.vocab_size
    return model, vocab


def _loss(model, x):
    from memfit.models.gpt import GPT

    if isinstance(model, GPT):
        _, loss_sum, n = model(x, x)
        return loss_sum / n
    return model(input_ids=x, labels=x).loss


def _one(case: Case, rank: int, world: int) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model, vocab = _build(case, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3):
        x = torch.randint(0, vocab, (case.batch * world, case.seq), generator=g)
        x = x[rank * case.batch:(rank + 1) * case.batch]
        mt = MemTracker() if step == 2 else None
        if mt is not None:
            mt.track_external(model, opt)
        with mt if mt is not None else contextlib.nullcontext():
            loss = _loss(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    peak = mt.get_tracker_snapshot("peak")
    cats = next(iter(peak.values()))
    return {"total": int(cats["Total"]), "losses": losses,
            **{getattr(k, "value", str(k)): int(v) for k, v in cats.items() if k != "Total"}}


def tracked(rank: int, world: int, cases: list[Case]) -> dict[Case, dict]:
    """Each case's MemTracker peak on this rank (run under memfit.distributed.spawn.run_world)."""
    return {c: _one(c, rank, world) for c in cases}


def estimated(case: Case, world: int) -> int:
    """`memfit estimate ... --strategy zero3|zero2 --world N --checkpoint P --json`: the largest rank's total."""
    from memfit.cli import main

    args = ["estimate", case.model, "--batch", str(case.batch), "--seq", str(case.seq), "--json",
            "--strategy", case.strategy, "--world", str(world), "--checkpoint", ESTIMATE_POLICY[case.wrapper]]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0, args
    return json.loads(buf.getvalue())["per_device"]["total"]


def errors(cases: list[Case], world: int, measured: list[dict]) -> list[dict]:
    """One row per case: the estimate, each rank's measured peak and the relative errors."""
    rows = []
    for c in cases:
        est = estimated(c, world)
        got = [measured[r][c]["total"] for r in range(world)]
        rows.append({"case": c.name, "model": c.model, "reshard": c.reshard, "wrapper": c.wrapper,
                     "strategy": c.strategy, "policy": ESTIMATE_POLICY[c.wrapper], "world": world,
                     "batch": c.batch, "seq": c.seq, "estimate": est, "measured": got,
                     "error": [(est - m) / m for m in got]})
    return rows
