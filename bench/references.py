"""Figures nobody here wrote, reproduced: published formulas and runs against memfit's prediction.

    PYTHONPATH=src python bench/references.py            # writes bench/results/references.json
    PYTHONPATH=src python bench/references.py --only zero

Every row has one shape (the JSON schema other reference sections follow too):

    {"section", "name", "reference", "predicted", "ratio", "tolerance", "note"}

`reference` and `predicted` are in the same unit (bytes unless the section says otherwise), `ratio`
is predicted / reference, `tolerance` the allowed |ratio - 1| (0.03 for a formula, 0.05 for a
measurement), and `note` says what the reference assumes and, for a row outside its tolerance, why.
A section is a function returning rows; SECTIONS lists them in the order the docs show them. To add
one, write `def my_rows() -> list[dict]` (each row from `row(...)`) and append ("key", title,
my_rows) to SECTIONS; the docs table (docs/estimate.md, "References") is rendered from the JSON.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

FORMULA, MEASURED = 0.03, 0.05


def row(section: str, name: str, reference: float, predicted: float, tolerance: float, note: str = "") -> dict:
    ratio = predicted / reference if reference else float("nan")
    return {"section": section, "name": name, "reference": reference, "predicted": predicted,
            "ratio": round(ratio, 4), "tolerance": tolerance, "note": note}


def within(r: dict) -> bool:
    return abs(r["ratio"] - 1) <= r["tolerance"]


# ---------------------------------------------------------------- ZeRO (Rajbhandari et al. 2020), Table 1
ZERO_TABLE_7_5B = {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
                   256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)}
"""Per-device GB of model states for 7.5B parameters, mixed-precision Adam (K = 12): P_os, P_os+g, P_os+g+p."""


def zero_rows() -> list[dict]:
    from memfit.measure.formulas import model_state_bytes

    rows = []
    for world, published in ZERO_TABLE_7_5B.items():
        for stage, gb in zip((1, 2, 3), published):
            got = model_state_bytes(7_500_000_000, "16-master", "adam", zero=stage, world=world).total
            # The table prints 2 or 3 significant figures: half its last digit is allowed beside 3%.
            digits = len(f"{gb:g}".replace(".", "").lstrip("0"))
            rounding = 0.5 * 10 ** (math.floor(math.log10(gb)) - digits + 1) / gb
            rows.append(row("zero", f"7.5B, ZeRO-{stage}, N={world}", gb * 1e9, got, max(FORMULA, round(rounding, 4)),
                            "(2 + 2 + 12) bytes per parameter (16-bit weights and gradients, fp32 master weights and "
                            "Adam moments), sharded over N; the tolerance allows the table's rounding"))
    return rows


# ---------------------------------------------------------------- Korthikanti et al. 2022, per layer
def korthikanti_rows() -> list[dict]:
    from references_layers import layer_rows  # the traced per-layer figures (bench/references_layers.py)

    return layer_rows(row, FORMULA)


def korthikanti_parallel_section() -> list[dict]:
    from references_parallel import korthikanti_parallel_rows

    return [dict(r, section="korthikanti_tp", ratio=round(r["ratio"], 4)) for r in korthikanti_parallel_rows()]


def published_section() -> list[dict]:
    from references_published import published_rows

    return [dict(r, section="published", ratio=round(r["ratio"], 4)) for r in published_rows()]


SECTIONS: list[tuple[str, str, Callable[[], list[dict]]]] = [
    ("korthikanti", "Korthikanti et al. 2022: activations saved per transformer layer (no tensor parallelism)",
     korthikanti_rows),
    ("zero", "ZeRO (Rajbhandari et al. 2020), Table 1: model states per device, 7.5B parameters", zero_rows),
    ("korthikanti_tp", "Korthikanti et al. 2022: activations per layer under tensor (and sequence) parallelism",
     korthikanti_parallel_section),
    ("published", "Published training runs: per-GPU peak memory as run, against memfit's estimate of the job",
     published_section),
]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="section keys to run (default: all)")
    args = ap.parse_args(argv)
    rows, titles = [], {}
    for key, title, make in SECTIONS:
        titles[key] = title
        if not args.only or key in args.only:
            rows += make()
    for r in rows:
        print(f"{'ok ' if within(r) else 'OUT'} {r['section']:<12} {r['name']:<48} ratio {r['ratio']:.4f}")
    result = {"sections": titles, "rows": rows}
    save("references", result)
    return result


# ---------------------------------------------------------------- docs
def _fmt(x: float) -> str:
    return f"{x / 1e9:,.3f} GB" if x >= 1e8 else f"{x / 2**20:,.2f} MiB"


def snippets(result: dict) -> dict[str, str]:
    lines = ["| reference | case | published | memfit | ratio | within |", "|---|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        mark = "yes" if within(r) else "no: explained in its note"
        lines.append(f"| {r['section']} | {r['name']} | {_fmt(r['reference'])} | {_fmt(r['predicted'])} | "
                     f"{r['ratio']:.3f} | {mark} |")
    notes = {}
    for r in result["rows"]:
        notes.setdefault((r["section"], r["note"]), None)
    lines.append("")
    lines += [f"- {sec}: {note}" for sec, note in notes if note]
    sections = "\n".join(f"- `{k}`: {t}" for k, t in result["sections"].items())
    return {"references": sections + "\n\n" + "\n".join(lines) + "\n\n(bench/results/references.json, "
            "`PYTHONPATH=src python bench/references.py`)"}


def render(result: dict) -> str:
    return "## References\n\n" + snippets(result)["references"] + "\n"


if __name__ == "__main__":
    main()
