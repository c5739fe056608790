"""The ranked plan table keeps its columns apart, and a predicted time says what it is."""
import re

from memfit.cli.plan import table
from memfit.core.units import format_seconds
from memfit.plan.plan import Candidate, Plan


def _plan(basis: str) -> Plan:
    ranked = [Candidate(8, 1, None, "bf16-master", int(74.13 * 2**30), 12786.3105, "keep*32", True),
              Candidate(1, 8, "cpu", "bf16-master", int(9.5 * 2**30), 25572.621, "recompute*32", True, 64),
              Candidate(4, 2, None, "bf16-master", 0, 0.0, "", False)]
    return Plan(model="llama-2-7b", budget=80 * 2**30, actions=[], micro_batch=8, accumulation=1, optimizer="adamw",
                precision="bf16-master", offload_optimizer=None, predicted_peak=ranked[0].peak,
                predicted_time=ranked[0].time, n_blocks=32, ranked=ranked, time_basis=basis,
                baseline_time=ranked[0].time / 1.25)


def test_columns_never_run_together_and_flop_times_are_relative():
    lines = table(_plan("flop-model"))
    peak_col = lines[0].index("peak")
    for line in lines[1:4]:
        assert re.search(r"GiB  +\S", line) or "does not fit" in line, line  # a gap after every peak
    assert "74.13 GiB" in lines[1] and "1.00x" in lines[1] and "2.00x" in lines[2]
    assert not any(u in "\n".join(lines) for u in (" ms", " s ", " h ")), "no seconds for an untimed model"
    assert lines[1].index("GiB") + 3 == peak_col + 4  # right-aligned under its header
    assert "1.25x the step that keeps every activation" in _plan("flop-model").summary()


def test_measured_times_are_seconds_in_a_readable_unit():
    lines = table(_plan("profile"))
    assert "3.55 h" in lines[1] and "7.10 h" in lines[2] and "step time" in lines[0]
    assert "(memfit profile costs)" in _plan("profile").summary()
    assert [format_seconds(s) for s in (0.0123, 75, 5400)] == ["12.3 ms", "75.00 s", "90.0 min"]
