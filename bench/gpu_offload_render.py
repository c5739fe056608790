"""The "GPU: activation offload overlap" section of docs/BENCHMARKS.md, from bench/results/gpu_offload.json
(written by bench/gpu_offload.py), and the table that script prints last."""
from __future__ import annotations

from common import fmt_bytes, fmt_ratio, fmt_spread, load_line, run_line

HEAD = ("| precision, batch | contender | step time | vs keep | max_memory_allocated | to host per step | "
        "to host / step time | transfer bound | gradients vs keep |")
RULE = "|---|---|---:|---:|---:|---:|---:|---:|---|"


def _grad(check: dict | None) -> str:
    if not check:
        return "n/a"
    if "error" in check:
        return f"error: {check['error'][:60]}"
    return "bit-equal" if check.get("equal") else f"max abs diff {check.get('max_abs_diff', float('nan')):.2e}"


def _line(row: dict, name: str, c: dict) -> str:
    label = f"{row['precision']}, {row.get('batch', row.get('batch_requested'))}"
    grad = _grad(row.get("grad_check", {}).get(name))
    if name == "keep" and grad != "n/a":
        grad = f"repeat: {grad}"  # keep against itself: the run-to-run noise floor
    if "error" in c:
        return f"| {label} | {name} | failed: {c['error'][:80]} | | | | | | {grad} |"
    vs = fmt_ratio(c["vs_keep"]) if "vs_keep" in c else "n/a"
    peak = fmt_bytes(c["max_memory_allocated"]) if "max_memory_allocated" in c else "n/a"
    moved = fmt_bytes(c["bytes_to_host"]) if c["bytes_to_host"] else "0"
    rate = f"{c['bytes_per_s'] / 1e9:.1f} GB/s" if c["bytes_to_host"] else ""
    bound = f"{c['transfer_bound_s'] * 1e3:.0f} ms" if "transfer_bound_s" in c else ""
    return (f"| {label} | {name} | {fmt_spread(c['step_s'], 1e3, 'ms', 1)} | {vs} | {peak} | {moved} | {rate} | "
            f"{bound} | {grad} |")


def rows_table(result: dict) -> str:
    lines = [HEAD, RULE]
    for row in result.get("rows", []):
        if "error" in row and "contenders" not in row:
            lines.append(f"| {row.get('precision')}, {row.get('batch_requested')} | all | failed: "
                         f"{row['error'][:100]} | | | | | | |")
            continue
        for name, c in row.get("contenders", {}).items():
            lines.append(_line(row, name, c))
    return "\n".join(lines)


def _bandwidth(bw: dict) -> str:
    if "error" in bw:
        return f"Host<->device bandwidth not measured ({bw['error']})."
    return (f"Measured pinned copy bandwidth ({fmt_bytes(bw['bytes'])}, median of {len(bw['h2d']['seconds'])}): "
            f"host->device {bw['h2d']['GB_per_s']:.1f} GB/s, device->host {bw['d2h']['GB_per_s']:.1f} GB/s.")


def _model_lines(result: dict) -> list[str]:
    out = []
    for row in result.get("rows", []):
        if "params" not in row:
            continue
        m = row["model"]
        share = f", saved activations {row['activation_share'] * 100:.0f}% of keep's peak" \
            if "activation_share" in row else ""
        out.append(f"- {row['precision']}: GPT {m['layers']} layers, hidden {m['hidden']}, seq {m['seq']}, "
                   f"{row['params'] / 1e6:.0f}M parameters, batch {row['batch']} "
                   f"({row['tokens_per_step']:,} tokens per step){share}; TF32 {'on' if row['tf32'] else 'off'}.")
        if "rounds" in row:
            out.append(f"  {load_line(row['rounds'])}")
    return out


def summary(result: dict) -> str:
    """What bench/gpu_offload.py prints last: bandwidth, model rows, the table."""
    return "\n".join([_bandwidth(result.get("bandwidth", {})), *_model_lines(result), "", rows_table(result)])


def render(result: dict) -> str:
    from render import machine_line

    lines = [
        "## GPU: activation offload overlap",
        "",
        f"`{result.get('command', 'PYTHONPATH=src python3 bench/gpu_offload.py')}` on {result.get('device_name')} "
        f"(torch {result.get('torch')}, CUDA {result.get('cuda')})",
        "",
        machine_line(result) + " " + run_line(result),
        "",
        "Every block's saved activations offloaded to pinned host memory during forward and brought back "
        "in backward, against keeping them on the device; memfit copies on a side stream and prefetches "
        "the previous block while backward runs the current one. Step time is forward plus backward, "
        "CUDA-synchronised; \"vs keep\" is the median over rounds of each round's time over keep's in the "
        "same round (target: under +10%). \"To host per step\" is what was copied out (and back); "
        "\"transfer bound\" is that many bytes each way at the measured bandwidth, the least time the "
        "copies take even when perfectly overlapped. save_on_cpu also copies parameters (and their bf16 "
        "copies) that memfit leaves in place.",
        "",
        _bandwidth(result.get("bandwidth", {})),
        "",
        *_model_lines(result),
        "",
        rows_table(result),
    ]
    return "\n".join(lines)
