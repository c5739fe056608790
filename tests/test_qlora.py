"""QLoRA: LoRA adapters on an NF4 base (torchao's NF4Tensor). The NF4 layout memfit estimates is torchao's
to the byte, the traced step equals the real step's tracked peak, and training matches LoRA on the
dequantized base."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao")

import memfit  # noqa: E402
from memfit.apply.optimizer import TrainingOptimizer  # noqa: E402
from memfit.cli import main  # noqa: E402
from memfit.core.errors import ConfigError  # noqa: E402
from memfit.core.host import inner_tensors  # noqa: E402
from memfit.measure.trace import measure_step, trace_step  # noqa: E402
from memfit.models.lora import parse_lora  # noqa: E402
from memfit.models.qlora import empty_nf4, is_nf4, nf4_bytes, to_nf4  # noqa: E402
from memfit.models.spec import parse_model  # noqa: E402

# hidden 128: every linear weight a multiple of 64 x 256 elements, as NF4 double quantization needs
TINY = "llama:layers=2,hidden=128,heads=4,vocab=512,seq=64"
LORA = "r=8,targets=qkv,proj"


def _storages(t: torch.Tensor) -> list[int]:
    return [x.untyped_storage().nbytes() for x in inner_tensors(t)]


@pytest.mark.parametrize("shape,dtype", [((128, 128), torch.float32), ((384, 128), torch.bfloat16),
                                         ((256, 512), torch.float32)])
def test_nf4_layout_and_bytes_are_torchaos(shape, dtype):
    real = to_nf4(torch.randn(shape, dtype=dtype))
    empty = empty_nf4(torch.Size(shape), dtype, torch.device("cpu"))
    assert is_nf4(real) and is_nf4(empty)
    assert _storages(empty) == _storages(real)  # (128, 128): the factor's storage is 256 elements
    assert sum(_storages(real)) == nf4_bytes(real.numel(), dtype)
    numel, s = real.numel(), real.element_size()
    assert nf4_bytes(numel, dtype) < numel * s / 3.5  # 4.1 bits a weight against 16 or 32


def test_qlora_quantizes_the_frozen_linears_but_the_head():
    torch.manual_seed(0)
    model = replace(parse_model(TINY), lora=parse_lora(LORA + ",base=nf4")).build()
    nf4 = {n for n, p in model.named_parameters() if is_nf4(p)}
    assert nf4 == {f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv.base.weight", "attn.proj.base.weight",
                                                                    "mlp.fc.weight", "mlp.proj.base.weight")}
    assert not any(p.requires_grad for p in model.parameters() if is_nf4(p))
    with memfit.track(model) as t:
        pass
    plain = sum(p.numel() * p.element_size() for p in model.parameters() if not is_nf4(p))
    assert t.snapshot()["params"] == plain + sum(nf4_bytes(p.numel(), p.dtype) for p in model.parameters() if is_nf4(p))
    with pytest.raises(ConfigError, match="multiple of 16384"):  # 64 x 64 weights
        replace(parse_model("llama:layers=1,hidden=64,heads=4,vocab=512"), lora=parse_lora(LORA + ",base=nf4")).build()


def test_qlora_step_tracked_peak_equals_the_estimate():
    spec = replace(parse_model(TINY), lora=parse_lora(LORA + ",base=nf4"))
    pred = trace_step(spec, 2, 32, precision="bf16-true")
    real = measure_step(spec, 2, 32, precision="bf16-true")
    assert pred.breakdown() == real.breakdown()  # byte for byte, every category
    # The allocator also sees kernel scratch no tensor holds: 40 B on this step, as on the plain LoRA step;
    # 1% leaves room for other CPUs' kernels, and is still far below one dequantized weight (about 3%).
    assert abs(real.allocator_peak - real.peak) <= 0.01 * real.peak
    est = memfit.estimate(TINY, batch=2, seq=32, precision="bf16-true", lora=LORA, qlora=True)
    assert est.total == pred.peak
    # deeper and wider, where the weights outweigh the dequantized temporaries: the base in 4 bits wins
    big = "llama:layers=6,hidden=256,heads=4,vocab=512,seq=64"
    lora = trace_step(replace(parse_model(big), lora=parse_lora(LORA)), 2, 32, precision="bf16-true")
    qlora = trace_step(replace(parse_model(big), lora=parse_lora(LORA + ",base=nf4")), 2, 32, precision="bf16-true")
    assert qlora.params < lora.params / 2 and qlora.peak < lora.peak


def _dequantized_copy(model: nn.Module) -> nn.Module:
    """The same model with every NF4 weight replaced by its dequantized values as a plain frozen weight."""
    import copy

    ref = copy.deepcopy(model)
    for m in ref.modules():
        if is_nf4(getattr(m, "weight", None)):
            m.weight = nn.Parameter(m.weight.get_original_weight().clone(), requires_grad=False)
    return ref


def test_qlora_trains_as_lora_on_the_dequantized_base():
    torch.manual_seed(0)
    model = replace(parse_model(TINY), lora=parse_lora(LORA + ",base=nf4")).build()
    for n, p in model.named_parameters():  # B starts at zero: give it values, so the base's gradient path matters
        if "lora_B" in n:
            nn.init.normal_(p, std=0.02)
    ref = _dequantized_copy(model)
    x = torch.randint(0, 512, (2, 32))
    losses = []
    for m in (model, ref):
        opt = TrainingOptimizer(m, "adamw", lr=1e-2)
        run = []
        for _ in range(4):
            _, loss_sum, n = m(x, x)
            loss = loss_sum / n
            opt.backward(loss)
            opt.step()
            run.append(loss.item())
        losses.append(run)
    # The forward is the same product with the same dequantized weight; backward's x-gradient is
    # grad @ W in both, one as a matmul and one as linear's backward: fp32 rounding only.
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert losses[0][-1] < losses[0][0]


def test_cli_qlora_estimate_and_refusals(capsys):
    args = ["estimate", TINY, "--batch", "2", "--seq", "32", "--precision", "bf16-true", "--lora", LORA, "--json"]
    assert main(args) == 0
    lora = json.loads(capsys.readouterr().out)["per_device"]
    assert main(args + ["--qlora"]) == 0
    qlora = json.loads(capsys.readouterr().out)["per_device"]
    assert qlora["params"] < lora["params"] and qlora["optimizer"] == lora["optimizer"]
    for bad, needle in [(["--qlora"], "give the adapters"), (["--lora", "r=8,targets=qkv,base=int3"], "base=int3")]:
        assert main(["estimate", TINY] + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0]
    assert main(["plan", TINY, "--budget", "3MiB", "--qlora"]) == 2  # refused before any planning
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give the adapters" in err[0]
    # a LoRA fine-tune that cannot fit names the 4-bit base as the way on (the weights check: no trace)
    assert main(["plan", TINY, "--device", "cpu", "--budget", "1MiB", "--seq", "32", "--lora", LORA]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--qlora" in err[0]
    with pytest.raises(ConfigError, match="one device"):
        memfit.fit(TINY, budget="3MiB", lora=LORA, qlora=True, gpus=2)


@pytest.mark.slow
def test_plan_a_qlora_fine_tune():
    """The planner on an NF4 base (about 20 CPU-s: the chain profiles of each configuration)."""
    plan = memfit.fit(TINY, budget="3MiB", batch=2, seq=32, device="cpu", precision="bf16-true", lora=LORA,
                      qlora=True)
    assert plan.measured_peak <= plan.budget and any("NF4" in n for n in plan.notes)
    # the composed per-block figure the solver used is the full trace's, to the byte
    assert plan.predicted_peak == plan.measured_peak
    spec = replace(parse_model(TINY), lora=parse_lora(LORA + ",base=nf4"))
    from memfit.apply.policy import to_string

    traced = trace_step(spec, 2, 32, precision="bf16-true", checkpoint=to_string(plan.actions))
    assert plan.predicted_peak >= traced.peak  # the plan also holds the loop's output through backward


def test_train_qlora_runs_saves_and_resumes_exactly(tmp_path):
    """memfit train --lora ... --qlora: the loss falls, and a run stopped and resumed from its checkpoint
    (NF4 weights inside) follows the uninterrupted one exactly."""
    from memfit.train import loop

    def config(out):
        return loop.TrainConfig(model=TINY, lora=LORA + ",base=nf4", seq=32, batch=4, steps=6, warmup=2,
                                eval_every=3, eval_batches=2, save_every=3, out=str(out), track=False,
                                precision="bf16-true", device="cpu")

    straight = loop.train(config(tmp_path / "straight"), progress=False)
    half = loop.train(config(tmp_path / "split"), stop_at=3, progress=False)
    assert half.step == 3
    assert main(["train", "--resume", str(tmp_path / "split"), "--quiet"]) == 0
    resumed = json.loads((tmp_path / "split" / "metrics.json").read_text())
    losses = straight.metrics["steps"]["loss"]
    assert resumed["steps"]["loss"] == losses and losses[-1] < losses[0]
    ckpt = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)["model"]
    assert is_nf4(ckpt["blocks.0.mlp.fc.weight"])
    # the CLI spelling: --qlora adds base=nf4 to --lora
    from memfit.cli.train import config_of

    cfg, _ = config_of({"lora": LORA, "qlora": True})
    assert parse_lora(cfg.lora).base == "nf4"
