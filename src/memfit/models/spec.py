"""Model specs: a table of well-known architectures (published shapes only), custom
`gpt:`/`llama:` specs, and Hugging Face config.json files. No weights are ever loaded.

    parse_model("gpt2-medium")
    parse_model("gpt:layers=12,hidden=768,heads=12,vocab=50257")
    parse_model("llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256")
    parse_model("path/to/config.json")      # needs `transformers`
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.core.patching import patched
from memfit.models.gpt import GPT, GPTConfig
from memfit.models.hf_check import MAX_LAYERS, check_values, checked
from memfit.models.lora import LoraConfig, apply_lora

_GPT2 = dict(vocab=50257, seq=1024, arch="gpt2")
_LLAMA = dict(arch="llama", bias=False, tied_embeddings=False)

# Shapes as published by the model authors (papers / official config.json files).
ARCHITECTURES: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(layers=12, hidden=768, heads=12, **_GPT2),
    "gpt2-medium": GPTConfig(layers=24, hidden=1024, heads=16, **_GPT2),
    "gpt2-large": GPTConfig(layers=36, hidden=1280, heads=20, **_GPT2),
    "gpt2-xl": GPTConfig(layers=48, hidden=1600, heads=25, **_GPT2),
    "llama-2-7b": GPTConfig(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, seq=4096, **_LLAMA),
    "llama-2-13b": GPTConfig(layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000, seq=4096, **_LLAMA),
    "llama-2-70b": GPTConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq=4096, **_LLAMA),
    "llama-3-8b": GPTConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192,
                            rope_theta=500000.0, **_LLAMA),
    "llama-3-70b": GPTConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=8192,
                             rope_theta=500000.0, **_LLAMA),
    # Llama 3.1 (128k context): torchtitan's llama3 flavors 8B, 70B and 405B
    "llama-3.1-8b": GPTConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=131072,
                              rope_theta=500000.0, **_LLAMA),
    "llama-3.1-70b": GPTConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=131072,
                               rope_theta=500000.0, **_LLAMA),
    "llama-3.1-405b": GPTConfig(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
                                seq=131072, rope_theta=500000.0, **_LLAMA),
    "llama-3.2-1b": GPTConfig(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=131072,
                              rope_theta=500000.0, **{**_LLAMA, "tied_embeddings": True}),
    "llama-3.2-3b": GPTConfig(layers=28, hidden=3072, heads=24, kv_heads=8, ffn=8192, vocab=128256, seq=131072,
                              rope_theta=500000.0, **{**_LLAMA, "tied_embeddings": True}),
    "mistral-7b": GPTConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, seq=32768,
                            **_LLAMA),
}

SUPPORTED = ("memfit builds decoder-only causal language models: a named architecture (gpt2, llama-2-7b, ...), "
             "a gpt:/llama: spec, or a Hugging Face config.json whose model_type has a causal-LM class "
             "(gpt2, llama, mistral, qwen2, gpt_neox, opt, phi, ...)")
"""The supported families, named in every refusal of a model memfit cannot build."""
MAX_ELEMENTS = 2**63 // 8
"""torch sizes tensors in signed 64-bit bytes: no tensor may hold more 8-byte elements than this."""

_SPEC_KEYS = {
    "layers": int, "hidden": int, "heads": int, "vocab": int, "seq": int, "ffn": int,
    "kv_heads": int, "tied": bool, "dropout": float, "bias": bool, "rope_theta": float,
}


@dataclass
class ModelSpec:
    """A model memfit can build with random weights: our GPT from a config, or a HF config file."""

    name: str
    config: GPTConfig | None = None
    hf_config: Path | None = None
    lora: LoraConfig | None = None
    """LoRA adapters on a frozen base (memfit.models.lora), applied by every build."""
    task: str | None = None
    """A config.json's family (memfit.models.hf_families: causal-lm, seq2seq, masked-lm, image-classification);
    None: a causal LM, refused otherwise (what `track` and `train` take)."""
    image_size: int | None = None
    """Image models: the side of the square input (default: the config's image_size)."""

    def build(self, seq: int | None = None) -> nn.Module:
        """Instantiate in the current device/fake-tensor context (e.g. under FakeTensorMode)."""
        if self.config is not None:
            cfg = self.config
            if seq is not None and seq > cfg.seq and cfg.arch == "gpt2":
                raise ConfigError(f"seq={seq} exceeds {self.name}'s position table ({cfg.seq})")
            if seq is not None and seq > cfg.seq:
                cfg = replace(cfg, seq=seq)  # rotary models have no position table to outgrow
            model = GPT(cfg)
        elif self.task is not None:
            from memfit.models.hf_families import build_family

            model = build_family(read_hf_config(self.hf_config, families=True), self.task, self.image_size,
                                 self.hf_config)
        else:
            model = build_hf(self.hf_config)
        return apply_lora(model, self.lora) if self.lora is not None else model

    def num_params(self) -> int:
        return self.counts()[0]

    def on_meta(self, seq: int | None = None) -> nn.Module:
        """The model built on the meta device: shapes and dtypes only, nothing allocated."""
        with torch.device("meta"), _no_init():
            return self.build(seq)

    def counts(self) -> tuple[int, int]:
        """(parameter elements, parameter tensors), from a build on the meta device.

        Tied weights appear once in parameters(), as they occupy memory once."""
        params = list(self.on_meta().parameters())
        return sum(p.numel() for p in params), len(params)

    def trainable_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the parameters that train (all of them, or a LoRA's adapters on a frozen base)."""
        return [tuple(p.shape) for p in self.on_meta().parameters() if p.requires_grad]

    @property
    def seq(self) -> int | None:
        """The model's context length: its position table (memfit's GPT) or its config's positions (HF)."""
        if self.config is not None:
            return self.config.seq
        if self.hf_config is None or self.task == "image-classification":
            return None
        return _hf_positions(read_hf_config(self.hf_config, families=self.task is not None))

    def example(self, batch: int, seq: int | None):
        """A config family's micro-batch: a function device -> dict of inputs with valid values."""
        from memfit.models.hf_families import family_batch, hf_config

        data = read_hf_config(self.hf_config, families=True)
        return family_batch(self.task or "causal-lm", hf_config(data, self.image_size, self.hf_config), batch, seq,
                            self.image_size)

    def check_shape(self, batch: int, seq: int | None) -> None:
        """Refuse a (batch, seq) the model cannot take or torch cannot size, before anything is built.

        seq None means the model's default (its context length, at most 4096)."""
        positions = self.seq if (self.config is None or self.config.arch == "gpt2") else None
        if seq is not None and positions is not None and seq > positions:
            raise ConfigError(f"--seq {seq} exceeds {self.name}'s {positions} positions; use --seq <= {positions}")
        seq = seq or min(self.seq or 1024, 4096)
        _, widest, heads = self._widths()
        largest = max(batch * seq * widest, batch * heads * seq * seq)
        if largest > MAX_ELEMENTS:
            raise ConfigError(f"batch {batch} x seq {seq} gives {self.name} tensors of {largest:.3g} elements, beyond "
                              "torch's 64-bit sizes; use a smaller --batch or --seq")

    def _widths(self) -> tuple[int, int, int]:
        """(hidden, widest activation row, attention heads) from the config, without building."""
        if self.config is not None:
            c = self.config
            return c.hidden, max(c.ffn or 0, c.vocab, (c.heads + 2 * (c.kv_heads or c.heads)) * c.head_dim), c.heads
        return _hf_widths(read_hf_config(self.hf_config, families=self.task is not None))


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def _no_init():
    """torch's weight init functions as no-ops: meta weights hold no values, and `normal_` on the meta
    device goes through torch._refs, whose first call imports torch._dynamo (seconds).

    transformers copies torch's init functions into a table when `transformers.initialization` is
    first imported, which a model class's lazy import does. Imported inside this block, the table
    would keep the no-ops for good, and every later model of the process would train from
    uninitialised memory; so it is imported first."""
    if "transformers" in sys.modules:
        with contextlib.suppress(ImportError):  # transformers releases without the table
            import transformers.initialization  # noqa: F401
    with patched(nn.init, {name: (lambda t, *args, **kwargs: t) for name in _INITS}):
        yield


def _parse_bool(key: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "y"):
        return True
    if value.lower() in ("0", "false", "no", "n"):
        return False
    raise ConfigError(f"spec key {key}={value!r} is not a boolean; use true or false")


def parse_custom(text: str) -> GPTConfig:
    """`gpt:layers=..,hidden=..,heads=..,vocab=..` (or `llama:`): a custom shape."""
    kind, _, body = text.partition(":")
    base = {"gpt": dict(arch="gpt2"), "llama": dict(_LLAMA)}[kind]
    kv: dict[str, object] = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in _SPEC_KEYS:
            raise ConfigError(
                f"malformed model spec item {item!r} in {text!r}; expected key=value with key one of "
                f"{', '.join(_SPEC_KEYS)}"
            )
        typ = _SPEC_KEYS[key]
        try:
            kv[key] = _parse_bool(key, value) if typ is bool else typ(value)
        except ValueError:
            raise ConfigError(f"spec key {key}={value!r} is not a valid {typ.__name__}") from None
        _check_spec_value(key, kv[key], value)
    missing = [k for k in ("layers", "hidden", "heads", "vocab") if k not in kv]
    if missing:
        raise ConfigError(f"model spec {text!r} is missing {', '.join(missing)}; e.g. "
                          "gpt:layers=12,hidden=768,heads=12,vocab=50257")
    if "tied" in kv:
        kv["tied_embeddings"] = kv.pop("tied")
    try:
        cfg = GPTConfig(**{**base, **kv})  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"model spec {text!r}: {exc}") from None
    _check_sizes(text, cfg)
    return cfg


def _check_spec_value(key: str, number: object, text: str) -> None:
    if key == "dropout":
        if not 0 <= number < 1:  # type: ignore[operator]  (NaN fails this too)
            raise ConfigError(f"spec key dropout={text} must be in [0, 1)")
    elif isinstance(number, float) and not math.isfinite(number):
        raise ConfigError(f"spec key {key}={text} must be a finite number")
    elif isinstance(number, (int, float)) and not isinstance(number, bool) and number <= 0:
        raise ConfigError(f"spec key {key}={text} must be positive")
    if key == "layers" and number > MAX_LAYERS:  # type: ignore[operator]
        raise ConfigError(f"spec key layers={text} is more than memfit builds (at most {MAX_LAYERS})")


def _check_sizes(text: str, cfg: GPTConfig) -> None:
    """A weight matrix torch cannot size is refused here, not as an overflow deep inside torch."""
    widest = max(cfg.vocab, cfg.ffn or 0, cfg.seq, (cfg.heads + 2 * (cfg.kv_heads or cfg.heads)) * cfg.head_dim)
    if cfg.hidden * widest > MAX_ELEMENTS:
        raise ConfigError(f"model spec {text!r}: a {cfg.hidden} x {widest} weight is beyond torch's 64-bit sizes; "
                          "use smaller hidden, ffn, vocab or seq")


def parse_model(text: str, task: str | None = None, image_size: int | None = None,
                families: bool = False) -> ModelSpec:
    """Resolve a model name, custom spec or config.json path to a ModelSpec.

    `families` (what `estimate` takes): a config.json may be any family memfit.models.hf_families builds,
    picked from its `architectures` or by `task`; without it only causal LMs (what `train` runs)."""
    text = text.strip()
    if task is not None or image_size is not None:
        families = True
        path = Path(text)
        if not (path.suffix == ".json" or path.is_dir()):
            raise ConfigError(f"{'--task' if task is not None else '--image-size'} applies to a Hugging Face "
                              f"config.json, not to {text!r}")
    if text.lower() in ARCHITECTURES:
        return ModelSpec(text.lower(), config=ARCHITECTURES[text.lower()])
    if text.split(":", 1)[0] in ("gpt", "llama") and ":" in text:
        return ModelSpec(text, config=parse_custom(text))
    path = Path(text)
    if path.suffix == ".json" or path.is_dir():
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no Hugging Face config file at {path}")
        data = read_hf_config(path, families=families)
        name = path.parent.name or path.stem
        if not families:
            _check_causal_lm(data, path)
            checked(data, path)  # every size, count and ratio, before anything is built
            return ModelSpec(name, hf_config=path)
        from memfit.models.hf_families import task_of

        found = task_of(data, task, path)
        if image_size is not None and found != "image-classification":
            raise ConfigError(f"--image-size applies to image models; {path} is a {found} model")
        checked(data, path, image_size)
        return ModelSpec(name, hf_config=path, task=found, image_size=image_size)
    raise ConfigError(
        f"unknown model {text!r}; accepted: one of {', '.join(ARCHITECTURES)}, a custom spec like "
        "gpt:layers=12,hidden=768,heads=12,vocab=50257, or a Hugging Face config.json path"
    )


def read_hf_config(path: Path | None, families: bool = False) -> dict:
    """The config.json as a dict, refused with one line if memfit cannot build a causal LM from it
    (`families`: or a model of another family memfit.models.hf_families builds)."""
    try:
        data = json.loads(Path(path).read_text())  # type: ignore[arg-type]
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read Hugging Face config {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Hugging Face config {path} holds a JSON {type(data).__name__}, not an object; {SUPPORTED}")
    kind = data.get("model_type")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"Hugging Face config {path} has no model_type; {SUPPORTED}")
    if data.get("is_encoder_decoder") and not families:
        raise ConfigError(f"Hugging Face config {path} is an encoder-decoder ({kind}); {SUPPORTED}")
    check_values(data, path)
    return data


def _hf_positions(data: dict) -> int | None:
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        if isinstance(data.get(key), int) and data[key] > 0:
            return data[key]
    return None


def _hf_widths(data: dict) -> tuple[int, int, int]:
    def first(*keys: str, default: int = 1) -> int:
        values = [data[k] for k in keys if isinstance(data.get(k), int) and data[k] > 0]
        return values[0] if values else default

    hidden = first("hidden_size", "n_embd", "d_model", "dim")
    ffn = first("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    return hidden, max(ffn, first("vocab_size"), 3 * hidden), first("num_attention_heads", "n_head", "n_heads")


def build_hf(config_path: Path | None) -> nn.Module:
    """A Hugging Face causal LM from its config.json, with random weights (never downloads)."""
    from memfit.models.hf_check import build_quietly

    data = read_hf_config(config_path)
    _check_causal_lm(data, config_path)
    hidden, widest, _ = _hf_widths(data)
    if hidden * widest > MAX_ELEMENTS:
        raise ConfigError(f"Hugging Face config {config_path}: a {hidden} x {widest} weight is beyond torch's sizes")
    config = checked(data, config_path)
    import transformers

    return build_quietly(lambda: transformers.AutoModelForCausalLM.from_config(config), "model", config_path)


def _check_causal_lm(data: dict, path: Any) -> None:
    """Refuse a config whose model_type has no causal-LM class (or is unknown to transformers)."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise ConfigError("a config.json model needs `transformers`: pip install 'memfit[hf]'") from None
    kind = data["model_type"]
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        known = kind in transformers.CONFIG_MAPPING
        raise ConfigError(f"Hugging Face config {path}: model_type {kind!r} "
                          f"{'has no causal-LM class' if known else 'is unknown to transformers'}; {SUPPORTED}")
