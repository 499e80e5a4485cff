"""When the slot pool's ticker steps: one step per tick, on a schedule of deadlines.

Each step is due one tick after the previous deadline. After an overrun the ticker catches up
with steps at least `catch_up_gap` apart (no back-to-back burst), which also drains the input
that piled up meanwhile. Further behind than `resync_after`, the schedule restarts from now and
the pool cuts every caller's backlog, so that nobody stays seconds behind. A tick that stepped
nobody (no call was live yet) keeps no schedule: the next one comes `idle_gap` later, so a call
that has just gone live takes its first step at once rather than a whole tick later.
"""

from __future__ import annotations

from typing import NamedTuple

from .clock import Clock


class Lateness(NamedTuple):
    seconds: float  # after the deadline the step finished; <= 0: on time
    resync: bool  # so late that the schedule restarted from now


class TickPacer:
    def __init__(self, clock: Clock, tick: float, catch_up_gap: float, resync_after: float,
                 idle_gap: float = 0.02) -> None:
        self.clock = clock
        self.tick = tick
        self.catch_up_gap = catch_up_gap
        self.resync_after = resync_after
        self.idle_gap = idle_gap
        self._deadline: float | None = None
        self._last_start: float | None = None

    def stop(self) -> None:
        """Nothing to step: the next step starts a fresh schedule."""
        self._deadline = self._last_start = None

    def wait(self) -> None:
        """Sleep until the next step is due."""
        now = self.clock.monotonic()
        if self._deadline is None:
            self._deadline = now
        due = self._deadline if self._last_start is None else max(self._deadline,
                                                                     self._last_start + self.catch_up_gap)
        if now < due:
            self.clock.sleep(due - now)
        self._last_start = self.clock.monotonic()

    def stepped(self, rows: int = 1) -> Lateness:
        """The step that `wait` let start has finished, having stepped `rows` calls: move the
        deadline on by one tick (by `idle_gap` from now when it stepped nobody)."""
        assert self._deadline is not None, "stepped() without wait()"
        if not rows:
            self._deadline, self._last_start = self.clock.monotonic() + self.idle_gap, None
            return Lateness(0.0, False)
        self._deadline += self.tick
        late = self.clock.monotonic() - self._deadline
        resync = late > self.resync_after
        if resync:
            self._deadline = self.clock.monotonic()
        return Lateness(late, resync)
