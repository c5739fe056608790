"""bench/run_all.sh reruns every bench: bench/benches.txt names each bench/*.py (as a run or a
helper) and each bench/results/*.json (with the arguments that made it); a failing bench fails the
run without stopping the others, and GPU benches are skipped with a note where CUDA is absent."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _manifest() -> list[tuple[str, str, str, list[str]]]:
    rows = []
    for line in (BENCH / "benches.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            result, kind, script, *args = line.split()
            rows.append((result, kind, script, args))
    return rows


def test_manifest_names_every_script_and_every_result():
    rows = _manifest()
    scripts = {script for _, _, script, _ in rows}
    assert scripts == {p.name for p in BENCH.glob("*.py")}, "bench/benches.txt must list every bench/*.py"
    assert all(kind in ("cpu", "gpu") for result, kind, _, _ in rows if result != "helper")
    results = [r for r, _, _, _ in rows if r not in ("-", "helper")]
    assert len(results) == len(set(results))
    assert set(results) == {p.stem for p in (BENCH / "results").glob("*.json")}


def test_a_result_named_by_the_script_comes_from_it():
    """A run whose JSON name is not the script's must pass --name (or, for compression_sgd, the
    optimizer that names it), else the rerun would overwrite another result."""
    for result, _, script, args in _manifest():
        if result in ("-", "helper") or result == script[:-3]:
            continue
        assert ("--name" in args and args[args.index("--name") + 1] == result) or \
            (result == "compression_sgd" and args == ["--optimizer", "momentum"]), result


def test_each_result_was_made_with_the_manifest_arguments():
    """run_all.sh reproduces each JSON: where a result records the arguments it was made with
    (bench/common.py's save, since 2026-11-25), bench/benches.txt gives it the same ones."""
    import json

    for result, _, script, args in _manifest():
        path = BENCH / "results" / f"{result}.json"
        if result in ("-", "helper") or not path.exists():
            continue
        recorded = json.loads(path.read_text()).get("run", {}).get("argv")
        if recorded is not None:
            assert recorded == args, f"{result}: made with {recorded}, bench/benches.txt reruns it with {args}"


def _run_all(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    """run_all.sh with a stand-in interpreter that logs each call, fails bench/planner.py and says
    there is no CUDA."""
    log = tmp_path / "calls"
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" = -c ] && exit 1\n[ "$1" = bench/planner.py ] && exit 3\nexit 0\n')
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub)}
    return subprocess.run(["bash", str(BENCH / "run_all.sh"), *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_run_all_runs_every_cpu_bench_skips_gpu_and_fails_only_for_a_failed_bench(tmp_path):
    out = _run_all(tmp_path)
    calls = (tmp_path / "calls").read_text().splitlines()
    cpu = [f"bench/{s} {' '.join(a)}".strip() for r, k, s, a in _manifest() if k == "cpu"]
    gpu = [s for r, k, s, a in _manifest() if k == "gpu"]
    assert [c for c in calls if c.startswith("bench/") and "render.py" not in c] == cpu
    assert calls[-1] == "bench/render.py"            # the docs are regenerated after the failure
    assert all(f"bench/{s} skipped: needs CUDA" in out.stdout for s in gpu)
    assert out.returncode == 1 and "failed: planner" in out.stdout
    assert "planner FAILED" in out.stdout and "train_default done" in out.stdout


def test_list_prints_the_runs_and_runs_nothing(tmp_path):
    out = _run_all(tmp_path, "--list", "compression_long", "gpu_train")
    assert out.returncode == 0 and not (tmp_path / "calls").exists()
    lines = out.stdout.splitlines()
    assert lines[0].startswith("cpu compression_long bench/compression.py --steps 300 --name compression_long")
    assert lines[1:] == ["gpu gpu_train bench/gpu_train.py"]
