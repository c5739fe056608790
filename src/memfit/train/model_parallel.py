"""The checks `memfit train --strategy pipeline|tensor` makes before any process group exists.

Made in the launcher (world = --nproc) and again on every rank (world = WORLD_SIZE), so a
configuration that cannot run fails at once, with one message and exit 2, never a hang. memfit's
GPT is checked from its config; a Hugging Face causal LM (a config.json) from a build on the meta
device (no memory): the family must ship a tensor plan (tensor) or be one memfit cuts into stages
(pipeline), and the heads / layers must split over the ranks. `--strategy pipeline --engine fsdp2` is
the 3-D layout (memfit.distributed.mesh3d): --pp x --tp must divide the processes, the layers split
into --pp stages, the heads over --tp, and a replica's batch into --microbatches.
"""
from __future__ import annotations

from typing import Any

from memfit.core.errors import ConfigError


def precheck_model_parallel(cfg: Any, world: int | None, resuming: bool) -> None:
    from memfit.models.spec import parse_model

    mesh3d = cfg.strategy == "pipeline" and getattr(cfg, "engine", "memfit") == "fsdp2"
    _check_layout_flags(cfg, mesh3d)
    spec = parse_model(cfg.model)
    config = spec.config
    if mesh3d:
        return _precheck_3d(spec, cfg, world)
    if config is None:
        return _precheck_hf(spec, cfg, world)
    if world is None:
        return
    if cfg.strategy == "pipeline":
        from memfit.distributed.pipeline import check_pipeline

        stages = _stages(cfg, world)
        check_pipeline(config.layers, stages, cfg.batch * stages, cfg.microbatches or stages, cfg.schedule,
                       getattr(cfg, "virtual_stages", None))
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
                           cfg.schedule, getattr(cfg, "virtual_stages", None))
        return
    from memfit.distributed.hf_tensor import heads_of, hf_tp_plan
    from memfit.distributed.tensor_parallel import check_tensor

    hf_tp_plan(model)
    if world is not None:
        check_tensor(*heads_of(model.config), world, cfg.tp or world)


def _check_layout_flags(cfg: Any, mesh3d: bool) -> None:
    """--pp and --tp shape the 3-D layout; memfit's own pipeline takes --dp."""
    if mesh3d and cfg.dp != 1:
        raise ConfigError("--dp with --strategy pipeline --engine fsdp2: the 3-D layout takes --pp and --tp "
                          "(dp = nproc / (pp x tp)); leave out --dp")
    if not mesh3d and cfg.strategy == "pipeline" and (getattr(cfg, "pp", None) is not None or cfg.tp is not None):
        raise ConfigError("--pp and --tp with --strategy pipeline shape the 3-D layout: add --engine fsdp2, or "
                          "leave them out (memfit's own pipeline takes --dp)")


def mesh3d_shape(cfg: Any, world: int) -> tuple[int, int, int]:
    """(pp, dp, tp) of a 3-D run over `world` processes: --tp (default 1), --pp (default world / tp)."""
    from memfit.distributed.mesh3d import check_mesh3d

    tp = cfg.tp or 1
    pp = cfg.pp or max(world // tp, 1)
    return pp, check_mesh3d(world, pp, tp), tp


def _precheck_3d(spec: Any, cfg: Any, world: int | None) -> None:
    """The 3-D layout (see the module docstring), from the config or a meta build; no process group."""
    from memfit.distributed.pipeline import check_pipeline

    tp = cfg.tp or 1
    if spec.config is not None:
        if tp > 1:
            raise ConfigError("--tp with --engine fsdp2 shards a Hugging Face causal LM by its tensor plan; memfit's "
                              "GPT runs the 3-D layout with --tp 1 (or --strategy tensor on memfit's engine)")
        layers = spec.config.layers
    else:
        if spec.task not in (None, "causal-lm"):
            raise ConfigError(f"--strategy pipeline trains a causal LM; {cfg.model} is a {spec.task} model: "
                              "train it with ddp or zero1-3")
        from memfit.distributed.hf_stages import check_hf_pipeline
        from memfit.distributed.hf_tensor import heads_of, hf_layers, hf_tp_plan
        from memfit.distributed.tensor_parallel import check_tensor

        model = spec.on_meta()
        check_hf_pipeline(model.config)
        if tp > 1:
            hf_tp_plan(model)
            check_tensor(*heads_of(model.config), tp, tp)
        layers = len(hf_layers(model)[1])
    if world is not None:
        pp, _, tp = mesh3d_shape(cfg, world)
        check_pipeline(layers, pp, cfg.batch * pp * tp, cfg.microbatches or pp, cfg.schedule)


def check_3d_resume(cfg: Any, ckpt: dict, world: int) -> None:
    """A 3-D run resumes only in its own layout, and only a 3-D checkpoint resumes as one: moving between
    layouts (another pp, tp or dp, or another strategy) is not built for it, and is refused, not guessed."""
    saved = (ckpt.get("optimizer") or {}).get("mesh3d") if isinstance(ckpt.get("optimizer"), dict) else None
    mesh3d = cfg.strategy == "pipeline" and cfg.engine == "fsdp2"
    if saved is None and not mesh3d:
        return
    now = list(mesh3d_shape(cfg, world)) if mesh3d else None
    if now != saved:
        was = "pp {} x dp {} x tp {}".format(*saved) if saved else f"--strategy {ckpt['config'].get('strategy')}"
        raise ConfigError(f"this run was written in the layout {was}; resume it in the same layout (the same "
                          "--strategy, --engine, --pp, --tp and --nproc): resuming a 3-D run in another layout, or "
                          "another run in the 3-D layout, is not supported yet")
