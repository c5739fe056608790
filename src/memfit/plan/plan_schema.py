"""The schema of a plan file (`memfit plan ... --json`, read by `memfit train --plan FILE` and
Plan.from_json): every field's type and range, checked before a plan is made of it, so that a file
edited by hand or cut short is refused in one line naming the field, never a traceback or a run
under a budget of -1, NaN or 1e40 bytes.

    check_plan(d, "plan.json")
"""
from __future__ import annotations

import math
from typing import Any, Callable

from memfit.core.errors import ConfigError

MAX_BUDGET = 2**60
"""An exbibyte: far beyond any machine or cluster; a budget above it is a typo (or 1e40)."""
MAX_COUNT = 2**31 - 1
"""Largest micro-batch, accumulation, block, chunk or sequence count (as the command line's counts)."""


def _int(low: int, high: int) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high,
            f"an integer in [{low}, {high}]")


def _number(low: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low,
            f"a finite number >= {low:g}")


def _one_of(*names: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in names), "one of " + ", ".join(names)


_TEXT = ((lambda v: isinstance(v, str) and v.strip() != ""), "a non-empty string")
_BOOL = ((lambda v: isinstance(v, bool)), "true or false")
_TEXTS = ((lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v)), "a list of strings")


def _nullable(check: tuple[Callable[[Any], bool], str]) -> tuple[Callable[[Any], bool], str]:
    ok, what = check
    return (lambda v: v is None or ok(v)), f"null or {what}"


def _fields() -> dict[str, tuple[tuple[Callable[[Any], bool], str], bool]]:
    """field -> ((check, what it must be), required)."""
    from memfit.apply.optimizers import NAMES as OPTIMIZERS
    from memfit.measure.formulas import PRECISIONS

    return {
        "model": (_TEXT, True),
        "budget": ((_int(1, MAX_BUDGET)[0], "a positive whole number of bytes, at most 2**60 (1 EiB)"), True),
        "actions": (_TEXT, True),
        "micro_batch": (_int(1, MAX_COUNT), True),
        "accumulation": (_int(1, MAX_COUNT), True),
        "optimizer": (_one_of(*OPTIMIZERS), True),
        "precision": (_one_of(*PRECISIONS), True),
        "offload_optimizer": (_nullable(_one_of("cpu", "disk")), True),
        "predicted_peak": (_int(0, 2**63 - 1), True),
        "predicted_time": (_number(0), True),
        "n_blocks": (_int(1, MAX_COUNT), True),
        "head_chunks": (_nullable(_int(1, MAX_COUNT)), False),
        "step_in_backward": (((lambda v: isinstance(v, bool)), "true or false"), False),
        "ranked": (((lambda v: isinstance(v, list) and all(isinstance(c, dict) for c in v)), "a list of objects"),
                   False),
        "where": (((lambda v: isinstance(v, str)), "a string"), False),
        "measured_peak": (_nullable(_int(0, 2**63 - 1)), False),
        "notes": (_TEXTS, False),
        "device": (_TEXT, False),
        "seq": (_nullable(_int(1, MAX_COUNT)), False),
        "global_batch": (_nullable(_int(1, MAX_COUNT)), False),
        "model_digest": (_nullable(_TEXT), False),
        "keep_output": (_BOOL, False),
        "time_basis": (_one_of("flop-model", "profile"), False),
        "baseline_time": (_number(0), False),
        "host_memory": (_nullable(_int(0, 2**63 - 1)), False),
        "host_need": (_nullable(_int(0, 2**63 - 1)), False),
        "host_source": (((lambda v: v is None or isinstance(v, str)), "null or a string"), False),
    }


def check_plan(d: Any, where: Any = "the plan") -> None:
    """Refuse the first field of `d` (a plan's JSON object) that is missing, of the wrong type or out
    of range, in one line naming it and what it must be."""
    rewrite = "write it again with `memfit plan ... --json`"
    if not isinstance(d, dict):
        raise ConfigError(f"{where} is not a memfit plan: expected a JSON object with a 'plan' field from "
                          "`memfit plan --json`")
    fields = _fields()
    missing = [name for name, (_, required) in fields.items() if required and name not in d]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)}: not a whole memfit plan; {rewrite}")
    for name, ((ok, what), _) in fields.items():
        if name in d and not ok(d[name]):
            raise ConfigError(f"{where}: {name} must be {what}, got {d[name]!r}; {rewrite}")
