"""Attributes of a library replaced for the length of a block (tracing answers what fake tensors cannot)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def patched(owner: Any, replacements: dict[str, Any]) -> Iterator[None]:
    """Set `owner.<name>` to each replacement while the block runs; the originals come back after,
    also when the block raises."""
    originals = {name: getattr(owner, name) for name in replacements}
    for name, value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(owner, name, value)
