"""The torch optimizers TrainingOptimizer runs, made with torch's own defaults, and the one param
group a scheduler sees when the update is streamed over several chunk optimizers.

Only what the caller passes overrides torch's defaults: AdamW gets betas (0.9, 0.999), eps 1e-8
and weight_decay 0.01 unless told otherwise, exactly as `torch.optim.AdamW(params)` would.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from memfit.apply import optimizers
from memfit.apply.optimizers import optimizer_class
from memfit.core.errors import ConfigError

OPTIMIZERS = optimizers.NAMES  # the one table: memfit.apply.optimizers


def torch_kwargs(name: str, lr: float | None = None, weight_decay: float | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments for `name`'s torch optimizer: those given (None: torch's default);
    "momentum" is SGD with momentum=0.9 unless `momentum` is given. ConfigError for one it lacks."""
    cls = optimizer_class(name)
    kw = {k: v for k, v in dict(extra or {}, lr=lr, weight_decay=weight_decay).items() if v is not None}
    if name.lower() == "momentum":
        kw.setdefault("momentum", 0.9)
    fixed = set(getattr(cls, "keywords", {}))  # a format bound by the registry (8-/4-bit)
    accepted = [p for p in inspect.signature(cls).parameters if p not in ("params", *fixed)]
    unknown = sorted(set(kw) - set(accepted))
    if unknown:
        raise ConfigError(f"optimizer {name!r} ({getattr(cls, '__name__', name)}) takes no {', '.join(unknown)}; "
                          f"accepted: {', '.join(accepted)}")
    return kw


def make_torch_optimizer(name: str, params, lr: float | None = None, weight_decay: float | None = None,
                         **kw: Any) -> torch.optim.Optimizer:
    """`name`'s torch optimizer over `params`, torch's defaults for every argument left None."""
    return optimizer_class(name)(params, **torch_kwargs(name, lr, weight_decay, kw))


class GroupMirror:
    """One param group (the hyperparameters of `template`, all parameters) that stands for the
    groups of several chunk optimizers. A scheduler changes the mirror; `push()` copies every
    hyperparameter to the chunk groups before they are used, `pull()` reads them back after a load.
    `chunk_groups` is asked each time: a torch optimizer's load_state_dict replaces its group dicts."""

    def __init__(self, params: list[torch.nn.Parameter], chunk_groups: Callable[[], list[dict]]) -> None:
        self.chunk_groups = chunk_groups
        self.group: dict[str, Any] = {"params": list(params)}
        self.pull()

    def push(self) -> None:
        hyper = {k: v for k, v in self.group.items() if k != "params"}
        for g in self.chunk_groups():
            g.update(hyper)

    def pull(self) -> None:
        self.group.update({k: v for k, v in self.chunk_groups()[0].items() if k != "params"})

