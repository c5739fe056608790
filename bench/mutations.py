"""Named mutations, each a realistic bug, and whether the tests named for it catch it.

    .venv/bin/python bench/mutations.py                  # every mutation: bench/results/mutations.json
    .venv/bin/python bench/mutations.py --rotate 2       # CI: two of them, chosen by the day of the year
    .venv/bin/python bench/mutations.py --only NAME ...  # these (by name); --list prints the names

Each mutation replaces one exact text (found exactly once, else the mutation is reported "stale":
the code moved and the entry needs updating) in one file of a copy of the working tree (the files
git tracks or would track), then runs the named tests in that copy with PYTHONPATH at its src/:
"caught" when they fail, "survived" when they pass. The full run first runs each mutation's tests on
the unmutated copy ("control"): a mutation counts as caught only by tests that pass without it. The
exit status is 1 if any mutation survived, went stale or could not be run. --rotate and --only write
no JSON (the JSON always holds the whole list); render() and snippets() put the table in
docs/BENCHMARKS.md and docs/testing.md.
"""
import argparse
import datetime as _dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import save  # noqa: E402  (imported first: the run's wall time and load start here)


# No `from __future__ import annotations` in this file: bench/render.py loads it without registering it
# as a module, and a dataclass with string annotations looks its module up.
@dataclass(frozen=True)
class Mutation:
    name: str
    area: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    """pytest arguments: files, node ids, or -k with its expression."""
    what: str
    """The bug in words."""
    before: str = ""
    """What passed it before the test that catches it was written or tightened."""


MUTATIONS = [
    Mutation("offload-masters-beside-model", "optimizer offload", "src/memfit/apply/optim_offload.py",
             'store = self.params[0].device if self.where == "device" else torch.device("cpu")',
             "store = self.params[0].device",
             ("tests/test_apply_optim_offload_device.py",),
             '`_make_masters`: masters and state beside the model for every `where` ("cpu" offload keeps them on the device)'),
    Mutation("sharded-step-counter-reset", "sharded checkpoints", "src/memfit/distributed/checkpoint.py",
             '        set_step(slots, state["step"])\n', '        set_step(slots, torch.zeros_like(state["step"]))\n',
             ("tests/test_distributed_checkpoint_resume.py",),
             "`load_sharded`: Adam's step counter set to 0 after the load"),
    Mutation("momentum-0.5", "optimizers (tolerances)", "src/memfit/apply/torch_optim.py",
             'kw.setdefault("momentum", 0.9)', 'kw.setdefault("momentum", 0.5)',
             ("tests/test_apply_optimizers.py::test_every_optimizer_trains_a_step[momentum]",),
             '"momentum" uses momentum 0.5 instead of 0.9', "the old 10%-drop bound"),
    Mutation("powersgd-bytes-doubled", "compression accounting", "src/memfit/distributed/compression/powersgd.py",
             "ps, qs = ps + n * r, qs + m * r", "ps, qs = ps + 2 * n * r, qs + 2 * m * r",
             ("tests/test_distributed_compression_strategies.py", "tests/test_distributed_compression_multiproc.py",
              "-k", "bytes and powersgd"),
             "`torch_powersgd_bytes`: P and Q counted at twice the rank", "the old [1.2, 60] range"),
    Mutation("run-all-stops-at-first-failure", "benchmarks", "bench/run_all.sh",
             '    failed+=("$name")\n', '    failed+=("$name"); break\n',
             ("tests/test_bench_manifest.py::test_run_all_runs_every_cpu_bench_skips_gpu_and_fails_only_for_a_failed_bench",),
             "`bench/run_all.sh`: stop at the first failing bench"),
    Mutation("spill-truncated-read-silent", "activation offload", "src/memfit/apply/disk_spill.py",
             'raise SpillError(f"spill file {path!r} is truncated")', "break",
             ("tests/test_apply_disk_spill.py::test_a_truncated_spill_file_is_a_clear_error_not_short_data",),
             "`DiskSpill.read`: a truncated spill file ends the read silently (short data) instead of raising",
             "no test truncated a spill file"),
    Mutation("spill-read-before-write", "activation offload", "src/memfit/apply/saved_copies.py",
             "        self.write_future.result()\n        return spill.read(", "        return spill.read(",
             ("tests/test_apply_disk_spill.py::test_a_read_waits_for_its_write_to_finish",),
             "`DiskCopy._read`: the read no longer waits for its own write to finish",
             "49 offload tests"),
    Mutation("bf16-master-offload-no-copy-back", "optimizer offload", "src/memfit/apply/optim_offload.py",
             "            if i not in self._shared:\n                self.params[i].data.copy_(m.detach())",
             '            if i not in self._shared and (self.where == "device" or self.params[i].dtype == m.dtype):\n'
             "                self.params[i].data.copy_(m.detach())",
             ("tests/test_apply_optimizers_compose.py::test_offload_is_bit_identical_with_clipping_and_accumulation"
              "[sgd-bf16-master]",
              "tests/test_apply_optimizers_compose.py::test_offload_is_bit_identical_with_clipping_and_accumulation"
              "[adamw-bf16-master]"),
             "bf16-master with CPU or disk offload never copies the master weights back to the model",
             "the compose test's `3*10*LR` tolerance, ten times what three steps move a weight"),
    Mutation("zero3-gathers-one-block-ahead", "per-rank estimate", "src/memfit/distributed/rank_memory.py",
             "sum(sorted(blocks)[-2:])", "sum(sorted(blocks)[-1:])",
             ("tests/test_distributed_rank_grid.py::test_covering_subset_each_rank_within_its_strategy_tolerance",),
             "ZeRO-3's per-rank estimate gathers one block (the running one) instead of two (and the prefetched one)",
             "the per-rank grid's flat 3%"),
    Mutation("chunked-head-fused-restarts-each-chunk", "chunked LM head", "src/memfit/apply/chunked_head.py",
             "        if k0 == 0:\n            torch.mm(g[k0 - r0:k1 - r0].t(), hc[k0:k1], out=dw)",
             "        if k0 == r0:\n            torch.mm(g[k0 - r0:k1 - r0].t(), hc[k0:k1], out=dw)",
             ("tests/test_apply_chunked_head_fused.py",),
             "`_sum_weight_grad`: each token chunk overwrites the weight gradient instead of adding to it",
             "every fused-path test skipped on a CPU whose GEMM has no measured reduction block"),
]


