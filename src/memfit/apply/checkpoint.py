"""Activation checkpointing, offload and compression of a model's repeated blocks, by policy.

    memfit.checkpoint(model, "selective")
    memfit.checkpoint(model, "keep*4,recompute+offload:disk*8", spill_dir="/nvme/tmp")

A policy resolves to one `BlockAction` per block (see `memfit.apply.policy`). Blocks are wrapped by
replacing the block's *instance* `forward`, so parameter names and state_dict keys are unchanged;
applying another policy (or "none") replaces the previous one.

Recomputation uses PyTorch's non-reentrant checkpoint machinery (the generator behind
`torch.utils.checkpoint.checkpoint`), opened at a segment's first block and closed after its last
block, so one code path serves single blocks and multi-block segments (sqrt). That machinery stashes
and restores the CPU and device RNG states and the autocast state, which makes recomputation
bit-exact, dropout included. It saves the segment's input through whatever saved-tensor hooks are
active when it opens — which is how a recomputed block's input gets offloaded or compressed: the
store's hooks are pushed just before the segment opens and popped after it closes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils import checkpoint as _tc

from memfit.apply import selective
from memfit.apply.offload import ActivationStore
from memfit.core.spill import validate_spill_dir
from memfit.apply.policy import BlockAction, resolve_policy, segments
from memfit.core.compat import checkpoint_generator_flags
from memfit.core.errors import ConfigError

# Attribute paths where well-known models keep their repeated blocks.
_BLOCK_PATHS = ("blocks", "transformer.h", "model.layers", "transformer.layers", "layers", "h", "model.decoder.layers")


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: a known attribute path, else the largest ModuleList."""
    for path in _BLOCK_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ConfigError(
            f"found no nn.ModuleList of repeated blocks in {type(model).__name__}; "
            "pass blocks=<the ModuleList> explicitly"
        )
    return max(lists, key=len)


@dataclass
class Applied:
    """What `checkpoint` did to a block list (kept on the ModuleList; not part of the state_dict)."""

    actions: list[BlockAction]
    store: ActivationStore | None


def applied(model: nn.Module, blocks: nn.ModuleList | None = None) -> Applied | None:
    """The policy currently applied to `model` (None if none), with its activation store (offload stats)."""
    blocks = blocks if blocks is not None else find_blocks(model)
    return getattr(blocks, "_memfit_applied", None)


def _orig_forward(block: nn.Module) -> Callable[..., Any]:
    return block.__dict__.get("forward") or type(block).forward.__get__(block)


def _install(block: nn.Module, fn: Callable[..., Any]) -> None:
    fn._memfit_orig = block.__dict__.get("forward")  # type: ignore[attr-defined]
    block.forward = fn  # type: ignore[method-assign]


def _uninstall(block: nn.Module) -> None:
    fn = block.__dict__.get("forward")
    if fn is None or not hasattr(fn, "_memfit_orig"):
        return
    if fn._memfit_orig is None:
        del block.__dict__["forward"]
    else:
        block.forward = fn._memfit_orig


