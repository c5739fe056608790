"""The planner's answer times of issue 33 (finding 6), each in fresh processes: CPU seconds (user + system
of the child, what a loaded 2-core machine does not inflate) and wall seconds, cold (an empty
MEMFIT_CACHE_DIR: every trace made again) and warm (the same folder again).

    PYTHONPATH=src python bench/planner_speed.py --targets [--rounds 2]   # bench/results/planner_targets.json

Targets (CPU seconds): `memfit plan gpt2 --budget 6GiB --batch 8 --seq 1024` cold <= 20; a few-MiB Hugging
Face model through `fit_trainer` <= 10; llama-3-8b on one GPU (80 GB, batch 8 x 4096, bf16-master,
optimizer offload allowed: memfit.fit(device="cuda"), traced on this CPU) <= 60; `memfit plan llama-2-70b
--budget 80GiB --gpus auto` and the 405B-class model <= 30. Runs interleaved in shuffled rounds.

The fit_trainer target applies to the call (CALL_TARGETS): the process's own CPU seconds around
`fit_trainer(trainer, "24MiB")`, what memfit adds to a run whose Trainer the user has built already
(importing transformers' Trainer, which imports torchao, datasets and accelerate, and building it are
the user's cost either way). The whole process is measured beside it. `--only NAME` reruns the named
targets and replaces their rows in the saved JSON, each such row recording its own date and load.
"""
from __future__ import annotations

import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LLAMA_405B = "llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,seq=8192"
CALL_TARGETS = ("HF model via fit_trainer", "HF model via fit_trainer, shortcuts off")
SHORTCUTS_OFF = ("MEMFIT_TRACKED_WARMUP", "MEMFIT_WARMUP_UPDATE", "MEMFIT_TRACKED_DETACH", "MEMFIT_WALK_UPDATE")
"""The switches that turn the tracing shortcuts off (tests/test_plan_speed_shortcuts.py: the same plans)."""
"""Targets whose CPU seconds are the memfit call's within the process (printed by `one` after CALL_MARK)."""
CALL_MARK = "memfit call CPU s: "
TIMEOUT_S = 1800
"""Wall seconds a run may take (a loaded machine stretches wall time far beyond CPU time)."""
ALLOW_8B = "recompute,selective,offload-cpu,offload-disk,accumulate,chunked-head,optimizer-offload"
TARGETS = {  # name: (argv after python, CPU-second target)
    "gpt2 plan (README)": (["-m", "memfit", "plan", "gpt2", "--budget", "6GiB", "--batch", "8", "--seq", "1024"], 20),
    "HF model via fit_trainer": ([str(HERE / "planner_speed.py"), "--one", "hf_trainer"], 10),
    # the same with the tracing shortcuts of issue 33 turned off (SHORTCUTS_OFF): a reference, no target
    "HF model via fit_trainer, shortcuts off": ([str(HERE / "planner_speed.py"), "--one", "hf_trainer_off"], None),
    "llama-3-8b, one GPU, optimizer offload": ([str(HERE / "planner_speed.py"), "--one", "llama8b"], 60),
    "llama-2-70b --gpus auto": (["-m", "memfit", "plan", "llama-2-70b", "--budget", "80GiB", "--gpus", "auto"], 30),
    # (fp32 405B fits no count up to 256 devices at seq 4096; bf16-master as bench/cluster_paper.py plans it)
    "405B-class --gpus auto": (["-m", "memfit", "plan", LLAMA_405B, "--budget", "80GiB", "--gpus", "auto", "--precision",
                                "bf16-master"], 30),
}


def one(which: str) -> None:
    """In this process: the API targets (fit_trainer on a tiny HF model; the 8B one-GPU plan)."""
    if which == "hf_trainer_off":
        os.environ.update({k: "1" for k in SHORTCUTS_OFF})  # (read when memfit is imported)
    import memfit

    if which == "llama8b":
        plan = memfit.fit("llama-3-8b", budget="80GB", batch=8, seq=4096, precision="bf16-master", device="cuda",
                          allow=ALLOW_8B)
        print(plan.summary())
        return
    import torch
    import transformers

    from memfit.integrations.hf import fit_trainer

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=4096, n_positions=128, bos_token_id=0,
                                 eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)  # 0.37M parameters, 1.4 MiB
    ids = torch.randint(0, 4096, (32, 128))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=1, use_cpu=True, report_to=[],
                                              per_device_train_batch_size=8, disable_tqdm=True, save_strategy="no")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        t0 = time.process_time()  # this process's CPU seconds, all its threads
        plan = fit_trainer(trainer, "24MiB")
        call = time.process_time() - t0
    print(plan.summary())
    print(f"{CALL_MARK}{call:.3f}")


