"""Contenders of bench/planner.py, all on shared models (one model and optimizer per kind, so a
GPT-2-small run holds two copies of the weights, not one per contender):

- eager checkpoint policies (memfit's plans and the uniform policies), switched in place on one model;
- torch.compile at a tuned `torch._functorch.config.activation_memory_budget`, block by block, on a
  second model that memfit never re-checkpoints;
- PyTorch's SAC ILP (`torch.distributed._tools.sac_ilp`): attempted, and where it stops, the stage and
  the exact error are recorded.

torch.compile runs with the aot_eager backend and the min-cut partitioner. The partitioner is where
`activation_memory_budget` is read (torch/_functorch/partitioners.py, min_cut_rematerialization_partition
-> choose_saved_values_set), at compile time, so each ratio gets its own compile. Inductor would use the
same partition, but its kernels allocate without going through the dispatcher, so memfit's tracker
(a TorchDispatchMode) could not see its peak; aot_eager runs the partitioned graphs op by op.
"""
from __future__ import annotations

import copy
import functools
import random
import statistics
import time
from typing import Any, Callable

import torch

from memfit.core.tracker import MemoryTracker


class PeakTracker(MemoryTracker):
    """memfit's tracker, told to let dynamo compile under it: dynamo skips frames while a dispatch mode
    is active unless the mode ignores compile internals; it is then on for the compiled graphs' ops."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # The step the planner plans (memfit.measure.trace): mean token loss, logits dropped before backward.
    from memfit.measure.trace import _loss

    return _loss(model, x)


class Bench:
    """One model, its AdamW TrainingOptimizer and one batch; step(fn) runs fn(x) -> loss, backward, step."""

    def __init__(self, build: Callable[[], torch.nn.Module], batch: int, seq: int, vocab: int) -> None:
        from memfit.apply.optimizer import TrainingOptimizer

        torch.manual_seed(0)
        self.model = build()
        self.opt = TrainingOptimizer(self.model, "adamw", lr=1e-4)
        self.x = torch.randint(0, vocab, (batch, seq))
        self.eager = lambda x: loss_of(self.model, x)
        self.applied: Any = None

    def step(self, fn: Callable | None = None) -> None:
        with self.opt.autocast():
            loss = (fn or self.eager)(self.x.clone())
        self.opt.backward(loss)
        self.opt.step()

    def policy(self, actions: Any, head_chunks: int | None = None) -> None:
        """Switch the eager model's checkpoint policy and LM head in place (untimed, between contenders)."""
        import memfit
        from memfit.apply.head_swap import chunk_head

        key = (str(actions), head_chunks)
        if key != self.applied:
            memfit.checkpoint(self.model, actions)
            chunk_head(self.model, head_chunks)
            self.applied = key

    def peak(self, fn: Callable | None = None) -> dict:
        """Peak and its categories of one tracked step."""
        with PeakTracker(self.model, self.opt) as t:
            self.step(fn)
        return {"peak": t.peak_bytes, "breakdown": dict(t.breakdown)}


# ---------------------------------------------------------------- timing
def timed_rounds(contenders: dict[str, Callable[[], object]], rounds: int, steps: int,
                 setup: Callable[[str], object], seed: int = 0) -> dict:
    """Each round runs every contender in a freshly shuffled order (random.Random(seed)); a contender runs
    `steps` warm steps in a row after its untimed switch (setup), and the round's figure is their median.
    (Every contender has run at least one untimed step before: its tracked peak step or its compile.)
    Returns the shape of bench/common.py's `interleaved` ("wall"/"cpu": spread of the round figures, whose
    "times" are per round, so common.paired_ratio pairs rounds), plus every step's time under "steps"."""
    from common import MIN_ROUNDS, load, spread

    if rounds < MIN_ROUNDS:
        raise ValueError(f"at least {MIN_ROUNDS} rounds, got {rounds}")
    names, rng, before = list(contenders), random.Random(seed), load()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    raw: dict[str, list[list[float]]] = {n: [] for n in names}
    orders, loads = [], []
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        orders.append(order)
        for name in order:
            setup(name)
            ws, cs = [], []
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                contenders[name]()
                ws.append(time.perf_counter() - t0)
                cs.append(time.process_time() - c0)
            raw[name].append(ws)
            wall[name].append(statistics.median(ws))
            cpu[name].append(statistics.median(cs))
        loads.append(load()[0])
        print(f"    round {r + 1}/{rounds} (load {loads[-1]:.1f}): "
              + ", ".join(f"{n[:14]} {wall[n][-1]:.3f}s" for n in order), flush=True)
    return {"rounds": rounds, "steps": steps, "seed": seed, "orders": orders, "load_before": before,
            "load_each_round": loads,
            "load_after": load(), "wall": {n: spread(wall[n]) for n in names},
            "cpu": {n: spread(cpu[n]) for n in names}, "steps_s": raw}


