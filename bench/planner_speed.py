"""How fast the planner's pieces are: `memfit estimate` on a 70B model, one composed evaluation and one
solve on a 100-block chain.

    .venv/bin/python bench/planner_speed.py            # bench/results/planner_speed.json; then bench/render.py

Contenders run interleaved in shuffled order (bench/common.py), 5 rounds, median and spread, with the
machine's load. The estimate is timed as a fresh process (what a user waits for), traced and with its chain
profile read from the disk cache (memfit.measure.chain_cache), beside the import floor every such
process pays (torch, exiting with the heap frozen as the CLI does) and with torch._dynamo (which
FakeTensorMode imports, so a traced estimate pays it), with CPU seconds and the estimate's own
in-process seconds from its JSON. The chain is a 100-block GPT (hidden 64, batch 8 x seq 128); a
composed evaluation is `ChainProfile.compose` of a 100-entry action list.
"""
from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, save, spread  # noqa: E402

ESTIMATE = ["-m", "memfit", "estimate", "llama-2-70b", "--zero", "3", "--world", "64", "--checkpoint", "full", "--json"]
ROUNDS = 5
# The floors exit as `memfit estimate` does: with the heap frozen, so teardown does not walk it.
FLOOR = "import gc, torch; gc.freeze()"
FLOOR_DYNAMO = "import gc, torch, torch._dynamo; gc.freeze()"
CALLS = 100


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def estimate_cli() -> dict:
    """Wall seconds of fresh processes, and their CPU seconds (less sensitive to a loaded machine): traced
    (MEMFIT_NO_CACHE=1), with the chain profile read from the disk cache, and the import floor."""
    inner: dict[str, list[float]] = {"traced": [], "cached": []}
    cpu: dict[str, list[float]] = {"traced": [], "cached": [], "import floor": [], "import dynamo": []}

    def timed(name: str, argv: list[str], env: dict | None = None) -> str:
        c0 = _child_cpu()
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=True,
                             env={**os.environ, **(env or {})}).stdout
        cpu[name].append(_child_cpu() - c0)
        return out

    def run(name: str, env: dict | None = None):
        return lambda: inner[name].append(json.loads(timed(name, ESTIMATE, env))["trace_seconds"])

    def floor() -> None:
        timed("import floor", ["-c", FLOOR])

    def dynamo() -> None:
        timed("import dynamo", ["-c", FLOOR_DYNAMO])

    timing = interleaved({"estimate, traced": run("traced", {"MEMFIT_NO_CACHE": "1"}),
                          "estimate, cached chain profile": run("cached"),
                          "import torch": floor, "import torch + torch._dynamo": dynamo}, rounds=ROUNDS)
    # The first call of each is the warm-up (it also fills the cache).
    return {"command": "memfit " + " ".join(ESTIMATE[2:]), "timing": timing,
            "in_process_estimate_s": {k: spread(v[1:]) for k, v in inner.items()},
            "process_cpu_s": {k: spread(v[1:]) for k, v in cpu.items()}}


def chain() -> dict:
    from memfit.apply.policy import BlockAction, resolve_policy
    from memfit.measure.blocks import chain_profile, spec_source
    from memfit.models.spec import parse_model
    from memfit.plan.costs import _bases, _cost
    from memfit.plan.solve import solve

    spec = parse_model("gpt:layers=100,hidden=64,heads=4,vocab=256,seq=128")
    bases = _bases(("recompute", "selective", "offload-cpu"))
    t0 = time.perf_counter()
    prof = chain_profile(spec_source(spec, 8, 128), "32-true", "adamw", bases=bases)
    profile_s = time.perf_counter() - t0
    rng = random.Random(0)
    mixed = [rng.choice(bases) for _ in range(100)]
    sqrt = resolve_policy("sqrt", 100)
    keep = prof.peak_of([BlockAction("keep")] * 100)
    full = prof.peak_of([BlockAction("recompute")] * 100)
    budget = full + (keep - full) // 2
    cost = _cost(1e-3, None, prof)
    got: dict = {}

    def many(acts):
        def run() -> None:
            for _ in range(CALLS):
                prof.compose(acts)
        return run

    def solve_half() -> None:
        got["choice"] = solve(prof, budget, bases, cost, max_segment=16)

    timing = interleaved({f"compose x{CALLS} (sqrt)": many(sqrt), f"compose x{CALLS} (mixed actions)": many(mixed),
                          "solve (budget halfway)": solve_half}, rounds=ROUNDS)
    c = got["choice"]
    return {"chain": "gpt:layers=100,hidden=64,heads=4,vocab=256 batch 8 x seq 128, 32-true, adamw",
            "actions": [str(b) for b in bases], "profile_seconds": profile_s, "calls_per_compose_timing": CALLS,
            "timing": timing, "solve": {"budget": budget, "peak": c.peak, "fits": c.peak <= budget}}


