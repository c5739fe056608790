"""A memfit plan as the frameworks see it: the degrees, batch split, checkpointing, precision and
offload of `memfit plan ... --json` (one device or a cluster plan), read once for every writer.

    view = plan_view(json.load(open("PLAN.json")))     # {"plan": ..., "cluster": ...} or the plan alone
    out = emit(view, "deepspeed")                      # Emitted(text, suffix, unexpressed)

One writer per framework (memfit.integrations.emit_deepspeed, emit_torchtitan, emit_accelerate,
emit_lightning); each returns the framework's own config and the lines naming what of the plan
that config cannot say (per-block offload and compression, a chunked loss head, a mix of
recomputed and kept blocks where the framework checkpoints all or none).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memfit.core.errors import ConfigError

TARGETS = ("torchtitan", "accelerate", "lightning", "deepspeed")
STRATEGIES = ("none", "ddp", "zero1", "zero2", "zero3", "pipeline", "tensor")


@dataclass
class PlanView:
    model: str
    strategy: str
    """none, ddp, zero1, zero2, zero3, pipeline or tensor (memfit train's strategies)."""
    world: int
    dp: int
    tp: int
    pp: int
    zero: int
    """ZeRO stage over dp (0: none); pipeline and tensor layouts carry one on paper only."""
    micro_batch: int
    """Sequences per data-parallel replica per micro-step (a TP group's rows; a pipeline replica's
    micro-batch of the schedule)."""
    accumulation: int
    """Micro-steps per optimizer step (pipeline: the schedule's micro-batches)."""
    seq: int | None
    precision: str
    optimizer: str
    offload_optimizer: str | None
    actions: list
    """One memfit.apply.policy.BlockAction per block."""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    """Pipeline stages per rank (schedule "interleaved")."""
    head_chunks: int | None = None
    notes: list = field(default_factory=list)

    @property
    def recomputed(self) -> int:
        """Blocks that recompute in backward, whole or in part (recompute or selective)."""
        return sum(a.mode != "keep" for a in self.actions)

    @property
    def checkpoint(self) -> str:
        """none, full, selective (every block the same) or mixed."""
        modes = {a.mode for a in self.actions}
        if modes == {"keep"}:
            return "none"
        if modes == {"recompute"}:
            return "full"
        return "selective" if modes == {"selective"} else "mixed"

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp


@dataclass
class Emitted:
    text: str
    suffix: str
    """File name ending: .json, .toml, .yaml."""
    unexpressed: list[str]
    """What of the plan the framework's config cannot carry, one line each."""
    extra: list[str] = field(default_factory=list)
    """What the user sets by hand (batch sizes the config has no field for, the launch line)."""


def _need(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where} has no {key!r}: not a memfit plan; write one with `memfit plan ... --json`")
    return d[key]


def plan_view(doc: dict, where: str = "the plan") -> PlanView:
    """The plan JSON of `memfit plan --json` (with or without its cluster field) as a PlanView."""
    from memfit.apply.policy import resolve_policy
    from memfit.plan.plan_schema import check_plan

    if not isinstance(doc, dict):
        raise ConfigError(f"{where} is not a memfit plan: expected the JSON object of `memfit plan ... --json`")
    plan = doc.get("plan", doc)
    check_plan(plan, where)
    cluster = doc.get("cluster") or {}
    lay = (cluster.get("layout") if isinstance(cluster, dict) else None) or {"strategy": "none"}
    actions = resolve_policy(plan["actions"], plan["n_blocks"])
    strategy = lay.get("strategy", "none") if isinstance(lay, dict) else None
    if strategy not in STRATEGIES:
        raise ConfigError(f"{where}: cluster.layout.strategy must be one of {', '.join(STRATEGIES)}, got "
                          f"{strategy!r}; write it again with `memfit plan ... --json`")
    dp, tp, pp = (_count(lay, k, 1, where) for k in ("dp", "tp", "pp"))
    zero = int(strategy[-1]) if strategy.startswith("zero") else min(_count(lay, "dp_shard", 0, where), 3)
    if strategy == "pipeline":  # a replica's micro-batch of the schedule, and the schedule's count
        micro, accum = _count(lay, "rows", 1, where), _count(lay, "accum", 1, where)
    elif strategy == "tensor":  # the TP group runs the replica's rows together
        micro, accum = _count(lay, "rows", plan["micro_batch"] * tp, where), plan["accumulation"]
    else:
        micro, accum = plan["micro_batch"], plan["accumulation"]
    schedule = lay.get("schedule", "1f1b")
    if not isinstance(schedule, str):
        raise ConfigError(f"{where}: cluster.layout.schedule must be a string, got {schedule!r}")
    virtual = _count(lay, "virtual_stages", 1, where) if schedule == "interleaved" else 1
    if schedule == "interleaved" and plan["n_blocks"] % (pp * virtual):  # the interleaved cut is even
        raise ConfigError(f"{where}: {plan['n_blocks']} blocks do not split evenly into {pp} x {virtual} pipeline "
                          "stages (cluster.layout pp x virtual_stages); write it again with `memfit plan ... --json`")
    return PlanView(model=plan["model"], strategy=strategy, world=dp * tp * pp,
                    dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=micro, accumulation=accum, seq=plan.get("seq"),
                    precision=plan["precision"], optimizer=plan["optimizer"],
                    offload_optimizer=plan["offload_optimizer"], actions=actions,
                    schedule=schedule, head_chunks=plan.get("head_chunks"),
                    virtual_stages=virtual)


def _count(lay: dict, key: str, default: int, where: str) -> int:
    value = lay.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if default else 0) or value > 2**31:
        raise ConfigError(f"{where}: cluster.layout.{key} must be a positive integer, got {value!r}; write it again "
                          "with `memfit plan ... --json`")
    return value


