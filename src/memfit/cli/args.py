"""Argument types shared by the subcommands."""
from __future__ import annotations

import argparse
from typing import Callable


def positive_int(name: str) -> Callable[[str], int]:
    """An argparse type for an integer >= 1 whose error names the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        return value

    return parse
