"""The per-rank grid: each rank's tracked step peak next to `memfit estimate --strategy S --world N`.

A case is (model, strategy, precision, checkpoint, options); `tracked(rank, world, cases)` runs each
on the spawned gloo ranks (three steps, the third tracked: optimizer state exists and DDP has
rebuilt its buckets) and `estimated(case, world)` asks the CLI, as a user would. Shared by
tests/test_distributed_rank_grid.py and bench/rank_estimate.py.
"""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

BATCH, SEQ = 2, 32  # per rank (pipeline and tensor: per rank of the global batch world x BATCH)
DATA_PARALLEL = ("none", "ddp", "ps", "zero1", "zero2", "zero3")


def gpt(layers: int) -> str:
    return f"gpt:layers={layers},hidden=32,heads=4,vocab=128,seq={SEQ}"


def hf_configs(folder: Path, layers: int = 2) -> dict[str, str]:
    """Small Hugging Face causal LMs written as config.json files: name -> path (`layers` decoder
    layers; other than 2, the folder names end in -L)."""
    import transformers as tf

    small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                 max_position_embeddings=64)
    configs = {
        "llama-tied": tf.LlamaConfig(**small, num_key_value_heads=4, tie_word_embeddings=True, architectures=["LlamaForCausalLM"]),
        "llama-untied": tf.LlamaConfig(**small, num_key_value_heads=4, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
        "llama-gqa": tf.LlamaConfig(**{**small, "num_key_value_heads": 2}, architectures=["LlamaForCausalLM"]),
        "gpt2": tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                              architectures=["GPT2LMHeadModel"]),
        "mixtral": tf.MixtralConfig(**small, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                                    architectures=["MixtralForCausalLM"]),
    }
    out = {}
    for name, cfg in configs.items():
        d = folder / (name if layers == 2 else f"{name}-{layers}")
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(cfg.to_json_string())
        out[name] = str(d / "config.json")
    return out


@dataclass(frozen=True)
class Case:
    model: str
    strategy: str
    precision: str = "32-true"
    checkpoint: str = "none"
    schedule: str | None = None
    microbatches: int | None = None
    tags: tuple = field(default=())
    accum: int = 1
    engine: str = "memfit"
    """who runs a data-parallel strategy (memfit.distributed.strategy.ENGINES)"""
    virtual_stages: int | None = None
    """pipeline's interleaved schedule: stages per rank"""

    @property
    def name(self) -> str:
        s = self.strategy + (f"-{self.schedule}" if self.schedule else "") \
            + (f"x{self.virtual_stages}" if self.virtual_stages else "")
        return f"{Path(self.model).parent.name if self.model.endswith('.json') else self.model} {s} " \
               f"{self.precision} ckpt={self.checkpoint}" + (f" accum={self.accum}" if self.accum > 1 else "") \
               + (f" engine={self.engine}" if self.engine != "memfit" else "")

    def options(self) -> list[str]:
        out = ["--precision", self.precision, "--checkpoint", self.checkpoint]
        if self.schedule:
            out += ["--schedule", self.schedule]
        if self.microbatches:
            out += ["--microbatches", str(self.microbatches)]
        if self.accum > 1:
            out += ["--accum", str(self.accum)]
        if self.engine != "memfit" or self.strategy in ("zero2", "zero3"):  # (auto would estimate FSDP2)
            out += ["--engine", self.engine]
        if self.virtual_stages:
            out += ["--virtual-stages", str(self.virtual_stages)]
        return out


def _build(case: Case):
    from memfit.apply.checkpoint import checkpoint
    from memfit.models.spec import parse_model

    spec = parse_model(case.model)
    model = spec.build(seq=SEQ)
    model.train()
    if case.checkpoint != "none":  # pipeline re-applies the policy to its stage
        checkpoint(model, case.checkpoint)
    return spec, model


def loss_of(model, x):
    """The mean token loss of memfit's GPT (wrapped or not) or a Hugging Face causal LM on batch `x`."""
    from memfit.models.gpt import GPT

    inner = getattr(model, "module", model)
    if isinstance(inner, GPT):
        _, loss_sum, n = model(x, x)
        return loss_sum / n
    return model(input_ids=x, labels=x).loss


