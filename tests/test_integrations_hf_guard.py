"""MemfitCallback's guard (save and stop before the device's reserve crosses the budget), on a simulated
device: the reading the guard takes on CUDA (max_memory_reserved) is memfit's tracker over the whole run,
and the batches grow longer step by step until one would cross the budget."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tiny_llama as tl  # noqa: E402
import memfit  # noqa: E402
from memfit.integrations import hf_callback  # noqa: E402
from memfit.integrations.hf_callback import GUARD, MemfitCallback  # noqa: E402

STEPS, ROWS = 8, 2


def growing_rows() -> list[dict]:
    """Step s has ROWS sequences of 32 + 4 s tokens: each step holds a little more than the one before."""
    g = torch.Generator().manual_seed(0)
    out = []
    for s in range(STEPS):
        for _ in range(ROWS):
            ids = torch.randint(0, tl.VOCAB, (32 + 4 * s,), generator=g)
            out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def run(out, monkeypatch, callbacks=(), resume=None):
    """A Trainer run on the simulated device: `readings` is what max_memory_reserved returns after each step
    (the high-water mark of memfit's tracker since the run began)."""
    model = tl.model()
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=ROWS,
                                          use_cpu=True, report_to=[], logging_steps=1, seed=0, disable_tqdm=True,
                                          learning_rate=1e-3, save_strategy="no", train_sampling_strategy="sequential")
    readings = []

    class Reading(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            readings.append(tracker.peak_bytes)

    trainer = transformers.Trainer(model=model, args=args, train_dataset=growing_rows(),
                                   callbacks=[Reading(), *callbacks])
    monkeypatch.setattr(hf_callback, "reserved_bytes", lambda device: tracker.peak_bytes)
    with memfit.track(model) as tracker:
        trainer.train(resume_from_checkpoint=resume)
    return trainer, readings


def test_guard_saves_and_stops_before_the_budget_is_crossed_and_the_checkpoint_resumes(tmp_path, monkeypatch):
    whole, readings = run(tmp_path / "whole", monkeypatch)
    assert readings == sorted(readings) and readings[-1] > readings[0]
    budget = readings[-2] + (readings[-1] - readings[-2]) // 2  # the last step crosses it
    stop = next(i for i, r in enumerate(readings) if r > GUARD * budget)  # the guard's step (0-based)
    assert stop < STEPS - 1  # before the step that would have run out of memory

    guard = MemfitCallback(budget=budget, check_steps=0)
    with pytest.warns(UserWarning, match="saving a checkpoint and stopping") as caught:
        guarded, seen = run(tmp_path / "guarded", monkeypatch, [guard])
    assert len([w for w in caught if "memfit" in str(w.message)]) == 1  # one line
    assert guarded.state.global_step == stop + 1 and seen == readings[:stop + 1]
    assert max(seen) <= budget  # stopped with the reserve still under the budget
    checkpoint = tmp_path / "guarded" / f"checkpoint-{stop + 1}"
    assert (checkpoint / "trainer_state.json").exists()

    resumed, _ = run(tmp_path / "resumed", monkeypatch, resume=str(checkpoint))
    assert resumed.state.global_step == STEPS
    for (n, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n  # the resumed run ends where the uninterrupted one did


def test_guard_is_off_where_there_is_no_cuda_reading(tmp_path):
    assert hf_callback.reserved_bytes(torch.device("cpu")) is None
    trainer = transformers.Trainer(
        model=tl.model(), train_dataset=growing_rows()[:4], callbacks=[MemfitCallback(budget=1, check_steps=0)],
        args=transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=ROWS,
                                            use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True))
    trainer.train()  # a 1-byte budget, but no reading: the guard does not stop a CPU run
    assert trainer.state.global_step == 2
