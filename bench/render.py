"""Regenerate docs/BENCHMARKS.md from bench/results/*.json.

    python bench/render.py

Each result file is written by one script in bench/ and names it in its "bench" field; that
script's `render(result) -> str` turns the JSON into a markdown section. Sections appear in the
order of ORDER, then any others alphabetically.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "BENCHMARKS.md"
ORDER = ["estimate_accuracy", "activations", "precision_offload"]

HEADER = """# Benchmarks

Every table here is generated: each section names the command that produced its JSON in
`bench/results/`, and `python bench/render.py` rewrites this file from those JSON files.
Ratios are measured side by side in one process run; each section names the machine.
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


def main() -> None:
    results = {}
    for f in sorted(RESULTS.glob("*.json")):
        data = json.loads(f.read_text())
        results[data.get("bench", f.stem)] = data
    names = [n for n in ORDER if n in results] + sorted(n for n in results if n not in ORDER)
    parts = [HEADER]
    for name in names:
        module = _load_bench(name)
        parts.append(module.render(results[name]).rstrip() + "\n")
    OUT.write_text("\n".join(parts))
    print(f"wrote {OUT.relative_to(ROOT)} ({len(names)} sections)")


if __name__ == "__main__":
    main()
