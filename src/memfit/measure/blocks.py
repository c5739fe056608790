"""Where composed estimates get their short chains: a model spec, or any module with an example.

A *chain source* is (build_k, n_blocks, step): build_k(k) builds the model with its repeated blocks
cut to the first k (inside FakeTensorMode), and step(model, opt) runs one training step. Blocks must
be identical (same class, parameter names, shapes, dtypes and trainability); otherwise there is no
chain and callers fall back to tracing the whole step.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from memfit.apply.policy import BlockAction, resolve_policy, segments
from memfit.core.errors import ConfigError
from memfit.measure.compose import BASE_ACTIONS, ChainProfile, profile_chain
from memfit.measure.timeline import NotAChain, Vec
from memfit.models.hf_check import per_layer_config


@dataclass
class ChainSource:
    build_k: Callable[[int], nn.Module]
    n_blocks: int
    step: Callable[[nn.Module, Any], None]
    key: tuple
    """Identifies the model shape and batch (for caching profiles)."""
    plain_differs: bool = False
    """The model runs differently once any block is checkpointed (a Hugging Face KV cache is switched off)."""


def block_signature(block: nn.Module) -> tuple:
    return (type(block).__name__,) + tuple(
        (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in block.named_parameters())


def chain_mismatch(model: nn.Module) -> str:
    """Which of `model`'s blocks differ from the others, in words (for a one-line refusal); "" when all are alike."""
    from memfit.apply.checkpoint import find_blocks

    try:
        blocks = find_blocks(model)
    except ConfigError as exc:
        return str(exc)
    sigs = [block_signature(b) for b in blocks]
    common = max(set(sigs), key=sigs.count)
    odd = [i for i, s in enumerate(sigs) if s != common]
    if not odd:
        return ""
    first = dict((n, sh) for n, sh, *_ in sigs[odd[0]][1:]) if odd else {}
    usual = dict((n, sh) for n, sh, *_ in common[1:])
    extra = sorted(set(first) - set(usual)) or sorted(set(usual) - set(first)) or \
        sorted(n for n in first if first[n] != usual.get(n))
    what = f" ({', '.join(extra[:3])})" if extra else ""
    return (f"block{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} of the {len(blocks)} "
            f"{type(blocks[0]).__name__} blocks differ{'s' if len(odd) == 1 else ''} from the others{what}")


def identical_blocks(model: nn.Module) -> nn.ModuleList | None:
    from memfit.apply.checkpoint import find_blocks

    try:
        blocks = find_blocks(model)
    except ConfigError:
        return None
    sigs = {block_signature(b) for b in blocks}
    return blocks if len(sigs) == 1 else None


def truncate(model: nn.Module, k: int) -> nn.Module:
    """Cut the repeated blocks to the first k (or add copies of the first one up to k)."""
    blocks = identical_blocks(model)
    if blocks is None:
        raise NotAChain("no identical repeated blocks")
    n = len(blocks)
    del blocks[k:]
    # Hugging Face models run `layers[:config.num_hidden_layers]` and may describe each layer in the config.
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "num_hidden_layers", None) == n:
            per_layer_config(cfg, n, k)
    from memfit.measure.anymodel import _materialise, _meta_copy

    while len(blocks) < k:
        # Block i is a copy of block i mod n, so a pattern of layer kinds (sliding and full attention, ...)
        # runs on as the config's per-layer lists do. Fresh empty parameters: a deepcopy of fake tensors
        # would not be seen as the same storages.
        source = blocks[len(blocks) % n]
        dev = next(iter(source.parameters())).device
        new = _materialise(_meta_copy(source), dev)
        for m in new.modules():  # Hugging Face layers know their index (KV cache slots; GPT-Neo's is layer_id)
            for name in ("layer_idx", "layer_id"):
                if type(getattr(m, name, None)) is int:
                    setattr(m, name, len(blocks))
        blocks.append(new)
    return model


