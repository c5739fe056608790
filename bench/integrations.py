"""memfit in the frameworks: predicted and measured peak, and a short run's time against the framework's
plain run, for HF Trainer, a peft LoRA model under Trainer, trl's SFTTrainer, accelerate's loop and
Lightning's Trainer.

    python bench/integrations.py            # tiny Llama (2 blocks, hidden 64, vocab 512), batch 4 x 32 tokens
    python bench/render.py                  # the table in docs/integrations.md and docs/BENCHMARKS.md
    python bench/integrations.py --only trl,lightning   # run again some of them (the others kept from the JSON)

The budget is halfway between the all-recompute and all-keep peaks (memfit.estimate); the plan is
memfit's recompute-only one for it. trl's is made by fit_trainer, which prices trl's fused LM head as
SFTTrainer calls it; SFTConfig's own activation checkpointing is off in both trl runs (the plain run
keeps every activation, as the other frameworks' plain runs do). Measured peak: memfit's tracker over each optimizer step (the
largest of 3 steps). Time: a whole 4-step run (framework set-up included, the same in both), plain
against planned, interleaved in shuffled order (bench/common.py). CPU: the peak is the tracker's
device accounting. Writes bench/results/integrations.json.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import interleaved, paired_ratio, save  # noqa: E402

import memfit  # noqa: E402
import tiny_llama as tl  # noqa: E402

STEPS = 4


def hf_run(plan=None, lora=False, steps=STEPS):
    import transformers

    from memfit.integrations.hf_callback import MemfitCallback

    model = tl.model()
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    if plan is not None:
        plan.install(model.get_base_model() if lora else model)
    cb = MemfitCallback(budget=plan.budget if plan else 1 << 40, check_steps=steps)
    args = transformers.TrainingArguments(output_dir="/tmp/memfit-bench-hf", per_device_train_batch_size=4,
                                          max_steps=steps, use_cpu=True, report_to=[], save_strategy="no",
                                          disable_tqdm=True, logging_strategy="no")
    transformers.Trainer(model=model, args=args, train_dataset=tl.rows(), callbacks=[cb]).train()
    return max(cb.peaks)


def trl_trainer(plan=None, steps=STEPS, callbacks=None):
    import datasets
    import trl

    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in tl.rows()]})
    args = trl.SFTConfig(output_dir="/tmp/memfit-bench-trl", per_device_train_batch_size=plan.micro_batch if plan else 4,
                         gradient_accumulation_steps=plan.accumulation if plan else 1, max_steps=steps, use_cpu=True,
                         report_to=[], save_strategy="no", disable_tqdm=True, logging_strategy="no",
                         activation_checkpointing=False)
    return trl.SFTTrainer(model=tl.model(), args=args, train_dataset=ds, processing_class=tl.tokenizer(),
                          callbacks=callbacks)


def trl_plan():
    """fit_trainer's plan for SFTTrainer at the budget halfway between its all-recompute and all-keep peaks
    (trl's fused head included, as fit_trainer prices it)."""
    from memfit.integrations.hf import collated_batch, fit_trainer

    probe = trl_trainer()
    b = {**collated_batch(probe, 4), "fused_lm_head": True}
    prec = "bf16-mixed" if probe.args.bf16 else "32-true"
    keep, full = (memfit.estimate(probe.model, b, precision=prec, checkpoint=c).per_device["total"]
                  for c in ("none", "full"))
    return fit_trainer(trl_trainer(), (keep + full) // 2, allow="recompute")


def trl_run(plan=None, steps=STEPS):
    from memfit.integrations.hf_callback import MemfitCallback

    cb = MemfitCallback(budget=plan.budget if plan else 1 << 40, check_steps=steps)
    trainer = trl_trainer(plan, steps, [cb])
    if plan is not None:
        plan.install(trainer.model)
    trainer.train()
    return max(cb.peaks)


def accelerate_run(plan=None, steps=STEPS):
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    from memfit.integrations.accelerate import prepare

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True)
    m = tl.model()
    if plan is None:
        model, opt = acc.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-3))
    else:
        model, opt, _ = prepare(acc, m, plan=plan, lr=1e-3, no_decay=None)
    data, peaks = tl.batch(4 * steps), []
    with memfit.track(model, opt) as tr:
        for s in range(steps):
            tr.reset_peak()
            with acc.accumulate(model):
                b = {k: v[4 * s: 4 * s + 4] for k, v in data.items()}
                acc.backward(model(**b).loss)
                opt.step()
                opt.zero_grad()
            peaks.append(tr.peak_bytes)
    return max(peaks)