def _run(argv: list[str], cache: str) -> dict:
    """One fresh process: its own CPU seconds (user + system, from /usr/bin/time, so runs may overlap)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MEMFIT_CACHE_DIR": cache, "MEMFIT_PROGRESS": "0"}
    env.pop("MEMFIT_NO_CACHE", None)
    fd, times = tempfile.mkstemp(prefix="memfit-time-")
    os.close(fd)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(["/usr/bin/time", "-f", "%U %S", "-o", times, sys.executable, *argv], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=TIMEOUT_S)
        rc, out = proc.returncode, proc.stdout or proc.stderr
        user, system = (float(x) for x in Path(times).read_text().split()[-2:])
    except subprocess.TimeoutExpired:
        rc, out, user, system = -9, f"timed out after {TIMEOUT_S} s wall", float("nan"), 0.0
    finally:
        os.unlink(times)
    lines = out.strip().splitlines()
    call = [float(x[len(CALL_MARK):]) for x in lines if x.startswith(CALL_MARK)]
    got = {"cpu": user + system, "wall": time.perf_counter() - t0, "rc": rc,
           "tail": [x for x in lines if not x.startswith(CALL_MARK)][-12:]}
    if call:
        got["call_cpu"] = call[-1]
    return got


def _spread(v: list[float]) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}


def targets(rounds: int, only: list[str] | None = None, jobs: int = 1) -> dict:
    """Each target's runs in order (cold, then warm on the same cache folder), `rounds` times: with one job
    round by round, every target once a round in a shuffled order; with `jobs` > 1 that many targets run
    side by side, each its rounds in a row (CPU seconds stay each process's own; wall grows)."""
    from concurrent.futures import ThreadPoolExecutor

    from common import load

    names = [n for n in TARGETS if not only or n in only]
    runs: dict = {n: {"cold": [], "warm": []} for n in names}
    load_before = load()

    def target(n: str, which: range | None = None) -> None:
        for r in which if which is not None else range(rounds):
            cache = tempfile.mkdtemp(prefix="memfit-targets-")
            try:
                for kind in ("cold", "warm"):  # the warm run reads what the cold one stored
                    got = _run(TARGETS[n][0], cache)
                    runs[n][kind].append(got)
                    call = f" (the call: {got['call_cpu']:.1f} s CPU)" if "call_cpu" in got else ""
                    print(f"round {r + 1} {n} {kind}: {got['cpu']:.1f} s CPU{call}, {got['wall']:.1f} s wall, "
                          f"rc {got['rc']}", flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)

    order = names[:]
    random.Random(0).shuffle(order)
    if jobs == 1:
        for r in range(rounds):
            for n in order:
                target(n, range(r, r + 1))
            random.Random(r + 1).shuffle(order)
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(target, order))
    out = {}
    for n in names:
        row = {"command": "python " + " ".join(TARGETS[n][0]).replace(str(ROOT) + "/", ""), "target_cpu_s": TARGETS[n][1],
               "answer": runs[n]["cold"][-1]["tail"], "exit_codes": [g["rc"] for k in runs[n].values() for g in k]}
        for kind in ("cold", "warm"):
            row[f"{kind}_cpu_s"] = _spread([g["cpu"] for g in runs[n][kind]])
            row[f"{kind}_wall_s"] = _spread([g["wall"] for g in runs[n][kind]])
            if n in CALL_TARGETS:
                row[f"{kind}_call_cpu_s"] = _spread([g.get("call_cpu", float("nan")) for g in runs[n][kind]])
        row["target_applies_to"] = "call" if n in CALL_TARGETS else "process"
        measure = row["cold_call_cpu_s" if n in CALL_TARGETS else "cold_cpu_s"]["max"]
        ok = all(c == 0 for c in row["exit_codes"])
        row["met"] = (measure <= TARGETS[n][1] and ok) if TARGETS[n][1] is not None else None
        out[n] = row
    return {"rounds": rounds, "jobs": jobs, "load_before": load_before, "load_after": load(), "targets": out}