def spec_source(spec: Any, batch: int, seq: int) -> ChainSource:
    """A memfit GPT spec (built directly with k layers) or a Hugging Face config (built, then cut)."""
    from memfit.measure.trace import _train_step, _vocab
    from memfit.models.spec import ModelSpec, _no_init

    if spec.config is not None:
        def build_k(k: int) -> nn.Module:
            # Fake weights hold no values: torch's init functions (nn.Embedding's normal_, which under
            # FakeTensorMode runs through torch._refs and imports DTensor, a second) are skipped.
            with _no_init():
                return ModelSpec(spec.name, config=replace(spec.config, layers=k), lora=spec.lora).build(seq=seq)
        n = spec.config.layers
    else:
        import transformers  # noqa: F401  (imported before tracing, as trace_step does)

        def build_k(k: int) -> nn.Module:
            return truncate(spec.build(seq=seq), k)
        with torch.device("meta"):
            probe = spec.build()
        n = len(identical_blocks(probe) or [])
        cache = bool(getattr(getattr(probe, "config", None), "use_cache", False))
        if n == 0:
            raise NotAChain("no identical repeated blocks")

    def step(model: nn.Module, opt: Any) -> None:
        dev = next(iter(model.parameters())).device
        _train_step(model, opt, batch, seq, _vocab(model), dev)

    key = ("spec", spec.name, repr(spec.config), str(spec.hf_config), batch, seq)
    if spec.lora is not None:  # adapters (and an NF4 base) in every block
        key += (repr(spec.lora),)
    return ChainSource(build_k, n, step, key, plain_differs=spec.config is None and cache)


def module_source(model: Any, example: Any, loss_fn: Callable | None) -> ChainSource:
    """Any module (real, meta) or factory, with one example micro-batch."""
    from memfit.measure.anymodel import example_step, module_builder

    build = module_builder(model)
    with torch.device("meta"):
        probe = build()
    blocks = identical_blocks(probe)
    n = len(blocks) if blocks is not None else 0

    def build_k(k: int) -> nn.Module:
        return truncate(build(), k)

    key = ("module", id(model), repr(_shapes(example)))
    cache = bool(getattr(getattr(probe, "config", None), "use_cache", False))
    return ChainSource(build_k, n, example_step(example, loss_fn), key, plain_differs=cache)


