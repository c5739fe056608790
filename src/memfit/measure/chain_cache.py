"""Traced chain profiles kept on disk, so a repeated estimate or plan of a known model shape skips tracing.

A ChainProfile is plain data (bytes per stretch), a pure function of the model shape, batch, precision,
optimizer, the traced actions, and the code that traced it. The key holds all of them: the spec (and a
Hugging Face config's contents), the torch and transformers versions, and a digest of memfit's own
sources, so any change to the code that traces gives a new key rather than a stale figure.
Only model specs are cached (a module given in memory has no identity across processes).
`MEMFIT_NO_CACHE=1` turns it off.
"""
from __future__ import annotations

import functools
import hashlib
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from memfit.core import cache
from memfit.measure.compose import ChainProfile
from memfit.measure.timeline import Stretch

KIND = "chains"
_STRETCH_DICTS = ("per_block", "fwd", "bwd", "seg_extra")
_STRETCHES = ("pre_fwd", "post_fwd", "post_bwd", "pre_bwd", "opt")


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    import torch

    h = hashlib.sha256(torch.__version__.encode())
    try:  # the installed version, without importing transformers (seconds)
        h.update(metadata.version("transformers").encode())
    except metadata.PackageNotFoundError:
        pass
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def disk_key(key: tuple) -> dict[str, Any] | None:
    """The on-disk key of an in-process chain key (None when it is not cacheable across processes)."""
    if os.environ.get("MEMFIT_NO_CACHE") or not key or key[0] != "spec":
        return None
    hf = key[3]
    content = ""
    if hf not in ("None", ""):
        try:
            content = hashlib.sha256(Path(hf).read_bytes()).hexdigest()
        except OSError:
            return None
    return {"chain": repr(key), "hf_config": content, "code": _code_digest()}


def to_json(p: ChainProfile) -> dict[str, Any]:
    d: dict[str, Any] = {"n_blocks": p.n_blocks, "start": list(p.start), "start_per_block": list(p.start_per_block),
                         "traced_blocks": p.traced_blocks, "bw_temps": p.bw_temps, "seconds": p.seconds,
                         "grad_bytes": p.grad_bytes, "block_params": p.block_params,
                         "deferred": {k: {kk: list(v) for kk, v in dv.items()} for k, dv in p.deferred.items()},
                         "plain": to_json(p.plain) if p.plain is not None else None}
    for name in _STRETCHES:
        d[name] = getattr(p, name).to_json()
    for name in _STRETCH_DICTS:
        d[name] = {k: s.to_json() for k, s in getattr(p, name).items()}
    for name in ("first", "last"):
        d[name] = {k: [a.to_json(), b.to_json()] for k, (a, b) in getattr(p, name).items()}
    for name in ("first_around", "last_around"):
        d[name] = {k: {n: s.to_json() for n, s in v.items()} for k, v in getattr(p, name).items()}
    d["first_ckpt"] = None if p.first_ckpt is None else [s.to_json() for s in p.first_ckpt]
    return d


def from_json(d: dict[str, Any]) -> ChainProfile:
    kw: dict[str, Any] = {name: Stretch.from_json(d[name]) for name in _STRETCHES}
    for name in _STRETCH_DICTS:
        kw[name] = {k: Stretch.from_json(s) for k, s in d[name].items()}
    for name in ("first", "last"):
        kw[name] = {k: (Stretch.from_json(a), Stretch.from_json(b)) for k, (a, b) in d[name].items()}
    for name in ("first_around", "last_around"):
        kw[name] = {k: {n: Stretch.from_json(s) for n, s in v.items()} for k, v in d[name].items()}
    fc = d["first_ckpt"]
    kw["first_ckpt"] = None if fc is None else (Stretch.from_json(fc[0]), Stretch.from_json(fc[1]))
    return ChainProfile(
        n_blocks=d["n_blocks"], start=tuple(d["start"]), start_per_block=tuple(d["start_per_block"]),
        deferred={k: {kk: tuple(v) for kk, v in dv.items()} for k, dv in d["deferred"].items()},
        traced_blocks=d["traced_blocks"], bw_temps=d["bw_temps"], seconds=d["seconds"], grad_bytes=d.get("grad_bytes"),
        block_params=d.get("block_params"),
        plain=from_json(d["plain"]) if d["plain"] is not None else None, **kw)


def load(key: tuple) -> ChainProfile | None:
    dk = disk_key(key)
    hit = cache.load(dk, KIND) if dk is not None else None
    if hit is None:
        return None
    try:
        return from_json(hit["profile"])
    except (KeyError, TypeError, ValueError):
        return None


def store(key: tuple, prof: ChainProfile) -> None:
    dk = disk_key(key)
    if dk is None:
        return
    try:
        cache.store(dk, {"profile": to_json(prof)}, KIND)
    except OSError:  # a read-only or full cache folder only costs the next run a trace
        pass
