"""A progress bar on stderr while planning traces steps (tqdm), shown once the work passes 2 seconds.

    with progress("planning gpt2"):      # plan/fit.py, plan/cluster_fit.py
        ...                              # every traced step calls tick() (measure/anymodel.run_steps)

Shown on a terminal only (stderr a TTY), so a log, a pipe or a test's captured stderr keeps its one
line per message; MEMFIT_PROGRESS=1 shows it anyway, MEMFIT_PROGRESS=0 never. Nested calls share the
outermost bar. The total is not known in advance (the search stops as soon as a plan fits), so the bar
counts traces and seconds.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

DELAY_S = 2.0
_BAR: list[Any] = []


def _wanted() -> bool:
    flag = os.environ.get("MEMFIT_PROGRESS", "")
    if flag in ("0", "1"):
        return flag == "1"
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


@contextlib.contextmanager
def progress(desc: str) -> Iterator[None]:
    if _BAR or not _wanted():
        yield
        return
    try:
        from tqdm import tqdm
    except ImportError:  # an optional dependency: without it, no bar (e.g. a bare GPU machine's python3)
        yield
        return
    bar = tqdm(desc=desc, unit=" trace", file=sys.stderr, delay=DELAY_S, leave=False, dynamic_ncols=True)
    _BAR.append(bar)
    try:
        yield
    finally:
        _BAR.clear()
        bar.close()


def tick(what: str = "") -> None:
    """One traced step done (`what`: shown after the count)."""
    if _BAR:
        if what:
            _BAR[0].set_postfix_str(what, refresh=False)
        _BAR[0].update(1)
