"""kill -9 of a random rank at a random moment, under every strategy and optimizer offload; the job
restarts (torchrun's --max-restarts through `memfit train --nproc 2`), resumes from its last
checkpoint and must end bitwise equal to the uninterrupted run: weights, optimizer state and step
counter (read whole from any layout, memfit.train.portable), data sampler and every logged loss.

    .venv/bin/python bench/chaos.py --trials 1            # every strategy x offload, 1 trial each
    .venv/bin/python bench/chaos.py --trials 10 --only zero2:disk

The moment: a random rank SIGKILLs itself at a random call (drawn within an uninterrupted run's
count) of a step's backward, a save's fsync or a torch.distributed collective (bench/chaos_inject),
or the driver kills a random rank after a random delay. Writes bench/results/chaos.json; render()
makes the table pasted into docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16"
STEPS, SAVE_EVERY = 6, 2
PHASES = ("step", "save", "collective", "time")
# Disk offload first (the newest checkpoint path), then the rest: a bench stopped early has covered it.
COMBOS = [(s, o) for o in ("disk", "none", "cpu") for s in ("zero1", "zero2", "zero3", "pipeline", "tensor")] \
    + [("ddp", "none"), ("ps", "none")]


def command(out: Path, strategy: str, offload: str, restarts: int) -> list[str]:
    argv = [sys.executable, "-m", "memfit", "train", "--model", TINY, "--seq", "16", "--batch", "2", "--warmup", "1",
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--eval-every", "0", "--eval-batches", "1",
            "--no-track", "--quiet", "--device", "cpu", "--strategy", strategy, "--nproc", "2", "--out", str(out),
            "--spill-dir", str(out.parent / f"{out.name}-spill")]
    if offload != "none":
        argv += ["--offload-optimizer", offload]
    return argv + (["--max-restarts", str(restarts)] if restarts else [])


def environment(chaos: str | None) -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE / "chaos_inject")])}
    if chaos:
        env["MEMFIT_CHAOS"] = chaos
    return env


def ranks_of(pid: int) -> list[int]:
    """The launcher's worker processes (spawned by multiprocessing), found through /proc."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            todo += kids
            found += [k for k in kids if b"spawn_main" in _cmdline(k)]
    return sorted(found)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def reference(work: Path, strategy: str, offload: str) -> dict:
    """The uninterrupted run, with each rank's count of calls per phase."""
    out, counts = work / f"ref-{strategy}-{offload}", work / f"counts-{strategy}-{offload}"
    t0 = time.perf_counter()
    done = subprocess.run(command(out, strategy, offload, 0), env=environment(f"count:{counts}"),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"reference {strategy}/{offload} failed: {done.stderr.strip().splitlines()[-1:]}")
    calls = {r: json.loads(Path(f"{counts}.{r}").read_text()) for r in (0, 1)}
    return {"out": out, "seconds": time.perf_counter() - t0, "calls": calls}


def trial(work: Path, ref: dict, strategy: str, offload: str, rng: random.Random, n: int,
          phase: str | None = None) -> dict:
    """One killed run, restarted; its outcome against the reference (`phase`: drawn when None)."""
    out = work / f"trial-{strategy}-{offload}-{n}"
    rank, phase = rng.randrange(2), phase or rng.choice(PHASES)
    record: dict = {"strategy": strategy, "offload": offload, "rank": rank, "phase": phase}
    if phase == "time":
        record["after_s"] = round(rng.uniform(0.3, 0.9) * ref["seconds"], 2)
        chaos = None
    else:
        record["call"] = rng.randint(1, max(1, ref["calls"][rank][phase]))
        chaos = f"{rank}:{phase}:{record['call']}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(command(out, strategy, offload, 1), env=environment(chaos), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if phase == "time":
        record["killed"] = _kill_later(proc, rank, record["after_s"])
    _, err = proc.communicate(timeout=900)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    restarted = [ln for ln in err.splitlines() if "memfit train: restart 1: resuming from step" in ln]
    record["resumed_from"] = int(restarted[0].split("step ")[1].split()[0]) if restarted else None
    if phase != "time":  # the n-th call is drawn within the calls an uninterrupted run makes: it comes
        record["killed"] = True
    if proc.returncode != 0:
        record.update(outcome="failed", rc=proc.returncode, said=(err.strip().splitlines() or [""])[-1][:300])
        return record
    record["outcome"] = "bitwise" if same_state(ref["out"], out) else "differs"
    return record


def _kill_later(proc: subprocess.Popen, rank: int, after: float) -> bool:
    deadline = time.monotonic() + after
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    ranks = ranks_of(proc.pid)
    if proc.poll() is not None or len(ranks) < 2:
        return False
    os.kill(ranks[rank], signal.SIGKILL)
    return True


def same_state(a: Path, b: Path) -> bool:
    """Bitwise: weights, optimizer state and step counter (whole, any layout), sampler, losses."""
    import torch

    from memfit.train import distributed as dist_train
    from memfit.train.portable import kind, read_portable

    ca, cb = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (a, b))
    if ca["step"] != cb["step"] or ca["history"]["steps"]["loss"] != cb["history"]["steps"]["loss"]:
        return False
    if not torch.equal(ca["sampler"]["generator"], cb["sampler"]["generator"]):
        return False
    if ca["model"].keys() != cb["model"].keys() or not all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"]):
        return False
    sharded = kind(ca["config"]["strategy"]) != "pt"
    pa, pb = (read_portable(c, dist_train.checkpoint_folder(d, c) if sharded else None)
              for c, d in ((ca, a), (cb, b)))
    if not torch.equal(pa.step, pb.step) or pa.optim.keys() != pb.optim.keys():
        return False
    return all(pa.optim[n].keys() == pb.optim[n].keys() and all(torch.equal(v, pb.optim[n][k])
                                                                  for k, v in pa.optim[n].items()) for n in pa.optim)