def common_unexpressed(view: PlanView, framework: str) -> list[str]:
    """What no framework's config says: per-block offload and compression of saved activations, the
    chunked loss head, segments of recomputed blocks."""
    out = []
    off = [i for i, a in enumerate(view.actions) if a.offload]
    if off:
        where = sorted({view.actions[i].offload for i in off})
        out.append(f"activation offload to {'/'.join(where)} of blocks {_ranges(off)}: {framework} has no per-block "
                   "offload of saved tensors (memfit.apply.offload's saved-tensor hooks do it in your loop)")
    comp = [i for i, a in enumerate(view.actions) if a.compress]
    if comp:
        out.append(f"compressed saved activations of blocks {_ranges(comp)} "
                   f"({', '.join(sorted({view.actions[i].compress for i in comp}))}): not in {framework}")
    if any(a.segment is not None for a in view.actions):
        out.append("recompute segments (several blocks rerun as one): the config checkpoints block by block, "
                   "which keeps one block input more per segment")
    if view.head_chunks:
        out.append(f"the loss head in {view.head_chunks} chunks (logits never whole): {framework} computes the "
                   "whole logits; budget them or use memfit.apply.chunked_head")
    return out


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def block_list(view: PlanView, mode_filter=lambda a: a.mode != "keep") -> str:
    idx = [i for i, a in enumerate(view.actions) if mode_filter(a)]
    return _ranges(idx) if idx else "none"


def emit(view: PlanView, target: str) -> Emitted:
    """The framework's config for the plan (`target` one of TARGETS)."""
    import importlib

    if target not in TARGETS:
        raise ConfigError(f"--emit {target!r}: accepted: {', '.join(TARGETS)}")
    return importlib.import_module(f"memfit.integrations.emit_{target}").emit(view)


def block_class(model: str) -> tuple[str, str]:
    """(module, class name) of the model's repeated block: what the frameworks wrap and checkpoint.
    memfit's GPT: memfit.models.gpt.Block; a Hugging Face config: its decoder layer class."""
    from memfit.models.spec import parse_model

    spec = parse_model(model)
    if getattr(spec, "hf_config", None) is None:
        return "memfit.models.gpt", "Block"
    import importlib
    import json

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        kind = json.loads(open(spec.hf_config).read())["model_type"]
        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])
        layer = (cls._no_split_modules or ["DecoderLayer"])[0]
    except (OSError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise ConfigError(f"cannot name the decoder layer class of {model} for the framework's wrap policy "
                          f"({type(exc).__name__}: {exc}); give a causal LM's config.json") from None
    module = importlib.import_module(cls.__module__)
    return (module.__name__ if hasattr(module, layer) else cls.__module__), layer
