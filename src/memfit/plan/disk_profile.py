"""Disk offload in the composed estimate: exact, including the read-ahead that couples neighbours.

In backward, the first unpack of a block whose saved tensors were moved off the device (cpu or disk)
starts reading back the nearest earlier moved block (`ActivationStore._prefetch_before`). When that
earlier block p went to disk, its restore buffers (R_p bytes) are allocated inside the later block's
backward stretch and stay live through every block between them, until p's own backward consumes
them. So a moved block's backward stretch depends on the kind of the previous moved block (when it
is a disk block), and a disk block's own backward depends on whether a later moved block reads it
ahead (`pf`, prefetched) or it reads itself lazily. Every other stretch is the base profile's.

A `DiskProfile` holds the base ChainProfile plus, traced on short chains: each disk kind's forward,
every backward variant (kind, pf, previous disk kind or None), the end corrections of disk kinds,
and R per disk kind. `compose` walks the chain as ChainProfile.compose does. Moved segments (cpu
offload of a recomputed segment) are composed only where no pending disk read-ahead precedes them;
disk kinds are single blocks. docs/planner.md has the derivation the solver (plan/disk_solve.py) uses.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Sequence

from memfit.apply.policy import BlockAction, segments
from memfit.measure.compose import ChainProfile, Composed, _where, base_of, fwd_kinds, walk
from memfit.measure.chain_ends import AROUND
from memfit.measure.timeline import ZERO, Stretch, vadd, vscale

KEEP = BlockAction("keep")
_NONE = Stretch(ZERO, ZERO)


def is_disk(a: BlockAction) -> bool:
    return a.offload == "disk"


def disk_bases(allow: Sequence[str]) -> list[BlockAction]:
    """The disk actions `allow` permits: what a kept block saves, or a recomputed block's input."""
    if "offload-disk" not in allow:
        return []
    out = [BlockAction("keep", offload="disk")]
    if "recompute" in allow:
        out.append(BlockAction("recompute", offload="disk"))
    return out


def coupling(actions: Sequence[BlockAction]) -> list[tuple[bool, str | None]]:
    """Per block: (read ahead by a later moved block, kind of the disk block it reads ahead or None).

    Moved regions are the units of `ActivationStore` groups (a segment's input belongs to its first
    block; the read-ahead starts in its last block's backward, where the input is unpacked)."""
    regions = segments(actions)
    out: list[tuple[bool, str | None]] = [(False, None)] * len(actions)
    prev: str | None = None
    moved = [r for r in regions if actions[r[0]].offload]
    for k, r in enumerate(moved):
        a = actions[r[0]]
        pf = k + 1 < len(moved) and is_disk(a)
        out[r[-1]] = (pf, prev)
        prev = str(base_of(a)) if is_disk(a) else None
    return out


