"""Every difference between the torch versions memfit supports (2.11 to 2.15), in one place.

memfit calls a few private torch functions whose signatures moved between releases. Each helper
here picks the call by the signature it finds (never by a version number, so a backport or a
nightly works too); tests/test_torch_private_api.py pins the behaviour of each on the installed
torch, and tests/test_core_compat.py pins both branches of each helper.

| difference | versions | helper |
| --- | --- | --- |
| `_checkpoint_without_reentrant_generator` takes `early_stop` after `debug` | 2.13 on | `checkpoint_generator_flags` |
| `PipelineScheduleSingle._initialize_stage(args, kwargs, target)` (no `target` before) | 2.13 on | `initialize_pipeline_stage` |
| Adagrad's `step()` creates missing state (before: only `__init__` does) | 2.13 on | handled without a branch: apply/optim_offload.py rebuilds `__init__`'s state |
| non-reentrant checkpoint saves a 0-element placeholder beside the segment input | before 2.13 | nothing to do: 0 bytes to offload |
| a pipeline stage drops a sent output once its send completes (`release_fwd_send_outputs`), and the schedules wait on sends at other points | 2.15 on | `pipeline_releases_sent_outputs`: memfit's stage trace follows 2.11-2.14's schedules, so on 2.15 a pipeline rank's figure is not exact (the default-tier grid cases: -2.1% to +4.0%) |
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from torch.utils import checkpoint as _tc


def _takes(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def checkpoint_generator_flags(context_fn: Callable, generator: Callable | None = None) -> tuple:
    """The positional flags after `fn` for torch's non-reentrant checkpoint generator:
    (preserve_rng_state, context_fn, determinism_check, debug[, early_stop])."""
    gen = _tc._checkpoint_without_reentrant_generator if generator is None else generator
    flags: tuple = (True, context_fn, "default", False)
    # early_stop=True: recomputation stops once the last saved tensor is rebuilt (torch's default)
    return flags + (True,) if _takes(gen, "early_stop") else flags


def initialize_pipeline_stage(init: Callable, args: tuple, target: Any) -> None:
    """Call a schedule's `_initialize_stage`: 2.13 on takes the target too (for its loss shape),
    earlier versions infer the backward set-up without it."""
    if _takes(init, "target"):
        init(args, {}, target)
    else:
        init(args, {})


def pipeline_releases_sent_outputs(stage_class: type | None = None) -> bool:
    """Whether torch's pipeline stage drops a forward output once its send completes (2.15 on, whose
    schedules also wait on their sends at other points). The stage trace (memfit.measure.pipeline_trace)
    follows 2.11-2.14's schedules, so where this is True a pipeline rank's figure is a few percent off
    the tracked peak, either way."""
    if stage_class is None:
        from torch.distributed.pipelining.stage import _PipelineStageBase as stage_class
    return hasattr(stage_class, "release_fwd_send_outputs")
