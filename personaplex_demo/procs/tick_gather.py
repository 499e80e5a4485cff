"""A client process's callers' audio for one engine, held until just before the engine's next tick and sent
together (docs/processes.md § Audio in tick-sized batches).

Sent as it arrived, every 40 ms packet of every caller woke this process's channel writer and the engine
process's channel reader. Held to the tick, one batch a tick carries them all, and every packet still reaches
the engine before the tick that takes it: the engine says when its next tick is planned with each output
(`messages.Out.next_in`), and a packet that comes too close to it goes at once. How long each piece was held
travels with it (`messages.Push.held`), so that the engine's packet ages, which set its tick's phase
(serving/pacing.py `PhaseAligner`), are those of the packets' arrival here."""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable

import numpy as np

from . import messages as msg

# Seconds before the planned tick a batch leaves: the tick's phase moving by up to 5 ms a tick
# (serving/pacing.py `TickPacer.move_per_step`), two threads' wake-ups and the socket; the loop's
# own lateness, as measured, comes on top.
LEAD = 0.015
STALE = 0.2  # a plan heard longer ago than this says nothing (the engine idle, stalled, or gone)
LATENESS_KEPT = 25  # batches whose timer's lateness sets the lead (2 s of ticks)


class TickGather:
    """One engine's share of the callers' audio on one event loop (`loop`), or none before the first call.
    `send` queues messages to go out together; everything else runs on the loop."""

    def __init__(self, send: Callable[[list[msg.Push]], None], tick: float, lead: float = LEAD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._clock = clock
        self.tick = tick
        self.least_lead = lead
        self.loop: asyncio.AbstractEventLoop | None = None  # the calls' loop, from the first call on
        self._planned: float | None = None  # the engine's next tick, on this process's clock
        self._plan_tick = -1  # the tick whose outputs said so (an older one's say is out of date)
        self._heard = -math.inf  # when that plan came
        self._held: list[tuple[float, int, np.ndarray]] = []  # (arrival, rid, samples), in order of arrival
        self._timer: asyncio.TimerHandle | None = None
        self._leaves = math.inf  # when the armed timer sends what is held
        self._lateness: collections.deque[float] = collections.deque(maxlen=LATENESS_KEPT)
        self.batches = 0  # batches sent at a planned time (the others went as they came)

    @property
    def lead(self) -> float:
        """How long before the planned tick a batch leaves: the least lead, and the loop's recent lateness."""
        return min(self.least_lead + max(self._lateness, default=0.0), self.tick / 2)

    def plan(self, next_in: float | None, heard: float, tick: int) -> None:
        """Tick `tick`'s output, heard at `heard` (on `clock`), said the engine's next tick comes `next_in` s
        after it left (None: it did not say)."""
        if next_in is None or tick < self._plan_tick:
            return
        self._plan_tick, self._heard = tick, heard
        # Due already when it left (a step that overran, a slow relay): no plan to go by until the next.
        self._planned = heard + next_in if next_in > 0 else None
        # The tick came forward (its phase follows the packets): what is held must leave earlier too.
        if self._timer is not None and self._planned is not None and self._planned - self.lead < self._leaves - 0.001:
            self._arm(self._planned - self.lead)

    def push(self, rid: int, samples: np.ndarray, now: float) -> None:
        """Hold `samples` for the engine's next tick, or send them now (with what is held) when that
        tick is too close, or nobody knows when it comes."""
        self._held.append((now, rid, samples))
        due = self._next_tick(now)
        lead = self.lead
        if due is None or self.loop is None or now >= due - lead:
            self.flush(now)
        elif self._timer is None:
            self._arm(due - lead)

    def forget(self, rid: int) -> None:
        """The call ended: its held audio has nobody to hear it."""
        self._held = [h for h in self._held if h[1] != rid]

    def flush(self, now: float | None = None) -> None:
        """Send everything held, in order of arrival, each piece with the time it was held."""
        self._disarm()
        if not self._held:
            return
        now = self._clock() if now is None else now
        held, self._held = self._held, []
        self._send([msg.Push(rid, samples, max(0.0, now - arrived)) for arrived, rid, samples in held])

    def close(self) -> None:
        """Nothing more goes: the link closed."""
        self._disarm()
        self._held = []

    def _next_tick(self, now: float) -> float | None:
        """The engine's first tick after `now` on the last plan heard, or None when none is fresh."""
        if self._planned is None or now - self._heard > STALE:
            return None
        due = self._planned
        if now >= due:  # that tick has come and its outputs are on their way: the one after it
            due += self.tick * math.ceil((now - due) / self.tick)
        return due

    def _arm(self, when: float) -> None:
        """Send what is held at `when` (on `clock`, which the loop's need not be)."""
        self._disarm()
        self._leaves = when
        self._timer = self.loop.call_later(max(0.0, when - self._clock()), self._due)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._leaves = None, math.inf

    def _due(self) -> None:
        now = self._clock()
        self._lateness.append(max(0.0, now - self._leaves))
        self._timer, self._leaves = None, math.inf
        if self._held:
            self.batches += 1
            self.flush(now)
