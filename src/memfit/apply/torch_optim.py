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
from memfit.apply.param_groups import GROUP_KEY
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
    """The param groups (the hyperparameters of the chunk groups, the parameters of each memfit group)
    that stand for the groups of several chunk optimizers. A scheduler changes the mirror; `push()`
    copies every hyperparameter to the chunk groups of the same memfit group (GROUP_KEY) before they
    are used, `pull()` reads them back after a load. `chunk_groups` is asked each time: a torch
    optimizer's load_state_dict replaces its group dicts."""

    def __init__(self, params: list[torch.nn.Parameter], chunk_groups: Callable[[], list[dict]],
                 group_index: list[int] | None = None) -> None:
        self.chunk_groups = chunk_groups
        index = group_index or [0] * len(params)
        self.groups: list[dict[str, Any]] = [{"params": [p for p, k in zip(params, index) if k == g]}
                                             for g in range(max(index) + 1)]
        self.pull()

    @property
    def group(self) -> dict[str, Any]:
        """The first group (the only one without parameter groups)."""
        return self.groups[0]

    def push(self) -> None:
        for g in self.chunk_groups():
            mirror = self.groups[g.get(GROUP_KEY, 0)]
            g.update({k: v for k, v in mirror.items() if k != "params"})

    def pull(self) -> None:
        for g in self.chunk_groups():
            self.groups[g.get(GROUP_KEY, 0)].update({k: v for k, v in g.items() if k != "params"})