def _one(case: Case, rank: int, world: int) -> dict:
    from memfit.apply.optimizer import TrainingOptimizer
    from memfit.core.tracker import track
    from memfit.distributed import distribute

    torch.manual_seed(0)
    spec, model = _build(case)
    vocab = spec.config.vocab if spec.config is not None else model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    kw = {}
    if case.strategy == "pipeline":
        kw = dict(schedule=case.schedule or "1f1b", microbatches=case.microbatches or world)
        if case.virtual_stages:
            kw["virtual_stages"] = case.virtual_stages
    if case.strategy == "none":
        opt = TrainingOptimizer(model, "adamw", lr=1e-3, precision=case.precision)
        opt.model, opt.tracked_module = model, model
        opt.micro_batch = lambda last: contextlib.nullcontext()
    else:
        opt = distribute(model, case.strategy, "adamw", lr=1e-3, precision=case.precision, engine=case.engine, **kw)
    # A Hugging Face model under pipeline or tensor runs as memfit train runs it, the step `memfit estimate`
    # models: targets aligned with the inputs, in storage of their own (memfit.measure.parallel_estimate).
    aligned = spec.config is None and case.strategy in ("pipeline", "tensor")
    if aligned:
        opt.aligned_targets = True
    with opt:
        rows = opt.data_rows(BATCH * world) if case.strategy == "tensor" else None
        for step in range(3):
            ms = [torch.randint(0, vocab, (BATCH * world, SEQ), generator=g) for _ in range(case.accum)]
            ts = [torch.randint(0, vocab, m.shape, generator=g) if aligned else m for m in ms]
            tracker = track(opt.tracked_module, opt, device="cpu") if step == 2 else None
            with tracker if tracker is not None else contextlib.nullcontext():
                if case.strategy == "pipeline":
                    opt.accumulate_step(list(zip(ms, ts)))
                elif case.strategy == "tensor":
                    opt.accumulate_step([(m[rows], t[rows]) for m, t in zip(ms, ts)])
                else:
                    _data_parallel_step(case, opt, ms, rank, world)
    return dict(tracker.breakdown)


def _data_parallel_step(case: Case, opt, ms: list, rank: int, world: int) -> None:
    """One step of len(ms) micro-batches, each rank on its rows (the gradients of the earlier ones held)."""
    for i, m in enumerate(ms):
        last = i == len(ms) - 1
        x = m[rank * BATCH:(rank + 1) * BATCH] if case.strategy != "none" else m[:BATCH]
        with opt.micro_batch(last), opt.autocast():
            loss = loss_of(opt.model, x)
        if case.strategy == "none":
            opt.backward(loss / len(ms))
        else:
            opt.backward(loss / (world * len(ms)), final=last)
    opt.step()


def tracked(rank: int, world: int, cases: list[Case]) -> dict[Case, dict]:
    """Each case's tracked breakdown on this rank (run under memfit.distributed.spawn.run_world)."""
    return {c: _one(c, rank, world) for c in cases}


