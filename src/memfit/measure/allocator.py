"""Allocator-level ground truth: the peak of bytes the allocator handed out, from profiler events.

The tracker (memfit.core.tracker) counts tensor storages; this module does not trust it. With
`profile_memory=True` the c10 CPU allocator (and the CUDA caching allocator) report every
allocation and free to the profiler, including workspaces that kernels allocate and free inside
one op and that never surface as a tensor. Replaying those events gives the live bytes at every
moment and so the peak.

    with AllocatorProfile() as prof:
        model = build()                   # allocate inside: frees of older blocks are not reported
        ...
        with prof.window("step"):
            train_step()
    prof.peak("step")                     # live bytes at the window's highest point

The CPU reporter only knows blocks allocated while a profiler was recording, so everything whose
free falls inside a window should be allocated inside the profile too.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

_PREFIX = "memfit::window::"


@dataclass
class Window:
    name: str
    start_bytes: int
    """Live bytes (allocated inside the profile) when the window opened."""
    peak_bytes: int
    """Highest live bytes while the window was open."""


class AllocatorProfile:
    """Profiles allocator events for `device` ("cpu" or "cuda") and replays them into peaks."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device_type = torch.device(device).type
        self.windows: dict[str, Window] = {}
        self._prof: profile | None = None

    def __enter__(self) -> "AllocatorProfile":
        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._prof is not None
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._replay()

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[None]:
        """A named region whose peak is reported by `peak(name)` after the profile ends."""
        with record_function(_PREFIX + name):
            yield

    def peak(self, name: str) -> int:
        return self.windows[name].peak_bytes

    def _replay(self) -> None:
        from torch._C._profiler import _EventType

        events, marks = [], []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                if f.device.type == self.device_type:
                    events.append((e.start_time_ns, f.alloc_size, f.ptr))
            elif e.tag == _EventType.TorchOp and e.name.startswith(_PREFIX):
                marks.append((e.name[len(_PREFIX):], e.start_time_ns, e.end_time_ns))
        events.sort(key=lambda ev: (ev[0], ev[1] > 0))  # at one timestamp, frees before allocations
        # Live bytes after each event. A free counts only if its block was allocated inside this
        # profile: the CPU reporter also reports frees of blocks it learnt in earlier profiles.
        # An allocation at an address still live replaces that block: an allocator never hands out a
        # live address, so its free went unreported (adding the two counted it twice).
        live: dict[int, int] = {}
        running, times, levels = 0, [], []
        for t, size, ptr in events:
            if size > 0:
                running += size - live.get(ptr, 0)
                live[ptr] = size
            elif ptr in live:
                running -= live.pop(ptr)
            times.append(t)
            levels.append(running)
        for name, start, end in marks:
            before = [lv for t, lv in zip(times, levels) if t < start]
            start_bytes = before[-1] if before else 0
            inside = [lv for t, lv in zip(times, levels) if start <= t <= end]
            self.windows[name] = Window(name, start_bytes, max([start_bytes, *inside]))
