"""Every causal-LM architecture the installed transformers builds from a config, as a user would bring it:
a tiny config (bench/hf_family_tiny.py: 2 layers, width 64, vocabulary 1024; batch 8 x 64 tokens), then
(a) memfit.estimate against the measured step (memfit's tracker and the CPU allocator on two real AdamW
steps), (b) memfit.fit at 60% of the measured plain peak, the plan applied and its step measured, (c) the
repeated blocks memfit finds, and whether `--strategy tensor` / `--strategy pipeline` on 2 processes
accept the model or refuse it in one line (checked as the launcher checks them).

    .venv/bin/python bench/hf_families_sweep.py            # resumes: architectures already in the JSON are kept
    .venv/bin/python bench/hf_families_sweep.py --fresh    # all again

Each architecture runs in a child process (a few at a time, stopped after TIMEOUT seconds an architecture); the
JSON is written after every batch, so a stopped sweep keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS, fmt_bytes, run_line, save  # noqa: E402

NAME = "hf_families_sweep"
COMMAND = ".venv/bin/python bench/hf_families_sweep.py"
TARGET_PCT = 0.3
CHUNK = {"checks": 4, "plan": 1}
TIMEOUT = {"checks": 240.0, "plan": 600.0}
"""Seconds an architecture may take in a child before the child is stopped (the plan of a model with a
sequential scan, Mamba's on a CPU, takes minutes)."""


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _run_chunk(phase: str, archs: list[str], timeout: float) -> tuple[list[str], list[dict]]:
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
        rows.append({"arch": left[0], "status": "fails", "reason": f"{phase}: " + (stopped or "the child process died")})
    return archs, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fresh", action="store_true", help="measure every architecture again")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--again", nargs="+", metavar="ARCH", help="measure these architectures again (after a fix), "
                    "each replaced row marked with its own date and arguments; the rest of the file is kept")
    args = ap.parse_args()
    path = RESULTS / f"{NAME}.json"
    have = {} if args.fresh or not path.exists() else {r["arch"]: r for r in json.loads(path.read_text())["rows"]}
    if args.again and path.exists():
        return _again(path, have, args.again)
    archs = architectures()
    # first the estimate and the checks of every architecture (seconds each), then the plans (the slow part)
    _phase("checks", have, [a for a in archs if a not in have], args)
    _phase("plan", have, [a for a in archs if have[a]["status"] != "skipped" and "err_pct" in have[a]
                          and not have[a].get("planned") and "timed out" not in have[a].get("reason", "")], args)


def _again(path: Path, have: dict, archs: list[str]) -> None:
    """The named architectures' checks and plan again (one child each), their rows replaced in the saved
    file, which keeps its own run record; each new row carries `rerun` (date and arguments)."""
    import datetime

    d = json.loads(path.read_text())
    for arch in archs:
        for phase in ("checks", "plan"):
            if phase == "plan" and not ("err_pct" in have.get(arch, {}) and have[arch].get("status") != "skipped"):
                break
            _, rows = _run_chunk(phase, [arch], TIMEOUT[phase])
            for r in rows:
                have[r["arch"]] = {**({} if phase == "checks" else have.get(r["arch"], {})), **r}
        have[arch]["rerun"] = {"date": datetime.date.today().isoformat(), "argv": sys.argv[1:]}
        print(f"{arch}: {have[arch].get('status')}", flush=True)
    d["rows"] = [have[a] for a in sorted(have)]
    path.write_text(json.dumps(d, indent=1))


def _phase(phase: str, have: dict, todo: list[str], args) -> None:
    """Run `phase` over `todo` in child processes (CHUNK[phase] architectures each, args.jobs at a time, a
    new one started as one ends); each child's rows merged into `have` (a plan's row over its checks' row)
    and saved. A child settles at least one architecture (a stopped child's first unreported one is
    recorded as such; the ones after it go back in the queue), so the loop ends."""
    queue, size = list(todo), CHUNK[phase]
    with ThreadPoolExecutor(args.jobs) as pool:
        pending: set = set()

        def submit() -> None:
            chunk = queue[:size]
            del queue[:size]
            pending.add(pool.submit(_run_chunk, phase, chunk, TIMEOUT[phase] * len(chunk)))

        while queue and len(pending) < args.jobs:
            submit()
        while pending:
            job = next(as_completed(pending))
            pending.remove(job)
            chunk, rows = job.result()
            for r in rows:
                have[r["arch"]] = {**have.get(r["arch"], {}), **r}
            reported = {r["arch"] for r in rows}
            queue[:0] = [a for a in chunk if a not in reported]
            _save(have)
            print(f"{phase}: {len(have)} rows, {len(queue) + size * len(pending)} or fewer to go", flush=True)
            if queue:
                submit()