def estimated(case: Case, world: int) -> list[dict]:
    """`memfit estimate ... --json`'s per-rank rows, expanded to one per rank."""
    from memfit.cli import main

    args = ["estimate", case.model, "--batch", str(BATCH), "--seq", str(SEQ), "--json", *case.options()]
    if case.strategy != "none":
        args += ["--strategy", case.strategy, "--world", str(world)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0, args
    data = json.loads(buf.getvalue())
    if case.strategy == "none":
        return [dict(data["per_device"], rank=r) for r in range(world)]
    out = {}
    for row in data["ranks"]:
        for r in row["rank_ids"]:
            out[r] = dict(row, rank=r)
    return [out[r] for r in range(world)]


def errors(cases: list[Case], world: int, measured: list[dict]) -> list[dict]:
    """One row per case: estimate and tracked total per rank, and the relative errors."""
    rows = []
    for c in cases:
        est = [r["total"] for r in estimated(c, world)]
        got = [measured[r][c]["total"] for r in range(world)]
        rows.append({"case": c.name, "model": c.model, "strategy": c.strategy, "schedule": c.schedule,
                     **({"virtual_stages": c.virtual_stages or 2, "microbatches": c.microbatches or world}
                        if c.schedule == "interleaved" else {}),
                     "precision": c.precision, "checkpoint": c.checkpoint, "world": world, "estimate": est,
                     "measured": got, "error": [(e - m) / m for e, m in zip(est, got)]})
    return rows


DEPTHS = (1, 2, 11, 12, 13, 24, 48)
STRATEGIES = (("none", None), ("ddp", None), ("ps", None), ("zero1", None), ("zero2", None), ("zero3", None),
              ("pipeline", "1f1b"), ("pipeline", "gpipe"), ("tensor", None))
PRECISIONS = ("32-true", "bf16-master")
CHECKPOINTS = ("none", "full")


def gpt_cases(depths=DEPTHS, world: int = 2, precisions=PRECISIONS, checkpoints=CHECKPOINTS,
              strategies=STRATEGIES) -> list[Case]:
    """memfit's GPT at each depth under each strategy (pipeline needs a block per stage)."""
    return [Case(gpt(d), s, p, c, sch) for d in depths for p in precisions for c in checkpoints
            for s, sch in strategies if s != "pipeline" or d >= world]


def covering_cases(depth: int, world: int = 2, each_once: bool = False) -> list[Case]:
    """Each strategy with and without checkpointing at `depth`, the precisions taken in turn so that
    each precision x checkpoint pair meets four strategies or more: half the grid of a deep model
    (whose traces are the test's cost). `each_once`: each strategy once, the checkpoint and the
    precision alternating, so each checkpoint and each precision still meets four strategies or more
    (a quarter of the grid; 24 and 48 blocks take opposite quarters). bench/rank_estimate.py runs them all."""
    strategies = [(s, sch) for s, sch in STRATEGIES if s != "pipeline" or depth >= world]
    if each_once:  # 24 and 48 blocks take complementary quarters: together, the covering half
        o = depth // 24 % 2
        return [Case(gpt(depth), s, PRECISIONS[(i // 2 + o) % 2], CHECKPOINTS[(i + o) % 2], sch)
                for i, (s, sch) in enumerate(strategies)]
    return [Case(gpt(depth), s, PRECISIONS[(i + j) % len(PRECISIONS)], c, sch)
            for i, (s, sch) in enumerate(strategies) for j, c in enumerate(CHECKPOINTS)]


def hf_cases(paths: dict[str, str], precisions=("32-true",), checkpoints=CHECKPOINTS) -> list[Case]:
    """Hugging Face families under each data-parallel strategy, and under tensor and pipeline (1F1B and
    GPipe) for the Llama configs (a family with a tensor plan that memfit cuts at decoder layers:
    memfit.distributed.hf_tensor, hf_stages)."""
    model_parallel = [("tensor", None), ("pipeline", "1f1b"), ("pipeline", "gpipe")]
    return [Case(path, s, p, c, sch) for name, path in paths.items() for p in precisions for c in checkpoints
            for s, sch in [(d, None) for d in DATA_PARALLEL] + (model_parallel if name.startswith("llama") else [])]


def interleaved_cases(hf_paths: dict[str, str]) -> dict[int, list[Case]]:
    """world -> pipeline cases under the interleaved schedule: memfit's GPT at depths that split evenly
    into world x V stages (V 2 to 4; 2 and 4 micro-batches per rank pair), both precisions, with and
    without full checkpointing; on 4 ranks 8 blocks; the Llama configs of `hf_paths` (4 layers)."""
    both = [(p, c) for p in PRECISIONS for c in CHECKPOINTS]
    two = [Case(gpt(4), "pipeline", p, c, "interleaved", m) for m in (2, 4) for p, c in both]
    two += [Case(gpt(12), "pipeline", p, c, "interleaved", 4, virtual_stages=v) for v in (2, 3) for p, c in both]
    two += [Case(gpt(24), "pipeline", p, c, "interleaved", 4, virtual_stages=4) for p, c in both]
    two += [Case(path, "pipeline", "32-true", c, "interleaved", m) for name, path in hf_paths.items()
            if name.startswith("llama") for m in (2, 4) for c in CHECKPOINTS]
    four = [Case(gpt(8), "pipeline", "32-true", c, "interleaved", m) for m in (4, 8) for c in CHECKPOINTS]
    return {2: two, 4: four}
