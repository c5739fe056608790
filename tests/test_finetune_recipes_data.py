"""The published-recipe data file read by bench/finetune_recipes.py: each recipe is complete, names a source
pinned to a commit, and its configuration is one memfit accepts (the bench's figures come from running it)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_finetune_recipes", ROOT / "bench" / "finetune_recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipes_are_complete_and_accepted_by_memfit():
    from memfit.apply.optimizers import info
    from memfit.apply.precision import precision_mode
    from memfit.core.gpus import target
    from memfit.models.lora import parse_lora
    from memfit.models.spec import parse_model

    bench = _bench()
    data = bench.load_recipes()
    assert len(data["recipes"]) >= 3
    for src in data["sources"].values():
        assert re.fullmatch(r"[0-9a-f]{40}", src["commit"]) and src["commit"] in src["url"]
    for r in data["recipes"]:
        assert re.fullmatch(r"[0-9a-f]{40}", r["config"]["commit"]), r["name"]
        assert r["published"]["peak"] > 0 and str(r["published"]["peak"]) in r["row"], r["name"]
        assert parse_model(r["model"]).config.layers > 0
        assert target(r["gpu"]) is not None, r["gpu"]
        precision_mode(r["precision"])
        info(r["optimizer"])
        assert r["checkpoint"] in ("none", "full", "selective")
        if r["lora"]:
            assert parse_lora(bench._lora(r)).r > 0
        assert r["qlora"] is False or r["lora"], "QLoRA needs the adapters' rank and targets"
        assert r["unpublished"], "say what the source leaves out, even if only the counter"


def test_a_recipe_missing_a_field_is_refused(tmp_path):
    bench = _bench()
    data = json.loads(bench.DATA.read_text())
    del data["recipes"][0]["seq"]
    bad = tmp_path / "recipes.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks seq"):
        bench.load_recipes(bad)
