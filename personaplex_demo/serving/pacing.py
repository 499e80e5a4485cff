"""When the slot pool's ticker steps: one step per tick, on a schedule of deadlines, with catch-up
steps after an overrun and a resync when far behind (docs/serving.md § Pacing). The schedule's phase
follows the callers' packets (`PhaseAligner`; docs/serving.md § Latency budget). The ticker reads and
sleeps on a `Clock`: a seam for tests (tests/support/fake_clock.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol


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


class Lateness(NamedTuple):
    seconds: float  # after the deadline the step finished; <= 0: on time
    resync: bool  # so late that the schedule restarted from now


class TickPacer:
    def __init__(self, clock: Clock, tick: float, catch_up_gap: float, resync_after: float,
                 idle_gap: float = 0.02, move_per_step: float = 0.005) -> None:
        self.clock = clock
        self.tick = tick
        self.catch_up_gap = catch_up_gap
        self.resync_after = resync_after
        self.idle_gap = idle_gap
        # A move of the phase is spread over steps, this much each: a client that times its audio by
        # the plan of the step before (procs/tick_gather.py) is never later than this.
        self.move_per_step = move_per_step
        self._deadline: float | None = None
        self._last_start: float | None = None
        self._advance = 0.0  # seconds still to bring the schedule forward (`follow`), a share a step
        self.aligner = PhaseAligner()

    def stop(self) -> None:
        """Nothing to step: the next step starts a fresh schedule."""
        self._deadline = self._last_start = None
        self._advance = 0.0

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

    def follow(self, ages: dict[str, float]) -> None:
        """This tick's packet ages (`PhaseAligner.observe`): the next steps may come earlier (the phase
        moves, not the rate), never before the current step has finished: moving the phase is no overrun."""
        self._advance += max(0.0, self.aligner.observe(ages))

    def planned(self) -> float | None:
        """When the next step is due as `follow` left the schedule, a catch-up step's gap included (None
        before the first `wait`): a step that overruns moves it later, never earlier."""
        if self._deadline is None:
            return None
        due = self._deadline + self.tick - min(self._advance, self.move_per_step)
        return due if self._last_start is None else max(due, self._last_start + self.catch_up_gap)

    def stepped(self, rows: int = 1) -> Lateness:
        """The step that `wait` let start has finished, having stepped `rows` calls: move the
        deadline on by one tick (by `idle_gap` from now when it stepped nobody)."""
        assert self._deadline is not None, "stepped() without wait()"
        if not rows:
            self._deadline, self._last_start, self._advance = self.clock.monotonic() + self.idle_gap, None, 0.0
            return Lateness(0.0, False)
        self._deadline += self.tick
        if self._advance:
            share = min(self._advance, self.move_per_step)
            self._deadline = max(self._deadline - share, self.clock.monotonic())
            self._advance -= share
        late = self.clock.monotonic() - self._deadline
        resync = late > self.resync_after
        if resync:
            self._deadline = self.clock.monotonic()
        return Lateness(late, resync)


class PhaseAligner:
    """How far to bring the next tick forward so that it comes right after the live callers' packets,
    fed each tick's packet ages (call id -> how long its newest audio had been in the room).

    A caller whose audio the room itself paces shows the same age however the tick moves; after a
    move, a call whose youngest age did not drop by about as much is left out (`followers`), or it
    would pull the tick forward window after window: a room that runs fast."""

    def __init__(self, window_ticks: int = 25, guard: float = 0.005, least: float = 0.002,
                 most: float = 0.04) -> None:
        self.window_ticks = window_ticks  # ticks over which the youngest packet age is taken (2 s)
        self.guard = guard  # the least age kept: jitter of the packets and of the ticker's wake-up
        self.least = least  # smaller moves are not worth a tick out of step
        self.most = most  # one packet's spacing: beyond it the previous packet would do as well
        self._youngest: dict[str, float] = {}  # this window's youngest age of each call
        self._before: dict[str, float] = {}  # ...and of the window before the last move
        self._last_move = 0.0
        self._ticks = 0
        self._settle = 0  # ticks right after a move, not counted: a follower has not followed yet
        self.followers: set[str] = set()  # calls whose audio follows the room's ticks
        self.moved = 0.0  # seconds brought forward in all

    def observe(self, ages: dict[str, float]) -> float:
        """One tick's packet ages; the seconds to bring the next tick forward (0.0: none)."""
        if not ages:  # nobody's audio to follow: start over
            self._youngest, self._before, self._last_move, self._ticks = {}, {}, 0.0, 0
            return 0.0
        if self._settle:
            self._settle -= 1
            return 0.0
        for call, age in ages.items():
            self._youngest[call] = min(age, self._youngest.get(call, age))
        self._ticks += 1
        if self._ticks < self.window_ticks:
            return 0.0
        window, self._youngest, self._ticks = self._youngest, {}, 0
        if self._last_move >= 2 * self.least:  # who moved with the tick last time?
            self.followers |= {c for c, age in window.items()
                               if c in self._before and self._before[c] - age < self._last_move / 2}
        self.followers &= set(window)  # calls that ended are forgotten
        free = [age for c, age in window.items() if c not in self.followers]
        spare = min(free) - self.guard if free else 0.0
        self._before, self._last_move = window, (min(spare, self.most) if spare >= self.least else 0.0)
        self.moved += self._last_move
        self._settle = 2 if self._last_move else 0
        return self._last_move
