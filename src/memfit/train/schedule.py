"""How long a run is and how fast it learns: the learning-rate schedule and the time-limit fit."""
from __future__ import annotations

import math

CALIBRATION_STEPS = 6
"""Steps timed before a time-limited run first fits its schedule length (the first is warm-up)."""
RECENT = 30
"""A time-limited run refits its schedule length after every step from the last RECENT step times."""


def lr_at(step: int, base: float, warmup: int, horizon: int | None, min_ratio: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then a cosine from `base` to `base * min_ratio` at `horizon`.

    The warm-up is at most a fifth of the run, so a short run (a time limit on a slow machine)
    does not spend itself warming up. `horizon` None (a time-limited run still timing its first
    steps) holds `base` after warm-up.
    """
    if horizon is not None:
        warmup = min(warmup, horizon // 5)
    if step < warmup:
        return base * (step + 1) / warmup
    if horizon is None:
        return base
    progress = min(1.0, max(0.0, (step - warmup) / max(1, horizon - warmup)))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def fit_horizon(step: int, time_limit: float, eval_every: int, elapsed: float, step_seconds: list[float],
                eval_seconds: list[float]) -> int:
    """Steps that fit in the time limit, from the step and evaluation times measured so far.

    Time still to spend = remaining steps * (mean recent step time + amortised evaluation) + one
    final evaluation and a step's worth of slack for the last checkpoint. The mean (not the median)
    of recent steps, because slow phases on a shared machine cost real seconds and pass.
    """
    timed = (step_seconds[1:] or step_seconds)[-RECENT:]  # the first step pays one-off warm-up costs
    per_step = sum(timed) / len(timed)
    per_eval = max(eval_seconds) if eval_seconds else 0.0
    amortised = per_step + (per_eval / eval_every if eval_every else 0.0)
    remaining = time_limit - elapsed - per_eval - per_step
    return step + max(1, int(remaining / amortised))


class Clock:
    """Seconds of training in this session, and the schedule length a time-limited run fits as it goes.

    Without --steps the schedule length is fitted to the time limit: first after a few timed steps,
    then refitted after every step from the recent speed (a shared machine's speed drifts) until
    90% of the time is spent. A resumed run keeps the length its checkpoint fixed.
    """

    def __init__(self, time_limit: float | None, eval_every: int, auto_horizon: bool) -> None:
        import time

        self._now = time.perf_counter
        self.started = self._now()
        self.time_limit, self.eval_every, self.auto_horizon = time_limit, eval_every, auto_horizon
        self.step_seconds: list[float] = []
        self.eval_seconds: list[float] = []

    def elapsed(self) -> float:
        return self._now() - self.started

    def out_of_time(self) -> bool:
        return self.time_limit is not None and self.elapsed() >= self.time_limit

    def refit(self, step: int, horizon: int | None) -> int | None:
        """The schedule length after `step` steps: refitted while calibrating a time-limited run."""
        if not self.auto_horizon or len(self.step_seconds) < CALIBRATION_STEPS:
            return horizon
        elapsed = self.elapsed()
        if horizon is not None and elapsed >= 0.9 * self.time_limit:  # type: ignore[operator]
            return horizon
        return fit_horizon(step, self.time_limit, self.eval_every, elapsed,  # type: ignore[arg-type]
                           self.step_seconds, self.eval_seconds)
