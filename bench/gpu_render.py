"""Markdown sections and terminal tables for the GPU benches (bench/gpu_larger_model.py,
bench/gpu_train.py); bench/render.py calls each script's `render`, which is one of these."""
from __future__ import annotations

from common import fmt_bytes

LABELS = {"plain": "plain fp32 AdamW", "offload": "bf16-master + CPU optimizer offload + full checkpointing",
          "planner": "memfit.fit (planner) at the same budget"}


def _safe(title: str, fn):
    """fn as a renderer that never raises: a result it cannot read becomes a one-line section."""
    def render(result: dict) -> str:
        try:
            return fn(result)
        except Exception as exc:  # noqa: BLE001 - a section saying why beats no BENCHMARKS.md at all
            return f"## {title}\n\n`{result.get('bench', '?')}` could not be rendered ({type(exc).__name__}: {exc})."
    return render


def _machine(result: dict) -> str:
    from render import machine_line

    dev = result.get("device_info", {})
    name = dev.get("name", result.get("device", "?"))
    return machine_line(result) + f" Device: {name}, torch {dev.get('torch', '?')}."


def larger_model_table(result: dict) -> str:
    rows = [f"{'contender':58s} {'largest that trains':>20s} {'params':>10s} {'x plain':>8s} {'max alloc':>11s}"]
    for name, c in result["contenders"].items():
        if "error" in c and "trials" not in c:
            rows.append(f"{LABELS.get(name, name):58s} error: {c['error'][:60]}")
            continue
        best = next((t for t in c["trials"] if t["rung"] == c["best_rung"]), None)
        alloc = fmt_bytes(best["max_memory_allocated"]) if best and "max_memory_allocated" in best else "n/a"
        ratio = c.get("ratio_vs_plain")
        rows.append(f"{c['label'][:58]:58s} {str(c['best_spec'] and c['best_spec'].split(',vocab')[0][4:]):>20s} "
                    f"{c['best_params'] / 1e6:9.1f}M {ratio if ratio is None else f'{ratio:.1f}x':>8} {alloc:>11s}")
    return "\n".join(rows)



def _mem(t: dict, key: str) -> str:
    return fmt_bytes(t[key]) if t.get(key) is not None else "n/a"


def _best_row(c: dict) -> str:
    b = next((t for t in c["trials"] if t["rung"] == c["best_rung"]), None)
    if b is None:
        return f"| {c['label']} | none | 0 | | | | | | {len(c['trials'])} |"
    step = b.get("step_seconds") or [float("nan")]
    ratio = "" if c.get("ratio_vs_plain") is None else f"{c['ratio_vs_plain']:.1f}x"
    host = fmt_bytes(b["host_state_bytes"]) if b.get("host_state_bytes") else "-"
    return (f"| {c['label']} | {c['best_spec'][4:]} | {c['best_params'] / 1e6:,.1f}M | {ratio} | "
            f"{_mem(b, 'max_memory_allocated')} | {_mem(b, 'max_memory_reserved')} | {step[-1]:.2f} | {host} | "
            f"{len(c['trials'])}{' (stopped: ' + c['stopped'] + ')' if c.get('stopped') else ''} |")


def _smoke(result: dict) -> list[str]:
    return (["**Smoke run** (`--smoke`: tiny sizes, checks the code paths only; not a measurement).", ""]
            if result.get("smoke") else [])


