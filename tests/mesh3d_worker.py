"""What one rank of a 3-D (pp, dp, tp) run does in the tests and in bench/mesh3d.py: three clipped AdamW
steps of a tiny Hugging Face causal LM on `distribute(model, "zero3", engine="fsdp2", pp=, tp=)`, the
third tracked by torch's MemTracker."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import hf_family_configs as fam

STEPS, ROWS, SEQ, MICRO = 3, 8, 16, 2  # ROWS: the global batch; each replica's rows split into MICRO


@dataclass(frozen=True)
class Layout:
    family: str
    pp: int
    tp: int
    schedule: str = "1f1b"
    checkpoint: bool = False

    @property
    def name(self) -> str:
        return f"{self.family} pp{self.pp} tp{self.tp} {self.schedule}" + (" ckpt" if self.checkpoint else "")


def _tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    class StageTracker(MemTracker):
        """torch's MemTracker over a pipeline stage. The stage runs once per micro-batch, and MemTracker takes
        a root module's second forward for the next iteration and refuses it; per-module statistics are kept
        from the first micro-batch (the totals compared here come from every allocation either way)."""

        def _pre_fw_hook(self, module, inputs) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                return
            super()._pre_fw_hook(module, inputs)

    return StageTracker()


def run(layout: Layout, rank: int, world: int) -> dict:
    from memfit.distributed import distribute

    model = fam.model(layout.family)
    if layout.checkpoint:
        model.gradient_checkpointing_enable()
    opt = distribute(model, "zero3", "adamw", lr=1e-2, clip=1.0, engine="fsdp2", pp=layout.pp, tp=layout.tp,
                     microbatches=MICRO, schedule=layout.schedule)
    losses = []
    for step, x in enumerate(fam.token_batches(STEPS, ROWS, SEQ)):
        tracker = _tracker() if step == STEPS - 1 else contextlib.nullcontext()
        if step == STEPS - 1:
            tracker.track_external(opt.stage_module, opt.inner)
        with tracker:
            losses.append(opt.accumulate_step([(x, x)])[0])
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {"losses": losses, "total": int(peak["Total"]), "place": (opt.rank, opt.dp_rank, opt.tp_rank)}


def runs(rank: int, world: int, layouts: list[Layout]) -> dict:
    """Each layout's run on this rank (under memfit.distributed.spawn.run_world)."""
    return {lay: run(lay, rank, world) for lay in layouts}
