"""Tell Hugging Face masking, while tracing, that memfit's batches have no padding.

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

CHECKS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


@contextlib.contextmanager
def unpadded_masks() -> Iterator[None]:
    masking = None
    if "transformers" in sys.modules:
        try:
            from transformers import masking_utils as masking
        except ImportError:
            masking = None
    originals = {name: getattr(masking, name) for name in CHECKS if masking is not None and hasattr(masking, name)}
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

    for name, original in originals.items():
        setattr(masking, name, unpadded(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)
