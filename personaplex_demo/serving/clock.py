"""The clock the SlotPool ticker reads and sleeps on: a seam for tests (tests/support/fake_clock.py)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block the calling thread for `seconds` of this clock."""
        ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
