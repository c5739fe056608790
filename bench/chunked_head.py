"""The chunked LM head: the step's peak with the head in k chunks, and what it costs in time.

    python bench/chunked_head.py            # GPT-2 small at batch 1 x seq 1024 (traced), timings
    python bench/chunked_head.py --quick    # a small head-bound GPT only

Peaks: the steady-state peak of a training step (fp32, AdamW) traced under FakeTensorMode, which
equals the tracker on a real step (tests/test_plan_chunked_head.py); the small model is also
measured on a real step. Time: the head and loss alone (forward + backward of the hidden states
and the head weight) at the planner bench's head shapes (GPT-2 small: 1024 tokens x 768 x 50257; its
HF Llama: 1024 x 256 x 32000), plain against chunked, interleaved in shuffled order (bench/common.py),
on `--threads` threads (1 by default: the figures then depend less on what else the machine runs).
"k chunks" sum the weight gradient in the forward (fp32, three head GEMMs); "weight gradient in
backward" is the four-GEMM path (`early_weight_grad=False`, taken in 16-bit or with a bias); "k chunks,
recomputed" is the path backward takes when the loss's upstream gradient is not the one the forward
expected (`expect_grad`). Writes bench/results/chunked_head.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import fmt_spread, interleaved, load_line, paired_ratio, run_line, save  # noqa: E402

from memfit.apply.chunked_head import chunked_cross_entropy, reference_cross_entropy  # noqa: E402
from memfit.apply.gemm_blocking import cpu_k_block  # noqa: E402
from memfit.apply.head_swap import chunk_head  # noqa: E402
from memfit.measure.trace import measure_step, trace_step  # noqa: E402
from memfit.models.spec import parse_model  # noqa: E402

CHUNKS = (None, 2, 4, 8, 16)


def peaks(name: str, batch: int, seq: int, real: bool) -> dict:
    spec = parse_model(name)
    out = {}
    for c in CHUNKS:
        build = lambda c=c: chunk_head(spec.build(seq=seq), c)  # noqa: E731
        t = trace_step(build, batch=batch, seq=seq)
        row = {"traced_peak": t.peak, "breakdown": t.breakdown()}
        if real:
            row["measured_peak"] = measure_step(build, batch=batch, seq=seq, allocator=False).peak
        out[str(c or "plain")] = row
    return {"model": name, "batch": batch, "seq": seq, "precision": "32-true", "optimizer": "adamw", "peaks": out}


TIMED = (2, 4, 8, 16)
SHAPES = {"gpt2": (1024, 768, 50257), "llama": (1024, 256, 32000)}
QUICK_SHAPE = (256, 64, 8192)


def head_times(n: int, h: int, v: int, rounds: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) * 0.02).requires_grad_()
    y = torch.randint(0, v, (n,))

    def run(chunks, expect="auto", early=True):
        def go():
            loss = reference_cross_entropy(x, w, y) if chunks is None else \
                chunked_cross_entropy(x, w, y, chunks=chunks, expect_grad=expect, early_weight_grad=early)
            torch.autograd.grad(loss, [x, w])
        return go

    contenders = {"plain": run(None), **{f"{k} chunks": run(k) for k in TIMED},
                  "8 chunks, weight gradient in backward": run(8, early=False), "8 chunks, recomputed": run(8, None)}
    res = interleaved(contenders, rounds=rounds)
    ratios = {kind: {k: paired_ratio(res, k, "plain", kind) for k in contenders if k != "plain"}
              for kind in ("wall", "cpu")}
    return {"tokens": n, "hidden": h, "vocab": v, "threads": torch.get_num_threads(), **res, "ratio": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.quick and cpu_k_block() is None:
        # the fit (fit_constants) times both head paths; without the forward-summed one the "k chunks" rows
        # would run the four-GEMM path and the fit would price the wrong path
        print("bench/chunked_head.py skipped: this CPU's fp32 GEMM has no bitwise reduction block "
              "(memfit.apply.gemm_blocking.cpu_k_block), so the chunked head cannot sum its weight gradient in the "
              "forward here and plan/head.py's fit needs both paths; bench/results/chunked_head.json kept as it is",
              file=sys.stderr)
        return
    small = "gpt:layers=2,hidden=64,heads=4,vocab=8192,seq=256"
    payload = {"small": peaks(small, 1, 256, real=True)}
    if not args.quick:
        payload["gpt2"] = peaks("gpt2", 1, 1024, real=False)
    shapes = {"quick": QUICK_SHAPE} if args.quick else SHAPES
    payload["head_time"] = {k: head_times(*shape, rounds=args.rounds) for k, shape in shapes.items()}
    path = save("chunked_head", payload)
    for key in ("small", "gpt2"):
        if key in payload:
            p = payload[key]["peaks"]
            print(key, {k: round(r["traced_peak"] / 2**20, 2) for k, r in p.items()}, "MiB")
    for key, t in payload["head_time"].items():
        print(key, {k: round(s["median"], 3) for k, s in t["wall"].items()}, "s")
    print(path)


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def _table(r: dict) -> list[str]:
    small, big = r["small"], r.get("gpt2")
    cols = ([f"GPT-2 small, batch {big['batch']} x seq {big['seq']} (traced)"] if big else []) + \
        [f"small GPT, batch {small['batch']} x seq {small['seq']} (traced)", "same, measured on a real step"]
    lines = ["| head | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for k, row in small["peaks"].items():
        label = "plain" if k == "plain" else f"{k} chunks"
        cells = ([_mib(big["peaks"][k]["traced_peak"])] if big else []) + \
            [_mib(row["traced_peak"]), _mib(row["measured_peak"])]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _times(r: dict) -> list[str]:
    lines = []
    for t in r["head_time"].values():
        lines += [f"| head + loss, forward and backward ({t['tokens']} tokens x {t['hidden']} hidden x {t['vocab']} "
                  f"vocab, {t['threads']} thread{'s' if t['threads'] > 1 else ''}) | wall, median (min–max) | "
                  "against plain, same round | process CPU time | against plain, same round |", "|---|---|---|---|---|"]
        for name, s in t["wall"].items():
            rel = [t["ratio"][kind].get(name) for kind in ("wall", "cpu")]
            rel = ["1.00x" if q is None else f"{q['median']:.2f}x ({q['min']:.2f}–{q['max']:.2f})" for q in rel]
            lines.append(f"| {name} | {fmt_spread(s)} | {rel[0]} | {fmt_spread(t['cpu'][name])} | {rel[1]} |")
        lines += ["", load_line(t), ""]
    return lines[:-1]


def fit_constants(r: dict) -> dict[str, float]:
    """plan/head.py's time-model constants fitted to the process CPU medians of `r` (every shape).

    A head GEMM's time G is the plain head's over three (its three GEMMs are most of its time). Per
    shape: the per-chunk cost is the least-squares slope of the "k chunks" times over k, in tokens of
    one head GEMM (G / tokens); the four-GEMM path's extra is its time over the plain head's, less its
    8 chunks' cost, in head GEMMs. Shapes are averaged. The per-chunk cost is held at least 1 token,
    so that fewer chunks rank first among otherwise equal plans when the slope is below noise; the
    "k chunks" path's own saving over the plain head (negative here: the plain head page-faults fresh
    N x vocab tensors) is reported, not credited."""
    chunk, extra, saving = [], [], []
    for t in r["head_time"].values():
        cpu = {k: v["median"] for k, v in t["cpu"].items()}
        gemm, tokens = cpu["plain"] / 3, t["tokens"]
        ks = sorted(int(k.split()[0]) for k in cpu if k.endswith(" chunks"))
        ys = [cpu[f"{k} chunks"] for k in ks]
        mk, my = sum(ks) / len(ks), sum(ys) / len(ys)
        slope = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sum((k - mk) ** 2 for k in ks)
        chunk.append(slope / (gemm / tokens))
        extra.append((cpu["8 chunks, weight gradient in backward"] - cpu["plain"] - 8 * slope) / gemm)
        saving.append((my - slope * mk - cpu["plain"]) / gemm)
    return {"EXTRA_GEMMS": round(sum(extra) / len(extra), 2),
            "CHUNK_TOKENS": max(1, round(sum(chunk) / len(chunk))),
            "chunk_tokens_fit": round(sum(chunk) / len(chunk), 1),
            "early_gemms_fit": round(sum(saving) / len(saving), 2)}


def _fit_sentence(r: dict) -> str:
    c = fit_constants(r)
    return (f"Fitted to the process CPU times below (`fit_constants` in bench/chunked_head.py, run {r['date']}): "
            f"EXTRA_GEMMS = {c['EXTRA_GEMMS']} head GEMMs on the four-GEMM path; a per-chunk cost of "
            f"{c['chunk_tokens_fit']} tokens' worth of a head GEMM, below noise, so CHUNK_TOKENS = "
            f"{c['CHUNK_TOKENS']} (the floor that ranks fewer chunks first); with dW summed in the forward the "
            f"head measured {c['early_gemms_fit']} head GEMMs against the plain one, a saving the model does not "
            "credit. tests/test_plan_chunked_head.py checks plan/head.py's constants equal this fit.")


def snippets(r: dict) -> dict[str, str]:
    text = "\n".join([f"From `python bench/chunked_head.py`, run {r['date']}; peaks of a training step, fp32, AdamW "
                      f"(small GPT: `{r['small']['model']}`).", "", *_table(r), "", *_times(r)])
    return {"chunked_head": text, "chunked_head_summary": _summary(r), "chunked_head_fit": _fit_sentence(r)}


def _summary(r: dict) -> str:
    """The CPU-time ratios of the tables above, as one sentence: the range of the chunked heads'
    medians (every shape, 2 to 16 chunks) and of the recompute path's."""
    cpu = [t["ratio"]["cpu"] for t in r["head_time"].values()]
    chunked = [q[k]["median"] for q in cpu for k in q if k.endswith(" chunks")]
    recompute = [q["8 chunks, recomputed"]["median"] for q in cpu if "8 chunks, recomputed" in q]
    return (f"On one thread, by process CPU time (the wall times above also count the time a loaded machine gave "
            f"to other processes): {min(chunked):.2f}-{max(chunked):.2f}x the plain head at 2 to 16 chunks, against "
            f"{min(recompute):.2f}-{max(recompute):.2f}x on the recompute path (backward recomputes the gradient wrt "
            "the hidden states, as when the upstream gradient is not the expected one).")


def render(r: dict) -> str:
    return "\n".join(["## Chunked LM head (`bench/chunked_head.py`)", "", snippets(r)["chunked_head"], "",
                      run_line(r)])


if __name__ == "__main__":
    main()
