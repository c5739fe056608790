"""memfit.fit(..., gpus=N or "auto"): the fastest layout on N devices of `budget` each, or the
smallest N with one that fits and the fastest there.

    cp = plan_cluster("llama-2-70b", budget="80GiB", gpus="auto", precision="bf16-master", batch=256)
    print(cp.summary())

The search composes every figure (memfit.plan.cluster_search); the chosen plan's largest rank is
then checked by a full trace (memfit.plan.cluster_verify), and when the trace finds it over the
budget the next fastest is checked instead (at most MAX_REFUSED times).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from memfit.apply.policy import BlockAction
from memfit.core.errors import ConfigError
from memfit.core.units import format_bytes
from memfit.plan.cluster_links import parse_interconnect, topology
from memfit.plan.cluster_memory import Layout, stage_sizes
from memfit.plan.cluster_plan import ClusterPlan, degrees, per_process_batch
from memfit.plan.cluster_search import ClusterProblem, Row, candidates, counts_to_try, host_per_rank, smallest
from memfit.plan.costs import FLOPS, PlanError, parse_budget
from memfit.plan.host_memory import describe, host_limit
from memfit.plan.plan import Plan, parse_allow

DEVICE_FLOPS = {"cuda": 4e14, "cpu": FLOPS}
"""Sustained FLOP/s per device for the FLOP model: on CUDA about 40% of an H100's dense 16-bit peak
(989 TFLOP/s; 32-true runs on TF32 at half that); on CPU the single-device planner's figure."""
DEFAULT_BATCH = 256
MAX_REFUSED = 3


def _basis(flops: float, calibrated: bool, host=None) -> str:
    share = f"; ranks of {host.threads} thread(s) share {host.cores} CPU core(s)" if host is not None else ""
    if host is not None and host.core_share < 1:
        share += f", {host.core_share:.0%} of them theirs at once (measured: the rest is other work's)"
    if host is not None and host.measured:
        return (f"host, measured here: compute {flops / 1e9:.3g} GFLOP/s + {host.overhead_s * 1e3:.3g} ms per block "
                f"and micro-batch, optimizer {host.step_s_per_elem * 1e9:.3g} ns per weight (forward and backward "
                f"timed at 1-8 sequences, the step apart), DTensor {host.tp_pair_s * 1e3:.3g} ms per tensor-parallel "
                f"pair and {host.tp_param_step_s * 1e3:.3g} ms per parameter in the step, pipeline schedule "
                f"{host.pp_gpipe_s * 1e3:.3g} ms (GPipe) / {host.pp_1f1b_s * 1e3:.3g} ms (1F1B) per micro-batch and "
                f"stage, gloo's loopback{share}")
    if calibrated:
        return (f"calibrated: {flops / 1e12:.3g} TFLOP/s per device and the link bandwidth given, measured on this "
                f"machine{share}")
    return (f"FLOP model: {flops / 1e12:.3g} TFLOP/s sustained per device assumed (not measured) and the "
            f"interconnect's published bandwidth; seconds for ranking and sizing, not a measurement{share}")


def actions_of(lay: Layout, layers: int) -> list[BlockAction]:
    """Per block of the whole model: each stage's recomputed blocks first, then selective, then kept."""
    out = []
    for size, (keep, sel, rec) in zip(stage_sizes(layers, lay.pp), lay.counts or [(layers, 0, 0)]):
        out += [BlockAction("recompute")] * rec + [BlockAction("selective")] * sel + [BlockAction("keep")] * keep
    return out


