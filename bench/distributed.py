"""Data-parallel strategies side by side on 2 gloo ranks (CPU): memfit ddp/zero1/zero2/zero3 against
torch's ZeroRedundancyOptimizer (+ DDP), FSDP2 (fully_shard, reshard_after_forward True/False) and
DeepSpeed ZeRO 1/2/3 (DS_ACCELERATOR=cpu).

    PYTHONPATH=src python bench/distributed.py [--rounds 5] [--steps 3] [--quick]

DeepSpeed is not a dependency of memfit: `bash bench/setup_deepspeed.sh` builds the bench's own
environment (a venv that sees the main one's torch). When it exists (MEMFIT_DS_VENV, default
/work/dsvenv) this script runs itself under that venv's interpreter; without it the DeepSpeed rows
say "skipped: DeepSpeed not installed".

Same model, seed and global batch for every contender; each round runs them in a shuffled order
(the same on both ranks). Per rank and contender: the allocator's peak over a training step
(profiler ground truth: everything the rank allocated, weights and communication buffers
included), memfit's tracked peak where the tracker can see the contender's storages (memfit's
strategies; FSDP2 frees by resizing storages, which the tracker does not see), RSS growth, step
time, bytes sent per step. Bytes are counted where the collectives are called: memfit's own
counter; for the peers, torch.distributed's Python collectives are wrapped for the run and DDP's
reducer reports through a counting communication hook. On this CPU machine host and device are the
same RAM: the peaks are the rank's allocations, not a device's.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt_bytes, save  # noqa: E402

MODEL = dict(layers=6, hidden=96, heads=4, vocab=256, seq=64)
BATCH = 4  # per rank
CONTENDERS = ["memfit ddp", "memfit zero1", "memfit zero2", "memfit zero3", "ZeroRedundancyOptimizer+DDP",
              "FSDP2 reshard=True", "FSDP2 reshard=False"]
DEEPSPEED = ["DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3"]
DS_VENV = Path(os.environ.get("MEMFIT_DS_VENV", "/work/dsvenv"))


def _deepspeed_ready() -> str | None:
    """None if DeepSpeed imports here, else why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return "skipped: DeepSpeed not installed (bash bench/setup_deepspeed.sh)"
    except Exception as exc:  # noqa: BLE001 - recorded as the reason it could not run
        return f"skipped: DeepSpeed does not import ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    return None


def _reexec_in_deepspeed_venv() -> None:
    """Run this script under the bench's DeepSpeed venv when it exists and this interpreter lacks it."""
    python = DS_VENV / "bin" / "python"
    if os.environ.get("MEMFIT_DS_REEXEC") or not python.exists() or Path(sys.executable) == python:
        return
    try:
        import deepspeed  # noqa: F401
        return
    except Exception:  # noqa: BLE001
        pass
    import site  # the venv sees this interpreter's packages first: its .pth may name a venv since moved

    path = os.pathsep.join(p for p in [*site.getsitepackages(), os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "MEMFIT_DS_REEXEC": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": path}
    os.execve(str(python), [str(python), *sys.argv], env)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeerCounter:
    """Wraps torch.distributed's Python collectives for a peer's run and counts bytes sent (ring costs)."""

    # all_reduce is left alone: DDP's reducer is C++, its bytes come through the counting hook.
    # DeepSpeed calls it from Python: counted for it (ring: 2 M (N-1)/N).
    NAMES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
             "broadcast")

    def __init__(self, all_reduce: bool = False):
        self.names = self.NAMES + (("all_reduce",) if all_reduce else ())

    def __enter__(self):
        import torch.distributed as dist

        from memfit.distributed import comm

        self.saved = {n: getattr(dist, n) for n in self.names}
        n = dist.get_world_size()

        def wrap(name, orig):
            def f(*args, **kw):
                t = args[0] if args else next(iter(kw.values()))  # all_gather_*: the gathered output
                if name.startswith("reduce_scatter"):  # the full input
                    t = args[1] if len(args) > 1 else kw.get("input", kw.get("input_tensor"))
                nbytes = t.numel() * t.element_size()
                if name == "all_reduce":
                    comm.TRAFFIC.add(name, 2 * nbytes * (n - 1) / n)
                elif name == "broadcast":
                    src = args[1] if len(args) > 1 else kw.get("src", 0)
                    if dist.get_rank() == src:
                        comm.TRAFFIC.add(name, nbytes * (n - 1))
                else:
                    comm.TRAFFIC.add(name, nbytes * (n - 1) / n)
                return orig(*args, **kw)
            return f

        for name, orig in self.saved.items():
            setattr(dist, name, wrap(name, orig))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, orig in self.saved.items():
            setattr(dist, name, orig)


def _build(name: str):
    """(model to call, object with backward/step, what the tracker watches or None)."""
    import torch.distributed as dist

    from memfit.distributed import comm, distribute
    from memfit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    if name.startswith("memfit"):
        opt = distribute(model, name.split()[1], "adamw", lr=1e-3, engine="memfit")
        return opt.model, opt, opt
    if name.startswith("ZeroRedundancy"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, gradient_as_bucket_view=True)
        ddp.register_comm_hook(dist.group.WORLD, comm.ddp_counting_hook)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        return ddp, _Plain(opt), None
    if name.startswith("DeepSpeed"):
        import deepspeed

        # Buckets of one block's elements, as memfit's layout has: DeepSpeed's defaults (5e8-element
        # reduce/all-gather buffers, ZeRO-3 keeping every tensor under 1e5 elements unsharded) are
        # sized for billion-parameter models and would measure the defaults, not the technique.
        block = sum(p.numel() for p in model.blocks[0].parameters())
        zero = {"stage": int(name[-1]), "reduce_bucket_size": block, "allgather_bucket_size": block}
        if zero["stage"] == 3:
            zero.update(stage3_prefetch_bucket_size=block, stage3_param_persistence_threshold=0)
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                  "zero_optimization": zero, "zero_allow_untested_optimizer": True}
        engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                               optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        return engine, _Engine(engine), None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard = name.endswith("True")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, _Plain(torch.optim.AdamW(model.parameters(), lr=1e-3)), None


