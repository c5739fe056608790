"""A property of the whole command line: whatever the arguments, `memfit` exits 0 or 2, never with
an uncaught exception (exit 1) or a traceback, and a refusal is one line saying what was wrong.

Arguments are drawn from a grammar of valid and broken values per option. Runs stay tiny (one-layer
models, one or two steps) and the number of examples is bounded, so the file takes about a minute.
A subcommand that the grammar does not know yet is fuzzed from its own parser's options.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from time_limit import time_limit

from memfit.cli import SUBCOMMANDS, build_parser, main

TINY = "gpt:layers=1,hidden=16,heads=2,vocab=256,seq=128"
TINY_LLAMA = "llama:layers=1,hidden=16,heads=2,vocab=256"
BROKEN_MODELS = ["gpt9000", "gpt:layers=1", "gpt:layers=x,hidden=16,heads=2,vocab=256",
                 "gpt:layers=1,hidden=15,heads=2,vocab=256", "gpt:layers=1,hidden=16,heads=2,vocab=256,dropout=-1",
                 "gpt:layers=1,hidden=99999999999,heads=1,vocab=256", "{t5}", "{array}", "{no_type}", "{missing}", ""]
BAD_COUNTS = ["0", "-1", "x", "1.5", "99999999999999999999", "", "inf"]
BAD_FLOATS = ["nan", "inf", "-inf", "1e400", "-1", "x", ""]
EXAMPLE_SECONDS = 120
"""A single example running longer than this fails: a command that hangs is a bug too."""


def _opt(flag: str, good: list[str], bad: list[str], clean: bool = False) -> st.SearchStrategy[list[str]]:
    """Either absent, or the flag with a valid value (likely) or (unless `clean`) a broken one."""
    value = st.sampled_from(good)
    if bad and not clean:
        value = st.one_of(value, value, value, st.sampled_from(bad))
    return st.one_of(st.just([]), value.map(lambda v: [flag, v if v != "" or bad else None]))


COMMON = {
    "--batch": (["1", "2"], BAD_COUNTS),
    "--precision": (["32-true", "bf16-true", "bf16-mixed"], ["fp8", "auto2", ""]),
    "--optimizer": (["adamw", "sgd", "adam", "momentum"], ["lion", ""]),
    "--checkpoint": (["none", "full", "every:1", "full+offload:cpu", "full+offload:disk"],
                     ["sometimes", "every:0", "full+offload:tape", ""]),
}
GRAMMAR = {
    "estimate": {**COMMON, "--seq": (["8", "16"], [*BAD_COUNTS, "33", "99999"]),
                 "--params": (["7B", "124M", "1000"], ["-3", "1e400", "abc", "0", "99999999999999999999999T"]),
                 "--zero": (["0", "1", "3"], ["4", "-1", "x"]), "--world": (["1", "8"], BAD_COUNTS),
                 "--offload-optimizer": (["none", "cpu", "disk"], ["tape"]),
                 "--device-memory": (["24GiB", "1KiB", "80GB"], ["1e400", "-1", "0", "abc", "12 parsecs"]),
                 "--modules": (["0", "3"], ["-1", "x"]), "--json": ([""], [])},
    "track": {**COMMON, "--seq": (["8", "16"], [*BAD_COUNTS, "33"]), "--steps": (["1", "2"], BAD_COUNTS),
              "--device": (["cpu"], ["tpu", "cuda:7", "", "cpu:x"]), "--no-predict": ([""], []),
              "--modules": (["0", "3"], ["-1"]), "--json": ([""], [])},
    "train": {**COMMON, "--seq": (["8", "16"], [*BAD_COUNTS, "33"]),
              "--accum": (["1", "2"], BAD_COUNTS), "--lr": (["1e-3", "0.01"], [*BAD_FLOATS, "0"]),
              "--warmup": (["0", "1"], ["-1", "x"]), "--weight-decay": (["0", "0.1"], BAD_FLOATS),
              "--seed": (["0", "7", str(2**64 - 1)], [str(2**64), "-1", "x"]),
              "--offload-optimizer": (["none", "cpu", "disk"], ["tape"]),
              "--spill-dir": (["{spill}"], ["{missing}", "{file}"]),
              "--clip": (["0", "1"], BAD_FLOATS), "--dropout": (["0", "0.1"], ["1", "-0.5", *BAD_FLOATS]),
              "--eval-every": (["0", "1"], ["-1"]), "--eval-batches": (["1"], BAD_COUNTS),
              "--save-every": (["0", "1"], ["-1", "x"]), "--time-limit": (["60"], [*BAD_FLOATS, "0"]),
              "--data": (["{text}"], ["/dev/null", "{missing}", "{empty_dir}", "{dir}/*.nothing"]),
              "--device": (["cpu"], ["tpu", "cuda:7", ""]), "--no-track": ([""], []),
              "--overwrite": ([""], [])},
}


@st.composite
def command_lines(draw, command: str) -> list[str]:
    options = GRAMMAR[command]
    argv = [command]
    clean = draw(st.booleans())  # half the examples are valid command lines: they must run, and exit 0
    models = st.sampled_from([TINY, TINY_LLAMA])
    model = draw(models if clean else st.one_of(models, models, models, st.sampled_from(BROKEN_MODELS)))
    if command == "estimate" and draw(st.booleans()):
        argv.append(model)  # estimate and track also take the model positionally
    else:
        argv += ["--model", model]
    if command == "train":
        # Always a step count (valid or not), so no run waits for a time limit; a resume sometimes.
        argv += draw(_opt("--steps", ["1", "2"], BAD_COUNTS, clean).filter(bool))
        resume = [["--resume", "{run}"], ["--resume", "{run}/checkpoint.pt"]]
        argv += draw(st.sampled_from([[], [], [], *resume] + ([] if clean else [["--resume", "{missing}"],
                                                                                ["--resume", "{tensor}"]])))
        outs = [["--out", "{out}"]] + ([] if clean else [["--out", "{file}"], ["--out", "{file}/sub"],
                                                         ["--out", "{run}"]])  # a run's folder: refused or --overwrite
        argv += draw(st.sampled_from(outs))
    for flag in draw(st.permutations(sorted(options)))[: draw(st.integers(0, 6))]:
        good, bad = options[flag]
        argv += [a for a in draw(_opt(flag, good, bad, clean)) if a is not None]
    return argv


@contextlib.contextmanager
def _places() -> Iterator[dict[str, str]]:
    """Paths the grammar refers to by name, fresh for each example."""
    with tempfile.TemporaryDirectory() as root:
        r = Path(root)
        (r / "spill").mkdir()
        (r / "empty_dir").mkdir()
        (r / "file").write_text("a file, not a folder")
        (r / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
        (r / "t5.json").write_text(json.dumps({"model_type": "t5", "vocab_size": 256}))
        (r / "array.json").write_text("[1, 2]")
        (r / "no_type.json").write_text(json.dumps({"n_layer": 1}))
        torch.save(torch.zeros(2), r / "tensor.pt")
        shutil.copytree(_base_run(), r / "run")
        yield {"spill": str(r / "spill"), "empty_dir": str(r / "empty_dir"), "file": str(r / "file"),
               "text": str(r / "text.txt"), "t5": str(r / "t5.json"), "array": str(r / "array.json"),
               "no_type": str(r / "no_type.json"), "missing": str(r / "missing" / "x.json"), "dir": root,
               "tensor": str(r / "tensor.pt"), "run": str(r / "run"), "out": str(r / "out")}


_BASE: list[Path] = []
_FOLDER: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _base_folder(tmp_path_factory):
    """Where `_base_run` trains: pytest's temporary folders (kept for the last few sessions, then
    removed), not a folder of the system's temp folder that nothing removes."""
    _FOLDER.append(tmp_path_factory.mktemp("fuzz-run"))
    yield
    _FOLDER.clear()
    _BASE.clear()


