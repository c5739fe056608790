"""Parameter groups for TrainingOptimizer: per-group hyperparameters (weight decay off for biases and
norm weights, as Hugging Face Trainer does), also when the update is streamed over chunk optimizers.

    TrainingOptimizer(model, "adamw", lr=1e-3, weight_decay=0.1, no_decay=True)      # 1-D params: no decay
    TrainingOptimizer(model, "adamw", groups=[{"params": decay, "weight_decay": 0.1},
                                              {"params": rest, "weight_decay": 0.0}])

Each trainable parameter belongs to exactly one group; a group is a dict of overrides of the
optimizer's defaults. The torch optimizers (one, or one per streamed chunk) get one torch param group
per memfit group they hold, tagged with GROUP_KEY so the scheduler-facing groups can be mapped back.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError

GROUP_KEY = "memfit_group"
"""The memfit group index a torch param group carries (torch optimizers ignore unknown keys)."""


def default_no_decay(name: str, p: nn.Parameter) -> bool:
    """Biases and norm weights (the one-dimensional parameters) take no weight decay."""
    return p.dim() < 2


def resolve_groups(named: list[tuple[str, nn.Parameter]], groups: Iterable[dict] | None,
                   no_decay: "bool | Iterable[str] | Callable | None") -> tuple[list[int], list[dict[str, Any]]]:
    """(group index per trainable parameter, the overrides of each group)."""
    if groups is not None and no_decay not in (None, False):
        raise ConfigError("give either groups= or no_decay=, not both")
    if groups is not None:
        return _from_torch_groups(named, list(groups))
    if no_decay in (None, False):
        return [0] * len(named), [{}]
    if no_decay is True:
        rule = default_no_decay
    elif callable(no_decay):
        rule = no_decay
    else:
        names = set(no_decay)  # parameter names (names of frozen ones are allowed and ignored)
        rule = lambda n, p: n in names  # noqa: E731
    index = [1 if rule(n, p) else 0 for n, p in named]
    return index, [{}, {"weight_decay": 0.0}]


def _from_torch_groups(named, groups: list[dict]) -> tuple[list[int], list[dict[str, Any]]]:
    where: dict[int, int] = {}
    overrides = []
    for k, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ConfigError("each group must be a dict with 'params' (torch.optim style)")
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in params:
            if id(p) in where:
                raise ConfigError("a parameter appears in two groups; each belongs to exactly one")
            where[id(p)] = k
        overrides.append({key: v for key, v in g.items() if key != "params"})
    missing = [n for n, p in named if id(p) not in where]
    if missing:
        raise ConfigError(f"{len(missing)} trainable parameters are in no group (first: {missing[0]}); "
                          "put every parameter that requires grad in one group, or freeze it")
    return [where[id(p)] for _, p in named], overrides


def regroup(opt: torch.optim.Optimizer, group_of: dict[int, int], overrides: list[dict[str, Any]]) -> None:
    """Split a freshly made torch optimizer's parameters into one param group per memfit group
    (before any step: no state yet). `group_of` maps id(parameter) to its group index."""
    params = [p for g in opt.param_groups for p in g["params"]]
    opt.param_groups = []
    for k, over in enumerate(overrides):
        mine = [p for p in params if group_of[id(p)] == k]
        if mine:
            opt.add_param_group({"params": mine, **over, GROUP_KEY: k})


class Grouping:
    """Which memfit group each parameter is in, applied to the torch optimizers TrainingOptimizer makes."""

    def __init__(self, params: list[nn.Parameter], index: list[int], overrides: list[dict[str, Any]]) -> None:
        self.index, self.overrides = index, overrides
        self.of: dict[int, int] = {id(p): k for p, k in zip(params, index)}
        self.active = len(overrides) > 1 or bool(overrides[0])

    def maker(self, make: Callable) -> Callable:
        """`make(params)`, split into groups when the parameters are known ones."""
        def grouped(ps):
            opt = make(ps)
            if self.active and all(id(p) in self.of for p in ps):
                regroup(opt, self.of, self.overrides)
            return opt
        return grouped

    def split_streamed(self, masters: list[nn.Parameter], optimizers: list[torch.optim.Optimizer]) -> None:
        """Streamed: the master weights exist once the chunk optimizers do; split each chunk's group."""
        if self.active:
            self.of.update({id(m): k for m, k in zip(masters, self.index)})
            for opt in optimizers:
                regroup(opt, self.of, self.overrides)
