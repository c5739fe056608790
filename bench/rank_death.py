"""How long a rank outlives its peer's kill -9 inside a save, with the launcher's reaper and without it.

    .venv/bin/python bench/rank_death.py --rounds 3

`memfit train --nproc 2 --strategy zero3 --offload-optimizer cpu --max-restarts 1` (bench/chaos.py's
run); rank 0 SIGKILLs itself at the fsync of its last save (bench/chaos_inject), where rank 1 is
blocked in a collective and runs no Python handler. Measured: seconds from the kill until rank 1's
process is gone (polled every 0.1 s from the launcher's process tree), and the whole run's wall time
with its restart. Contenders: the default (memfit.cli.launch_signals.Reaper kills the survivor
REAP_GRACE_S after the crash) and MEMFIT_REAP_GRACE_S=inf (torch-elastic's own SIGTERM, then SIGKILL
after torch.multiprocessing's 30 s). Rounds alternate in a shuffled order; each run must still end
bitwise equal to the uninterrupted one. Writes bench/results/rank_death.json.
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chaos  # noqa: E402
from common import load, save, spread  # noqa: E402

STRATEGY, OFFLOAD = "zero3", "cpu"
CONTENDERS = {"reaper (default)": None, "torch-elastic's grace": "inf"}




def one(work: Path, ref_out: Path, call: int, grace: str | None, n: str) -> dict:
    out = work / f"run-{n}"
    env = chaos.environment(f"0:save:{call}")
    if grace is not None:
        env["MEMFIT_REAP_GRACE_S"] = grace
    t0 = time.perf_counter()
    proc = subprocess.Popen(chaos.command(out, STRATEGY, OFFLOAD, 1), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    first: list[int] = []
    gone: dict[int, float] = {}
    while proc.poll() is None:
        ranks = chaos.ranks_of(proc.pid)
        if not first and len(ranks) == 2:
            first = sorted(ranks)
        now = time.perf_counter() - t0
        for pid in first:
            if pid not in ranks and pid not in gone:
                gone[pid] = now
        time.sleep(0.1)
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or len(gone) != 2:
        raise RuntimeError(f"run {n} ended with {proc.returncode} ({len(gone)} ranks seen): {err[-2000:]}")
    killed, survivor = sorted(gone.values())
    return {"survivor_s": round(survivor - killed, 2), "wall_s": round(wall, 1),
            "bitwise": chaos.same_state(ref_out, out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rank-death-"))
    ref = chaos.reference(work, STRATEGY, OFFLOAD)
    call, ref_out = ref["calls"][0]["save"], ref["out"]  # the kill falls in rank 0's last save
    rng, runs = random.Random(args.seed), {k: [] for k in CONTENDERS}
    load_before = load()
    for r in range(args.rounds):
        order = list(CONTENDERS)
        rng.shuffle(order)
        for name in order:
            runs[name].append(one(work, ref_out, call, CONTENDERS[name], f"{list(CONTENDERS).index(name)}-{r}"))
            print(name, runs[name][-1], file=sys.stderr, flush=True)
    rows = [{"contender": k, "survivor_s": spread([x["survivor_s"] for x in v]),
             "wall_s": spread([x["wall_s"] for x in v]), "bitwise": all(x["bitwise"] for x in v)}
            for k, v in runs.items()]
    save("rank_death", {"strategy": STRATEGY, "offload": OFFLOAD, "kill": f"rank 0, save fsync {call}",
                        "rounds": args.rounds, "seed": args.seed, "load_before": load_before, "load_after": load(),
                        "rows": rows})


def snippets(result: dict) -> dict[str, str]:
    lines = ["| launcher | rank 1 gone after rank 0's kill | whole run with its restart | bitwise |", "|---|---|---|---|"]
    for row in result["rows"]:
        s, w = row["survivor_s"], row["wall_s"]
        lines.append(f"| {row['contender']} | {s['median']:.1f} s ({s['min']:.1f}-{s['max']:.1f}) | "
                     f"{w['median']:.1f} s ({w['min']:.1f}-{w['max']:.1f}) | {'yes' if row['bitwise'] else 'no'} |")
    lines += ["", f"`{result['strategy']}` with optimizer offload `{result['offload']}`, {result['kill']}; "
              f"{result['rounds']} rounds in a shuffled order (seed {result['seed']}), median (min-max); 1-minute "
              f"load average {result['load_before'][0]:.1f} before and {result['load_after'][0]:.1f} after "
              f"({result['machine']['cores']} cores). `python bench/rank_death.py --rounds {result['rounds']}`."]
    return {"rank_death": "\n".join(lines)}


def render(result: dict) -> str:
    return "## rank_death: a rank killed inside a save, and how long its peer outlives it\n\n" + \
        snippets(result)["rank_death"] + "\n"


if __name__ == "__main__":
    main()
