"""fit_trainer on a Hugging Face Trainer running FSDP2 on 2 gloo processes: the plan's per-rank peak
against the per-rank peak torch's trackers measure in the Trainer's second step.

    PYTHONPATH=src python bench/trainer_fsdp2.py          # writes bench/results/trainer_fsdp2.json

A tiny Llama (hidden 64, 2 layers, vocab 256), batch 4 x 32 tokens per rank, fsdp="full_shard",
fsdp_config {"fsdp_version": 2}, AdamW, fp32 (and bf16=True for one budget), under
`torchrun --nproc_per_node 2`, for budgets that make
the plan keep the batch, split it (micro-batch 2 x accumulation 2) and recompute every decoder layer
(micro-batch 4, memfit's recomputation). Each rank measures its step with torch.distributed._tools' FSDPMemTracker and,
in a second run, MemTracker (both count tensors, FSDP2's resized storages included). accelerate
turns FSDP on for GPUs and accelerators only (on CPU processes the Trainer would run DDP), so the
worker sets the accelerator's state to FSDP with the plugin the Trainer built, as a GPU run has it.
The same model under torch's fully_shard without a framework (`bare`) is measured the same way.
Memory figures are exact byte counts (no timing): one run of each is enough.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = [("64MiB", "keeps the batch", "fp32"), ("2.3MiB", "splits the batch", "fp32"),
         ("2.05MiB", "recomputes", "fp32"), ("64MiB", "keeps the batch", "bf16")]
TRACKERS = ("fsdp", "plain")


def cpu_fsdp(trainer) -> None:
    """The Trainer's accelerator set to FSDP with the plugin the Trainer built from fsdp=/fsdp_config
    (what accelerate does on a GPU; on CPU processes it leaves FSDP off)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
    trainer.is_fsdp_enabled = True


def _peak_callback(kind: str):
    from transformers import TrainerCallback

    class Peak(TrainerCallback):
        """The second step's peak (the first creates Adam's state), from torch's tracker."""

        def __init__(self) -> None:
            self.mt, self.peak = None, None

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == 1:
                opt = getattr(optimizer, "optimizer", optimizer)
                if kind == "fsdp":
                    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
                    self.mt = FSDPMemTracker(model, opt)
                else:
                    from torch.distributed._tools.mem_tracker import MemTracker
                    self.mt = MemTracker()
                    self.mt.track_external(model, opt)
                self.mt.__enter__()

        def on_substep_end(self, args, state, control, **kw):
            if self.mt is not None:  # a later micro-batch runs the modules again: their stats restart
                self.mt.reset_mod_stats()  # (the peak is the tracker's, kept)

        def on_step_end(self, args, state, control, **kw):
            if self.mt is not None:
                self.mt.__exit__(None, None, None)
                snap = self.mt.get_tracker_snapshot("peak")
                self.peak = {str(k).split(".")[-1]: v for cats in snap.values() for k, v in cats.items()}
                self.mt = None
    return Peak()


def worker(budget: str, kind: str, precision: str = "fp32") -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from memfit.integrations.hf import fit_trainer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    g = torch.Generator().manual_seed(1)
    ds = [{"input_ids": (ids := torch.randint(0, 256, (32,), generator=g)), "labels": ids.clone()} for _ in range(64)]
    args = TrainingArguments(output_dir=os.environ.get("TMPDIR", "/tmp") + "/memfit-trainer-fsdp2", use_cpu=True,
                             per_device_train_batch_size=4, max_steps=2, fsdp="full_shard",
                             fsdp_config={"fsdp_version": 2}, report_to=[], save_strategy="no", disable_tqdm=True,
                             bf16=precision == "bf16")
    peak = _peak_callback(kind)
    trainer = Trainer(model=LlamaForCausalLM(cfg), args=args, train_dataset=ds, callbacks=[peak])
    cpu_fsdp(trainer)
    plan = fit_trainer(trainer, budget=budget)
    trainer.train()
    print("RESULT " + json.dumps({"rank": args.process_index, "predicted": plan.predicted, "measured": peak.peak,
                                  "micro_batch": plan.micro_batch, "accumulation": plan.accumulation,
                                  "checkpoint": plan.checkpoint, "summary": plan.summary()}), flush=True)


