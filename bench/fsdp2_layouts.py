"""torch's FSDP2 layouts and memfit's own ZeRO per rank: `memfit estimate` against the measured peak.

    PYTHONPATH=src python bench/fsdp2_layouts.py

On 2 gloo ranks, for memfit's GPT, a Hugging Face Llama and GPT-2 (4 blocks of hidden 64, vocab 256,
batch 4 x seq 128 per rank, AdamW, 32-true): FSDP2 (memfit.distributed.fsdp2: fully_shard per block,
reshard_after_forward True or False) without checkpointing, with torch's checkpoint_wrapper on each
block, and (Hugging Face models) with gradient_checkpointing_enable; memfit's flat ZeRO-3 without and
with `--checkpoint full`. FSDP2 is measured with torch's MemTracker (it sees FSDP2's storage
resizes), memfit's engine with memfit's tracker; both the third step's peak per rank. The estimate is
`memfit estimate MODEL --engine fsdp2 --reshard-after-forward R --world N --checkpoint P` for FSDP2 and
`--strategy zero3` for memfit's engine; the rows estimated with `--checkpoint full` under
checkpoint_wrapper are issue 34's finding. On 4 ranks, reshard_after_forward 2 (a 1/2 shard of each
block kept from forward to backward) beside True and False. Memory
figures are byte counts (the same on every run): one run. tests/fsdp2_grid.py holds the cases.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import save  # noqa: E402
import fsdp2_grid as grid  # noqa: E402

BATCH, SEQ, HIDDEN, LAYERS, VOCAB = 4, 128, 64, 4, 256
COMMAND = "PYTHONPATH=src python bench/fsdp2_layouts.py"


def models(folder: Path) -> dict[str, str]:
    import transformers as tf

    configs = {
        "llama": tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                max_position_embeddings=SEQ, architectures=["LlamaForCausalLM"]),
        "gpt2": tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=SEQ,
                              architectures=["GPT2LMHeadModel"]),
    }
    out = {"memfit GPT": f"gpt:layers={LAYERS},hidden={HIDDEN},heads=4,vocab={VOCAB},seq={SEQ}"}
    for name, cfg in configs.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "config.json").write_text(cfg.to_json_string())
        out[f"HF {name}"] = str(folder / name / "config.json")
    return out


def cases(paths: dict[str, str]) -> list[grid.Case]:
    out = []
    for family, path in paths.items():
        hf = family.startswith("HF")
        for reshard in (True, False):
            out += [grid.Case(path, reshard, w, BATCH, SEQ) for w in ("none", "checkpoint_wrapper")]
        out.append(grid.Case(path, True, "checkpoint_wrapper", BATCH, SEQ, policy="full"))  # the finding
        if hf:
            out.append(grid.Case(path, True, "hf", BATCH, SEQ))
        out += [grid.Case(path, True, w, BATCH, SEQ, "memfit") for w in ("none", "full")]
    return out


def main() -> None:
    from memfit.distributed.spawn import run_world

    with tempfile.TemporaryDirectory() as tmp:
        paths = models(Path(tmp))
        family = {v: k for k, v in paths.items()}
        todo = cases(paths)
        measured = run_world(grid.tracked, 2, (todo,), timeout_s=1800)
        rows = grid.errors(todo, 2, measured)
        # reshard_after_forward as an int needs a world it divides: 2 of 4 ranks, beside True and False
        wide = [grid.Case(paths[f], r, "none", BATCH, SEQ) for f in ("memfit GPT", "HF llama") for r in (True, 2, False)]
        rows += grid.errors(wide, 4, run_world(grid.tracked, 4, (wide,), timeout_s=1800))
    for r in rows:
        r["model"] = family[r["model"]]
    save("fsdp2_layouts", {"command": COMMAND, "batch_per_rank": BATCH, "seq": SEQ, "hidden": HIDDEN,
                           "layers": LAYERS, "vocab": VOCAB, "world": "2 (the last rows 4)", "rows": rows})


def _layout(row: dict) -> str:
    return "memfit zero3" if row["engine"] == "memfit" else f"FSDP2 reshard_after_forward={row['reshard']}"


def _estimated_as(row: dict) -> str:
    if row["engine"] == "memfit":
        return f"--strategy zero3 --checkpoint {row['policy']}"
    return f"--engine fsdp2 --reshard-after-forward {str(row['reshard']).lower()} --checkpoint {row['policy']}"
_CKPT = {"none": "none", "checkpoint_wrapper": "torch checkpoint_wrapper", "hf": "HF gradient_checkpointing_enable",
         "full": "memfit full"}


def _table(result: dict) -> str:
    lines = ["| model | ranks | layout | checkpointing | estimated as | estimate (B/rank) | measured (B/rank) | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['world']} | {_layout(r)} | {_CKPT[r['wrapper']]} | {_estimated_as(r)} | "
                     f"{r['estimate']:,} | {max(r['measured']):,} | {max(r['error'], key=abs):+.2%} |")
    return "\n".join(lines)


def render(result: dict) -> str:
    from render import machine_line  # bench/render.py

    return "\n".join([
        "## FSDP2 layouts per rank against the estimate", "", f"`{result['command']}`", "",
        f"{result['layers']} blocks of hidden {result['hidden']}, batch {result['batch_per_rank']} x seq "
        f"{result['seq']} per rank, AdamW, 32-true, {result['world']} gloo ranks (docs/distributed.md).", "",
        _table(result), "", machine_line(result), ""])


def snippets(result: dict) -> dict[str, str]:
    return {"fsdp2_layouts": _table(result) + f"\n\n`{result['command']}`"}


if __name__ == "__main__":
    main()
