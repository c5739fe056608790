"""Tell Hugging Face masking, while tracing, that memfit's batches have no padding and no packing.

Encoder-decoders such as BART build an all-ones attention mask themselves when none is given. A real
run reads it, finds no padding and lets SDPA run without an explicit mask. A fake mask has no values to
read, so transformers materialises (B, 1, T, T) masks the real run never allocates. memfit's traced
batches are unpadded, so the skip checks are asked as for a mask without padding (None).
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator

from memfit.core.patching import patched

CHECKS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


def _masking():
    """transformers.masking_utils when transformers is in use (no HF model is built without importing
    it first), else None."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import masking_utils
    except ImportError:
        return None
    return masking_utils


@contextlib.contextmanager
def unpadded_masks() -> Iterator[None]:
    masking = _masking()
    originals = {name: getattr(masking, name) for name in CHECKS if hasattr(masking, name)}
    if not originals:
        yield
        return
    from torch._subclasses.fake_tensor import is_fake

    def unpadded(original):
        @functools.wraps(original)
        def check(padding_mask, *args, **kwargs):
            if padding_mask is not None and is_fake(padding_mask):
                padding_mask = None
            return original(padding_mask, *args, **kwargs)
        return check

    with patched(masking, {name: unpadded(original) for name, original in originals.items()}):
        yield


def unpacked_batches() -> contextlib.AbstractContextManager:
    """Tell Hugging Face masking that the traced batches hold one sequence per row.

    A real run reads the position ids, finds no packed sequences and lets SDPA use `is_causal`.
    Fake tensors have no data to read, so transformers assumes packing might be present and builds
    an explicit (B, 1, T, T) mask instead, which the real run never allocates. memfit's batches are
    unpacked, so the trace answers the question the way the real run does."""
    masking = _masking()
    if getattr(masking, "find_packed_sequence_indices", None) is None:
        return contextlib.nullcontext()
    return patched(masking, {"find_packed_sequence_indices": lambda position_ids: None})