def bare(kind: str) -> None:
    """The same model and batch under torch's fully_shard directly (each decoder layer, then the root), the
    loop `model(**batch).loss.backward(); opt.step()`: what the estimate is of, without a framework."""
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.integrations.fsdp import hf_spec, rank_estimate, setup_of

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    with tempfile.TemporaryDirectory() as folder:
        predicted = rank_estimate(hf_spec(model, folder), 4, 32, setup_of(2, "no", True, False), "adamw",
                                  "none").per_device["total"]
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(2):
        if step == 1:
            mt = MemTracker()
            mt.track_external(model, opt)
            mt.__enter__()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    mt.__exit__(None, None, None)
    peak = {str(k).split(".")[-1]: v for k, v in mt.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "predicted": predicted, "measured": peak, "micro_batch": 4,
                                  "accumulation": 1, "checkpoint": "none", "summary": "bare fully_shard"}), flush=True)
    dist.destroy_process_group()


def table(r: dict) -> str:
    """Each run's plan and rank 0's figures (rank 1's are marked where they differ)."""
    lines = ["| run | tracker | plan per rank | predicted | measured | predicted / measured |",
             "|---|---|---|---:|---:|---:|"]
    for row in (x for x in r["rows"] if x["rank"] == 0):
        other = [x for x in r["rows"] if x["rank"] == 1 and x["budget"] == row["budget"] and
                 x["tracker"] == row["tracker"] and x["plan"] == row["plan"] and
                 x.get("precision") == row.get("precision")]
        same = "" if all(o["measured"]["Total"] == row["measured"]["Total"] for o in other) else " (rank 1 differs)"
        run = (f"Trainer, {row.get('precision', 'fp32')}, budget {row['budget']}" if row["budget"]
               else "fully_shard, no framework, fp32")
        plan = (f"{row['micro_batch']} x {row['accumulation']}"
                + (", every layer recomputed" if row["checkpoint"] == "full" else ""))
        tracker = "FSDPMemTracker" if row["tracker"] == "fsdp" else "MemTracker"
        lines.append(f"| {run} | {tracker} | {plan} | {row['predicted']:,} | {row['measured']['Total']:,}{same} | "
                     f"{row['ratio']:.3f} |")
    return "\n".join(lines)


def snippets(r: dict) -> dict[str, str]:
    """The table in docs/integrations.md (between <!-- bench:trainer_fsdp2 --> and its end) and the line
    rank 0 prints (the 2.3MiB budget's)."""
    line = next(x["summary"] for x in r["rows"] if x["rank"] == 0 and x["budget"] == "2.3MiB")
    return {"trainer_fsdp2": table(r), "trainer_fsdp2_output": f"```\n{line}\n```"}


def render(r: dict) -> str:
    return ("## FSDP2 ranks planned by fit_trainer: predicted against measured per-rank peak\n\n"
            "`python bench/trainer_fsdp2.py`: a tiny Llama (hidden 64, 2 layers, vocabulary 256), 4 x 32 tokens per "
            "rank, HF Trainer with fsdp='full_shard' and FSDP2 on 2 gloo processes under torchrun, AdamW; bytes "
            "of the second step's peak on each rank from torch's trackers, against fit_trainer's prediction.\n\n"
            + table(r) + "\n")


def _launch(budget: str, kind: str, port: int, precision: str = "fp32") -> list[dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(port), __file__, "--worker", budget, kind,
           precision]
    with tempfile.TemporaryDirectory() as scratch:  # torchrun's log folder (torchelastic_*): torchrun never removes it
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "TMPDIR": scratch})
    # the ranks' lines may interleave: each result is decoded from where its marker starts
    decoder, text = json.JSONDecoder(), out.stdout
    rows = [decoder.raw_decode(text, i + len("RESULT "))[0] for i in range(len(text)) if text.startswith("RESULT ", i)]
    if out.returncode or len(rows) != 2:
        raise SystemExit(f"torchrun failed ({out.returncode}): {out.stderr[-2000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    sys.path.insert(0, str(HERE))
    from common import save

    rows = []
    for i, (budget, what, precision) in enumerate(CASES):
        for j, kind in enumerate(TRACKERS):
            for r in _launch(budget, kind, 29600 + 2 * i + j, precision):
                total = r["measured"]["Total"]
                rows.append({"budget": budget, "plan": what, "tracker": kind, "precision": precision, **r,
                             "ratio": round(r["predicted"] / total, 4)})
                print(f"{budget} {kind} rank {r['rank']}: predicted {r['predicted']} measured {total} "
                      f"({rows[-1]['ratio']}x)", file=sys.stderr, flush=True)
    for r in _launch("-", "bare", 29620):
        total = r["measured"]["Total"]
        rows.append({"budget": None, "plan": "bare fully_shard", "tracker": "plain", **r,
                     "ratio": round(r["predicted"] / total, 4)})
    print(save("trainer_fsdp2", {"rows": rows}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        bare(sys.argv[3]) if sys.argv[3] == "bare" else worker(*sys.argv[2:5])
    else:
        main()