def _table(d: dict) -> str:
    """Intro line and table, from bench/results/planner_speed.json."""
    e, c = d["estimate"], d["chain"]
    cpu, inner = e["process_cpu_s"], e["in_process_estimate_s"]
    cw, cc = c["timing"]["wall"], c["timing"]["cpu"]
    n = c["calls_per_compose_timing"]

    def rng(s: dict, scale: float = 1.0, digits: int = 2) -> str:
        return f"{s['median']*scale:.{digits}f} ({s['min']*scale:.{digits}f}-{s['max']*scale:.{digits}f})"

    load = f"{e['timing']['load_before'][0]:.1f} before and {e['timing']['load_after'][0]:.1f} after"
    busy = " The machine was busy with other jobs (load above its core count)." if e["timing"]["load_before"][0] > d["machine"]["cores"] else ""
    return textwrap.dedent(f"""\
    From `python bench/planner_speed.py`, run {d['date']} (5 interleaved rounds, median (min-max);
    {d['machine']['cores']} cores, 1-minute load {load} the estimate rounds; on a busy machine wall
    times are mostly waiting and CPU seconds are the better guide).{busy}

    | what | median (min-max) |
    |---|---|
    | `memfit estimate llama-2-70b --zero 3 --world 64 --checkpoint full`, traced (`MEMFIT_NO_CACHE=1`) | {rng(e['timing']['wall']['estimate, traced'])} s wall, {rng(cpu['traced'])} s CPU, {rng(inner['traced'])} s in process |
    | the same, chain profile from the disk cache | {rng(e['timing']['wall']['estimate, cached chain profile'])} s wall, {rng(cpu['cached'])} s CPU, {rng(inner['cached'])} s in process |
    | `python -c "{FLOOR}"` (the floor of any estimate) | {rng(e['timing']['wall']['import torch'])} s wall, {rng(cpu['import floor'])} s CPU |
    | `python -c "{FLOOR_DYNAMO}"` (the floor of a traced estimate) | {rng(e['timing']['wall']['import torch + torch._dynamo'])} s wall, {rng(cpu['import dynamo'])} s CPU |
    | one composed evaluation, 100 blocks, `sqrt` | {rng(cw[f'compose x{n} (sqrt)'], 1e3 / n)} ms wall, {rng(cc[f'compose x{n} (sqrt)'], 1e3 / n)} ms CPU |
    | one composed evaluation, 100 blocks, random mix of {len(c['actions'])} actions | {rng(cw[f'compose x{n} (mixed actions)'], 1e3 / n)} ms wall, {rng(cc[f'compose x{n} (mixed actions)'], 1e3 / n)} ms CPU |
    | one solve, 100 blocks, {len(c['actions'])} actions + segments up to 16, budget halfway | {rng(cw['solve (budget halfway)'], 1e3, 0)} ms wall, {rng(cc['solve (budget halfway)'], 1e3, 0)} ms CPU |
    """)


def snippets(d: dict) -> dict[str, str]:
    if "targets" in d:  # bench/results/planner_targets.json (--targets)
        from planner_targets import table

        return {"planner_targets": table(d)}
    return {"planner_speed": _table(d)}


def render(d: dict) -> str:
    if "targets" in d:
        from planner_targets import table

        return "## planner_targets: how long a plan takes to answer\n\n" + table(d)
    return "## planner_speed: how fast the planner estimates, composes and solves\n\n" + _table(d)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", action="store_true", help="the answer-time targets (bench/planner_targets.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1, help="--targets: targets run side by side")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--only", action="append", metavar="NAME", help="--targets: rerun this target alone (repeatable); "
                    "its row is replaced in the saved JSON")
    args = ap.parse_args()
    if args.one:
        from planner_targets import one

        one(args.one)
        return
    if args.targets:
        from planner_targets import TARGETS, save_targets, targets

        unknown = [n for n in args.only or () if n not in TARGETS]
        if unknown:
            ap.error(f"--only {unknown[0]!r}: not a target; the targets are {', '.join(map(repr, TARGETS))}")
        print(save_targets(targets(args.rounds, args.only, args.jobs), args.only))
        return
    print("estimate (fresh processes)", flush=True)
    est = estimate_cli()
    print("100-block chain", flush=True)
    ch = chain()
    path = save("planner_speed", {"estimate": est, "chain": ch})
    w = est["timing"]["wall"]
    c, inner = est["process_cpu_s"], est["in_process_estimate_s"]
    for name, key in (("estimate, traced", "traced"), ("estimate, cached chain profile", "cached")):
        print(f"{name}: {w[name]['median']:.2f} s wall, {c[key]['median']:.2f} s CPU, "
              f"{inner[key]['median']:.2f} s in process")
    print(f"import torch: {w['import torch']['median']:.2f} s wall, {c['import floor']['median']:.2f} s CPU")
    print(f"import torch + torch._dynamo: {w['import torch + torch._dynamo']['median']:.2f} s wall, "
          f"{c['import dynamo']['median']:.2f} s CPU")
    for name, s in ch["timing"]["wall"].items():
        scale = 1e3 / CALLS if name.startswith("compose") else 1e3
        print(f"{name}: {s['median'] * scale:.2f} ms" + (" per call" if name.startswith("compose") else ""))
    print(path)


if __name__ == "__main__":
    main()
