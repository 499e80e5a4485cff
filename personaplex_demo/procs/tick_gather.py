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
import math
import time
from collections.abc import Callable

import numpy as np

from . import messages as msg

LEAD = 0.015  # seconds before the planned tick a batch leaves: the loop's lag, two threads' wake-ups, the socket
STALE = 0.2  # a plan heard longer ago than this says nothing (the engine idle, stalled, or its tick moved)


class TickGather:
    """One engine's share of the callers' audio on one event loop (`loop`), or none before the first call.
    `send` queues messages to go out together; everything else runs on the loop."""

    def __init__(self, send: Callable[[list[msg.Push]], None], tick: float, lead: float = LEAD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._clock = clock
        self.tick = tick
        self.lead = lead
        self.loop: asyncio.AbstractEventLoop | None = None  # the calls' loop, from the first call on
        self._planned: float | None = None  # the engine's next tick, on this process's clock
        self._heard = -math.inf  # when that plan came
        self._held: list[tuple[float, int, np.ndarray]] = []  # (arrival, rid, samples), in order of arrival
        self._timer: asyncio.TimerHandle | None = None
        self._leaves = math.inf  # when the armed timer sends what is held
        self.batches = 0  # batches sent at a planned time (the others went as they came)

    def plan(self, next_in: float | None, heard: float) -> None:
        """An output heard at `heard` (on `clock`) said the engine's next tick comes `next_in` s after
        it left (None: it did not say)."""
        if next_in is None:
            return
        self._planned, self._heard = heard + next_in, heard
        # The tick came forward (its phase follows the packets): what is held must leave earlier too.
        if self._timer is not None and self._planned - self.lead < self._leaves - 0.001:
            self._arm(self._planned - self.lead)

    def push(self, rid: int, samples: np.ndarray, now: float) -> None:
        """Hold `samples` for the engine's next tick, or send them now (with what is held) when that
        tick is too close, or nobody knows when it comes."""
        self._held.append((now, rid, samples))
        due = self._next_tick(now)
        if due is None or self.loop is None or now >= due - self.lead:
            self.flush(now)
        elif self._timer is None:
            self._arm(due - self.lead)

    def forget(self, rid: int) -> None:
        """The call ended: its held audio has nobody to hear it."""
        self._held = [h for h in self._held if h[1] != rid]

    def flush(self, now: float | None = None) -> None:
        """Send everything held, in order of arrival, each piece with the time it was held."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._leaves = None, math.inf
        if not self._held:
            return
        now = self._clock() if now is None else now
        held, self._held = self._held, []
        self._send([msg.Push(rid, samples, max(0.0, now - arrived)) for arrived, rid, samples in held])

    def close(self) -> None:
        """Nothing more goes: the link closed."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._leaves = None, math.inf
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
        if self._timer is not None:
            self._timer.cancel()
        self._leaves = when
        self._timer = self.loop.call_later(max(0.0, when - self._clock()), self._due)

    def _due(self) -> None:
        self._timer, self._leaves = None, math.inf
        self.batches += 1
        self.flush()
