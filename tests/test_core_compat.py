"""Both branches of each torch-version helper in memfit.core.compat, whichever torch is installed:
the older and newer signatures are stand-ins with the exact parameter lists of each release."""
from __future__ import annotations

import torch

from memfit.core import compat


def test_checkpoint_flags_follow_the_generator_signature():
    def new(fn, preserve_rng_state, context_fn, determinism_check, debug, early_stop, *args, **kwargs):
        pass

    def old(fn, preserve_rng_state, context_fn, determinism_check, debug, *args, **kwargs):
        pass

    ctx = object()
    assert compat.checkpoint_generator_flags(ctx, new) == (True, ctx, "default", False, True)
    assert compat.checkpoint_generator_flags(ctx, old) == (True, ctx, "default", False)
    # the installed torch: flags fill exactly the parameters between fn and *args
    import inspect
    from torch.utils import checkpoint as tc
    params = [p for p in inspect.signature(tc._checkpoint_without_reentrant_generator).parameters.values()
              if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert len(compat.checkpoint_generator_flags(ctx)) == len(params) - 1


def test_pipeline_stage_initialisation_passes_target_only_where_taken():
    calls = []

    def new(args, kwargs, target):
        calls.append(("new", args, kwargs, target))

    def old(args, kwargs):
        calls.append(("old", args, kwargs))

    x, y = torch.ones(2), torch.zeros(2)
    compat.initialize_pipeline_stage(new, (x,), y)
    compat.initialize_pipeline_stage(old, (x,), y)
    assert calls[0][0] == "new" and calls[0][3] is y and calls[0][2] == {}
    assert calls[1] == ("old", (x,), {})


def test_pipeline_send_release_is_read_from_the_stage_class():
    class Old:
        pass

    class New:
        def release_fwd_send_outputs(self, fwd_chunk_id: int) -> None:
            pass

    assert not compat.pipeline_releases_sent_outputs(Old) and compat.pipeline_releases_sent_outputs(New)
    compat.pipeline_releases_sent_outputs()  # the installed torch's answer, without error
