"""Parsing and printing sizes: "24GiB", "80GB", "7B" parameters.

The rule for memory sizes (docs/train.md, "Sizes"): KiB, MiB, GiB, TiB are binary (2**10 ...),
KB, MB, GB, TB decimal (10**3 ...), B or a plain number is bytes. A bare K, M, G or T is refused
with a hint: "80G" is read as 80 GiB by some tools and 80 GB by others, and the two differ by 7%.
Counts (parameters, tokens) are another matter: there 7B, 124M, 0.5k are the usual decimal
multipliers (parse_count).
"""
from __future__ import annotations

import math
import re

from memfit.core.errors import ConfigError

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_AMBIGUOUS = {"k": "Ki", "m": "Mi", "g": "Gi", "t": "Ti"}
"""Bare multipliers a size may not use: binary or decimal is anyone's guess."""
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
SIZE_RULE = "KiB/MiB/GiB/TiB are binary, KB/MB/GB/TB decimal, a plain number is bytes"


def _scaled(text: str | int | float, units: dict[str, int], what: str, examples: str) -> float:
    """The number in `text` times its unit's factor; a ConfigError naming `what` if unreadable."""
    if isinstance(text, (int, float)):
        value = float(text) if abs(text) < 2**1023 else math.inf
    else:
        m = _NUMBER.match(text)
        if m and units is _BYTE_UNITS and m.group(2).lower() in _AMBIGUOUS:
            number, unit = m.group(1), m.group(2)
            raise ConfigError(f"memory size {text!r} has a bare {unit!r}: write {number}{_AMBIGUOUS[unit.lower()]}B "
                              f"(binary) or {number}{unit.upper()}B (decimal); {SIZE_RULE}")
        if not m or m.group(2).lower() not in units:
            raise ConfigError(f"cannot read {what} {text!r}; use e.g. {examples}")
        value = float(m.group(1)) * units[m.group(2).lower()]
    if not math.isfinite(value):  # 1e400 reads as inf: no size or count is infinite
        raise ConfigError(f"{what} {text!r} is not a finite number; use e.g. {examples}")
    return value


def parse_bytes(text: str | int | float) -> int:
    """'24GiB' -> 25769803776. Accepts B, KB/MB/GB/TB (decimal) and KiB/MiB/GiB/TiB (binary); a bare
    K/M/G/T is a ConfigError that names both readings."""
    n = int(_scaled(text, _BYTE_UNITS, "memory size", "24GiB, 80GB, 300MiB or a byte count"))
    if n <= 0:
        raise ConfigError(f"memory size must be positive, got {text!r}")
    return n


def parse_count(text: str | int | float) -> int:
    """'7B' -> 7_000_000_000; '124M', '1.5e9' and plain integers too."""
    n = int(round(_scaled(text, _COUNT_UNITS, "count", "7B, 124M, 350000000 or 1.5e9")))
    if n <= 0:
        raise ConfigError(f"count must be positive, got {text!r}")
    return n


def format_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{int(n)} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    """0.0123 -> '12.3 ms', 75 -> '75.0 s', 5400 -> '1.50 h': the unit that keeps the figure short."""
    if s < 1:
        return f"{s * 1000:.1f} ms"
    if s < 600:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min" if s < 3 * 3600 else f"{s / 3600:.2f} h"
