"""A property of what a user writes in a file: whatever a Hugging Face config.json, a plan file or a
--budget says, `memfit` exits 0 or 2, never with a traceback, within bounded time and memory, and a
refusal is one line.

Configs are tiny families (GPT-2, Llama, Gemma-2, Mixtral, Falcon) with one to three keys replaced by
values from a pool of broken and valid ones (zero, negative, float, string, null, boolean, huge).
Plan files are a real `memfit plan --json` with fields removed or replaced. The default tier runs a
few dozen examples in this process (the CLI's main); the slow tier runs many more and also trains
and tracks the fuzzed configs for real.
"""
from __future__ import annotations

import contextlib
import io
import json
import resource
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from time_limit import time_limit

from memfit.cli import main

pytest.importorskip("transformers")

_TINY = dict(vocab_size=256)
BASES = {
    "gpt2": dict(model_type="gpt2", n_layer=1, n_embd=16, n_head=2, n_positions=32, **_TINY),
    "llama": dict(model_type="llama", num_hidden_layers=1, hidden_size=16, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=32, max_position_embeddings=32, **_TINY),
    "gemma2": dict(model_type="gemma2", num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8, intermediate_size=32, max_position_embeddings=32,
                   sliding_window=8, **_TINY),
    "mixtral": dict(model_type="mixtral", num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=32, num_local_experts=2, num_experts_per_tok=1,
                    max_position_embeddings=32, **_TINY),
    "falcon": dict(model_type="falcon", num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                   new_decoder_architecture=True, num_kv_heads=1, **_TINY),
}
EXTRA_KEYS = ["head_dim", "num_key_value_heads", "rope_theta", "n_inner", "layer_types", "rms_norm_eps",
              "attention_dropout", "num_hidden_layers", "vocab_size", "max_position_embeddings", "model_type"]
VALUES = [0, -1, -128, 1, 2, 3, 7, 8, 16, 2.5, 16.0, 1e12, 10**12, 2**63, "16", "", None, True, False, [], {},
          ["full_attention"], ["sliding_attention", "full_attention"], float("inf"), "llama", "t5", "gpt9000"]
EXAMPLE_SECONDS = 120
"""An example running longer than this fails: a command that hangs is a bug too (the slowest valid one,
a fuzzed config's estimate on a loaded machine, takes seconds)."""
MEMORY_GROWTH = 2 << 30
"""The process's peak RSS may grow by at most this much in one example: every valid config is tiny, so
only a build that should have been refused can use gigabytes."""


@st.composite
def hf_configs(draw) -> dict:
    base = dict(BASES[draw(st.sampled_from(sorted(BASES)))])
    keys = sorted(set(base) | set(EXTRA_KEYS))
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            base.pop(key, None)
        else:
            base[key] = draw(st.sampled_from(VALUES))
    return base


def _peak_rss(reset: bool = False) -> int:
    """This process's peak resident bytes since the last reset. The reset (Linux: clear_refs 5 sets the
    peak to the current size) makes the bound per example: under pytest-xdist a worker may have run a
    heavy test of another file before this one, and that peak is not this example's."""
    try:
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_exit(argv: list[str], capsys) -> int:
    """Run `memfit *argv` in this process: exit 0 or 2, no traceback, one error line on 2, bounded time
    and memory. Returns the exit code."""
    start = _peak_rss(reset=True)
    capsys.readouterr()
    with time_limit(EXAMPLE_SECONDS):
        code = main(argv)  # an uncaught exception fails the example: that would be exit 1
    out, err = capsys.readouterr()
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"memfit {argv[0]}: error:"), (argv, err)
    assert _peak_rss() - start < MEMORY_GROWTH, (argv, _peak_rss(), start)
    return code


def _write(folder: str, data) -> str:
    path = Path(folder) / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


_SETTINGS = dict(deadline=timedelta(seconds=EXAMPLE_SECONDS), derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=25, **_SETTINGS)
@given(data=hf_configs())
def test_estimate_of_any_config_exits_0_or_2(data, capsys):
    with tempfile.TemporaryDirectory() as folder:
        check_exit(["estimate", _write(folder, data), "--batch", "1", "--seq", "8"], capsys)


@pytest.mark.slow
@settings(max_examples=200, **_SETTINGS)
@given(data=hf_configs(), command=st.sampled_from(["estimate", "track", "train"]))
def test_any_config_in_every_command_exits_0_or_2(data, command, capsys):
    with tempfile.TemporaryDirectory() as folder:
        argv = [command, "--model", _write(folder, data), "--batch", "1", "--seq", "8"]
        if command == "train":
            argv += ["--steps", "1", "--eval-batches", "1", "--no-track", "--quiet", "--out", f"{folder}/run"]
        elif command == "track":
            argv += ["--steps", "1", "--no-predict"]
        check_exit(argv, capsys)


# ---------------------------------------------------------------- plan files and budgets

TINY = "gpt:layers=2,hidden=16,heads=2,vocab=256,seq=32"
PLAN_VALUES = [None, 0, -1, 1, 2, 2.5, float("nan"), float("inf"), 1e40, 2**70, "", "x", "adamw", "32-true", "keep*2",
               "keep,recompute", "full", [], {}, [{}], True]
_PLAN: list[dict] = []


def _plan() -> dict:
    """A real plan file's object (made once per session)."""
    if not _PLAN:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["plan", TINY, "--budget", "64MiB", "--seq", "16", "--batch", "2", "--json",
                         "--no-verify"]) == 0
        _PLAN.append(json.loads(out.getvalue()))
    return _PLAN[0]


@st.composite
def plan_files(draw) -> object:
    whole = json.loads(json.dumps(_plan()))
    plan = whole["plan"]
    for key in draw(st.lists(st.sampled_from(sorted(plan)), min_size=0, max_size=3, unique=True)):
        if draw(st.integers(0, 3)) == 0:
            plan.pop(key)
        else:
            plan[key] = draw(st.sampled_from(PLAN_VALUES))
    return draw(st.sampled_from([whole, whole, plan, [plan], "not json"]))


@settings(max_examples=20, **_SETTINGS)
@given(data=plan_files())
def test_train_of_any_plan_file_exits_0_or_2(data, capsys):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        check_exit(["train", "--plan", str(path), "--steps", "1", "--eval-batches", "1", "--no-track", "--quiet",
                    "--out", f"{folder}/run"], capsys)


BUDGETS = ["64MiB", "1GiB", "-1", "0", "nan", "inf", "1e40", "1e40GiB", "2**60", "x", "", "8", "1e6", "64 MiB",
           "99999999999999999999999999TiB"]


@settings(max_examples=12, **_SETTINGS)
@given(budget=st.sampled_from(BUDGETS))
def test_plan_of_any_budget_exits_0_or_2(budget, capsys):
    check_exit(["plan", TINY, "--budget", budget, "--seq", "16", "--batch", "2", "--no-verify"], capsys)
