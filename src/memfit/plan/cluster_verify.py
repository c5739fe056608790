"""The chosen cluster plan's largest rank, checked by a full trace through memfit's per-rank estimate.

    traced_peak(spec, layout, seq, actions)  -> bytes

none / ddp / zero1-3: memfit.estimate of the rank's micro-batch with the plan's per-block actions
(the composed trace for deep models), put on the strategy's shard layout by
memfit.distributed.rank_memory (rank_model_state, rank_totals). pipeline and tensor:
memfit.measure.parallel_estimate (pipeline_ranks traces each stage's step under the plan's one action;
tensor_ranks traces the whole model one TP rank runs). Optimizer offload takes the rank's optimizer
state and gradients off the device (under ZeRO the rank's shares of them). With accumulation a later
micro-batch's backward runs beside the gradients of the earlier ones (measured on 2 gloo ranks: the
one-micro-batch moment alone read 14-18% low under zero2, zero3 and tensor at 2 micro-batches).
"""
from __future__ import annotations

from memfit.apply.policy import to_string
from memfit.plan.cluster_memory import Layout
from memfit.plan.cluster_plan import per_process_batch

_CHECKPOINT = {"keep": "none", "selective": "selective", "recompute": "full"}


def traced_peak(spec, lay: Layout, seq: int, actions: list) -> int:
    """The largest rank's traced peak in bytes."""
    common = dict(precision=lay.precision, optimizer=lay.optimizer)
    if lay.strategy == "pipeline":
        from memfit.measure.parallel_estimate import pipeline_ranks

        mode = actions[0].mode
        b, _ = per_process_batch(lay)
        rows = pipeline_ranks(spec, b, seq, lay.pp, lay.accum, lay.schedule, checkpoint=_CHECKPOINT[mode], **common)
        # each stage's step is traced in the schedule's order (gpipe's first backward, beside every
        # micro-batch's activations, included)
        return max(r["total"] for r in rows)
    if lay.strategy == "tensor":
        from memfit.measure.parallel_estimate import tensor_ranks

        b, _ = per_process_batch(lay)
        rows = tensor_ranks(spec, b, seq, lay.gpus, lay.tp, checkpoint=to_string(actions), **common)
        worst = max(r["total"] for r in rows)
        if lay.accum > 1:  # a later micro-batch's backward beside every gradient of the earlier ones
            bwd = tensor_ranks(spec, b, seq, lay.gpus, lay.tp, checkpoint=to_string(actions), optimizer="sgd",
                               precision=lay.precision.replace("-master", "-true"))
            # (the rank's whole gradients take its weights' bytes in every precision memfit trains)
            worst = max(worst, max(w["total"] - w["grads"] - w["optimizer"] + r["params"] + r["optimizer"]
                                   for w, r in zip(bwd, rows)))
        return worst
    from memfit.distributed.rank_memory import rank_model_state, rank_totals
    from memfit.measure.estimate import estimate

    # Two moments: the optimizer step (the trace as planned) and backward, traced with a stateless
    # optimizer (sgd) so that the one-device peak is backward's, whose activations the strategy's
    # rank keeps; rank_totals puts each on the rank's model states. The device-resident trace is
    # used (deep models take the composed path; an offload trace is not composed): the offloaded
    # optimizer state and gradients are taken off the rank's figures instead.
    states = rank_model_state(spec.on_meta(seq), "ddp" if lay.strategy == "none" else lay.strategy,
                              max(lay.dp, 1), **common)
    if lay.offload_optimizer:  # each rank offloads its own shard (ZeRO-Offload)
        states = [{**r, "optimizer": 0, "grads": 0 if lay.zero >= 2 else r["grads"]} for r in states]
    worst = 0
    # (a -master mode's fp32 master copy is optimizer state: its -true twin computes the same way)
    for opt, prec in ((lay.optimizer, lay.precision), ("sgd", lay.precision.replace("-master", "-true"))):
        est = estimate(spec, batch=lay.rows, seq=seq, checkpoint=to_string(actions), precision=prec, optimizer=opt)
        d, saved = dict(est.per_device), est.module_activations
        if opt == "sgd" and not saved and lay.strategy != "none":
            d, saved = _full_trace(spec, lay.rows, seq, prec, actions)
        if lay.strategy == "none":
            worst = max(worst, d["total"] - d["optimizer"] + states[0]["optimizer"]
                        - (d["grads"] if lay.offload_optimizer else 0))
            continue
        if opt == "sgd":
            d["total"] += states[0]["optimizer"] - d["optimizer"]
        worst = max(worst, max(r["total"] + (_held(lay, states[0]["grads"], r["grads"]) if opt == "sgd" else 0)
                               for r in rank_totals(states, d, saved, lay.rows * seq)))
    return worst


def _held(lay: Layout, rank_grads: int, moment_grads: int) -> int:
    """Gradient bytes a later micro-batch's backward holds beyond the one-micro-batch moment's: every
    gradient of the earlier micro-batches (ZeRO-2/3: the rank's reduced shard, beside the gradients
    being made), none without accumulation."""
    if lay.accum <= 1:
        return 0
    return rank_grads if lay.zero >= 2 else max(rank_grads - moment_grads, 0)


def _full_trace(spec, rows: int, seq: int, precision: str, actions: list) -> tuple[dict, dict]:
    """One step traced in full (the composed estimate keeps no per-module figures, which a ZeRO rank's
    backward peak is made of): per-device categories and the bytes each module saves for backward."""
    from memfit.measure.trace import trace_step

    t = trace_step(spec, rows, seq, precision, "sgd", to_string(actions), steps=1)
    cats = {c: getattr(t, c) for c in ("params", "grads", "optimizer", "activations", "temporaries")}
    return {**cats, "total": t.peak}, dict(t.module_activations)
