"""What one block and the model's ends cost one rank, per sequence: the cluster planner's unit.

    u = unit_profile(spec, seq=4096, tp=8, precision="bf16-master", optimizer="adamw")
    u.block_numel, u.saved["keep"], u.head_saved, u.temporaries(rows=2)

From three short traces under FakeTensorMode (nothing allocated) of the model (memfit's GPT or a Hugging
Face causal LM: memfit.plan.cluster_shape.unit_model) cut to one block, built with the shapes one
tensor-parallel rank holds (memfit.measure.parallel_estimate.local_tp_gpt, local_tp_hf;
tp=1 is the plain model): checkpoint none and selective at one sequence, and none at two (a recomputed block saves only
its input, the hidden states, counted from the shapes).
Their per-module saved bytes (module_activations) give what a block saves for backward under each
action (`saved`), what the embeddings and the head + loss save (`embed_saved`, `head_saved`, which
includes the logits), and the step's temporaries at one and two sequences (linear in between and
beyond). Activations are linear in the rows of a micro-batch at a fixed sequence length, so every
rank of every layout composes from these figures (memfit.plan.cluster_memory). Element counts come
from fake builds at one and two blocks. Cached in this process and on disk (memfit.core.cache;
MEMFIT_NO_CACHE=1 traces again).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from memfit.core import cache

ACTIONS = ("keep", "selective", "recompute")
_CHECKPOINT = {"keep": "none", "selective": "selective", "recompute": "full"}
_VERSION = 1
_MEMO: dict[tuple, "UnitProfile"] = {}


@dataclass(frozen=True)
class UnitProfile:
    tp: int
    block_numel: int
    """Elements of one block's weights on one TP rank."""
    embed_numel: int
    head_numel: int
    """Final norm and head (a tied head: 0, its matrix is the embedding's)."""
    block_tensors: int
    rest_tensors: int
    saved: dict
    """Bytes one block saves for backward per sequence, by action (recompute: its input)."""
    embed_saved: int
    head_saved: int
    """Final norm, head and loss per sequence, the logits included."""
    logits: int
    """Bytes of one sequence's logits (what a chunked head does not keep whole)."""
    temps: tuple
    """The step's temporaries at one and at two sequences."""
    boundary: int
    """Bytes of one sequence's hidden states between blocks (a pipeline stage's output)."""

    def temporaries(self, rows: int) -> int:
        """The larger of the optimizer step's (the one-sequence trace peaks there for large
        models) and backward's, which grows with the rows (the logits' gradient)."""
        one, two = self.temps
        return max(one, two * rows // 2)

    @property
    def rest_numel(self) -> int:
        return self.embed_numel + self.head_numel


def _counts(spec, seq: int, tp: int) -> tuple[int, int, int, int, int]:
    from memfit.measure.fake_mode import fake_mode
    from memfit.models.spec import _no_init
    from memfit.plan.cluster_shape import names_of, unit_model

    out = []
    for layers in (1, 2):
        with fake_mode(), _no_init():
            m = unit_model(spec, seq, tp, layers)
            ps = [p for p in m.parameters()]
            embed = sum(m.get_submodule(n).weight.numel() for n in names_of(m)[1]
                        if getattr(m, n.split(".")[0], None) is not None)
            out.append((sum(p.numel() for p in ps), len(ps), embed))
    (n1, t1, embed), (n2, t2, _) = out
    block, block_t = n2 - n1, t2 - t1
    return block, embed, n1 - block - embed, block_t, t1 - block_t


def _traced(spec, seq: int, tp: int, precision: str, optimizer: str) -> dict:
    import torch

    from memfit.measure.trace import trace_step
    from memfit.models.spec import _no_init
    from memfit.plan.cluster_shape import names_of, shape_of, unit_model

    build = lambda: unit_model(spec, seq, tp, 1)  # noqa: E731
    runs = {a: trace_step(build, 1, seq, precision, optimizer, _CHECKPOINT[a]) for a in ACTIONS[:2]}
    two = trace_step(build, 2, seq, precision, optimizer, "none")
    keep = runs["keep"].module_activations
    with torch.device("meta"), _no_init():
        probe = unit_model(spec, seq, 1, 1)
    (block, embeds), root = names_of(probe), type(probe).__name__  # the tracker's names of its modules
    embed = sum(keep.get(n, 0) for n in embeds)
    saved = {a: r.module_activations.get(block, 0) for a, r in runs.items()}
    cfg = shape_of(spec)
    # a recomputed block saves only its input: the residual stream (fp32 under autocast)
    saved["recompute"] = seq * cfg.hidden * (2 if precision.startswith(("bf16", "16")) and
                                              not precision.endswith("-mixed") else 4)
    return {"saved": saved, "embed_saved": embed, "head_saved": max(keep.get(root, 0) - saved["keep"] - embed, 0),
            "logits": seq * cfg.vocab * 4, "temps": [runs["keep"].temporaries, two.temporaries],
            "boundary": saved["recompute"]}  # a recomputed block saves its input: the hidden states


def states_only(spec, seq: int, tp: int) -> UnitProfile:
    """The element counts alone (no trace; activations zero): a floor that rules layouts out cheaply."""
    from memfit.plan.cluster_shape import shape_of

    key = ("numel", shape_of(spec).key, seq, tp)
    if key not in _MEMO:
        block, embed, head, bt, rt = _counts(spec, seq, tp)
        _MEMO[key] = UnitProfile(tp, block, embed, head, bt, rt, dict.fromkeys(ACTIONS, 0), 0, 0, 0, (0, 0), 0)
    return _MEMO[key]


def unit_profile(spec, seq: int, tp: int, precision: str, optimizer: str) -> UnitProfile:
    """The unit for `spec` (memfit's GPT or a Hugging Face causal LM: memfit.plan.cluster_shape) at this TP degree."""
    from memfit.plan.cluster_shape import shape_of

    key = {"v": _VERSION, "spec": shape_of(spec).key, "seq": seq, "tp": tp, "precision": precision,
           "optimizer": optimizer}
    memo = tuple(sorted((k, str(v)) for k, v in key.items()))
    got = _MEMO.get(memo)
    if got is not None:
        return got
    off = bool(os.environ.get("MEMFIT_NO_CACHE"))  # as memfit.measure.chain_cache
    data = None if off else cache.load(key, "cluster")
    if data is None:
        c = states_only(spec, seq, tp)
        block, embed, head, bt, rt = c.block_numel, c.embed_numel, c.head_numel, c.block_tensors, c.rest_tensors
        data = {"block_numel": block, "embed_numel": embed, "head_numel": head, "block_tensors": bt,
                "rest_tensors": rt, **_traced(spec, seq, tp, precision, optimizer)}
        try:
            if not off:
                cache.store(key, data, "cluster")
        except OSError:
            pass  # a read-only cache folder only costs the traces next time
    fields = {f.name for f in dataclasses.fields(UnitProfile)}
    got = UnitProfile(tp=tp, **{k: (tuple(v) if k == "temps" else v) for k, v in data.items() if k in fields})
    _MEMO[memo] = got
    return got
