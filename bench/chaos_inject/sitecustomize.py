"""bench/chaos.py's kill switch, loaded at start-up by every Python process of a chaos trial (this folder
is put on PYTHONPATH only there). MEMFIT_CHAOS="<rank>:<phase>:<n>" makes that rank SIGKILL itself at
the n-th call of its phase on the first attempt (TORCHELASTIC_RESTART_COUNT 0):

    step        loss.backward (mid-step: forward done, gradients not)
    save        os.fsync (a checkpoint file written, not yet renamed or not yet named by checkpoint.pt)
    collective  a torch.distributed call (all_reduce, reduce_scatter, all_gather, broadcast, send, ...;
                not isend/irecv, which P2POp checks by identity: batch_isend_irecv counts those)

MEMFIT_CHAOS="count:<file>" counts the calls instead; each rank keeps its counts in <file>.<rank>, so
the driver can draw n within the run.
"""
import os

_SPEC = os.environ.get("MEMFIT_CHAOS")
_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast",
                "send", "recv", "all_gather_object", "broadcast_object_list", "barrier",
                "reduce_scatter", "all_to_all_single", "batch_isend_irecv")


def _install() -> None:
    import json
    import signal

    import torch
    import torch.distributed as dist

    counts = {"step": 0, "save": 0, "collective": 0}
    counting = _SPEC.startswith("count:")
    target = None if counting else _SPEC.split(":")

    def hit(phase: str) -> None:
        if os.environ.get("RANK") is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        counts[phase] += 1
        if counting:
            with open(f"{_SPEC.split(':', 1)[1]}.{os.environ['RANK']}", "w") as f:
                json.dump(counts, f)
        elif target is not None and target[0] == os.environ["RANK"] and target[1] == phase \
                and counts[phase] == int(target[2]):
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name: str, phase: str) -> None:
        real = getattr(owner, name, None)
        if real is None:
            return

        def patched(*a, **k):
            hit(phase)
            return real(*a, **k)

        setattr(owner, name, patched)

    wrap(torch.Tensor, "backward", "step")
    wrap(os, "fsync", "save")
    for name in _COLLECTIVES:
        wrap(dist, name, "collective")


if _SPEC:
    _install()
