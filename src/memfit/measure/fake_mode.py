"""The fake mode every trace runs in: FakeTensorMode plus the answers fake tensors cannot give.

- `real_tensor_defaults`: fake tensors take the kernels real ones would (foreach optimizers on CUDA);
- `unpacked_batches`, `unpadded_masks`: Hugging Face masking is told the batch has no packing or padding;
- `fake_experts`: mixture-of-experts routing traced without reading routing values;
- `top_of_range_draws`: a random scalar read in Python (LayerDrop) takes its worst case;
- `gpu_kernels` (a named GPU target): attention and optimizer kernels as that GPU runs them.
`allow_non_fake_inputs`: libraries keep a few real constants at module level (e.g. HF masks).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from memfit.measure.fake_defaults import real_tensor_defaults
from memfit.measure.fake_random import top_of_range_draws
from memfit.measure.hf_masks import unpacked_batches, unpadded_masks
from memfit.measure.moe import fake_experts


@contextlib.contextmanager
def fake_mode(gpu: "GpuSpec | None" = None) -> Iterator[None]:  # noqa: F821
    """gpu: a named GPU (memfit.core.gpus) whose kernels the step runs (memfit.measure.gpu_kernels)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.measure.gpu_kernels import gpu_kernels

    with FakeTensorMode(allow_non_fake_inputs=True), real_tensor_defaults(), unpacked_batches(), unpadded_masks(), \
            fake_experts(), top_of_range_draws(), gpu_kernels(gpu) if gpu is not None else contextlib.nullcontext():
        yield
