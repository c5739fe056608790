"""One rank of a framework running FSDP2 on CPU gloo processes, planned by memfit (launched by
tests/test_integrations_fsdp.py with torchrun): prints `RESULT {json}` with the plan's predicted per-rank
peak, the peak torch's MemTracker measured in the second optimizer step, and the losses.

    torchrun --nproc_per_node 2 tests/fsdp_worker.py accelerate BUDGET
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


if __name__ == "__main__":
    mode, budget = sys.argv[1], sys.argv[2]
    result = {"accelerate": run_accelerate}[mode](budget)
    print("RESULT " + json.dumps(result), flush=True)
