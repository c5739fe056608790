"""Checkpoint policies as plain data: one `BlockAction` per repeated block.

A policy is what the planner emits and what `memfit.checkpoint` carries out. It can be written as

- a name for the whole model: ``none``, ``full``, ``every:K``, ``sqrt``, ``selective`` (or
  ``selective:torchtitan``: torchtitan's op list, memfit.apply.selective), ``wrapper`` (torch's
  ``checkpoint_wrapper`` on every block, as torchtitan and accelerate apply it: ``recompute+cache``)
  (optionally with modifiers: ``full+offload:disk``, ``selective+compress:int8``);
- a compact per-block list: ``keep*4,selective*4,recompute+offload:disk*4`` (``*N`` repeats an item;
  a single item applies to every block);
- a JSON list (in the string itself or in a ``.json`` file): ``[{"mode": "recompute", "offload": "cpu"}, "keep"]``.

Every block is one mode (keep / selective / recompute) plus, optionally, where what it keeps goes
(``offload:cpu|disk``) and how it is stored (``compress:int8|int8-channel|fp8|bf16|fp16``). What a block
"keeps" depends on its mode: everything autograd saves for ``keep``, only the block input for
``recompute`` and ``selective`` (the input is what recomputation starts from). ``seg=N`` joins
consecutive recomputed blocks with the same N into one recomputed segment (Chen et al.'s sqrt(L)
scheme): only the segment's input is kept, and the whole segment is recomputed in backward.
``+cache`` (recompute only) leaves a Hugging Face model's KV cache as its config has it: memfit
switches the cache off under recomputation, as ``gradient_checkpointing_enable`` does (so ``full``
is what Hugging Face's own checkpointing keeps), but torch's ``checkpoint_wrapper`` does not, and the
cache then holds each layer's keys and values from forward and their recomputed copies appended in
backward (docs/activations.md).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

from memfit.core.errors import ConfigError

MODES = ("keep", "selective", "recompute")
OFFLOADS = ("cpu", "disk")
COMPRESSIONS = ("int8", "int8-channel", "fp8", "bf16", "fp16")
NAMED = ("none", "full", "every:K", "sqrt", "selective", "wrapper")
SELECTIVE_OPS = ("torchtitan",)
"""Op lists a selective block may follow instead of memfit's (memfit.apply.selective): `selective:torchtitan`."""

ACCEPTED = (
    "accepted: none, full, every:K, sqrt, selective, selective:torchtitan, wrapper "
    "(each optionally +offload:cpu|disk, +compress:CODEC), "
    "or a comma list of per-block items MODE[+offload:cpu|disk][+compress:CODEC][+seg=N][+cache][*COUNT] "
    f"with MODE in {'/'.join(MODES)} and CODEC in {'/'.join(COMPRESSIONS)}, "
    "or a JSON list of such items / {\"mode\": ..., \"offload\": ..., \"compress\": ..., \"segment\": ...} "
    "(inline or in a .json file)"
)


