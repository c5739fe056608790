"""memfit.profile(): what each block costs on this machine, in time and (exactly) in bytes.

    prof = memfit.profile("gpt2", batch=4, seq=256)
    prof.blocks.recompute_s, prof.saved["selective"], prof.bandwidth["disk"]

Times are medians of warm real steps of one model whose policy is switched in place between steps,
in a shuffled order each round (so drift and allocator state hit every variant alike): every block
kept, recomputed one by one (`full`), selective, recomputed in segments (`sqrt`), and with the LM head
in chunks. A block's recompute cost is (t_full - t_none) / blocks, selective's likewise; a segment's
per-block cost is (t_sqrt - t_none) / blocks (on CPU it differs from one block at a time: a segment
recomputes its blocks back to back, with other memory traffic); the chunked head's is t_head - t_none.
Bytes come from the composed estimate's traces (memfit.measure.compose): what a block keeps for
backward under each action, and its input. Offload cost is bytes over measured host-copy and disk
bandwidth. Cached as JSON per model shape, batch, seq, precision, optimizer, device and torch.
"""
from __future__ import annotations

import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from memfit.core import cache


@dataclass
class BlockCosts:
    fwd_s: float
    """One block's forward (= what recomputing it costs)."""
    bwd_s: float
    recompute_s: float
    selective_s: float
    """Extra time per block of selective recomputation."""
    input_bytes: int
    segment_s: dict[str, float] = field(default_factory=dict)
    """Extra time per block of a recomputed segment, by segment length (measured with `sqrt`'s)."""
    head_s: dict[str, float] = field(default_factory=dict)
    """Extra time per step of the LM head in chunks, by chunk count (measured at one count)."""
    saved: dict[str, int] = field(default_factory=dict)
    """Bytes a block keeps for backward, per action (keep, selective, recompute)."""
    bandwidth: dict[str, float] = field(default_factory=dict)
    """Rates for the planner's offload and compression costs: "cpu" and "disk" bytes/s moved, "int8" and
    "fp8" device bytes freed per second of encoding and decoding (memfit.plan.costs)."""


@dataclass
class Profile:
    key: dict[str, Any]
    blocks: BlockCosts
    step_s: dict[str, float]
    """Median step time with every block under each action."""
    bandwidth: dict[str, float]
    """Bytes per second: "cpu" (host copy), "disk" (write + read of a spill file)."""
    offload_s: dict[str, float] = field(default_factory=dict)
    """Per block: moving its kept bytes out and back, per target."""
    cached: bool = False

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("cached")
        return d


HEAD_CHUNKS = 8
"""Chunk count at which the profile times the chunked LM head (memfit.plan.costs scales it to others)."""
VERSION = 3
"""Bumped when what a profile holds changes: older cached profiles are measured again."""


def _median_steps(spec, variants: dict[str, tuple[str, int | None]], batch: int, seq: int, precision: str,
                  rounds: int, optimizer: str = "sgd") -> dict[str, float]:
    """Median warm step time per variant (checkpoint policy, head chunks) of one model switched in place;
    each round runs every variant once in a shuffled order, after one untimed warm step."""
    import memfit
    from memfit.apply.head_swap import chunk_head
    from memfit.apply.optimizer import TrainingOptimizer
    from memfit.measure.trace import _loss

    torch.manual_seed(0)
    model = spec.build(seq=seq)
    opt = TrainingOptimizer(model, optimizer, lr=0.0, precision=precision)
    vocab = spec.config.vocab if spec.config is not None else model.config.vocab_size
    x = torch.randint(0, vocab, (batch, seq))
    times: dict[str, list[float]] = {v: [] for v in variants}
    rng = random.Random(0)

    def step() -> float:
        t0 = time.perf_counter()
        with opt.autocast():
            loss = _loss(model, x)
        opt.backward(loss)
        opt.step()
        return time.perf_counter() - t0

    step()  # warm-up (one step: switching variants has no first-call cost of its own, measured)
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            policy, chunks = variants[name]
            memfit.checkpoint(model, policy)
            chunk_head(model, chunks)
            times[name].append(step())
    return {v: statistics.median(t) for v, t in times.items()}