# ---------------------------------------------------------------- torch.compile
def compiled_blocks(blocks: torch.nn.ModuleList, ratio: float) -> list[Callable]:
    """Each block's forward compiled with aot_eager + the min-cut partitioner at `ratio`.

    Per block, as torchtitan compiles: compiling the whole step as one graph makes the backward graph
    recompute everything it dropped at once, which does not lower the peak at all (measured: ratio 0
    saves almost nothing yet peaks where ratio 1 does)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(*args: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=ratio):
            return min_cut_rematerialization_partition(*args, **kwargs)

    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)
    # dynamo caches compiled frames per code object: a fresh function per ratio keeps each ratio's graphs.
    ns: dict[str, Any] = {}
    name = f"block_at_{int(round(ratio * 1e6))}"
    exec(f"def {name}(block, *args, **kwargs):\n    return type(block).forward(block, *args, **kwargs)\n", ns)  # noqa: S102
    fn = torch.compile(ns[name], backend=backend, dynamic=False)
    return [functools.partial(fn, block) for block in blocks]


class CompileTuner:
    """Bisects activation_memory_budget (the ratio) for the largest ratio whose measured peak fits a budget.
    Every ratio tried is compiled once and cached (per-block compiled forwards, measured peak, compile seconds).
    The bench's second model runs its blocks through the forwards of the ratio in use (`use`)."""

    def __init__(self, bench: Bench, steps: int) -> None:
        from memfit.apply.checkpoint import find_blocks

        self.bench, self.steps = bench, steps
        self.blocks = find_blocks(bench.model)
        self.tried: dict[float, dict] = {}
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    def use(self, ratio: float) -> None:
        for block, fwd in zip(self.blocks, self.at(ratio)["forwards"]):
            block.forward = fwd  # an instance attribute: nn.Module.__call__ runs it

    def at(self, ratio: float) -> dict:
        if ratio not in self.tried:
            self.tried[ratio] = {"forwards": compiled_blocks(self.blocks, ratio)}
            self.use(ratio)
            t0 = time.perf_counter()
            self.bench.step()  # compiles
            compile_s = time.perf_counter() - t0
            self.tried[ratio].update(compile_s=compile_s, **self.bench.peak())
            print(f"    compile ratio {ratio:.4f}: peak {self.tried[ratio]['peak']:,} ({compile_s:.0f} s)", flush=True)
        return self.tried[ratio]

    def tune(self, budget: int) -> float | None:
        """The ratio to run at `budget`, or None when even ratio 0 (recompute all it can) does not fit."""
        if self.at(1.0)["peak"] <= budget:
            return 1.0
        if self.at(0.0)["peak"] > budget:
            return None
        lo, hi = 0.0, 1.0  # lo fits, hi does not
        for _ in range(self.steps):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.at(mid)["peak"] <= budget else (lo, mid)
        return lo

    def summary(self) -> dict:
        return {f"{r:.4f}": {"peak": v["peak"], "compile_s": v["compile_s"]} for r, v in sorted(self.tried.items())}


# ---------------------------------------------------------------- PyTorch's SAC ILP
def sac_ilp_attempt(build: Callable[[], torch.nn.Module], batch: int, seq: int, vocab: int, budget_gib: float) -> dict:
    """Run torch.distributed._tools' pipeline for the SAC ILP (as in PyTorch's own test_sac_ilp.py: MemTracker,
    RuntimeEstimator and SACEstimator under FakeTensorMode, aggregate_stats, sac_milp) on this machine.
    Returns {"ran": True, "decisions": ...} or the stage where it stopped and the exact error."""
    stage = "import"
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
        from torch.distributed._tools.mem_tracker import _ModState, MemTracker
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator
        from torch.distributed._tools.sac_estimator import SACEstimator
        from torch.distributed._tools.sac_ilp import sac_milp

        with FakeTensorMode():
            model = build()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            x = torch.randint(0, vocab, (batch, seq))
            stage = "MemTracker"
            mt = MemTracker()
            mt.track_external(model, opt)
            with mt:
                for i in range(2):  # twice, to create the optimizer state
                    loss_of(model, x).backward()
                    last = mt.get_tracker_snapshot("current") if i == 1 else None
                    opt.step()
                    opt.zero_grad()
                    if i == 0:
                        mt.reset_mod_stats()
            for s in mt.memory_tracking.values():
                s.snapshots.setdefault(_ModState.POST_BW, []).append(copy.deepcopy(last))
            for mode in ("operator-level-cost-model", "operator-level-benchmark"):
                stage = f"RuntimeEstimator({mode!r})"
                try:
                    rt = RuntimeEstimator()
                    with rt(estimate_mode_type=mode):
                        loss_of(model, x).backward()
                        opt.step()
                        opt.zero_grad()
                    break
                except Exception as exc:  # noqa: BLE001  (both modes are tried; the last error is reported)
                    first = f"{type(exc).__name__}: {exc}"
                    if mode == "operator-level-benchmark":
                        raise RuntimeError(f"cost-model mode: {first_err}; benchmark mode: {first}") from None
                    first_err = first
            stage = "SACEstimator"
            se = SACEstimator()
            with se(estimate_mode_type=mode):
                loss = loss_of(model, x)
            loss.backward()
            stage = "aggregate_stats"
            info = aggregate_stats(model, mt, rt, se, torch.device("cpu"))
        stage = "sac_milp"
        decisions, recompute_time, peak = sac_milp(parse_module_info(info), memory_budget=budget_gib)
        return {"ran": True, "decisions": decisions, "recompute_time": recompute_time, "peak_bound": peak,
                "applied": False}
    except Exception as exc:  # noqa: BLE001  (what stops it is the finding)
        return {"ran": False, "stage": stage, "error": f"{type(exc).__name__}: {exc}"[:600]}
