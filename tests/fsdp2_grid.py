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

from rank_grid import loss_of

WRAPPERS = ("none", "checkpoint_wrapper", "hf", "full")
"""How the blocks are checkpointed: not at all, torch's checkpoint_wrapper, Hugging Face's own, memfit's full."""
ESTIMATE_POLICY = {"none": "none", "checkpoint_wrapper": "wrapper", "hf": "full", "full": "full"}
"""The memfit policy that estimates each (measured: Hugging Face's own drops the KV cache, as full does)."""


@dataclass(frozen=True)
class Case:
    model: str
    reshard: bool | int = True
    """FSDP2's reshard_after_forward: True, False, or N (a 1/N shard kept from forward to backward)."""
    wrapper: str = "none"
    batch: int = 2
    seq: int = 32
    engine: str = "fsdp2"
    """fsdp2 (memfit.distributed.fsdp2, measured by torch's MemTracker) or memfit's own flat engine
    (measured by memfit's tracker, as tests/rank_grid.py does)."""
    policy: str | None = None
    """The --checkpoint the estimate is asked with; None: ESTIMATE_POLICY's for the wrapper."""
    precision: str = "32-true"

    @property
    def name(self) -> str:
        model = Path(self.model).parent.name if self.model.endswith(".json") else self.model.split(",")[0]
        return f"{model} {self.engine} reshard={self.reshard} ckpt={self.wrapper} est={self.estimate_policy}"

    @property
    def estimate_policy(self) -> str:
        return self.policy or ESTIMATE_POLICY[self.wrapper]

    @property
    def strategy(self) -> str:
        # reshard_after_forward=False keeps each block's gathered weights from its forward to its
        # backward: at the backward's start every weight is whole on every rank, as in ZeRO-2.
        return "zero2" if self.reshard is False else "zero3"


def _build(case: Case):
    """(optimizer with memfit's strategy interface, vocabulary size)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from memfit.apply.checkpoint import checkpoint, find_blocks
    from memfit.distributed import distribute
    from memfit.models.spec import parse_model

    spec = parse_model(case.model)
    model = spec.build(seq=case.seq)
    model.train()
    if case.wrapper == "hf":
        model.gradient_checkpointing_enable()
    elif case.wrapper == "full":
        checkpoint(model, "full")
    elif case.wrapper == "checkpoint_wrapper":
        blocks = find_blocks(model)
        for i in range(len(blocks)):
            blocks[i] = checkpoint_wrapper(blocks[i])
    if case.engine == "fsdp2" and not isinstance(case.reshard, bool):  # an int: FSDP2's own option
        from memfit.distributed.fsdp2 import FSDP2Optimizer

        opt = FSDP2Optimizer(model, "adamw", lr=1e-3, precision=case.precision, reshard=case.reshard)
    else:
        opt = distribute(model, case.strategy, "adamw", lr=1e-3, engine=case.engine, precision=case.precision)
    return opt, spec.config.vocab if spec.config is not None else model.config.vocab_size


def _one(case: Case, rank: int, world: int) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    from memfit.core.tracker import track

    torch.manual_seed(0)
    opt, vocab = _build(case)
    g = torch.Generator().manual_seed(1)
    losses, cats = [], {}
    for step in range(3):
        x = torch.randint(0, vocab, (case.batch * world, case.seq), generator=g)
        x = x[rank * case.batch:(rank + 1) * case.batch]
        if step < 2:
            tracker = contextlib.nullcontext()
        elif case.engine == "fsdp2":
            tracker = MemTracker()
            tracker.track_external(opt.model, opt.inner)
        else:
            tracker = track(opt.tracked_module, opt, device="cpu")
        with tracker:
            with opt.micro_batch(True), opt.autocast():
                loss = loss_of(opt.model, x)
            opt.backward(loss / world, final=True)  # both engines sum the ranks' gradients, as memfit's strategies do
            opt.step()
        losses.append(loss.item())
    if case.engine == "fsdp2":
        cats = next(iter(tracker.get_tracker_snapshot("peak").values()))
        total = int(cats.pop("Total"))
    else:
        total = tracker.breakdown["total"]
    opt.close()
    return {"total": total, "losses": losses, **{getattr(k, "value", str(k)): int(v) for k, v in cats.items()}}


def tracked(rank: int, world: int, cases: list[Case]) -> dict[Case, dict]:
    """Each case's MemTracker peak on this rank (run under memfit.distributed.spawn.run_world)."""
    return {c: _one(c, rank, world) for c in cases}


def estimated(case: Case, world: int, engine: str | None = None) -> int:
    """`memfit estimate ... --world N --checkpoint P --json` as a user asks it, the largest rank's total:
    FSDP2 with `--engine fsdp2 --reshard-after-forward R`, memfit's engine with `--strategy zero3|zero2`;
    `engine` (default: the case's) "memfit" asks the ZeRO estimate of an FSDP2 case."""
    from memfit.cli import main

    args = ["estimate", case.model, "--batch", str(case.batch), "--seq", str(case.seq), "--json",
            "--precision", case.precision, "--world", str(world), "--checkpoint", case.estimate_policy]
    if (engine or case.engine) == "fsdp2":
        args += ["--engine", "fsdp2", "--reshard-after-forward", str(case.reshard).lower()]
    else:
        args += ["--strategy", case.strategy, "--engine", "memfit"]
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
                     "engine": c.engine, "strategy": c.strategy, "policy": c.estimate_policy, "world": world,
                     "batch": c.batch, "seq": c.seq, "estimate": est, "measured": got,
                     "error": [(est - m) / m for m in got]})
    return rows
