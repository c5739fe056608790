"""Regenerate docs/BENCHMARKS.md from bench/results/*.json.

    python bench/render.py

Each result file is written by one script in bench/ and names it in its "bench" field; that
script's `render(result) -> str` turns the JSON into a markdown section. Sections appear in the
order of ORDER, then any others alphabetically. A script may also define
`snippets(result) -> {name: markdown}`: each is pasted into docs/*.md between the lines
`<!-- bench:NAME -->` and `<!-- /bench:NAME -->` (e.g. docs/train.md's sample output), so no number
in the docs is typed by hand.
"""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "BENCHMARKS.md"
ORDER = ["estimate_accuracy", "estimate_families", "activations", "precision_offload"]
GPU_ORDER = ["gpu_estimate", "gpu_offload", "gpu_larger_model", "gpu_train"]  # last, together

HEADER = """# Benchmarks

Every table here is generated: each section names the command that produced its JSON in
`bench/results/`, and `python bench/render.py` rewrites this file from those JSON files.
Timings are side by side in one process (bench/common.py): a warm-up, then at least 5 rounds, each
running every contender once in a freshly shuffled order; tables give the median with the fastest
and slowest round, and each section gives the machine's load average. Memory comes from memfit's
tracker and, where the text says so, from the process's peak RSS (the physical figure). On a
CPU-only machine host and device are the same RAM: the tracker's "device" figures for CPU offload
are accounting of what an accelerator would hold, not RAM saved, and are marked as such.
Every run's whole-script wall time and load are recorded; `bash bench/run_all.sh` reruns everything.
"""


def machine_line(result: dict) -> str:
    m = result.get("machine", {})
    return f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}, {m.get('device', 'cpu')}; run {result.get('date', '?')}."


def _load_bench(name: str):
    path = ROOT / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    spec.loader.exec_module(module)
    return module


def load_results() -> dict[str, dict]:
    results = {}
    for f in sorted(RESULTS.glob("*.json")):
        data = json.loads(f.read_text())
        results[data.get("bench", f.stem)] = data
    return results


def build(results: dict[str, dict]) -> tuple[str, dict[str, str]]:
    """docs/BENCHMARKS.md's text and the snippets to paste into docs/*.md."""
    names = [n for n in ORDER if n in results] + sorted(n for n in results if n not in ORDER + GPU_ORDER) \
        + [n for n in GPU_ORDER if n in results]
    parts, blocks = [HEADER], {}
    for name in names:
        module = _load_bench(results[name].get("script", name))  # one script may write several results
        try:
            parts.append(module.render(results[name]).rstrip() + "\n")
        except (KeyError, TypeError) as exc:  # a result written by an older version of its script
            parts.append(f"## {name}\n\n`bench/results/{name}.json` predates the current `bench/{name}.py` "
                         f"(missing {exc}); rerun `python bench/{name}.py` to fill this section.\n")
        if hasattr(module, "snippets"):
            try:
                blocks.update(module.snippets(results[name]))
            except (KeyError, TypeError):
                pass
    return "\n".join(parts), blocks


def main() -> None:
    results = load_results()
    text, blocks = build(results)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(results)} sections)")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        pasted = paste(doc.read_text(), blocks)
        if pasted != doc.read_text():
            doc.write_text(pasted)
            print(f"pasted into {doc.relative_to(ROOT)}")


def paste(text: str, blocks: dict[str, str]) -> str:
    """Replace what lies between <!-- bench:NAME --> and <!-- /bench:NAME --> with blocks[NAME]."""
    for name, body in blocks.items():
        # (?:.*?\n)?: an empty block (the two lines next to each other) is filled too
        tag = re.escape(name)
        pattern = re.compile(rf"(<!-- bench:{tag} -->\n)(?:.*?\n)?(<!-- /bench:{tag} -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text)
    return text


if __name__ == "__main__":
    main()