def problem_of(model: Any, budget: Any, interconnect, nodes, batch, seq, precision, optimizer, allow, device,
               flops, cores: int | None = None, host_memory: Any = None) -> ClusterProblem:
    """The search's inputs, checked (a model name or spec with memfit's GPT config; the allow list for
    `device`; the FLOP rate for the time model). On a CPU device the devices are this machine's
    cores (memfit.plan.cluster_host): the ranks share them; with `interconnect` "measured" (or
    "loopback") the link is gloo's here, measured, and compute is calibrated by memfit.profile where
    the model is small enough to build."""
    from memfit.models.spec import parse_model

    spec = parse_model(model) if isinstance(model, str) else model
    if getattr(spec, "config", None) is None and getattr(spec, "hf_config", None) is None:
        raise ConfigError("a cluster plan lays out memfit's GPT or a Hugging Face causal LM: give a known name, a "
                          "gpt:/llama: spec or a config.json, not a module")
    from memfit.plan.cluster_shape import shape_of

    shape_of(spec)  # a config.json that is no causal LM fails here, before any trace
    allowed = parse_allow(allow, device)
    precisions = (precision,) + (("bf16-master",) if "precision" in allowed and precision != "bf16-master" else ())
    seq = seq or min(spec.seq or 1024, 4096)
    host = None
    if device == "cpu":
        host, flops, interconnect = _host(model, spec, seq, precision, optimizer, flops, cores, interconnect)
        nodes = nodes or 1
    parse_interconnect(interconnect)  # fail on a bad name before any work
    host_bytes, host_source = host_limit(host_memory, device, cluster=True)
    rate = flops or DEVICE_FLOPS.get(device, FLOPS) / (2 if precision == "32-true" and device == "cuda" else 1)
    p = ClusterProblem(spec, seq, batch or DEFAULT_BATCH, parse_budget(budget),
                       lambda n: topology(n, interconnect, nodes), precisions, optimizer, allowed, rate, host=host,
                       host_memory=host_bytes, host_source=host_source)
    return p


def _host(model, spec, seq, precision, optimizer, flops, cores, interconnect):
    """(Host, FLOP/s, link) for ranks on this machine's cores; measured unless given."""
    from memfit.plan.cluster_host import calibrate, host_of, loopback

    host = host_of(cores)
    if str(interconnect).lower() not in ("loopback", "measured"):
        return host, flops, interconnect  # the core sharing alone: nothing measured unless asked
    got = calibrate(model if isinstance(model, str) else spec.name, seq, precision, optimizer, host.threads) \
        if flops is None else None
    if got is not None:  # measured here: the fixed costs (blocks', DTensor's, the schedules') come with the rate
        flops = got[0]
        link = loopback()
        host = host_of(host.cores, host.threads, overhead_s=got[1], step_s_per_elem=got[2], measured=True,
                       **{k: link[k] for k in ("tp_pair_s", "tp_param_step_s", "pp_gpipe_s", "pp_1f1b_s",
                                               "core_share")})
    return host, flops, interconnect


def plan_cluster(model: Any, budget: Any, gpus: int | str = "auto", *, interconnect: Any = None,
                 nodes: int | None = None, batch: int | None = None, seq: int | None = None,
                 precision: str = "32-true", optimizer: str = "adamw", allow: Any = None, device: str = "cuda",
                 verify: bool = True, flops: float | None = None, cores: int | None = None,
                 host_memory: Any = None) -> ClusterPlan:
    """The cluster plan (see the module docstring). `batch`: the global batch in sequences (default 256);
    `flops`: sustained FLOP/s per device (measured: the time basis says calibrated); `cores`: on a CPU
    device, the cores the ranks share (default: this machine's); `host_memory`: per node (default: a
    DGX H100 node's 2 TiB on GPUs, this machine's RAM for ranks on its CPU; memfit.plan.host_memory)."""
    from memfit.core.progress import progress

    with progress(f"planning {getattr(model, 'name', model)} on devices"):
        return _plan_cluster(model, budget, gpus, interconnect, nodes, batch, seq, precision, optimizer, allow, device,
                             verify, flops, cores, host_memory)


