"""`memfit train --budget SIZE` / `--plan FILE`: plan the run to fit, train it, report peak against budget.

--plan FILE: the run takes its whole shape from the plan (sequence, micro-batch x accumulation,
precision, optimizer, per-block actions, optimizer offload, head chunks). An option that says
otherwise is refused in one line; one that agrees is accepted.

--budget SIZE: the run's shape (global batch = --batch x --accum, --seq, --precision, --optimizer)
is the plan's input, and the plan chooses the rest (the split into micro-batches, the per-block
actions, the head chunks and, where --allow permits, optimizer offload and the precision). So
--checkpoint and --offload-optimizer, which the plan chooses, are refused with a hint to --allow.

After the run the measured step peak is compared with the budget: over it, the run folder and its
metrics.json (plan, predicted and measured peaks) are kept and `memfit train` exits OVER_BUDGET.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from memfit.apply.policy import to_string
from memfit.core.errors import ConfigError
from memfit.core.units import format_bytes
from memfit.plan.plan import Plan

OVER_BUDGET = 3
"""Exit code of a run whose measured step peak ended over its budget (its run folder is kept)."""
CHOSEN_BY_BUDGET = {"checkpoint": "recompute,selective,offload-cpu,offload-disk",
                    "offload_optimizer": "optimizer-offload", "step_in_backward": "step-in-backward"}
"""Options --budget chooses itself, and the --allow names that let (or stop) it choose them."""


def load_plan(path: str) -> Plan:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read plan file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"plan file {path} is not JSON ({exc.msg}); write it with `memfit plan ... --json`") from None
    return Plan.from_json(data.get("plan", data) if isinstance(data, dict) else data, f"plan file {path}")


def plan_config(cfg: Any, budget: str | None = None, plan_file: str | None = None, allow: str | None = None,
                given: Any = ()) -> tuple[Any, Plan]:
    """The run's TrainConfig with the plan's shape and actions. `given`: the TrainConfig fields the
    user set (the command line's options), checked against the plan."""
    given = set(given)
    if budget is not None and plan_file is not None:
        raise ConfigError("give --budget (plan now) or --plan FILE (a saved plan), not both")
    if plan_file is not None:
        plan = load_plan(plan_file)
        if "model" not in given:  # the plan names its model (a name, spec or config path memfit reads)
            cfg = dataclasses.replace(cfg, model=plan.model)
        _check_plan_file(cfg, plan, plan_file, given)
        seq = plan.seq or cfg.seq
    else:
        if allow is not None and "allow" not in given:
            given.add("allow")
        for name, names in CHOSEN_BY_BUDGET.items():
            if name in given:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} is chosen by --budget; drop it (or give --plan FILE), and use --allow to "
                                  f"say what the plan may use (its names for this: {names})")
        from memfit.plan.fit import fit

        precision = "32-true" if cfg.precision == "auto" else cfg.precision
        # memfit train's loop drops the model's output before backward (train.step.loss_sum).
        plan = fit(cfg.model, budget=budget, optimizer=cfg.optimizer, precision=precision, allow=allow,
                   batch=cfg.batch * cfg.accum, seq=cfg.seq, keep_output=False, lora=cfg.lora)
        plan.notes.append(f"--budget kept the run's global batch {cfg.batch * cfg.accum} (--batch {cfg.batch} x "
                          f"--accum {cfg.accum}), --seq {cfg.seq} and --optimizer {cfg.optimizer}; it chose the "
                          "split, the per-block actions, the head" + (f" and {plan.precision} over --precision "
                          f"{precision} (allowed)" if plan.precision != precision else f" (--precision {precision} kept)"))
        seq = cfg.seq
    cfg = dataclasses.replace(cfg, checkpoint=to_string(plan.actions), batch=plan.micro_batch,
                              accum=plan.accumulation, precision=plan.precision, seq=seq, optimizer=plan.optimizer,
                              offload_optimizer=plan.offload_optimizer or "none", head_chunks=plan.head_chunks,
                              step_in_backward=plan.step_in_backward)
    if plan.step_in_backward and "clip" not in given:
        cfg = dataclasses.replace(cfg, clip=None)  # the plan gives up global clipping (its notes say so)
    return cfg, plan