def _shapes(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return (tuple(obj.shape), str(obj.dtype))
    if isinstance(obj, dict):
        return {k: _shapes(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return [_shapes(v) for v in obj]
    return obj


_CACHE: dict[tuple, ChainProfile] = {}
CATS = ("params", "grads", "optimizer", "activations", "temporaries")


def chain_profile(src: ChainSource, precision: str, optimizer: str, device: str = "cpu",
                  bases: Sequence[BlockAction] = BASE_ACTIONS, with_segments: bool = True,
                  ends: tuple[list[BlockAction], list[BlockAction]] | None = None,
                  step_in_backward: bool = False) -> ChainProfile:
    """The source's ChainProfile (cached in this process)."""
    key = src.key + (precision, optimizer, device, tuple(str(b) for b in bases), with_segments,
                     None if ends is None else tuple(str(a) for e in ends for a in e))
    if step_in_backward:  # appended only when set: the keys of profiles cached before stay valid
        key += ("step-in-backward",)
    prof = _CACHE.get(key)
    if prof is None:
        if src.n_blocks < 1:
            raise NotAChain("no identical repeated blocks")
        from memfit.measure import chain_cache

        prof = chain_cache.load(key)
        if prof is None:
            prof = profile_chain(src.build_k, src.n_blocks, src.step, precision, optimizer, device, bases,
                                 with_segments, src.plain_differs, ends, step_in_backward=step_in_backward)
            chain_cache.store(key, prof)
        _CACHE[key] = prof
    return prof


def bases_of(actions: Sequence[BlockAction]) -> tuple[list[BlockAction], bool]:
    """The distinct actions (segment ids dropped) and whether any segment has two blocks or more."""
    from memfit.apply.policy import segments

    seen: list[BlockAction] = []
    for a in actions:
        b = replace(a, segment=None)
        if b not in seen:
            seen.append(b)
    multi = any(len(r) > 1 for r in segments(actions))
    return seen, multi


def composed_step(spec: Any, batch: int, seq: int, precision: str = "32-true", optimizer: str = "adamw",
                  checkpoint: Any = "none", min_blocks: int = 12, step_in_backward: bool = False):
    """trace_step's TraceResult for a repeated-block model, composed from short traces (exact, see
    memfit.measure.compose); None when the model is not a chain of identical blocks or too short to gain."""
    from memfit.measure.trace import TraceResult

    t0 = time.perf_counter()
    try:
        src = spec_source(spec, batch, seq)
        if src.n_blocks < min_blocks:
            return None
        actions = resolve_policy(checkpoint, src.n_blocks)
        if any(a.offload == "disk" for a in actions):
            return None  # disk read-ahead brings the previous offloaded block back early: not additive
        bases, multi = bases_of(actions)
        regions = segments(actions)
        ends = ([actions[i] for i in regions[0][:2]], [actions[i] for i in regions[-1][-2:]])
        prof = chain_profile(src, precision, optimizer, bases=bases, with_segments=multi, ends=ends,
                             step_in_backward=step_in_backward)
        got = prof.compose(actions)
    except NotAChain:
        return None
    cats = dict(zip(CATS, got.at_peak))
    root, prefix, embeddings = module_names(spec, seq)
    # Each block's and each stretch around the blocks' highest moment, by category (the whole trace's
    # module_categories: sharded per moment by the estimate, read by the per-rank estimate).
    moments = {(f"{prefix}{k[6:]}" if k.startswith("block ") else f"({k})"): dict(zip(CATS, v), total=sum(v))
               for k, v in prof.moments(actions).items()}
    moments[root] = dict(cats, total=got.peak)
    modules = dict(sorted(((k, v["total"]) for k, v in moments.items()), key=lambda kv: -kv[1]))
    other = _busiest(prof.moments(actions, busy=True), prefix)
    # Bytes saved for backward, named as a whole trace names them (the per-rank estimate reads them):
    # each block's, the embeddings' (what the forward keeps before the blocks) and the model's.
    pre, per_block, post = prof.saved(actions)
    saved = {root: pre + sum(per_block) + post, **{f"{prefix}{i}": v for i, v in enumerate(per_block)}}
    if embeddings:
        saved[embeddings[0]] = pre
    return TraceResult(peak=got.peak, modules=modules, seconds=time.perf_counter() - t0, module_categories=moments,
                       other_moments=other,
                       module_activations=dict(sorted(saved.items(), key=lambda kv: -kv[1])), **cats)


def _busiest(points: dict[str, Vec], prefix: str) -> dict[str, dict[str, int]]:
    """The composed step's moment with the most activations + temporaries while the model runs (not
    the optimizer step), named as a whole trace names it (memfit.measure.trace.TraceResult.other_moments)."""
    from memfit.distributed.rank_memory import busiest_name

    points = {k: v for k, v in points.items() if k not in ("optimizer step", "step start")}
    if not points:
        return {}
    k, v = max(points.items(), key=lambda kv: kv[1][3] + kv[1][4])
    name = busiest_name((f"{prefix}{k[6:]}",) if k.startswith("block ") else ())
    return {name: dict(zip(CATS, v), total=sum(v))}


def module_names(spec: Any, seq: int) -> tuple[str, str, list[str]]:
    """The model's class name, its blocks' qualified-name prefix ("blocks.", "model.layers.") and its
    embedding modules' names, from a build on the meta device."""
    from memfit.apply.checkpoint import find_blocks

    probe = spec.on_meta(seq)
    blocks = find_blocks(probe)
    prefix = next(n for n, m in probe.named_modules() if m is blocks) + "."
    embeddings = [n for n, m in probe.named_modules() if isinstance(m, nn.Embedding)]
    return type(probe).__name__, prefix, embeddings

