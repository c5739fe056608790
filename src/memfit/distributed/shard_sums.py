"""Checksums of a sharded (torch.distributed.checkpoint) folder: a flipped bit in any rank's shard is
refused on resume, naming the entry it is in.

    sums = gather(folder)          # every rank, after dcp.save: crc32 of each stored item, and of .metadata
    check(folder, sums)            # every rank, before dcp.load: CorruptCheckpointError naming the first item that differs

DCP's metadata says where each stored item (a tensor's chunk, a bucket's slice) lies in which file:
its crc32 is taken over those bytes. The files are shared out over the ranks (file i to rank i mod
world), so each byte is read once; every rank learns every rank's verdict. One process (no group)
reads them all. The sums travel in checkpoint.pt, which is itself checksummed.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from memfit.core.errors import CorruptCheckpointError

METADATA = ".metadata"
_BLOCK = 1 << 22


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _crc_range(path: Path, offset: int = 0, length: int | None = None) -> str:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left is None or left > 0:
            block = f.read(_BLOCK if left is None else min(_BLOCK, left))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            if left is not None:
                left -= len(block)
    return f"{crc:08x}"


def _items(folder: Path) -> list[tuple[str, str, int, int]]:
    """(entry name, file, offset, length) of every stored item, from the folder's DCP metadata."""
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(str(folder)).read_metadata().storage_data or {}
    out = []
    for index, info in storage.items():
        where = "" if index.offset is None else "@" + ",".join(str(int(o)) for o in index.offset)
        out.append((f"{index.fqn}{where}", info.relative_path, int(info.offset), int(info.length)))
    return sorted(out)


def _mine(items: list[tuple[str, str, int, int]], rank: int, world: int) -> list[tuple[str, str, int, int]]:
    files = sorted({f for _, f, _, _ in items})
    assigned = {f for i, f in enumerate(files) if i % world == rank}
    return [it for it in items if it[1] in assigned]


def local_sums(folder: Path, rank: int = 0, world: int = 1) -> dict[str, str]:
    """crc32 of the items in this rank's share of the files."""
    return {name: _crc_range(folder / file, offset, length) for name, file, offset, length
            in _mine(_items(folder), rank, world)}


def gather(folder: str | Path) -> dict[str, Any]:
    """Every rank after the save: the folder's sums (the same dict on every rank)."""
    folder = Path(folder)
    rank, world = _world()
    mine = local_sums(folder, rank, world)
    if world > 1:
        import torch.distributed as dist

        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        mine = {k: v for part in everyone for k, v in part.items()}
    return {"folder": folder.name, "metadata": _crc_range(folder / METADATA), "crc32": mine}


def _first_bad(folder: Path, sums: dict[str, Any], rank: int, world: int) -> str | None:
    try:
        if _crc_range(folder / METADATA) != sums.get("metadata"):
            return f"its {METADATA} file does not match its checksum"
        items = _items(folder)
        expected = sums.get("crc32") or {}
        if {name for name, *_ in items} != set(expected):
            return "its list of stored entries is not the one saved"
        for name, file, offset, length in _mine(items, rank, world):
            if _crc_range(folder / file, offset, length) != expected[name]:
                return f"entry {name.split('@')[0]} (in {file}) does not match its checksum"
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    except Exception as exc:  # a damaged .metadata fails to unpickle in many ways
        return f"its {METADATA} cannot be read ({type(exc).__name__})"
    return None


def check(folder: str | Path, sums: dict[str, Any] | None, alone: bool = False) -> None:
    """Every rank (or, `alone`, this process by itself) before loading: CorruptCheckpointError if any item
    differs from `sums` (None: a folder saved before sums existed, loaded unchecked)."""
    if not sums:
        return
    folder = Path(folder)
    rank, world = (0, 1) if alone else _world()
    bad = _first_bad(folder, sums, rank, world)
    if world > 1:
        import torch.distributed as dist

        said: list[Any] = [None] * world
        dist.all_gather_object(said, bad)
        bad = next((b for b in said if b is not None), None)
    if bad is not None:
        raise CorruptCheckpointError(f"sharded checkpoint {str(folder)!r} is corrupt: {bad}")