def save_targets(got: dict, only: list[str] | None) -> Path:
    """bench/results/planner_targets.json: the whole run, or (`only`) the saved file with those targets'
    rows replaced, each replaced row carrying its own date, load and arguments (`rerun`)."""
    import datetime

    from common import RESULTS, save

    path = RESULTS / "planner_targets.json"
    if not only or not path.exists():
        return save("planner_targets", got)
    d = json.loads(path.read_text())
    for n, row in got["targets"].items():
        row["rerun"] = {"date": datetime.date.today().isoformat(), "argv": sys.argv[1:], "load_before": got["load_before"],
                        "load_after": got["load_after"], "rounds": got["rounds"]}
        d["targets"][n] = row
    d["targets"] = {n: d["targets"][n] for n in [*TARGETS, *d["targets"]] if n in d["targets"]}  # (TARGETS' order)
    path.write_text(json.dumps(d, indent=1, sort_keys=False))
    return path


def table(d: dict) -> str:
    jobs = d.get("jobs", 1)
    side = f", {jobs} targets side by side" if jobs > 1 else ""
    lines = [f"From `PYTHONPATH=src python bench/planner_speed.py --targets --rounds {d['rounds']}"
             + (f" --jobs {jobs}" if jobs > 1 else "") + f"`, run {d['date']} "
             f"({d['rounds']} round(s){side}, fresh processes, median (min-max); {d['machine']['cores']} cores, "
             f"1-minute load {d['load_before'][0]:.1f} before and {d['load_after'][0]:.1f} after: wall seconds are "
             "mostly waiting for a core, CPU seconds are the measure).", "",
             "| target | cold CPU s, process | cold CPU s, the call | warm CPU s, process | cold wall s | target (CPU s) "
             "| met |", "|---|---:|---:|---:|---:|---:|---|"]
    f = lambda s: f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"  # noqa: E731
    notes: list[str] = []
    for n, r in d["targets"].items():
        call = f(r["cold_call_cpu_s"]) if "cold_call_cpu_s" in r else "-"
        applies = "the call" if r.get("target_applies_to") == "call" else "process"
        mark = ""
        if "rerun" in r:
            rr = r["rerun"]
            note = (f"run again on {rr['date']} without the other targets (`python bench/planner_speed.py "
                    + " ".join(f'"{a}"' if " " in a else a for a in rr["argv"]) + f"`, those rows in the same rounds; "
                    f"1-minute load {rr['load_before'][0]:.1f} before and {rr['load_after'][0]:.1f} after).")
            if note not in notes:
                notes.append(note)
            mark = " " + "\\*" * (notes.index(note) + 1)
        target = f"{r['target_cpu_s']} ({applies})" if r["target_cpu_s"] is not None else "- (reference)"
        met = "-" if r["met"] is None else "yes" if r["met"] else "no"
        lines.append(f"| {n}{mark}: `{r['command']}` | {f(r['cold_cpu_s'])} | {call} | {f(r['warm_cpu_s'])} | "
                     f"{f(r['cold_wall_s'])} | {target} | {met} |")
    if notes:
        lines += [""] + ["\\*" * (i + 1) + " " + x for i, x in enumerate(notes)]
    return "\n".join(lines) + "\n"


def snippets(d: dict) -> dict[str, str]:
    return {"planner_targets": table(d)}


def render(d: dict) -> str:
    return "## planner_targets: how long a plan takes to answer\n\n" + table(d)


def main() -> None:
    """`python bench/planner_targets.py --targets ...`: the same run as `bench/planner_speed.py --targets ...`."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", action="store_true", help="(as bench/planner_speed.py takes it)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1, help="targets run side by side")
    ap.add_argument("--only", action="append", choices=list(TARGETS), help="rerun these targets alone (their rows "
                    "replaced in the saved JSON)")
    args = ap.parse_args()
    print(save_targets(targets(args.rounds, args.only, args.jobs), args.only))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
