"""Argument types shared by the subcommands: each refuses what it cannot use with a message that
says what would work (argparse prints it as one line, exit code 2), never a traceback later."""
from __future__ import annotations

import argparse
import math
from typing import Callable

MAX_COUNT = 2**31 - 1
"""Largest count (batch, seq, steps, world size) any option takes: beyond it a count is a typo."""


def integer(low: int = 1, high: int = MAX_COUNT) -> Callable[[str], int]:
    """An argparse type for an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not low <= value <= high:
            what = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"must be {what} (at most {high}), got {text!r}")
        return value

    return parse


def number(low: float = -math.inf, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type for a finite number in [low, high] (or (low, high] with `low_open`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low or (low_open and value == low) or value > high:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            rng = bound if high == math.inf else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be {rng}, got {text!r}")
        return value

    return parse
