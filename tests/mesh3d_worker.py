"""What one rank of a 3-D (pp, dp, tp) run does in the tests and in bench/mesh3d.py: three clipped AdamW
steps of a tiny Hugging Face causal LM on `distribute(model, "zero3", engine="fsdp2", pp=, tp=)`, the
third tracked by torch's MemTracker."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import hf_family_configs as fam

STEPS, ROWS, SEQ, MICRO = 3, 8, 16, 2  # ROWS: the global batch; each replica's rows split into MICRO
GPT = "gpt:layers=2,hidden=32,heads=4,vocab=256,seq=16"  # family "gpt": memfit's GPT (tied embeddings)


@dataclass(frozen=True)
class Layout:
    family: str
    pp: int
    tp: int
    schedule: str = "1f1b"
    checkpoint: bool = False
    tied: bool = False
    precision: str = "32-true"

    @property
    def name(self) -> str:
        return (f"{self.family} pp{self.pp} tp{self.tp} {self.schedule}" + (" ckpt" if self.checkpoint else "")
                + (" tied" if self.tied else "") + (f" {self.precision}" if self.precision != "32-true" else ""))

    def model(self):
        """The layout's model (seed 0), checkpointed where it asks for it (a Hugging Face model by its own
        gradient_checkpointing_enable, memfit's GPT by memfit's policy "full")."""
        import torch
        import transformers

        from memfit.models.spec import parse_model

        torch.manual_seed(0)
        if self.family == "gpt":  # memfit's own checkpoint policy, which the stage re-applies to its blocks
            from memfit.apply.checkpoint import checkpoint

            model = parse_model(GPT).build(SEQ)
            if self.checkpoint:
                checkpoint(model, "full")
            return model
        model = transformers.AutoModelForCausalLM.from_config(self.config())
        if self.checkpoint:
            model.gradient_checkpointing_enable()
        return model

    def config(self):
        cfg = fam.config(self.family)
        cfg.tie_word_embeddings = self.tied
        return cfg

    def write(self, folder) -> str:
        """The layout's config.json in folder/<name>/, its path (memfit's GPT: its spec)."""
        if self.family == "gpt":
            return GPT
        d = folder / self.name.replace(" ", "-")
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(self.config().to_json_string())
        return str(d / "config.json")

    def pairs(self, x):
        """(inputs, targets) of a batch of token ids: a Hugging Face model's labels are its inputs (it shifts
        them); memfit's GPT takes the next tokens (SEQ - 1 of them)."""
        return (x, x) if self.family != "gpt" else (x[:, :-1].contiguous(), x[:, 1:].contiguous())

    def one_process_losses(self) -> list[float]:
        if self.family != "gpt":
            return fam.one_process_losses(self.model(), fam.token_batches(STEPS, ROWS, SEQ))
        from memfit.apply.optimizer import TrainingOptimizer

        model, out = self.model(), []
        with TrainingOptimizer(model, "adamw", lr=1e-2, clip=1.0) as opt:  # as fam.one_process_losses
            for x in fam.token_batches(STEPS, ROWS, SEQ):
                _, loss_sum, n = model(*self.pairs(x))
                opt.backward(loss_sum / n)
                opt.step()
                out.append(float((loss_sum / n).detach()))
        return out


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

    opt = distribute(layout.model(), "zero3", "adamw", lr=1e-2, clip=1.0, engine="fsdp2", pp=layout.pp, tp=layout.tp,
                     microbatches=MICRO, schedule=layout.schedule, precision=layout.precision)
    losses = []
    for step, x in enumerate(fam.token_batches(STEPS, ROWS, SEQ)):
        tracker = _tracker() if step == STEPS - 1 else contextlib.nullcontext()
        if step == STEPS - 1:
            tracker.track_external(opt.stage_module, opt.inner)
        with tracker:
            losses.append(opt.accumulate_step([layout.pairs(x)])[0])
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {"losses": losses, "total": int(peak["Total"]), "place": (opt.rank, opt.dp_rank, opt.tp_rank)}


def runs(rank: int, world: int, layouts: list[Layout]) -> dict:
    """Each layout's run on this rank (under memfit.distributed.spawn.run_world)."""
    return {lay: run(lay, rank, world) for lay in layouts}