def run(combos: list[tuple[str, str]], trials: int, seed: int, work: Path, log=print, each=None,
        phase: str | None = None) -> list[dict]:
    """`trials` per combination; `each(records)` after every trial (the bench saves as it goes)."""
    rng = random.Random(seed)
    records = []
    for strategy, offload in combos:
        try:
            ref = reference(work, strategy, offload)
        except RuntimeError as exc:  # recorded, and the other combinations still run
            records.append({"strategy": strategy, "offload": offload, "phase": "none", "seed": seed,
                            "outcome": "reference failed", "said": str(exc)[:300]})
            log(json.dumps(records[-1]))
            continue
        for n in range(trials):
            rec = {**trial(work, ref, strategy, offload, rng, n, phase), "seed": seed}
            log(json.dumps(rec))
            records.append(rec)
            if each is not None:
                each(records)
        shutil.rmtree(ref["out"], ignore_errors=True)
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", action="append", help="strategy:offload (repeatable; default: every combination)")
    p.add_argument("--phase", choices=PHASES, help="kill in this phase only (default: drawn per trial)")
    p.add_argument("--resume", action="store_true", help="keep bench/results/chaos.json's trials (and, without "
                   "--phase or --more, skip their combinations)")
    p.add_argument("--more", action="store_true", help="with --resume: add trials to every combination, done or not")
    args = p.parse_args()
    combos = [tuple(c.split(":")) for c in args.only] if args.only else COMBOS
    sys.path[:0] = [str(ROOT / "src"), str(HERE)]
    from common import RESULTS, save

    earlier = json.loads((RESULTS / "chaos.json").read_text()) if args.resume else {"trials": []}
    kept = earlier["trials"]
    commands = earlier.get("commands", [f"--trials {earlier.get('trials_per_combination')} --seed "
                                         f"{earlier.get('seed')}"] if kept else []) + [" ".join(sys.argv[1:])]
    if args.phase is None and not args.more:
        combos = [c for c in combos if not any((t["strategy"], t["offload"]) == c for t in kept)]

    def write(records: list[dict]) -> Path:  # after every trial: a stopped bench keeps what it did
        return save("chaos", {"script": "chaos", "steps": STEPS, "save_every": SAVE_EVERY, "model": TINY,
                              "trials_per_combination": args.trials, "seed": args.seed, "commands": commands,
                              "trials": kept + records})

    with tempfile.TemporaryDirectory(prefix="memfit-chaos-") as tmp:
        records = run(combos, args.trials, args.seed, Path(tmp), log=lambda s: print(s, flush=True), each=write,
                      phase=args.phase)
    print(f"wrote {write(records)}")


def _summary(result: dict) -> dict:
    rows: dict = {}
    for r in result["trials"]:
        row = rows.setdefault((r["strategy"], r["offload"]), {"n": 0, "bitwise": 0, "phases": {}, "other": [],
                                                              "resumed": []})
        row["n"] += 1
        row["resumed"].append("start" if r.get("resumed_from") is None else str(r["resumed_from"]))
        row["bitwise"] += r["outcome"] == "bitwise"
        row["phases"][r["phase"]] = row["phases"].get(r["phase"], 0) + 1
        if r["outcome"] != "bitwise":
            row["other"].append(f"{r['outcome']} ({r.get('said', '')})")
    return rows


def _spread(xs: list[float]) -> str:
    """'median M (min A, max B)' of a list of seconds."""
    import statistics

    return f"median {statistics.median(xs):.0f} (min {min(xs):.0f}, max {max(xs):.0f})" if xs else "-"


def snippets(result: dict) -> dict[str, str]:
    from render import machine_line

    rows = _summary(result)
    total = sum(r["n"] for r in rows.values())
    good = sum(r["bitwise"] for r in rows.values())
    killed = sum(bool(t.get("killed")) for t in result["trials"])
    runs = result.get("commands") or [f"--trials {result['trials_per_combination']}"]
    lines = [", then ".join(f"`.venv/bin/python bench/chaos.py {c}`" for c in runs) + " "
             f"({result['steps']} steps, a save every {result['save_every']}, 2 processes, `{result['model']}`); "
             + machine_line(result), "",
             f"{good} of {total} trials ended bitwise equal to the uninterrupted run; in {killed} a rank was killed "
             "before the run ended (a timed kill can come after the last step). Load average of the last command "
             f"{result['run']['load_start'][0]} at the start and {result['run']['load_end'][0]} at the end "
             f"(other jobs shared the 2 cores); the killed runs took "
             f"{sum(t.get('seconds', 0) for t in result['trials']) / 60:.0f} minutes in all, one killed run with its "
             f"restart {_spread([t['seconds'] for t in result['trials'] if 'seconds' in t])} s.", "",
             "| strategy | optimizer offload | trials | bitwise | killed during (trials) | restarted from step | "
             "other outcomes |", "|---|---|---:|---:|---|---|---|"]
    for (strategy, offload), r in rows.items():
        phases = ", ".join(f"{k} {v}" for k, v in sorted(r["phases"].items()))
        lines.append(f"| {strategy} | {offload} | {r['n']} | {r['bitwise']} | {phases} | {', '.join(r['resumed'])} | "
                     f"{'; '.join(r['other']) or '-'} |")
    return {"chaos": "\n".join(lines)}


def render(result: dict) -> str:
    return "## chaos: kill -9 of a random rank, restarted, bitwise\n\n" + snippets(result)["chaos"] + "\n"


if __name__ == "__main__":
    main()
