"""Does memfit's caching-allocator model reproduce the real allocator, given the real requests?

    PYTHONPATH=src python3 bench/gpu_estimate.py --collect DIR     # on a CUDA machine: snapshots
    PYTHONPATH=src python3 bench/gpu_allocator_check.py DIR        # anywhere
    PYTHONPATH=src python3 bench/gpu_allocator_check.py            # the H100 snapshots kept in bench/data

Each snapshot (torch.cuda.memory._snapshot) holds the run's allocations and frees in order, with
the segments cudaMalloc returned. They are replayed through memfit.measure.caching_allocator twice:
with its own segment addresses (what a prediction has) and with the real ones (ties between equal
free blocks go to the lowest address, so only the addresses can differ). The peak reserve of each
replay is compared with the snapshot's.
"""
from __future__ import annotations

import pickle
import sys
import tarfile
from pathlib import Path

from memfit.measure.caching_allocator import CachingAllocatorModel


class _RealAddresses(CachingAllocatorModel):
    def __init__(self, addresses: list[int]) -> None:
        super().__init__()
        self._addresses = addresses

    def _new_segment(self, size: int, small: bool):
        self._next_addr = self._addresses.pop(0)
        return super()._new_segment(size, small)


def check(trace: list[dict]) -> tuple[int, int, int]:
    """(real peak reserve, replay with modelled addresses, replay with the real addresses)."""
    real = peak = 0
    models = [CachingAllocatorModel(), _RealAddresses([e["addr"] for e in trace if e["action"] == "segment_alloc"])]
    for e in trace:
        action = e["action"]
        if action == "segment_alloc":
            real += e["size"]
            peak = max(peak, real)
        elif action == "segment_free":
            real -= e["size"]
        for m in models:
            if action == "alloc":
                m.malloc(e["addr"], e["size"])
            elif action == "free_completed":
                m.free(e["addr"])
    return peak, models[0].peak_reserved, models[1].peak_reserved


KEPT = Path(__file__).resolve().parent / "data" / "h100_allocator_snapshots.tar.xz"


def traces(source: Path) -> dict[str, list[dict]]:
    """Run name -> allocator trace, from a folder of snapshots or a .tar.xz of them."""
    out = {}
    if source.is_dir():
        for f in sorted(source.glob("*.snapshot.pickle")):
            with open(f, "rb") as fh:
                out[f.name.split(".")[0]] = pickle.load(fh)["device_traces"][0]
        return out
    with tarfile.open(source) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.name.endswith(".snapshot.pickle"):
                out[Path(member.name).name.split(".")[0]] = pickle.load(tar.extractfile(member))["device_traces"][0]
    return out


def main() -> None:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else KEPT
    runs = traces(source)
    if not runs:
        raise SystemExit(f"no *.snapshot.pickle in {source}: run bench/gpu_estimate.py --collect DIR on a GPU")
    print(f"{'run':40s} {'real MiB':>10s} {'modelled':>10s} {'err':>7s} {'real addr':>10s}")
    for name, trace in runs.items():
        real, own, addr = check(trace)
        print(f"{name:40s} {real / 2**20:10.1f} {own / 2**20:10.1f} "
              f"{100 * (own - real) / real:+6.2f}% {addr / 2**20:10.1f}")


if __name__ == "__main__":
    main()
