"""The chosen cluster plan's largest rank, checked by a full trace through memfit's per-rank estimate.

    traced_peak(spec, layout, seq, actions)  -> bytes

zero2/zero3 on FSDP2 (Layout.engine): memfit.measure.fsdp2_estimate of the rank's micro-batch.
none / ddp / zero1-3: one memfit.estimate of the rank's micro-batch (every moment of backward) with the plan's per-block actions
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
        virtual = {"virtual_stages": lay.virtual_stages} if lay.schedule == "interleaved" else {}
        rows = pipeline_ranks(spec, b, seq, lay.pp, lay.accum, lay.schedule, checkpoint=_CHECKPOINT[mode], **common,
                              **virtual)
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
    from memfit.measure.rank_estimate import _peak_block

    if lay.engine == "fsdp2" and lay.strategy in ("zero2", "zero3"):  # as FSDP2 runs it (one micro-batch)
        from memfit.measure.fsdp2_estimate import fsdp2_estimate

        return fsdp2_estimate(estimate, spec, lay.rows, seq, lay.dp, checkpoint=to_string(actions),
                              reshard=lay.strategy == "zero3", **common).per_device["total"]

    # One trace: backward's moments, traced with a stateless optimizer (sgd) so that each moment is
    # a backward one, whose activations the strategy's rank keeps; rank_totals puts every moment on
    # the rank's model states (the plan's optimizer state included: rank_model_state below). The
    # optimizer step's moment is model states alone, exact by formula on both sides. Offload takes
    # the rank's optimizer state and gradients (under ZeRO its shares) off the device.
    # (a -master mode's fp32 master copy is optimizer state: its -true twin computes the same way)
    prec = lay.precision.replace("-master", "-true")
    est = estimate(spec, batch=lay.rows, seq=seq, checkpoint=to_string(actions), precision=prec, optimizer="sgd")
    d = dict(est.per_device)
    if lay.strategy == "none":
        states = rank_model_state(spec.on_meta(seq), "ddp", 1, **common)[0]
        return d["total"] + (0 if lay.offload_optimizer else states["optimizer"]) - \
            (d["grads"] if lay.offload_optimizer else 0)
    states = rank_model_state(spec.on_meta(seq), lay.strategy, max(lay.dp, 1), **common)
    if lay.offload_optimizer:  # each rank offloads its own shard (ZeRO-Offload)
        states = [{**r, "optimizer": 0, "grads": 0 if lay.zero >= 2 else r["grads"]} for r in states]
    rows = rank_totals(states, d, est.module_activations, lay.rows * seq, peak_block=_peak_block(est.modules),
                       moments=est.moments)
    step = max(r["params"] + r["gathered"] + r["grads"] + r["optimizer"] for r in states)
    return max(step, max(r["total"] + _held(lay, states[0]["grads"], r["grads"]) for r in rows))


def _held(lay: Layout, rank_grads: int, moment_grads: int) -> int:
    """Gradient bytes a later micro-batch's backward holds beyond the one-micro-batch moment's: every
    gradient of the earlier micro-batches (ZeRO-2/3: the rank's reduced shard, beside the gradients
    being made), none without accumulation."""
    if lay.accum <= 1:
        return 0
    return rank_grads if lay.zero >= 2 else max(rank_grads - moment_grads, 0)