@dataclass
class DiskProfile:
    """A ChainProfile extended with disk kinds and the read-ahead coupling (exact, see the module doc)."""

    base: ChainProfile
    fwd: dict[str, Stretch]
    bwd: dict[tuple[str, bool, str | None], Stretch]
    """(kind, read ahead, previous disk kind) -> backward stretch of a moved block (cpu kinds: pf False)."""
    first: dict[tuple[str, bool], tuple[Stretch, Stretch]]
    last: dict[str, tuple[Stretch, Stretch]]
    restore: dict[str, int] = field(default_factory=dict)
    """R per disk kind: bytes its read-back allocates (live from the read-ahead to its own backward)."""
    first_around: dict[tuple[str, bool], dict[str, Stretch]] = field(default_factory=dict)
    """Per disk kind first (and read ahead or not): what the stretches around the blocks differ by from
    the base composition's; `last_around` likewise per disk kind last (as ChainProfile's)."""
    last_around: dict[str, dict[str, Stretch]] = field(default_factory=dict)
    seconds: float = 0.0

    def __getattr__(self, name: str):
        # Everything around the blocks (start, stretches, per-block growth) is the base profile's.
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def supports(self, actions: Sequence[BlockAction]) -> bool:
        """Disk kinds are single blocks; a moved segment must not claim a pending disk read-ahead."""
        if not self.base.supports([KEEP if is_disk(a) else a for a in actions]):
            return False
        couple = coupling(actions)
        for r in segments(actions):
            a = actions[r[0]]
            pf, prev = couple[r[-1]]
            if not a.offload or (not is_disk(a) and prev is None):
                continue
            if len(r) > 1 or (str(base_of(a)), pf, prev) not in self.bwd:
                return False
        return True

    def variant(self, a: BlockAction, pf: bool, prev: str | None) -> Stretch | None:
        """The backward stretch of a single moved block, or None when it is the base profile's."""
        if not a.offload or (not is_disk(a) and prev is None):
            return None
        return self.bwd[(str(base_of(a)), pf, prev)]

    def stretches(self, actions: Sequence[BlockAction]) -> tuple[list[str], list[Stretch], list[Stretch]]:
        """Forward kind, forward and backward stretch of every block, ends included."""
        n = len(actions)
        plain = [KEEP if is_disk(a) else a for a in actions]
        kinds, fwd, bwd = self.base.keys(plain)
        kinds = fwd_kinds(actions)
        couple = coupling(actions)
        for r in segments(actions):
            i, a = r[0], actions[r[0]]
            if is_disk(a):
                fwd[i] = self.fwd[kinds[i]]
            v = self.variant(a, *couple[i]) if len(r) == 1 else None
            if v is not None:
                bwd[i] = v
        for i, table in ((0, "first"), (n - 1, "last")):
            a = actions[i]
            if is_disk(a):
                f, b = self.first[(kinds[0], couple[0][0])] if i == 0 else self.last[kinds[-1]]
            else:
                f, b = getattr(self.base, table)[kinds[i]]
            fwd[i], bwd[i] = fwd[i] + f, bwd[i] + b
        return kinds, fwd, bwd

    def compose(self, actions: Sequence[BlockAction]) -> Composed:
        """The step's peak with `actions` (disk blocks included), by the walk of ChainProfile.compose."""
        if not any(is_disk(a) for a in actions):
            return self.base.compose(actions)
        if not self.supports(actions):
            raise ValueError(f"the disk profile does not compose {[str(a) for a in actions]}")
        base, n = self.base, len(actions)
        kinds, fwd, bwd = self.stretches(actions)
        extra = n - base.traced_blocks
        start = vadd(base.start, vscale(base.start_per_block, extra))
        counts: dict[str, int] = {}
        for k in kinds:  # autocast's deferred frees (weight casts, never saved): a disk kind's are its mode's
            k = k.replace("+offload:disk", "")
            counts[k] = counts.get(k, 0) + 1
        # what the end blocks' kinds change around the blocks
        fa = self.first_around.get((kinds[0], coupling(actions)[0][0])) if is_disk(actions[0]) else \
            base.first_around.get(kinds[0])
        la = self.last_around.get(kinds[-1]) if is_disk(actions[-1]) else base.last_around.get(kinds[-1])
        seq = [base._part(name, extra, counts, fa, la) for name in ("pre_fwd", "post_fwd")]
        seq = [seq[0], *fwd, seq[1], base._part("post_bwd", extra, counts, fa, la), *bwd[::-1],
               *(base._part(name, extra, counts, fa, la) for name in ("pre_bwd", "opt"))]
        best, best_j, block_peaks = walk(start, seq, n)
        return Composed(best, base._at(start, seq, best_j, n), block_peaks, _where(best_j, n))

    def peak_of(self, actions: Sequence[BlockAction]) -> int:
        return self.compose(actions).peak


def walks(disk: Sequence[BlockAction], cpu: Sequence[BlockAction]) -> list[list[BlockAction]]:
    """Sequences of moved kinds whose traces cover every backward variant (see `trace_disk`).

    A walk m1..mr measures (m_i, read ahead iff i < r and disk, previous = m_{i-1} if disk): one long
    walk covers every read-ahead variant and every cpu kind after each disk kind; a disk kind read
    lazily must end a walk, so each (disk kind, previous) pair not yet measured gets a short walk."""
    if not disk:
        return []
    main: list[BlockAction] = []
    for p in disk:
        for x in cpu:
            main += [p, x]
        for d in disk:
            main += [p, d]
    main.append(disk[0])  # so the last pair's second block is read ahead too
    out = [main]
    seen = set(_measured(main))
    for d in disk:
        for prev in [None, *disk]:
            if (str(d), False, None if prev is None else str(prev)) not in seen:
                out.append([d] if prev is None else [prev, d])
    return out


