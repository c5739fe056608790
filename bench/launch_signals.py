"""A check, not a timing: SIGTERM to `memfit train --nproc 2` (ddp) at a random moment after training
began, `--runs` times in a row. Each run must exit 143 with no traceback, a summary that names SIGTERM,
a checkpoint and no temporary files left; then `--resume RUN --steps <saved + 1>` must exit 0 at that
step. Exits 1 at the first run that does not; prints one JSON line per run.

    .venv/bin/python bench/launch_signals.py --runs 20
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


def one(tmp: Path, rng: random.Random) -> dict:
    import torch

    (tmp / "tmp").mkdir()
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin",
           "TMPDIR": str(tmp / "tmp")}
    run = tmp / "run"
    cmd = [sys.executable, "-m", "memfit", "train", "--model", MODEL, "--seq", "32", "--batch", "2", "--steps",
           "100000", "--eval-every", "0", "--eval-batches", "1", "--save-every", "0", "--no-track", "--device", "cpu",
           "--strategy", "ddp", "--nproc", "2", "--out", str(run)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    while True:  # until rank 0's first progress line: the ranks are in their step loop
        line = proc.stdout.readline()
        seen.append(line)
        if line.startswith("step ") or (not line and proc.poll() is not None):
            break
    delay = rng.uniform(0, 3)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    said = "".join(seen) + proc.communicate(timeout=600)[0]
    rec = {"rc": proc.returncode, "delay_s": round(delay, 2), "stop_s": round(time.perf_counter() - t0, 1)}
    ok = (proc.returncode == 143 and "Traceback" not in said and "(SIGTERM)" in said
          and (run / "checkpoint.pt").exists() and os.listdir(tmp / "tmp") == [])
    if ok:
        rec["saved_step"] = saved = torch.load(run / "checkpoint.pt", weights_only=False)["step"]
        again = subprocess.run([sys.executable, "-m", "memfit", "train", "--resume", str(run), "--nproc", "2",
                                "--steps", str(saved + 1)], env=env, capture_output=True, text=True, timeout=600)
        rec["resume_rc"] = again.returncode
        ok = again.returncode == 0 and torch.load(run / "checkpoint.pt", weights_only=False)["step"] == saved + 1
    rec["ok"] = ok
    if not ok:
        rec["said"] = said[-3000:]
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    print(json.dumps({"load_start": os.getloadavg()}), flush=True)
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="memfit-signals-") as tmp:
            rec = {"run": i, **one(Path(tmp), rng)}
        print(json.dumps(rec), flush=True)
        if not rec["ok"]:
            return 1
    print(json.dumps({"runs": args.runs, "all_ok": True, "load_end": os.getloadavg()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
