"""This machine as the cluster: N ranks on its CPU cores, gloo over 127.0.0.1.

    host = Host(cores=2, threads=1, overhead_s=0.004)
    link = loopback_link()                          # measured: two gloo ranks here, all-reduce timed
    flops, overhead = calibrate("llama:layers=4,hidden=256", seq=64, precision="32-true")

`memfit plan MODEL --gpus N --device cpu` plans for what `memfit train --nproc N` runs here, so its
time model must be this machine's, not a GPU cluster's:

- compute: the rate and a fixed cost per block and micro-batch, from warm forward and backward
  passes of the model (every block kept, at 1, 2, 4 and 8 sequences, on `threads` threads as the
  launcher gives each rank): time(rows) = fixed + FLOPs(rows) / rate, fitted by least squares, the
  fixed part spread over the blocks; and the optimizer step, timed apart within the same steps
  (once per step, in proportion to the weights a rank updates). A CPU runs small matmuls and many
  small ops far below its rate, which the FLOP model alone misses (a pipeline's smaller
  micro-batches, tensor parallelism's narrower ones).
- the link: gloo's all-reduce between two ranks on this machine, timed at 4 bytes (latency) and
  4 MiB (bandwidth), as the ring formulas of memfit.plan.cluster_links count them; and what a
  column- then row-parallel pair of linears costs under DTensor beyond its FLOPs and the link's
  latency (two pairs a block under tensor parallelism: DTensor's dispatch on a CPU is milliseconds),
  and what AdamW's step costs per DTensor parameter beyond a plain one's; and the pipeline
  schedules' fixed cost per micro-batch and stage (memfit.plan.cluster_probe).
- cores: N ranks of `threads` threads share `cores` cores, of which other work on this machine may
  take a part: `core_share`, measured as two ranks' throughput computing at once against one's
  alone (memfit.plan.cluster_probe; the calibration's rate is one rank's alone). The step can be
  no shorter than every rank's busy time over the cores they get (memfit.plan.cluster_time adds the
  difference as the "cores" term): on enough idle cores that is zero; on fewer, pipeline stages do
  not overlap and data-parallel ranks take turns.

Both measurements are cached on disk (memfit.core.cache, kind `host`; MEMFIT_NO_CACHE=1 measures again).
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from memfit.core import cache
from memfit.plan.cluster_link import Link
from memfit.plan.cluster_probe import slope

CALIBRATE_ROWS = (1, 2, 4, 8)
PROFILE_ROUNDS = 5
MAX_CALIBRATE_PARAMS = 200_000_000
"""Models above this are not built for a calibration run (the FLOP model's CPU rate is used)."""
_VERSION = 9
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
    pp_gpipe_s: float = 0.0
    """Fixed seconds per micro-batch and stage of torch's GPipe schedule beside the stage's work and
    the P2P link time (gloo's send and receive, receive buffers, a backward call, Python):
    memfit.plan.cluster_probe. It is what makes many small micro-batches slow on a CPU."""
    pp_1f1b_s: float = 0.0
    """The same for the 1F1B schedule (measured apart: the two schedules wait at different points)."""
    core_share: float = 1.0
    """The share of the cores that ranks computing at once get (measured: 2 ranks together against
    one alone; below 1 where other work here takes the rest), whose rate the calibration measured
    one rank alone: the step is no shorter than the ranks' busy time over cores x core_share."""
    measured: bool = False
    """Whether the rate and fixed costs were measured here (else the FLOP model's rate, no fixed costs)."""

    def microbatch_s(self, schedule: str) -> float:
        """The pipeline schedule's fixed seconds per micro-batch and stage."""
        return self.pp_gpipe_s if schedule == "gpipe" else self.pp_1f1b_s


def host_of(cores: int | None = None, threads: int | None = None, **costs: float) -> Host:
    """This machine: `cores` (default: the CPUs this process may run on), `threads` per rank
    (default: OMP_NUM_THREADS, else 1 as the launcher sets); `costs`: Host's measured fields."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads is None:
        threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
    return Host(max(1, cores), max(1, threads), **costs)


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


def _probe(rank: int, world: int) -> tuple:
    import torch
    import torch.distributed as dist

    from memfit.plan.cluster_probe import schedule_times, sharing_times

    try:  # a session of its own, as memfit's launcher gives each rank: the scheduler shares a busy
        os.setsid()  # machine between sessions, so ranks in one session would get less than train's
    except OSError:
        pass
    out = []
    for numel, reps in ((1, 40), (1 << 20, 6)):
        x = torch.ones(numel)
        out.append(_timed(lambda: dist.all_reduce(x), reps))
    return (out[0], out[1], *_pair_s(rank, world), schedule_times(rank, world), sharing_times(rank, world))


def loopback() -> dict:
    """gloo between two ranks here: latency_s, bytes_per_s, the fixed costs of DTensor (tp_pair_s,
    tp_param_step_s) and of the pipeline schedules (pp_gpipe_s, pp_1f1b_s), and the share of the
    cores the ranks get at once (core_share), as Host names them; measured and cached."""
    def measure() -> dict:
        from memfit.distributed.spawn import run_world
        from memfit.plan.cluster_probe import core_share, microbatch_s

        small, big, pair, param_step, schedules, sharing = run_world(_probe, 2, timeout_s=120)[0]
        latency = small / 2
        pp = microbatch_s(schedules, latency)
        # the pair's two all-reduces (forward and backward, 2 ring steps each) are the link's
        return {"latency_s": latency, "bytes_per_s": (4 << 20) / max(big - 2 * latency, 1e-9),
                "tp_pair_s": max(pair - 4 * latency, 0.0), "tp_param_step_s": max(param_step, 0.0),
                "pp_gpipe_s": pp["gpipe"], "pp_1f1b_s": pp["1f1b"], "pp_times_s": schedules,
                "core_share": core_share(sharing, 2, host_of().cores), "sharing_s": sharing}

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


def _timed_steps(spec, seq: int, precision: str, optimizer: str) -> tuple[list[float], float]:
    """(median seconds of forward and backward at each of CALIBRATE_ROWS sequences, median seconds
    of the optimizer step): every round runs each size once, its forward and backward timed, then
    the step on the gradients it made (learning rate 0), timed apart. Timing the step inside the
    steps it belongs to matters: alone, on gradients set by hand, it ran longer here, and taken
    out of a fitted intercept that included it, it wiped out the fixed cost per block."""
    import statistics
    import time

    import torch

    from memfit.apply.optimizer import TrainingOptimizer
    from memfit.measure.trace import _loss

    torch.manual_seed(0)
    model = spec.build(seq=seq)
    opt = TrainingOptimizer(model, optimizer, lr=0.0, precision=precision)
    xs = [torch.randint(0, spec.config.vocab, (r, seq)) for r in CALIBRATE_ROWS]
    fb: list[list[float]] = [[] for _ in xs]
    steps = []
    for i in range(2 + PROFILE_ROUNDS):  # two warm-up rounds (the optimizer state is made in the first)
        for k, x in enumerate(xs):
            t0 = time.perf_counter()
            with opt.autocast():
                loss = _loss(model, x)
            opt.backward(loss)
            t1 = time.perf_counter()
            opt.step()
            if i >= 2:
                fb[k].append(t1 - t0)
                steps.append(time.perf_counter() - t1)
    return [statistics.median(t) for t in fb], statistics.median(steps)


def calibrate(model: str, seq: int, precision: str, optimizer: str = "adamw",
              threads: int = 1) -> tuple[float, float, float] | None:
    """(FLOP/s, fixed seconds per block and micro-batch, optimizer seconds per weight element) on
    `threads` threads: warm forward and backward passes timed (median of PROFILE_ROUNDS) at each of
    CALIBRATE_ROWS sequences, the line time = fixed + FLOPs / rate fitted through them, and the
    optimizer step timed apart in the same steps; None for a model too large to build here."""
    from memfit.models.spec import parse_model

    spec = parse_model(model)
    if spec.config is None or _numel(spec, seq) > MAX_CALIBRATE_PARAMS:
        return None

    def measure() -> dict:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t, step = _timed_steps(spec, seq, precision, optimizer)
        finally:
            torch.set_num_threads(before)
        return {"rows": list(CALIBRATE_ROWS), "fwd_bwd_s": t, "optimizer_s": step}

    got = _cached("compute", {"model": repr(spec.config), "seq": seq, "precision": precision,
                              "optimizer": optimizer, "threads": threads}, measure)
    f = [step_flops(spec, seq, r) for r in got["rows"]]
    t, numel, opt = got["fwd_bwd_s"], _numel(spec, seq), got["optimizer_s"]
    per_flop = slope(f, t)  # least squares: t = fixed + f / rate
    if per_flop <= 0:  # noise beyond the signal: the rate of the largest run, no fixed part
        return f[-1] / max(t[-1], 1e-9), 0.0, opt / numel
    fixed = sum(t) / len(t) - per_flop * sum(f) / len(f)
    return 1 / per_flop, max(fixed, 0.0) / spec.config.layers, opt / numel


def _numel(spec, seq: int) -> int:
    from memfit.plan.cluster_unit import states_only

    u = states_only(spec, seq, 1)
    return u.block_numel * spec.config.layers + u.rest_numel