def _measured(walk: Sequence[BlockAction]) -> list[tuple[str, bool, str | None]]:
    out = []
    for i, m in enumerate(walk):
        prev = walk[i - 1] if i and is_disk(walk[i - 1]) else None
        out.append((str(m), i + 1 < len(walk) and is_disk(m), None if prev is None else str(prev)))
    return out


def trace_disk(src, base: ChainProfile, disk: Sequence[BlockAction], precision: str, optimizer: str,
               device: str = "cpu") -> DiskProfile:
    """Trace the disk kinds' stretches on short chains (keep blocks at both ends) around `base`."""
    import time

    from memfit.measure.compose import _trace

    t0 = time.perf_counter()
    cpu = [BlockAction(m, offload="cpu") for m in ("keep", "recompute") if str(BlockAction(m, offload="cpu")) in base.fwd]
    run = (precision, optimizer, device)
    restore = restore_bytes(src, base, disk, precision, optimizer, device)  # (its traces are walks below too)
    fwd, bwd = {}, {}
    for walk in walks(disk, cpu):
        t = _walk_trace(src, walk, run)
        for i, key in enumerate(_measured(walk)):
            fwd.setdefault(key[0], t.fwd[i + 1])
            if is_disk(walk[i]) or key[2] is not None:
                bwd.setdefault(key, t.bwd[i + 1])
    first, last, fa, la = {}, {}, {}, {}
    plain = getattr(base, "unchunked", base)  # the traces below run the plain LM head
    for d in disk:
        key = str(d)
        lazy = _trace(src.build_k, 3, src.step, [d, KEEP, KEEP], *run)
        first[(key, False)] = (lazy.fwd[0] - fwd[key], lazy.bwd[0] - bwd[(key, False, None)])
        pair = _trace(src.build_k, 3, src.step, [d, KEEP, d], *run)
        first[(key, True)] = (pair.fwd[0] - fwd[key], pair.bwd[0] - bwd[(key, True, None)])
        last[key] = (pair.fwd[-1] - fwd[key], pair.bwd[-1] - bwd[(key, False, key)])
        # Around the blocks: a disk end changes the embedding's or the head's stretches (the lone
        # trace has its disk block first only, a third one last only; the pair splits by difference).
        fa[(key, False)] = _around(plain, lazy, [d, KEEP, KEEP])
        la[key] = _around(plain, _trace(src.build_k, 3, src.step, [KEEP, KEEP, d], *run), [KEEP, KEEP, d])
        both = _around(plain, pair, [d, KEEP, d])
        fa[(key, True)] = {n: both.get(n, _NONE) - la[key].get(n, _NONE) for n in set(both) | set(la[key])}
    for key in [k for k in _WALKS if k[:2] == (src.key, run)]:  # (kept only until the profile is)
        del _WALKS[key]
    return DiskProfile(base, fwd, bwd, first, last, restore, fa, la, time.perf_counter() - t0)


def _walk_trace(src, walk: Sequence[BlockAction], run: tuple):
    """The trace of a walk between two kept blocks, kept in this process (restore_bytes and trace_disk
    share two of them)."""
    from memfit.measure.compose import _trace

    key = (src.key, run, tuple(str(a) for a in walk))
    if key not in _WALKS:
        # Only the blocks' stretches of a walk are read: its step runs without the optimizer's update.
        _WALKS[key] = _trace(src.build_k, len(walk) + 2, src.step, [KEEP, *walk, KEEP], *run, update=not WALKS_NO_UPDATE)
    return _WALKS[key]


WALKS_NO_UPDATE = os.environ.get("MEMFIT_WALK_UPDATE", "") != "1"
"""A walk's traced step leaves out the optimizer's update, about a third of its operations (MEMFIT_WALK_UPDATE=1
keeps it; tests/test_plan_speed_shortcuts.py compares the blocks' stretches with and without)."""


_WALKS: dict[tuple, object] = {}


def restore_bytes(src, base: ChainProfile, disk: Sequence[BlockAction], precision: str, optimizer: str,
                  device: str = "cpu") -> dict[str, int]:
    """R per disk kind d: its lone block read lazily ([d]) allocates its read-back in its own backward,
    the first of a pair ([d, d]) in the second's; the difference of the two backward stretches. Two
    short traces per kind (both are walks of trace_disk), or the disk profile's when it is cached."""
    got = _CACHE.get(_key(src, base, disk, precision, optimizer)) or _load(_key(src, base, disk, precision, optimizer),
                                                                          base)
    if got is not None:
        return dict(got.restore)
    run = (precision, optimizer, device)
    out = {}
    for d in disk:
        lazy, pair = _walk_trace(src, [d], run), _walk_trace(src, [d, d], run)
        out[str(d)] = lazy.bwd[1].net_bytes - pair.bwd[1].net_bytes
    return out


