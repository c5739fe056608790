"""memfit.fit(): the fastest configuration whose predicted peak fits a byte budget.

    plan = memfit.fit(model, {"input_ids": x, "labels": x}, budget="300MiB", optimizer="adamw")
    print(plan.summary()); opt = plan.apply(model, lr=3e-4)

Inner problem: per-block actions, solved exactly over the composed estimate (memfit.plan.solve).
Outer search: micro-batch x accumulation at the same global batch, optimizer offload, precision
(only when allowed). Every feasible configuration is ranked by predicted time. The chosen plan is
then checked with a full trace of the step; if that exceeds the budget the solve is repeated with
the bound lowered by the difference.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from memfit.apply.policy import BlockAction, to_string
from memfit.core.errors import ConfigError
from memfit.core.units import format_bytes, parse_bytes
from memfit.measure.blocks import ChainSource, chain_profile, module_source, spec_source
from memfit.measure.compose import ChainProfile
from memfit.measure.formulas import check_precision
from memfit.plan.plan import Plan, parse_allow
from memfit.plan.costs import PlanError, parse_budget as _budget

def _slice_batch(example: Any, micro: int) -> Any:
    if isinstance(example, torch.Tensor):
        return example[:micro] if example.dim() > 0 else example
    if isinstance(example, dict):
        return {k: _slice_batch(v, micro) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return type(example)(_slice_batch(v, micro) for v in example)
    return example


def _batch_of(example: Any) -> int | None:
    if isinstance(example, torch.Tensor):
        return int(example.shape[0]) if example.dim() > 0 else None
    items = example.values() if isinstance(example, dict) else example if isinstance(example, (tuple, list)) else []
    sizes = {b for b in (_batch_of(v) for v in items) if b is not None}
    return sizes.pop() if len(sizes) == 1 else None


class _Problem:
    """The model, how to build chain sources per micro-batch, and the time model."""

    def __init__(self, model: Any, example: Any, loss_fn: Callable | None, batch: int | None, seq: int | None,
                 lora: Any = None):
        self.model, self.example, self.loss_fn, self.seq = model, example, loss_fn, seq
        if isinstance(model, str):
            from memfit.models.spec import parse_model

            self.spec = parse_model(model)
            if lora is not None:
                self.spec = replace(self.spec, lora=lora)
            self.name = self.spec.name
            self.seq = seq or min(self.spec.seq or 1024, 4096)
            self.batch = batch or 1
        else:
            self.spec = None
            self.name = type(model).__name__ if hasattr(model, "parameters") else getattr(model, "__name__", "model")
            self.batch = _batch_of(example) or 1

    def source(self, micro: int) -> ChainSource:
        """The chain source of one micro-batch, its step holding the output as the loop does."""
        from memfit.plan.loop_step import loop_source

        if self.spec is not None:
            src = spec_source(self.spec, micro, self.seq)
        else:
            src = module_source(self.model, _slice_batch(self.example, micro), self.loss_fn)
        return loop_source(self, src, micro, self.keep_output)

    def digest(self) -> str:
        """What identifies the model beyond its name: its configuration (a spec), else its parameters'
        names and shapes (a module); sha256, 16 hex digits."""
        import hashlib

        if self.spec is not None:
            text = repr(self.spec.config) if self.spec.config is not None else _config_text(self.spec)
            if self.spec.lora is not None and self.spec.config is not None:
                text += repr(self.spec.lora)
        elif isinstance(self.model, torch.nn.Module):
            text = repr([(n, tuple(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()])
        else:
            text = getattr(self.model, "__qualname__", repr(self.model))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def example_for(self, micro: int) -> Any:
        return _slice_batch(self.example, micro)

    def tokens(self, micro: int) -> int:
        if self.spec is not None:
            return micro * self.seq
        ex = _slice_batch(self.example, micro)
        from memfit.plan.loop_step import tensor_leaves

        first = next((t for t in tensor_leaves(ex) if t.dim() >= 1), None)
        return int(first.shape[0] * (first.shape[1] if first.dim() > 1 else 1)) if first is not None else micro


def _config_text(spec: Any) -> str:
    """A Hugging Face config file's contents (sorted JSON), else the spec's repr."""
    import json
    from pathlib import Path

    try:
        return json.dumps(json.loads(Path(spec.hf_config).read_text()), sort_keys=True) + repr(spec.lora)
    except (OSError, TypeError, ValueError):
        return repr(spec)


def _device_of(model: Any) -> str:
    if isinstance(model, torch.nn.Module):
        p = next(iter(model.parameters()), None)
        if p is not None and p.device.type != "meta":
            return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_digest(model: str, lora: Any = None) -> str:
    """The configuration digest a plan of the named model (with LoRA adapters) records (Plan.model_digest)."""
    if isinstance(lora, str):
        from memfit.models.lora import parse_lora

        lora = parse_lora(lora)
    return _Problem(model, None, None, None, None, lora).digest()


def _check_weights(problem: _Problem, limit: int, precision: str, allowed: tuple[str, ...]) -> None:
    """Refuse, before any trace, a budget below the weights alone (in the smallest precision the search
    may take): a trace-free bound, so a mistyped budget fails in a moment instead of after the search."""
    from memfit.measure.formulas import bytes_per_param

    if problem.spec is not None:
        n = problem.spec.num_params()
    elif isinstance(problem.model, torch.nn.Module):
        n = sum(p.numel() for p in problem.model.parameters())
    else:
        return  # a factory: building it to count would cost what the check saves
    precisions = [precision] + (["bf16-master"] if "precision" in allowed else [])
    weights = n * min(bytes_per_param(p).weights for p in precisions)
    if problem.spec is not None and problem.spec.lora is not None and problem.spec.lora.base == "nf4":
        weights = n // 2  # 4 bits a weight: a lower bound (the head, embeddings and scales hold more)
    if weights > limit:
        raise PlanError(f"budget {format_bytes(limit)} is too small: the weights alone need {format_bytes(weights)} "
                        f"({n:,} parameters); shard them over more devices or train a smaller model")


def fit(model: Any, example: Any = None, budget: Any = None, *, optimizer: str = "adamw",
        precision: str = "32-true", allow: Any = None, loss_fn: Callable | None = None,
        batch: int | None = None, seq: int | None = None, verify: bool = True, costs: Any = None,
        device: str | None = None, keep_output: bool = True, gpus: int | str | None = None,
        interconnect: Any = None, host_memory: Any = None, lora: Any = None, qlora: bool = False) -> Plan:
    """Plan `model` (a module, a zero-argument factory, or a model name/spec for the CLI) to fit `budget`.

    `gpus`: N or "auto" plans a cluster of devices of `budget` each over `interconnect` (nvlink, pcie, ib
    or GB/s) and returns a ClusterPlan (docs/planner.md, "Cluster plans"); `batch` is then the global batch.
    `device`: where it trains (default: the module's parameters' device; for a name, cuda when available,
    else cpu). On a CPU device the default `allow` leaves out host offload (docs/planner.md).
    `keep_output`: the loop holds the model's output (logits, a Hugging Face KV cache) through backward,
    as `out = model(**batch); out.loss.backward()` does, until its next forward returns; pass False
    when it drops the output before backward (memfit.plan.loop_step).
    A named GPU as `device` (h100, a100-80gb, ...: memfit.core.gpus) plans for it from any machine: its
    kernels and caching allocator in the full-trace check, `budget` by default its capacity less the CUDA
    context, `precision` by default bf16-master (else 32-true).
    `host_memory`: the host RAM the plan may use (per node with `gpus`): optimizer and activation offload
    live there, and on a CPU device the whole step does; default this machine's RAM (a cluster of GPUs:
    2 TiB per node). A plan that needs more is not chosen (memfit.plan.host_memory).
    `lora` ("r=16,targets=q_proj,v_proj" or a LoraConfig; a model name or spec only) plans a LoRA fine-tune of
    the frozen model; `qlora=True` (or base=nf4 in `lora`) with its base in NF4 (memfit.models.qlora)."""
    lora = _lora_of(model, lora, qlora, gpus)
    from memfit.core.gpus import target

    gpu = target(device)
    precision_note = None
    if precision is None:
        precision = gpu.default_precision if gpu is not None else "32-true"
        if gpu is not None:
            precision_note = f"precision {precision}: the default on {gpu.name}; pass precision= to change"
    if budget is None and gpu is not None:
        budget = gpu.memory - gpu.context
    device = gpu.name if gpu is not None else device
    if budget is None:
        raise ConfigError("give a budget, e.g. budget='8GiB'")
    if gpus is not None:  # several devices: a ClusterPlan (memfit.plan.cluster_fit)
        from memfit.plan.cluster_fit import plan_cluster

        return plan_cluster(model, budget, gpus, interconnect=interconnect, batch=batch, seq=seq, precision=precision,
                            optimizer=optimizer, allow=allow, device=device or "cuda", verify=verify,
                            host_memory=host_memory)
    limit = _budget(budget)
    device = device or _device_of(model)
    allowed = parse_allow(allow, device)
    check_precision(precision)
    if not isinstance(model, str):
        from memfit.measure.anymodel import check_example

        check_example(example)
    from memfit.plan.host_memory import host_limit

    problem = _Problem(model, example, loss_fn, batch, seq, lora)
    problem.keep_output = bool(keep_output)
    problem.host_limit, problem.host_source = host_limit(host_memory, device)
    _check_weights(problem, limit, precision, allowed)
    problem.costs = costs  # memfit.profile BlockCosts measured at the full batch, or None for the FLOP model
    problem.device = device
    from memfit.core.progress import progress

    with progress(f"planning {problem.name}"):
        plan = _search(problem, limit, allowed, optimizer, precision, verify)
    plan.device, plan.keep_output, plan.seq = device, problem.keep_output, problem.seq
    plan.global_batch, plan.model_digest = problem.batch, problem.digest()
    if precision_note:
        plan.notes.append(precision_note)
    if allow is None and device == "cpu":
        plan.notes.append("on a CPU device the default leaves out offload-cpu and optimizer-offload (host memory "
                          "is the same RAM); name them in allow to plan them anyway")
    plan.fit_args = dict(model=model, example=example, budget=limit, optimizer=optimizer, precision=precision,
                         allow=allowed, loss_fn=loss_fn, batch=batch, seq=seq, verify=verify, costs=costs, device=device,
                         keep_output=keep_output, host_memory=host_memory, lora=lora)
    plan.notes += _lora_notes(lora)
    return plan


def _search(problem: Any, limit: int, allowed: Any, optimizer: str, precision: str, verify: bool) -> Plan:
    """memfit.plan.search, with a model that is not a chain of identical blocks refused in one line."""
    from memfit.measure.timeline import NotAChain
    from memfit.plan.search import search

    try:
        return search(problem, limit, allowed, optimizer, precision, verify)
    except NotAChain as exc:
        why = str(exc)
        if problem.spec is None and hasattr(problem.model, "parameters"):
            from memfit.measure.blocks import chain_mismatch

            why = chain_mismatch(problem.model) or why  # alike blocks: the chain broke elsewhere (exc says where)
        raise PlanError(f"memfit.fit plans each repeated block of a chain of identical blocks; {problem.name}: "
                        f"{why}. Estimate it with memfit.estimate, and checkpoint its blocks with "
                        f"memfit.checkpoint(model, 'full') or a policy of your own") from None


def _lora_notes(lora: Any) -> list[str]:
    """What a LoRA plan trains, and what a 4-bit base gives up."""
    if lora is None:
        return []
    base = ": the frozen base in NF4 (4-bit, quantization error in the base's outputs)" if lora.base == "nf4" else ""
    return [f"LoRA r={lora.r} on {', '.join(lora.targets)}{base}"]


def _lora_of(model: Any, lora: Any, qlora: bool, gpus: Any) -> Any:
    """The LoraConfig of a plan, or None; refused where memfit cannot add the adapters."""
    from memfit.models.lora import parse_lora, with_nf4_base

    if qlora:
        lora = with_nf4_base(lora)
    if lora is None:
        return None
    if not isinstance(model, str):
        raise ConfigError("lora= applies to a model name, spec or config.json; add the adapters to your module "
                          "(e.g. peft.get_peft_model) and pass it")
    if gpus is not None:
        raise ConfigError("LoRA plans are for one device; drop gpus= (or --gpus)")
    return parse_lora(lora) if isinstance(lora, str) else lora