class _Plain:
    def __init__(self, opt):
        self.opt = opt

    def backward(self, loss, final=True):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _Engine:
    """DeepSpeed's engine: its backward (loss scaling, gradient partitioning) and step."""

    def __init__(self, engine):
        self.engine = engine

    def backward(self, loss, final=True):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()


def _contender(name: str, steps: int, rank: int, world: int) -> dict:
    from memfit.core.tracker import track
    from memfit.distributed import comm
    from memfit.measure.allocator import AllocatorProfile

    gc.collect()
    rss0 = _rss()
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, MODEL["vocab"], (BATCH * world, MODEL["seq"] + 1), generator=g) for _ in range(steps)]
    peer = None if name.startswith("memfit") else _PeerCounter(name.startswith("DeepSpeed")).__enter__()
    times, sent, tracked = [], [], None
    try:
        with AllocatorProfile() as prof:
            call, opt, watch = _build(name)
            for s, b in enumerate(batches):
                b = b[rank * BATCH:(rank + 1) * BATCH]
                comm.TRAFFIC.reset()
                tr = track(watch.tracked_module, watch, device="cpu") if watch is not None and s == steps - 1 else None
                if tr is not None:
                    tr.__enter__()
                t0 = time.perf_counter()
                with prof.window(f"step{s}"):
                    _, loss, n = call(b[:, :-1].contiguous(), b[:, 1:].contiguous())
                    opt.backward(loss / (n * world))
                    opt.step()
                times.append(time.perf_counter() - t0)
                if tr is not None:
                    tr.__exit__(None, None, None)
                    tracked = tr.peak_bytes
                sent.append(comm.TRAFFIC.total)
        peak = max(prof.peak(f"step{s}") for s in range(1, steps))
    finally:
        if peer is not None:
            peer.__exit__()
    if hasattr(opt, "close"):
        opt.close()
    return {"peak": peak, "tracked": tracked, "rss_growth": _rss() - rss0, "step_s": statistics.median(times[1:]),
            "bytes_sent": sent[-1]}


def _work(rank: int, world: int, rounds: int, steps: int, contenders: list[str]) -> dict:
    out: dict = {name: [] for name in contenders}
    for r in range(rounds):
        order = contenders[:]
        random.Random(r).shuffle(order)  # the same order on every rank
        for name in order:
            out[name].append(_contender(name, steps, rank, world))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="5 rounds of 2 steps (the first is warm-up)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 5, 2
    _reexec_in_deepspeed_venv()
    from memfit.distributed.spawn import run_world

    skipped = _deepspeed_ready()
    contenders = CONTENDERS + ([] if skipped else DEEPSPEED)
    load0 = os.getloadavg()
    ranks = run_world(_work, 2, args=(args.rounds, args.steps, contenders), timeout_s=3000)
    summary = {}
    for name in contenders:
        summary[name] = []
        for rank, res in enumerate(ranks):
            rows = res[name]
            med = {k: statistics.median([x[k] for x in rows if x[k] is not None]) if any(x[k] is not None for x in rows)
                   else None for k in rows[0]}
            spread = [min(x["step_s"] for x in rows), max(x["step_s"] for x in rows)]
            summary[name].append({"rank": rank, **med, "step_s_range": spread})
    from memfit.models.gpt import GPT, GPTConfig

    n_params = GPT(GPTConfig(**MODEL)).num_params()
    path = save("distributed", {
        "command": "PYTHONPATH=src python bench/distributed.py " + f"--rounds {args.rounds} --steps {args.steps}",
        "deepspeed": None if skipped else __import__("deepspeed").__version__,
        "model": MODEL, "params": n_params, "batch_per_rank": BATCH, "world": 2, "rounds": args.rounds,
        "load_before": load0, "load_after": os.getloadavg(), "cores": os.cpu_count(), "results": summary, "raw": ranks,
        "skipped": {name: skipped for name in DEEPSPEED} if skipped else {},
    })
    print(render(__import__("json").loads(path.read_text())))