def _around(base: ChainProfile, t, actions: Sequence[BlockAction]) -> dict[str, Stretch]:
    """What trace t's stretches around the blocks differ by from the base composition's for `actions`
    (disk kinds counted as their mode for the deferred frees, as DiskProfile.compose counts them)."""
    counts: dict[str, int] = {}
    for k in fwd_kinds(actions):
        k = k.replace("+offload:disk", "")
        counts[k] = counts.get(k, 0) + 1
    extra = len(actions) - base.traced_blocks
    out = {name: getattr(t, name) - base._part(name, extra, counts) for name in AROUND}
    return {n: s for n, s in out.items() if s != _NONE}


def disk_profile(src, base: ChainProfile, disk: Sequence[BlockAction], precision: str, optimizer: str) -> DiskProfile:
    """`trace_disk`, cached in this process per chain source and disk kinds. The disk stretches are traced
    on the chain source alone, so one trace serves every base profile of it with the same cpu kinds (a
    base with a chunked head grafted on included: the head's stretches are the base's)."""
    key = _key(src, base, disk, precision, optimizer)
    got = _CACHE.get(key) or _load(key, base)
    if got is None:
        got = trace_disk(src, base, disk, precision, optimizer)
        _store(key, got)
    _CACHE[key] = got
    return got if got.base is base else replace(got, base=base)


def _key(src, base: ChainProfile, disk: Sequence[BlockAction], precision: str, optimizer: str) -> tuple:
    return src.key + (precision, optimizer, tuple(str(d) for d in disk), tuple(sorted(base.fwd)))


# On disk (memfit.measure.chain_cache's key and folder): the traced parts, not the base profile, which
# is cached on its own. Dicts keyed by tuples are stored as [key, value] pairs.
def _to_json(dp: DiskProfile) -> dict:
    pair = lambda t: [t[0].to_json(), t[1].to_json()]  # noqa: E731
    parts = lambda d: {n: s.to_json() for n, s in d.items()}  # noqa: E731
    return {"fwd": {k: v.to_json() for k, v in dp.fwd.items()},
            "bwd": [[list(k), v.to_json()] for k, v in dp.bwd.items()],
            "first": [[list(k), pair(v)] for k, v in dp.first.items()],
            "last": {k: pair(v) for k, v in dp.last.items()}, "restore": dp.restore,
            "first_around": [[list(k), parts(v)] for k, v in dp.first_around.items()],
            "last_around": {k: parts(v) for k, v in dp.last_around.items()}}


def _from_json(d: dict, base: ChainProfile) -> DiskProfile:
    st = Stretch.from_json
    pair = lambda v: (st(v[0]), st(v[1]))  # noqa: E731
    parts = lambda v: {n: st(s) for n, s in v.items()}  # noqa: E731
    return DiskProfile(base, fwd={k: st(v) for k, v in d["fwd"].items()},
                       bwd={tuple(k): st(v) for k, v in d["bwd"]},
                       first={tuple(k): pair(v) for k, v in d["first"]},
                       last={k: pair(v) for k, v in d["last"].items()},
                       restore={k: int(v) for k, v in d["restore"].items()},
                       first_around={tuple(k): parts(v) for k, v in d["first_around"]},
                       last_around={k: parts(v) for k, v in d["last_around"].items()})


def _load(key: tuple, base: ChainProfile) -> DiskProfile | None:
    from memfit.core import cache
    from memfit.measure.chain_cache import disk_key

    dk = disk_key(key)
    hit = cache.load(dk, "disk-chains") if dk is not None else None
    try:
        return _from_json(hit["profile"], base) if hit is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def _store(key: tuple, dp: DiskProfile) -> None:
    from memfit.core import cache
    from memfit.measure.chain_cache import disk_key

    dk = disk_key(key)
    try:
        if dk is not None:
            cache.store(dk, {"profile": _to_json(dp)}, "disk-chains")
    except OSError:  # a read-only or full cache folder only costs the next run a trace
        pass


_CACHE: dict[tuple, DiskProfile] = {}
