"""Atomic checkpoints that load with `torch.load(path, weights_only=True)`.

A checkpoint holds only tensors and plain Python containers (dicts, lists, str, int, float, bool,
None), so loading one never runs pickled code. It is written to a temporary file in the same folder,
fsynced, then renamed over the old one with `os.replace`: a crash or a full disk mid-write leaves
the previous checkpoint intact, never a torn file.

The temporary file's name carries its writer's process id (memfit.core.checkpoint_temps), so a
later run can remove what a killed writer left behind (remove_stale_temps) and nothing else.

A training checkpoint carries checksums of every tensor and of the rest (memfit.train.integrity);
load_checkpoint checks them. Before a new checkpoint.pt replaces the old one, the old one is kept
as checkpoint.prev.pt (keep_previous: a hard link renamed into place, so checkpoint.pt always exists).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from memfit.core.checkpoint_temps import remove_stale_checkpoint_temps, temp_prefix
from memfit.core.errors import ConfigError, CorruptCheckpointError

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
"""The checkpoint before checkpoint.pt, kept until a newer one is written and verified."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files readable by the owner only; a run folder's files should read like any other.
_FILE_MODE = 0o666 & ~_umask()


def _fsync_dir(folder: Path) -> None:
    # The rename itself is only durable once the directory entry is on disk (POSIX).
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows cannot open directories; os.replace is still atomic there
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Any, before_replace: Any = None) -> Path:
    """Call `write(file)` on a temp file beside `path`, fsync it, then atomically move it to `path`.
    `before_replace(temp_path)` runs between the two (a check of the written file; raising keeps `path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Remove the temp files of checkpoint.pt and metrics.json in `folder` whose writer was killed.

    Call it before this process saves there: a temp file carrying this process's own id counts as stale."""
    return [p for name in (CHECKPOINT, PREVIOUS, "metrics.json")
            for p in remove_stale_checkpoint_temps(folder, target=name)]


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any], *, sealed: bool = False,
                    before_replace: Any = None) -> Path:
    """Write `state` (tensors and plain containers only) atomically to `path`. `sealed`: with checksums
    (memfit.train.integrity), and the written file read back and checked before it replaces `path`."""
    if not sealed:
        return atomic_write(path, lambda f: torch.save(state, f), before_replace)
    from memfit.train import integrity

    state = integrity.seal(state)

    def check(tmp: Path) -> None:
        verify_file(tmp)
        if before_replace is not None:
            before_replace(tmp)

    return atomic_write(path, lambda f: torch.save(state, f), check)


def verify_file(path: str | os.PathLike) -> None:
    """Read a sealed checkpoint back (memory-mapped, so it costs no memory) and check its checksums;
    OSError if it does not hold what was written (a save failing this is a failed save)."""
    from memfit.train import integrity

    try:
        loaded = _torch_load(path, map_location="cpu", mmap=True)
        integrity.verify(loaded, repr(str(path)))
    except ConfigError as exc:
        raise OSError(errno.EIO, f"it does not read back ({exc})") from None
    except OSError:
        raise
    except Exception as exc:  # unpickling errors have many types
        raise OSError(errno.EIO, f"it does not read back ({type(exc).__name__}: {exc})".splitlines()[0]) from None


def keep_previous(path: str | os.PathLike, previous: str | os.PathLike) -> None:
    """Make `previous` a copy of `path` (atomically; `path` stays in place the whole time)."""
    path, previous = Path(path), Path(previous)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(previous), suffix=".tmp", dir=previous.parent)
    os.close(fd)
    try:
        os.unlink(tmp)
        try:
            os.link(path, tmp)  # a second name for the same bytes: nothing is copied
        except OSError:  # a file system without hard links
            shutil.copyfile(path, tmp)
        os.replace(tmp, previous)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(previous.parent)


def save_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """metrics.json is rewritten while a run goes on; readers never see half a file."""
    text = json.dumps(payload, indent=1, allow_nan=False, default=_json_default)
    return atomic_write(path, lambda f: f.write(text.encode()))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _torch_load(path: str | os.PathLike, **kwargs: Any) -> Any:
    """torch.load(weights_only=True); a checkpoint of a QLoRA run holds torchao's NF4Tensor, which loads once
    torchao has declared it safe (on import: not done up front, torchao takes seconds to import)."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except Exception as exc:  # unpickling errors have many types
        if "NF4Tensor" not in str(exc):
            raise
    from memfit.models.qlora import nf4_module

    nf4_module()
    return torch.load(path, weights_only=True, **kwargs)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by save_checkpoint (weights_only: no code runs while loading)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {str(path)!r}; --resume takes a run folder written by memfit train")
    try:
        loaded = _torch_load(path, map_location=map_location)
    except Exception as exc:  # unpickling errors have many types; all mean "not a usable checkpoint"
        raise ConfigError(f"cannot load checkpoint {str(path)!r}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"checkpoint {str(path)!r} holds a {type(loaded).__name__}, not the dict memfit train "
                          "writes; --resume takes a run folder written by memfit train")
    from memfit.train import integrity

    try:
        return integrity.verify(loaded, repr(str(path)))
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{exc}; {previous_hint(path)}") from None


def previous_hint(path: Path) -> str:
    """How to continue when `path` (or the sharded folder it names) is corrupt: from the checkpoint
    kept before it, if there is one."""
    previous = path.parent / PREVIOUS
    if path.name == CHECKPOINT and previous.is_file():
        return f"the checkpoint before it is kept: continue from it with memfit train --resume {previous}"
    return "it was not used; no earlier checkpoint is kept beside it"


def check_shards(folder: Path, checkpoint: dict[str, Any], alone: bool = False) -> None:
    """The checksums of the sharded folder `checkpoint` names (memfit.distributed.shard_sums), with
    how to continue if they fail (from checkpoint.prev.pt when the resume came from checkpoint.pt)."""
    from memfit.distributed import shard_sums

    try:
        shard_sums.check(folder, checkpoint.get("shards"), alone=alone)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{exc}; {previous_hint(Path(checkpoint.get('_source') or ''))}") from None


def rng_state() -> dict[str, Any]:
    """torch's global RNG streams (dropout draws from them), as tensors."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
