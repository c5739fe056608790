"""A readable GPT: token + position embeddings, pre-norm blocks, tied head.

Every block is one `Block` in `GPT.blocks` (an `nn.ModuleList`), which is what the activation
mechanisms in `memfit.apply` look for. Grouped-query attention (`kv_heads < heads`) and an explicit
FFN width cover Llama-style shapes with the same code.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    vocab: int = 50257
    seq: int = 1024
    """Longest sequence (size of the learned position table)."""
    ffn: int | None = None
    """FFN inner width; None means 4 * hidden as in GPT-2."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means heads (plain multi-head)."""
    tied_embeddings: bool = True
    dropout: float = 0.0
    bias: bool = True
    arch: str = "gpt2"
    """"gpt2" (LayerNorm, GELU MLP, learned positions) or "llama" (RMSNorm, SwiGLU MLP, rotary)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        self.ffn = self.ffn or 4 * self.hidden
        self.kv_heads = self.kv_heads or self.heads
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.arch not in ("gpt2", "llama"):
            raise ValueError(f"arch={self.arch!r}; accepted: gpt2, llama")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def rope_tables(T: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x1, x2) of (B, H, T, D) by position-dependent angles."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def make_norm(cfg: "GPTConfig") -> nn.Module:
    if cfg.arch == "llama":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, bias=cfg.bias, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        qkv_out = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, qkv_out, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.rope = cfg.arch == "llama"
        self.rope_theta = cfg.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = rope_tables(T, self.head_dim, self.rope_theta, x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_heads != self.heads:  # grouped-query attention: share each kv head across a group
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)  # local heads under tensor parallelism
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """GPT-2's GELU MLP, or Llama's SwiGLU (a gated pair of up-projections) when arch="llama"."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.arch == "llama"
        self.fc = nn.Linear(cfg.hidden, cfg.ffn * (2 if self.swiglu else 1), bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.drop(self.proj(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _holds_no_data(t: torch.Tensor) -> bool:
    if t.device.type == "meta":
        return True
    # No fake tensor exists before FakeTensorMode's module is loaded; importing it here would pull in
    # torch._dynamo (seconds) for every build.
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and fake.is_fake(t)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden) if cfg.arch == "gpt2" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = make_norm(cfg)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.tok.weight
        # With targets: a replacement for head + summed cross-entropy, called as head_loss(hidden, weight,
        # bias, targets, ignore_index, reduction). memfit.apply.head_swap sets a chunked one that never
        # holds all the logits; the forward then returns logits=None.
        self.head_loss = None
        if _holds_no_data(self.head.weight):
            return  # meta or fake weights (estimates, plans): initial values are never read
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for `idx` (B, T); with `targets`, returns (logits, summed cross-entropy, n tokens)
        (logits None when a chunked head is installed: see `head_loss`).

        The loss is a *sum* so that gradient accumulation can divide by the token count of the
        whole accumulated batch (see memfit.train.loop); `ignore_index=-1` marks padding.
        """
        T = idx.shape[1]
        if T > self.cfg.seq:
            raise ValueError(f"sequence length {T} exceeds the model's seq={self.cfg.seq}")
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(T, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        h = self.ln_f(x)
        if targets is not None and self.head_loss is not None:
            loss = self.head_loss(h, self.head.weight, self.head.bias, targets, -1, "sum")
            return None, loss, (targets != -1).sum()
        logits = self.head(h)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1, reduction="sum")
        return logits, loss, (targets != -1).sum()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
