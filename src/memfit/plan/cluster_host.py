"""This machine as the cluster: N ranks on its CPU cores, gloo over 127.0.0.1.

    host = Host(cores=2, threads=1, overhead_s=0.004)
    link = loopback_link()                          # measured: two gloo ranks here, all-reduce timed
    flops, overhead = calibrate("llama:layers=4,hidden=256", seq=64, precision="32-true")

`memfit plan MODEL --gpus N --device cpu` plans for what `memfit train --nproc N` runs here, so its
time model must be this machine's, not a GPU cluster's:

- compute: the rate and a fixed cost per block and micro-batch, from warm steps of the model timed
  as memfit.profile times them (every block kept, at 1, 2, 4 and 8 sequences, on `threads` threads as
  the launcher gives each rank): step(rows) = fixed + FLOPs(rows) / rate, fitted by least squares,
  the fixed part, less the optimizer step (timed alone, once per step in proportion to the
  weights a rank updates), spread over the blocks. A CPU runs small
  matmuls and many small ops far below its rate, which the FLOP model alone misses (a pipeline's
  smaller micro-batches, tensor parallelism's narrower ones).
- the link: gloo's all-reduce between two ranks on this machine, timed at 4 bytes (latency) and
  4 MiB (bandwidth), as the ring formulas of memfit.plan.cluster_links count them; and what a
  column- then row-parallel pair of linears costs under DTensor beyond its FLOPs and the link's
  latency (two pairs a block under tensor parallelism: DTensor's dispatch on a CPU is milliseconds),
  and what AdamW's step costs per DTensor parameter beyond a plain one's.
- cores: N ranks of `threads` threads share `cores` cores. The step can be no shorter than every
  rank's busy time over the cores it shares (memfit.plan.cluster_time adds the difference as the
  "cores" term): on enough cores that is zero; on fewer, pipeline stages do not overlap.

Both measurements are cached on disk (memfit.core.cache, kind `host`; MEMFIT_NO_CACHE=1 measures again).
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from memfit.core import cache
from memfit.plan.cluster_link import Link

CALIBRATE_ROWS = (1, 2, 4, 8)
PROFILE_ROUNDS = 5
MAX_CALIBRATE_PARAMS = 200_000_000
"""Models above this are not built for a calibration run (the FLOP model's CPU rate is used)."""
_VERSION = 7
_MEMO: dict[str, object] = {}


@dataclass(frozen=True)
class Host:
    cores: int
    threads: int = 1
    """Threads per rank (memfit's launcher and torchrun: 1 unless OMP_NUM_THREADS says otherwise)."""
    overhead_s: float = 0.0
    """Fixed seconds per block and micro-batch, forward and backward (measured; 0 on a GPU model)."""
    tp_pair_s: float = 0.0
    """Fixed seconds of a column- then row-parallel pair of linears (DTensor's dispatch, beside the
    FLOPs and the link's latency), forward and backward: two in each block under tensor parallelism."""
    tp_param_step_s: float = 0.0
    """The optimizer step's extra seconds per DTensor parameter (four a block under tensor parallelism)."""
    step_s_per_elem: float = 0.0
    """Seconds of the optimizer step per weight element the rank updates (once per step)."""
    measured: bool = False
    """Whether the rate and fixed costs were measured here (else the FLOP model's rate, no fixed costs)."""


def host_of(cores: int | None = None, threads: int | None = None, overhead_s: float = 0.0,
            tp_pair_s: float = 0.0, measured: bool = False, step_s_per_elem: float = 0.0,
            tp_param_step_s: float = 0.0) -> Host:
    """This machine: `cores` (default: the CPUs this process may run on), `threads` per rank
    (default: OMP_NUM_THREADS, else 1 as the launcher sets)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads is None:
        threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
    return Host(max(1, cores), max(1, threads), overhead_s, tp_pair_s, tp_param_step_s, step_s_per_elem, measured)


def _cached(name: str, key: dict, measure) -> dict:
    memo = name + repr(sorted(key.items()))
    if memo in _MEMO:
        return _MEMO[memo]
    off = bool(os.environ.get("MEMFIT_NO_CACHE"))
    full = {"v": _VERSION, "what": name, "node": platform.node(), "cpus": os.cpu_count(), **key}
    got = None if off else cache.load(full, "host")
    if got is None:
        got = {"key": full, **measure()}
        if not off:
            try:
                cache.store(full, got, "host")
            except OSError:
                pass  # a read-only cache only costs the measurement next time
    _MEMO[memo] = got
    return got


def _timed(fn, reps: int) -> float:
    """Median seconds of one call over `reps` batches of 5 (a loaded machine's preemptions fall in few)."""
    import statistics
    import time

    import torch.distributed as dist

    for _ in range(3):
        fn()
    dist.barrier()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        out.append((time.perf_counter() - t0) / 5)
    return statistics.median(out)


def _pair_s(rank: int, world: int) -> float:
    """Seconds of a tensor-parallel pair of linears (forward and backward) over a plain one's, at a
    width where the FLOPs are negligible."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    tp = parallelize_module(copy.deepcopy(plain), init_device_mesh("cpu", (world,)),
                            {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(2, 16, 32, requires_grad=True)
    pair = _timed(lambda: tp(x).sum().backward(), 20) - _timed(lambda: plain(x).sum().backward(), 20)
    steps = []
    for m in (tp, plain):  # AdamW over the pair's 4 parameters: DTensors (sharded or replicated) or plain
        opt = torch.optim.AdamW(m.parameters(), lr=0.0)
        steps.append(_timed(opt.step, 12))
    return pair, (steps[0] - steps[1]) / 4


def _probe(rank: int, world: int) -> tuple[float, float, float, float]:
    import torch
    import torch.distributed as dist

    out = []
    for numel, reps in ((1, 40), (1 << 20, 6)):
        x = torch.ones(numel)
        out.append(_timed(lambda: dist.all_reduce(x), reps))
    return (out[0], out[1], *_pair_s(rank, world))


def loopback() -> dict:
    """gloo between two ranks here: latency_s, bytes_per_s and tp_pair_s (Host), measured and cached."""
    def measure() -> dict:
        from memfit.distributed.spawn import run_world

        small, big, pair, param_step = run_world(_probe, 2, timeout_s=60)[0]
        latency = small / 2
        # the pair's two all-reduces (forward and backward, 2 ring steps each) are the link's
        return {"latency_s": latency, "bytes_per_s": (4 << 20) / max(big - 2 * latency, 1e-9),
                "tp_pair_s": max(pair - 4 * latency, 0.0), "tp_param_step_s": max(param_step, 0.0)}

    return _cached("loopback", {}, measure)


def loopback_link() -> Link:
    """gloo between two ranks on 127.0.0.1, measured (an all-reduce of 2 ranks: each sends the
    tensor's bytes in 2 ring steps)."""
    got = loopback()
    return Link(f"gloo loopback, measured {got['bytes_per_s'] / 1e9:.2g} GB/s, {got['latency_s'] * 1e6:.3g} us",
                got["bytes_per_s"], got["latency_s"])


def step_flops(spec, seq: int, rows: int) -> float:
    """FLOPs of one training step of `rows` sequences by the cluster time model's count."""
    from memfit.plan.cluster_unit import states_only

    cfg, u = spec.config, states_only(spec, seq, 1)
    fwd = cfg.layers * (2 * u.block_numel * seq + 2 * seq * seq * cfg.hidden) + 2 * cfg.hidden * cfg.vocab * seq
    return 3 * fwd * rows


def _optimizer_s(spec, seq: int, precision: str, optimizer: str) -> float:
    """Median seconds of one optimizer step over the whole model (gradients set, learning rate 0)."""
    import statistics
    import time

    import torch

    from memfit.apply.optimizer import TrainingOptimizer

    model = spec.build(seq=seq)
    opt = TrainingOptimizer(model, optimizer, lr=0.0, precision=precision)
    out = []
    for i in range(2 + PROFILE_ROUNDS):
        for p in model.parameters():  # (each step zeroes them)
            p.grad = torch.zeros_like(p)
        t0 = time.perf_counter()
        opt.step()
        if i >= 2:  # two warm-up steps (the optimizer state is made in the first)
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def calibrate(model: str, seq: int, precision: str, optimizer: str = "adamw",
              threads: int = 1) -> tuple[float, float, float] | None:
    """(FLOP/s, fixed seconds per block and micro-batch, optimizer seconds per weight element) on
    `threads` threads: warm steps timed as memfit.profile times them (median of PROFILE_ROUNDS) at
    each of CALIBRATE_ROWS sequences, the line step = fixed + FLOPs / rate fitted through them, and
    the optimizer step timed alone and taken out of the fixed part; None for a model too large to
    build here."""
    from memfit.models.spec import parse_model

    spec = parse_model(model)
    if spec.config is None or _numel(spec, seq) > MAX_CALIBRATE_PARAMS:
        return None

    def measure() -> dict:
        import torch

        from memfit.profile.measure import _median_steps

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t = [_median_steps(spec, {"none": ("none", None)}, r, seq, precision, PROFILE_ROUNDS, optimizer)["none"]
                 for r in CALIBRATE_ROWS]
            step = _optimizer_s(spec, seq, precision, optimizer)
        finally:
            torch.set_num_threads(before)
        return {"rows": list(CALIBRATE_ROWS), "step_s": t, "optimizer_s": step}

    got = _cached("compute", {"model": repr(spec.config), "seq": seq, "precision": precision,
                              "optimizer": optimizer, "threads": threads}, measure)
    f = [step_flops(spec, seq, r) for r in got["rows"]]
    t, numel = got["step_s"], _numel(spec, seq)
    opt = min(got["optimizer_s"], min(t))
    mf, mt = sum(f) / len(f), sum(t) / len(t)  # least squares: t = fixed + f / rate
    slope = sum((x - mf) * (y - mt) for x, y in zip(f, t)) / sum((x - mf) ** 2 for x in f)
    if slope <= 0:  # noise beyond the signal: the rate of the largest run, no fixed part
        return f[-1] / max(t[-1] - opt, 1e-9), 0.0, opt / numel
    return 1 / slope, max(mt - mf * slope - opt, 0.0) / spec.config.layers, opt / numel


def _numel(spec, seq: int) -> int:
    from memfit.plan.cluster_unit import states_only

    u = states_only(spec, seq, 1)
    return u.block_numel * spec.config.layers + u.rest_numel
