"""`memfit train --budget SIZE` / `--plan FILE`: plan the run to fit, train it, report peak against budget."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from memfit.apply.policy import to_string
from memfit.core.errors import ConfigError
from memfit.core.units import format_bytes
from memfit.plan.plan import Plan


def load_plan(path: str) -> Plan:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read plan file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"plan file {path} is not JSON ({exc.msg}); write it with `memfit plan ... --json`") from None
    return Plan.from_json(data.get("plan", data) if isinstance(data, dict) else data)


def plan_config(cfg: Any, budget: str | None = None, plan_file: str | None = None, allow: str | None = None):
    """The run's TrainConfig with the plan's actions, micro-batch x accumulation, precision, offload and head chunks."""
    from memfit.models.spec import parse_model

    if budget is not None and plan_file is not None:
        raise ConfigError("give --budget (plan now) or --plan FILE (a saved plan), not both")
    if plan_file is not None:
        plan = load_plan(plan_file)
        name = parse_model(cfg.model).name
        if plan.model != name:
            raise ConfigError(f"plan file {plan_file} is for model {plan.model!r}; this run trains {name!r}")
    else:
        from memfit.plan.fit import fit

        precision = "32-true" if cfg.precision == "auto" else cfg.precision
        plan = fit(cfg.model, budget=budget, optimizer=cfg.optimizer, precision=precision, allow=allow,
                   batch=cfg.batch * cfg.accum, seq=cfg.seq)
    cfg = dataclasses.replace(cfg, checkpoint=to_string(plan.actions), batch=plan.micro_batch,
                              accum=plan.accumulation, precision=plan.precision,
                              offload_optimizer=plan.offload_optimizer or "none", head_chunks=plan.head_chunks)
    return cfg, plan


def report(run_dir: Path, plan: Plan) -> str:
    """Add the plan and the measured peak against the budget to metrics.json; the summary lines."""
    path = Path(run_dir) / "metrics.json"
    metrics = json.loads(path.read_text())
    step = (metrics.get("memory") or {}).get("step_breakdown") or {}
    measured = step.get("peak_bytes")
    metrics["budget"] = {"budget_bytes": plan.budget, "predicted_peak_bytes": plan.predicted_peak,
                         "measured_peak_bytes": measured, "plan": plan.to_json()}
    path.write_text(json.dumps(metrics, indent=1))
    verdict = "" if measured is None else (
        f"measured step peak {format_bytes(measured)} ({'within' if measured <= plan.budget else 'OVER'} budget)")
    return f"{plan.summary()}\n  {verdict}".rstrip()
