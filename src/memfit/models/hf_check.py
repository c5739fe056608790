"""A Hugging Face config.json checked before anything is built: one line for what is wrong, never a
traceback from inside transformers or torch, and never a build that cannot end.

    check_values(data, path)           # types and ranges of the sizes, counts and numbers it gives
    config = checked_config(data, path)  # transformers' config object (its own checks too, quietly)
    check_shape(config, data, path)    # divisibility, layer counts, what the layers list per layer
    with quiet(): ...                  # other libraries' warnings silenced while memfit reads a config

Keys are named as the file spells them (`n_embd`, `hidden_size`, ...), for every family: a key a
family does not read is still checked, as a size that is negative or not an integer is never meant.
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
from typing import Any, Iterator

from memfit.core.errors import ConfigError

MAX_LAYERS = 10_000
"""Deeper than any published model by far; building more blocks (even on the meta device) takes minutes."""

COUNTS = ("n_embd", "hidden_size", "d_model", "dim", "n_head", "num_attention_heads", "num_heads", "n_heads",
          "n_layer", "num_hidden_layers", "num_layers", "n_layers", "vocab_size", "n_positions",
          "max_position_embeddings", "n_ctx", "intermediate_size", "ffn_dim", "d_ff", "d_kv",
          "decoder_sparse_step", "image_size", "patch_size", "num_channels")
"""Positive integers wherever they appear (null refused: the family's default is then not what was meant)."""
OPTIONAL_COUNTS = ("n_inner", "head_dim", "num_key_value_heads", "num_kv_heads", "n_kv_heads", "sliding_window",
                   "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size", "rotary_dim",
                   "multi_query_group_num")
"""Positive integers, or null for the family's default (GPT-2's n_inner: 4 x n_embd)."""
EXPERT_COUNTS = ("num_local_experts", "num_experts", "num_experts_per_tok", "n_routed_experts", "n_shared_experts")
"""Integers >= 0 (0: a dense model in some families)."""
LAYER_COUNTS = ("n_layer", "num_hidden_layers", "num_layers", "n_layers")
MAX_SIZE = 2**31 - 1
"""Largest width, count or length: beyond it a size is a typo (torch could not index such a tensor row)."""
PER_LAYER_NAMES = ("layer_types",)
"""Lists of one string per layer."""
POSITIVE_NUMBERS = ("rope_theta", "partial_rotary_factor", "factor")
EPSILONS = ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps", "norm_eps", "initializer_range")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Warnings of other libraries (transformers' config notes, torchao's and torch's import-time
    warnings) silenced: a refusal is one line, and an accepted config prints nothing of theirs."""
    previous = logging.root.manager.disable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(max(previous, logging.WARNING))
        try:
            yield
        finally:
            logging.disable(previous)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _problem(key: str, value: Any) -> str | None:
    """What is wrong with `value` for `key`, or None."""
    name = key.rsplit(".", 1)[-1]
    if name in COUNTS or (name in OPTIONAL_COUNTS and value is not None):
        high = MAX_LAYERS if name in LAYER_COUNTS else MAX_SIZE
        if not _is_int(value) or not 1 <= value <= high:
            return (f"must be a positive integer (at most {high})"
                    + (" or null (the family's default)" if name in OPTIONAL_COUNTS else ""))
    elif name in EXPERT_COUNTS and value is not None:
        if not _is_int(value) or not 0 <= value <= MAX_SIZE:
            return f"must be an integer in [0, {MAX_SIZE}]"
    elif name in PER_LAYER_NAMES and value is not None:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return "must be a list with one layer type (a string) per layer"
    elif name in POSITIVE_NUMBERS and value is not None:
        if not _is_number(value) or value <= 0:
            return "must be a positive finite number"
    elif name in EPSILONS and value is not None:
        if not _is_number(value) or value < 0:
            return "must be a finite number >= 0"
    elif (name.endswith(("dropout", "pdrop", "dropout_prob", "dropout_rate"))) and value is not None:
        if not _is_number(value) or not 0 <= value <= 1:
            return "must be a probability in [0, 1]"
    return None


def check_values(data: dict, path: Any) -> None:
    """Refuse the first size, count or number that no model can be built with, naming its key."""
    def walk(obj: dict, prefix: str) -> None:
        for key, value in obj.items():
            if not isinstance(key, str):
                continue
            full = prefix + key
            if isinstance(value, dict) and (key.endswith(("_config", "_parameters", "_scaling")) or prefix):
                walk(value, full + ".")  # text_config, rope_parameters (per layer type too), rope_scaling
                continue
            problem = _problem(full, value)
            if problem:
                raise ConfigError(f"Hugging Face config {path}: {full} {problem}, got {value!r}")

    walk(data, "")


def _one_line(exc: BaseException) -> str:
    """The useful line of a library's message: the cause of a wrapped validation error, else its first."""
    inner = exc.__cause__ if exc.__cause__ is not None and str(exc.__cause__).strip() else exc
    lines = [line.strip() for line in str(inner).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(inner).__name__


def checked_config(data: dict, path: Any, image_size: int | None = None) -> Any:
    """transformers' config object of `data` (values checked first); any refusal of transformers' is one line."""
    import transformers

    check_values(data, path)
    if image_size is not None:
        data = {**data, "image_size": image_size}
    try:
        with quiet():
            return transformers.AutoConfig.for_model(**data)
    except Exception as exc:  # noqa: BLE001  (huggingface_hub's strict-dataclass errors are no ValueError)
        raise ConfigError(f"cannot build a model from Hugging Face config {path}: {_one_line(exc)}") from None


def text_config(config: Any) -> Any:
    """The part of a config that describes the language model (itself, or a multimodal config's text_config)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _raw_text(data: dict) -> dict:
    inner = data.get("text_config")
    return inner if isinstance(inner, dict) else data


def check_shape(config: Any, data: dict, path: Any) -> None:
    """Divisibility and depth: the checks transformers leaves to a ZeroDivisionError or a failed matmul."""
    text, raw = text_config(config), _raw_text(data)
    layers = getattr(text, "num_hidden_layers", None)
    if _is_int(layers) and not 1 <= layers <= MAX_LAYERS:
        raise ConfigError(f"Hugging Face config {path} has {layers} layers; memfit builds 1 to {MAX_LAYERS}")
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    if not (_is_int(hidden) and _is_int(heads) and hidden > 0 and heads > 0):
        return
    if raw.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"Hugging Face config {path}: the width {hidden} is not a multiple of the {heads} attention "
                          "heads; give a width that the heads divide (or an explicit head_dim)")
    for key in ("num_key_value_heads", "num_kv_heads"):
        kv = getattr(text, key, None)
        if _is_int(kv) and (kv < 1 or heads % kv):
            raise ConfigError(f"Hugging Face config {path}: {key} {kv} must divide the {heads} attention heads "
                              "(grouped-query attention shares each key/value head among heads / kv heads)")
    for key, values in vars(text).items():
        if key in ("layer_types", "no_rope_layers") and isinstance(values, (list, tuple)) and _is_int(layers) \
                and len(values) != layers:
            raise ConfigError(f"Hugging Face config {path}: {key} lists {len(values)} layers, the model has {layers}")


def checked(data: dict, path: Any, image_size: int | None = None) -> Any:
    """The config object of `data`, every check above passed."""
    config = checked_config(data, path, image_size)
    check_shape(config, data, path)
    return config


TRACING_MODULES = ("torch._subclasses", "torch.fx", "torch._dynamo")
"""Where the exceptions of a build under FakeTensorMode come from (not the config's fault)."""


def build_quietly(build: Any, what: str, path: Any) -> Any:
    """`build()` (a model from a checked config) with other libraries' warnings silenced; what a check
    above did not foresee is refused in one line rather than as a traceback."""
    import torch

    try:
        with quiet():
            return build()
    except (ConfigError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # noqa: BLE001  (a config transformers accepts but cannot build)
        if type(exc).__module__.startswith(TRACING_MODULES):
            raise  # the fake-tensor build's own limits: its callers fall back to a build on the meta device
        raise ConfigError(f"cannot build a {what} from Hugging Face config {path}: {type(exc).__name__}: "
                          f"{_one_line(exc)}") from None


INDEX_LISTS = ("mlp_only_layers", "moe_layers")
"""Config lists of layer indices (not one entry per layer): Qwen2/3-MoE's dense layers, Llama-4's sparse ones."""


def per_layer_config(cfg: Any, n: int, k: int) -> None:
    """Set a Hugging Face config of n layers to k, each per-layer list kept consistent with the layers:
    the first k entries, or (k > n) entry i mod n for the copies of block i mod n. Lists of one entry
    per layer (`layer_types`, `no_rope_layers`, ...) are the lists of n entries named for layers (not
    `architectures` or `eos_token_id`, which may have n entries too); lists of layer indices (INDEX_LISTS)
    keep the indices of the layers there are."""
    for name, values in list(vars(cfg).items()):
        if name in INDEX_LISTS and isinstance(values, (list, tuple)):
            setattr(cfg, name, type(values)(i for i in range(k) if i % n in values))
        elif isinstance(values, (list, tuple)) and len(values) == n and "layer" in name and not name.startswith("_"):
            setattr(cfg, name, type(values)(values[i % n] for i in range(k)))
    cfg.num_hidden_layers = k
