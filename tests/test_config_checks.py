"""Model configs and plan files checked before anything is built or trained: each fault a user can write is
one line with exit 2 (never a traceback, a model that eats the machine, or a plan under a budget of NaN),
SIGTERM stops a model's build, and a truncated block chain keeps every per-layer config list consistent."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from memfit.cli import main

transformers = pytest.importorskip("transformers")

GPT2 = dict(model_type="gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=256, n_positions=32)
LLAMA = dict(model_type="llama", num_hidden_layers=1, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=32, vocab_size=256, max_position_embeddings=32)


def _one_line(capsys, argv, needle) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"memfit {argv[0]}: error:") and needle in lines[0], lines[0]
    return lines[0]


CONFIGS = [
    (GPT2, {"n_embd": 16.5}, "n_embd must be a positive integer"),
    (GPT2, {"n_embd": "16"}, "n_embd must be a positive integer"),
    (GPT2, {"n_embd": None}, "n_embd must be a positive integer"),
    (GPT2, {"n_embd": -16}, "n_embd must be a positive integer"),
    (GPT2, {"n_head": 0}, "n_head must be a positive integer"),
    (GPT2, {"n_head": 3}, "the width 16 is not a multiple of the 3 attention heads"),
    (GPT2, {"n_inner": -5}, "n_inner must be a positive integer"),
    (GPT2, {"n_positions": 0}, "n_positions must be a positive integer"),
    (GPT2, {"n_layer": 0}, "n_layer must be a positive integer"),
    (GPT2, {"n_layer": 1e12}, "n_layer must be a positive integer"),
    (GPT2, {"n_layer": 10**12}, "n_layer must be a positive integer (at most 10000)"),
    (LLAMA, {"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    (LLAMA, {"num_key_value_heads": 3}, "num_key_value_heads 3 must divide the 4 attention heads"),
    (LLAMA, {"num_attention_heads": 5, "num_key_value_heads": 5}, "not a multiple of the number of attention heads"),
    (LLAMA, {"head_dim": 7}, "RoPE requires an even rotary dimension"),
    (LLAMA, {"intermediate_size": -128}, "intermediate_size must be a positive integer"),
    (LLAMA, {"rope_theta": -1}, "rope_theta must be a positive finite number"),
    (LLAMA, {"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta must be"),
    (LLAMA, {"layer_types": 7}, "layer_types must be a list"),
    (LLAMA, {"vocab_size": 2**63}, "vocab_size must be a positive integer (at most 2147483647)"),
]


@pytest.mark.parametrize("base, change, needle", CONFIGS)
def test_hf_config_values_are_one_line(tmp_path, capsys, base, change, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **change}))
    _one_line(capsys, ["estimate", str(path), "--batch", "1", "--seq", "8"], needle)


def test_train_refuses_a_bad_config_before_building_and_leaves_no_folder(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "num_key_value_heads": 3}))
    _one_line(capsys, ["train", "--model", str(path), "--steps", "1", "--out", str(tmp_path / "run")],
              "must divide the 4 attention heads")
    assert not (tmp_path / "run").exists()


def test_a_model_beyond_this_machines_memory_is_refused_before_building(tmp_path, capsys):
    path = tmp_path / "config.json"  # 10,000 layers of width 4096: 2.0e12 parameters, 7.3 TiB of float32
    path.write_text(json.dumps({**GPT2, "n_layer": 10_000, "n_embd": 4096, "n_head": 32}))
    start = time.process_time()
    line = _one_line(capsys, ["train", "--model", str(path), "--seq", "16", "--steps", "1",
                              "--out", str(tmp_path / "run")], "parameters (7.33 TiB of float32 weights), more than")
    assert "2.01e+12 parameters" in line and time.process_time() - start < 30  # two shallow meta builds, no more
    _one_line(capsys, ["track", "gpt:layers=10000,hidden=8192,heads=32,vocab=256", "--seq", "16"],
              "memfit cannot measure it here")


def test_sigterm_while_the_model_is_built_stops_the_build(tmp_path, capsys, monkeypatch):
    from memfit.models import host_fit, spec as spec_mod

    built, before = [], signal.getsignal(signal.SIGTERM)

    def slow_build(self, seq=None):  # a build that would run on for a minute
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(600):
            time.sleep(0.1)
        built.append(True)

    monkeypatch.setattr(spec_mod.ModelSpec, "build", slow_build)
    monkeypatch.setattr(host_fit, "check_fits_host", lambda spec, action: None)  # (it builds on meta too)
    start = time.monotonic()
    code = main(["train", "--model", "gpt:layers=1,hidden=16,heads=2,vocab=256,seq=32", "--seq", "16", "--steps", "1",
                 "--out", str(tmp_path / "run")])
    assert code == 128 + signal.SIGTERM and not built and time.monotonic() - start < 30
    assert "memfit: interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before  # the build's and the loop's handlers are both undone


def test_a_refused_config_prints_no_other_librarys_warnings(tmp_path):
    path = tmp_path / "config.json"  # a fresh process: transformers, torchao and torch warn on first import
    path.write_text(json.dumps({**LLAMA, "num_key_value_heads": 3}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-m", "memfit", "estimate", str(path), "--batch", "1", "--seq", "8"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("memfit estimate: error:") and not r.stdout


# ---------------------------------------------------------------- plan files


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # --allow accumulate: a whole plan file from the smallest search (half the CPU time of the default
        # kinds); each case below breaks one field of it.
        assert main(["plan", "gpt:layers=2,hidden=16,heads=2,vocab=256,seq=32", "--budget", "64MiB", "--seq", "16",
                     "--batch", "2", "--json", "--no-verify", "--allow", "accumulate"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("change, needle", [
    ({"model": None}, "has no model: not a whole memfit plan"),
    ({"optimizer": None}, "optimizer must be one of"),
    ({"budget": -1}, "budget must be a positive whole number of bytes"),
    ({"budget": 1e40}, "budget must be a positive whole number of bytes"),
    ({"budget": float("nan")}, "budget must be a positive whole number of bytes"),
    ({"micro_batch": 0}, "micro_batch must be an integer in [1,"),
    ({"actions": "keep*3"}, "actions name 3 blocks, n_blocks says 2"),
    ({"ranked": [{"x": 1}]}, "ranked holds a configuration that is not a memfit candidate"),
])
def test_plan_file_fields_are_one_line(tmp_path, capsys, plan_json, change, needle):
    data = json.loads(json.dumps(plan_json))
    for key, value in change.items():
        if value is None and key == "model":
            data["plan"].pop(key)
        else:
            data["plan"][key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    _one_line(capsys, ["train", "--plan", str(path), "--steps", "1", "--out", str(tmp_path / "run")], needle)
    assert not (tmp_path / "run").exists()


def test_a_budget_beyond_any_machine_is_one_line(capsys):
    _one_line(capsys, ["plan", "gpt:layers=2,hidden=16,heads=2,vocab=256,seq=32", "--budget", "1e40"],
              "is more than any machine holds")


# ---------------------------------------------------------------- per-layer config lists


def test_truncation_keeps_per_layer_lists_consistent():
    from memfit.models.hf_check import per_layer_config

    cfg = transformers.Gemma2Config(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=8, intermediate_size=32, vocab_size=256, eos_token_id=[1, 2])
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    per_layer_config(cfg, 2, 5)  # copies of block i mod 2: the pattern runs on
    assert cfg.num_hidden_layers == 5 and cfg.layer_types == ["sliding_attention", "full_attention"] * 2 + [
        "sliding_attention"]
    assert cfg.eos_token_id == [1, 2]  # two entries, as two layers, but not one per layer
    per_layer_config(cfg, 5, 1)
    assert cfg.layer_types == ["sliding_attention"]
    moe = transformers.Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[1, 3])
    per_layer_config(moe, 4, 6)  # layer indices, not one entry per layer
    assert moe.mlp_only_layers == [1, 3, 5]
    per_layer_config(moe, 6, 2)
    assert moe.mlp_only_layers == [1]