def _larger_model(result: dict) -> str:
    lines = ["## GPU: larger model under a fixed budget", "",
             (f"`PYTHONPATH=src python3 bench/gpu_larger_model.py --budget-gib {result['budget_bytes'] / 2**30:g} "
              f"--batch {result['batch']} --seq {result['seq']} --vocab {result['vocab']}`"), "",
             _machine(result), "", *_smoke(result),
             f"Budget {fmt_bytes(result['budget_bytes'])} (torch.cuda.set_per_process_memory_fraction); batch "
             f"{result['batch']} x seq {result['seq']}, vocab {result['vocab']}, {result['steps_per_trial']} optimizer "
             "steps per trial, each trial in a fresh process. " + result["method"], "",
             "| contender | largest that trains | parameters | x plain | max_memory_allocated | max_memory_reserved | "
             "step s | host state | trials |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in result["contenders"].items():
        if "trials" not in c:
            lines.append(f"| {LABELS.get(name, name)} | error: {c.get('error', '?')[:80]} | | | | | | | |")
            continue
        lines.append(_best_row(c))
    lines += ["", "Every trial (rung: fits, parameters, max allocated, error if any):", ""]
    for name, c in result["contenders"].items():
        for t in c.get("trials", []):
            alloc = fmt_bytes(t["max_memory_allocated"]) if "max_memory_allocated" in t else "n/a"
            err = f" — {t['error'][:100]}" if t.get("error") else ""
            lines.append(f"- {name} rung {t['rung']} ({t['params'] / 1e6:,.1f}M): "
                         f"{'fits' if t['fits'] else 'does not fit'}, {alloc}{err}")
    lines += ["", "Notes: " + "; ".join(result.get("notes", [])) + "."]
    return "\n".join(lines)




def _tflops(x: float | None) -> str:
    return f"{x / 1e12:,.1f}" if x else "n/a"


def train_table(result: dict) -> str:
    peak = result.get("matmul_peak", {}).get("flops_per_s")
    rows = [f"bf16 matmul peak {_tflops(peak)} TFLOP/s ({result.get('device', '?')})",
            f"{'case':64s} {'tokens/s':>12s} {'TFLOP/s':>9s} {'MFU':>7s}"]
    for c in result.get("cases", []):
        if "error" in c:
            rows.append(f"{c['label'][:64]:64s} error: {c['error'][:60]}")
            continue
        mfu = f"{c['mfu'] * 100:.1f}%" if c.get("mfu") is not None else "n/a"
        rows.append(f"{c['label'][:64]:64s} {c['tokens_per_s']:12,.0f} {_tflops(c['model_flops_per_s']):>9s} {mfu:>7s}")
    return "\n".join(rows)


def _train(result: dict) -> str:
    peak = result.get("matmul_peak", {})
    lines = ["## GPU: default training throughput", "",
             f"`PYTHONPATH=src python3 bench/gpu_train.py --steps {result['steps']}`", "",
             _machine(result), "", *_smoke(result),
             f"`memfit train` defaults (TrainConfig()) on {result['device']} with precision {result['precision']}, "
             f"{result['steps']} steps per case, the first {result['warmup_frac']:.0%} of them and the tracked step "
             f"left out of the timing. Peak: {peak.get('n', '?')}^3 {peak.get('dtype', 'bf16')} torch.matmul on random "
             f"data, median of {peak.get('reps', '?')} after {peak.get('warmup', '?')} warm-ups: "
             f"{_tflops(peak.get('flops_per_s'))} TFLOP/s. `{result['formula']}` (N_matmul: every nn.Linear weight, "
             "the tied LM head once; T: the sequence length).", "",
             "| case | model | batch x seq | params | tokens/s (timed) | tokens/s (median step) | step ms (median) | "
             "model TFLOP/s | MFU |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in result.get("cases", []):
        if "error" in c:
            lines.append(f"| {c['label']} | {c.get('model') or 'default'} | | | error: {c['error'][:100]} | | | | |")
            continue
        mfu = f"{c['mfu'] * 100:.1f}%" if c.get("mfu") is not None else "n/a"
        lines.append(f"| {c['label']} | `{c['model']}` | {c['batch']} x {c['seq']} | "
                     f"{c['model_flops']['params'] / 1e6:,.1f}M | {c['tokens_per_s']:,.0f} | "
                     f"{c['tokens_per_s_median_step']:,.0f} | {c['step_seconds_median'] * 1e3:.1f} | "
                     f"{_tflops(c['model_flops_per_s'])} | {mfu} |")
    corpus = next((c.get("corpus") for c in result.get("cases", []) if c.get("corpus")), None)
    if corpus:
        size = f" ({corpus['bytes'] / 1e6:.1f} MB)" if isinstance(corpus, dict) and "bytes" in corpus else ""
        name = corpus.get("name", corpus) if isinstance(corpus, dict) else corpus
        lines += ["", f"Data: {name}{size}, one byte a token."]
    lines += ["", "The default model is tiny (a few million parameters, byte vocabulary): its steps are too small "
              "to keep a GPU busy, so its MFU says how much of the step is overhead; the GPT-2-small-size case is "
              "the figure for a model of useful size. No torch.compile, no fused kernels beyond torch's defaults."]
    return "\n".join(lines)


larger_model = _safe("GPU: larger model under a fixed budget", _larger_model)
train = _safe("GPU: default training throughput", _train)
