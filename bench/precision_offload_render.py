"""Markdown for bench/precision_offload.py's result (its `render` calls this): every figure and
every sentence below is computed from the JSON."""
from __future__ import annotations

from common import fmt_spread, load_line, run_line

GPU_NOTE = "to be confirmed on a GPU (issue 13)"


def mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def _ms(s: dict) -> str:
    return fmt_spread(s, 1e3, "ms", 1)


def _fit(r: dict, cpu_only: bool) -> list[str]:
    lines = [f"### Largest model that trains under a {mib(r['budget'])} device budget", "",
             f"GPT (hidden {r['fit_shape']['hidden']}, {r['fit_shape']['heads']} heads, byte vocabulary), "
             f"{r['fit_batch']} x {r['fit_shape']['seq']} tokens per step; device peak = memfit tracker peak over two "
             "real steps, host-resident optimizer copies excluded. Peak RSS growth: the same depth run again in a "
             "fresh process, growth of its peak resident memory over building the model and two steps.", "",
             "| configuration | layers | parameters | device peak (tracker) | next depth's peak | peak RSS growth (physical) |",
             "|---|---|---|---|---|---|"]
    for f in r["fit"]:
        rss = mib(f["rss_growth"]) if f.get("rss_growth") is not None else "–"
        lines.append(f"| {f['kind']} | {f['layers']} | {f['params'] / 1e6:.2f}M | {mib(f['peak'])} | "
                     f"{mib(f['next']['peak'])} ({f['next']['layers']} layers) | {rss} |")
    plain, ours = r["fit"]
    lines += ["", f"By the tracker's accounting of device-resident bytes, memfit trains a **{r['ratio']:.1f}x** larger "
              f"model in the same device budget (N = {plain['params'] / 1e6:.2f}M parameters with plain fp32 AdamW)."]
    if cpu_only:
        phys = ""
        if plain.get("rss_growth") and ours.get("rss_growth"):
            phys = (f" Physically, the {ours['layers']}-layer memfit run grew the process's peak RSS by "
                    f"{mib(ours['rss_growth'])} against {mib(plain['rss_growth'])} for the {plain['layers']}-layer "
                    "fp32 run: the offloaded fp32 masters and Adam state live in that same RAM.")
        lines += ["This is what an accelerator would hold: on this CPU-only machine host and device are the same "
                  "RAM, the offload marks its copies host-resident and the host step runs with dispatch disabled, "
                  f"so the device figure is accounting, not RAM saved.{phys} The device figure is {GPU_NOTE}."]
    return lines + [""]