def _hidden_first(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Blocks called as block(hidden_states=x, ...) are treated as block(x, ...)."""
    if not args and "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        args = (kwargs.pop("hidden_states"),)
    return args, kwargs


def _next_hidden(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


class _Region:
    """Consecutive blocks recomputed together in backward; only the first block's inputs are kept."""

    def __init__(self, blocks: nn.ModuleList, idx: list[int], action: BlockAction, store: ActivationStore | None) -> None:
        self.idx, self.action, self.store = idx, action, store
        self.origs = {i: _orig_forward(blocks[i]) for i in idx}
        self.context_fn = selective.context_for(action.ops) if action.mode == "selective" else _tc.noop_context_fn
        self._open: tuple | None = None  # (generator, hooks context, calls) while a forward is inside

    def __call__(self, i: int, args: tuple, kwargs: dict) -> Any:
        args, kwargs = _hidden_first(args, kwargs)
        if i == self.idx[0]:
            self._start(args, kwargs)
        elif self._open is None:  # the model skipped the segment's first block: nothing to recompute from
            return self.origs[i](*args, **kwargs)
        else:
            if not args or not isinstance(args[0], torch.Tensor):
                self._abort(None)
                raise ConfigError(f"block {i} of a recompute segment must take the hidden state as first argument")
            self._open[2].append((i, args[1:], kwargs))
        try:
            out = self.origs[i](*args, **kwargs)
        except BaseException as exc:
            self._abort(exc)
            raise
        if i == self.idx[-1]:
            self._finish()
        return out

    def _start(self, args: tuple, kwargs: dict) -> None:
        if self._open is not None:  # a previous forward died between blocks of this segment
            self._abort(None)
        calls: list[tuple[int, tuple, dict]] = [(self.idx[0], (), kwargs)]
        origs = self.origs

        def recompute(*inputs: Any) -> None:
            out = origs[calls[0][0]](*inputs, **calls[0][2])
            for j, extra, kw in calls[1:]:
                out = origs[j](_next_hidden(out), *extra, **kw)

        a = self.action
        hooks = self.store.hooks(self.idx[0], a.offload, a.compress) if (a.offload or a.compress) else None
        if hooks is not None:
            hooks.__enter__()
        flags = checkpoint_generator_flags(self.context_fn)
        gen = _tc._checkpoint_without_reentrant_generator(recompute, *flags, *args)
        try:
            next(gen)
        except BaseException:
            if hooks is not None:
                hooks.__exit__(None, None, None)
            raise
        self._open = (gen, hooks, calls)

    def _finish(self) -> None:
        gen, hooks, _ = self._open
        self._open = None
        try:
            next(gen)
        except StopIteration:
            pass
        finally:
            if hooks is not None:
                hooks.__exit__(None, None, None)

    def _abort(self, exc: BaseException | None) -> None:
        if self._open is None:
            return
        gen, hooks, _ = self._open
        self._open = None
        try:
            gen.throw(exc if exc is not None else RuntimeError("checkpoint segment abandoned"))
        except BaseException:
            pass
        finally:
            if hooks is not None:
                hooks.__exit__(None, None, None)


def _region_forward(region: _Region, i: int) -> Callable[..., Any]:
    return lambda *args, **kwargs: region(i, args, kwargs)


def _kept_forward(orig: Callable[..., Any], store: ActivationStore, i: int, a: BlockAction) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        with store.hooks(i, a.offload, a.compress):
            return orig(*args, **kwargs)

    return forward


def remove(model: nn.Module, blocks: nn.ModuleList | None = None) -> nn.Module:
    """Undo `checkpoint`: plain forwards again, spill folder removed."""
    blocks = blocks if blocks is not None else find_blocks(model)
    for block in blocks:
        _uninstall(block)
    prev = getattr(blocks, "_memfit_applied", None)
    if prev is not None and prev.store is not None:
        prev.store.close()
    blocks.__dict__.pop("_memfit_applied", None)
    return model


def checkpoint(
    model: nn.Module,
    policy: Any = "full",
    blocks: nn.ModuleList | None = None,
    spill_dir: str | None = None,
) -> nn.Module:
    """Apply a checkpoint policy to `model`'s repeated blocks in place and return the model.

    policy: a name (none, full, every:K, sqrt, selective, optionally +offload:cpu|disk / +compress:CODEC),
    a compact per-block list ("keep*2,recompute+offload:disk*10"), a JSON list or .json file, or a list of
    `BlockAction`s (what the planner emits). See docs/activations.md.
    blocks: the nn.ModuleList of repeated blocks, if `find_blocks` does not find the right one.
    spill_dir: folder for offload:disk (default: the system temp folder); checked here, before training.
    """
    blocks = blocks if blocks is not None else find_blocks(model)
    actions = resolve_policy(policy, len(blocks))
    remove(model, blocks)
    if all(a.is_plain for a in actions):
        return model
    store = None
    if any(a.offload or a.compress for a in actions):
        if any(a.offload == "disk" for a in actions):
            validate_spill_dir(spill_dir, purpose="activation offload")
        store = ActivationStore(model, spill_dir=spill_dir)
    for region in segments(actions):
        a = actions[region[0]]
        if a.mode == "keep":
            if not a.is_plain:
                i = region[0]
                _install(blocks[i], _kept_forward(_orig_forward(blocks[i]), store, i, a))
            continue
        r = _Region(blocks, region, a, store)
        for i in region:
            _install(blocks[i], _region_forward(r, i))
    if any(a.mode != "keep" and not a.cache for a in actions):
        # Hugging Face models would append to a KV cache again while recomputing; they switch it off too
        # (+cache leaves it, as torch's checkpoint_wrapper does: apply.policy).
        # Every config the model's modules read: a multimodal model's language model reads its text config.
        configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
        for c in list(configs.values()):
            text = c.get_text_config() if callable(getattr(c, "get_text_config", None)) else None
            if text is not None:
                configs[id(text)] = text
        for config in configs.values():
            if getattr(config, "use_cache", False):
                config.use_cache = False
    object.__setattr__(blocks, "_memfit_applied", Applied(actions, store))
    return model