def _check_plan_file(cfg: Any, plan: Plan, path: str, given: set[str]) -> None:
    """Refuse, in one line, a model the plan is not for and any option that contradicts the plan."""
    from memfit.models.spec import parse_model

    name = parse_model(cfg.model).name
    if plan.model != name:
        raise ConfigError(f"plan file {path} is for model {plan.model!r}; this run trains {name!r}")
    if plan.model_digest:
        from memfit.plan.fit import model_digest

        if model_digest(cfg.model, cfg.lora) != plan.model_digest:
            raise ConfigError(f"plan file {path} was made for another configuration of {name!r} (config digest "
                              f"{plan.model_digest}); plan it again for this one")
    shape = f"{plan.micro_batch} x {plan.accumulation}" + (f", seq {plan.seq}" if plan.seq else "")
    conflicts = []
    if given & {"batch", "accum"} and cfg.batch * cfg.accum != plan.micro_batch * plan.accumulation:
        conflicts.append(f"--batch {cfg.batch} x --accum {cfg.accum} (the plan: {shape})")
    if "seq" in given and plan.seq and cfg.seq != plan.seq:
        conflicts.append(f"--seq {cfg.seq} (the plan: {plan.seq})")
    if "checkpoint" in given and cfg.checkpoint != to_string(plan.actions):
        conflicts.append(f"--checkpoint {cfg.checkpoint} (the plan: {to_string(plan.actions)})")
    if "precision" in given and cfg.precision not in ("auto", plan.precision):
        conflicts.append(f"--precision {cfg.precision} (the plan: {plan.precision})")
    if "optimizer" in given and cfg.optimizer != plan.optimizer:
        conflicts.append(f"--optimizer {cfg.optimizer} (the plan: {plan.optimizer})")
    if "offload_optimizer" in given and cfg.offload_optimizer != (plan.offload_optimizer or "none"):
        conflicts.append(f"--offload-optimizer {cfg.offload_optimizer} (the plan: {plan.offload_optimizer or 'none'})")
    if "step_in_backward" in given and cfg.step_in_backward != plan.step_in_backward:
        conflicts.append(f"--step-in-backward (the plan: {'on' if plan.step_in_backward else 'off'})")
    if conflicts:
        raise ConfigError(f"{'; '.join(conflicts)} conflict{'s' if len(conflicts) == 1 else ''} with plan file "
                          f"{path}: drop {'it' if len(conflicts) == 1 else 'them'} (the run takes its shape from the "
                          "plan), or plan again with `memfit plan ... --json`")


def report(run_dir: Path, plan: Plan) -> tuple[str, str | None]:
    """Add the plan and the measured peak against the budget to metrics.json: (the summary lines, the
    one-line verdict when the measured peak is over the budget, else None)."""
    path = Path(run_dir) / "metrics.json"
    metrics = json.loads(path.read_text())
    step = (metrics.get("memory") or {}).get("step_breakdown") or {}
    measured = step.get("peak_bytes")
    over = measured is not None and measured > plan.budget
    metrics["budget"] = {"budget_bytes": plan.budget, "predicted_peak_bytes": plan.predicted_peak,
                         "traced_peak_bytes": plan.measured_peak, "measured_peak_bytes": measured,
                         "over_budget": over, "plan": plan.to_json()}
    path.write_text(json.dumps(metrics, indent=1))
    verdict = "" if measured is None else (
        f"measured step peak {format_bytes(measured)} ({'OVER' if over else 'within'} budget)")
    lines = f"{plan.summary()}\n  {verdict}".rstrip()
    if not over:
        return lines, None
    return lines, (f"memfit train: the measured step peak {format_bytes(measured)} is over the budget "
                   f"{format_bytes(plan.budget)} by {format_bytes(measured - plan.budget)}; run folder {run_dir} "
                   "kept (metrics.json: plan, predicted and measured peaks)")
