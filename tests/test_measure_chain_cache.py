"""Chain profiles cached on disk: the same figures back, keyed by the code that traced them."""
from __future__ import annotations

from memfit.apply.policy import resolve_policy
from memfit.measure import blocks, chain_cache
from memfit.measure.blocks import chain_profile, spec_source
from memfit.models.spec import parse_model
from memfit.plan.costs import _bases

# Keep and recompute: memfit/measure/chain_cache.py writes every kind of stretch alike, so the other kinds
# (selective, offload) would only add seconds of tracing to the round trip through the file.
BASES = _bases(("recompute",))


def test_a_cached_chain_profile_composes_the_same_figures(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMFIT_NO_CACHE", raising=False)
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blocks, "_CACHE", {})
    spec = parse_model("gpt:layers=4,hidden=32,heads=2,vocab=64,seq=64")
    src = spec_source(spec, 2, 16)
    traced = chain_profile(src, "32-true", "adamw", bases=BASES)
    assert list((tmp_path / chain_cache.KIND).glob("*.json"))
    calls = []
    monkeypatch.setattr(blocks, "profile_chain", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(blocks, "_CACHE", {})
    again = chain_profile(src, "32-true", "adamw", bases=BASES)
    assert calls == [] and again == traced
    for policy in ("none", "full", "sqrt"):
        acts = resolve_policy(policy, 4)
        assert again.compose(acts) == traced.compose(acts)
    # Other code (or another torch) traced it: traced again, not read back.
    monkeypatch.setattr(chain_cache, "_code_digest", lambda: "other code")
    monkeypatch.setattr(blocks, "profile_chain", lambda *a, **k: calls.append(a) or traced)
    monkeypatch.setattr(blocks, "_CACHE", {})
    chain_profile(src, "32-true", "adamw", bases=BASES)
    assert len(calls) == 1


def test_modules_in_memory_are_not_cached():
    assert chain_cache.disk_key(("module", 1234, "[]")) is None