def render(result: dict) -> str:
    from render import machine_line  # bench/render.py

    lines = [
        "## Data-parallel strategies, 2 gloo ranks on CPU", "",
        f"`{result['command']}`", "",
        f"GPT {result['model']} ({result['params']:,} parameters), AdamW, fp32, batch {result['batch_per_rank']} "
        f"per rank; {result['rounds']} rounds, contenders shuffled each round; medians over rounds (rank 0; "
        "ranks agree unless marked). Peak: the allocator's (profiler) over a step, everything the rank "
        "allocated; tracked: memfit's tracker (memfit's strategies only). Host = device RAM here. "
        f"Load average before/after: {result['load_before'][0]:.1f} / {result['load_after'][0]:.1f}."
        + (f" DeepSpeed {result['deepspeed']} (DS_ACCELERATOR=cpu, its own venv: bench/setup_deepspeed.sh), "
           "buckets of one block's elements; its bytes are counted at torch.distributed's Python collectives "
           "(all-reduce included), a lower bound where it calls others." if result.get("deepspeed") else ""), "",
    ]
    cores = result.get("cores") or os.cpu_count() or 1
    busy = max(result["load_before"][0], result["load_after"][0]) > cores
    if busy:
        lines += [f"The machine was busy (load average above its {cores} cores, other jobs running): the memory "
                  "and byte figures are what count; the step times are marked busy and are not a speed "
                  "comparison.", ""]
    lines += [
        "| contender | peak per rank | tracked | RSS growth | step time" + (" (busy)" if busy else "")
        + " (range) | bytes sent / step / rank |",
        "|---|---|---|---|---|---|",
    ]
    for name, ranks in result["results"].items():
        r = ranks[0]
        other = ranks[1]
        peak = fmt_bytes(r["peak"]) + ("" if other["peak"] == r["peak"] else f" (rank 1: {fmt_bytes(other['peak'])})")
        tracked = fmt_bytes(r["tracked"]) if r["tracked"] else "-"
        lines.append(f"| {name} | {peak} | {tracked} | {fmt_bytes(r['rss_growth'])} | "
                     f"{r['step_s'] * 1e3:.0f} ms ({r['step_s_range'][0] * 1e3:.0f}-{r['step_s_range'][1] * 1e3:.0f}) | "
                     f"{fmt_bytes(r['bytes_sent'])} |")
    for name, why in result.get("skipped", {}).items():
        lines.append(f"| {name} | {why} | | | | |")
    lines += ["", machine_line(result), ""]
    return "\n".join(lines)


ENGINE_PAIRS = (("zero1", "memfit zero1", "ZeroRedundancyOptimizer+DDP"), ("zero2", "memfit zero2", "FSDP2 reshard=False"),
                ("zero3", "memfit zero3", "FSDP2 reshard=True"))
"""Each ZeRO stage on memfit's flat engine and on the torch engine that carries it out."""


def snippets(result: dict) -> dict[str, str]:
    """docs/design.md's table: memfit's flat engine against torch's, stage by stage (rank 0's medians)."""
    got = result["results"]
    cores = result.get("cores") or os.cpu_count() or 1
    busy = max(result["load_before"][0], result["load_after"][0]) > cores
    lines = [f"`{result['command']}` ({result['date']}; GPT {', '.join(f'{k}={v}' for k, v in result['model'].items())}, "
             f"{result['params']:,} parameters, "
             f"AdamW, fp32, batch {result['batch_per_rank']} per rank, 2 gloo ranks, {result['rounds']} shuffled "
             "rounds; rank 0's medians)" + (": the machine was busy, so the step times are not a speed comparison"
                                             if busy else ""), "",
             "| stage | engine | peak per rank | vs memfit | bytes sent / step / rank | step time (range) |",
             "|---|---|---|---|---|---|"]
    for stage, ours, theirs in ENGINE_PAIRS:
        if ours not in got or theirs not in got:
            continue
        base = got[ours][0]
        for name in (ours, theirs):
            r = got[name][0]
            vs = "" if name == ours else f"{100 * (r['peak'] - base['peak']) / base['peak']:+.1f}%"
            lines.append(f"| {stage} | {name} | {r['peak']:,} B | {vs} | {r['bytes_sent']:,} B | "
                         f"{r['step_s'] * 1e3:.0f} ms ({r['step_s_range'][0] * 1e3:.0f}-{r['step_s_range'][1] * 1e3:.0f}) |")
    return {"engine_choice": "\n".join(lines)}


if __name__ == "__main__":
    main()