def _save(have: dict) -> None:
    import transformers

    rows = [have[a] for a in sorted(have)]
    left = len(architectures()) - len(rows) + sum(1 for r in rows if "err_pct" in r and not r.get("planned"))
    save(NAME, {"command": COMMAND, "rows": rows, "left": left, "transformers": transformers.__version__,
                "target_pct": TARGET_PCT})


_TAGS = (("has none", "no tensor plan"), ("which memfit does not shard", "plan styles memfit does not shard"),
         ("is not one of them", "family not cut"), ("does not divide", "heads do not divide"),
         ("need at least", "too few blocks"), ("is too small", "budget too small"),
         ("not all alike", "blocks not all alike"), ("differ", "blocks not all alike"))


def _short(text: str | None) -> str:
    """A check's cell: accepts, memfit's refusal (a tag; the full lines are listed under the table), or what
    escaped."""
    if not text:
        return "-"
    if text == "accepts":
        return "accepts"
    kind, _, why = text.partition(": ")
    tag = next((t for key, t in _TAGS if key in why), why.split(";")[0][:80])
    return f"{'refused' if kind == 'refuses' else kind}: {tag}".replace("|", "/")


def refusals(result: dict) -> str:
    """Each distinct refusal line memfit gave in the sweep, in full, with the architectures it was given for."""
    seen: dict[str, list[str]] = {}
    for r in result["rows"]:
        for key in ("tensor", "pipeline", "fit", "blocks", "estimate", "measured"):
            v = r.get(key)
            if isinstance(v, str) and v.startswith("refuses: "):
                line = v[len("refuses: "):].replace(repr(r["arch"]), "<model_type>")
                seen.setdefault(line, []).append(r["arch"])
    lines = ["| memfit's line | architectures |", "|---|---|"]
    lines += [f"| {line.replace('|', '/')} | {len(archs)}: {', '.join(archs[:12])}{' ...' if len(archs) > 12 else ''} |"
              for line, archs in sorted(seen.items(), key=lambda kv: -len(kv[1]))]
    return "\n".join(lines) + "\n"


def _fit_cell(r: dict) -> str:
    if r.get("applied") is not None:
        ok = "within" if r["applied"] <= r["budget"] else "OVER"
        return f"{fmt_bytes(r['budget'])}: measured {fmt_bytes(r['applied'])} ({ok})"
    for key in ("applied_error", "fit"):
        if isinstance(r.get(key), str) and r[key].split(":")[0] in ("refuses", "traceback"):
            return _short(r[key])
    if "timed out" in r.get("reason", ""):
        return r["reason"]
    return "not yet planned" if "err_pct" in r else "-"


def _err_cell(r: dict) -> str:
    if r.get("err_pct") is not None:
        return f"{r['err_pct']:+.3f}%"
    for key in ("estimate", "measured"):
        if isinstance(r.get(key), str):
            return _short(r[key])
    return r.get("reason", "-")


def table(result: dict) -> str:
    rows = [r for r in result["rows"] if r["status"] != "skipped"]
    lines = ["| architecture | parameters | repeated blocks | estimate vs allocator | plan at 60% of the plain peak "
             "| tensor, 2 ranks | pipeline, 2 ranks |", "|---|---:|---|---:|---|---|---|"]
    for r in rows:
        blocks = r.get("blocks", "-") if " x " in str(r.get("blocks")) else _short(r.get("blocks"))
        lines.append(f"| {r['arch']} | {r.get('params', 0):,} | {blocks} | {_err_cell(r)} | {_fit_cell(r)} "
                     f"| {_short(r.get('tensor'))} | {_short(r.get('pipeline'))} |")
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
    return ("\n".join(head) + "\n" + table(result) + "\nmemfit's refusals in full:\n\n" + refusals(result)
            + "\nSkipped:\n\n" + skipped(result))


def snippets(result: dict) -> dict[str, str]:
    return {"hf_families_sweep": table(result) + "\nmemfit's refusals in full:\n\n" + refusals(result),
            "hf_families_skipped": skipped(result)}


if __name__ == "__main__":
    main()
