"""`memfit export RUN --out DIR`: one consolidated state dict from a run of any layout.

    DIR/model.pt      the whole model's state dict (torch.load(..., weights_only=True) reads it)
    DIR/export.json   what it is: model spec, step, the layout it was trained in, dtypes
    DIR/optimizer.pt  with --optimizer: per parameter name its optimizer state, and the step
    DIR/config.json + weights   Hugging Face models: save_pretrained as well

A run of several processes (zero1-3, pipeline, tensor) keeps its state in slices; the weights are
whole in checkpoint.pt, and master weights and optimizer state are gathered from the sharded
folder (memfit.train.portable), in one process with no process group.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export",
        help="write a run's checkpoint (any layout) as one consolidated state dict",
        description="Write the model of a `memfit train` run folder as one state dict (model.pt), whatever "
        "layout trained it (one process, ddp, ps, zero1-3, pipeline, tensor); Hugging Face models are also "
        "saved with save_pretrained.",
    )
    p.add_argument("run", metavar="RUN", help="a run folder written by memfit train (or its checkpoint.pt)")
    p.add_argument("--out", metavar="DIR", required=True, help="folder to write (created; files in it are replaced)")
    p.add_argument("--master", action="store_true",
                   help="write the master weights (fp32) of a *-master run instead of the 16-bit weights")
    p.add_argument("--optimizer", action="store_true", help="also write optimizer.pt (per-parameter state and step)")
    return p


def run(args: argparse.Namespace) -> int:
    from memfit.core.errors import ConfigError
    from memfit.train import distributed as dist_train, state as state_mod
    from memfit.train.portable import kind, read_portable
    from memfit.train.resume import check_checkpoint

    path = Path(args.run)
    folder = path.parent if path.is_file() else path
    ckpt = state_mod.load_checkpoint(path)
    check_checkpoint(ckpt, repr(str(path)))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; give a folder")
    weights = {k: v.detach().clone() for k, v in ckpt["model"].items()}
    strategy = ckpt["config"].get("strategy") or "none"
    if args.master or args.optimizer:
        sharded = dist_train.checkpoint_folder(folder, ckpt) if kind(strategy) != "pt" else None
        try:
            portable = read_portable(ckpt, sharded)
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:  # a damaged or foreign folder
            raise ConfigError(f"cannot read the optimizer state of {folder} ({type(exc).__name__}: {exc})"
                              .splitlines()[0]) from None
        masters = {n: s["master"] for n, s in portable.optim.items() if "master" in s}
        if args.master and not masters:
            raise ConfigError("--master: this run kept no master weights (its precision has none); leave --master out")
        if args.master:
            weights.update({n: m.clone() for n, m in masters.items()})
            _retie(weights)
    out.mkdir(parents=True, exist_ok=True)
    state_mod.save_checkpoint(out / "model.pt", weights)
    if args.optimizer:
        state_mod.save_checkpoint(out / "optimizer.pt", {"state": {n: {k: v for k, v in s.items() if k != "master"}
                                                                   for n, s in portable.optim.items()},
                                                         "step": float(portable.step), "scaler": portable.scaler})
    hf = _save_pretrained(ckpt, weights, out)
    info = {"model": ckpt["config"]["model"], "step": ckpt["step"], "strategy": strategy,
            "world": ckpt.get("world"), "precision": ckpt["config"].get("precision"),
            "weights": "master" if args.master else "model",
            "dtypes": sorted({str(v.dtype).replace("torch.", "") for v in weights.values()}),
            "params": sum(v.numel() for k, v in weights.items() if k != "head.weight" or "tok.weight" not in weights),
            "files": ["model.pt"] + (["optimizer.pt"] if args.optimizer else []) + (["save_pretrained"] if hf else [])}
    state_mod.save_json(out / "export.json", info)
    print(f"memfit export: step {ckpt['step']} of {folder} ({strategy}) -> {out}/model.pt"
          + (" and save_pretrained" if hf else "") + f", {len(weights)} tensors, {info['dtypes']}")
    return 0


def _retie(weights: dict) -> None:
    """memfit's GPT ties head.weight to tok.weight: the exported dict keeps them one tensor."""
    if "head.weight" in weights and "tok.weight" in weights:
        weights["head.weight"] = weights["tok.weight"]


def _save_pretrained(ckpt: dict, weights: dict, out: Path) -> bool:
    """Hugging Face models: also save_pretrained (config.json + weights) into `out`."""
    from memfit.train.portable import plain_model

    meta = plain_model(ckpt["config"])
    if not hasattr(meta, "save_pretrained"):
        return False
    model = meta.to_empty(device="cpu")
    model.load_state_dict(weights)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model.save_pretrained(str(out))
    return True
