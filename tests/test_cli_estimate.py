"""`memfit estimate`: JSON shape, traced estimates, and one-line errors for bad input."""
import json
import subprocess
import sys

import pytest

from memfit.cli import main

TINY = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=64"
FIELDS = {"params", "grads", "optimizer", "activations", "temporaries", "total"}


def run_json(capsys, *argv):
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_params_only_json_shape(capsys):
    data = run_json(capsys, "--params", "7.5B", "--precision", "16-master", "--optimizer", "adam",
                    "--zero", "1", "--world", "64", "--device-memory", "32GB")
    per = data["per_device"]
    assert set(per) == FIELDS and all(isinstance(v, int) for v in per.values())
    assert per["total"] == sum(per[k] for k in FIELDS - {"total"})
    assert per["total"] / 1e9 == pytest.approx(31.4, abs=0.05)  # ZeRO paper, P_os, N_d = 64
    assert data["fits"] is True and data["headroom"] == 32 * 10**9 - per["total"]


def test_traced_estimate_adds_up_and_checkpointing_lowers_it(capsys):
    plain = run_json(capsys, TINY, "--batch", "4", "--seq", "64")
    per = plain["per_device"]
    assert set(per) == FIELDS
    assert per["total"] == sum(per[k] for k in FIELDS - {"total"})
    # AdamW in fp32: two states per element plus a 4-byte step counter per parameter tensor.
    from memfit.models.spec import parse_model
    n_tensors = parse_model(TINY).counts()[1]
    assert per["activations"] > 0 and per["optimizer"] == 2 * per["params"] + 4 * n_tensors
    full = run_json(capsys, TINY, "--batch", "4", "--seq", "64", "--checkpoint", "full")
    assert full["per_device"]["activations"] < per["activations"]
    assert plain["traced"] is True and plain["modules"]


def test_zero_and_offload_scale_model_states(capsys):
    base = run_json(capsys, TINY, "--batch", "2", "--seq", "32")["per_device"]
    data = run_json(capsys, TINY, "--batch", "2", "--seq", "32", "--zero", "3", "--world", "4")
    z3, rank = data["per_device"], data["ranks"][0]  # --zero 3 --world 4 is --strategy zero3's largest rank
    assert rank["params"] == pytest.approx(base["params"] / 4, rel=0.01)  # this rank's slices
    assert z3["params"] == rank["params"] + rank["gathered"]  # and the blocks gathered around the peak
    assert z3["optimizer"] == pytest.approx(base["optimizer"] / 4, rel=0.01)
    assert z3["activations"] <= base["activations"] and z3["total"] < base["total"]
    off = run_json(capsys, TINY, "--batch", "2", "--seq", "32", "--offload-optimizer", "cpu")
    assert off["per_device"]["optimizer"] == 0 and off["offloaded"] > 0


def test_table_output(capsys):
    assert main(["estimate", TINY, "--batch", "2", "--seq", "32", "--device-memory", "1KiB"]) == 0
    out = capsys.readouterr().out
    for word in ("params", "grads", "optimizer", "activations", "temporaries", "total (peak)", "does NOT fit"):
        assert word in out


@pytest.mark.parametrize("argv,needle", [
    (["no-such-model"], "unknown model"),
    (["gpt:layers=2,hidden=64"], "missing"),
    (["gpt:layers=two,hidden=64,heads=4,vocab=10"], "not a valid int"),
    (["gpt:layers=2,hidden=64,heads=5,vocab=10"], "divisible"),
    (["gpt2", "--batch", "-1"], "must be a positive integer"),
    (["gpt2", "--precision", "fp8"], "unknown precision 'fp8'; accepted: 32-true"),
    (["--params", "-3"], "positive"),
    (["missing/config.json"], "no Hugging Face config"),
    ([], "give a model"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys):
    code = main(["estimate", *argv])  # argparse's own errors return 2 too
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err


def test_bad_input_from_the_shell_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "memfit", "estimate", "gpt:layers=2"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "missing" in proc.stderr


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offload_estimate_matches_measured_run(precision, offload):
    from memfit.measure.estimate import estimate
    from memfit.measure.trace import measure_step
    from memfit.models.spec import parse_model

    spec = parse_model(TINY)
    est = estimate(spec, batch=2, seq=32, precision=precision, offload_optimizer=offload)
    real = measure_step(spec, 2, 32, precision, offload_optimizer=offload, allocator=False)
    assert est.per_device == real.breakdown()


def test_heap_frozen_only_when_run_as_the_program(capsys, monkeypatch):
    """`memfit estimate` run as the program freezes the heap before exit (a faster interpreter teardown);
    called with an argument list (tests, scripts), it leaves the caller's collector alone."""
    import gc

    before = gc.get_freeze_count()
    run_json(capsys, "--params", "1B")
    assert gc.get_freeze_count() == before
    monkeypatch.setattr(sys, "argv", ["memfit", "estimate", "--params", "1B", "--json"])
    try:
        assert main() == 0
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
