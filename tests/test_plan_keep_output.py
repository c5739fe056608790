"""fit(keep_output=True), the default, budgets for the loop people write: the output (logits, an HF
cache) held through backward and until the next forward returns. The usual loops measure within the
budget; a plan made for a loop that drops its output goes over in them (the negative control)."""
import pytest
import torch

import memfit
from memfit.apply.policy import parse_items
from memfit.core.tracker import MemoryTracker
from memfit.measure.blocks import chain_profile
from memfit.models.gpt import GPT, GPTConfig
from memfit.plan.costs import _bases
from memfit.plan.fit import _Problem

CFG = GPTConfig(layers=3, hidden=64, heads=4, vocab=4096, seq=64)
BATCH = 4


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def gpt_loop(model, opt, x):
    """memfit's GPT as nanoGPT-style loops use it: the logits stay in scope."""
    def step():
        with opt.autocast():
            logits, loss_sum, n = model(x, x)
        opt.backward(loss_sum / n)
        opt.step()
        return logits
    return step


def _usual_peak(plan, build, loop, example) -> int:
    model = build()
    opt = plan.apply(model, lr=1e-3)
    step = loop(model, opt, example)
    held = step()  # noqa: F841  (the loop's variable: alive while the next step runs)
    with MemoryTracker(model, opt) as t:
        held = step()  # noqa: F841
        held = step()  # noqa: F841
    return t.peak_bytes


def _budget(model, example, loss_fn, n_blocks) -> int:
    """Just under all-keep for a loop that drops its output: such a plan keeps almost everything."""
    problem = _Problem(model, example, loss_fn, None, None)
    problem.keep_output = False
    prof = chain_profile(problem.source(BATCH), "32-true", "adamw", bases=_bases(("recompute", "selective")))
    return prof.peak_of(list(parse_items(f"keep*{n_blocks}"))) - 1


def _check(build, example, loss_fn, loop, loop_input, n_blocks):
    model = build()  # one instance for the budget and both plans: their traces are shared (cached per model)
    budget = _budget(model, example, loss_fn, n_blocks)
    kw = dict(budget=f"{budget}B", loss_fn=loss_fn, device="cpu", allow=("recompute", "selective", "chunked-head"))
    kept = memfit.fit(model, example, **kw)
    assert kept.keep_output and "held through backward (keep_output=True)" in kept.summary()
    assert kept.measured_peak <= budget and _usual_peak(kept, build, loop, loop_input) <= budget
    dropped = memfit.fit(model, example, keep_output=False, verify=False, **kw)
    assert "dropped before backward (keep_output=False)" in dropped.summary()
    assert _usual_peak(dropped, build, loop, loop_input) > budget  # the test can fail: the output is real


@pytest.mark.slow  # the default tier: test_plan_chunked_head.py's loop that keeps its output
def test_memfit_gpt_loop_holding_its_logits_measures_within_the_budget():
    x = torch.randint(0, CFG.vocab, (BATCH, CFG.seq))
    _check(gpt, (x, x), lambda out, ex: out[1] / out[2], gpt_loop, x, CFG.layers)


def llama():
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=4096, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def hf_loop(model, opt, batch):
    """The Hugging Face loop: `out = model(**batch); loss = out.loss; loss.backward()`."""
    def step():
        with opt.autocast():
            out = model(**batch)
        opt.backward(out.loss)
        opt.step()
        return out
    return step


@pytest.mark.slow
def test_the_usual_hugging_face_loop_measures_within_the_budget():
    x = torch.randint(0, 4096, (BATCH, 64))
    batch = {"input_ids": x, "labels": x}
    _check(llama, batch, None, hf_loop, batch, 3)
