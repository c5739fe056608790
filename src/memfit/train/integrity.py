"""Checksums inside a checkpoint: a flipped bit anywhere in it is refused on load, naming what changed.

    sealed = seal(state)        # state plus "checksums": crc32 of every tensor's bytes, blake2b of the rest
    state = verify(loaded, "'runs/x/checkpoint.pt'")   # ConfigError naming the first part that differs

Every tensor's bytes get a crc32 (fast enough to check a checkpoint on every load). Each top-level
entry (step, config, history, sampler, ...) gets a blake2b digest of its plain values, its tensors'
dtypes, shapes and crc32s, so the whole file's content is covered. A checkpoint written before
checksums existed has no "checksums" entry and loads unchecked.
"""
from __future__ import annotations

import hashlib
import re
import zlib
from typing import Any

import torch

from memfit.core.errors import CorruptCheckpointError
from memfit.core.host import inner_tensors, wraps_tensors

KEY = "checksums"


def tensor_crc(t: torch.Tensor) -> int:
    """crc32 of a tensor's bytes in its dtype (any device; a non-contiguous tensor is copied)."""
    if type(t) is not torch.Tensor and wraps_tensors(t):  # an NF4 weight: its codes, scales and factors
        crc = 0
        for inner in inner_tensors(t):
            crc = zlib.crc32(tensor_crc(inner).to_bytes(4, "little"), crc)
        return crc
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 1:  # "contiguous" whatever its stride (a strided view's one element), which view() refuses
        flat = flat.clone(memory_format=torch.contiguous_format)
    return zlib.crc32(flat.view(torch.uint8).numpy())


def _walk(obj: Any, path: str, tensors: dict[str, str], parts: list[str]) -> None:
    if isinstance(obj, torch.Tensor):
        crc = f"{tensor_crc(obj):08x}"
        tensors[path] = crc
        parts.append(f"T{path}|{obj.dtype}|{tuple(obj.shape)}|{crc}")
    elif isinstance(obj, dict):
        parts.append(f"D{path}|{len(obj)}")
        for k, v in obj.items():
            parts.append(f"K{k!r}")
            _walk(v, f"{path}/{k}", tensors, parts)
    elif isinstance(obj, (list, tuple)):
        parts.append(f"{type(obj).__name__}{path}|{len(obj)}")
        for i, v in enumerate(obj):
            _walk(v, f"{path}/{i}", tensors, parts)
    else:
        parts.append(f"V{path}|{type(obj).__name__}|{obj!r}")


def _sums(state: dict[str, Any]) -> dict[str, Any]:
    tensors: dict[str, str] = {}
    entries: dict[str, str] = {}
    for key, value in state.items():
        if key == KEY:
            continue
        parts: list[str] = []
        _walk(value, str(key), tensors, parts)
        entries[str(key)] = hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()
    return {"crc32": tensors, "entries": entries}


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with its checksums under KEY (a new dict; `state` is not changed)."""
    return {**{k: v for k, v in state.items() if k != KEY}, KEY: _sums(state)}


def verify(state: dict[str, Any], where: str) -> dict[str, Any]:
    """`state` without KEY if every checksum holds; else CorruptCheckpointError naming the first part that differs."""
    stored = state.get(KEY)
    if stored is None:
        return state
    if not isinstance(stored, dict) or not isinstance(stored.get("crc32"), dict) \
            or not isinstance(stored.get("entries"), dict):
        raise CorruptCheckpointError(f"checkpoint {where} is corrupt: its checksum table is damaged")
    now = _sums(state)
    for path, crc in now["crc32"].items():
        if stored["crc32"].get(path) != crc:
            raise CorruptCheckpointError(f"checkpoint {where} is corrupt: {describe(path, state)} does not match its checksum")
    for key in sorted(set(now["entries"]) | set(stored["entries"])):
        if now["entries"].get(key) != stored["entries"].get(key):
            what = f"its {key!r} entry" if key in now["entries"] else f"its {key!r} entry is missing and"
            raise CorruptCheckpointError(f"checkpoint {where} is corrupt: {what} does not match its checksum")
    return {k: v for k, v in state.items() if k != KEY}


def describe(path: str, state: dict[str, Any]) -> str:
    """A tensor's path in a checkpoint in the user's words: a weight's name, an optimizer state's parameter."""
    if path.startswith("model/"):
        return f"model weight {path[len('model/'):]}"
    m = re.fullmatch(r"optimizer/optimizer/state/(\d+)/(\w+)", path)
    if m:
        return f"optimizer state {m.group(2)} of {_param_name(state, int(m.group(1)))}"
    m = re.fullmatch(r"optimizer/streamed/masters/(\d+)", path)
    if m:
        return f"master weight of {_param_name(state, int(m.group(1)), index=True)}"
    return f"tensor {path.replace('/', '.')}"


def _param_name(state: dict[str, Any], pid: int, index: bool = False) -> str:
    """The parameter behind torch's optimizer state id `pid` (or list position with `index`)."""
    try:
        import dataclasses

        from memfit.train.config import TrainConfig
        from memfit.train.model_build import build_model

        known = {f.name for f in dataclasses.fields(TrainConfig)}
        with torch.device("meta"):  # names and order only: no memory
            model = build_model(TrainConfig(**{k: v for k, v in state["config"].items() if k in known}))
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not index:
            ids = [i for g in state["optimizer"]["optimizer"]["param_groups"] for i in g["params"]]
            pid = ids.index(pid)
        return f"parameter {names[pid]}"
    except Exception:  # an unreadable config or layout: the position still says which one
        return f"parameter #{pid}"
