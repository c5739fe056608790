"""GPUs memfit can estimate for from any machine: `--device h100` on a laptop traces the step as an
H100 runs it (memfit.measure.gpu_kernels) and predicts what its caching allocator holds.

    target("h100")            # GpuSpec: memory, compute capability, attention backends, bf16, context
    target("cuda")            # None: not a named GPU (cuda means this machine's own)

`memory` is the total capacity torch reports for the card (torch.cuda.get_device_properties), which is
less than the marketed size; `context` the bytes the CUDA context (kernels, cuBLAS/cuDNN handles) takes
outside the caching allocator, so a step fits when its reserve plus the context is at most `memory`.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    label: str
    memory: int
    capability: tuple[int, int]
    context: int
    """Bytes of the CUDA context (not measured except where `measured` says; bench/gpu_target.py records it)."""
    measured: bool = False
    """True when `memory` is a figure read from such a card (bench/results/gpu_*.json), not a typical one."""

    @property
    def bf16(self) -> bool:
        return self.capability >= (8, 0)

    @property
    def attention_backends(self) -> tuple[str, ...]:
        """The fused scaled-dot-product-attention kernels torch has for this card, in torch's priority
        order (cuDNN first on sm90/sm100 since torch 2.8 with cuDNN >= 9.9), then math."""
        order = []
        if self.capability in ((9, 0), (10, 0)):
            order.append("cudnn")
        if (8, 0) <= self.capability <= (12, 1):
            order.append("flash")
        if self.capability >= (5, 0):
            order.append("efficient")
        return (*order, "math")

    @property
    def default_precision(self) -> str:
        """What people train in on this card: bf16 weights and activations with fp32 master weights and
        optimizer state; fp16 with a loss scale before bf16 existed (Volta, Turing)."""
        return "bf16-master" if self.bf16 else "16-master"


def _spec(name: str, label: str, gib: float, cap: tuple[int, int], context_mib: int, measured: bool = False,
          exact: int | None = None) -> GpuSpec:
    return GpuSpec(name, label, exact or int(gib * GiB), cap, context_mib * MiB, measured)


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    _spec("h100", "NVIDIA H100 80GB HBM3", 0, (9, 0), 520, measured=True, exact=85_017_493_504),
    _spec("h200", "NVIDIA H200 141GB HBM3e", 139.8, (9, 0), 520),
    _spec("a100-80gb", "NVIDIA A100 80GB", 79.15, (8, 0), 430),
    _spec("a100-40gb", "NVIDIA A100 40GB", 39.39, (8, 0), 430),
    _spec("l40s", "NVIDIA L40S 48GB", 44.39, (8, 9), 400),
    _spec("rtx4090", "NVIDIA GeForce RTX 4090 24GB", 23.65, (8, 9), 400),
    _spec("v100-32gb", "NVIDIA V100 32GB", 31.74, (7, 0), 350),
    _spec("t4", "NVIDIA T4 16GB", 14.58, (7, 5), 300),
)}
ALIASES = {"h100-80gb": "h100", "h100-sxm": "h100", "h200-141gb": "h200", "a100": "a100-80gb",
           "rtx-4090": "rtx4090", "4090": "rtx4090", "v100": "v100-32gb"}
NAMES = ", ".join(GPUS)


def target(name: object) -> GpuSpec | None:
    """The named GPU (case-insensitive, a few aliases), or None when `name` names no GPU in the table."""
    if isinstance(name, GpuSpec):
        return name
    if not isinstance(name, str):
        return None
    key = name.strip().lower().replace("_", "-")
    return GPUS.get(ALIASES.get(key, key))


def local_gpu(index: int | None = None) -> GpuSpec:
    """This machine's CUDA GPU as a target (its name, capacity and capability as torch reports them)."""
    import torch

    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    cap = (props.major, props.minor)
    known = next((g for g in GPUS.values() if g.capability == cap and abs(g.memory - props.total_memory) < 2 * GiB), None)
    return GpuSpec("cuda", props.name, props.total_memory, cap, known.context if known else 512 * MiB, measured=True)