def tree_files(root: Path) -> list[str]:
    """The working tree's files as git sees them (tracked, or untracked and not ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]


def copy_tree(root: Path, dest: Path) -> None:
    for f in tree_files(root):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, dest / f)
    if (root / ".venv").exists():  # tests that run the project's interpreter by its path
        os.symlink((root / ".venv").resolve(), dest / ".venv")


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), PYTHONDONTWRITEBYTECODE="1",
               MEMFIT_CACHE_DIR=str(tree / ".memfit-cache"))  # a mutant's profiles stay in the copy
    cmd = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-n", "0", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = None, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}"
    lines = [ln for ln in out.strip().splitlines() if re.search(r"\b(passed|failed|error|timed out|no tests ran)\b", ln)]
    return {"rc": rc, "summary": lines[-1].strip("= ") if lines else out.strip()[-200:],
            "seconds": round(time.perf_counter() - t0, 1)}


def status_of(rc: int | None) -> str:
    # pytest: 0 all passed, 1 some failed; anything else (usage, no tests collected, timeout) is no verdict
    return {0: "survived", 1: "caught"}.get(rc, "error")


def run_one(m: Mutation, tree: Path, control: bool, timeout: float) -> dict:
    row = {k: v for k, v in asdict(m).items() if k not in ("old", "new")}
    row["tests"] = list(m.tests)
    path = tree / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        return dict(row, status="stale", summary=f"the text to replace occurs {text.count(m.old)} times in {m.file}")
    if control:
        clean = run_tests(tree, m.tests, timeout)
        row["control"] = clean
        if clean["rc"] != 0:
            return dict(row, status="error", summary=f"the named tests fail without the mutation: {clean['summary']}")
    path.write_text(text.replace(m.old, m.new))
    try:
        res = run_tests(tree, m.tests, timeout)
    finally:
        path.write_text(text)
    return dict(row, status=status_of(res["rc"]), **res)


def rotation(n: int, day: int | None = None) -> list[Mutation]:
    """n mutations for today: consecutive ones starting at day-of-year x n, so every mutation comes up
    once every len(MUTATIONS) / n days."""
    day = _dt.date.today().timetuple().tm_yday if day is None else day
    return [MUTATIONS[(day * n + i) % len(MUTATIONS)] for i in range(min(n, len(MUTATIONS)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rotate", type=int, metavar="N", help="run N mutations chosen by the day of the year; no JSON")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations; no JSON")
    ap.add_argument("--list", action="store_true", help="print the mutations' names and tests, run nothing")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:40s} {m.file}  {' '.join(m.tests)}")
        return 0
    chosen = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTATIONS})
        if unknown:
            ap.exit(2, f"mutations.py: error: unknown mutation {unknown[0]!r}; --list names them\n")
        chosen = [m for m in MUTATIONS if m.name in args.only]
    elif args.rotate:
        chosen = rotation(args.rotate)
    full = chosen is MUTATIONS
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still removes its copy
    rows = []
    with tempfile.TemporaryDirectory(prefix="memfit-mutate-") as tmp:
        tree = Path(tmp)
        copy_tree(ROOT, tree)
        for m in chosen:
            row = run_one(m, tree, control=full, timeout=args.timeout)
            rows.append(row)
            print(f"{row['status']:9s} {m.name}: {row['summary']} ({row.get('seconds', 0):.0f} s)", flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("caught", "survived", "stale", "error")}
    print(json.dumps(counts))
    if full:
        print(f"wrote {save('mutations', {'mutations': rows, 'counts': counts}).relative_to(ROOT)}")
    return 0 if counts["caught"] == len(rows) else 1


def table(result: dict) -> str:
    lines = ["| # | area | mutation | caught by | result | passed it before |", "| --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(result["mutations"], 1):
        args = r["tests"]
        k = args.index("-k") if "-k" in args else len(args)
        tests = ", ".join(args[:k]) + (f" (`-k '{' '.join(args[k + 1:])}'`)" if k < len(args) else "")
        lines.append(f"| {i} | {r['area']} | `{r['name']}`: {r['what']} (`{r['file']}`) | {tests} | "
                     f"{r['status']} ({r['summary']}) | {r.get('before') or '—'} |")
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    c = result["counts"]
    return (f"{c['caught']} of {len(result['mutations'])} mutations caught ({c['survived']} survived, {c['stale']} stale, "
            f"{c['error']} not run); `.venv/bin/python bench/mutations.py`, {result['date']}.")


def render(result: dict) -> str:
    from common import run_line
    from render import machine_line

    return "\n".join(["## mutations: realistic bugs the tests must catch", "",
                      "`.venv/bin/python bench/mutations.py` (docs/testing.md explains the runner)", "",
                      machine_line(result) + " " + run_line(result), "", summary_line(result), "", table(result), ""])


def snippets(result: dict) -> dict[str, str]:
    return {"mutations": summary_line(result) + "\n\n" + table(result)}


if __name__ == "__main__":
    sys.exit(main())