def _plan_cluster(model, budget, gpus, interconnect, nodes, batch, seq, precision, optimizer, allow, device, verify,
                  flops, cores, host_memory) -> ClusterPlan:
    t0 = time.perf_counter()
    p = problem_of(model, budget, interconnect, nodes, batch, seq, precision, optimizer, allow, device, flops, cores,
                   host_memory)
    if gpus == "auto":
        n, rows = smallest(p)
        if n is None:
            raise PlanError(f"no layout of up to {counts_to_try(p.batch)[-1]} devices fits {format_bytes(p.budget)} "
                            f"with {format_bytes(p.host_memory)} of host memory per node at a global batch of "
                            f"{p.batch}; give a larger --budget, more --host-memory or a smaller --seq")
    else:
        n = int(gpus)
        if n < 1 or p.batch % n:
            raise ConfigError(f"--gpus {gpus}: the global batch of {p.batch} sequences must split over the devices; "
                              f"give --batch a multiple of {gpus}")
        rows = candidates(p, n)
    chosen, notes = _checked(p, rows, verify)
    cp = _result(p, n, chosen, rows, notes, device, flops is not None)
    if gpus == "auto":
        cp.by_count = by_count(p, n, rows)
    cp.seconds = time.perf_counter() - t0
    return cp


def _checked(p: ClusterProblem, rows: list[Row], verify: bool) -> tuple[tuple[Row, int | None], list[str]]:
    from memfit.plan.cluster_verify import traced_peak

    notes = []
    feasible = [r for r in rows if r.feasible]
    if not feasible:
        host = [r for r in rows if r.peak <= p.budget]  # fit the devices, not the host
        if host:
            least = min(host, key=lambda r: r.host)
            raise PlanError(f"no layout on {rows[0].layout.gpus} devices fits: the ones within "
                            f"{format_bytes(p.budget)} per device need at least {format_bytes(least.host)} of host "
                            f"memory per node, more than {format_bytes(p.host_memory)} ({p.host_source}); give "
                            "--host-memory or try --gpus auto")
        least = min(rows, key=lambda r: r.peak) if rows else None
        raise PlanError(f"no layout on {rows[0].layout.gpus if rows else '?'} devices fits {format_bytes(p.budget)}"
                        + (f"; the smallest needs {format_bytes(least.peak)} per rank" if least else "")
                        + "; try --gpus auto")
    for row in feasible[:MAX_REFUSED]:
        if not verify:
            return (row, None), notes
        traced = traced_peak(p.spec, row.layout, p.seq, actions_of(row.layout, p.cfg.layers))
        if traced <= p.budget:
            return (row, traced), notes
        notes.append(f"refused by the full trace ({format_bytes(traced)} > budget): {row.layout.strategy} "
                     f"{degrees(row.layout)}; the next fastest checked")
    raise PlanError(f"no layout fits {format_bytes(p.budget)} once checked by a full trace: " + "; ".join(notes))


