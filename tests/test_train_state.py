"""Atomic checkpoints: weights_only loading, no torn files, no temp files left behind."""
from __future__ import annotations

import pytest
import torch

from memfit.core.errors import ConfigError
from memfit.train import state


def _payload(value: float) -> dict:
    return {"step": 3, "model": {"w": torch.full((4, 4), value)}, "history": {"loss": [1.5, None]},
            "rng": state.rng_state(), "name": "x", "flag": True, "pair": (1, 2)}


def test_checkpoint_loads_weights_only_and_round_trips(tmp_path):
    path = state.save_checkpoint(tmp_path / "checkpoint.pt", _payload(2.0))
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 3 and loaded["history"] == {"loss": [1.5, None]}
    assert torch.equal(loaded["model"]["w"], torch.full((4, 4), 2.0))
    assert torch.equal(state.load_checkpoint(tmp_path)["rng"]["cpu"], loaded["rng"]["cpu"])  # a folder works too
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temp file left


def test_failed_write_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    state.save_checkpoint(path, _payload(1.0))
    with pytest.raises(Exception):
        state.save_checkpoint(path, {"model": {"w": torch.zeros(2)}, "bad": lambda: None})  # cannot pickle
    assert torch.equal(state.load_checkpoint(path)["model"]["w"], torch.full((4, 4), 1.0))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_write_goes_through_a_temp_file_and_os_replace(tmp_path, monkeypatch):
    calls = []
    real_replace, real_fsync = state.os.replace, state.os.fsync
    monkeypatch.setattr(state.os, "replace", lambda src, dst: (calls.append(("replace", src, dst)), real_replace(src, dst)))
    monkeypatch.setattr(state.os, "fsync", lambda fd: (calls.append(("fsync",)), real_fsync(fd)))
    state.save_checkpoint(tmp_path / "c.pt", _payload(0.0))
    kinds = [c[0] for c in calls]
    assert kinds.index("fsync") < kinds.index("replace")  # data is on disk before the rename
    _, src, dst = calls[kinds.index("replace")]
    assert str(src).startswith(str(tmp_path)) and str(dst) == str(tmp_path / "c.pt")


def test_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"obj": _Unsafe()}, path)  # a plain torch.save of an arbitrary object
    with pytest.raises(ConfigError, match="cannot load checkpoint"):
        state.load_checkpoint(path)


def test_missing_checkpoint_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint at"):
        state.load_checkpoint(tmp_path / "nothing")


class _Unsafe:
    pass


def test_memfit_train_stays_callable_after_submodule_imports():
    import memfit
    import memfit.train.loop  # rebinds memfit.train to the package

    assert memfit.TrainConfig is memfit.train.loop.TrainConfig
    assert callable(memfit.train)
    from memfit.train.loop import train as loop_train

    calls = []
    orig = memfit.train.loop.train
    memfit.train.loop.train = lambda *a, **k: calls.append((a, k)) or "ran"
    try:
        assert memfit.train("cfg", progress=False) == "ran"
    finally:
        memfit.train.loop.train = orig
    assert calls == [(("cfg",), {"progress": False})] and loop_train is orig
