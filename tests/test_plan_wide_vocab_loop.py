"""The usual Hugging Face loop under a plan's budget with a wide vocabulary (issue 38, finding 9): a Llama
whose vocabulary is 125 times its width, planned by memfit.fit at a budget halfway between the plain and
the fully checkpointed peaks, then run as users write it (`out = model(**ex); loss = out.loss;
opt.backward(loss); opt.step()`, `out` alive until the next forward returns). Measured as the bytes live
before the step (the tracker's storages) plus what the CPU allocator handed out during it (profiler
memory events, which also see kernels' workspaces that never become tensors), and held to the budget.
The plan keeping every block is the control: it measures over the budget, so the budget binds."""
import pytest
import torch

import memfit
from memfit.apply.policy import parse_items
from memfit.core.tracker import MemoryTracker
from memfit.measure.allocator import AllocatorProfile
from memfit.measure.blocks import chain_profile
from memfit.plan.costs import _bases
from memfit.plan.fit import _Problem

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 4000, 32, 3, 3, 32  # vocab / hidden = 125 (the finding's 24000 / 192)


def llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def usual_loop_peak(plan, example) -> int:
    """Live bytes before the third step plus the allocator's rise during it (steps 1-2 warm up: the
    optimizer state exists and the previous `out` is held, as in a running loop)."""
    with AllocatorProfile() as ap:  # started before the model, so every free inside the window is known
        model = llama()
        opt = plan.apply(model, lr=1e-3)
        with MemoryTracker(model, opt) as t:
            for i in range(3):
                if i == 2:
                    start = t.current_bytes
                    window = ap.window("step")
                    window.__enter__()
                with opt.autocast():
                    out = model(**example)
                loss = out.loss
                opt.backward(loss)
                opt.step()
            window.__exit__(None, None, None)
    w = ap.windows["step"]
    return start + w.peak_bytes - w.start_bytes


@pytest.mark.slow  # the default tier holds a loop keeping its output in test_plan_chunked_head.py
def test_usual_loop_with_a_wide_vocabulary_measures_within_the_budget():
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    example = {"input_ids": x, "labels": x}
    model = llama()
    problem = _Problem(model, example, None, None, None)
    problem.keep_output = True
    prof = chain_profile(problem.source(BATCH), "32-true", "adamw", bases=_bases(("recompute", "selective")))
    keep = prof.peak_of(list(parse_items(f"keep*{LAYERS}")))
    full = prof.peak_of(list(parse_items(f"recompute*{LAYERS}")))
    budget = (keep + full) // 2
    plan = memfit.fit(model, example, budget=f"{budget}B", allow=("recompute", "selective"), device="cpu")
    assert plan.measured_peak <= budget  # the plan's own full trace
    measured = usual_loop_peak(plan, example)
    assert measured <= budget, f"{measured - budget} bytes over"
    control = memfit.fit(model, example, budget=f"{keep + 2**20}B", allow=("recompute", "selective"), device="cpu",
                         verify=False)  # (the same model and allow: its profile is the one traced above)
    assert all(a.mode == "keep" for a in control.actions)
    assert usual_loop_peak(control, example) > budget  # the budget binds: keeping every block measures over it
