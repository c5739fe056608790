"""The checks `memfit train --strategy pipeline|tensor` makes before any process group exists.

Made in the launcher (world = --nproc) and again on every rank (world = WORLD_SIZE), so a
configuration that cannot run fails at once, with one message and exit 2, never a hang. memfit's
GPT is checked from its config; a Hugging Face causal LM (a config.json) from a build on the meta
device (no memory): the family must ship a tensor plan (tensor) or be one memfit cuts into stages
(pipeline), and the heads / layers must split over the ranks.
"""
from __future__ import annotations

from typing import Any

from memfit.core.errors import ConfigError


def precheck_model_parallel(cfg: Any, world: int | None, resuming: bool) -> None:
    from memfit.models.spec import parse_model

    spec = parse_model(cfg.model)
    config = spec.config
    if config is None:
        return _precheck_hf(spec, cfg, world)
    if world is None:
        return
    if cfg.strategy == "pipeline":
        from memfit.distributed.pipeline import check_pipeline

        stages = _stages(cfg, world)
        check_pipeline(config.layers, stages, cfg.batch * stages, cfg.microbatches or stages, cfg.schedule)
    else:
        from memfit.distributed.tensor_parallel import check_tensor

        check_tensor(config.heads, config.kv_heads or config.heads, world, cfg.tp or world)


def _stages(cfg: Any, world: int) -> int:
    if world % cfg.dp:
        raise ConfigError(f"--dp {cfg.dp} does not divide the {world} processes; use a --dp dividing "
                          f"--nproc (stages = nproc / dp)")
    return world // cfg.dp


def _precheck_hf(spec: Any, cfg: Any, world: int | None) -> None:
    """A Hugging Face causal LM: its family and shape against the layout (see the module docstring)."""
    if spec.task not in (None, "causal-lm"):
        raise ConfigError(f"--strategy {cfg.strategy} trains a causal LM; {cfg.model} is a {spec.task} model: "
                          "train it with ddp or zero1-3")
    model = spec.on_meta()
    if cfg.strategy == "pipeline":
        from memfit.distributed.hf_stages import check_hf_pipeline
        from memfit.distributed.hf_tensor import hf_layers
        from memfit.distributed.pipeline import check_pipeline

        check_hf_pipeline(model.config)
        if world is not None:
            stages = _stages(cfg, world)
            check_pipeline(len(hf_layers(model)[1]), stages, cfg.batch * stages, cfg.microbatches or stages,
                           cfg.schedule)
        return
    from memfit.distributed.hf_tensor import heads_of, hf_tp_plan
    from memfit.distributed.tensor_parallel import check_tensor

    hf_tp_plan(model)
    if world is not None:
        check_tensor(*heads_of(model.config), world, cfg.tp or world)