def _modes(r: dict, cpu_only: bool) -> list[str]:
    m = r["modes"]
    t = m["timing"]
    base = t["wall"]["32-true / in memory"]["median"]
    lines = [f"### Every precision mode, optimizer in memory and offloaded ({m['params'] / 1e6:.1f}M parameters, "
             f"{m['batch']} x {m['model']['seq']} tokens, AdamW)", "",
             "Device and host peaks: memfit's tracker over two steady-state steps. Peak RSS growth: a fresh process "
             "per row, over building the model and three steps. Loss: the batch's loss after three steps from the "
             "same seed, a check that every mode trains. Step time: side by side, "
             + load_line(t, r["machine"]["cores"]), "",
             "| precision | optimizer | device peak (tracker) | host peak (tracker) | peak RSS growth (physical) | "
             "step time | vs 32-true in memory | loss after 3 steps |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in m["rows"]:
        if "error" in row:
            lines.append(f"| {row['precision']} | {row['offload'] or 'in memory'} | failed: {row['error']} | | | | | |")
            continue
        w = t["wall"][row["label"]]
        mark = " *" if cpu_only and row["offload"] == "cpu" else ""
        lines.append(f"| {row['precision']} | {row['offload'] or 'in memory'}{mark} | {mib(row['tracker_peak'])} | "
                     f"{mib(row['tracker_host_peak'])} | {mib(row['rss_growth'])} | {_ms(w)} | "
                     f"{(w['median'] / base - 1) * 100:+.0f}% | {row['loss_after_3_steps']:.4f} |")
    if cpu_only:
        lines += ["", "\\* CPU offload on a CPU-only machine: the device peak is tracker accounting (the host copies "
                  "are in the same RAM, see the RSS column), " + GPU_NOTE + "."]
    return lines + [""]


def _overhead(r: dict) -> list[str]:
    o = r["overhead"]
    lines = [f"### Offload step-time overhead ({o['params'] / 1e6:.1f}M parameters, {o['batch']} x "
             f"{o['model']['seq']} tokens, AdamW, no clipping)", "",
             "Step time: " + load_line(o["timing"], r["machine"]["cores"]), "",
             "| precision | optimizer offload | chunks | step time | overhead vs in-memory | "
             "spill I/O per step | spill throughput | raw throughput | % of raw |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in o["rows"]:
        io = (f"{mib(row['spill_bytes_per_step'])} | {row['spill_throughput'] / 2**30:.2f} GiB/s | "
              f"{row['raw_throughput'] / 2**30:.2f} GiB/s | {row['throughput_pct_of_raw']:.0f}%"
              ) if "spill_throughput" in row else "- | - | - | -"
        lines.append(f"| {row['precision']} | {row['offload']} | {row['chunks'] or '-'} | {_ms(row['step'])} | "
                     f"{row['overhead_pct']:+.0f}% | {io} |")
    by = {(row["precision"], row["offload"]): row for row in o["rows"]}
    parts = [f"{prec} {off} {by[(prec, off)]['overhead_pct']:+.0f}%" for prec in ("32-true", "bf16-master")
             for off in ("cpu", "disk") if (prec, off) in by]
    disk = [by[(p, "disk")]["throughput_pct_of_raw"] for p in ("32-true", "bf16-master") if (p, "disk") in by]
    kept = [by[(p, "disk, gradient files kept")]["throughput_pct_of_raw"] for p in ("32-true", "bf16-master")
            if (p, "disk, gradient files kept") in by]
    if parts:
        lines += ["", "Offloading the optimizer costs " + ", ".join(parts) + " per step (median against median) "
                  "against keeping it in memory"
                  + (f"; with the update after backward the spill I/O runs at {min(disk):.0f}-{max(disk):.0f}% of the "
                     "raw throughput" if disk else "")
                  + (f", and at {min(kept):.0f}-{max(kept):.0f}% when the gradient files are kept between steps." if kept
                     else ".")
                  + " With 4 MiB chunks the later chunks are updated on the worker thread while backward runs, "
                  "competing with it for this machine's cores; the seconds inside that thread's read and write calls "
                  "then include waiting for a core and for the interpreter lock, so their throughput is not a measure "
                  "of the I/O path. Deleting the gradient files after every step (the default) means new file pages "
                  "on every write; the last row keeps them (`keep_grad_files=True`)."]
    lines += ["", "Spill throughput: bytes moved to and from the spill files per step over the seconds spent inside "
              "the read and write calls. Raw: a sequential overwrite + read of the same number of bytes of one file in "
              "the same folder, in 16 MiB calls, taken right after each step; % of raw is the median of the per-step "
              "ratios. Both go through the page cache (no fsync on either side: spill files are scratch data), so at "
              "this size both are memory-copy speeds through the kernel, not the disk device's.", ""]
    return lines


def _compare(r: dict, cpu_only: bool) -> list[str]:
    from precision_offload_compare import AMP_BF16, CONTENDERS, DEEPSPEED, MEMFIT_OFFLOAD

    c = r["compare"]
    t = c.get("timing") or {"wall": {}}
    wall, mem = t["wall"], c["memory"]
    lines = [f"### memfit vs torch.amp vs DeepSpeed ZeRO-Offload on CPU ({c['params'] / 1e6:.1f}M parameters, "
             f"{c['batch']} x {c['model']['seq']} tokens, clipping at 1.0)", ""]
    if t.get("rounds"):
        lines += ["Step time: " + load_line(t, r["machine"]["cores"]), ""]
    lines += ["| configuration | step time | vs torch.amp bf16 | peak RSS growth (physical) | device peak (tracker) |",
              "|---|---|---|---|---|"]
    amp = wall.get(AMP_BF16, {}).get("median")
    for name in CONTENDERS:
        w, m = wall.get(name), mem.get(name, {})
        err = c["errors"].get(name) or m.get("error")
        if w is None and not m:
            lines.append(f"| {name} | skipped: {err or 'not installed'} | | | |")
            continue
        ratio = f"{w['median'] / amp:.2f}x" if w and amp else "-"
        lines.append(f"| {name} | {_ms(w) if w else 'failed: ' + str(err)} | {ratio} | "
                     f"{mib(m['rss_growth']) if 'rss_growth' in m else '-'} | "
                     f"{mib(m['tracker_peak']) if 'tracker_peak' in m else '-'} |")
    for note in c.get("notes", []):
        lines += ["", note]
    ours, base = mem.get(MEMFIT_OFFLOAD, {}), mem.get(AMP_BF16, {})
    if MEMFIT_OFFLOAD in wall and amp and "tracker_peak" in ours and "tracker_peak" in base:
        lines += ["", f"memfit bf16-master with CPU offload takes {wall[MEMFIT_OFFLOAD]['median'] / amp:.2f}x the step "
                  f"time of torch.amp bf16 (median against median). By the tracker's accounting it keeps "
                  f"{base['tracker_peak'] / ours['tracker_peak']:.1f}x fewer bytes on the device"
                  + (f" — what an accelerator would hold, {GPU_NOTE}. Physically, on this CPU-only machine, its "
                     f"process's peak RSS grew by {mib(ours['rss_growth'])} against {mib(base['rss_growth'])} for "
                     "torch.amp bf16: the offloaded state stays in the same RAM." if cpu_only else ".")
                  + (f" DeepSpeed's step takes {wall[DEEPSPEED]['median'] / amp:.2f}x torch.amp bf16's." if DEEPSPEED in wall
                     else "")]
    lines += ["", "torch.amp bf16 runs without a GradScaler (bf16 has fp32's exponent range; a scaler only adds an "
              "unscale pass), fp16 with one, as torch's documentation prescribes for each. The tracker's device peak "
              "counts what stays resident on the training device; RSS growth includes offloaded state and library "
              "workspaces. DeepSpeed's offloaded fp32 partitions are plain CPU tensors, which the tracker cannot tell "
              "from device tensors on a CPU-only machine."]
    return lines


def render(r: dict) -> str:
    from render import machine_line

    cpu_only = r["machine"].get("device", "cpu") == "cpu"
    lines = ["## Precision and optimizer offload", "",
             f"Command: `{r.get('command', '.venv/bin/python bench/precision_offload.py')}`", "",
             machine_line(r) + f" {r.get('threads', '?')} intra-op thread(s) per contender. {run_line(r)}", ""]
    lines += _fit(r, cpu_only)
    if "modes" in r:
        lines += _modes(r, cpu_only)
    lines += _overhead(r)
    lines += _compare(r, cpu_only)
    return "\n".join(lines) + "\n"