def _base_run() -> Path:
    """One finished two-step run to resume from (made once per module)."""
    if not _BASE:
        folder = _FOLDER[0]
        assert main(["train", "--model", TINY, "--seq", "16", "--batch", "2", "--steps", "2", "--eval-batches", "1",
                     "--no-track", "--quiet", "--out", str(folder / "run")]) == 0
        _BASE.append(folder / "run")
    return _BASE[0]


def check_exit(argv: list[str], capsys) -> None:
    """Run `memfit *argv` in this process; the property holds or the example fails."""
    capsys.readouterr()
    with _places() as places:
        argv = [a.format(**places) if "{" in a else a for a in argv]
        with time_limit(EXAMPLE_SECONDS):
            code = main(argv)  # an uncaught exception fails the example: that would be exit 1
    out, err = capsys.readouterr()
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    errors = [line for line in err.splitlines() if ": error:" in line]
    if code == 2:
        assert len(errors) == 1 and errors[0].startswith("memfit"), (argv, err)
    else:
        assert not errors, (argv, err)


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=30, **_SETTINGS)
@given(argv=command_lines("estimate"))
def test_estimate_exits_0_or_2(argv, capsys):
    check_exit(argv, capsys)


@settings(max_examples=15, **_SETTINGS)
@given(argv=command_lines("track"))
def test_track_exits_0_or_2(argv, capsys):
    check_exit(argv, capsys)


@settings(max_examples=20, **_SETTINGS)
@given(argv=command_lines("train"))
def test_train_exits_0_or_2(argv, capsys):
    check_exit(argv, capsys)


# ---------------------------------------------------------------- subcommands the grammar does not know

GENERIC = ["1", "2", "0", "-1", "x", "inf", "nan", "1e400", "99999999999999999999", "", TINY, "{missing}", "{file}",
           "24GiB", "none", "full", "cpu"]


def _unknown_subcommands() -> list[str]:
    return [name for name in SUBCOMMANDS if name not in GRAMMAR]


@st.composite
def generic_lines(draw, command: str) -> list[str]:
    """Options of `command` read from its own parser, each with a value from a generic pool."""
    sub = next(a for a in build_parser()._subparsers._group_actions if a.choices)  # type: ignore[union-attr]
    parser = sub.choices[command]
    argv = [command]
    if any("--model" in a.option_strings for a in parser._actions):
        argv += ["--model", draw(st.sampled_from([TINY, TINY, *BROKEN_MODELS[:3]]))]
    actions = [a for a in parser._actions if a.option_strings and a.dest not in ("help", "model")]
    for action in draw(st.permutations(actions))[: draw(st.integers(0, 5))]:
        argv.append(action.option_strings[-1])
        if action.nargs != 0:
            pool = [str(c) for c in action.choices] + ["nope"] if action.choices else GENERIC
            argv.append(draw(st.sampled_from(pool)))
    return argv


@pytest.mark.parametrize("command", _unknown_subcommands() or [pytest.param("none", marks=pytest.mark.skip(
    reason="every subcommand has a grammar above"))])
def test_other_subcommands_exit_0_or_2(command, capsys):
    @settings(max_examples=10, **_SETTINGS)
    @given(argv=generic_lines(command))
    def run(argv):
        check_exit(argv, capsys)

    run()
