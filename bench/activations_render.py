"""Markdown for bench/activations.py's result (its `render` calls this): every figure and every
sentence below is computed from the JSON."""
from __future__ import annotations

from common import fmt_bytes, fmt_ratio, fmt_spread, load_line, paired_ratio, run_line

OFFLOADED_TO_HOST = ("offload:cpu",)  # copies marked host-resident: tracker accounting on a CPU-only machine


def render(result: dict) -> str:
    from render import machine_line

    cpu_only = result["machine"].get("device", "cpu") == "cpu"
    out = [f"## activations — activation memory of every checkpoint policy, side by side\n",
           f"Command: `{result['command']}`  \n{machine_line(result)} {result.get('threads', '?')} intra-op "
           f"thread(s). {run_line(result)}\n",
           "Block activations: device bytes the repeated blocks keep from forward to backward (memfit's tracker, "
           "read before the first block and after the last, minus the last block's output). Peak: the tracker's peak "
           "over one training step (forward, backward, SGD update), predicted by `trace_step` under FakeTensorMode. "
           "Peak RSS growth: the physical figure — how much the process's peak resident memory grew over that same "
           "step (from after the model and batch exist), "
           + ("each model in a fresh process, its contenders one after another with the freed heap returned to the "
              "OS (malloc_trim) before each; no predictions in this mode. " if result.get("quick") else
              "each contender in a fresh process. ")
           + "Time: forward+backward; "
           "median over rounds with the fastest and slowest round in brackets; 'vs none' is each round's time over "
           "`none`'s in the same round, median and (range) over rounds, by wall time and by CPU time of the process. "
           "Batch 1.\n"]
    if cpu_only:
        out.append("On this CPU-only machine host and device are the same RAM. Rows marked * offload to CPU memory: "
                   "memfit marks its host copies host-resident, so their *block activations* and *peak* are tracker "
                   "accounting of what an accelerator would hold, not RAM saved; their peak RSS growth is the "
                   "physical total (the copies stay in the same RAM). To be confirmed on a GPU (issue 13). "
                   "`save_on_cpu` cannot mark its copies, so its tracker figures do not drop.\n")
    _model_tables(result, cpu_only, out)
    main = {r["contender"]: r for r in result["models"][0]["rows"]}
    _compression(result, main, out)
    _disk(result, main, out)
    _reading(result, main, out)
    return "\n".join(out)


