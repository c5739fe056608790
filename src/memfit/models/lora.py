"""LoRA adapters on a frozen base: how most people fit a large model's fine-tuning on a small device.

    model = apply_lora(model, parse_lora("r=8,targets=q_proj,v_proj"))

Every base parameter is frozen (requires_grad=False: no gradient, no optimizer state); each targeted
linear layer y = W x gains y += (B A x) * alpha / r with A (r x in) and B (out x r) trainable, B
starting at zero as in peft's LoRA, so the adapted model computes what the base did at step 0. The
adapter's memory is what peft's LoRA (dropout 0) allocates: its weights, their gradients and optimizer
state, and the activations A and B save for backward (x and A x).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError


@dataclass(frozen=True)
class LoraConfig:
    r: int = 8
    """Rank of the update B A."""
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    """Linear layers to adapt, by name: the last part of a module's name (q_proj) or a dotted tail (attn.proj)."""
    alpha: float = 16.0
    """Scale of the update: alpha / r."""
    base: str | None = None
    """nf4: the frozen base's linear layers in 4-bit NormalFloat (QLoRA, memfit.models.qlora); None: as built."""


_KEYS = ("r", "targets", "alpha", "base")
BASES = ("nf4",)


def parse_lora(text: str) -> LoraConfig:
    """`r=8,targets=q_proj,v_proj[,alpha=16][,base=nf4]`: items without '=' continue the targets list."""
    values: dict[str, object] = {}
    targets: list[str] = []
    key = None
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        k, eq, v = item.partition("=")
        if eq:
            key = k.strip()
            if key not in _KEYS:
                raise ConfigError(f"--lora {text!r}: unknown key {key!r}; accepted: {', '.join(_KEYS)} "
                                  "(e.g. r=8,targets=q_proj,v_proj)")
            if key == "targets":
                targets.append(v.strip())
            else:
                values[key] = v.strip()
        elif key == "targets":
            targets.append(item)
        else:
            raise ConfigError(f"--lora {text!r}: {item!r} is not key=value; e.g. r=8,targets=q_proj,v_proj")
    try:
        r = int(values.get("r", 8))
        alpha = float(values.get("alpha", 2 * r))
    except ValueError:
        raise ConfigError(f"--lora {text!r}: r must be an integer and alpha a number") from None
    if r < 1 or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"--lora {text!r}: r must be a positive integer and alpha a positive number")
    if not targets or not all(targets):
        raise ConfigError(f"--lora {text!r} names no layers to adapt; add targets=NAME[,NAME...], e.g. q_proj,v_proj")
    base = values.get("base")
    if base is not None and base not in BASES:
        raise ConfigError(f"--lora {text!r}: base={base} is not one of {', '.join(BASES)} (4-bit NormalFloat, QLoRA)")
    return LoraConfig(r=r, targets=tuple(targets), alpha=alpha, base=base)


def with_nf4_base(lora: "LoraConfig | str | None", flag: str = "qlora=True") -> LoraConfig:
    """`lora` with its base in NF4 (QLoRA); `flag` names the option in the refusal when lora is None."""
    if lora is None:
        raise ConfigError(f"{flag} puts a LoRA fine-tune's base in 4 bits: give the adapters too, "
                          "e.g. r=16,targets=q_proj,v_proj")
    cfg = parse_lora(lora) if isinstance(lora, str) else lora
    return replace(cfg, base="nf4")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (peft's LoRA with dropout 0)."""

    def __init__(self, base: nn.Module, r: int, alpha: float) -> None:
        super().__init__()
        in_features, out_features = _features(base)
        w = base.weight
        self.base = base
        self.lora_A = nn.Linear(in_features, r, bias=False, device=w.device, dtype=w.dtype)
        self.lora_B = nn.Linear(r, out_features, bias=False, device=w.device, dtype=w.dtype)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def _features(layer: nn.Module) -> tuple[int, int]:
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    # transformers' Conv1D (GPT-2): weight stored (in, out)
    return int(layer.weight.shape[0]), int(layer.weight.shape[1])


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and getattr(module, "weight", None)
                                              is not None and module.weight.dim() == 2)


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Freeze `model` and wrap every targeted linear layer in a LoRALinear (in place; returns the model);
    cfg.base "nf4" then holds every frozen linear weight but the head in NF4 (QLoRA)."""
    for p in model.parameters():
        p.requires_grad_(False)
    linear = [(name, m) for name, m in model.named_modules() if _is_linear(m) and name]
    chosen = [(name, m) for name, m in linear if _matches(name, cfg.targets)]
    if not chosen:
        names = sorted({name.rsplit(".", 1)[-1] for name, _ in linear})
        raise ConfigError(f"--lora targets {', '.join(cfg.targets)} match no linear layer of {type(model).__name__}; "
                          f"its linear layers are named {', '.join(names) or '(none)'}")
    for name, layer in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(layer, cfg.r, cfg.alpha))
    if cfg.base == "nf4":
        from memfit.models.qlora import quantize_base

        quantize_base(model)
    return model
