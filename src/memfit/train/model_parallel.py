"""The checks `memfit train --strategy pipeline|tensor` makes before any process group exists.

Made in the launcher (world = --nproc) and again on every rank (world = WORLD_SIZE), so a
configuration that cannot run fails at once, with one message and exit 2, never a hang.
"""
from __future__ import annotations

from typing import Any

from memfit.core.errors import ConfigError


def precheck_model_parallel(cfg: Any, world: int | None, resuming: bool) -> None:
    from memfit.models.spec import parse_model

    config = getattr(parse_model(cfg.model), "config", None)
    if config is None or not hasattr(config, "layers"):
        raise ConfigError(f"memfit train runs --strategy {cfg.strategy} on memfit's GPT (a gpt:/llama: spec or a "
                          f"known name), not {cfg.model!r}; a Hugging Face model runs it through "
                          f"memfit.distributed.distribute(model, {cfg.strategy!r}, ...), or train it with ddp or zero1-3")
    if world is None:
        return
    if cfg.strategy == "pipeline":
        from memfit.distributed.pipeline import check_pipeline

        if world % cfg.dp:
            raise ConfigError(f"--dp {cfg.dp} does not divide the {world} processes; use a --dp dividing "
                              f"--nproc (stages = nproc / dp)")
        stages = world // cfg.dp
        check_pipeline(config.layers, stages, cfg.batch * stages, cfg.microbatches or stages, cfg.schedule,
                       getattr(cfg, "virtual_stages", None))
    else:
        from memfit.distributed.tensor_parallel import check_tensor

        check_tensor(config.heads, config.kv_heads or config.heads, world, cfg.tp or world)
