"""A clock for the slot pool whose time moves only when told."""

from __future__ import annotations

import threading


class FakeClock:
    """Time moves only when told: `sleep` and `advance` add to `now` at once.

    A ticker driven by this clock runs as fast as the CPU allows, yet every time it reads is exact,
    so cadence, idle release and time limits can be checked to the millisecond."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self.sleeps: list[float] = []  # every sleep requested, in order, for pacing tests

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            if seconds > 0:
                self._now += seconds

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
