"""A wall-clock limit for one fuzzed example (SIGALRM, main thread). Its exception is no OSError, so
no `except OSError` in memfit (where a TimeoutError would land) can turn a hang into a clean exit."""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class TookTooLong(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum, frame):
        raise TookTooLong(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