def _result(p: ClusterProblem, n: int, chosen, rows, notes, device: str, calibrated: bool) -> ClusterPlan:
    row, traced = chosen
    lay, layers = row.layout, p.cfg.layers
    # the plan's peak: the closed form's, or the full trace's of the largest rank where that is higher (the
    # trace runs the step memfit train runs; the closed form read one 1f1b last stage 3.4% under it)
    peak = max(row.peak, traced or 0)
    b, a = per_process_batch(lay)
    # The per-process plan carries the sequence length every figure was made for: without it
    # `memfit train --plan FILE` ran at its own default --seq and the ranks went over the budget.
    name = p.spec.name if p.spec.config is not None else str(p.spec.hf_config)  # what memfit train launches
    single = Plan(model=p.spec.name, budget=p.budget, actions=actions_of(lay, layers), micro_batch=b, accumulation=a,
                  optimizer=lay.optimizer, precision=lay.precision, offload_optimizer=lay.offload_optimizer,
                  predicted_peak=peak, predicted_time=row.time["total"], n_blocks=layers,
                  head_chunks=lay.head_chunks, measured_peak=traced, device=device, seq=p.seq, global_batch=b * a,
                  keep_output=False, model_digest=_digest(p.spec))
    if lay.strategy == "pipeline":  # the schedule's micro-batches are not memfit train's --accum
        single.notes.append(f"pipeline: a replica's {b * lay.pp} sequences (--batch {b} on each of {lay.pp} stages) "
                            f"run as {lay.accum} micro-batches of {lay.rows} ({lay.schedule})")
    topo = p.topo_of(n)
    link = topo.intra.name + (f" in nodes of {topo.per_node}, {topo.inter.name} between" if topo.nodes > 1 else "")
    if lay.offload_optimizer:
        notes.append(f"optimizer offload: each rank's optimizer state and gradients ({format_bytes(host_per_rank(p, lay))})"
                     " live in host memory")
    host_text = describe(row.host, p.host_memory, p.host_source, " per node")
    if p.cfg.why_not:
        notes.append(p.cfg.why_not)
    return ClusterPlan(model=name, budget=p.budget, gpus=n, layout=dict(lay.__dict__), peak=peak,
                       ranks=row.ranks, time=row.time, tokens_per_s=row.tokens_per_s,
                       time_basis=_basis(p.flops, calibrated, p.host), interconnect=link, global_batch=p.batch, seq=p.seq,
                       plan=single.to_json(), traced_peak=traced, ranked=_ranked(rows), notes=notes,
                       host_memory=p.host_memory, host_need=row.host, host_text=host_text)


def _digest(spec) -> str:
    """The configuration digest memfit train checks a plan file against (memfit.plan.fit.model_digest)."""
    import hashlib

    if spec.config is None:  # a config.json: its sorted contents, as memfit.plan.fit digests it (tested equal)
        import json

        text = json.dumps(json.loads(spec.hf_config.read_text()), sort_keys=True) + repr(spec.lora)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
    return hashlib.sha256(repr(spec.config).encode()).hexdigest()[:16]


def _ranked(rows: list[Row], top: int = 20) -> list[dict]:
    """The `top` fastest rows, then the fastest of each strategy (and pipeline schedule) not among them, so
    that the table shows every kind of layout the search weighed."""
    kind = lambda r: (r.layout.strategy, r.layout.schedule if r.layout.strategy == "pipeline" else "")  # noqa: E731
    return [_brief(r) for r in first_of_each(rows, top, kind)]


def first_of_each(rows: list, limit: int, kind: Callable[[Any], Any]) -> list:
    """The first `limit` rows, then the first row of each kind not among them (rows fastest first)."""
    shown = rows[:limit]
    seen = {kind(r) for r in shown}
    for r in rows[limit:]:
        if kind(r) not in seen:
            seen.add(kind(r))
            shown.append(r)
    return shown


def _brief(r: Row) -> dict:
    lay = r.layout
    b, a = per_process_batch(lay)
    return {"strategy": lay.strategy, "degrees": degrees(lay), "gpus": lay.gpus, "micro_batch": b, "accumulation": a,
            "precision": lay.precision, "offload_optimizer": lay.offload_optimizer, "head_chunks": lay.head_chunks,
            "counts": lay.counts, "peak": r.peak, "feasible": r.feasible, "step_s": r.time["total"],
            "tokens_per_s": r.tokens_per_s, "comm_bytes": r.time["comm_bytes"], "host": r.host}


def by_count(p: ClusterProblem, n: int, rows: list[Row], more: int = 3) -> list[dict]:
    """The best plan at n and at the next `more` counts up that the global batch allows (2n, 4n, ...)."""
    out, k = [], n
    for _ in range(more + 1):
        if p.batch % k:
            break
        got = rows if k == n else candidates(p, k)
        best = next((r for r in got if r.feasible), None)
        if best is not None:
            out.append({**_brief(best), "tokens_per_s_per_device": best.tokens_per_s / k})
        k *= 2
    return out
