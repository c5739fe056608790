"""A step's live-bytes timeline, cut into stretches: before the blocks, each block, after them.

A `TimelineTracker` is a MemoryTracker that also records, at every op and every peak check, the
live device bytes (per category) and which repeated block was running. `stretches()` cuts the last
step's record into the canonical sequence

    pre-fwd, block 0 .. L-1 fwd, head fwd + loss, head bwd, block L-1 .. 0 bwd, pre bwd, optimizer

and reduces each stretch to two vectors relative to the live bytes when it began: its peak and its
net change (up to where the next stretch begins, so frees between stretches belong to the one
before). Memory is additive along the chain, which is what lets memfit.measure.compose rebuild the
whole step's peak from one traced block per action.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.core.tracker import CATEGORIES, MemoryTracker

_DEVICE = torch.ops.prim.device.default

N_CAT = len(CATEGORIES)
Vec = tuple  # bytes per category, CATEGORIES order


def vadd(a: Vec, b: Vec) -> Vec:
    return tuple(x + y for x, y in zip(a, b))


def vsub(a: Vec, b: Vec) -> Vec:
    return tuple(x - y for x, y in zip(a, b))


def vscale(a: Vec, k: int) -> Vec:
    return tuple(x * k for x in a)


ZERO: Vec = (0,) * N_CAT


@dataclass(frozen=True)
class Stretch:
    """One part of a step: live bytes at its peak and at its end, both relative to its start; `busy`:
    at its point with the most activations + temporaries (the peak's when not given), the moment that
    is highest once every gradient is held beside it (memfit.distributed.rank_memory.BUSIEST)."""

    peak: Vec
    net: Vec
    busy: Vec = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.busy is None:
            object.__setattr__(self, "busy", self.peak)
        # Totals are read in every composition walk: computed once.
        object.__setattr__(self, "peak_bytes", sum(self.peak))
        object.__setattr__(self, "net_bytes", sum(self.net))

    peak_bytes: int = field(init=False, repr=False, compare=False)
    net_bytes: int = field(init=False, repr=False, compare=False)

    def __add__(self, other: "Stretch") -> "Stretch":
        return Stretch(vadd(self.peak, other.peak), vadd(self.net, other.net), vadd(self.busy, other.busy))

    def __sub__(self, other: "Stretch") -> "Stretch":
        return Stretch(vsub(self.peak, other.peak), vsub(self.net, other.net), vsub(self.busy, other.busy))

    def scaled(self, k: int) -> "Stretch":
        return Stretch(vscale(self.peak, k), vscale(self.net, k), vscale(self.busy, k))

    def with_net(self, net: Vec) -> "Stretch":
        return Stretch(self.peak, net, self.busy)

    def to_json(self) -> dict[str, Any]:
        return {"peak": list(self.peak), "net": list(self.net), "busy": list(self.busy)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Stretch":
        return cls(tuple(d["peak"]), tuple(d["net"]), tuple(d.get("busy", d["peak"])))


class TimelineTracker(MemoryTracker):
    """MemoryTracker that records (total, categories, in backward, block index) at every event."""

    def __init__(self, model, optimizer, device, block_names: dict[str, int]) -> None:
        super().__init__(model, optimizer, device)
        self.block_names = block_names
        self.record: list[tuple[int, Vec, bool, int | None]] = []
        self.frees: list[tuple[int, int, int, int]] = []
        """(record index, creating block, bytes, category) of storages made in a block's forward."""
        self._fwd_phase = -1
        self._recording = False  # only the measured step (from reset_peak on) is recorded

    def _tag(self) -> int | None:
        names = self.block_names
        for m in self._current_mods():
            i = names.get(m)
            if i is not None:
                return i
        return None

    def _note(self) -> None:
        if self._recording:
            self.record.append((self.current_bytes, tuple(self._cur), self._in_bw, self._tag()))

    def _check_peak(self) -> None:
        super()._check_peak()
        self._note()

    def _recat(self, e, cat: int) -> None:
        before = tuple(self._cur)
        super()._recat(e, cat)
        # A relabel right after an allocation (a new gradient becomes p.grad) belongs to that moment,
        # which may have been recorded more than once (before and after the op's peak check).
        i = len(self.record) - 1
        while i >= 0 and self.record[i][1] == before:
            total, _, bw, tag = self.record[i]
            self.record[i] = (total, tuple(self._cur), bw, tag)
            i -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # no memory changes; most dispatches of a fake step are this one
            # A fake tensor's device, answered here as FakeTensorMode would (saves a second Python
            # dispatch for each of the thousands of device queries of the autograd engine).
            mode = getattr(args[0], "fake_mode", None) if len(args) == 1 else None
            if mode is not None and not mode.in_kernel_invocation:
                return args[0].fake_device
            return func(*args, **(kwargs or {}))
        self._note()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._note()
        return out

    def reset_peak(self) -> None:
        super().reset_peak()
        self.record.clear()
        self.frees.clear()
        self._fwd_phase = self._phase
        self._recording = True
        self._note()

    def _on_free(self, key: int) -> None:
        e = self._live.get(key)
        if e is not None and e.device and not e.host and e.phase == self._fwd_phase:
            names = self.block_names
            creator = next((names[m] for m in e.mods if m in names), None)
            if creator is not None:
                self.frees.append((len(self.record), creator, e.nbytes, e.cat))
        super()._on_free(key)


@dataclass
class StepStretches:
    start: Vec
    pre_fwd: Stretch
    fwd: list[Stretch]
    post_fwd: Stretch
    post_bwd: Stretch
    bwd: list[Stretch]
    """Indexed by block (not by the order they run in)."""
    pre_bwd: Stretch
    opt: Stretch
    peak: int
    deferred: dict[str, dict[int, Vec]] = None  # type: ignore[assignment]
    """Per stretch around the blocks: bytes it frees that block i's forward made (e.g. autocast's
    cached weight casts of a recomputed block, freed when the autocast region ends)."""
    bw_temps: int = 0
    """Temporaries when backward starts: the tracker then relabels what the forward made and is
    still alive as activations, so only older temporaries remain."""


class NotAChain(Exception):
    """The step's record does not have the canonical shape (e.g. blocks run out of order)."""


def _runs(record: list) -> tuple[list, list[int]]:
    """Consecutive records with the same (backward, block) tag -> (tag, start vec, peak vec, busy vec: the
    most activations + temporaries), and the record index where each run begins."""
    runs: list[list] = []
    first: list[int] = []
    for i, (total, cats, bw, tag) in enumerate(record):
        key = (bw, tag)
        if not runs or runs[-1][0] != key:
            runs.append([key, cats, cats, total, cats])
            first.append(i)
            continue
        run = runs[-1]
        if total > run[3]:
            run[2], run[3] = cats, total
        if cats[3] + cats[4] > run[4][3] + run[4][4]:
            run[4] = cats
    return [(k, s, p, b) for k, s, p, _, b in runs], first


def stretches(tracker: TimelineTracker, n_blocks: int, update: bool = True) -> StepStretches:
    """Cut the last step's record into the canonical stretches (raises NotAChain otherwise). update=False:
    the step had no optimizer update, so the optimizer stretch may be empty."""
    rec = tracker.record
    if not rec:
        raise NotAChain("empty record")
    runs, first = _runs(rec)
    starts = [r[1] for r in runs] + [rec[-1][1]]
    # Runs grouped by tag; untagged runs between two blocks of a phase go to the following block.
    groups: list[list] = []
    for j, ((bw, tag), *_) in enumerate(runs):
        k = ("none", bw) if tag is None else ("blk", bw, tag)
        if groups and groups[-1][0] == k:
            groups[-1][1].append(j)
        else:
            groups.append([k, [j]])
    # A free between records r-1 and r belongs to the run whose net spans it.
    bounds = first[1:] + [len(rec) + 1]
    owner: dict[int, list] = {}
    for r, creator, nbytes, cat in tracker.frees:
        j = bisect.bisect_left(bounds, r)
        owner.setdefault(j, []).append((creator, nbytes, cat))
    return _assemble(groups, runs, starts, n_blocks, tracker.peak_bytes, owner, update)


def _frees_in(idx: list[int], owner: dict[int, list]) -> dict[int, Vec]:
    out: dict[int, list[int]] = {}
    for j in idx:
        for creator, nbytes, cat in owner.get(j, ()):
            v = out.setdefault(creator, [0] * N_CAT)
            v[cat] += nbytes
    return {k: tuple(v) for k, v in out.items()}


def _stretch(idx: list[int], runs, starts) -> Stretch:
    s = starts[idx[0]]
    best = max(idx, key=lambda j: sum(runs[j][2]))
    busy = max(idx, key=lambda j: runs[j][3][3] + runs[j][3][4])
    return Stretch(vsub(runs[best][2], s), vsub(starts[idx[-1] + 1], s), vsub(runs[busy][3], s))


def _assemble(groups, runs, starts, n: int, peak: int, owner: dict, update: bool = True) -> StepStretches:
    fwd_blocks = [g for g in groups if g[0][0] == "blk" and not g[0][1]]
    bwd_blocks = [g for g in groups if g[0][0] == "blk" and g[0][1]]
    if [g[0][2] for g in fwd_blocks] != list(range(n)) or [g[0][2] for g in bwd_blocks] != list(range(n - 1, -1, -1)):
        raise NotAChain("blocks did not run once each, in order, in forward and in reverse in backward")
    pos = {id(g): i for i, g in enumerate(groups)}
    f0, fl = pos[id(fwd_blocks[0])], pos[id(fwd_blocks[-1])]
    b0, bl = pos[id(bwd_blocks[0])], pos[id(bwd_blocks[-1])]

    def idx(lo: int, hi: int) -> list[int]:
        return [j for g in groups[lo:hi] for j in g[1]]

    def block_runs(first: int, last: int) -> list[list[int]]:
        out, pending = [], []
        for g in groups[first:last + 1]:
            pending.extend(g[1])
            if g[0][0] == "blk":
                out.append(pending)
                pending = []
        return out

    fwd = block_runs(f0, fl)
    bwd = block_runs(b0, bl)[::-1]
    head = idx(fl + 1, b0)
    first_bw = next((k for k, j in enumerate(head) if runs[j][0][0]), None)
    if first_bw is None or first_bw == 0:
        raise NotAChain("no head stretch between the last block's forward and its backward")
    tail = idx(bl + 1, len(groups))
    last_bw = max((k for k, j in enumerate(tail) if runs[j][0][0]), default=None)
    if last_bw is None or (last_bw == len(tail) - 1 and update):
        raise NotAChain("no optimizer stretch after backward")
    pre = idx(0, f0)
    if not pre:
        raise NotAChain("no stretch before the first block")
    mk = lambda ix: _stretch(ix, runs, starts) if ix else Stretch(ZERO, ZERO)  # noqa: E731  (no update: none)
    parts = {"pre_fwd": pre, "post_fwd": head[:first_bw], "post_bwd": head[first_bw:],
             "pre_bwd": tail[:last_bw + 1], "opt": tail[last_bw + 1:]}
    deferred = {name: _frees_in(ix, owner) for name, ix in parts.items()}
    return StepStretches(deferred=deferred, 
        start=starts[0], pre_fwd=mk(pre), fwd=[mk(r) for r in fwd], post_fwd=mk(head[:first_bw]),
        post_bwd=mk(head[first_bw:]), bwd=[mk(r) for r in bwd], pre_bwd=mk(tail[:last_bw + 1]),
        opt=mk(tail[last_bw + 1:]), peak=peak, bw_temps=starts[head[first_bw]][-1],
    )