def bandwidth(nbytes: int = 32 << 20) -> dict[str, float]:
    src = torch.ones(nbytes // 4)
    t0 = time.perf_counter()
    dst = torch.empty_like(src, device="cpu", pin_memory=torch.cuda.is_available())
    dst.copy_(src)
    cpu = nbytes / max(time.perf_counter() - t0, 1e-9)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "spill.bin")
        t0 = time.perf_counter()
        src.numpy().tofile(path)
        back = torch.from_file(path, size=src.numel(), dtype=torch.float32)
        back.sum()
        disk = 2 * nbytes / max(time.perf_counter() - t0, 1e-9)
    return {"cpu": cpu, "disk": disk, **codec_rates(src)}


def codec_rates(src: torch.Tensor) -> dict[str, float]:
    """Per codec: bytes a compressed copy saves over `src`, per second of encoding plus decoding it."""
    from memfit.apply import compress as codecs

    out = {}
    for codec in ("int8", "fp8"):
        t0 = time.perf_counter()
        enc = codecs.encode(src, codec)
        if isinstance(enc, torch.Tensor):  # the codec does not apply here (e.g. no float8 in this torch)
            continue
        codecs.decode(enc)
        packed = sum(t.numel() * t.element_size() for t in enc.tensors)
        out[codec] = max(src.numel() * src.element_size() - packed, 0) / max(time.perf_counter() - t0, 1e-9)
    return out


def profile(model: str, batch: int = 1, seq: int | None = None, precision: str = "32-true", rounds: int = 3,
            use_cache: bool = True, optimizer: str = "sgd") -> Profile:
    """Measure (or read from the cache) what each block of `model` costs; see the module docstring."""
    from memfit.measure.blocks import chain_profile, spec_source
    from memfit.models.spec import parse_model

    spec = parse_model(model)
    seq = seq or min(spec.seq or 1024, 4096)
    key = {"model": spec.name, "shape": repr(spec.config) if spec.config else str(spec.hf_config), "batch": batch,
           "seq": seq, "precision": precision, "device": "cpu", "torch": torch.__version__, "version": VERSION}
    if optimizer != "sgd":  # (sgd profiles keep their old keys)
        key["optimizer"] = optimizer
    if use_cache:
        hit = cache.load(key)
        if hit is not None:
            p = Profile(key, BlockCosts(**hit["blocks"]), hit["step_s"], hit["bandwidth"], hit.get("offload_s", {}))
            p.cached = True
            return p
    src = spec_source(spec, batch, seq)
    chain = chain_profile(src, precision, "sgd")
    n = src.n_blocks
    variants = {"none": ("none", None), "full": ("full", None), "selective": ("selective", None)}
    seg = math.ceil(n / max(1, round(math.sqrt(n))))  # the segment length of `sqrt` (memfit.apply.policy)
    if seg > 1:
        variants["sqrt"] = ("sqrt", None)
    if _head_chunks_fit(src):
        variants[f"head:{HEAD_CHUNKS}"] = ("none", HEAD_CHUNKS)
    steps = _median_steps(spec, variants, batch, seq, precision, rounds, optimizer)
    # Raw differences (signed); memfit.plan.search treats a figure at or below zero as noise.
    rec = (steps["full"] - steps["none"]) / n
    sel = (steps["selective"] - steps["none"]) / n
    saved = {k: chain.fwd[k].net_bytes for k in ("keep", "selective", "recompute")}
    blocks = BlockCosts(fwd_s=max(rec, 0.0), bwd_s=max(steps["none"] / n - max(rec, 0.0), 0.0), recompute_s=rec,
                        selective_s=sel, input_bytes=saved["recompute"], saved=saved)
    if "sqrt" in steps:
        blocks.segment_s = {str(seg): (steps["sqrt"] - steps["none"]) / n}
    if f"head:{HEAD_CHUNKS}" in steps:
        blocks.head_s = {str(HEAD_CHUNKS): steps[f"head:{HEAD_CHUNKS}"] - steps["none"]}
    bw = bandwidth()
    blocks.bandwidth = bw
    offload = {t: 2 * saved["keep"] / bw[t] for t in bw}
    prof = Profile(key, blocks, steps, bw, offload)
    if use_cache:
        cache.store(key, prof.to_json())
    return prof


def _head_chunks_fit(src) -> bool:
    """Whether the LM head can run in HEAD_CHUNKS chunks (each at least MIN_CHUNK vocabulary columns)."""
    from memfit.apply.chunked_head import MIN_CHUNK
    from memfit.apply.head_swap import head_weight

    try:
        with torch.device("meta"):
            vocab = head_weight(src.build_k(1)).shape[0]
    except Exception:  # noqa: BLE001  (a model whose head memfit cannot chunk: no head timing)
        return False
    return HEAD_CHUNKS * MIN_CHUNK <= vocab