def lightning_run(plan=None, watch=None, steps=STEPS):
    import lightning.pytorch as L

    from memfit.integrations.lightning import MemfitCallback, MemfitPrecision, memfit_optimizer

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.batch_size = tl.model(), 4

        def training_step(self, batch, idx):
            return self.model(**batch).loss

        def train_dataloader(self):
            rows = [{k: r[k] for k in ("input_ids", "labels")} for r in tl.rows()]
            return torch.utils.data.DataLoader(rows, batch_size=self.batch_size)

        def configure_optimizers(self):
            return (torch.optim.AdamW(self.parameters(), lr=1e-3) if plan is None
                    else memfit_optimizer(plan, self, lr=1e-3, no_decay=None))

    extra = {} if plan is None else {"plugins": [MemfitPrecision(plan)]}
    cb = MemfitCallback(watch, check_steps=steps, on_exceed="warn")  # the plain run: the plan's budget watched only
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[cb], **extra).fit(Lit())
    return max(cb.peaks)


NAMES = {"hf": "HF Trainer", "peft": "peft LoRA (Trainer)", "trl": "trl SFTTrainer", "accelerate": "accelerate",
         "lightning": "Lightning"}


def table(r: dict) -> str:
    from common import load_line, run_line
    from memfit.core.units import format_bytes as fmt_bytes

    rows = ["| framework | plan | budget | predicted peak | measured peak | plain run's peak | run time vs plain (median, min-max) |",
            "|---|---|---|---|---|---|---|"]
    for name, f in r["frameworks"].items():
        q = f["memfit_over_plain"]
        rows.append(f"| {NAMES.get(name, name)} | {f['actions'].removeprefix('blocks (2): ')} | {fmt_bytes(f['budget'])} | "
                    f"{fmt_bytes(f['predicted_peak'])} | {fmt_bytes(f['measured_peak'])} | {fmt_bytes(f['plain_peak'])} | "
                    f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f}) |")
    first = next(iter(r["frameworks"].values()))["timing"]
    return "\n".join([f"Measured on {r['machine'].get('cpu', 'this machine')} ({r['date']}), a shared and loaded machine: "
                      f"{load_line(first)} {run_line(r)}", "", *rows])


def snippets(r: dict) -> dict[str, str]:
    """The table in docs/integrations.md (between <!-- bench:integrations --> and its end)."""
    return {"integrations": table(r)}


def render(r: dict) -> str:
    return ("## Integrations: memfit in Trainer, trl, peft, accelerate and Lightning\n\n"
            "`python bench/integrations.py`: a tiny Llama (2 blocks, hidden 64, vocabulary 512, batch 4 x 32 tokens) "
            "at a budget halfway between its all-recompute and all-keep peaks; measured peak: memfit's tracker over "
            "each optimizer step (CPU: device accounting); time: a whole 4-step run against the framework's plain "
            "run (docs/integrations.md).\n\n" + table(r) + "\n")


def main() -> None:
    warnings.filterwarnings("ignore")
    keep, full = tl.peaks(tl.model(), tl.batch(4))
    budget = (keep + full) // 2
    # each framework's own planning: Trainer and Lightning return the loss alone (the output is dropped
    # before backward, as fit_trainer and plan_module plan it); an accelerate loop keeps it (prepare)
    plan = memfit.fit(tl.model(), tl.batch(4), budget=budget, allow="recompute", keep_output=False)
    kept = memfit.fit(tl.model(), tl.batch(4), budget=budget, allow="recompute")
    lora_base = __import__("peft").get_peft_model(tl.model(), __import__("peft").LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"])).get_base_model()
    lk = memfit.estimate(lora_base, tl.batch(4), checkpoint="none").per_device["total"]
    lf = memfit.estimate(lora_base, tl.batch(4), checkpoint="full").per_device["total"]
    lora_plan = memfit.fit(lora_base, tl.batch(4), budget=(lk + lf) // 2, allow="recompute", keep_output=False)
    runs = {"hf": (lambda p: hf_run(p), plan), "peft": (lambda p: hf_run(p, lora=True), lora_plan),
            "accelerate": (accelerate_run, kept), "lightning": (lambda p: lightning_run(p, watch=plan), plan)}
    if "--only" not in sys.argv or "trl" in sys.argv[sys.argv.index("--only") + 1]:
        runs["trl"] = (trl_run, trl_plan())
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else list(runs)
    path = Path(__file__).resolve().parent / "results" / "integrations.json"
    out = __import__("json").loads(path.read_text())["frameworks"] if "--only" in sys.argv else {}
    for name, (fn, p) in runs.items():
        if name not in only:
            continue
        measured, plain_peak = fn(p), fn(None)
        timing = interleaved({"plain": lambda: fn(None), "memfit": lambda: fn(p)}, rounds=5)
        out[name] = {"budget": p.budget, "predicted_peak": p.predicted_peak, "measured_peak": measured,
                     "plain_peak": plain_peak, "actions": str(p.summary().splitlines()[1].strip()),
                     "timing": timing, "memfit_over_plain": paired_ratio(timing, "memfit", "plain")}
        print(name, {k: v for k, v in out[name].items() if k != "timing"}, flush=True)
    print(save("integrations", {"steps": STEPS, "frameworks": out}))


if __name__ == "__main__":
    main()
