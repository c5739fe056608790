"""The processes below a process, read from /proc (Linux): for tests that check what a run leaves running."""
from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (its children, theirs, ...)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found