@dataclass(frozen=True)
class BlockAction:
    """What one block does with its activations."""

    mode: str = "keep"
    """keep: autograd saves as usual; selective: keep matmul/attention outputs, recompute the rest;
    recompute: keep only the block input and rerun the block in backward."""
    offload: str | None = None
    """None, "cpu" or "disk": where the kept tensors live between forward and backward."""
    compress: str | None = None
    """None or a codec from COMPRESSIONS: how the kept tensors are stored (lossy except none)."""
    segment: int | None = None
    """Recompute only: consecutive blocks with the same id are recomputed as one segment."""
    ops: str | None = None
    """Selective only: whose op list decides what is kept (None: memfit's; one of SELECTIVE_OPS)."""
    cache: bool = False
    """Recompute only: the model's KV cache stays as configured (torch's checkpoint_wrapper); without
    it memfit switches a Hugging Face cache off, as Hugging Face's own checkpointing does."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown block mode {self.mode!r}; {ACCEPTED}")
        if self.offload not in (None, *OFFLOADS):
            raise ConfigError(f"unknown offload target {self.offload!r}; accepted: cpu, disk")
        if self.compress not in (None, *COMPRESSIONS):
            raise ConfigError(f"unknown compression {self.compress!r}; accepted: {', '.join(COMPRESSIONS)}")
        if self.segment is not None and self.mode != "recompute":
            raise ConfigError(f"seg= is only meaningful for recompute blocks, got mode {self.mode!r}")
        if self.ops is not None and (self.mode != "selective" or self.ops not in SELECTIVE_OPS):
            raise ConfigError(f"op list {self.ops!r} for a {self.mode} block; accepted: "
                              + ", ".join(f"selective:{o}" for o in SELECTIVE_OPS))
        if self.cache and self.mode != "recompute":
            raise ConfigError(f"+cache is only meaningful for recompute blocks, got mode {self.mode!r}")

    @property
    def is_plain(self) -> bool:
        """True when the block runs exactly as without memfit."""
        return self.mode == "keep" and self.offload is None and self.compress is None

    def __str__(self) -> str:
        parts = [self.mode + (f":{self.ops}" if self.ops else "")]
        if self.offload:
            parts.append(f"offload:{self.offload}")
        if self.compress:
            parts.append(f"compress:{self.compress}")
        if self.segment is not None:
            parts.append(f"seg={self.segment}")
        if self.cache:
            parts.append("cache")
        return "+".join(parts)


def to_string(actions: Sequence[BlockAction]) -> str:
    """The compact form, run-length encoded: `keep*2,recompute+offload:disk*3`."""
    out: list[str] = []
    i = 0
    while i < len(actions):
        j = i
        while j + 1 < len(actions) and actions[j + 1] == actions[i]:
            j += 1
        n = j - i + 1
        out.append(str(actions[i]) + (f"*{n}" if n > 1 else ""))
        i = j + 1
    return ",".join(out)


def to_json(actions: Sequence[BlockAction]) -> str:
    return json.dumps([{k: v for k, v in asdict(a).items() if v is not None and v is not False} for a in actions])


def _apply_modifiers(base: BlockAction, mods: list[str], where: str) -> BlockAction:
    for mod in mods:
        key, _, value = mod.partition(":")
        if key == "offload" and value:
            base = replace(base, offload=value)
        elif key == "compress" and value:
            base = replace(base, compress=value)
        elif mod == "cache":
            base = replace(base, cache=True)
        elif mod.startswith("seg=") and mod[4:].isdigit():
            base = replace(base, segment=int(mod[4:]))
        else:
            raise ConfigError(f"bad modifier {mod!r} in {where!r}; {ACCEPTED}")
    return base


def _parse_item(item: Any) -> list[BlockAction]:
    """One list item (string or dict) -> one or more (repeated) actions."""
    if isinstance(item, BlockAction):
        return [item]
    if isinstance(item, dict):
        unknown = set(item) - {"mode", "offload", "compress", "segment", "ops", "cache", "repeat"}
        if unknown:
            raise ConfigError(f"unknown keys {sorted(unknown)} in block action {item}; {ACCEPTED}")
        fields = {k: v for k, v in item.items() if k != "repeat"}
        return [BlockAction(**fields)] * int(item.get("repeat", 1))
    if not isinstance(item, str) or not item.strip():
        raise ConfigError(f"bad block action {item!r}; {ACCEPTED}")
    text = item.strip()
    count = 1
    if "*" in text:
        text, _, n = text.rpartition("*")
        if not n.strip().isdigit() or int(n) < 1:
            raise ConfigError(f"bad repeat count in {item!r}; use ITEM*N with N >= 1")
        count = int(n)
    mode, *mods = [p.strip() for p in text.split("+")]
    if mode.startswith(("offload:", "compress:")):  # a bare modifier: a kept block, offloaded/compressed
        mode, mods = "keep", [mode, *mods]
    if mode == "full":  # accepted in lists as an alias: a fully recomputed block
        mode = "recompute"
    mode, _, ops = mode.partition(":")
    if mode not in MODES:
        raise ConfigError(f"unknown block mode {mode!r} in {item!r}; {ACCEPTED}")
    return [_apply_modifiers(BlockAction(mode, ops=ops or None), mods, item)] * count


def _named(text: str, n_blocks: int) -> list[BlockAction] | None:
    """Whole-model names (with modifiers), or None if `text` is not one."""
    name, *mods = [p.strip() for p in text.split("+")]
    if name == "none":
        base = [BlockAction("keep")] * n_blocks
    elif name == "full":
        base = [BlockAction("recompute")] * n_blocks
    elif name == "selective":
        base = [BlockAction("selective")] * n_blocks
    elif name == "wrapper":  # torch's checkpoint_wrapper per block: recomputed, the KV cache as configured
        base = [BlockAction("recompute", cache=True)] * n_blocks
    elif name.startswith("selective:"):
        base = [BlockAction("selective", ops=name[len("selective:"):])] * n_blocks
    elif name == "sqrt":
        # Chen et al. (2016): about sqrt(L) segments, each recomputed as a whole in backward.
        n_seg = max(1, round(math.sqrt(n_blocks)))
        size = math.ceil(n_blocks / n_seg)
        base = [BlockAction("recompute", segment=i // size) for i in range(n_blocks)]
    elif name.startswith("every:"):
        k = name[6:]
        if not k.isdigit() or int(k) < 1:
            raise ConfigError(f"bad policy {text!r}: every:K needs an integer K >= 1")
        base = [BlockAction("recompute" if i % int(k) == 0 else "keep") for i in range(n_blocks)]
    else:
        return None
    # "none+offload:cpu" keeps everything autograd saves, but offloads it.
    return [_apply_modifiers(a, mods, text) for a in base]


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"checkpoint policy is not valid JSON ({exc.msg} at char {exc.pos}); {ACCEPTED}") from None


def parse_items(policy: Any) -> list[BlockAction] | str:
    """Parse a policy without knowing the block count: a list of actions, or a whole-model name.

    Raises ConfigError for anything malformed (so a CLI can fail before building the model).
    """
    if isinstance(policy, str):
        text = policy.strip()
        if text.endswith(".json") or (os.sep in text and os.path.isfile(text)):
            if not os.path.isfile(text):
                raise ConfigError(f"checkpoint policy file {text!r} does not exist")
            with open(text) as f:
                return parse_items(_load_json(f.read()))
        if text.startswith("["):
            return parse_items(_load_json(text))
        if "," not in text and _named(text, 1) is not None:
            return text
        return [a for item in text.split(",") for a in _parse_item(item)]
    if isinstance(policy, (list, tuple)):
        if not policy:
            raise ConfigError(f"empty checkpoint policy list; {ACCEPTED}")
        return [a for item in policy for a in _parse_item(item)]
    raise ConfigError(f"checkpoint policy must be a string or a list, got {type(policy).__name__}; {ACCEPTED}")


def resolve_policy(policy: Any, n_blocks: int) -> list[BlockAction]:
    """Exactly one validated BlockAction per block."""
    parsed = parse_items(policy)
    if isinstance(parsed, str):
        actions = _named(parsed, n_blocks)
        assert actions is not None
    elif len(parsed) == 1:
        actions = parsed * n_blocks  # one item applies to every block
        if parsed[0].segment is not None:
            raise ConfigError("a single item with seg= would make one segment of all blocks; use sqrt or list blocks")
    elif len(parsed) == n_blocks:
        actions = parsed
    else:
        raise ConfigError(f"checkpoint policy lists {len(parsed)} block actions but the model has {n_blocks} blocks")
    _check_segments(actions)
    return actions


def _check_segments(actions: list[BlockAction]) -> None:
    seen: set[int] = set()
    prev: int | None = None
    for i, a in enumerate(actions):
        if a.segment is not None and a.segment != prev:
            if a.segment in seen:
                raise ConfigError(f"segment {a.segment} is not contiguous (block {i}); segments must be consecutive blocks")
            seen.add(a.segment)
        elif a.segment is not None and a.segment == prev:
            first = actions[i - 1]
            if (a.offload, a.compress) != (first.offload, first.compress):
                raise ConfigError(f"blocks of segment {a.segment} must share offload/compress settings (block {i})")
        prev = a.segment


def segments(actions: Sequence[BlockAction]) -> list[list[int]]:
    """Group block indices into recompute regions (a region of one block unless seg= joins them)."""
    regions: list[list[int]] = []
    for i, a in enumerate(actions):
        if a.segment is not None and regions and actions[regions[-1][0]].segment == a.segment:
            regions[-1].append(i)
        else:
            regions.append([i])
    return regions
