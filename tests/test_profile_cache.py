"""memfit profile: exact bytes per action from the trace, a cache keyed by shape, and the command."""
from __future__ import annotations

from memfit.cli import main
from memfit.measure.trace import trace_step
from memfit.profile.measure import profile

SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=32"


def test_profile_bytes_are_exact_and_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    p = profile(SPEC, batch=2, seq=16, rounds=1)
    assert not p.cached and p.blocks.saved["keep"] > p.blocks.saved["selective"] > p.blocks.saved["recompute"] > 0
    # Timed variants of one model: segments (sqrt: one segment of both blocks); this vocabulary is too small
    # for the chunked head's count, so no head timing.
    assert set(p.step_s) == {"none", "full", "selective", "sqrt"} and set(p.blocks.segment_s) == {"2"}
    assert p.blocks.head_s == {}
    # Keeping every block saves exactly (keep - recompute) bytes per block more than recomputing them:
    # the traced peaks of the whole step (in forward order) differ by that much when the peak is after the blocks.
    keep = trace_step(SPEC, batch=2, seq=16, optimizer="sgd", checkpoint="none").activations
    full = trace_step(SPEC, batch=2, seq=16, optimizer="sgd", checkpoint="full").activations
    assert keep > full
    again = profile(SPEC, batch=2, seq=16, rounds=1)
    assert again.cached and again.blocks == p.blocks
    other = profile(SPEC, batch=4, seq=16, rounds=1)
    assert not other.cached and other.blocks.saved["keep"] == 2 * p.blocks.saved["keep"]
    assert main(["profile", SPEC, "--batch", "2", "--seq", "16"]) == 0
    assert "(cached)" in capsys.readouterr().out
