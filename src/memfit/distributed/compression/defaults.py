"""Which mode plain `topk:R` and `sign` run in: the one measured best for the run's optimizer.

Under Adam(W), error feedback on the gradient converges badly (docs/compression.md: +34.8% top-k
1%, +26.7% sign over the uncompressed final validation loss at 80 steps), because Adam's update
is not linear in the gradient; the adam mode (onebit.py, `adam=5`: five int8 warm-up steps, then
each rank's Adam direction compressed with error feedback; with its own defaults owe=step,
var=batch and, for top-k, select=gain, chosen at 300 steps: spec.py) is within a few percent. Under SGD the
update is linear, and error feedback on the gradient is the mode (with DGC's momentum= where the
user asks for it). So a spec that names no mode gets adam=5 when the optimizer is an Adam(W) whose
state sits beside its parameters, and stays plain error feedback otherwise (SGD, optimizer
offload, master-weight precisions). Any explicit option keeps the user's choice: adam=N, adam=off,
momentum=, start=, ef=0.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from memfit.core.errors import ConfigError
from memfit.distributed.compression.spec import CompressionSpec

ADAM_WARMUP = 5
"""Warm-up steps of the default adam mode (bench/compression.py measured adam=5)."""


def names_no_mode(spec: CompressionSpec) -> bool:
    """topk / sign with error feedback and none of the options that choose a mode."""
    return (spec.name in ("topk", "sign") and spec.adam is None and not spec.adam_off and not spec.momentum
            and not spec.start and spec.error_feedback and spec.var is None and spec.select is None
            and spec.owe is None)


def for_optimizer(spec: CompressionSpec, optimizer: Any | None) -> CompressionSpec:
    """`spec` with the mode its optimizer converges best with (unchanged when it names one)."""
    if optimizer is None or not names_no_mode(spec):
        return spec
    from memfit.distributed.compression.onebit import torch_optimizer_of

    try:
        torch_optimizer_of(optimizer)
    except ConfigError:  # SGD, or Adam state that is offloaded or behind master weights: error feedback
        return spec
    return dataclasses.replace(spec, adam=ADAM_WARMUP)
