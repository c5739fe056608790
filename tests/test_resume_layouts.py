"""A checkpoint of any layout resumes in any other: zero1/2/3 <-> ddp <-> one process <-> pipeline /
tensor, another --tp or world size. The global batch is kept (--batch is per process), so the run
continues the one-process trajectory; a changed layout sums the gradients across ranks in another
order, so losses agree to rel 1e-5 (fp32 reassociation, as every strategy against one process), and
bitwise when the layout is unchanged. The optimizer's step counter is the saved one after every load."""
from __future__ import annotations

import pytest

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16"
BASE = dict(model=TINY, seq=16, steps=4, warmup=1, eval_batches=1, eval_every=0, save_every=2, track=False,
            device="cpu")
GLOBAL = 4  # sequences per step: --batch 4 on one process, 2 on each of 2


def _cfg(strategy: str, world: int, **extra) -> dict:
    return {**BASE, "strategy": strategy, "batch": GLOBAL // world, **extra}


def _one(cfg: dict, stop_at=None, resume=None, overrides=None, world=1):
    """One process (or one rank of run_world): a fresh run up to stop_at, or a resume; its losses and
    the optimizer's step counter after the run."""
    from memfit.train import loop

    if resume is not None:
        result = loop.train(*loop.resume_config(resume, overrides or {}, world=world), progress=False)
    else:
        result = loop.train(loop.TrainConfig(**cfg), stop_at=stop_at, progress=False)
    return result.metrics["steps"]["loss"], result.step


def _rank(rank, world, cfg, stop_at, resume, overrides):
    return _one(cfg, stop_at, resume, overrides, world)


def _run(world, cfg, stop_at=None, resume=None, overrides=None):
    if world == 1:
        return _one(cfg, stop_at, resume, overrides)
    from memfit.distributed.spawn import run_world

    return run_world(_rank, world, args=(cfg, stop_at, resume, overrides), timeout_s=240)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(1, {**_cfg("none", 1), "out": str(tmp_path_factory.mktemp("ref") / "run")})[0]


def _resume_case(tmp_path, reference, source, target):
    (s_name, s_world, s_extra), (t_name, t_world, t_extra) = source, target
    part = str(tmp_path / "part")
    first, step = _run(s_world, {**_cfg(s_name, s_world, **s_extra), "out": part}, stop_at=2)
    assert step == 2 and first == pytest.approx(reference[:2], rel=1e-5)
    losses, step = _run(t_world, None, resume=part, overrides={"strategy": t_name, **t_extra})
    assert step == 4 and len(losses) == 4
    assert losses[:2] == first  # the history carried over
    assert losses[2:] == pytest.approx(reference[2:], rel=1e-5), (source, target)
    return losses


@pytest.mark.multiproc
def test_zero3_resumes_in_one_process(tmp_path, reference):
    _resume_case(tmp_path, reference, ("zero3", 2, {}), ("none", 1, {}))


LAYOUTS = [
    (("zero3", 2, {}), ("ddp", 2, {})),
    (("none", 1, {}), ("zero2", 2, {})),
    (("ddp", 2, {}), ("pipeline", 2, {})),
    (("pipeline", 2, {}), ("tensor", 2, {})),
    (("tensor", 2, {}), ("tensor", 2, {"tp": 1})),
    (("tensor", 2, {}), ("zero1", 2, {})),
    (("zero2", 2, {"offload_optimizer": "disk"}), ("none", 1, {})),
]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("source,target", LAYOUTS, ids=lambda c: f"{c[0]}{c[1]}")
def test_resume_in_another_layout(tmp_path, reference, source, target):
    _resume_case(tmp_path, reference, source, target)


def test_resume_keeps_the_global_batch_and_drops_the_old_layouts_options(tmp_path):
    import torch

    from memfit.core.errors import ConfigError
    from memfit.train import loop

    run = tmp_path / "run"
    loop.train(loop.TrainConfig(**{**_cfg("none", 1), "steps": 1, "out": str(run)}), progress=False,
               log=lambda m: None)
    cfg, _ = loop.resume_config(run, {"strategy": "zero2"}, world=2)
    assert (cfg.strategy, cfg.batch) == ("zero2", GLOBAL // 2)  # 1 x 4 sequences = 2 x 2
    with pytest.raises(ConfigError, match="global batch is 4 sequences .* 3 processes cannot share it evenly"):
        loop.resume_config(run, {"strategy": "zero2"}, world=3)
    with pytest.raises(ConfigError, match="cannot change --batch when resuming"):
        loop.resume_config(run, {"batch": 1})
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)  # as if a 2-replica pipeline had written it
    ckpt["config"].update(strategy="pipeline", dp=2, microbatches=4, batch=2)
    ckpt["world"] = 2
    from memfit.train.integrity import seal

    torch.save(seal(ckpt), run / "checkpoint.pt")  # with fresh checksums (the saved ones no longer hold)
    cfg, _ = loop.resume_config(run, {"strategy": "tensor"}, world=2)
    assert (cfg.strategy, cfg.dp, cfg.microbatches, cfg.tp, cfg.batch) == ("tensor", 1, None, None, 2)
    cfg, _ = loop.resume_config(run, {"strategy": "none"}, world=1)
    assert cfg.batch == GLOBAL


@pytest.mark.parametrize("strategy,optimizer,refused", [
    ("zero2", "adamw8bit", True), ("tensor", "adafactor", True), ("pipeline", "adamw4bit", True),
    ("zero3", "adafactor", False), ("pipeline", "lion", False), ("none", "adamw8bit", False),
])
def test_a_layout_whose_checkpoints_cannot_be_written_is_refused_before_training(strategy, optimizer, refused):
    from memfit.core.errors import ConfigError
    from memfit.train.portable import check_checkpointable

    if refused:
        with pytest.raises(ConfigError, match=f"--optimizer {optimizer} with --strategy {strategy}: its checkpoints"):
            check_checkpointable(strategy, optimizer)
    else:
        check_checkpointable(strategy, optimizer)