def _model_tables(result: dict, cpu_only: bool, out: list[str]) -> None:
    for m in result["models"]:
        rows = {r["contender"]: r for r in m["rows"]}
        base = rows["none"]
        t = m["timing"]
        out.append(f"### {m['model']}, seq {m['seq']}\n")
        out.append(f"Timing: {load_line(t, result['machine']['cores'])}\n")
        out.append("| contender | block activations | vs none | peak (tracker) | peak (predicted) | error | "
                   "peak RSS growth (physical) | fwd+bwd (wall) | vs none (wall) | vs none (CPU time) |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in m["rows"]:
            c = r["contender"]
            pred = r.get("predicted_peak")
            err = f"{(pred / r['peak'] - 1) * 100:+.2f}%" if pred else "–"
            removed = 1 - r["block_activations"] / base["block_activations"]
            mark = " *" if cpu_only and any(k in c for k in OFFLOADED_TO_HOST) else ""
            timed = c in t["wall"]
            out.append(
                f"| {c}{mark} | {fmt_bytes(r['block_activations'])} | -{removed * 100:.0f}% | "
                f"{fmt_bytes(r['peak'])} | {fmt_bytes(pred) if pred else '–'} | {err} | {fmt_bytes(r['rss_growth'])} | "
                + (f"{fmt_spread(t['wall'][c])} | {fmt_ratio(paired_ratio(t, c, 'none'))} | "
                   f"{fmt_ratio(paired_ratio(t, c, 'none', 'cpu'))} |" if timed else "not timed | | |")
            )
        out.append("")


def _compression(result: dict, main: dict, out: list[str]) -> None:
    g = result["grad_error"]
    tl = result["train_loss"]
    runs = tl["runs"]
    ratio = main["none"]["block_activations"] / main["none+compress:int8"]["block_activations"]
    out.append("### Compression\n")
    first = result["models"][0]["model"]
    out.append(f"int8 (per-block absmax) keeps the blocks' saved activations of the {first} **{ratio:.2f}x** smaller "
               "than fp32 (measured over the blocks, including the small tensors left uncompressed). "
               "Relative gradient error (‖g − g_exact‖ / ‖g_exact‖ over all parameters, one batch): "
               + ", ".join(f"{k} {v:.2e}" for k, v in g.items()) + ".\n")
    out.append(f"Default `memfit train` run ({tl['steps']} steps, same seed): final validation loss "
               f"{runs['none']['final_val_loss']:.4f} uncompressed, {runs['none+compress:int8']['final_val_loss']:.4f} "
               f"with int8 — {tl['rel_diff'] * 100:.2f}% apart.\n")


def _disk(result: dict, main: dict, out: list[str]) -> None:
    d = result["raw_disk"]
    out.append("### Disk spill\n")
    out.append("| | write | read |")
    out.append("|---|---:|---:|")
    out.append(f"| raw disk, {d['mib']} MiB sequential (write fsync'd / read with page cache dropped) | "
               f"{d['write_fsync_Bps'] / 2**20:.0f} MiB/s | {d['read_uncached_Bps'] / 2**20:.0f} MiB/s |")
    out.append(f"| raw disk, buffered write (page cache) | {d['write_buffered_Bps'] / 2**20:.0f} MiB/s | |")
    for name in ("full+offload:disk", "none+offload:disk"):
        o = main.get(name, {}).get("offload")
        if o and o["write_seconds"] > 0 and o["read_seconds"] > 0:
            out.append(f"| spill threads, `{name}` ({fmt_bytes(o['spilled_bytes'])} in {o['files']} files per step) | "
                       f"{o['spilled_bytes'] / o['write_seconds'] / 2**20:.0f} MiB/s | "
                       f"{o['read_bytes'] / o['read_seconds'] / 2**20:.0f} MiB/s |")
    out.append("")


def _reading(result: dict, main: dict, out: list[str]) -> None:
    from activations import TORCH_CKPT

    first = result["models"][0]["model"]
    one_block = main["none"]["block_activations"] / result["models"][0]["blocks"]
    disk_row = main["full+offload:disk"]
    out.append(
        f"With every block input on disk (`full+offload:disk`), the blocks keep {fmt_bytes(disk_row['block_activations'])} "
        f"on the device after forward — one block's saved activations are {fmt_bytes(one_block)} — and the step's "
        f"peak is {fmt_bytes(disk_row['peak'])} against {fmt_bytes(main['full']['peak'])} for `full`. "
        "Spill throughput is per thread-second of the write and read calls (buffered by the page cache, as the "
        "spill files are: they are deleted after one read, so they are never forced to the device).\n"
    )
    sel, full = main["selective"], main["full"]
    t0 = result["models"][0]["timing"]
    pr = lambda c: fmt_ratio(paired_ratio(t0, c, "none"))  # noqa: E731
    out.append(
        f"What it shows: on the {first}, `selective` removes "
        f"{(1 - sel['block_activations'] / main['none']['block_activations']) * 100:.0f}% of the blocks' activation "
        f"memory for {pr('selective')} step time, `full` removes "
        f"{(1 - full['block_activations'] / main['none']['block_activations']) * 100:.0f}% for {pr('full')} "
        f"(PyTorch's own checkpoint on every block: {pr(TORCH_CKPT)}); the bracket is the range over rounds. "
        + (f"The step's peak (tracker) moves only from {fmt_bytes(main['none']['peak'])} to {fmt_bytes(full['peak'])} "
           "between `none` and `full`: at batch 1 it is set by parameters, gradients and the LM head's logits, "
           "not by the blocks; the blocks' activations are what "
           if full["peak"] > 0.9 * main["none"]["peak"] else
           f"The step's peak (tracker) goes from {fmt_bytes(main['none']['peak'])} with `none` to "
           f"{fmt_bytes(full['peak'])} with `full`; the blocks' activations are what ")
        + "the policies change and what grows with batch and sequence. Every round's times and orders are in the JSON."
    )
