"""Model specs: a table of well-known architectures (published shapes only), custom
`gpt:`/`llama:` specs, and Hugging Face config.json files. No weights are ever loaded.

    parse_model("gpt2-medium")
    parse_model("gpt:layers=12,hidden=768,heads=12,vocab=50257")
    parse_model("llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256")
    parse_model("path/to/config.json")      # needs `transformers`
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.models.gpt import GPT, GPTConfig

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
    "llama-3.2-1b": GPTConfig(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=131072,
                              rope_theta=500000.0, **{**_LLAMA, "tied_embeddings": True}),
    "llama-3.2-3b": GPTConfig(layers=28, hidden=3072, heads=24, kv_heads=8, ffn=8192, vocab=128256, seq=131072,
                              rope_theta=500000.0, **{**_LLAMA, "tied_embeddings": True}),
    "mistral-7b": GPTConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, seq=32768,
                            **_LLAMA),
}

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

    def build(self, seq: int | None = None) -> nn.Module:
        """Instantiate in the current device/fake-tensor context (e.g. under FakeTensorMode)."""
        if self.config is not None:
            cfg = self.config
            if seq is not None and seq > cfg.seq and cfg.arch == "gpt2":
                raise ConfigError(f"seq={seq} exceeds {self.name}'s position table ({cfg.seq})")
            if seq is not None and seq > cfg.seq:
                cfg = replace(cfg, seq=seq)  # rotary models have no position table to outgrow
            return GPT(cfg)
        return build_hf(self.hf_config)

    def num_params(self) -> int:
        return self.counts()[0]

    def counts(self) -> tuple[int, int]:
        """(parameter elements, parameter tensors), from a build on the meta device.

        Tied weights appear once in parameters(), as they occupy memory once."""
        with torch.device("meta"):
            model = self.build()
        params = list(model.parameters())
        return sum(p.numel() for p in params), len(params)

    @property
    def seq(self) -> int | None:
        if self.config is not None:
            return self.config.seq
        return None


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
        if typ in (int, float) and kv[key] <= 0 and key != "dropout":  # type: ignore[operator]
            raise ConfigError(f"spec key {key}={value} must be positive")
    missing = [k for k in ("layers", "hidden", "heads", "vocab") if k not in kv]
    if missing:
        raise ConfigError(f"model spec {text!r} is missing {', '.join(missing)}; e.g. "
                          "gpt:layers=12,hidden=768,heads=12,vocab=50257")
    if "tied" in kv:
        kv["tied_embeddings"] = kv.pop("tied")
    try:
        return GPTConfig(**{**base, **kv})  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"model spec {text!r}: {exc}") from None


def parse_model(text: str) -> ModelSpec:
    """Resolve a model name, custom spec or config.json path to a ModelSpec."""
    text = text.strip()
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
        return ModelSpec(path.parent.name or path.stem, hf_config=path)
    raise ConfigError(
        f"unknown model {text!r}; accepted: one of {', '.join(ARCHITECTURES)}, a custom spec like "
        "gpt:layers=12,hidden=768,heads=12,vocab=50257, or a Hugging Face config.json path"
    )


def build_hf(config_path: Path | None) -> nn.Module:
    """A Hugging Face causal LM from its config.json, with random weights (never downloads)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("a config.json model needs `transformers`: pip install 'memfit[hf]'") from None
    try:
        data = json.loads(Path(config_path).read_text())
        config = transformers.AutoConfig.for_model(**data)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read Hugging Face config {config_path}: {exc}") from None
    return transformers.AutoModelForCausalLM.from_config(config)


def gpt_config_fields() -> list[str]:
    return [f.name for f in fields(GPTConfig)]
