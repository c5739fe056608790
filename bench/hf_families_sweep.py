"""Every causal-LM architecture the installed transformers builds from a config, as a user would bring it:
a tiny config (bench/hf_family_tiny.py: 2 layers, width 64, vocabulary 1024; batch 8 x 64 tokens), then
(a) memfit.estimate against the measured step (memfit's tracker and the CPU allocator on two real AdamW
steps), (b) memfit.fit at 60% of the measured plain peak, the plan applied and its step measured, (c) the
repeated blocks memfit finds, and whether `--strategy tensor` / `--strategy pipeline` on 2 processes
accept the model or refuse it in one line (checked as the launcher checks them).

    .venv/bin/python bench/hf_families_sweep.py            # resumes: architectures already in the JSON are kept
    .venv/bin/python bench/hf_families_sweep.py --fresh    # all again

Each architecture runs in a child process (a few at a time, each stopped after --timeout seconds); the
JSON is written after every batch, so a stopped sweep keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS, fmt_bytes, run_line, save  # noqa: E402

NAME = "hf_families_sweep"
COMMAND = ".venv/bin/python bench/hf_families_sweep.py"
TARGET_PCT = 0.3
CHUNK = 4


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _run_chunk(phase: str, archs: list[str], timeout: float) -> list[dict]:
    """Rows of `archs` from one child process; an architecture still running at the timeout is recorded as
    such and the ones after it are left for the next batch (absent from the rows)."""
    env = {"PYTHONPATH": str(HERE.parent / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "MEMFIT_NO_CACHE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    try:
        out = subprocess.run([sys.executable, str(HERE / "hf_family_tiny.py"), phase, *archs], env=env, capture_output=True,
                             text=True, timeout=timeout).stdout
        stopped = None
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stopped = "timed out"
    rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    done = {r["arch"] for r in rows}
    left = [a for a in archs if a not in done]
    if left:  # the first one not reported is the one that stopped (or crashed) the child
        rows.append({"arch": left[0], "status": "fails", "reason": stopped or "the child process died"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fresh", action="store_true", help="measure every architecture again")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per batch of architectures")
    args = ap.parse_args()
    path = RESULTS / f"{NAME}.json"
    have = {} if args.fresh or not path.exists() else {r["arch"]: r for r in json.loads(path.read_text())["rows"]}
    archs = architectures()
    # first the estimate and the checks of every architecture (seconds each), then the plans (the slow part)
    _phase("checks", have, [a for a in archs if a not in have], args)
    _phase("plan", have, [a for a in archs if have[a]["status"] != "skipped" and "err_pct" in have[a]
                          and not have[a].get("planned") and "timed out" not in have[a].get("reason", "")], args)


def _phase(phase: str, have: dict, todo: list[str], args) -> None:
    """Run `phase` over `todo`, CHUNK architectures a child, args.jobs children at a time; each batch's rows
    merged into `have` (a plan's row over its checks' row) and saved. Every batch settles at least one
    architecture (a stopped child's first unreported one is recorded as such), so the loop ends."""
    def settled(a: str) -> bool:
        r = have.get(a, {})
        return bool(r) and (phase == "checks" or r.get("planned") or "reason" in r)

    while todo:
        chunks = [todo[i:i + CHUNK] for i in range(0, min(len(todo), CHUNK * args.jobs), CHUNK)]
        with ThreadPoolExecutor(args.jobs) as pool:
            for rows in pool.map(lambda c: _run_chunk(phase, c, args.timeout), chunks):
                for r in rows:
                    have[r["arch"]] = {**have.get(r["arch"], {}), **r}
        todo = [a for a in todo if not settled(a)]
        _save(have)
        print(f"{phase}: {len(have)} rows, {len(todo)} to go", flush=True)


def _save(have: dict) -> None:
    import transformers

    rows = [have[a] for a in sorted(have)]
    left = len(architectures()) - len(rows) + sum(1 for r in rows if "err_pct" in r and not r.get("planned"))
    save(NAME, {"command": COMMAND, "rows": rows, "left": left, "transformers": transformers.__version__,
                "target_pct": TARGET_PCT})


def _short(text: str | None) -> str:
    """A check's cell: accepts, memfit's refusal (its first clause), or what escaped."""
    if not text:
        return "-"
    if text == "accepts":
        return "accepts"
    kind, _, why = text.partition(": ")
    return f"{'refused' if kind == 'refuses' else kind}: {why.split(';')[0]}".replace("|", "/")


def _fit_cell(r: dict) -> str:
    if r.get("applied") is not None:
        ok = "within" if r["applied"] <= r["budget"] else "OVER"
        return f"{fmt_bytes(r['budget'])}: measured {fmt_bytes(r['applied'])} ({ok})"
    return _short(r.get("fit") or r.get("applied_error") or r.get("measured") or r.get("estimate"))


def table(result: dict) -> str:
    rows = [r for r in result["rows"] if r["status"] != "skipped"]
    lines = ["| architecture | parameters | repeated blocks | estimate vs allocator | plan at 60% of the plain peak "
             "| tensor, 2 ranks | pipeline, 2 ranks |", "|---|---:|---|---:|---|---|---|"]
    for r in rows:
        err = f"{r['err_pct']:+.2f}%" if r.get("err_pct") is not None else _short(r.get("estimate") or r.get("reason"))
        lines.append(f"| {r['arch']} | {r.get('params', 0):,} | {r.get('blocks', '-') if 'x' in str(r.get('blocks')) else _short(r.get('blocks'))} "
                     f"| {err} | {_fit_cell(r)} | {_short(r.get('tensor'))} | {_short(r.get('pipeline'))} |")
    return "\n".join(lines) + "\n\n" + _verdict(result) + "\n"


def skipped(result: dict) -> str:
    rows = [r for r in result["rows"] if r["status"] == "skipped"]
    lines = ["| architecture | why it is not in the sweep |", "|---|---|"]
    lines += [f"| {r['arch']} | {r['reason'].replace('|', '/')[:220]} |" for r in rows]
    return "\n".join(lines) + "\n"


def _verdict(result: dict) -> str:
    rows = result["rows"]
    swept = [r for r in rows if r["status"] != "skipped"]
    est = [r for r in swept if r.get("err_pct") is not None]
    within = [r for r in est if abs(r["err_pct"]) <= result["target_pct"]]
    fits = [r for r in swept if r.get("applied") is not None]
    held = [r for r in fits if r["applied"] <= r["budget"]]
    worst = max(est, key=lambda r: abs(r["err_pct"]), default=None)
    text = (f"{len(swept)} of {len(rows)} architectures built from a tiny config "
            f"({len(rows) - len(swept)} skipped: below). Estimates within {result['target_pct']}%: "
            f"{len(within)} of {len(est)}")
    text += f" (largest error {worst['err_pct']:+.2f}%, {worst['arch']})." if worst else "."
    text += f" Plans applied within the budget: {len(held)} of {len(fits)} planned."
    fails = [r["arch"] for r in swept if r["status"] == "fails"]
    text += f" Failing: {', '.join(fails)}." if fails else " None fails."
    if result.get("left"):
        text += f" {result['left']} architectures not yet measured or planned (the sweep resumes where it stopped)."
    return text


def render(result: dict) -> str:
    head = [
        "## hf_families_sweep: every causal-LM architecture transformers builds from a config",
        "",
        f"`{result.get('command', COMMAND)}`",
        "",
        __import__("render").machine_line(result) + " " + run_line(result),
        "",
        f"transformers {result['transformers']}. Tiny configs (bench/hf_family_tiny.py: 2 layers, width 64, "
        "vocabulary 1024), batch 8 x 64 tokens, two AdamW steps in fp32. Estimate: `memfit.estimate` against the "
        "CPU allocator's peak on the real step. Plan: `memfit.fit` at 60% of the tracker's plain peak, applied, its "
        "step measured by the tracker. Tensor / pipeline: the launcher's checks for 2 processes.",
        "",
    ]
    return "\n".join(head) + "\n" + table(result) + "\nSkipped:\n\n" + skipped(result)


def snippets(result: dict) -> dict[str, str]:
    return {"hf_families_sweep": table(result), "hf_families_skipped": skipped(result)}


if __name__ == "__main__":
    main()
