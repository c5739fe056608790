"""One rank of a framework running FSDP2 on CPU gloo processes, planned by memfit (launched by
tests/test_integrations_fsdp.py with torchrun): prints `RESULT {json}` with the plan's predicted per-rank
peak, the peak torch's MemTracker measured in the second optimizer step, and the losses.

    torchrun --nproc_per_node 2 tests/fsdp_worker.py accelerate|lightning BUDGET
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_llama as tl  # noqa: E402


def cpu_fsdp(accelerator, plugin) -> None:
    """accelerate turns FSDP on for GPUs and accelerators only; on CPU processes it is set here, as a GPU has it."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin


def run_accelerate(budget: str) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed._tools.mem_tracker import MemTracker

    from memfit.integrations.accelerate import prepare

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    acc = Accelerator(cpu=True)
    cpu_fsdp(acc, plugin)
    data = tl.batch(8, seed=acc.process_index)
    model, opt, plan = prepare(acc, tl.model(), budget, example={k: v[:4] for k, v in data.items()}, lr=1e-3)
    losses, peak = [], None
    for step in range(2):
        mt = None
        if step == 1:  # the second step: Adam's state exists
            mt = MemTracker()
            mt.track_external(model, opt.optimizer)
            mt.__enter__()
        for k in range(0, 4, plan.micro_batch):
            b = {key: v[4 * step + k: 4 * step + k + plan.micro_batch] for key, v in data.items()}
            with acc.accumulate(model):
                loss = model(**b).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        if mt is not None:
            mt.__exit__(None, None, None)
            peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {"rank": acc.process_index, "predicted": plan.predicted, "measured": peak, "losses": losses,
            "micro_batch": plan.micro_batch, "accumulation": plan.accumulation, "checkpoint": plan.checkpoint}


def run_lightning(budget: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import fully_shard

    from memfit.integrations.lightning_fsdp import apply_checkpointing, plan_fsdp2

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    model = tl.model()
    plan = plan_fsdp2(model, tl.batch(4), budget, strategy)
    out = {"losses": []}

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def configure_model(self):
            apply_checkpointing(self.model, plan)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, i):
            loss = self.model(**batch).loss
            out["losses"].append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

        def on_train_batch_start(self, batch, i):
            if i == plan.accumulation:  # the second optimizer step: Adam's state exists
                out["mt"] = MemTracker()
                out["mt"].track_external(self.model, self.trainer.optimizers[0])
                out["mt"].__enter__()
            elif "mt" in out and i > plan.accumulation:
                out["mt"].reset_mod_stats()

    rank = int(__import__("os").environ.get("RANK", "0"))
    data = tl.batch(8, seed=rank)
    rows = [{k: v[i] for k, v in data.items()} for i in range(8)]
    loader = torch.utils.data.DataLoader(rows, batch_size=plan.micro_batch)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=plan.accumulation, use_distributed_sampler=False)
    trainer.fit(Lit(), loader)
    out["mt"].__exit__(None, None, None)
    peak = out["mt"].get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {"rank": rank, "predicted": plan.predicted, "measured": peak, "losses": out["losses"],
            "micro_batch": plan.micro_batch, "accumulation": plan.accumulation, "checkpoint": plan.checkpoint}


if __name__ == "__main__":
    mode, budget = sys.argv[1], sys.argv[2]
    result = {"accelerate": run_accelerate, "lightning": run_lightning}[mode](budget)
    print("RESULT " + json.dumps(result), flush=True)
